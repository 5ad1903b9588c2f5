"""polyamp_jax.precision: any optax optimizer following the policy's training-state plan.

The writes are checked element by element against the core's pure-Python reference
(`polyamp.backend_api.training_state.write_update`), bit for bit, through ``optax.apply_updates``; then the state's
dtypes and bytes, the pass-through under float32, skipped steps under `loss_scaled`, jit/scan, Flax, checkpoint
conversion, the hazard warning and the errors.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import polyamp_jax  # noqa: E402

import polyamp  # noqa: E402
from polyamp import InvalidConfigError, PolyampTypeError, StateDictError, TrainingStateWarning  # noqa: E402
from polyamp.backend_api.training_state import round_to, stochastic_round_bfloat16, write_update  # noqa: E402

PRESETS = ("bfloat16_float32_master", "bfloat16_kahan", "bfloat16_stochastic")
# One plan in the fast set where each plan repeats the same long run; the others with -m slow.
ONE_FAST = [pytest.param(p, marks=pytest.mark.slow) if p != "bfloat16_kahan" else p for p in PRESETS]


def _identity() -> Any:
    """An optimizer whose update is the gradient itself: the test chooses the float32 update exactly."""
    return optax.GradientTransformation(lambda params: optax.EmptyState(), lambda g, s, p=None: (g, s))


def _weights_and_updates(rng: np.random.Generator, n: int, dtype: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """Weights over many binades (zeros among them) and three steps of float32 updates from 1e-6 to 3 times
    their size, so that some round away, some move by a few units and some cross zero."""
    weights = (rng.normal(size=n) * 10.0 ** rng.integers(-3, 2, size=n)).astype(np.float32)
    weights[:8] = 0.0
    weights = np.asarray(jnp.asarray(weights, dtype).astype(jnp.float32))
    steps = [(np.abs(weights) + 1e-3) * rng.normal(size=n) * 10.0 ** rng.integers(-6, 1, size=n) for _ in range(3)]
    return weights, [step.astype(np.float32) for step in steps]


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize(
    ("policy", "dtype"),
    [
        ("bfloat16", "bfloat16"),
        ("bfloat16_kahan", "bfloat16"),
        ("bfloat16_float32_master", "bfloat16"),
        ("params=float16,compute=float16,rounding=kahan", "float16"),
        ("params=float16,compute=float16,master=float32", "float16"),
    ],
)
def test_writes_are_the_core_reference_bit_for_bit_through_optax_apply_updates(policy: str, dtype: str) -> None:
    rng = np.random.default_rng(7)
    weights, steps = _weights_and_updates(rng, 3000, dtype)
    tx = polyamp_jax.precision(_identity(), policy)
    params = {"w": jnp.asarray(weights, dtype)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainingStateWarning)  # the nearest plan warns; tested below
        state = tx.init(params)
    step = jax.jit(lambda p, s, u: tx.update(u, s, p))
    plan = polyamp.Policy(policy)
    want_w = [float(v) for v in weights]
    want_m = list(want_w)
    want_c = [0.0] * len(want_w)
    for u in steps:
        updates, state = step(params, state, {"w": jnp.asarray(u)})
        params = optax.apply_updates(params, updates)
        for i, du in enumerate(u.tolist()):
            base = want_m[i] if plan.keeps_master else want_w[i]
            target = float(np.float32(base) + np.float32(du))
            if plan.keeps_master:
                want_m[i], want_w[i] = target, round_to(target, dtype)
            else:
                want_w[i], want_c[i] = write_update(
                    want_w[i], target, dtype=dtype, rounding=plan.rounding, compensation=want_c[i]
                )
    assert params["w"].dtype == jnp.dtype(dtype)
    got = np.asarray(params["w"].astype(jnp.float32))
    assert got.tobytes() == np.asarray(want_w, np.float32).tobytes()
    if plan.keeps_master:
        assert np.asarray(state.master["w"]).tobytes() == np.asarray(want_m, np.float32).tobytes()
    if plan.rounding == "kahan":
        assert state.compensation["w"].dtype == jnp.dtype(dtype)
        comp = np.asarray(state.compensation["w"].astype(jnp.float32))
        assert comp.tobytes() == np.asarray(want_c, np.float32).tobytes()
        assert np.count_nonzero(comp) > 1000  # the buffers carry what the writes lost


def test_stochastic_writes_are_the_reference_with_the_states_random_bits() -> None:
    rng = np.random.default_rng(3)
    weights, steps = _weights_and_updates(rng, 2000, "bfloat16")
    tx = polyamp_jax.precision(_identity(), "bfloat16_stochastic", seed=11)
    params = {"w": jnp.asarray(weights, jnp.bfloat16)}
    state = tx.init(params)
    assert np.asarray(state.key).tobytes() == np.asarray(jax.random.PRNGKey(11)).tobytes()
    step = jax.jit(lambda p, s, u: tx.update(u, s, p))
    want = [float(v) for v in weights]
    for u in steps:
        _, sub = jax.random.split(state.key, 2)  # one key per parameter leaf after the carried one
        random16 = np.asarray(jax.random.bits(sub, u.shape, jnp.uint16)).tolist()
        updates, state = step(params, state, {"w": jnp.asarray(u)})
        params = optax.apply_updates(params, updates)
        want = [
            stochastic_round_bfloat16(float(np.float32(w) + np.float32(du)), r)
            for w, du, r in zip(want, u.tolist(), random16, strict=True)
        ]
    assert np.asarray(params["w"].astype(jnp.float32)).tobytes() == np.asarray(want, np.float32).tobytes()


def test_stochastic_rounding_is_unbiased_and_reproducible_from_the_seed() -> None:
    one_ulp = 2.0**-7  # bfloat16's spacing in [1, 2)
    params = {"w": jnp.ones(200_000, jnp.bfloat16)}
    grads = {"w": jnp.full(200_000, 0.3 * one_ulp, jnp.float32)}
    tx = polyamp_jax.precision(_identity(), "bfloat16_stochastic", seed=5)
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    written = np.asarray(optax.apply_updates(params, updates)["w"].astype(jnp.float32))
    assert set(np.unique(written).tolist()) == {1.0, 1.0 + one_ulp}
    up = float(np.mean(written > 1.0))
    assert abs(up - 0.3) < 4 * np.sqrt(0.3 * 0.7 / written.size)  # the expected value is the float32 target
    again, _ = polyamp_jax.precision(_identity(), "bfloat16_stochastic", seed=5).update(grads, state, params)
    other, _ = polyamp_jax.precision(_identity(), "bfloat16_stochastic", seed=6).update(
        grads, polyamp_jax.precision(_identity(), "bfloat16_stochastic", seed=6).init(params), params
    )
    assert _bits(again) == _bits(updates)
    assert _bits(other) != _bits(updates)


def test_a_stochastic_run_resumed_from_its_saved_state_draws_the_same_bits() -> None:
    params = _mlp("bfloat16")
    tx = polyamp_jax.precision(optax.adamw(1e-3), "bfloat16_stochastic")
    step = jax.jit(lambda p, s, x: _train_step(tx, p, s, x))
    state = tx.init(params)
    straight = (params, state)
    for i in range(4):
        straight = step(*straight, _batch(i))
    resumed = (params, state)
    for i in range(2):
        resumed = step(*resumed, _batch(i))
    saved = jax.tree_util.tree_map(np.asarray, resumed)  # through the host, as a checkpoint
    resumed = jax.tree_util.tree_map(jnp.asarray, saved)
    for i in range(2, 4):
        resumed = step(*resumed, _batch(i))
    assert _bits(resumed) == _bits(straight)


@pytest.mark.parametrize("policy", [*PRESETS, "bfloat16"])
def test_the_state_holds_the_plans_dtypes(policy: str) -> None:
    params = _mlp("bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainingStateWarning)
        state = polyamp_jax.precision(optax.adamw(1e-3), policy).init(params)
    plan = polyamp.Policy(policy)
    adam = state.inner[0]
    assert adam.count.dtype == jnp.int32  # counters stay as they are
    assert {str(leaf.dtype) for leaf in jax.tree_util.tree_leaves((adam.mu, adam.nu))} == {plan.state_dtype}
    master = jax.tree_util.tree_leaves(state.master)
    assert [str(leaf.dtype) for leaf in master] == (["float32"] * 4 if plan.keeps_master else [])
    if plan.keeps_master:
        assert _bits(state.master) == _bits(jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params))
    compensation = jax.tree_util.tree_leaves(state.compensation)
    assert [(str(c.dtype), float(jnp.abs(c).max())) for c in compensation] == (
        [("bfloat16", 0.0)] * 4 if plan.rounding == "kahan" else []
    )
    assert (state.key is not None) == (plan.rounding == "stochastic")


@pytest.mark.parametrize(
    ("policy", "total"), [("bfloat16_kahan", 10), ("bfloat16_stochastic", 8), ("bfloat16_float32_master", 16)]
)
def test_adamws_training_state_costs_what_the_plan_says(policy: str, total: int) -> None:
    params = _mlp("bfloat16")
    tx = polyamp_jax.loss_scaled(polyamp_jax.precision(optax.adamw(1e-3), policy))
    counted = polyamp_jax.measure_state_bytes(params, tx.init(params))
    assert counted.breakdown() == polyamp.state_bytes(policy)._asdict()
    assert counted.per_parameter == total


def test_plain_float32_adamw_costs_16_bytes_and_given_gradients_are_counted() -> None:
    params = _mlp("float32")
    counted = polyamp_jax.measure_state_bytes(params, optax.adamw(1e-3).init(params))
    assert counted.breakdown() == {"weights": 4, "gradients": 4, "master": 0, "state": 8, "compensation": 0}
    assert counted.per_parameter == 16
    grads = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    assert polyamp_jax.measure_state_bytes(params, optax.adamw(1e-3).init(params), grads).breakdown()["gradients"] == 2
    with pytest.raises(PolyampTypeError, match="no floating array"):
        polyamp_jax.measure_state_bytes({"n": jnp.arange(3)}, ())


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_float32_parameters_under_the_default_plan_pass_through_bit_for_bit(policy: str) -> None:
    params = _mlp("float32")
    inner = optax.adamw(3e-3)
    tx = polyamp_jax.precision(inner, policy)
    ours = jax.jit(lambda p, s, x: _train_step(tx, p, s, x))
    theirs = jax.jit(lambda p, s, x: _train_step(inner, p, s, x))
    a = (params, tx.init(params))
    b = (params, inner.init(params))
    for i in range(5):
        a, b = ours(*a, _batch(i)), theirs(*b, _batch(i))
    assert isinstance(a[1], polyamp_jax.PrecisionState) and a[1].master is a[1].compensation is a[1].key is None
    assert _bits(a[0]) == _bits(b[0])
    assert _bits(a[1].inner) == _bits(b[1])


@pytest.mark.parametrize("policy", PRESETS)
def test_a_skipped_step_leaves_params_and_the_whole_precision_state_bitwise_unchanged(policy: str) -> None:
    params = _mlp("bfloat16")
    params = {**params, "b1": params["b1"].at[0].set(-0.0)}  # a negative zero keeps its sign too
    tx = polyamp_jax.loss_scaled(polyamp_jax.precision(optax.adamw(1e-2), policy), enabled=True)

    @jax.jit
    def step(p: Any, s: Any, x: Any, bad: Any) -> Any:
        grads = jax.grad(lambda q: polyamp_jax.scale_loss(s, _loss(q, x)))(p)
        grads = {**grads, "w1": jnp.where(bad, grads["w1"].at[0, 0].set(jnp.inf), grads["w1"])}
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    state = tx.init(params)
    for i in range(3):
        params, state = step(params, state, _batch(i), jnp.asarray(False))
    before = _bits((params, state.inner))
    params, state = step(params, state, _batch(3), jnp.asarray(True))
    assert [r.skipped for r in polyamp_jax.records(state)] == [False, False, False, True]
    assert _bits((params, state.inner)) == before
    assert np.signbit(np.asarray(params["b1"][0], np.float32))
    params, state = step(params, state, _batch(4), jnp.asarray(False))
    assert _bits((params, state.inner)) != before


def test_float16_gradients_of_a_plan_are_unscaled_in_float32() -> None:
    # At scale 2**16 each true gradient is a float16 value once scaled (2**-27 becomes 2**-11 exactly); unscaled in
    # float16 the first and third would flush to zero and 3e-6 land on float16's subnormal grid (0.7% off).
    # loss_scaled unscales a plan's gradients in float32, so Adam's float32 moments get them.
    tiny = np.array([2.0**-27, 3e-6, -(2.0**-30), 1e-3], np.float32)
    plan = "params=float16,compute=float16,state=float32,rounding=kahan"
    tx = polyamp_jax.loss_scaled(polyamp_jax.precision(optax.adam(1e-3), plan), enabled=True, init_scale=2.0**16)
    params = {"w": jnp.ones(4, jnp.float16)}
    state = tx.init(params)
    grads = jax.grad(lambda p: polyamp_jax.scale_loss(state, (p["w"].astype(jnp.float32) * tiny).sum()))(params)
    assert grads["w"].dtype == jnp.float16
    _, state = jax.jit(tx.update)(grads, state, params)
    true = np.asarray(grads["w"]).astype(np.float32) * np.float32(2.0**-16)
    assert true[0] == 2.0**-27 and true[2] == -(2.0**-30) and abs(true[1] / 3e-6 - 1) < 2**-11
    adam = state.inner.inner[0]
    assert _bits(adam.mu["w"]) == _bits(np.float32(1 - 0.9) * true)
    assert _bits(adam.nu["w"]) == _bits(np.float32(1 - 0.999) * true * true)


@pytest.mark.parametrize("policy", ONE_FAST)
def test_steps_scanned_with_lax_scan_equal_steps_jitted_one_by_one(policy: str) -> None:
    params = _mlp("bfloat16")
    tx = polyamp_jax.precision(optax.adamw(1e-2), policy)
    batches = jnp.stack([_batch(i) for i in range(6)])

    def body(carry: Any, x: Any) -> tuple[Any, None]:
        return _train_step(tx, *carry, x), None

    scanned, _ = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))((params, tx.init(params)), batches)
    step = jax.jit(lambda p, s, x: _train_step(tx, p, s, x))
    looped = (params, tx.init(params))
    for x in batches:
        looped = step(*looped, x)
    assert _bits(scanned) == _bits(looped)


def test_kahan_and_stochastic_writes_track_the_float32_master_while_nearest_stalls() -> None:
    """A small learning rate: AdamW's steps (about 3e-4) are below half of bfloat16's spacing at the weights'
    size (2**-9 near 1.0), so writing to nearest loses them all."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)
    start = jnp.asarray(1.0 + rng.uniform(-0.2, 0.2, size=16), jnp.bfloat16)
    y = x @ (start.astype(jnp.float32) + 0.05)

    def loss(w: Any) -> Any:
        return jnp.mean((x @ w.astype(jnp.float32) - y) ** 2)

    def train(policy: str) -> tuple[float, np.ndarray]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TrainingStateWarning)
            tx = polyamp_jax.precision(optax.adam(3e-4), policy)
            state = tx.init(start)

        def body(carry: Any, _: Any) -> tuple[Any, None]:
            w, s = carry
            updates, s = tx.update(jax.grad(loss)(w), s, w)
            return (optax.apply_updates(w, updates), s), None

        (w, _), _ = jax.jit(lambda c: jax.lax.scan(body, c, None, length=300))((start, state))
        return float(loss(w)), np.asarray(w.astype(jnp.float32))

    first = float(loss(start))
    results = {policy: train(policy) for policy in (*PRESETS, "bfloat16")}
    master_loss, master_w = results["bfloat16_float32_master"]
    assert master_loss < 0.1 * first
    for policy in ("bfloat16_kahan", "bfloat16_stochastic"):
        got_loss, got_w = results[policy]
        assert got_loss < 0.15 * first, policy
        assert np.max(np.abs(got_w - master_w)) < 0.02, policy
    nearest_loss, nearest_w = results["bfloat16"]
    assert nearest_loss == pytest.approx(first, rel=1e-6)  # not one weight moved
    assert np.array_equal(nearest_w, np.asarray(start.astype(jnp.float32)))


