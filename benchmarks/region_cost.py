"""What making, entering and leaving an autocast region costs, alone, in a tight loop.

    python benchmarks/region_cost.py [--number 20000] [--repeat 7]

Best of ``repeat`` timings of ``number`` empty ``with`` blocks, in microseconds per block, for
``torch.autocast("cpu", dtype=torch.float16)`` and for ``polyamp_torch.autocast`` spelled the common ways: a
policy name and a device type, the default device types, and the policy in effect (``polyamp.set_policy``).
Inside a training step the same work costs several times more (the interpreter runs it between the model's
kernels with cold caches): the ``torch-cpu`` target measures that whole step.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

import torch

import polyamp
import polyamp_torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    polyamp.set_policy("mixed_float16")

    def native() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            pass

    def named() -> None:
        with polyamp_torch.autocast("mixed_float16", device_type="cpu"):
            pass

    def named_torch_lists() -> None:
        with polyamp_torch.autocast("mixed_float16", device_type="cpu", cpu_float32_ops=False):
            pass

    def in_effect() -> None:
        with polyamp_torch.autocast():
            pass

    cases: dict[str, Callable[[], None]] = {
        'torch.autocast("cpu", dtype=torch.float16)': native,
        'polyamp_torch.autocast("mixed_float16", device_type="cpu")': named,
        "  the same, cpu_float32_ops=False": named_torch_lists,
        "polyamp_torch.autocast() (the policy in effect)": in_effect,
    }
    for name, fn in cases.items():
        best = min(timeit.repeat(fn, number=args.number, repeat=args.repeat))
        print(f"{name:60s} {best / args.number * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
