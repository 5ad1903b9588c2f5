"""Target: eager PyTorch CPU training-step time, polyamp against torch.autocast + torch.amp.GradScaler.

One iteration = zero_grad, forward under the region (4 x (Linear + LayerNorm + GELU), cross-entropy),
scaled backward, step, update. float16 compute. Variants, built from identical initial weights and timed in
interleaved rounds in one process:

* ``native``: ``torch.autocast("cpu", dtype=torch.float16)`` + ``torch.amp.GradScaler("cpu")``;
* ``native again (A/A)``: a second native step, built the same way from the same weights: the ratio two
  identical steps show, i.e. what this machine's noise and the steps' memory placement alone give;
* ``polyamp``: ``polyamp_torch.autocast("mixed_float16")`` (default ``cpu_float32_ops=True``: CUDA's float32
  op list, via kernels at the AutocastCPU dispatch key) + ``polyamp.LossScaler()``;
* ``native + LayerNorm input cast by hand``: native, with ``.float()`` written before each LayerNorm: the
  float32 work CUDA's classification implies, with no mechanism at all (the floor for the polyamp column);
* ``polyamp region + GradScaler``: polyamp's region with torch's scaler, the region's cost alone;
* ``polyamp, torch CPU lists``: polyamp with ``cpu_float32_ops=False``;
* ``polyamp, function mode (previous)``: torch's CPU lists plus the TorchFunctionMode polyamp used before
  (benchmarks/_alternatives.py), i.e. the earlier implementation of the same semantics.

The polyamp and function-mode variants run LayerNorm in float32 (as CUDA autocast does), native runs it in
float16: different, more precise work. Before timing, the run checks that each variant produces the
dtypes it claims.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

import polyamp
import polyamp_torch
from benchmarks import _common
from benchmarks._alternatives import FunctionModeFloat32Ops
from polyamp_torch import _cpu_float32

HAND_CAST = "native + LayerNorm input cast by hand"
AGAIN = "native again (A/A)"
NATIVE = ("native", AGAIN, HAND_CAST)
VARIANTS = (
    "native",
    AGAIN,
    HAND_CAST,
    "polyamp",
    "polyamp region + GradScaler",
    "polyamp, torch CPU lists",
    "polyamp, function mode (previous)",
)
#: The variants whose ratio intervals are reported.
INTERVALS = (AGAIN, "polyamp, torch CPU lists", "polyamp")
OPTIMIZERS = ("sgd", "adam", "adam_fused")
OPTIMIZER_NAMES = {"sgd": "SGD momentum", "adam": "Adam", "adam_fused": "Adam fused"}


class CastToFloat32(torch.nn.Module):
    """``module(x.float())``: CUDA autocast's float32 rule for LayerNorm, written out by hand."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.float())  # type: ignore[no-any-return]