def test_a_flax_train_state_steps_through_precision_as_by_hand() -> None:
    train_state = pytest.importorskip("flax.training.train_state")
    params = _mlp("bfloat16")
    tx = polyamp_jax.precision(optax.adamw(1e-2), "bfloat16_kahan")
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    by_hand = (params, tx.init(params))
    for i in range(3):
        grads = jax.grad(_loss)(ts.params, _batch(i))
        ts = jax.jit(lambda t, g: t.apply_gradients(grads=g))(ts, grads)
        by_hand = _train_step(tx, *by_hand, _batch(i))
    assert jax.tree_util.tree_leaves(ts.params)[0].dtype == jnp.bfloat16
    assert _bits((ts.params, ts.opt_state)) == _bits(by_hand)


def _as_pure(nnx: Any, tree: Any) -> Any:
    """``nnx.as_pure`` (Flax 0.12.1 and newer): the arrays of a tree of NNX variables."""
    if hasattr(nnx, "as_pure"):
        return nnx.as_pure(tree)
    is_variable = (nnx.Variable, getattr(nnx, "VariableState", nnx.Variable))
    return jax.tree.map(
        lambda leaf: leaf.value if isinstance(leaf, is_variable) else leaf,
        tree,
        is_leaf=lambda leaf: isinstance(leaf, is_variable),
    )


