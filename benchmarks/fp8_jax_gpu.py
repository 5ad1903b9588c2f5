"""The JAX/Flax FP8 speed check on an H100/H200: a stack of matmul-bound Flax MLP blocks, hidden 4096.

Variants, from identical weights, timed in interleaved rounds (`benchmarks._common.interleaved`), one
iteration = one ``jax.jit`` step (forward, backward, ``optax.adamw`` through Flax's ``TrainState``) on
``batch x length`` tokens (default 8 x 2048); each block is ``x + Dense(hidden)(gelu(Dense(4 * hidden)(x)))``
without biases:

* ``bfloat16``: Flax's ``nn.Dense(dtype=jnp.bfloat16)`` (float32 parameters, bfloat16 compute), the baseline;
* ``polyamp tensorwise`` / ``polyamp rowwise`` / ``polyamp delayed``: the same layers with
  ``dot_general_cls=polyamp_jax.Float8DotGeneral`` under ``"float8_tensorwise"`` / ``"float8_rowwise"`` /
  ``"float8_delayed"``;
* ``flax delayed``: Flax's own ``nn.Fp8DirectDotGeneralOp`` (delayed scaling), the peer;
* ``autocast tensorwise``: the float32 model under ``polyamp_jax.autocast(policy="mixed_bfloat16+float8_tensorwise")``.

Target: an FP8 step >= 1.2x the bfloat16 step (polyamp tensorwise), with polyamp delayed within 3% of Flax's.
The result (command, device, versions, every round's times) goes to ``benchmarks/results/fp8-jax-gpu.json``.

    python benchmarks/fp8_jax_gpu.py           # on the GPU machine
    python benchmarks/fp8_jax_gpu.py --quick   # a smoke run of the code at toy sizes, on any device
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

VARIANTS = (
    "bfloat16",
    "polyamp tensorwise",
    "polyamp rowwise",
    "polyamp delayed",
    "flax delayed",
    "autocast tensorwise",
)


def _model(hidden: int, layers: int, dot: Any, dtype: Any) -> Any:
    """The block stack: ``dot`` is the Dense layers' ``dot_general_cls`` (None: Flax's own product)."""
    import flax.linen as nn

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            dense = functools.partial(nn.Dense, use_bias=False, dtype=dtype)
            if dot is not None:
                dense = functools.partial(dense, dot_general_cls=dot)
            for _ in range(layers):
                x = x + dense(hidden)(nn.gelu(dense(4 * hidden)(x)))
            return x

    return Stack()


def make_steps(hidden: int, layers: int, tokens: int) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """One callable per variant running one training step on its own state, and a sync over all of them."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    import polyamp_jax
    from flax.training import train_state

    bf16 = jnp.bfloat16
    models = {
        "bfloat16": _model(hidden, layers, None, bf16),
        "polyamp tensorwise": _model(
            hidden, layers, functools.partial(polyamp_jax.Float8DotGeneral, recipe="float8_tensorwise"), bf16
        ),
        "polyamp rowwise": _model(
            hidden, layers, functools.partial(polyamp_jax.Float8DotGeneral, recipe="float8_rowwise"), bf16
        ),
        "polyamp delayed": _model(
            hidden, layers, functools.partial(polyamp_jax.Float8DotGeneral, recipe="float8_delayed"), bf16
        ),
        "flax delayed": _model(hidden, layers, nn.Fp8DirectDotGeneralOp, bf16),
    }
    plain = _model(hidden, layers, None, jnp.float32)
    x = jax.random.normal(jax.random.key(1), (tokens, hidden), jnp.float32)
    y = jax.random.normal(jax.random.key(2), (tokens, hidden), jnp.float32)
    # identical weights: every variant starts from the bfloat16 model's parameters
    params = models["bfloat16"].init(jax.random.key(0), x)["params"]

    def state_for(model: Any) -> Any:
        variables = dict(model.init(jax.random.key(0), x))
        variables["params"] = jax.tree_util.tree_map(jnp.copy, params)  # each state's own: steps donate them
        return train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adamw(1e-4))

    def step_for(apply: Callable[..., Any]) -> Callable[..., Any]:
        @functools.partial(jax.jit, donate_argnums=0)
        def step(state: Any, x: Any, y: Any) -> Any:
            def loss(variables: Any) -> Any:
                return jnp.mean(jnp.square(apply(variables, x).astype(jnp.float32) - y))

            return state.apply_gradients(grads=jax.grad(loss)(state.params))

        return step

    states = {name: state_for(model) for name, model in models.items()}
    steps = {name: step_for(model.apply) for name, model in models.items()}
    autocast = polyamp_jax.autocast(plain.apply, policy="mixed_bfloat16+float8_tensorwise")
    states["autocast tensorwise"] = state_for(plain)
    steps["autocast tensorwise"] = step_for(autocast)

    def runner(name: str) -> Callable[[], None]:
        def run() -> None:
            states[name] = steps[name](states[name], x, y)

        return run

    return {name: runner(name) for name in VARIANTS}, lambda: jax.block_until_ready(list(states.values()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu" and not args.quick:
        raise SystemExit("fp8_jax_gpu needs a GPU JAX backend (or --quick for a smoke run)")
    hidden, layers, tokens = (64, 2, 64) if args.quick else (args.hidden, args.layers, args.batch * args.length)
    variants, sync = make_steps(hidden, layers, tokens)
    times = _common.interleaved(
        variants,
        iters=1 if args.quick else args.iters,
        rounds=2 if args.quick else args.rounds,
        warmup=1 if args.quick else 5,
        sync=sync,
    )
    summary = _common.summarize(times, "bfloat16")
    speedup = {name: 1.0 / summary[name]["ratio"] for name in VARIANTS}
    for name in VARIANTS:
        print(name, round(summary[name]["median_ms"], 2), "ms", round(speedup[name], 3), "x", flush=True)
    rows = [[name, _common.fmt_ms(summary[name]["median_ms"]), f"{speedup[name]:.3f}x"] for name in VARIANTS]
    against_flax = summary["polyamp delayed"]["median_ms"] / summary["flax delayed"]["median_ms"]
    name = getattr(device, "device_kind", device.platform)
    return _common.result(
        "fp8-jax-gpu",
        f"JAX/Flax FP8 on {name}: MLP blocks {layers} x {hidden}, {tokens} tokens, jax.jit",
        quick=args.quick,
        env={
            **_common.environment(device.platform, accelerator=name),
            "flax": _common._version("flax"),
            "optax": _common._version("optax"),
            "jaxlib": _common._version("jaxlib"),
        },
        tables=[
            {
                "caption": "step time (forward, backward, AdamW) and speed-up over bfloat16",
                "columns": ["variant", "ms", "speed-up"],
                "rows": rows,
            }
        ],
        notes=[
            f"polyamp delayed / flax delayed step time: {against_flax:.3f} (target: within 1.03).",
            "Target over bfloat16: polyamp tensorwise >= 1.2x.",
        ],
        raw={"times_ms": times},
    )


def main(argv: list[str] | None = None) -> int:
    parser = _common.gpu_stack_parser(__doc__)
    args = parser.parse_args(argv)
    _common.write(Path(args.out), run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