def build(
    width: int, depth: int, optimizer: str, hand_cast: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The MLP (same initial weights every call) and its optimizer."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        norm: torch.nn.Module = torch.nn.LayerNorm(width)
        layers += [torch.nn.Linear(width, width), CastToFloat32(norm) if hand_cast else norm, torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    if optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if optimizer == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)


def region_factory(variant: str) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A callable returning a fresh autocast region of the variant."""
    if variant in NATIVE:
        return lambda: torch.autocast("cpu", dtype=torch.float16)
    if variant in ("polyamp", "polyamp region + GradScaler"):
        return lambda: polyamp_torch.autocast("mixed_float16", device_type="cpu")
    if variant == "polyamp, torch CPU lists":
        return lambda: polyamp_torch.autocast("mixed_float16", device_type="cpu", cpu_float32_ops=False)

    @contextlib.contextmanager
    def function_mode() -> Iterator[None]:
        with polyamp_torch.autocast("mixed_float16", device_type="cpu", cpu_float32_ops=False):
            with FunctionModeFloat32Ops():
                yield

    return function_mode


def make_step(variant: str, width: int, depth: int, optimizer: str, x: torch.Tensor, y: torch.Tensor) -> Any:
    """One training iteration of the variant, as a closure; also returns the model (for dtype checks)."""
    model, opt = build(width, depth, optimizer, hand_cast=variant == HAND_CAST)
    region = region_factory(variant)
    native_scaler = variant in (*NATIVE, "polyamp region + GradScaler")
    scaler: Any = torch.amp.GradScaler("cpu") if native_scaler else polyamp.LossScaler(enabled=True)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with region():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step, model


def norm_dtype(variant: str, model: torch.nn.Module, x: torch.Tensor) -> str:
    """The dtype the first LayerNorm produces under the variant's region."""
    seen: list[torch.dtype] = []
    norm = list(model.children())[1]
    handle = norm.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        with torch.no_grad(), region_factory(variant)():
            model(x)
    finally:
        handle.remove()
    return str(seen[0]).replace("torch.", "")


def prepare_variants(variants: list[str]) -> dict[str, Callable[[], None]]:
    """Before each block: polyamp's AutocastCPU kernels installed for the variants that use them, removed
    for the others, so that native and torch-list runs see torch exactly as a process that never entered
    a polyamp float32 region does (a listed op costs a redispatch there once the kernels exist)."""
    uses_kernels = ("polyamp", "polyamp region + GradScaler")
    return {name: _cpu_float32._install if name in uses_kernels else _cpu_float32._uninstall for name in variants}


def calibrate(step: Callable[[], None], seconds: float) -> int:
    """Iterations per round so that one round of one variant takes about ``seconds``."""
    import time

    step()
    start = time.perf_counter()
    step()
    elapsed = max(time.perf_counter() - start, 1e-6)
    return max(1, math.ceil(seconds / elapsed))


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.clock == "cpu":
        args.threads = 1  # thread_time sees this thread only: torch must not compute on others
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = [(16, 8, 2)] if args.quick else [(64, 32, 4), (512, 64, 4)]
    if args.widths:
        configs = [(int(w), 32 if int(w) <= 64 else 64, 4) for w in args.widths.split(",")]
    optimizers = args.optimizers.split(",") if args.optimizers else list(OPTIMIZERS)
    variants = list(VARIANTS)
    rounds = 2 if args.quick else args.rounds
    rows: list[list[str]] = []
    interval_rows: list[list[str]] = []
    raw: list[dict[str, Any]] = []
    for width, batch, depth in configs:
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(batch, width, generator=generator)
        y = torch.randint(0, width, (batch,), generator=generator)
        for optimizer in optimizers:
            steps = {}
            dtypes = {}
            for variant in variants:
                steps[variant], model = make_step(variant, width, depth, optimizer, x, y)
                dtypes[variant] = norm_dtype(variant, model, x)
            assert dtypes["native"] == dtypes[AGAIN] == dtypes["polyamp, torch CPU lists"] == "float16", dtypes
            assert dtypes["polyamp"] == dtypes["polyamp, function mode (previous)"] == "float32", dtypes
            assert dtypes["polyamp region + GradScaler"] == dtypes[HAND_CAST] == "float32", dtypes
            _cpu_float32._uninstall()
            iters = 1 if args.quick else calibrate(steps["native"], args.round_seconds)
            times = _common.interleaved(
                steps,
                iters=iters,
                rounds=rounds,
                warmup=1 if args.quick else 5,
                clock=_common.CLOCKS[args.clock],
                prepare=prepare_variants(variants),
            )
            summary = _common.summarize(times, "native")
            label = f"{depth} x (Linear {width} + LayerNorm + GELU), batch {batch}"
            rows.append(
                [
                    label if optimizer == optimizers[0] else "",
                    OPTIMIZER_NAMES[optimizer],
                    _common.fmt_ms(summary["native"]["median_ms"]),
                    *(_common.fmt_ratio(summary[v]["ratio"]) for v in variants[1:]),
                ]
            )
            interval_rows.append(
                [
                    label if optimizer == optimizers[0] else "",
                    OPTIMIZER_NAMES[optimizer],
                    *_common.fmt_intervals(summary, INTERVALS),
                ]
            )
            raw.append(
                {
                    "width": width,
                    "batch": batch,
                    "depth": depth,
                    "optimizer": optimizer,
                    "iters_per_round": iters,
                    "rounds": rounds,
                    "layer_norm_dtype": dtypes,
                    "summary": summary,
                    "times_ms": times,
                }
            )
            print(label, optimizer, {v: round(s["ratio"], 3) for v, s in summary.items()}, flush=True)
    columns = ["model", "optimizer", "native ms", *variants[1:]]
    env = _common.environment("cpu", threads=torch.get_num_threads())
    notes = [
        "Ratios: median over interleaved rounds of (variant's ms/iteration / native's in the same round), "
        f"{rounds} rounds; the JSON also has each round's times, the ratio of medians and of minima. Clock: "
        + ("CPU time of the (single) computing thread." if args.clock == "cpu" else "wall time."),
        "polyamp's AutocastCPU kernels are installed before each polyamp block and removed before the others: "
        "native and torch-list variants run as in a process that never entered a polyamp float32 region.",
        "LayerNorm output dtype per variant: native float16; hand cast, polyamp, polyamp region and function mode "
        "float32 (CUDA autocast's classification); torch CPU lists float16 (checked before timing).",
        f"{AGAIN}: a second native step built like the first; its ratio is what two identical steps differ by in "
        "this run (noise and memory placement). A ratio is 1.00x within noise when its interval overlaps the A/A "
        "interval.",
    ]
    return _common.result(
        "torch-cpu",
        "PyTorch eager CPU training step: polyamp vs torch.autocast + GradScaler",
        quick=args.quick,
        env=env,
        tables=[
            {"caption": "float16 compute, cross-entropy loss", "columns": columns, "rows": rows},
            {
                "caption": "95% bootstrap intervals of the median ratios above (2000 resamplings of the rounds)",
                "columns": ["model", "optimizer", *INTERVALS],
                "rows": interval_rows,
            },
        ],
        notes=notes,
        raw=raw,
    )