def test_an_nnx_optimizer_steps_through_precision_as_by_hand() -> None:
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(8, 4, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    tx = polyamp_jax.precision(optax.adamw(1e-2), "bfloat16_stochastic")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = _as_pure(nnx, nnx.state(model, nnx.Param))
    by_hand = (params, tx.init(params))

    def loss(m: Any, x: Any) -> Any:
        return jnp.mean(m(x).astype(jnp.float32) ** 2)

    for i in range(3):
        grads = nnx.grad(loss)(model, _batch(i))
        optimizer.update(model, grads)
        pure = _as_pure(nnx, nnx.state(grads, nnx.Param))
        updates, state = tx.update(pure, by_hand[1], by_hand[0])
        by_hand = (optax.apply_updates(by_hand[0], updates), state)
    assert _bits(_as_pure(nnx, nnx.state(model, nnx.Param))) == _bits(by_hand[0])
    assert _bits(_as_pure(nnx, optimizer.opt_state)) == _bits(by_hand[1])


def test_the_hazard_warns_once_per_transformation_and_not_under_a_plan() -> None:
    params = _mlp("bfloat16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx = polyamp_jax.precision(optax.adamw(1e-3), "bfloat16")
        tx.init(params)
        tx.init(params)
        plain = polyamp_jax.loss_scaled(optax.adamw(1e-3), enabled=False)
        plain.init(params)
        plain.init(params)
        polyamp_jax.loss_scaled(polyamp_jax.precision(optax.adamw(1e-3), "bfloat16_kahan")).init(params)
        polyamp_jax.loss_scaled(optax.adamw(1e-3)).init(_mlp("float32"))
    messages = [str(w.message) for w in caught if issubclass(w.category, TrainingStateWarning)]
    assert len(messages) == 2
    assert messages[0].startswith("polyamp_jax.precision (policy 'bfloat16') updates bfloat16 weights directly")
    assert messages[1].startswith("The optax optimizer inside polyamp_jax.loss_scaled updates bfloat16 weights")
    assert "bfloat16_kahan" in messages[1] and "polyamp_jax.precision" in messages[1]


def test_the_policy_in_effect_is_read_when_the_transformation_is_made() -> None:
    params = _mlp("bfloat16")
    with polyamp.policy_scope("bfloat16_kahan"):
        tx = polyamp_jax.precision(optax.sgd(1e-2))
    state = tx.init(params)
    assert state.compensation is not None and state.master is None


def test_with_a_master_copy_a_weight_shrinking_2_to_the_24_fold_lands_within_a_float32_ulp() -> None:
    """The documented limit of returning updates: ``stored + update`` is computed in float32, so a written weight
    more than 2**15 times smaller than the stored one can be off by half a float32 unit in the last place of the
    stored weight. Without a master copy the working copy is the stored weight and every write is exact (above)."""
    tx = polyamp_jax.precision(_identity(), "bfloat16_float32_master")
    params = {"w": jnp.asarray([1.0, 1.0], jnp.bfloat16)}
    master = jnp.asarray([1.0 - 2.0**-24, 1.0 - 2.0**-24], jnp.float32)  # both round to 1.0
    state = tx.init(params)._replace(master={"w": master})
    updates, state = tx.update({"w": jnp.asarray([-1.0, -0.5], jnp.float32)}, state, params)
    got = np.asarray(optax.apply_updates(params, updates)["w"].astype(jnp.float32))
    assert np.asarray(state.master["w"]).tolist() == [-(2.0**-24), 0.5 - 2.0**-24]  # held exactly
    assert got.tolist() == [0.0, 0.5]  # -2**-24 in bfloat16 is off by 2**-24; 0.5 is exact
    updates, state = tx.update({"w": jnp.asarray([2.0**-24, 0.0], jnp.float32)}, state, params)
    assert np.asarray(state.master["w"]).tolist() == [0.0, 0.5 - 2.0**-24]  # the next write starts from the master


# -- checkpoints: a state saved under one plan, loaded under another ---------------------------------------


def _trained(tx: Any, params: Any, steps: int = 3) -> tuple[Any, Any]:
    state = tx.init(params)
    for i in range(steps):
        params, state = _train_step(tx, params, state, _batch(i))
    return params, state


def test_a_master_checkpoint_converts_to_a_kahan_plan_with_one_note(caplog: pytest.LogCaptureFixture) -> None:
    params, saved = _trained(polyamp_jax.precision(optax.adamw(1e-2), "bfloat16_float32_master"), _mlp("bfloat16"))
    new_tx = polyamp_jax.precision(optax.adamw(1e-2), "bfloat16_kahan")
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        state = polyamp_jax.convert_precision_state(saved, new_tx.init(params))
    assert len(caplog.records) == 1
    note = caplog.records[0].getMessage()
    assert "slots were saved in float32 and are loaded as bfloat16" in note and "rounded to nearest" in note
    assert "float32 master copies are dropped" in note and "no Kahan compensation buffers" in note
    assert state.master is None and state.key is None
    assert _bits(state.inner) == _bits(
        jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16) if a.ndim else a, saved.inner)
    )
    assert _bits(state.compensation) == _bits(new_tx.init(params).compensation)  # zeros
    _train_step(new_tx, params, state, _batch(9))  # it trains on


