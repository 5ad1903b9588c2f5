"""polyamp_jax with the frameworks JAX users train with: Flax Linen (``autocast(model.apply)``, a training loop
with ``loss_scaled``) and Equinox (``autocast`` of a module, ``filter_value_and_grad`` with ``loss_scaled``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import polyamp_jax  # noqa: E402

import polyamp  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _bytes(tree: Any) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def _dtypes(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf: jnp.dtype(leaf.dtype).name, tree)


def _data(n: int = 16, features: int = 6, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    return jnp.asarray(x), jnp.asarray(x[:, :4].argmax(axis=1).astype("int32"))


def test_importing_polyamp_jax_loads_neither_flax_nor_equinox() -> None:
    probe = "import polyamp_jax, sys, json; print(json.dumps([m for m in ('flax', 'equinox') if m in sys.modules]))"
    path = [str(ROOT), str(ROOT / "backends" / "jax")]
    env = {"PYTHONPATH": ":".join(path), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, env=env)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# -- Flax Linen -----------------------------------------------------------------------------------------------

nn = pytest.importorskip("flax.linen")


class _Net(nn.Module):  # type: ignore[misc]
    """Dense, batch norm, dropout, layer norm, dense: the layers whose dtypes a policy changes."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.Dropout(0.1, deterministic=not train)(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


def _linen_variables(x: jax.Array) -> Any:
    return _Net().init(jax.random.PRNGKey(0), x, train=False)


def test_linen_apply_runs_by_op_class_with_float32_params_and_outputs() -> None:
    x, _ = _data()
    variables = _linen_variables(x)
    assert set(jax.tree_util.tree_leaves(_dtypes(variables))) == {"float32"}
    apply = polyamp_jax.autocast(_Net().apply, policy="mixed_float16")
    rngs = {"dropout": jax.random.PRNGKey(1)}

    def train(v: Any, xb: jax.Array) -> Any:
        return apply(v, xb, train=True, rngs=rngs, mutable=["batch_stats"])

    jaxpr = str(jax.make_jaxpr(train)(variables, x))
    assert "f16[16,32] = dot_general" in jaxpr and "f16[16,4] = dot_general" in jaxpr  # matmuls in float16
    assert "f32[16] = rsqrt" in jaxpr or "f32[16,1] = rsqrt" in jaxpr  # layer norm's statistics in float32
    logits, updates = train(variables, x)
    assert logits.dtype == jnp.float32  # the output dtype
    assert set(jax.tree_util.tree_leaves(_dtypes(updates))) == {"float32"}  # batch_stats as stored
    _, state = apply(variables, x, train=False, capture_intermediates=True)
    computed = {
        name: value["__call__"][0].dtype for name, value in state["intermediates"].items() if name != "__call__"
    }
    assert computed == {
        "Dense_0": jnp.float16,
        "BatchNorm_0": jnp.float32,
        "Dropout_0": jnp.float32,
        "LayerNorm_0": jnp.float32,
        "Dense_1": jnp.float16,
    }
    # bfloat16: the same classes
    assert "bf16[16,32] = dot_general" in str(
        jax.make_jaxpr(lambda v, xb: polyamp_jax.autocast(_Net().apply, policy="mixed_bfloat16")(v, xb, train=False))(
            variables, x
        )
    )


def test_linen_batch_statistics_are_not_rounded_to_the_compute_dtype() -> None:
    """Running means of about 1000 (float16's spacing there is 0.5): updated under autocast, they match the float32
    model's to the batch statistic's float16 error, not to the 0.5 a round trip through float16 would cost."""
    x, _ = _data()
    variables = _linen_variables(x)
    stats = variables["batch_stats"]["BatchNorm_0"]
    variables = {
        "params": variables["params"],
        "batch_stats": {"BatchNorm_0": {"mean": 1000.3 + jnp.arange(32.0) * 0.01, "var": stats["var"]}},
    }
    reference = _Net().apply(variables, x, train=True, rngs={"dropout": jax.random.PRNGKey(1)}, mutable=["batch_stats"])
    ours = polyamp_jax.autocast(_Net().apply, policy="mixed_float16")(
        variables, x, train=True, rngs={"dropout": jax.random.PRNGKey(1)}, mutable=["batch_stats"]
    )
    want = np.asarray(reference[1]["batch_stats"]["BatchNorm_0"]["mean"])
    got = np.asarray(ours[1]["batch_stats"]["BatchNorm_0"]["mean"])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=2e-3)
    # had the running means entered in float16 (1000.3 -> 1000.5), the update would be off by about 0.18
    mean = np.asarray(variables["batch_stats"]["BatchNorm_0"]["mean"])
    batch_mean = (want - 0.9 * mean) / 0.1
    rounded = 0.9 * mean.astype(np.float16).astype(np.float32) + 0.1 * batch_mean
    assert np.max(np.abs(rounded - want)) > 0.1


