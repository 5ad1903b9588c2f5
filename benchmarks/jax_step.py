"""Target: a jitted JAX training step with polyamp_jax against a hand-written jmp-style step and plain float32
optax, on the same model in one run.

The model: an MLP of ``depth`` x (Dense width, gelu) and a 16-class head, batch 64, inner ``optax.adam``.
Variants, each one ``jax.jit`` of the whole step, from identical initial weights:

* ``float32 optax``: no casting, no loss scaling (the float32 floor);
* ``jmp-style``: parameters and inputs cast to float16 with ``jmp.get_policy``, ``jmp.DynamicLossScale``
  (scale, unscale, ``all_finite``, ``select_tree`` over parameters and optimizer state, ``adjust``): the step
  users write by hand today;
* ``polyamp``: ``polyamp_jax.cast_to_compute`` under ``mixed_float16`` and ``polyamp_jax.loss_scaled(adam)``
  (with its step-record ring).

Reported: median ms per step, and the median over interleaved rounds of (variant / jmp-style) in the same
round. The target is ``polyamp`` <= 1.02x the jmp-style step.

Run: python benchmarks/run.py jax [--quick] [--rounds 21]
"""

from __future__ import annotations

import time
from typing import Any

VARIANTS = ("jmp-style", "float32 optax", "polyamp")


def _steps(width: int, depth: int, batch: int) -> tuple[dict[str, Any], Any, Any]:
    import jax
    import jax.numpy as jnp
    import jmp
    import numpy as np
    import optax
    import polyamp_jax

    import polyamp

    keys = jax.random.split(jax.random.PRNGKey(0), depth + 1)
    params: dict[str, Any] = {}
    fan_in = width
    for i in range(depth):
        params[f"w{i}"] = jax.random.normal(keys[i], (fan_in, width)) / np.sqrt(fan_in)
        params[f"b{i}"] = jnp.zeros(width)
    params["head"] = jax.random.normal(keys[depth], (width, 16)) / np.sqrt(width)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(batch, width)).astype("float32"))
    y = jax.device_put(rng.integers(0, 16, size=(batch,)).astype("int32"))

    def forward(p: Any, xb: Any) -> Any:
        h = xb
        for i in range(depth):
            h = jax.nn.gelu(h @ p[f"w{i}"] + p[f"b{i}"])
        return (h @ p["head"]).astype(jnp.float32)

    def loss_fn(p: Any, xb: Any, yb: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, xb), yb).mean()

    inner = optax.adam(1e-4)

    @jax.jit
    def float32_step(state: Any) -> Any:
        p, opt = state
        grads = jax.grad(loss_fn)(p, x, y)
        updates, opt = inner.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt

    policy = jmp.get_policy("params=float32,compute=float16,output=float32")

    @jax.jit
    def jmp_step(state: Any) -> Any:
        p, opt, scale = state

        def scaled(p: Any) -> Any:
            return scale.scale(loss_fn(policy.cast_to_compute(p), policy.cast_to_compute(x), y))

        grads = scale.unscale(jax.grad(scaled)(p))
        finite = jmp.all_finite(grads)
        updates, new_opt = inner.update(grads, opt, p)
        p = jmp.select_tree(finite, optax.apply_updates(p, updates), p)
        opt = jmp.select_tree(finite, new_opt, opt)
        return p, opt, scale.adjust(finite)

    with polyamp.policy_scope("mixed_float16"):
        tx = polyamp_jax.loss_scaled(optax.adam(1e-4))

    @jax.jit
    def polyamp_step(state: Any) -> Any:
        p, opt = state

        def scaled(p: Any) -> Any:
            loss = loss_fn(
                polyamp_jax.cast_to_compute(p, "mixed_float16"), polyamp_jax.cast_to_compute(x, "mixed_float16"), y
            )
            return polyamp_jax.scale_loss(opt, loss)

        updates, opt = tx.update(jax.grad(scaled)(p), opt, p)
        return optax.apply_updates(p, updates), opt

    steps = {"jmp-style": jmp_step, "float32 optax": float32_step, "polyamp": polyamp_step}
    states = {
        "jmp-style": (params, inner.init(params), jmp.DynamicLossScale(jnp.float32(2.0**16))),
        "float32 optax": (params, inner.init(params)),
        "polyamp": (params, tx.init(params)),
    }
    return steps, states, jax


def _time(rounds: int, per_round: int, width: int, depth: int, batch: int) -> dict[str, list[float]]:
    steps, states, jax = _steps(width, depth, batch)
    for name in VARIANTS:  # compile and warm up
        for _ in range(5):
            states[name] = steps[name](states[name])
        jax.block_until_ready(states[name])
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for index in range(rounds):
        order = VARIANTS if index % 2 == 0 else tuple(reversed(VARIANTS))
        for name in order:
            state = states[name]
            start = time.perf_counter()
            for _ in range(per_round):
                state = steps[name](state)
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - start) / per_round * 1e3)
            states[name] = state
    return times


def run(args: Any) -> dict[str, Any]:
    import jax
    import optax

    from benchmarks import _common

    rounds, per_round = (2, 3) if args.quick else (args.rounds, 50)
    on_gpu = jax.default_backend() == "gpu"
    shapes = [(64, 4, 64)] if args.quick else [(256, 4, 64), (1024, 4, 256)] + ([(4096, 3, 512)] if on_gpu else [])
    rows, raw = [], []
    for width, depth, batch in shapes:
        times = _time(rounds, per_round, width, depth, batch)
        summary = _common.summarize(times, VARIANTS[0])
        model = f"{depth} x (Dense {width} gelu), batch {batch}"
        rows.append(
            [
                model,
                _common.fmt_ms(summary["jmp-style"]["median_ms"]),
                _common.fmt_ratio(summary["float32 optax"]["ratio"]),
                _common.fmt_ratio(summary["polyamp"]["ratio"]),
            ]
        )
        raw.append({"model": model, "summary": summary, "times_ms": times})
        print(model, {k: round(v["ratio"], 3) for k, v in summary.items()}, flush=True)
    return _common.result(
        "jax-cuda" if on_gpu else "jax",
        "JAX training step: polyamp_jax vs a hand-written jmp-style step and float32 optax"
        + (" (CUDA)" if on_gpu else ""),
        quick=args.quick,
        env=_common.environment(
            "cuda" if on_gpu else "cpu", threads=None, accelerator=str(jax.devices()[0].device_kind) if on_gpu else None
        ),
        tables=[
            {
                "caption": "jitted step, mixed_float16 (jmp-style, polyamp) or float32, inner Adam: median ms of the "
                "jmp-style step and time ratios against it",
                "columns": ["model", "jmp-style ms", "float32 optax", "polyamp"],
                "rows": rows,
            }
        ],
        notes=[
            f"{rounds} interleaved rounds of {per_round} steps each; ratio: median over rounds of (variant / "
            "jmp-style in the same round). Wall time, XLA's "
            + ("GPU backend, each round ended with block_until_ready." if on_gpu else "CPU backend."),
            f"jax {jax.__version__}, optax {optax.__version__}.",
        ],
        raw=raw,
    )
