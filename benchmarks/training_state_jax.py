"""The ``training-state`` benchmark's model and step on JAX with optax (see `benchmarks.training_state`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import polyamp_jax

import polyamp
from benchmarks.training_state import POLICY_OF, Chain, Config, Run, decayed, initial_weights, run_steps


def _layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * g.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def forward(params: dict[str, jax.Array], tokens: jax.Array, config: Config) -> jax.Array:
    """The GPT of `benchmarks.training_state_torch.GPT`, in the parameters' dtype with float32 norms, softmax
    and loss."""
    c = config
    batch, length = tokens.shape
    dtype = params["wte"].dtype
    x = params["wte"][tokens] + params["wpe"][:length]
    mask = jnp.triu(jnp.ones((length, length), bool), 1)
    for i in range(c.layers):
        h = _layer_norm(x, params[f"h{i}.ln1.g"], params[f"h{i}.ln1.b"])
        qkv = h @ params[f"h{i}.attn.w"] + params[f"h{i}.attn.b"]
        q, k, v = (
            t.reshape(batch, length, c.heads, c.width // c.heads).transpose(0, 2, 1, 3) for t in jnp.split(qkv, 3, -1)
        )
        scores = (q @ k.transpose(0, 1, 3, 2)).astype(jnp.float32) / math.sqrt(c.width // c.heads)
        attention = jax.nn.softmax(jnp.where(mask, -jnp.inf, scores), axis=-1).astype(dtype)
        y = (attention @ v).transpose(0, 2, 1, 3).reshape(batch, length, c.width)
        x = x + (y @ params[f"h{i}.proj.w"] + params[f"h{i}.proj.b"])
        h = _layer_norm(x, params[f"h{i}.ln2.g"], params[f"h{i}.ln2.b"])
        h = jax.nn.gelu(h @ params[f"h{i}.fc.w"] + params[f"h{i}.fc.b"], approximate=False)
        x = x + (h @ params[f"h{i}.out.w"] + params[f"h{i}.out.b"])
    x = _layer_norm(x, params["lnf.g"], params["lnf.b"])
    return x @ params["head.w"]


def loss_fn(params: dict[str, jax.Array], tokens: jax.Array, config: Config) -> jax.Array:
    logits = forward(params, tokens[:, :-1], config).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def train(plan: str, seed: int, config: Config, chain: Chain) -> Run:
    policy = polyamp.Policy(POLICY_OF.get(plan, plan))
    weights = initial_weights(config, seed)
    params = {name: jnp.asarray(w, dtype=policy.param_dtype) for name, w in weights.items()}
    mask = {name: decayed(name, w) for name, w in weights.items()}
    schedule = lambda count: jnp.asarray(  # noqa: E731
        [config.learning_rate(s) for s in range(config.steps)], jnp.float32
    )[jnp.minimum(count, config.steps - 1)]
    inner = optax.adamw(
        schedule, b1=config.betas[0], b2=config.betas[1], eps=config.eps, weight_decay=config.weight_decay, mask=mask
    )
    tx = polyamp_jax.precision(inner, policy, seed=seed)
    state = tx.init(params)

    @jax.jit
    def step(params: Any, state: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, config)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def one(tokens: np.ndarray) -> float:
        nonlocal params, state
        params, state, loss = step(params, state, jnp.asarray(tokens))
        return float(loss)

    batches = chain.batches(seed)
    losses, seconds = run_steps(config, batches, one)
    grads = jax.grad(loss_fn)(params, jnp.asarray(next(batches)), config)
    counted = polyamp_jax.measure_state_bytes(params, state, grads)
    timed = config.steps - config.untimed_steps
    return Run(plan, seed, losses, seconds, timed, counted.per_parameter, counted.breakdown())
