"""CUDA targets: host-device syncs, CUDA-graph capture, the AMP recipe (eager, compiled, bfloat16).

They need a CUDA device (benchmarks/gpu_suite.sh runs them all there). ``--device cpu --quick`` runs the
same code at toy sizes on CPU, only to check that it works; the sync counts and graph capture then
read "n/a on cpu".

* ``gpu-syncs``: host-device synchronisations per training step, counted with
  ``torch.cuda.set_sync_debug_mode("warn")`` (one warning per synchronising call), for GradScaler and
  polyamp's scaler, per optimizer.
* ``gpu-cuda-graph``: a whole training step (forward, scaled backward, Adam step, scaler update; fused Adam,
  and foreach Adam with ``skip_on_device=True``) captured in a ``torch.cuda.CUDAGraph``; whether capture works,
  replay vs eager time, and whether N replays leave the parameters bitwise equal to N eager steps.
* ``gpu-recipe``: the PyTorch AMP recipe's model (3 x Linear 4096 + ReLU, batch 512, MSE, SGD): float32,
  torch.autocast + GradScaler, polyamp; ms per iteration and the peak memory of a step above the resident
  parameters (``torch.cuda.max_memory_allocated`` minus what was allocated before the step, with no
  variant holding gradients).
* ``gpu-compiled``: the same, forward and loss under ``torch.compile``.
* ``gpu-bf16``: the same in bfloat16 without a scaler (polyamp's LossScaler() is off under mixed_bfloat16).
"""

from __future__ import annotations

import argparse
import functools
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch

import polyamp
import polyamp_torch
from benchmarks import _common

_CUDA = torch.cuda.is_available()  # (capturable optimizers run on CUDA only; --quick on a CPU drops it)
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD (foreach)": lambda p: torch.optim.SGD(p, lr=1e-3, foreach=True),
    "SGD momentum (for-loop)": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=False),
    "SGD momentum (foreach)": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=True),
    "SGD fused": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, fused=True),
    "Adam (for-loop)": lambda p: torch.optim.Adam(p, lr=1e-4, foreach=False),
    "Adam (foreach)": lambda p: torch.optim.Adam(p, lr=1e-4, foreach=True),
    "Adam fused": lambda p: torch.optim.Adam(p, lr=1e-4, fused=True),
    "Adam (foreach, capturable)": lambda p: torch.optim.Adam(p, lr=1e-4, foreach=True, capturable=_CUDA),
    "AdamW (foreach)": lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
    "AdamW (for-loop, capturable)": lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=False, capturable=_CUDA),
    "AdamW fused": lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
}


def _mlp(size: int, layers: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    modules: list[torch.nn.Module] = []
    for _ in range(layers - 1):
        modules += [torch.nn.Linear(size, size), torch.nn.ReLU()]
    modules.append(torch.nn.Linear(size, size))
    return torch.nn.Sequential(*modules).to(device)


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _env(args: argparse.Namespace) -> dict[str, Any]:
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    return _common.environment(args.device, threads=torch.get_num_threads(), accelerator=name)


# -- host-device syncs -----------------------------------------------------------------------------------


def _train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: Any, region: Callable[[], Any], x: Any, y: Any
) -> None:
    opt.zero_grad(set_to_none=True)
    with region():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def _scaler_and_region(kind: str, device: str, dtype: str = "float16") -> tuple[Any, Callable[[], Any]]:
    """GradScaler + torch.autocast, or polyamp's LossScaler() (``"polyamp-device"``: with
    ``skip_on_device=True``) + autocast for the matching policy."""
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    if kind == "native":
        scaler = torch.amp.GradScaler(device, enabled=dtype == "float16")
        return scaler, lambda: torch.autocast(device, dtype=torch_dtype)
    policy = "mixed_float16" if dtype == "float16" else "mixed_bfloat16"
    with polyamp.policy_scope(policy):  # LossScaler() scales under mixed_float16, not under mixed_bfloat16
        ours = polyamp.LossScaler(backend="torch", skip_on_device=kind == "polyamp-device")
    return ours, lambda: polyamp_torch.autocast(policy, device_type=device)


