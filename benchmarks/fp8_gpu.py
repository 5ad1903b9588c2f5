"""The FP8 speed check on an H100/H200: an 8-layer GPT block stack, hidden 4096, under ``torch.compile``.

Variants, from identical weights, timed in interleaved rounds (`benchmarks._common.interleaved`), one
iteration = forward, backward and a fused AdamW step on ``batch x length`` tokens (default 8 x 2048):

* ``bfloat16``: ``polyamp_torch.apply_policy(model, "mixed_bfloat16")`` (bfloat16 autocast);
* ``polyamp tensorwise`` / ``polyamp rowwise``: ``"float8_tensorwise"`` / ``"float8_rowwise"``;
* ``torchao tensorwise`` / ``torchao rowwise``: ``torchao.float8.convert_to_float8_training`` with the same
  recipe, under ``torch.autocast("cuda", torch.bfloat16)``.

Targets: polyamp tensorwise >= 1.25x and rowwise >= 1.15x the bfloat16 step, each within 3% of torchao's.
The result (command, device, versions, every round's times) goes to ``benchmarks/results/fp8-gpu.json``.

    python benchmarks/fp8_gpu.py                      # on the GPU machine (carry the torchao wheel there)
    python benchmarks/fp8_gpu.py --quick --device cpu # a smoke run of the code at toy sizes
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import polyamp_torch  # noqa: E402
from benchmarks import _common  # noqa: E402
from benchmarks._fp8_model import Block  # noqa: E402

VARIANTS = ("bfloat16", "polyamp tensorwise", "polyamp rowwise", "torchao tensorwise", "torchao rowwise")


def make_step(variant: str, base: torch.nn.Module, x: torch.Tensor, compile_: bool) -> Callable[[], None]:
    model = copy.deepcopy(base)
    device_type = x.device.type
    if variant.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(variant.split()[1]))
    else:
        policy = "mixed_bfloat16" if variant == "bfloat16" else f"float8_{variant.split()[1]}"
        polyamp_torch.apply_policy(model, policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device_type == "cuda")
    forward = torch.compile(model) if compile_ else model

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if variant.startswith("torchao"):
            with torch.autocast(device_type, dtype=torch.bfloat16):
                out = forward(x)
        else:
            out = forward(x)
        out.float().square().mean().backward()
        optimizer.step()

    return step


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fp8_gpu needs a CUDA device (or --device cpu for a smoke run)")
    hidden, layers, batch, length = (
        (64, 2, 2, 32) if args.quick else (args.hidden, args.layers, args.batch, args.length)
    )
    torch.manual_seed(0)
    base = torch.nn.Sequential(*(Block(hidden, heads=max(1, hidden // 128)) for _ in range(layers))).to(device)
    x = torch.randn(batch, length, hidden, device=device)
    steps = {variant: make_step(variant, base, x, compile_=not args.quick) for variant in VARIANTS}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rounds = 2 if args.quick else args.rounds
    times = _common.interleaved(
        steps, iters=1 if args.quick else args.iters, rounds=rounds, warmup=1 if args.quick else 10, sync=sync
    )
    summary = _common.summarize(times, "bfloat16")
    for name in VARIANTS:
        print(name, round(summary[name]["median_ms"], 2), "ms", round(1 / summary[name]["ratio"], 3), "x", flush=True)
    speedup = {name: 1.0 / summary[name]["ratio"] for name in VARIANTS}
    rows = [[name, _common.fmt_ms(summary[name]["median_ms"]), f"{speedup[name]:.3f}x"] for name in VARIANTS]
    against = {
        recipe: summary[f"polyamp {recipe}"]["median_ms"] / summary[f"torchao {recipe}"]["median_ms"]
        for recipe in ("tensorwise", "rowwise")
    }
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return _common.result(
        "fp8-gpu",
        f"FP8 on {name}: GPT blocks {layers} x {hidden}, batch {batch} x {length}, torch.compile",
        quick=args.quick,
        env={**_common.environment(device.type, accelerator=name), "torchao": _common._version("torchao")},
        tables=[
            {
                "caption": "step time (forward, backward, fused AdamW) and speed-up over bfloat16",
                "columns": ["variant", "ms", "speed-up"],
                "rows": rows,
            }
        ],
        notes=[
            f"polyamp / torchao step time: tensorwise {against['tensorwise']:.3f}, rowwise {against['rowwise']:.3f} "
            "(target: within 1.03).",
            "Targets over bfloat16: tensorwise >= 1.25x, rowwise >= 1.15x.",
        ],
        raw={"times_ms": times},
    )


def main(argv: list[str] | None = None) -> int:
    parser = _common.gpu_stack_parser(__doc__)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    _common.write(Path(args.out), run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
