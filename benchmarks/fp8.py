"""Target: the FP8 training step on the CPU, polyamp's conversion against torchao's.

One iteration = forward of a small GPT (`benchmarks._fp8_model.GPT`, its ``nn.Linear`` layers in FP8 through
``torch._scaled_mm``), cross-entropy, backward, AdamW step. Variants, from identical initial weights, timed in
interleaved rounds in one process, per recipe (tensorwise, rowwise):

* ``torchao``: ``torchao.float8.convert_to_float8_training`` with the recipe, inputs in bfloat16 (torchao takes
  its compute dtype from its input on the CPU);
* ``polyamp``: ``polyamp_torch.apply_policy(model, "bfloat16+<recipe>")``, the whole model in bfloat16 as
  torchao's: the like-for-like comparison;
* ``polyamp mixed``: ``"mixed_bfloat16+<recipe>"``, float32 parameters and bfloat16 autocast around the FP8
  layers (what most users run; the layers between the FP8 ones differ from torchao's);
* ``bfloat16``: no FP8, ``polyamp_torch.apply_policy(model, "mixed_bfloat16")`` (for scale: on the CPU
  ``torch._scaled_mm`` has no FP8 units, so FP8 is not faster there).

The ratio that matters is polyamp's to torchao's: the two compute the same values (tests/test_torch_float8.py),
so any difference is the cost of polyamp's layer around the same kernels.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch

import polyamp_torch
from benchmarks import _common
from benchmarks._fp8_model import GPT, bigram_batches, loss_of
from benchmarks.torch_cpu import calibrate

RECIPES = {"float8_tensorwise": "tensorwise", "float8_rowwise": "rowwise"}
VARIANTS = ("torchao", "polyamp", "polyamp mixed", "bfloat16")
POLICIES = {"polyamp": "bfloat16+{}", "polyamp mixed": "mixed_bfloat16+{}", "bfloat16": "mixed_bfloat16"}


def make_step(variant: str, recipe: str, base: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    model = copy.deepcopy(base)
    if variant == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(RECIPES[recipe]))
        model = model.to(torch.bfloat16)  # the whole model in bfloat16: torchao casts nothing on the CPU
    else:
        polyamp_torch.apply_policy(model, POLICIES[variant].format(recipe))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, tokens).backward()
        optimizer.step()

    return step


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.clock == "cpu":
        args.threads = 1  # the CPU time of one computing thread: steady on a shared machine
    if args.threads:
        torch.set_num_threads(args.threads)
    width, layers, batch, length = (64, 1, 2, 16) if args.quick else (256, 2, 8, 64)
    rounds = 2 if args.quick else args.rounds
    tokens = bigram_batches(256, batch, length, seed=0)()
    rows: list[list[str]] = []
    raw = []
    for recipe in RECIPES:
        torch.manual_seed(0)
        base = GPT(256, width, layers, heads=4, length=length)
        steps = {variant: make_step(variant, recipe, base, tokens) for variant in VARIANTS}
        iters = 1 if args.quick else calibrate(steps["torchao"], args.round_seconds)
        times = _common.interleaved(
            steps, iters=iters, rounds=rounds, warmup=1 if args.quick else 3, clock=_common.CLOCKS[args.clock]
        )
        summary = _common.summarize(times, "torchao")
        rows.append(
            [
                recipe,
                _common.fmt_ms(summary["torchao"]["median_ms"]),
                _common.fmt_ratio(summary["polyamp"]["ratio"]),
                *_common.fmt_intervals(summary, ["polyamp"]),
                _common.fmt_ratio(summary["polyamp mixed"]["ratio"]),
                _common.fmt_ratio(summary["bfloat16"]["ratio"]),
            ]
        )
        raw.append({"recipe": recipe, "summary": summary})
        print(recipe, {v: round(s["ratio"], 3) for v, s in summary.items()}, flush=True)
    table = {
        "caption": f"GPT {layers} x {width} wide, batch {batch} x {length}, AdamW: step time against torchao's",
        "columns": ["recipe", "torchao ms", "polyamp", "95% interval", "polyamp mixed", "bfloat16 (no FP8)"],
        "rows": rows,
    }
    notes = [
        f"Ratios: median over {rounds} interleaved rounds of (variant's ms / torchao's in the same round), "
        + ("CPU time of the (single) computing thread." if args.clock == "cpu" else "wall time."),
        "On the CPU torch._scaled_mm has no FP8 units; the step measures the casts and the layer around them.",
    ]
    return _common.result(
        "fp8",
        "FP8 step on the CPU: polyamp's conversion vs torchao's",
        quick=args.quick,
        env={**_common.environment("cpu", args.threads), "torchao": _common._version("torchao")},
        tables=[table],
        notes=notes,
        raw=raw,
    )