def syncs(args: argparse.Namespace) -> dict[str, Any]:
    """Per optimizer: float16 with loss scaling (GradScaler vs polyamp), and bfloat16, where GradScaler is off
    (torch's recipe) and polyamp's scaler guards (checks the gradients, skips a non-finite step)."""
    device = args.device
    size, batch, steps = (16, 4, 3) if args.quick else (1024, 64, 20)
    x = torch.randn(batch, size, device=device)
    y = torch.randn(batch, size, device=device)
    tables = []
    raw: dict[str, dict[str, dict[str, float | None]]] = {}
    for dtype, columns in (
        ("float16", ["GradScaler syncs/step", "polyamp syncs/step", "polyamp skip_on_device syncs/step"]),
        (
            "bfloat16",
            [
                "plain torch (GradScaler off) syncs/step",
                "polyamp guard syncs/step",
                "polyamp guard, skip_on_device syncs/step",
            ],
        ),
    ):
        rows = []
        raw[dtype] = {}
        for name, make in OPTIMIZERS.items():
            counts: dict[str, float | None] = {}
            for kind in ("native", "polyamp", "polyamp-device"):
                model = _mlp(size, 3, device)
                opt = make(model.parameters())
                scaler, region = _scaler_and_region(kind, device, dtype)
                for _ in range(3):  # lazy state (scale tensor, optimizer state) is created outside the count
                    _train_step(model, opt, scaler, region, x, y)
                _sync(device)()
                if device != "cuda":
                    counts[kind] = None
                    continue
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        for _ in range(steps):
                            _train_step(model, opt, scaler, region, x, y)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                found = [w for w in caught if "synchroniz" in str(w.message).lower()]
                counts[kind] = len(found) / steps
            raw[dtype][name] = counts
            rows.append([name, *("n/a on cpu" if c is None else f"{c:g}" for c in counts.values())])
        caption = f"3 x Linear {size}, batch {batch}, {dtype} autocast, {steps} counted steps"
        tables.append({"caption": caption, "columns": ["optimizer", *columns], "rows": rows})
    return _common.result(
        "gpu-syncs",
        "Host-device synchronisations per training step (torch.cuda.set_sync_debug_mode)",
        quick=args.quick,
        env=_env(args),
        tables=tables,
        notes=[
            "Counted: warnings torch emits for synchronising calls in 'warn' sync-debug mode.",
            "bfloat16: the guard reads its found-inf flag to the host with a non-fused optimizer (to decide the "
            "step, as GradScaler does under float16) and never with a fused one, which skips on the device.",
            "skip_on_device: LossScaler(skip_on_device=True) steps a non-fused SGD, Adam or AdamW and restores a "
            "skipped step on the device; Adam and AdamW without capturable=True keep their step counts on the "
            "CPU, so their steps are still decided on the host.",
        ],
        raw=raw,
    )


# -- CUDA graph capture ----------------------------------------------------------------------------------


