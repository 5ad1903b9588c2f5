"""polyamp_jax with the frameworks JAX users train with: Flax Linen (``autocast(model.apply)``, a training loop
with ``loss_scaled``), Flax's ``TrainState`` with `polyamp_jax.DynamicScale` side by side with Flax's own
``DynamicScale``, and Equinox (``autocast`` of a module, ``filter_value_and_grad`` with ``loss_scaled``)."""

from __future__ import annotations

import functools
import json
import math
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
from polyamp import InvalidConfigError, LossScaleConfig, PolyampTypeError  # noqa: E402

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


def _loss_scaled_run() -> tuple[Any, Any, Any, Any]:
    """A loss_scaled Adam (growth interval 2) and a jitted step that injects an inf gradient when asked; the
    parameters and state after three steps, the second one skipped."""
    params = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "bias": jnp.zeros(3)}}
    tx = polyamp_jax.loss_scaled(optax.adam(1e-2), enabled=True, growth_interval=2)
    x = jnp.linspace(-2.0, 2.0, 20).reshape(5, 4)

    @jax.jit
    def step(params: Any, opt_state: Any, bad: Any) -> tuple[Any, Any]:
        def loss_fn(p: Any) -> Any:
            return polyamp_jax.scale_loss(opt_state, jnp.mean(jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])))

        grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.inf, g), jax.grad(loss_fn)(params))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for bad in (False, True, False):
        params, opt_state = step(params, opt_state, jnp.asarray(bad))
    return tx, step, params, opt_state


def test_a_loss_scaled_state_checkpoints_with_flax_serialization() -> None:
    """flax.serialization writes a loss_scaled state (msgpack, as a TrainState's optimizer state) and restores it
    into a fresh tx.init(params): every array bit for bit, the gradients' names kept, and training on from it
    gives the same parameters, optimizer state and scale as training on from the original."""
    serialization = pytest.importorskip("flax.serialization")
    tx, step, params, opt_state = _loss_scaled_run()
    written = serialization.to_state_dict(opt_state)
    assert written.keys() == {"scaler", "inner"} and "names" not in written["scaler"]["provenance"]
    restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(opt_state))
    assert isinstance(restored, polyamp_jax.LossScaledState)
    assert _bytes(restored) == _bytes(opt_state)
    assert polyamp_jax.state_dict(restored) == polyamp_jax.state_dict(opt_state)
    ours, theirs = (params, restored), (params, opt_state)
    for bad in (False, True, False, False):
        ours, theirs = step(*ours, jnp.asarray(bad)), step(*theirs, jnp.asarray(bad))
    assert _bytes(ours) == _bytes(theirs)
    assert polyamp_jax.state_dict(ours[1]) == polyamp_jax.state_dict(theirs[1])
    (record,) = [r for r in polyamp_jax.records(ours[1]) if r.skipped and r.iteration == 4]
    assert [g.name for g in record.gradients] == ["dense/bias", "dense/kernel"]
    assert polyamp_jax.records(ours[1]) == polyamp_jax.records(theirs[1])
    # Restored where its run was never read (another process): its iterations' records, at unknown scales.
    elsewhere = polyamp_jax.loss_scaled(optax.adam(1e-2), enabled=True, growth_interval=2)
    moved = serialization.from_bytes(elsewhere.init(params), serialization.to_bytes(opt_state))
    assert [(r.iteration, r.skipped, r.scale) for r in polyamp_jax.records(moved)] == [
        (0, False, None),
        (1, True, None),
        (2, False, None),
    ]


# -- Flax TrainState with DynamicScale ----------------------------------------------------------------------

train_state = pytest.importorskip("flax.training.train_state")
flax_dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")


class _TrainState(train_state.TrainState):  # type: ignore[misc]
    batch_stats: Any = None
    dynamic_scale: Any = None


