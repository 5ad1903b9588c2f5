"""Target: how polyamp's per-step overhead grows with the model (CPU, eager, float16 compute, Adam).

Three sweeps, each variant timed in interleaved rounds against ``torch.autocast`` + ``GradScaler``:

* parameters: 4 x (Linear w + LayerNorm + GELU), w from 32 to 5000 (about 4.5e3 to 1e8 parameters, 16
  parameter tensors throughout), batch 16, as far as memory and ``--max-step-seconds`` allow;
* parameter tensors: width 16, depth 1 to 64 (4 to 256 parameter tensors; the number of listed ops per
  step, one LayerNorm per block, grows with it);
* the scaler alone, by parameters: ``scale`` + ``step`` + ``update`` of ``polyamp.LossScaler`` against
  ``GradScaler`` over the same 8 gradients of 4 x Linear w (the optimizer's own step a no-op, so what is timed is the
  scalers' work: the same fused unscale kernel, and each one's bookkeeping), with the Python function
  calls per iteration counted exactly (``sys.setprofile``): polyamp's overhead in microseconds, and the
  evidence that it does not grow with the parameter count.

Reported per size: native ms, polyamp ms, the difference (polyamp's overhead in ms) and the ratio. The
full run also draws step time against parameters, native and polyamp, as a PNG (matplotlib).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import polyamp
import polyamp_torch
from benchmarks import _common
from polyamp_torch import _cpu_float32

VARIANTS = ("native", "polyamp", "polyamp, torch CPU lists")
QUICK_WIDTHS = (8, 16)
WIDTHS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 5000)
DEPTHS = (1, 4, 16, 64)


def parameters(width: int, depth: int) -> int:
    return depth * (width * width + width + 2 * width)


def make_step(variant: str, width: int, depth: int, x: torch.Tensor, y: torch.Tensor) -> Any:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if variant == "native":
        scaler: Any = torch.amp.GradScaler("cpu")

        def region() -> Any:
            return torch.autocast("cpu", dtype=torch.float16)
    else:
        scaler = polyamp.LossScaler(enabled=True)
        float32_ops = variant == "polyamp"

        def region() -> Any:
            return polyamp_torch.autocast("mixed_float16", device_type="cpu", cpu_float32_ops=float32_ops)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with region():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure(width: int, depth: int, batch: int, rounds: int, quick: bool, clock: str = "wall") -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=generator)
    y = torch.randint(0, width, (batch,), generator=generator)
    steps = {variant: make_step(variant, width, depth, x, y) for variant in VARIANTS}
    _cpu_float32._uninstall()
    start = time.perf_counter()
    steps["native"]()
    steps["native"]()
    one = time.perf_counter() - start
    iters = 1 if quick else max(1, math.ceil(0.2 / max(one / 2, 1e-6)))
    prepare = {name: _cpu_float32._install if name == "polyamp" else _cpu_float32._uninstall for name in VARIANTS}
    times = _common.interleaved(
        steps, iters=iters, rounds=rounds, warmup=1 if quick else 2, clock=_common.CLOCKS[clock], prepare=prepare
    )
    summary = _common.summarize(times, "native")
    return {
        "width": width,
        "depth": depth,
        "batch": batch,
        "parameters": parameters(width, depth),
        "parameter_tensors": 4 * depth,
        "iters_per_round": iters,
        "rounds": rounds,
        "overhead_ms": summary["polyamp"]["median_ms"] - summary["native"]["median_ms"],
        "summary": summary,
        "times_ms": times,
    }


class _NoStep(torch.optim.SGD):
    """An optimizer whose step does nothing: timing a scaler's step then times the scaler."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def _scaler_iteration(variant: str, width: int) -> Any:
    """One ``scale`` + ``step`` + ``update`` of the variant's scaler over 4 x Linear w's gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    for param in model.parameters():
        param.grad = torch.full_like(param, 2.0**-20)  # finite at every scale: nothing is skipped
    opt = _NoStep(model.parameters(), lr=0.0)
    loss = torch.ones(())
    scaler: Any = torch.amp.GradScaler("cpu") if variant == "GradScaler" else polyamp.LossScaler(enabled=True)

    def iteration() -> None:
        scaler.scale(loss)
        scaler.step(opt)
        scaler.update()

    return iteration


def _python_calls(iteration: Any) -> int:
    """The Python functions (and builtins) one call of ``iteration`` runs, counted exactly."""
    for _ in range(300):  # past the first iterations' one-time work and a batch read of the records
        iteration()
    counted = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            counted[0] += 1

    sys.setprofile(count)
    try:
        iteration()
    finally:
        sys.setprofile(None)
    return counted[0] - 1  # less the setprofile call itself


SCALERS = ("GradScaler", "polyamp LossScaler")


def measure_scaler(width: int, rounds: int, quick: bool, clock: str) -> dict[str, Any]:
    steps = {variant: _scaler_iteration(variant, width) for variant in SCALERS}
    calls = {variant: _python_calls(step) for variant, step in steps.items()}
    start = time.perf_counter()
    steps["GradScaler"]()
    one = time.perf_counter() - start
    iters = 1 if quick else max(1, math.ceil(0.1 / max(one, 1e-6)))
    times = _common.interleaved(
        steps, iters=iters, rounds=rounds, warmup=1 if quick else 20, clock=_common.CLOCKS[clock]
    )
    summary = _common.summarize(times, "GradScaler")
    differences = _differences_us(times)
    return {
        "width": width,
        "parameters": scaler_parameters(width),
        "iters_per_round": iters,
        "rounds": rounds,
        "overhead_us": statistics.median(differences),
        "overhead_us_spread": [min(differences), max(differences)],
        "python_calls": calls,
        "summary": summary,
        "times_ms": times,
    }


def scaler_parameters(width: int) -> int:
    """Parameters of the scaler sweep's 4 x Linear w."""
    return 4 * (width * width + width)