def test_module_dtypes_gives_linen_layers_the_policy() -> None:
    assert polyamp_jax.module_dtypes("mixed_bfloat16") == {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
    layer = nn.Dense(8, **polyamp_jax.module_dtypes("mixed_float16"))
    x, _ = _data()
    variables = layer.init(jax.random.PRNGKey(0), x)
    assert _dtypes(variables) == {"params": {"bias": "float32", "kernel": "float32"}}
    assert layer.apply(variables, x).dtype == jnp.float16
    with polyamp.policy_scope("mixed_bfloat16"):
        assert polyamp_jax.module_dtypes()["dtype"] == jnp.bfloat16


def test_a_linen_training_loop_with_loss_scaled_skips_an_injected_overflow() -> None:
    """Linen under mixed_float16 with optax + loss_scaled under jax.jit: the step with an inf gradient leaves
    the parameters and the optimizer state bitwise as they were, is recorded, and halves the scale."""
    x, y = _data(32)
    variables = _linen_variables(x)
    apply = polyamp_jax.autocast(_Net().apply, policy="mixed_float16")
    tx = polyamp_jax.loss_scaled(optax.adam(1e-2), enabled=True)

    @jax.jit
    def step(params, batch_stats, opt_state, key, bad):  # type: ignore[no-untyped-def]
        def loss_fn(p):  # type: ignore[no-untyped-def]
            logits, updates = apply(
                {"params": p, "batch_stats": batch_stats}, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return polyamp_jax.scale_loss(opt_state, loss), (loss, updates["batch_stats"])

        (_, (loss, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.inf, g), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    params, batch_stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)
    losses = []
    for index in range(12):
        before = _bytes((params, opt_state.inner))
        key = jax.random.fold_in(jax.random.PRNGKey(2), index)
        params, batch_stats, opt_state, loss = step(params, batch_stats, opt_state, key, jnp.asarray(index == 4))
        losses.append(float(loss))
        assert (_bytes((params, opt_state.inner)) == before) == (index == 4)
    assert set(jax.tree_util.tree_leaves(_dtypes(params))) == {"float32"}
    records = polyamp_jax.records(opt_state)
    assert [(r.skipped, r.reason) for r in records] == [(i == 4, "overflow" if i == 4 else None) for i in range(12)]
    assert polyamp_jax.state_dict(opt_state)["scale"] == 32768.0
    assert losses[-1] < losses[0]


# -- Equinox --------------------------------------------------------------------------------------------------

eqx = pytest.importorskip("equinox")


class _EqxNet(eqx.Module):  # type: ignore[misc]
    """A module with a non-array leaf (the activation) and a static field."""

    first: Any
    norm: Any
    last: Any
    activation: Any
    width: int = eqx.field(static=True)

    def __init__(self, key: jax.Array, width: int = 16) -> None:
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(6, width, key=k1)
        self.norm = eqx.nn.LayerNorm(width)
        self.last = eqx.nn.Linear(width, 4, key=k2)
        self.activation = jax.nn.gelu
        self.width = width

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.last(self.norm(self.activation(self.first(x))))


def test_equinox_modules_cast_and_autocast_keep_static_fields_and_non_array_leaves() -> None:
    model = _EqxNet(jax.random.PRNGKey(0))
    half = polyamp_jax.cast_to_compute(model, "mixed_float16")
    assert (half.first.weight.dtype, half.norm.weight.dtype) == (jnp.float16, jnp.float16)
    assert half.activation is jax.nn.gelu and half.width == 16 and half.first.in_features == 6
    assert jax.tree_util.tree_structure(half) == jax.tree_util.tree_structure(model)
    x, _ = _data()
    run = polyamp_jax.autocast(model, policy="mixed_float16")
    jaxpr = str(jax.make_jaxpr(jax.vmap(run))(x))
    assert "f16[16,16] = dot_general" in jaxpr or "f16[16,16] = transpose" in jaxpr
    assert "f16[4,16] = dot_general" in jaxpr or "f16[16,4] = dot_general" in jaxpr
    assert "f32[16] = reduce_sum" in jaxpr  # the layer norm's statistics
    out = eqx.filter_jit(lambda m, xb: jax.vmap(polyamp_jax.autocast(m, policy="mixed_float16"))(xb))(model, x)
    assert out.dtype == jnp.float32 and out.shape == (16, 4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.vmap(model)(x)), atol=5e-2)
    bound = polyamp_jax.autocast(model.__call__, policy="mixed_float16", cast_outputs=False)
    assert bound(x[0]).dtype == jnp.float16  # a bound method's module enters as an argument


def test_equinox_training_with_loss_scaled_skips_an_injected_overflow() -> None:
    """eqx.filter_jit + eqx.filter_value_and_grad + loss_scaled, the model under mixed_float16 through autocast:
    the step with an inf gradient leaves the model (and the optimizer state) bitwise as they were and is
    recorded; the static field and the activation survive training."""
    x, y = _data(32)
    model = _EqxNet(jax.random.PRNGKey(1))
    tx = polyamp_jax.loss_scaled(optax.adam(1e-2), enabled=True)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, bad):  # type: ignore[no-untyped-def]
        def loss_fn(m):  # type: ignore[no-untyped-def]
            logits = jax.vmap(polyamp_jax.autocast(m, policy="mixed_float16"))(x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return polyamp_jax.scale_loss(opt_state, loss), loss

        (_, loss), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.inf, g), grads)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for index in range(10):
        before = _bytes((eqx.filter(model, eqx.is_array), opt_state.inner))
        model, opt_state, loss = step(model, opt_state, jnp.asarray(index == 3))
        losses.append(float(loss))
        assert (_bytes((eqx.filter(model, eqx.is_array), opt_state.inner)) == before) == (index == 3)
    assert model.activation is jax.nn.gelu and model.width == 16
    assert set(jax.tree_util.tree_leaves(_dtypes(eqx.filter(model, eqx.is_array)))) == {"float32"}
    records = polyamp_jax.records(opt_state)
    assert [(r.skipped, r.reason) for r in records] == [(i == 3, "overflow" if i == 3 else None) for i in range(10)]
    assert losses[-1] < losses[0]
