"""Target: a whole PyTorch CPU training step under ``torch.compile``, polyamp against torch.autocast + GradScaler.

One iteration, all inside one compiled function: forward under the region (4 x (Linear 64 + LayerNorm +
GELU), cross-entropy, float16 compute), scaled backward, step, update, zero_grad. Variants, built from
identical initial weights:

* ``native``: ``torch.autocast("cpu", dtype=torch.float16)`` + ``torch.amp.GradScaler("cpu")``;
* ``polyamp``: ``polyamp_torch.autocast("mixed_float16", device_type="cpu")`` + ``polyamp.LossScaler()``;
* ``polyamp, torch CPU lists``: the same with ``cpu_float32_ops=False`` (torch's CPU op lists, native's work).

Per variant: the wall time of its first ``warmup`` calls (the compiles), the graphs dynamo compiled for it
(``torch._dynamo.utils.counters["stats"]["unique_graphs"]``), whether a frame reached dynamo's recompile
limit, and the steady-state time per step (median over interleaved rounds, and its ratio to native). Each
variant's step function gets a code object of its own, so the variants never share dynamo's caches for it
(polyamp's own frames, resumed after a graph break inside them, are shared by its two variants, as by any two
scalers in one process). The first variant compiled in the process also pays the compiler's start-up.
polyamp's region runs LayerNorm in float32 as CUDA's autocast does (native: float16), as in ``torch-cpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

import polyamp
import polyamp_torch
from benchmarks import _common

OPTIMIZERS = {
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "Adam fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
}
VARIANTS = ("native", "polyamp", "polyamp, torch CPU lists")


def _step(variant: str, optimizer: str, width: int, depth: int, x: Any, y: Any) -> Callable[[], None]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    opt = OPTIMIZERS[optimizer](model.parameters())
    if variant == "native":
        scaler: Any = torch.amp.GradScaler("cpu")
        region: Callable[[], Any] = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    else:
        scaler = polyamp.LossScaler()
        float32_ops = variant == "polyamp"
        region = lambda: polyamp_torch.autocast(  # noqa: E731
            "mixed_float16", device_type="cpu", cpu_float32_ops=float32_ops
        )

    def step() -> None:
        with region():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    # A code object of its own: dynamo keeps compiled code per code object, and the variants must not share it.
    return types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, None, step.__closure__)


@contextlib.contextmanager
def _limit_hits() -> Iterator[list[str]]:
    """Collects dynamo's "hit config.recompile_limit" warnings while open."""
    hits: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "recompile_limit" in record.getMessage():
                hits.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield hits
    finally:
        logger.removeHandler(handler)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    if args.clock == "cpu":
        args.threads = 1  # thread_time sees this thread only: torch must not compute on others
    if args.threads:
        torch.set_num_threads(args.threads)
    width, batch, depth = (16, 8, 2) if args.quick else (64, 32, 4)
    backend = "eager" if args.quick else args.backend
    warmup = 3 if args.quick else args.warmup
    rounds = 2 if args.quick else args.rounds
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=generator)
    y = torch.randint(0, width, (batch,), generator=generator)
    rows: list[list[str]] = []
    warm_rows: list[list[str]] = []
    raw = []
    for optimizer in OPTIMIZERS:
        torch._dynamo.reset()  # each optimizer's variants start from empty caches
        compiled: dict[str, Callable[[], None]] = {}
        warm: dict[str, dict[str, Any]] = {}
        for variant in VARIANTS:
            step = torch.compile(_step(variant, optimizer, width, depth, x, y), backend=backend)
            counters.clear()
            with _limit_hits() as hits:
                start = time.perf_counter()
                for _ in range(warmup):
                    step()
                seconds = time.perf_counter() - start
            warm[variant] = {
                "seconds": seconds,
                "graphs": int(counters["stats"]["unique_graphs"]),
                "limit_hits": len(hits),
            }
            compiled[variant] = step
            warm_rows.append(
                [
                    optimizer if variant == VARIANTS[0] else "",
                    variant,
                    f"{seconds:.2f}",
                    str(warm[variant]["graphs"]),
                    "yes" if hits else "no",
                ]
            )
        iters = 1 if args.quick else max(1, round(args.round_seconds / max(warm["native"]["seconds"] / warmup, 1e-4)))
        times = _common.interleaved(compiled, iters=iters, rounds=rounds, warmup=2, clock=_common.CLOCKS[args.clock])
        summary = _common.summarize(times, "native")
        rows.append(
            [
                optimizer,
                _common.fmt_ms(summary["native"]["median_ms"]),
                *(_common.fmt_ratio(summary[v]["ratio"]) for v in VARIANTS[1:]),
            ]
        )
        raw.append({"optimizer": optimizer, "warmup": warm, "summary": summary, "times_ms": times})
        print(optimizer, {v: (round(s["ratio"], 3), warm[v]) for v, s in summary.items()}, flush=True)
    return _common.result(
        "compiled",
        "PyTorch CPU training step under torch.compile: polyamp vs torch.autocast + GradScaler",
        quick=args.quick,
        env=_common.environment("cpu", threads=torch.get_num_threads()),
        tables=[
            {
                "caption": f"{depth} x (Linear {width} + LayerNorm + GELU), batch {batch}, float16 compute; the whole "
                f"step compiled (backend {backend!r}): time per step once compiled",
                "columns": ["optimizer", "native ms", *VARIANTS[1:]],
                "rows": rows,
            },
            {
                "caption": f"the same: the first {warmup} calls (the compiles)",
                "columns": ["optimizer", "variant", "seconds", "graphs compiled", "recompile limit hit"],
                "rows": warm_rows,
            },
        ],
        notes=[
            "Ratios: median over interleaved rounds of (variant's ms/step / native's in the same round), "
            f"{rounds} rounds; step times: "
            + ("CPU time of the (single) computing thread" if args.clock == "cpu" else "wall time")
            + "; the first calls: wall time.",
            "torch does not trace its own GradScaler (its calls run eagerly between graphs); polyamp's scale and "
            "step are traced and its update runs outside the trace (see the README's torch.compile paragraph).",
            "polyamp's region runs LayerNorm in float32 as CUDA's autocast does (native: float16), as in torch-cpu.",
        ],
        raw=raw,
    )