def _differences_us(times: dict[str, list[float]]) -> list[float]:
    """polyamp's time minus GradScaler's in each round, in microseconds."""
    return [(ours - native) * 1e3 for ours, native in zip(times[SCALERS[1]], times[SCALERS[0]], strict=True)]


def _quartiles(measured: dict[str, Any]) -> tuple[float, float]:
    """The first and third quartiles of a scaler measurement's per-round differences, in microseconds."""
    differences = _differences_us(measured["times_ms"])
    if len(differences) < 2:
        return differences[0], differences[0]
    low, _, high = statistics.quantiles(differences, n=4)
    return low, high


SCALER_WIDTHS = (50, 158, 500, 1581, 5000)  # about 1e4, 1e5, 1e6, 1e7 and 1e8 parameters
QUICK_SCALER_WIDTHS = (8,)


def _scaler_row(m: dict[str, Any]) -> list[str]:
    s = m["summary"]
    low, high = m["overhead_us_spread"]
    return [
        f"{m['parameters']:.2e}",
        f"{s['GradScaler']['median_ms'] * 1e3:.1f}",
        f"{s['polyamp LossScaler']['median_ms'] * 1e3:.1f}",
        f"{m['overhead_us']:+.1f} ({low:+.0f} to {high:+.0f})",
        str(m["python_calls"]["GradScaler"]),
        str(m["python_calls"]["polyamp LossScaler"]),
    ]


def _row(m: dict[str, Any], key: str) -> list[str]:
    s = m["summary"]
    return [
        f"{m[key]:.2e}" if key == "parameters" else str(m[key]),
        _common.fmt_ms(s["native"]["median_ms"]),
        _common.fmt_ms(s["polyamp"]["median_ms"]),
        f"{m['overhead_ms']:+.3f}",
        _common.fmt_ratio(s["polyamp"]["ratio"]),
        _common.fmt_ratio(s["polyamp, torch CPU lists"]["ratio"]),
    ]


