"""The PyTorch AMP recipe with polyamp: a stack of Linear+ReLU in default precision, with native
torch.amp, and with polyamp; wall time and peak memory of each.

Run: python examples/torch_recipe.py                  # small sizes (CPU friendly)
     python examples/torch_recipe.py --device cuda    # the recipe's 512 x 4096 x 3 sizes
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

import polyamp
import polyamp_torch


def make_model(in_size: int, out_size: int, num_layers: int, device: str) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(num_layers - 1):
        layers += [torch.nn.Linear(in_size, in_size), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(in_size, out_size))
    return torch.nn.Sequential(*layers).to(device)


def timed(device: str, run: Callable[[], Any]) -> tuple[float, int | None]:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return time.perf_counter() - start, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--size", type=int, default=None, help="in/out features (recipe: 4096)")
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--num-batches", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--policy", default=None, help="default: mixed_float16 on cuda, mixed_bfloat16 on cpu")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    batch_size = args.batch_size or (512 if cuda else 64)
    size = args.size or (4096 if cuda else 256)
    num_batches = args.num_batches or (50 if cuda else 10)
    policy = polyamp.set_policy(args.policy or ("mixed_float16" if cuda else "mixed_bfloat16"))
    device = args.device
    torch.manual_seed(0)
    data = [torch.randn(batch_size, size, device=device) for _ in range(num_batches)]
    targets = [torch.randn(batch_size, size, device=device) for _ in range(num_batches)]
    loss_fn = torch.nn.MSELoss()

    def default_precision() -> None:
        net = make_model(size, size, args.num_layers, device)
        opt = torch.optim.SGD(net.parameters(), lr=0.001)
        for _ in range(args.epochs):
            for x, y in zip(data, targets, strict=True):
                loss_fn(net(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    def native_amp() -> None:
        net = make_model(size, size, args.num_layers, device)
        opt = torch.optim.SGD(net.parameters(), lr=0.001)
        dtype = getattr(torch, policy.compute_dtype)
        scaler = torch.amp.GradScaler(device, enabled=policy.needs_loss_scaling)
        for _ in range(args.epochs):
            for x, y in zip(data, targets, strict=True):
                with torch.autocast(device, dtype=dtype):
                    loss = loss_fn(net(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)

    def polyamp_amp() -> None:
        net = make_model(size, size, args.num_layers, device)
        opt = torch.optim.SGD(net.parameters(), lr=0.001)
        scaler = polyamp.LossScaler()
        for _ in range(args.epochs):
            for x, y in zip(data, targets, strict=True):
                with polyamp_torch.autocast(device_type=device):
                    loss = loss_fn(net(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
        with torch.no_grad(), polyamp_torch.autocast(device_type=device):  # inference: autocast alone
            assert net(data[0]).dtype == getattr(torch, policy.compute_dtype)

    print(
        f"device {device}, policy {policy.name}, batch {batch_size}, size {size}, layers {args.num_layers}, "
        f"{num_batches} batches x {args.epochs} epochs"
    )
    results = {}
    for name, run in (("default precision", default_precision), ("torch.amp", native_amp), ("polyamp", polyamp_amp)):
        run()  # warm-up (kernels, allocator)
        results[name] = timed(device, run)
        seconds, peak = results[name]
        memory = f"{peak / 2**20:.1f} MiB" if peak is not None else "not tracked on cpu"
        print(f"{name:>18}: {seconds:.3f} s, peak memory {memory}")
    print(f"polyamp / torch.amp time: {results['polyamp'][0] / results['torch.amp'][0]:.3f}")


if __name__ == "__main__":
    main()
