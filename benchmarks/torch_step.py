"""Training-step time of polyamp against native torch.amp (torch.autocast + GradScaler), same run.

For each optimizer, one iteration = forward under autocast, scaled backward, step, update. Variants are
timed in interleaved rounds and the median per-iteration time is reported, with the ratio to native.

Run: python benchmarks/torch_step.py [--device cpu|cuda] [--width 512] [--iters 50] [--rounds 7]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import polyamp
import polyamp_torch


def build(device: str, width: int, depth: int, optimizer: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    elif optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    return model, opt


def variant(name: str, device: str, width: int, depth: int, optimizer: str) -> Callable[[torch.Tensor], None]:
    model, opt = build(device, width, depth, optimizer)
    dtype = torch.float16
    if name == "native":
        scaler: Any = torch.amp.GradScaler(device)

        def region() -> Any:
            return torch.autocast(device, dtype=dtype)
    else:
        kwargs = {"hysteresis": 2, "min_scale": 1.0, "max_scale": 2.0**24} if name == "polyamp+hysteresis" else {}
        scaler = polyamp.LossScaler(enabled=True, **kwargs)
        cpu_ops = name != "polyamp (torch cpu op lists)"

        def region() -> Any:
            return polyamp_torch.autocast("mixed_float16", device_type=device, cpu_float32_ops=cpu_ops)

    def step(x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with region():
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--optimizers", default="sgd,adam,adam_fused")
    args = parser.parse_args()
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    names = ["native", "polyamp", "polyamp+hysteresis"]
    if device == "cpu":
        names.append("polyamp (torch cpu op lists)")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine()
    print(
        f"device {device} ({gpu}), torch {torch.__version__}, python {platform.python_version()}, "
        f"threads {torch.get_num_threads()}"
    )
    print(
        f"model {args.depth} x (Linear {args.width} + LayerNorm + GELU), batch {args.batch}, "
        f"{args.iters} iterations x {args.rounds} rounds, median ms/iteration"
    )
    x = torch.randn(args.batch, args.width, device=device)
    for optimizer in args.optimizers.split(","):
        steps = {name: variant(name, device, args.width, args.depth, optimizer) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        for step in steps.values():  # warm-up
            for _ in range(5):
                step(x)
        sync()
        for _ in range(args.rounds):
            for name, step in steps.items():
                sync()
                start = time.perf_counter()
                for _ in range(args.iters):
                    step(x)
                sync()
                times[name].append((time.perf_counter() - start) / args.iters * 1e3)
        native = statistics.median(times["native"])
        cells = ", ".join(
            f"{name} {statistics.median(t):.3f} ms ({statistics.median(t) / native:.3f}x)" for name, t in times.items()
        )
        print(f"{optimizer:>10}: {cells}")


if __name__ == "__main__":
    main()