def plot(measured: list[dict[str, Any]], scalers: list[dict[str, Any]], path: Path) -> None:
    """Step time against parameters, native and polyamp, log-log; the polyamp / native ratio below; and the
    scaler alone: polyamp's microseconds over GradScaler's per iteration, with the spread over rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = [m["parameters"] for m in measured]
    native = [m["summary"]["native"]["median_ms"] for m in measured]
    ours = [m["summary"]["polyamp"]["median_ms"] for m in measured]
    figure, (top, bottom, scaler) = plt.subplots(
        3, 1, figsize=(7, 10), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]}
    )
    top.loglog(params, native, "o-", label="torch.autocast + GradScaler")
    top.loglog(params, ours, "s--", label="polyamp (CUDA float32 list on CPU)")
    top.set_ylabel("ms per step (median)")
    top.legend()
    top.grid(True, which="both", alpha=0.3)
    bottom.semilogx(params, [m["summary"]["polyamp"]["ratio"] for m in measured], "d-", color="tab:red")
    lists = [m["summary"]["polyamp, torch CPU lists"]["ratio"] for m in measured]
    bottom.semilogx(params, lists, "^:", color="tab:gray", label="polyamp, torch CPU lists")
    bottom.axhline(1, color="black", linewidth=0.8)
    bottom.set_ylabel("polyamp / native\n(median of per-round ratios)")
    bottom.legend()
    bottom.grid(True, which="both", alpha=0.3)
    x = [m["parameters"] for m in scalers]
    y = [m["overhead_us"] for m in scalers]
    quartiles = [_quartiles(m) for m in scalers]
    spread = [
        [m - q[0] for m, q in zip(y, quartiles, strict=True)],
        [q[1] - m for m, q in zip(y, quartiles, strict=True)],
    ]
    scaler.errorbar(x, y, yerr=spread, fmt="o-", color="tab:green", capsize=3, label="median (bars: quartiles)")
    scaler.set_xscale("log")
    scaler.set_yscale("symlog", linthresh=10)
    scaler.axhline(0, color="black", linewidth=0.8)
    scaler.set_xlabel("parameters (4 x Linear; 16 parameter tensors in the top panels, 8 in the bottom one)")
    scaler.set_ylabel("scaler alone:\npolyamp - GradScaler, us")
    scaler.legend()
    scaler.grid(True, which="both", alpha=0.3)
    figure.suptitle("CPU training step vs model size (float16 compute, Adam, batch 16)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.clock == "cpu":
        args.threads = 1  # thread_time sees this thread only: torch must not compute on others
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    batch = 4 if args.quick else 16
    by_size: list[dict[str, Any]] = []
    skipped: list[str] = []
    for width in QUICK_WIDTHS if args.quick else WIDTHS:
        count = parameters(width, 4)
        available = _available_bytes()
        # float32 weights, grads, Adam's two moments, the float16 copies, plus slack for activations.
        needed = count * (4 * 4 + 2) * 3 // 2
        if count > args.max_params * 1.05:
            skipped.append(f"{count:.1e} parameters: above --max-params")
            continue
        if available is not None and needed > available // 3:  # three variants hold a model each
            skipped.append(f"{count:.1e} parameters: needs ~{needed / 2**30:.1f} GiB per variant")
            continue
        measured = measure(width, 4, batch, rounds, args.quick, args.clock)
        by_size.append(measured)
        print(f"width {width}: {count:.2e} params, overhead {measured['overhead_ms']:+.3f} ms", flush=True)
        gc.collect()
        if measured["summary"]["native"]["median_ms"] / 1e3 > args.max_step_seconds:
            skipped.append(f"beyond {count:.1e} parameters: a native step took over {args.max_step_seconds} s")
            break
    by_tensors = []
    for depth in (1, 2) if args.quick else DEPTHS:
        measured = measure(16, depth, batch, rounds, args.quick, args.clock)
        by_tensors.append(measured)
        print(f"depth {depth}: {4 * depth} tensors, overhead {measured['overhead_ms']:+.3f} ms", flush=True)
    by_scaler = []
    for width in QUICK_SCALER_WIDTHS if args.quick else SCALER_WIDTHS:
        count = scaler_parameters(width)
        if count > args.max_params * 1.05:
            skipped.append(f"scaler alone, {count:.1e} parameters: above --max-params")
            continue
        measured = measure_scaler(width, 3 if args.quick else max(args.rounds, 15), args.quick, args.clock)
        by_scaler.append(measured)
        print(f"scaler alone, {count:.2e} params: polyamp {measured['overhead_us']:+.1f} us", flush=True)
        gc.collect()
    notes = [
        "overhead = median polyamp step minus median native step, same run; ratios as in the other tables. "
        + ("Clock: CPU time of the (single) computing thread." if args.clock == "cpu" else "Clock: wall time."),
        "polyamp's float32 list runs each block's LayerNorm in float32 (native: float16), a different amount "
        "of work that grows with width; the 'torch CPU lists' column isolates the scaler and region cost.",
        "The scaler alone: scale + step + update over 4 x Linear w's gradients (8 tensors), the optimizer's own "
        "step a no-op; polyamp - GradScaler is the median over rounds of each round's difference (in brackets: "
        "the smallest and largest); Python calls per iteration counted with sys.setprofile (functions and "
        "builtins), after 300 iterations.",
    ]
    notes += [f"not measured: {reason}" for reason in skipped]
    if not args.quick:
        png = Path(args.plot) if args.plot else Path(args.out) / "scale.png"
        try:
            plot(by_size, by_scaler, png)
            notes.append(f"plot: {png.name}")
        except ImportError:
            notes.append("plot not drawn: matplotlib is not installed (pip install matplotlib)")
    columns = ["parameters", "native ms", "polyamp ms", "overhead ms", "polyamp", "polyamp, torch CPU lists"]
    tensor_columns = ["parameter tensors", *columns[1:]]
    return _common.result(
        "scale",
        "Per-step overhead as the model grows (CPU, eager, float16 compute, Adam)",
        quick=args.quick,
        env=_common.environment("cpu", threads=torch.get_num_threads()),
        tables=[
            {
                "caption": f"4 x (Linear w + LayerNorm + GELU), batch {batch}, w = "
                + ", ".join(str(m["width"]) for m in by_size),
                "columns": columns,
                "rows": [_row(m, "parameters") for m in by_size],
            },
            {
                "caption": f"depth x (Linear 16 + LayerNorm + GELU), batch {batch}, depth = "
                + ", ".join(str(m["depth"]) for m in by_tensors),
                "columns": tensor_columns,
                "rows": [_row(m, "parameter_tensors") for m in by_tensors],
            },
            {
                "caption": "The scaler alone (scale + step + update, the optimizer's step a no-op), 4 x Linear w, "
                "w = " + ", ".join(str(m["width"]) for m in by_scaler),
                "columns": [
                    "parameters",
                    "GradScaler us",
                    "polyamp us",
                    "polyamp - GradScaler us (range)",
                    "Python calls, GradScaler",
                    "Python calls, polyamp",
                ],
                "rows": [_scaler_row(m) for m in by_scaler],
            },
        ],
        notes=notes,
        raw={"by_size": by_size, "by_tensors": by_tensors, "by_scaler": by_scaler, "skipped": skipped},
    )
