"""The kernels behind the GPU recipe's guard and masked commit, each timed alone.

    python benchmarks/gpu_kernels.py [--device cuda] [--size 4096] [--layers 3] [--iters 50]

Gradients and parameters shaped like the recipe's (``layers`` x ``size`` x ``size`` float32 weights and their
biases). Prints microseconds per call (CUDA events on a GPU, the wall clock elsewhere) for: the guard's
check (torch's fused non-finite check at inverse scale 1, which reads and writes every gradient), a
reduction that only reads (``torch._foreach_norm`` with ``ord=inf``), the masked commit of
``skip_on_device=True`` for an optimizer without state (a copy of the parameters, then one ``where`` per
tensor) and its two halves, a foreach SGD step, and one host read of a flag (the sync a step decided on the
host makes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    grads = [torch.randn(args.size, args.size, device=device) for _ in range(args.layers)]
    grads += [torch.randn(args.size, device=device) for _ in range(args.layers)]
    params = [g.clone() for g in grads]
    one = torch.ones((), device=device)
    skip = torch.zeros((), dtype=torch.bool, device=device)

    def check() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros((), device=device), one)

    def read_only_check() -> None:
        (~torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite()).any()

    def masked_commit() -> None:
        old = [p.clone() for p in params]
        for param, before in zip(params, old, strict=True):
            torch.where(skip, before, param, out=param)

    def copy() -> None:
        [p.clone() for p in params]

    saved = [p.clone() for p in params]

    def select() -> None:
        for param, before in zip(params, saved, strict=True):
            torch.where(skip, before, param, out=param)

    def sgd_step() -> None:
        torch._foreach_add_(params, grads, alpha=-1e-3)

    def host_read() -> None:
        torch.zeros((), device=device).item()

    cases: dict[str, Callable[[], None]] = {
        "guard check (fused, inverse scale 1)": check,
        "read-only check (_foreach_norm, ord=inf)": read_only_check,
        "masked commit (copy + where)": masked_commit,
        "  its copy": copy,
        "  its where": select,
        "foreach SGD step": sgd_step,
        "host read of a flag": host_read,
    }
    megabytes = sum(g.numel() * g.element_size() for g in grads) / 2**20
    print(f"{args.layers} x {args.size} x {args.size} float32 ({megabytes:.0f} MiB of gradients) on {device}")
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            micros = start.elapsed_time(end) * 1000 / args.iters
        else:
            began = time.perf_counter()
            for _ in range(args.iters):
                fn()
            micros = (time.perf_counter() - began) * 1e6 / args.iters
        print(f"{name:42s} {micros:9.1f} us")


if __name__ == "__main__":
    main()