def test_a_plain_float32_checkpoint_converts_to_a_master_plan(caplog: pytest.LogCaptureFixture) -> None:
    params32, saved = _trained(optax.adamw(1e-2), _mlp("float32"))
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params32)
    new_tx = polyamp_jax.precision(optax.adamw(1e-2), "bfloat16_float32_master")
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        state = polyamp_jax.convert_precision_state(saved, new_tx.init(params))
    assert (
        len(caplog.records) == 1
        and "no master copies (it was saved under another plan): they are made from the weights, exactly"
        in caplog.records[0].getMessage()
    )
    assert _bits(state.inner) == _bits(saved)  # float32 moments, exactly
    assert _bits(state.master) == _bits(jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params))
    # and back to the plain optimizer: the moments as they were, the master dropped with a note
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        plain = polyamp_jax.convert_precision_state(state, optax.adamw(1e-2).init(params32))
    assert _bits(plain) == _bits(saved) and len(caplog.records) == 1


def test_loss_scaled_states_convert_and_keep_the_scaler(caplog: pytest.LogCaptureFixture) -> None:
    params = _mlp("bfloat16")
    old = polyamp_jax.loss_scaled(polyamp_jax.precision(optax.adamw(1e-2), "bfloat16_stochastic"), init_scale=64.0)
    new = polyamp_jax.loss_scaled(polyamp_jax.precision(optax.adamw(1e-2), "bfloat16_kahan"))
    saved = old.init(params)
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        state = polyamp_jax.convert_precision_state(saved, new.init(params))
    # the same dtypes: nothing converted; the compensation the stochastic plan did not keep starts at zero
    assert [r.getMessage() for r in caplog.records] == [
        "The checkpoint has no Kahan compensation buffers (it was saved under another plan): they start at zero."
    ]
    assert polyamp_jax.state_dict(state)["scale"] == 64.0
    assert state.inner.compensation is not None and state.inner.key is None
    with pytest.raises(PolyampTypeError, match="both be loss_scaled states or neither"):
        polyamp_jax.convert_precision_state(saved.inner, new.init(params))


