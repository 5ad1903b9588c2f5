"""Target: what the guard and the step records cost, on the eager PyTorch CPU step.

One iteration = zero_grad, forward under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (4 x (Linear +
LayerNorm + GELU), cross-entropy), backward, step. Variants, from identical initial weights, timed in
interleaved rounds in one process:

* ``plain torch``: no scaler at all (what a bfloat16 run does without polyamp);
* ``check by hand``: plain torch plus the smallest guard one can write: the gradients in a list, torch's fused
  check at inverse scale 1, then the step unless the flag is set (read to the host for a non-fused optimizer;
  handed to a fused one as ``found_inf``). No records, no stages, no misuse checks: the floor any guard pays;
* ``guard on (default)``: ``polyamp.LossScaler()`` under ``"mixed_bfloat16"``: the gradients are checked with
  torch's fused non-finite-check kernel at inverse scale 1, the step is taken unless one is inf/NaN, and the
  iteration is recorded (a non-fused optimizer reads the flag to the host to decide, as GradScaler does; a
  fused one skips on the device);
* ``guard off``: ``polyamp.LossScaler(guard=False)``: scaler calls and records, no check.

and, under ``"mixed_float16"`` with loss scaling, the records' share of the step:

* ``GradScaler``: ``torch.autocast(float16)`` + ``torch.amp.GradScaler("cpu")``;
* ``polyamp``: ``polyamp.LossScaler()`` (records on, as always; they add no kernel: the iteration's flag tensor
  is kept, and read in one batch every ``history // 2`` iterations).

and, on the same models' gradients, the ways torch offers to tell whether any gradient is inf/NaN (one call
each, no step): the fused check the guard uses against the reductions one could use instead.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch

import polyamp
from benchmarks import _common
from benchmarks.torch_cpu import calibrate

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
}
#: Ways to tell whether any of ``grads`` holds inf/NaN; the first is the guard's (exact, writes nothing new).
CHECKS: dict[str, Callable[[list[Any], Any, Any], Any]] = {
    "fused check (the guard's)": lambda grads, flag, one: torch._amp_foreach_non_finite_check_and_unscale_(
        grads, flag, one
    ),
    "_foreach_norm, ord 2": lambda grads, flag, one: torch._foreach_norm(grads, 2),
    "_foreach_norm, ord inf": lambda grads, flag, one: torch._foreach_norm(grads, float("inf")),
    "_foreach_max": lambda grads, flag, one: torch._foreach_max(grads),
    "aminmax per tensor": lambda grads, flag, one: [torch.aminmax(g) for g in grads],
    "sum per tensor, stacked": lambda grads, flag, one: torch.stack([g.sum() for g in grads]),
}
BF16_VARIANTS = ("plain torch", "check by hand", "guard on (default)", "guard off")
FP16_VARIANTS = ("GradScaler", "polyamp")


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def make_step(variant: str, width: int, depth: int, optimizer: str, x: Any, y: Any) -> Callable[[], None]:
    model = _model(width, depth)
    opt = OPTIMIZERS[optimizer](model.parameters())
    bf16 = variant in BF16_VARIANTS
    dtype = torch.bfloat16 if bf16 else torch.float16
    scaler: Any = None
    if variant == "guard on (default)" or variant == "polyamp":
        scaler = polyamp.LossScaler()
    elif variant == "guard off":
        scaler = polyamp.LossScaler(guard=False)
    elif variant == "GradScaler":
        scaler = torch.amp.GradScaler("cpu")

    one = torch.ones(())
    fused = optimizer == "adam_fused"

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if variant == "check by hand":
            loss.backward()
            grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
            found_inf = torch.zeros(())
            with torch.no_grad():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
            if fused:  # torch's fused optimizers skip on the device, as under GradScaler
                opt.found_inf = found_inf  # type: ignore[attr-defined]
                opt.step()
                del opt.found_inf  # type: ignore[attr-defined]
            elif not found_inf.item():
                opt.step()
            return
        if scaler is None:
            loss.backward()
            opt.step()
            return
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.clock == "cpu":
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = [(16, 8, 2)] if args.quick else [(64, 32, 4), (512, 64, 4)]
    rounds = 2 if args.quick else args.rounds
    tables = []
    raw: list[dict[str, Any]] = []
    for caption, variants, baseline in (
        ("bfloat16 compute: the guard", BF16_VARIANTS, "plain torch"),
        ("float16 compute with loss scaling: records included", FP16_VARIANTS, "GradScaler"),
    ):
        rows: list[list[str]] = []
        # Set for the process, as a training script does (the scalers read it each iteration).
        polyamp.set_policy("mixed_bfloat16" if baseline == "plain torch" else "mixed_float16")
        for width, batch, depth in configs:
            generator = torch.Generator().manual_seed(1)
            x = torch.randn(batch, width, generator=generator)
            y = torch.randint(0, width, (batch,), generator=generator)
            for optimizer in OPTIMIZERS:
                steps = {v: make_step(v, width, depth, optimizer, x, y) for v in variants}
                iters = 1 if args.quick else calibrate(steps[baseline], args.round_seconds)
                times = _common.interleaved(
                    steps, iters=iters, rounds=rounds, warmup=1 if args.quick else 5, clock=_common.CLOCKS[args.clock]
                )
                summary = _common.summarize(times, baseline)
                label = f"{depth} x (Linear {width} + LayerNorm + GELU), batch {batch}"
                rows.append(
                    [
                        label if optimizer == "sgd" else "",
                        optimizer,
                        _common.fmt_ms(summary[baseline]["median_ms"]),
                        *(_common.fmt_ratio(summary[v]["ratio"]) for v in variants[1:]),
                    ]
                )
                raw.append({"caption": caption, "width": width, "optimizer": optimizer, "summary": summary})
                print(caption, label, optimizer, {v: round(s["ratio"], 3) for v, s in summary.items()}, flush=True)
        tables.append(
            {"caption": caption, "columns": ["model", "optimizer", f"{baseline} ms", *variants[1:]], "rows": rows}
        )
    rows = []
    for width, batch, depth in configs:
        model = _model(width, depth)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(batch, width, generator=generator)
        torch.nn.functional.cross_entropy(model(x), torch.randint(0, width, (batch,), generator=generator)).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flag, one = torch.zeros(()), torch.ones(())
        checks = {
            name: functools.partial(check, grads, flag, one)
            for name, check in CHECKS.items()
            if name != "_foreach_max" or hasattr(torch, "_foreach_max")
        }
        baseline = next(iter(checks))
        iters = 1 if args.quick else calibrate(checks[baseline], args.round_seconds / 4)
        with torch.no_grad():
            times = _common.interleaved(
                checks, iters=iters, rounds=rounds, warmup=1 if args.quick else 5, clock=_common.CLOCKS[args.clock]
            )
        summary = _common.summarize(times, baseline)
        label = f"{depth} x (Linear {width} + LayerNorm + GELU): {len(grads)} gradients"
        for name in checks:
            us = summary[name]["median_ms"] * 1000
            rows.append(
                [label if name == baseline else "", name, f"{us:.1f}", _common.fmt_ratio(summary[name]["ratio"])]
            )
        raw.append({"caption": "checks", "width": width, "summary": summary})
        print("checks", label, {v: round(s["ratio"], 3) for v, s in summary.items()}, flush=True)
    tables.append(
        {
            "caption": "the check alone: is any gradient inf/NaN? (one call over the gradients, no step)",
            "columns": ["model", "check", "µs per call", "vs the fused check"],
            "rows": rows,
        }
    )
    notes = [
        "Ratios: median over interleaved rounds of (variant's ms/iteration / the baseline's in the same round), "
        f"{rounds} rounds. Clock: "
        + ("CPU time of the (single) computing thread." if args.clock == "cpu" else "wall time."),
        "The guard's check is torch's fused _amp_foreach_non_finite_check_and_unscale_ at inverse scale 1 (the "
        "gradients stay bitwise unchanged); non-fused optimizers read its flag to the host to decide the step.",
        "'check by hand' is that check written inline with nothing around it: the floor of any guard. The guard's "
        "cost above it is the scaler's bookkeeping (stages, misuse checks, records), which 'guard off' shows "
        "alone.",
        "The checks table: the fused check is exact and reads the flag out of the same pass; a norm is non-finite "
        "for inf/NaN but can also overflow on finite gradients (ord 2), and every reduction needs a further "
        "op to turn its per-tensor results into one flag.",
    ]
    return _common.result(
        "guard",
        "PyTorch eager CPU step: the bfloat16 guard and the step records",
        quick=args.quick,
        env=_common.environment("cpu", threads=torch.get_num_threads()),
        tables=tables,
        notes=notes,
        raw=raw,
    )