def cuda_graph(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    size, batch, replays = (16, 4, 3) if args.quick else (1024, 64, 50)
    x = torch.randn(batch, size, device=device)
    y = torch.randn(batch, size, device=device)
    rows = []
    raw: dict[str, Any] = {}
    # Fused Adam skips on the device for both scalers. Foreach Adam: polyamp's skip_on_device=True steps it and
    # restores a skipped step on the device; GradScaler reads found_inf to the host, which capture refuses (last,
    # since a refused capture can leave the stream unusable for what follows).
    variants = (("native", "fused"), ("polyamp", "fused"), ("polyamp-device", "foreach"), ("native", "foreach"))
    for kind, form in variants:
        label = f"{kind} ({form} Adam)"

        def fresh(
            kind: str = kind, form: str = form
        ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Callable[[], Any]]:
            model = _mlp(size, 3, device)
            capturable: dict[str, Any] = {"capturable": True} if device == "cuda" else {}
            opt = torch.optim.Adam(model.parameters(), lr=1e-4, **{form: True}, **capturable)
            scaler, region = _scaler_and_region(kind, device)
            return model, opt, scaler, region

        # Reference: eager steps.
        model, opt, scaler, region = fresh()
        for _ in range(3 + replays):
            _train_step(model, opt, scaler, region, x, y)
        _sync(device)()
        eager_params = [p.detach().clone() for p in model.parameters()]
        eager_ms = _common.interleaved(
            {"eager": functools.partial(_train_step, model, opt, scaler, region, x, y)},
            iters=replays,
            rounds=1 if args.quick else args.rounds,
            warmup=0,
            sync=_sync(device),
        )["eager"]
        if device != "cuda":
            rows.append([label, "n/a on cpu", "", _common.fmt_ms(min(eager_ms)), ""])
            continue
        model, opt, scaler, region = fresh()
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up on a side stream, as torch's whole-network capture recipe does
                _train_step(model, opt, scaler, region, x, y)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                with region():
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        except Exception as exc:  # report why capture failed, keep going
            rows.append([label, f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", "", "", ""])
            raw[label] = {"captured": False, "error": repr(exc)}
            continue
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        equal = all(torch.equal(a, b) for a, b in zip(eager_params, model.parameters(), strict=True))
        replay_ms = _common.interleaved(
            {"replay": graph.replay},
            iters=replays,
            rounds=1 if args.quick else args.rounds,
            warmup=0,
            sync=torch.cuda.synchronize,
        )["replay"]
        rows.append(
            [
                label,
                "yes",
                _common.fmt_ms(min(replay_ms)),
                _common.fmt_ms(min(eager_ms)),
                "yes" if equal else "no",
            ]
        )
        raw[label] = {"captured": True, "replay_ms": replay_ms, "eager_ms": eager_ms, "bitwise_equal": equal}
    return _common.result(
        "gpu-cuda-graph",
        "CUDA-graph capture of a training step with capturable Adam, fused and foreach",
        quick=args.quick,
        env=_env(args),
        tables=[
            {
                "caption": f"3 x Linear {size}, batch {batch}, float16 autocast, Adam(capturable=True)",
                "columns": ["scaler", "captured", "replay ms (min)", "eager ms (min)", f"{replays} replays == eager"],
                "rows": rows,
            }
        ],
        raw=raw,
    )


# -- the AMP recipe --------------------------------------------------------------------------------------


def _recipe_step(opt: torch.optim.Optimizer, scaler: Any, compute: Callable[[], torch.Tensor]) -> None:
    opt.zero_grad(set_to_none=True)
    scaler.scale(compute()).backward()
    scaler.step(opt)
    scaler.update()


def recipe(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """``mode``: "eager", "compiled" (forward + loss under torch.compile) or "bf16" (no scaler)."""
    device = args.device
    size, batch, layers, iters = (32, 8, 3, 2) if args.quick else (4096, 512, 3, 20)
    x = torch.randn(batch, size, device=device)
    y = torch.randn(batch, size, device=device)
    dtype = "bfloat16" if mode == "bf16" else "float16"
    # polyamp-device: LossScaler(skip_on_device=True), no host read; its masked commit's copy is in the time and
    # in the peak memory.
    kinds = ("float32", "native", "polyamp", "polyamp-device")
    steps: dict[str, Callable[[], None]] = {}
    optimizers: list[torch.optim.Optimizer] = []
    for kind in kinds:
        model = _mlp(size, layers, device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        optimizers.append(opt)
        if kind == "float32":
            scaler: Any = torch.amp.GradScaler(device, enabled=False)
            region: Callable[[], Any] = lambda: torch.autocast(device, enabled=False)  # noqa: E731
        else:
            scaler, region = _scaler_and_region(kind, device, dtype)

        def forward_loss(model: Any = model, region: Any = region) -> torch.Tensor:
            with region():
                return torch.nn.functional.mse_loss(model(x).float(), y)

        compute = torch.compile(forward_loss) if mode == "compiled" else forward_loss

        steps[kind] = functools.partial(_recipe_step, opt, scaler, compute)
    peaks: dict[str, int | None] = {}
    for kind, step in steps.items():  # peak memory: each variant alone, after its warm-up
        for _ in range(2):
            step()
        for opt in optimizers:  # no variant's gradients held while another is measured
            opt.zero_grad(set_to_none=True)
        gc.collect()
        base = 0
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()  # every variant's parameters (and optimizer state)
            torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            step()
        peaks[kind] = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    times = _common.interleaved(
        steps, iters=iters, rounds=1 if args.quick else args.rounds, warmup=0, sync=_sync(device)
    )
    summary = _common.summarize(times, "native")
    rows = [
        [
            kind,
            _common.fmt_ms(summary[kind]["median_ms"]),
            _common.fmt_ratio(summary[kind]["ratio"]),
            _mib(peaks[kind]),
        ]
        for kind in kinds
    ]
    target = {"eager": "gpu-recipe", "compiled": "gpu-compiled", "bf16": "gpu-bf16"}[mode]
    title = {
        "eager": "AMP recipe: float32 vs torch.autocast + GradScaler vs polyamp (float16)",
        "compiled": "AMP recipe under torch.compile (forward + loss compiled)",
        "bf16": "AMP recipe in bfloat16, no loss scaling",
    }[mode]
    return _common.result(
        target,
        title,
        quick=args.quick,
        env=_env(args),
        tables=[
            {
                "caption": f"{layers} x Linear {size} (+ ReLU), batch {batch}, MSE, SGD; {dtype} compute",
                "columns": ["variant", "ms / iteration", "vs native", "step peak MiB above parameters"],
                "rows": rows,
            }
        ],
        raw={"summary": summary, "times_ms": times, "peak_bytes": peaks},
    )


def _mib(peak: int | None) -> str:
    return "n/a on cpu" if peak is None else f"{peak / 2**20:.0f}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"{args.target} needs a CUDA device (torch {torch.__version__} sees none); "
            "use --device cpu --quick only to smoke-test the code"
        )
    if args.target == "gpu-syncs":
        return syncs(args)
    if args.target == "gpu-cuda-graph":
        return cuda_graph(args)
    return recipe(args, {"gpu-recipe": "eager", "gpu-compiled": "compiled", "gpu-bf16": "bf16"}[args.target])