def _grad_step(state: Any, x: jax.Array, y: jax.Array, key: jax.Array, bad: jax.Array) -> Any:
    """Flax's mixed-precision gradient step (its ImageNet example's), the model under polyamp's float16 policy;
    ``bad`` makes the loss, and so the gradients, infinite."""
    apply = polyamp_jax.autocast(_Net().apply, policy="mixed_float16")

    def loss_fn(params: Any) -> Any:
        logits, updates = apply(
            {"params": params, "batch_stats": state.batch_stats},
            x,
            train=True,
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * jnp.where(bad, jnp.inf, 1.0)
        return loss, updates

    return state.dynamic_scale.value_and_grad(loss_fn, has_aux=True)(state.params)


def _apply_step(state: Any, result: Any) -> Any:
    """The optimizer step, kept only where the gradients are finite."""
    new_state = state.apply_gradients(grads=result.grad, batch_stats=result.aux[1]["batch_stats"])
    select = functools.partial(jnp.where, result.finite)
    return new_state.replace(
        params=jax.tree_util.tree_map(select, new_state.params, state.params),
        opt_state=jax.tree_util.tree_map(select, new_state.opt_state, state.opt_state),
        dynamic_scale=result.dynamic_scale,
    )


def _train_step(state: Any, x: jax.Array, y: jax.Array, key: jax.Array, bad: jax.Array) -> Any:
    result = _grad_step(state, x, y, key, bad)
    return _apply_step(state, result), result.finite, result.aux[0]


def _two_programs(state: Any, x: jax.Array, y: jax.Array, key: jax.Array, bad: jax.Array) -> Any:
    result = _jitted_grad_step(state, x, y, key, bad)
    return _jitted_apply_step(state, result), result.finite, result.aux[0]


_jitted_grad_step = jax.jit(_grad_step)
_jitted_apply_step = jax.jit(_apply_step)


@pytest.mark.parametrize(
    ("step", "make_tx"),
    [
        pytest.param(jax.jit(_train_step), lambda: optax.sgd(0.05), id="one-program-sgd"),
        pytest.param(
            _two_programs, lambda: optax.adam(1e-2), id="gradient-and-update-programs-adam", marks=pytest.mark.slow
        ),
    ],
)
def test_dynamic_scale_trains_a_train_state_bit_for_bit_like_flaxs(step: Any, make_tx: Any) -> None:
    """The same TrainState loop with Flax's DynamicScale and with polyamp_jax's, under jax.jit: natural float16
    overflows (the scale grows every 3 finite steps until the float16 backward overflows) and an injected one
    give the same finite flags, scales, fin_steps and losses, and bitwise equal parameters, optimizer states
    and batch statistics at every step; polyamp's records and reference rule agree."""
    x, y = _data(32)
    variables = _linen_variables(x)

    def make(dynamic_scale: Any) -> Any:
        return _TrainState.create(
            apply_fn=_Net().apply,
            params=variables["params"],
            tx=make_tx(),
            batch_stats=variables["batch_stats"],
            dynamic_scale=dynamic_scale,
        )

    flax_state = make(flax_dynamic_scale.DynamicScale(growth_interval=2))
    ours = make(polyamp_jax.DynamicScale(growth_interval=2))
    pattern = []
    for index in range(40):
        key, bad = jax.random.fold_in(jax.random.PRNGKey(3), index), jnp.asarray(index == 25)
        flax_state, flax_fin, flax_loss = step(flax_state, x, y, key, bad)
        ours, fin, loss = step(ours, x, y, key, bad)
        assert bool(fin) == bool(flax_fin), index
        assert np.asarray(ours.dynamic_scale.scale).tobytes() == np.asarray(flax_state.dynamic_scale.scale).tobytes()
        assert int(ours.dynamic_scale.fin_steps) == int(flax_state.dynamic_scale.fin_steps)
        assert np.asarray(loss).tobytes() == np.asarray(flax_loss).tobytes()
        assert _bytes((ours.params, ours.opt_state, ours.batch_stats)) == _bytes(
            (flax_state.params, flax_state.opt_state, flax_state.batch_stats)
        ), index
        pattern.append(not bool(fin))
    natural = [i for i, skipped in enumerate(pattern) if skipped and i != 25]
    assert pattern[25] and natural  # float16's own overflows, besides the injected one
    records = polyamp_jax.records(ours)
    assert [r.skipped for r in records] == pattern
    assert [r.next_scale for r in records] == LossScaleConfig(growth_interval=3).trajectory(pattern)
    assert polyamp_jax.state_dict(ours)["scale"] == float(flax_state.dynamic_scale.scale)


SETTINGS = [
    pytest.param({}, "FFFOFFFFFFOOF", id="defaults"),
    pytest.param(
        {"growth_factor": 1.1, "backoff_factor": 0.3, "growth_interval": 1, "scale": 1000.0, "minimum_scale": 100.0},
        "FFFOFFFFFOOOOOFFFFFFFOF",
        id="float32-rounded-factors-and-a-floor",
    ),
    pytest.param({"growth_interval": 5, "fin_steps": 4, "scale": 3.0}, "FFFFFFFOF", id="a-started-count"),
    pytest.param({"minimum_scale": None, "scale": 2.0**-120}, "OOOOOOFF", id="no-floor-above-2**-126"),
    pytest.param({"growth_interval": 0, "scale": 2.0**120}, "FFFFFOOFF", id="up-to-2**126"),
]


def _power_of_two(value: Any) -> bool:
    return math.frexp(float(value))[0] == 0.5


@pytest.mark.parametrize(("settings", "pattern"), SETTINGS)
def test_dynamic_scale_follows_flaxs_trajectory(settings: dict[str, Any], pattern: str) -> None:
    """Flax's settings translated (its growth counting, its float32 factors, its floor): step by step under jit,
    the scale's bits, fin_steps and the finite flag equal Flax's, and so do the value and the gradient, bit for
    bit at power-of-two scales and within one unit in the last place otherwise (Flax divides by the scale,
    polyamp multiplies by its float32 reciprocal)."""
    step = jax.jit(lambda ds, p: ds.value_and_grad(lambda q: q * q)(p))
    theirs, ours = flax_dynamic_scale.DynamicScale(**settings), polyamp_jax.DynamicScale(**settings)
    for char in pattern:
        p = jnp.float32(math.inf if char == "O" else 1.5)
        exact = _power_of_two(ours.scale)
        theirs, their_fin, their_value, their_grad = step(theirs, p)
        ours, fin, value, grad = step(ours, p)
        assert (bool(fin), int(ours.fin_steps)) == (bool(their_fin), int(theirs.fin_steps))
        assert np.float32(ours.scale).tobytes() == np.float32(theirs.scale).tobytes()
        assert (value.dtype, grad.dtype) == (their_value.dtype, their_grad.dtype) == (jnp.float32, jnp.float32)
        if exact:
            assert (np.asarray(value).tobytes(), np.asarray(grad).tobytes()) == (
                np.asarray(their_value).tobytes(),
                np.asarray(their_grad).tobytes(),
            )
        else:
            np.testing.assert_array_max_ulp(np.asarray(grad), np.asarray(their_grad), maxulp=1)
            np.testing.assert_array_max_ulp(np.asarray(value), np.asarray(their_value), maxulp=1)
    assert [r.skipped for r in polyamp_jax.records(ours)] == [c == "O" for c in pattern]


def test_the_scale_stops_where_its_float32_reciprocal_stops_being_normal() -> None:
    """The documented differences at float32's ends. At the top, Flax grows on to float32's largest value;
    polyamp's scale stops at 2**126, whose reciprocal (what it unscales with) is still a normal number. At the
    bottom, ``minimum_scale=None`` lets Flax's scale fall below 2**-126 (on this CPU, XLA flushes the subnormal
    to zero at once); polyamp's stays at 2**-126."""
    step = jax.jit(lambda ds, p: ds.value_and_grad(lambda q: q * q)(p))
    theirs = flax_dynamic_scale.DynamicScale(growth_interval=0, scale=2.0**125)
    ours = polyamp_jax.DynamicScale(growth_interval=0, scale=2.0**125)
    for _ in range(3):
        theirs, their_fin, _, their_grad = step(theirs, jnp.float32(0.5))
        ours, fin, _, grad = step(ours, jnp.float32(0.5))
        assert bool(fin) and bool(their_fin) and float(grad) == float(their_grad) == 1.0
    assert (float(theirs.scale), float(ours.scale)) == (float(np.finfo(np.float32).max), 2.0**126)
    theirs = flax_dynamic_scale.DynamicScale(minimum_scale=None, scale=2.0**-125)
    ours = polyamp_jax.DynamicScale(minimum_scale=None, scale=2.0**-125)
    for _ in range(3):
        theirs = step(theirs, jnp.float32(math.inf))[0]
        ours = step(ours, jnp.float32(math.inf))[0]
    assert float(theirs.scale) < 2.0**-126 and float(ours.scale) == 2.0**-126


def test_dynamic_scale_averages_over_a_named_axis_like_flaxs() -> None:
    """Two replicas (a named vmap, as pmap gives one), one with an inf gradient: the averaged gradients are
    non-finite on both, and both back off, as with Flax's."""

    def run(cls: Any) -> tuple[list[bool], list[float], np.ndarray]:
        ds = jax.tree_util.tree_map(lambda leaf: jnp.stack([leaf, leaf]), cls(growth_interval=0))

        def replica(ds, p):  # type: ignore[no-untyped-def]
            return ds.value_and_grad(lambda q: jnp.sum(q * q), axis_name="replicas")(p)

        points = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
        out = jax.jit(jax.vmap(replica, axis_name="replicas"))(ds, points)
        fins, grads = [bool(f) for f in out.finite], np.asarray(out.grad)
        out = jax.jit(jax.vmap(replica, axis_name="replicas"))(out.dynamic_scale, points.at[1, 0].set(jnp.inf))
        return fins + [bool(f) for f in out.finite], [float(s) for s in out.dynamic_scale.scale], grads

    fins, scales, grads = run(polyamp_jax.DynamicScale)
    their_fins, their_scales, their_grads = run(flax_dynamic_scale.DynamicScale)
    assert fins == their_fins == [True, True, False, False]
    assert scales == their_scales == [65536.0, 65536.0]  # grown (growth_interval=0) and backed off on both
    assert grads.tobytes() == their_grads.tobytes()
    np.testing.assert_array_equal(grads, [[4.0, 6.0], [4.0, 6.0]])  # the mean of 2p over the replicas


def test_dynamic_scale_runs_under_pmap_and_its_records_read_from_one_replica() -> None:
    n = jax.local_device_count()
    replicated = jax.tree_util.tree_map(lambda leaf: jnp.stack([leaf] * n), polyamp_jax.DynamicScale(growth_interval=0))

    @functools.partial(jax.pmap, axis_name="batch")
    def step(ds, p):  # type: ignore[no-untyped-def]
        return ds.value_and_grad(lambda q: jnp.sum(q * q), axis_name="batch")(p)

    out = step(replicated, jnp.ones((n, 2)))
    assert [bool(f) for f in out.finite] == [True] * n and [float(s) for s in out.dynamic_scale.scale] == [131072.0] * n
    out = step(out.dynamic_scale, jnp.full((n, 2), jnp.inf))
    first = jax.tree_util.tree_map(lambda leaf: leaf[0], out.dynamic_scale)
    assert [(r.skipped, r.scale, r.next_scale) for r in polyamp_jax.records(first)] == [
        (False, 65536.0, 131072.0),
        (True, 131072.0, 65536.0),
    ]


def test_dynamic_scale_state_dicts_are_torchs_format() -> None:
    """polyamp_jax.state_dict of a DynamicScale loads into torch's GradScaler and polyamp's LossScaler, which
    then follow the same scales; a torch GradScaler's dict loads into a DynamicScale (Flax's growth_interval is
    torch's minus one), and the round trip is exact."""
    torch = pytest.importorskip("torch")
    step = jax.jit(lambda ds, p: ds.value_and_grad(lambda q: q * q)(p))
    ds = polyamp_jax.DynamicScale(growth_interval=2, scale=1024.0)
    for char in "FFFFOF":
        ds = step(ds, jnp.float32(math.inf if char == "O" else 1.0)).dynamic_scale
    saved = polyamp_jax.state_dict(ds)
    assert (saved["scale"], saved["_growth_tracker"], saved["growth_interval"]) == (1024.0, 1, 3)
    native = torch.amp.GradScaler("cpu")
    native.load_state_dict(saved)
    assert (native.get_scale(), native.get_growth_interval(), native.state_dict()["_growth_tracker"]) == (1024.0, 3, 1)
    core = polyamp.LossScaler(enabled=True)
    core.load_state_dict(saved)
    assert core.state_dict() == saved  # the skip count (one overflow) included

    # the rest of the run, in torch (a linear model, an inf gradient where the pattern says) and here
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pattern, torch_scales, our_scales = "FFOFFFFFFO", [], []
    for char in pattern:
        opt.zero_grad()
        loss = model(torch.ones(1, 2)).sum() * (math.inf if char == "O" else 1.0)
        native.scale(loss).backward()
        native.step(opt)
        native.update()
        torch_scales.append(native.get_scale())
        ds = step(ds, jnp.float32(math.inf if char == "O" else 1.0)).dynamic_scale
        our_scales.append(float(ds.scale))
    assert (
        our_scales
        == torch_scales
        == LossScaleConfig(growth_interval=3).trajectory(pattern, polyamp.LossScaleState(1024.0, 1, 1))
    )

    back = polyamp_jax.load_state_dict(
        ds, torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=7).state_dict()
    )
    assert (back.growth_interval, float(back.scale), int(back.fin_steps)) == (6, 256.0, 0)
    assert polyamp_jax.load_state_dict(ds, polyamp_jax.state_dict(ds)).growth_interval == ds.growth_interval
    assert polyamp_jax.state_dict(polyamp_jax.load_state_dict(ds, saved)) == saved
    with pytest.raises(InvalidConfigError, match="no hysteresis"):
        polyamp_jax.load_state_dict(ds, {**saved, "hysteresis": 2, "hysteresis_left": 2})


