"""Target ``gpu-training-state``: the throughput and memory of each training-state plan on a GPU.

A GPT of 34M parameters (8 layers, width 512, 8 heads, vocabulary 8192, sequences of 256 tokens, batch 32;
the model of `benchmarks.training_state` at that size) trained with AdamW under each plan of the
``training-state`` target, on torch (``polyamp_torch.PrecisionOptimizer`` over ``torch.optim.AdamW``, fused)
and on JAX (``polyamp_jax.precision`` over ``optax.adamw``, the step jitted), each against the
``bfloat16_float32_master`` plan measured in the same process. On torch two native references run beside them:
torch AMP as usually written (float32 weights, ``torch.autocast(bfloat16)``, fused AdamW) and plain bfloat16
weights with fused AdamW (no plan: updates rounded to nearest, what the scaler's warning is about).

Reported per plan: ms per step (median of ``--rounds`` rounds of 10 steps, the plans interleaved), tokens per
second, the step time against the float32-master plan, the training state's bytes per parameter counted from the
tensors, and the peak GPU memory of a step. Random tokens: this target measures speed and memory, not loss (the
``training-state`` target measures loss).

``python benchmarks/run.py gpu-training-state`` (a CUDA device); ``--device cpu --quick`` smoke-tests the code at
toy size on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import polyamp
from benchmarks import _common
from benchmarks.training_state import PLANS, POLICY_OF, REFERENCE, Config, decayed, initial_weights, plan_rows

NATIVE = ("torch AMP: float32 weights, fused AdamW", "bfloat16 weights, fused AdamW (no plan)")


def _config(quick: bool) -> Config:
    if quick:
        return Config(layers=1, width=32, heads=2, vocab=64, sequence=16, batch=4, steps=1, seeds=(0,))
    return Config(layers=8, width=512, heads=8, vocab=8192, sequence=256, batch=32, steps=1, seeds=(0,))


def _interleaved(steppers: dict[str, Callable[[], None]], sync: Callable[[], None], rounds: int, steps: int):
    """Median ms per step of each stepper over ``rounds`` rounds of ``steps`` steps, the steppers interleaved."""
    for step in steppers.values():  # warm-up: allocations, autotuning, compilation
        for _ in range(3):
            step()
    sync()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, step in steppers.items():
            sync()
            started = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            times[name].append((time.perf_counter() - started) / steps * 1e3)
        print("  round:", ", ".join(f"{name} {values[-1]:.2f} ms" for name, values in times.items()), flush=True)
    return {name: statistics.median(values) for name, values in times.items()}


def _torch(config: Config, device: str, rounds: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import polyamp
    import polyamp_torch
    from benchmarks.training_state_torch import GPT

    weights = initial_weights(config, 0)
    generator = np.random.default_rng(0)
    tokens = torch.from_numpy(generator.integers(0, config.vocab, (config.batch, config.sequence + 1))).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows: dict[str, dict[str, Any]] = {}
    steppers: dict[str, Callable[[], None]] = {}
    keep: list[Any] = []

    def build(name: str) -> None:
        started = time.perf_counter()
        native = name in NATIVE
        policy = polyamp.Policy(
            {NATIVE[0]: "mixed_bfloat16", NATIVE[1]: "bfloat16"}.get(name) or POLICY_OF.get(name, name)
        )
        dtype = getattr(torch, "bfloat16" if name == NATIVE[1] else policy.param_dtype)
        model = GPT(config, weights, dtype).to(device)
        named = dict(zip(model.names, model.weights.values(), strict=True))
        groups = [
            {"params": [p for n, p in named.items() if decayed(n, weights[n])], "weight_decay": config.weight_decay},
            {"params": [p for n, p in named.items() if not decayed(n, weights[n])], "weight_decay": 0.0},
        ]
        fused = device == "cuda"
        if native:
            optimizer: Any = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=fused)
        else:
            kind = {"fused": True} if fused else {"foreach": True}
            inner = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, **kind)
            optimizer = polyamp_torch.PrecisionOptimizer(inner, policy, seed=0)

        if name == NATIVE[0]:
            region: Callable[[], Any] = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731
        elif name == NATIVE[1]:
            region = contextlib.nullcontext
        else:
            region = lambda: polyamp_torch.autocast(policy, device_type=device)  # noqa: E731

        def step() -> None:
            with region():
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, config.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the hazard warning of the no-plan reference
            step()
        sync()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            sync()
            peak = (torch.cuda.max_memory_allocated() - before) / 2**20
            resident = before / 2**20
        else:
            step()
            peak = resident = float("nan")
        if native:
            counted = sum(t.numel() * t.element_size() for p in named.values() for t in _tensors(p, optimizer))
            per_parameter = counted / sum(p.numel() for p in named.values())
        else:
            per_parameter = polyamp_torch.measure_state_bytes(optimizer).per_parameter
        rows[name] = {"bytes_per_parameter": per_parameter, "resident_mib": resident, "peak_step_mib": peak}
        steppers[name] = step
        keep.append((model, optimizer))
        print(f"torch {name}: built and stepped twice in {time.perf_counter() - started:.1f} s", flush=True)

    names = (*PLANS, *NATIVE)
    for name in names:
        build(name)
    parameters = sum(p.numel() for p in keep[0][0].parameters())
    timed = _interleaved(steppers, sync, rounds, steps)
    return _finish("torch", rows, timed, parameters, config, {"torch": torch.__version__})


def _tensors(parameter: Any, optimizer: Any) -> list[Any]:
    state = optimizer.state.get(parameter, {})
    found = [parameter]
    if parameter.grad is not None:
        found.append(parameter.grad)
    found += [v for k, v in state.items() if k != "step" and getattr(v, "is_floating_point", lambda: False)()]
    return found


def _jax(config: Config, rounds: int, steps: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    import polyamp_jax

    import polyamp
    from benchmarks.training_state_jax import loss_fn

    weights = initial_weights(config, 0)
    mask = {name: decayed(name, w) for name, w in weights.items()}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab, (config.batch, config.sequence + 1)))
    rows: dict[str, dict[str, Any]] = {}
    steppers: dict[str, Callable[[], None]] = {}
    for plan in PLANS:
        policy = polyamp.Policy(POLICY_OF.get(plan, plan))
        params = {name: jnp.asarray(w, dtype=policy.param_dtype) for name, w in weights.items()}
        inner = optax.adamw(
            config.lr,
            b1=config.betas[0],
            b2=config.betas[1],
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=mask,
        )
        tx = polyamp_jax.precision(inner, policy, seed=0)

        @jax.jit
        def step(params: Any, state: Any, tokens: jax.Array, tx: Any = tx) -> tuple[Any, Any, jax.Array]:
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, config)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        holder = {"params": params, "state": tx.init(params)}

        def stepper(holder: dict[str, Any] = holder, step: Any = step) -> None:
            holder["params"], holder["state"], holder["loss"] = step(holder["params"], holder["state"], tokens)

        grads = jax.grad(loss_fn)(params, tokens, config)
        counted = polyamp_jax.measure_state_bytes(params, holder["state"], grads)
        del grads
        rows[plan] = {"bytes_per_parameter": counted.per_parameter, "resident_mib": None, "peak_step_mib": None}
        print(f"jax {plan}: built", flush=True)
        steppers[plan] = stepper
    parameters = sum(int(np.prod(w.shape)) for w in weights.values())

    def sync() -> None:
        for stepper in steppers.values():
            holder = stepper.__defaults__[0]  # type: ignore[index]
            if "loss" in holder:
                holder["loss"].block_until_ready()

    timed = _interleaved(steppers, sync, rounds, steps)
    return _finish("jax", rows, timed, parameters, config, {"jax": jax.__version__, "optax": optax.__version__})


def _finish(
    backend: str,
    rows: dict[str, dict[str, Any]],
    timed: dict[str, float],
    parameters: int,
    config: Config,
    versions: dict[str, str],
) -> dict[str, Any]:
    tokens = config.batch * config.sequence
    for name, row in rows.items():
        row["ms_per_step"] = timed[name]
        row["tokens_per_second"] = tokens / (timed[name] / 1e3)
        row["time_ratio"] = timed[name] / timed[REFERENCE]
    return {"backend": backend, "parameters": parameters, "versions": versions, "plans": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Torch in this process, JAX (when it sees a GPU, or with --device cpu) in a subprocess; one payload."""
    config = _config(args.quick)
    rounds = 2 if args.quick else args.rounds
    steps = 1 if args.quick else 10
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-training-state needs a CUDA device; use --device cpu --quick only to smoke-test the code")
    warnings.simplefilter("ignore", polyamp.TrainingStateWarning)  # the nearest plan is measured on purpose
    results = [_torch(config, args.device, rounds, steps)]
    del torch
    Path(args.out).mkdir(parents=True, exist_ok=True)
    part = Path(args.out) / "gpu-training-state-jax.part.json"
    command = [sys.executable, "-m", "benchmarks.training_state_gpu", str(part), "--rounds", str(rounds)]
    if args.quick:
        command.append("--quick")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    notes = []
    code = subprocess.run(command, env=env, cwd=Path(__file__).resolve().parent.parent, check=False).returncode
    if code == 0:
        results.append(json.loads(part.read_text()))
        part.unlink()
    else:
        notes.append(f"the JAX part did not run (exit {code}: JAX, optax or JAX's GPU backend is missing)")

    def cells(result: dict[str, Any], values: dict[str, Any]) -> list[str]:
        return [
            f"{values['bytes_per_parameter']:.2f}",
            _common.fmt_ms(values["ms_per_step"]),
            f"{values['tokens_per_second'] / 1e3:.1f}k",
            _common.fmt_ratio(values["time_ratio"]),
            "n/a" if values["peak_step_mib"] is None else f"{values['peak_step_mib']:.0f}",
        ]

    rows = plan_rows(results, cells)
    c = config
    accelerator = None
    if args.device == "cuda":
        import torch

        accelerator = torch.cuda.get_device_name(0)
    return _common.result(
        "gpu-training-state",
        "Training-state plans on a GPU: AdamW on a 34M-parameter GPT, step time and memory",
        quick=args.quick,
        env=_common.environment(args.device, accelerator=accelerator),
        tables=[
            {
                "caption": "ms per step = median of rounds of 10 steps, every plan interleaved in one process; "
                "'time vs' = step time against the bfloat16_float32_master plan of the same backend; bytes/param of "
                "the training state counted from the tensors; peak step MiB = peak GPU memory of one step above "
                "what was resident before it (torch)",
                "columns": ["backend", "plan", "bytes/param", "ms/step", "tokens/s", "time vs", "peak step MiB"],
                "rows": rows,
            }
        ],
        notes=[
            f"{c.layers}-layer GPT, width {c.width}, {c.heads} heads, vocabulary {c.vocab}, sequence {c.sequence}, "
            f"batch {c.batch} ({results[0]['parameters'] / 1e6:.1f}M parameters); AdamW, random tokens; torch: "
            "PrecisionOptimizer over AdamW(fused=True) (foreach on CPU), the natives with fused=True; JAX: precision(optax.adamw) "
            "in one jitted step",
            *notes,
        ],
        raw=results,
    )


def main(argv: list[str] | None = None) -> int:
    """The JAX part alone: ``python -m benchmarks.training_state_gpu OUT.json [--rounds N] [--quick]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training_state_gpu")
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", polyamp.TrainingStateWarning)  # the nearest plan is measured on purpose
    result = _jax(_config(args.quick), args.rounds, 1 if args.quick else 10)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