def test_a_malformed_checkpoint_is_refused_and_nothing_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    params = _mlp("bfloat16")
    tx = polyamp_jax.precision(optax.adamw(1e-2), "bfloat16_kahan")
    like = tx.init(params)
    other = polyamp_jax.precision(optax.adamw(1e-2), "bfloat16_float32_master").init({**params, "w1": params["w1"][:4]})
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        with pytest.raises(StateDictError, match=r"must be an array of shape \(8, 16\)"):
            polyamp_jax.convert_precision_state(other, like)
        with pytest.raises(StateDictError, match="does not have the structure of the optimizer's"):
            polyamp_jax.convert_precision_state(optax.sgd(0.1, momentum=0.9).init(params), like)
        with pytest.raises(StateDictError, match="Received: 'not a state'"):
            polyamp_jax.convert_precision_state("not a state", like)
    assert caplog.records == []


# -- errors --------------------------------------------------------------------------------------------------


def test_misuse_gets_clear_errors() -> None:
    params = _mlp("bfloat16")
    with pytest.raises(PolyampTypeError, match="wraps an optax transformation"):
        polyamp_jax.precision("adamw")  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match=r"`seed` must be an int in \[0, 2\*\*32\)"):
        polyamp_jax.precision(optax.adamw(1e-3), seed=-1)
    with pytest.raises(polyamp.InvalidPolicyError):
        polyamp_jax.precision(optax.adamw(1e-3), "bfloat17")
    tx = polyamp_jax.precision(optax.adamw(1e-3), "bfloat16_kahan")
    with pytest.raises(PolyampTypeError, match=r"needs them: call tx.update\(grads, opt_state, params\)"):
        tx.update(params, tx.init(params))
    with pytest.raises(PolyampTypeError, match="takes the state its init made"):
        tx.update(params, optax.adamw(1e-3).init(params), params)
    with pytest.raises(InvalidConfigError, match=r"Write loss_scaled\(precision\(optimizer\)\)"):
        polyamp_jax.precision(polyamp_jax.loss_scaled(optax.adamw(1e-3)), "bfloat16_kahan").init(params)
    half = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    with pytest.raises(InvalidConfigError, match=r"the parameter \['b1'\] is float16"):
        polyamp_jax.precision(optax.adamw(1e-3), "bfloat16_stochastic").init(half)


