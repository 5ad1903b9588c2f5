"""A small Flax Linen classifier under polyamp: op classes through ``polyamp_jax.autocast(model.apply)``, loss
scaling (or the bfloat16 guard) as an optax transformation, overflows injected at chosen steps and skipped
exactly there, the skipped steps' records naming the parameter that overflowed.

    python examples/jax_flax.py --policy mixed_float16 --steps 40 --overflow-at 5,17
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import polyamp_jax

import polyamp


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(64)(x))  # the matmul in the compute dtype
        x = nn.LayerNorm()(x)  # its statistics in float32
        return nn.Dense(4)(x)


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
    model = Classifier()
    params = polyamp_jax.cast_to_param(model.init(jax.random.PRNGKey(0), x[:1]))  # float32 parameters
    apply = polyamp_jax.autocast(model.apply)  # compute dtype in, op classes inside, output dtype out

    tx = polyamp_jax.loss_scaled(optax.adam(3e-3))  # scales under float16 policies, guards under bfloat16
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb, bad):  # type: ignore[no-untyped-def]
        def scaled(p):  # type: ignore[no-untyped-def]
            logits = apply(p, xb).astype(jnp.float32)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
            return polyamp_jax.scale_loss(opt_state, loss), loss

        (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        kernel = grads["params"]["Dense_0"]["kernel"]
        kernel = jnp.where(bad, kernel.at[0, 0].set(jnp.inf), kernel)  # the injected overflow
        grads = {"params": {**grads["params"], "Dense_0": {**grads["params"]["Dense_0"], "kernel": kernel}}}
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mode = polyamp_jax.scaler_of(opt_state).mode
    print(f"policy {args.policy}: compute {polyamp.get_policy().compute_dtype}, loss scaler {mode}")
    first = None
    named: set[str] = set()
    for index in range(args.steps):
        batch = slice((index * 64) % 512, (index * 64) % 512 + 64)
        params, opt_state, loss = step(params, opt_state, x[batch], y[batch], jnp.asarray(index in bad_steps))
        first = float(loss) if first is None else first
        for record in polyamp_jax.records(opt_state):  # the most recent skip names its gradients
            named.update(g.name for g in record.gradients)
    skipped = [r.iteration for r in polyamp_jax.records(opt_state) if r.skipped]
    print(f"loss {first:.4f} -> {float(loss):.4f}; skipped steps {skipped}; non-finite gradients in {sorted(named)}")


if __name__ == "__main__":
    main()