def test_dynamic_scale_in_a_train_state_checkpoints_as_flaxs() -> None:
    """flax.serialization writes a DynamicScale as Flax's own ({fin_steps, scale}), so a TrainState checkpoint
    made with Flax's DynamicScale restores into one with polyamp_jax's, and back; polyamp_jax finds the
    DynamicScale inside the TrainState."""
    serialization = pytest.importorskip("flax.serialization")
    x, _ = _data()
    params = _linen_variables(x)["params"]

    def make(dynamic_scale: Any) -> Any:
        return _TrainState.create(apply_fn=_Net().apply, params=params, tx=optax.sgd(0.1), dynamic_scale=dynamic_scale)

    theirs = make(flax_dynamic_scale.DynamicScale(fin_steps=3, scale=512.0))
    ours = make(polyamp_jax.DynamicScale())
    assert serialization.to_state_dict(ours)["dynamic_scale"].keys() == {"fin_steps", "scale"}
    restored = serialization.from_bytes(ours, serialization.to_bytes(theirs))
    assert isinstance(restored.dynamic_scale, polyamp_jax.DynamicScale)
    assert (float(restored.dynamic_scale.scale), int(restored.dynamic_scale.fin_steps)) == (512.0, 3)
    assert polyamp_jax.state_dict(restored)["scale"] == 512.0  # found inside the TrainState
    back = serialization.from_bytes(make(flax_dynamic_scale.DynamicScale()), serialization.to_bytes(restored))
    assert (float(back.dynamic_scale.scale), int(back.dynamic_scale.fin_steps)) == (512.0, 3)