# -- helpers -------------------------------------------------------------------------------------------------


def _mlp(dtype: str) -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {
        "w1": jax.random.normal(k1, (8, 16)) * 0.3,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 4)) * 0.3,
        "b2": jnp.zeros(4),
    }
    return jax.tree_util.tree_map(lambda p: p.astype(dtype), params)


def _batch(i: int) -> Any:
    return jax.random.normal(jax.random.PRNGKey(100 + i), (16, 8))


def _loss(params: Any, x: Any) -> Any:
    h = jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"])
    out = (h @ params["w2"] + params["b2"]).astype(jnp.float32)
    return jnp.mean((out - 0.5) ** 2)


def _train_step(tx: Any, params: Any, state: Any, x: Any) -> tuple[Any, Any]:
    updates, state = tx.update(jax.grad(_loss)(params, x), state, params)
    return optax.apply_updates(params, updates), state


# -- the conformance harness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ONE_FAST)
def test_the_harness_trainer_follows_the_plan_and_skips_without_a_trace(policy: str) -> None:
    from polyamp_jax.testing import JaxHarness

    harness = JaxHarness("cpu")
    assert "precision" in harness.capabilities
    trainer = harness.trainer(polyamp.Policy(policy), scaler={"enabled": True}, optimizer="adam")
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (16, 8)))
    y = np.arange(16) % 4
    trainer.step(x, y)
    assert {str(leaf.dtype) for leaf in trainer.weights()} == {"bfloat16"}
    plan = polyamp.Policy(policy)
    state = trainer.optimizer_state()
    assert sum(leaf.dtype == np.float32 and leaf.ndim > 0 for leaf in state) == (12 if plan.keeps_master else 0)
    assert sum(str(leaf.dtype) == "bfloat16" for leaf in state) == {"kahan": 12, "stochastic": 8}.get(plan.rounding, 0)
    before = [leaf.tobytes() for leaf in (*trainer.params(), *state)]
    trainer.step(x, y, overflow=True)
    assert trainer.step_skipped()
    assert [leaf.tobytes() for leaf in (*trainer.params(), *trainer.optimizer_state())] == before
