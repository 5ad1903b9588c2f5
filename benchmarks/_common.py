"""Shared pieces of the benchmark suite: the environment record, interleaved timing, JSON results.

Every target writes one JSON file: ``{"target", "title", "quick", "environment", "command", "tables":
[{"caption", "columns", "rows"}], "notes", "raw"}``. ``report.py`` renders those files as markdown, so the
tables in RESULTS.md are generated, never typed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
NOT_MEASURED = "not yet measured"


def gpu_stack_parser(description: str | None) -> argparse.ArgumentParser:
    """The arguments of the GPU speed checks that time a stack of blocks (benchmarks/fp8_gpu.py,
    fp8_jax_gpu.py): its size, the interleaved rounds, ``--quick`` and ``--out``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--iters", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    return parser


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str | None:
    # Read from the installed metadata: importing tensorflow or jax just to print a version costs seconds.
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: str = "cpu", threads: int | None = None, accelerator: str | None = None) -> dict[str, Any]:
    """Where and with what a measurement was taken."""
    return {
        "device": device,
        "accelerator": accelerator,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "tensorflow": _version("tensorflow"),
        "keras": _version("keras"),
        "jax": _version("jax"),
        "numpy": _version("numpy"),
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def command() -> str:
    """The command line that produced this result, as one would type it from the repository root."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    # Paths inside the repository are written relative to it, as typed from its root. Where the JSON went
    # (--out) is left out: it does not change what was measured.
    args: list[str] = []
    skip = False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            args.append(arg.replace(f"{ROOT}/", ""))
    return shlex.join(["python", str(script), *args])


def interleaved(
    variants: dict[str, Callable[[], Any]],
    *,
    iters: int,
    rounds: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
    prepare: dict[str, Callable[[], Any]] | None = None,
) -> dict[str, list[float]]:
    """Milliseconds per call of each variant, one value per round; variants alternate within each round.

    Interleaving spreads machine noise (other processes, frequency changes) over all variants alike. Each
    round runs the variants in a new random order (seeded, so a run repeats): a variant's block follows a
    different neighbour from round to round. (Rotating one fixed order would not: each variant would always
    follow the same one, and a block's time depends a little on what ran before it. On the torch-cpu target the
    A/A ratio was 0.995x-0.997x in three such runs, and 1.000x-1.010x with random orders.) ``clock`` is
    wall time by default; ``time.thread_time`` (CPU time of this thread) makes single-threaded measurements
    insensitive to other processes taking the CPU away, on a shared machine. ``prepare[name]``, if given,
    runs (untimed) before each of that variant's blocks.
    """
    prepare = prepare or {}
    names = list(variants)
    for name in names:
        if name in prepare:
            prepare[name]()
        for _ in range(warmup):
            variants[name]()
    sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    for order in round_orders(names, rounds):
        for name in order:
            run = variants[name]
            if name in prepare:
                prepare[name]()
            sync()
            start = clock()
            for _ in range(iters):
                run()
            sync()
            times[name].append((clock() - start) / iters * 1e3)
    return times


def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order the variants run in, per round: a new random order each round (seeded, so a run repeats),
    so that each variant's block follows a different neighbour from round to round."""
    order = random.Random(0)
    return [order.sample(list(names), len(names)) for _ in range(rounds)]


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def summarize(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    """Per variant: median ms, and its ratio to the baseline as the median of per-round ratios.

    Each round times every variant back to back, so a round's ratio compares measurements taken under
    the same machine conditions; its median over rounds is what the tables report ("ratio"), with its 95%
    bootstrap interval ("ratio_low", "ratio_high"; see `bootstrap_interval`). The ratio of the medians and
    of the minima are kept too.
    """
    base = statistics.median(times[baseline])
    summary = {}
    for name, values in times.items():
        paired = [value / ref for value, ref in zip(values, times[baseline], strict=True)]
        low, high = bootstrap_interval(paired)
        summary[name] = {
            "median_ms": statistics.median(values),
            "min_ms": min(values),
            "ratio": statistics.median(paired),
            "ratio_low": low,
            "ratio_high": high,
            "ratio_of_medians": statistics.median(values) / base,
            "ratio_of_minima": min(values) / min(times[baseline]),
        }
    return summary


def bootstrap_interval(values: list[float], *, resamples: int = 2000, level: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of ``values``: the median recomputed on ``resamples``
    resamplings with replacement (seeded, so a result file is reproducible from its raw times), cut at the
    ``(1 - level) / 2`` quantiles on each side. One value gives a zero-width interval."""
    if len(values) < 2:
        return values[0], values[0]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    cut = int(resamples * (1 - level) / 2)
    return medians[cut], medians[resamples - 1 - cut]


def fmt_intervals(summary: dict[str, dict[str, float]], names: Sequence[str]) -> list[str]:
    """Each variant's 95% interval of its median ratio as a table cell ("" for a variant `summary` lacks)."""
    return [
        f"{summary[name]['ratio_low']:.3f}-{summary[name]['ratio_high']:.3f}" if name in summary else ""
        for name in names
    ]


def write(out_dir: Path, payload: dict[str, Any]) -> Path:
    """Writes one target's result as ``<target>[-quick].json`` in ``out_dir``; returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if payload.get("quick") else ""
    path = out_dir / f"{payload['target']}{suffix}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}")
    return path


def result(
    target: str,
    title: str,
    *,
    quick: bool,
    env: dict[str, Any],
    tables: list[dict[str, Any]],
    notes: list[str] | None = None,
    raw: Any = None,
    status: str = "measured",
) -> dict[str, Any]:
    """The JSON payload every target writes (see the module doc)."""
    return {
        "target": target,
        "title": title,
        "status": status,
        "quick": quick,
        "environment": env,
        "command": command(),
        "tables": tables,
        "notes": notes or [],
        "raw": raw,
    }


def fmt_ratio(value: float) -> str:
    return f"{value:.3f}x"


def fmt_ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.2f}" if value < 100 else f"{value:.1f}"
