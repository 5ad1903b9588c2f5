"""Cost of ``polyamp_torch.watch_forward``: eager CPU training-step time with and without the watch.

One iteration = zero_grad, forward (``depth`` x (Linear + LayerNorm + GELU), then a Linear head;
``3 * depth + 2`` watched modules with the Sequential), cross-entropy, backward, SGD step, all finite (the
watch's fast path: one ``torch.aminmax`` per checked tensor, one host read per forward). Variants, on
identical models and data, timed in interleaved rounds in one process:

* ``no watch``;
* ``watch every=1``: every forward watched;
* ``watch every=10``: one forward in ten watched.

Run from the repository root::

    python benchmarks/forward_watch.py            # prints the table and the torch version
    python benchmarks/forward_watch.py --quick    # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import polyamp_torch  # noqa: E402
from benchmarks import _common  # noqa: E402

VARIANTS = {"no watch": None, "watch every=1": 1, "watch every=10": 10}


def build(width: int, depth: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    iters, rounds, warmup = (3, 3, 2) if args.quick else (20, 15, 10)

    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (args.batch,), generator=torch.Generator().manual_seed(2))
    steps = {}
    watches = []
    for name, every in VARIANTS.items():
        model, opt = build(args.width, args.depth)
        if every is not None:
            watches.append(polyamp_torch.watch_forward(model, every=every))

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        steps[name] = step
    times = _common.interleaved(steps, iters=iters, rounds=rounds, warmup=warmup, clock=_common.CLOCKS["cpu"])
    summary = _common.summarize(times, "no watch")
    assert all(w.report() is None for w in watches)  # the fast path was measured: every forward finite
    for w in watches:
        w.remove()
    modules = 3 * args.depth + 2
    print(
        f"torch {torch.__version__}, CPU ({_common.cpu_model()}), {args.threads} thread(s); "
        f"width {args.width}, depth {args.depth} ({modules} modules), batch {args.batch}; "
        f"{rounds} rounds x {iters} steps, CPU time of this thread"
    )
    print(f"{'variant':<16} {'median ms/step':>15} {'ratio':>8}")
    for name, row in summary.items():
        print(f"{name:<16} {_common.fmt_ms(row['median_ms']):>15} {_common.fmt_ratio(row['ratio']):>8}")
    return {"torch": torch.__version__, "summary": summary}


if __name__ == "__main__":
    main()