def test_dynamic_scale_refuses_what_flaxs_rule_cannot_map() -> None:
    with pytest.raises(InvalidConfigError, match=r"`growth_factor` must be a finite number > 1"):
        polyamp_jax.DynamicScale(growth_factor=1.0)
    with pytest.raises(InvalidConfigError, match=r"`growth_interval` must be an int in \[0, "):
        polyamp_jax.DynamicScale(growth_interval=-1)
    with pytest.raises(PolyampTypeError, match="`growth_interval` must be an int"):
        polyamp_jax.DynamicScale(growth_interval=2.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="minimum_scale=None or a value >= 2\\*\\*-126"):
        polyamp_jax.DynamicScale(minimum_scale=0.0)
    with pytest.raises(InvalidConfigError, match=r"`scale` must be a number from minimum_scale \(8.0\) to 2\*\*126"):
        polyamp_jax.DynamicScale(scale=4.0, minimum_scale=8.0)
    with pytest.raises(InvalidConfigError, match=r"to 2\*\*126"):
        polyamp_jax.DynamicScale(scale=2.0**127)
    with pytest.raises(InvalidConfigError, match=r"`fin_steps` must be an int in \[0, growth_interval=3\]"):
        polyamp_jax.DynamicScale(growth_interval=3, fin_steps=4)
    with pytest.raises(PolyampTypeError, match="take a concrete number for `scale`"):
        jax.jit(lambda s: polyamp_jax.DynamicScale().replace(scale=s).scale)(jnp.float32(2.0))
    with pytest.raises(PolyampTypeError, match="takes the fields"):
        polyamp_jax.DynamicScale().replace(scal=2.0)
    replaced = polyamp_jax.DynamicScale(growth_interval=3).replace(scale=8.0)
    assert (float(replaced.scale), replaced.growth_interval) == (8.0, 3)


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
