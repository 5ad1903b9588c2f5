"""A small classifier in plain JAX + optax under polyamp: the policy's casting, polyamp's loss scaling as an
optax transformation, overflows injected at chosen steps and skipped exactly there.

    python examples/jax_optax.py --policy mixed_float16 --steps 40 --overflow-at 5,17
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
import polyamp_jax

import polyamp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_float16", help="mixed_float16 (scaling) or mixed_bfloat16 (guard)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--overflow-at", default="5,17", help="steps whose gradients get an inf")
    args = parser.parse_args()
    bad_steps = {int(s) for s in args.overflow_at.split(",") if s}

    polyamp.set_policy(args.policy)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(512, 16)).astype("float32"))
    y = jnp.asarray((np.asarray(x)[:, :4].argmax(axis=1)).astype("int32"))
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = polyamp_jax.cast_to_param(
        {
            "w1": jax.random.normal(k1, (16, 64)) * 0.25,
            "b1": jnp.zeros(64),
            "w2": jax.random.normal(k2, (64, 4)) * 0.125,
            "b2": jnp.zeros(4),
        }
    )

    def loss_fn(p: dict[str, jax.Array], xb: jax.Array, yb: jax.Array) -> jax.Array:
        p, xb = polyamp_jax.cast_to_compute(p), polyamp_jax.cast_to_compute(xb)  # the policy in effect
        logits = polyamp_jax.cast_to_output(jax.nn.relu(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), yb).mean()

    tx = polyamp_jax.loss_scaled(optax.adam(3e-3))  # scales under float16 policies, guards under bfloat16
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb, bad):  # type: ignore[no-untyped-def]
        def scaled(p):  # type: ignore[no-untyped-def]
            loss = loss_fn(p, xb, yb)
            return polyamp_jax.scale_loss(opt_state, loss), loss

        (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        grads = {**grads, "w1": jnp.where(bad, grads["w1"].at[0, 0].set(jnp.inf), grads["w1"])}  # injected overflow
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mode = polyamp_jax.scaler_of(opt_state).mode
    print(f"policy {args.policy}: compute {polyamp.get_policy().compute_dtype}, loss scaler {mode}")
    first = None
    for index in range(args.steps):
        batch = slice((index * 64) % 512, (index * 64) % 512 + 64)
        params, opt_state, loss = step(params, opt_state, x[batch], y[batch], jnp.asarray(index in bad_steps))
        first = float(loss) if first is None else first
    skipped = [r.iteration for r in polyamp_jax.records(opt_state) if r.skipped]
    print(
        f"loss {first:.4f} -> {float(loss):.4f}; skipped steps {skipped}; scale {polyamp_jax.state_dict(opt_state)['scale']}"
    )


if __name__ == "__main__":
    main()
