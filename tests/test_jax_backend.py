"""polyamp_jax: the functional scaler over JAX arrays, the optax transformation and jmp-style casting.

The conformance cases run on the ``jax`` harness through tests/test_conformance.py; these tests check what is
JAX's own: the transformation against a hand-written jmp step bit for bit, jit/scan composition, state dicts
across backends, casting like jmp, the registry and the errors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import polyamp_jax  # noqa: E402

import polyamp  # noqa: E402
from polyamp import LossScaleConfig, LossScaler, PolyampTypeError, SpikeRule  # noqa: E402
from polyamp.conformance.cases import TRAJECTORY_VECTORS  # noqa: E402


def _params() -> dict[str, jax.Array]:
    key1, key2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(key1, (4, 3)), "b": jax.random.normal(key2, (3,))}


def _loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(jnp.tanh(x @ params["w"] + params["b"])))


def _batches(n: int) -> list[jax.Array]:
    rng = np.random.default_rng(1)
    return [jnp.asarray(rng.normal(size=(5, 4)).astype("float32")) for _ in range(n)]


def _float_leaves(tree: object) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)]


@pytest.mark.parametrize("name", [v[0] for v in TRAJECTORY_VECTORS])
def test_functional_scaler_under_jit_follows_the_reference(name: str) -> None:
    _, settings, _, pattern = next(v for v in TRAJECTORY_VECTORS if v[0] == name)
    fn = LossScaler(**settings, enabled=True).functional(backend="jax")

    @jax.jit
    def step(state: object, bad: jax.Array) -> object:
        grads = {"g": jnp.where(bad, jnp.inf, jnp.ones(3))}
        _, found_inf = fn.unscale(state, grads)
        return fn.update(state, found_inf)

    state = fn.init()
    got = []
    for char in pattern:
        state = step(state, jnp.asarray(char == "O"))
        host = fn.read(state)
        got.append((host.scale, host.growth_tracker, host.hysteresis_left))
    want = [(s.scale, s.growth_tracker, s.hysteresis_left) for s in LossScaleConfig(**settings).states(pattern)]
    assert got == want
    assert int(fn.skipped_steps(state)) == pattern.count("O")


def test_the_functional_scaler_runs_inside_lax_scan() -> None:
    fn = LossScaler(growth_interval=2, enabled=True).functional(backend="jax")
    pattern = "FFOFFFOO"

    def body(state: object, bad: jax.Array) -> tuple[object, jax.Array]:
        _, found_inf = fn.unscale(state, [jnp.where(bad, jnp.nan, 1.0)])
        return fn.update(state, found_inf), found_inf

    state, flags = jax.lax.scan(body, fn.init(), jnp.asarray([c == "O" for c in pattern]))
    assert [bool(f) for f in np.asarray(flags)] == [c == "O" for c in pattern]
    assert fn.read(state).scale == LossScaleConfig(growth_interval=2).trajectory(pattern)[-1]
    assert [r.skipped for r in fn.records(state)] == [c == "O" for c in pattern]


def _jmp_style_step(inner: optax.GradientTransformation, jmp):  # type: ignore[no-untyped-def]
    """The hand-written step polyamp's transformation replaces: scale, unscale by the float32 reciprocal,
    check, apply the inner update or keep everything (jmp's select_tree), adjust the scale; with ``jmp`` or
    with polyamp_jax.jmp_compat in its place."""

    @jax.jit
    def step(params, inner_state, loss_scale, x, bad):  # type: ignore[no-untyped-def]
        grads = jax.grad(lambda p: loss_scale.scale(_loss(p, x)))(params)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.inf, g) if g.dtype == jnp.float32 else g, grads)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_inner = inner.update(grads, inner_state, params)
        new_params = optax.apply_updates(params, updates)
        params = jmp.select_tree(finite, new_params, params)
        inner_state = jmp.select_tree(finite, new_inner, inner_state)
        return params, inner_state, loss_scale.adjust(finite)

    return step


@pytest.mark.parametrize("library", ["jmp", "jmp_compat"])
@pytest.mark.parametrize("make_inner", [lambda: optax.sgd(0.1, momentum=0.9), lambda: optax.adamw(1e-2)])
def test_the_transformation_equals_a_hand_written_jmp_step_bit_for_bit(make_inner, library: str) -> None:  # type: ignore[no-untyped-def]
    jmp = polyamp_jax.jmp_compat if library == "jmp_compat" else pytest.importorskip("jmp")
    pattern = "FFOFFFOOFFFFOF"
    inner = make_inner()
    tx = polyamp_jax.loss_scaled(make_inner(), enabled=True, growth_interval=3)

    @jax.jit
    def step(params, opt_state, x, bad):  # type: ignore[no-untyped-def]
        grads = jax.grad(lambda p: polyamp_jax.scale_loss(opt_state, _loss(p, x)))(params)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.inf, g) if g.dtype == jnp.float32 else g, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ours, opt_state = _params(), None
    opt_state = tx.init(ours)
    theirs, inner_state = _params(), inner.init(_params())
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**16), period=3)
    reference = _jmp_style_step(inner, jmp)
    for x, char in zip(_batches(len(pattern)), pattern, strict=True):
        before = _float_leaves(ours)
        ours, opt_state = step(ours, opt_state, x, jnp.asarray(char == "O"))
        theirs, inner_state, loss_scale = reference(theirs, inner_state, loss_scale, x, jnp.asarray(char == "O"))
        if char == "O":  # a skipped step: parameters and the inner state bitwise as they were
            assert all(a.tobytes() == b.tobytes() for a, b in zip(_float_leaves(ours), before, strict=True))
        assert [a.tobytes() for a in _float_leaves(ours)] == [a.tobytes() for a in _float_leaves(theirs)]
        assert float(polyamp_jax.state_dict(opt_state)["scale"]) == float(loss_scale.loss_scale)
    assert [a.tobytes() for a in _float_leaves(opt_state.inner)] == [a.tobytes() for a in _float_leaves(inner_state)]
    records = polyamp_jax.records(opt_state)
    assert [(r.skipped, r.reason) for r in records] == [(c == "O", "overflow" if c == "O" else None) for c in pattern]
    assert int(np.asarray(opt_state.scaler["scaler"]["skipped"])) == pattern.count("O")


def test_the_transformation_guards_under_bfloat16_and_follows_the_policy() -> None:
    with polyamp.policy_scope("mixed_bfloat16"):
        tx = polyamp_jax.loss_scaled(optax.sgd(0.1))
    params = _params()
    state = tx.init(params)
    assert polyamp_jax.scaler_of(state).mode == "guarding"
    loss = jnp.asarray(2.5)
    assert polyamp_jax.scale_loss(state, loss) is loss  # not scaling
    bad = jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.nan) if p.dtype == jnp.float32 else p, params)
    updates, state = tx.update(bad, state, params)
    assert all(not np.any(leaf) for leaf in _float_leaves(updates))
    assert [(r.skipped, r.reason, r.mode) for r in polyamp_jax.records(state)] == [(True, "non_finite", "guarding")]
    with polyamp.policy_scope("mixed_float16"):
        assert polyamp_jax.scaler_of(polyamp_jax.loss_scaled(optax.sgd(0.1)).init(params)).mode == "scaling"


def test_a_spike_rule_on_the_loss_takes_the_loss_as_an_extra_argument() -> None:
    rule = SpikeRule("loss", window=4, warmup=3, threshold=3.0)
    tx = polyamp_jax.loss_scaled(optax.sgd(0.01), enabled=True, spike=rule)
    params = _params()
    state = tx.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    losses = [1.0, 1.1, 0.9, 1.05, 50.0, 1.0]
    skipped = []
    for loss in losses:
        scale = polyamp_jax.state_dict(state)["scale"]
        scaled = jax.tree_util.tree_map(lambda g, s=scale: g * s, grads)
        _, state = tx.update(scaled, state, params, loss=jnp.asarray(loss))
        skipped.append(polyamp_jax.records(state)[-1].skipped)
    assert skipped == rule.decide(losses, [False] * len(losses))
    assert polyamp_jax.records(state)[4].reason == "loss_spike"
    with pytest.raises(polyamp.ScalerUsageError, match="needs loss="):
        tx.update(grads, state, params)


def test_state_dicts_resume_across_backends() -> None:
    """A state saved by the reference scaler (any backend's) resumes in the transformation with the same
    next scales, and the transformation's state dict loads back."""
    settings = {"growth_interval": 2, "hysteresis": 2, "min_scale": 64.0}
    source = LossScaler(**settings, enabled=True)
    source.load_state_dict({**source.state_dict(), "scale": 1024.0, "_growth_tracker": 1, "hysteresis_left": 1})
    saved = source.state_dict()
    tx = polyamp_jax.loss_scaled(optax.sgd(0.1), **settings, enabled=True)
    params = _params()
    state = polyamp_jax.load_state_dict(tx.init(params), saved)
    assert polyamp_jax.state_dict(state) == saved
    pattern = "FOFFOO"
    for char in pattern:
        value = math.inf if char == "O" else 1.0
        grads = jax.tree_util.tree_map(lambda p, v=value: jnp.full_like(p, v), params)
        _, state = tx.update(grads, state, params)
    start = LossScaleConfig(**settings)
    from polyamp import LossScaleState

    want = start.states(pattern, LossScaleState(1024.0, 1, 1))[-1]
    got = polyamp_jax.state_dict(state)
    assert (got["scale"], got["_growth_tracker"], got["hysteresis_left"]) == (
        want.scale,
        want.growth_tracker,
        want.hysteresis_left,
    )


def test_casting_follows_jmp_and_the_policy_in_effect() -> None:
    jmp = pytest.importorskip("jmp")
    tree = {"f": jnp.ones(2), "h": jnp.ones(2, jnp.float16), "i": jnp.ones(2, jnp.int32), "n": np.ones(2), "s": "x"}
    for spec in ("params=float32,compute=float16,output=float32", "params=float32,compute=bfloat16,output=bfloat16"):
        ours, theirs = polyamp.Policy(spec), jmp.get_policy(spec)
        for method in ("cast_to_compute", "cast_to_param", "cast_to_output"):
            got = getattr(polyamp_jax, method)(tree, ours)
            want = getattr(theirs, method)(tree)
            assert jax.tree_util.tree_map(lambda a: getattr(a, "dtype", a), got) == jax.tree_util.tree_map(
                lambda a: getattr(a, "dtype", a), want
            ), (spec, method)
    with polyamp.policy_scope("mixed_float16"):
        assert polyamp_jax.cast_to_compute(tree)["f"].dtype == jnp.float16
        assert polyamp_jax.cast_to_output(tree)["h"].dtype == jnp.float32


# -- polyamp_jax.jmp_compat (jmp's own tests run against it in tests/test_upstream_jax.py) ------------------

jc = polyamp_jax.jmp_compat


@pytest.mark.parametrize(
    ("name", "dtypes"),
    [
        ("c=f16", ("float32", "float16", "float16")),  # compute follows params, output follows compute
        ("p=f16,c=bf16", ("float16", "bfloat16", "bfloat16")),
        ("c=bf16,o=full", ("float32", "bfloat16", "float32")),
        ("params=float32,compute=float16,output=float32", ("float32", "float16", "float32")),
        ("p=bf16", ("bfloat16", "bfloat16", "bfloat16")),
        ("half", ("float16", "float16", "float16")),  # a bare dtype is all three (half: float16 off TPU)
        ("f32", ("float32", "float32", "float32")),
        ("bfloat16", ("bfloat16", "bfloat16", "bfloat16")),
        ("mixed_bfloat16", ("float32", "bfloat16", "float32")),  # polyamp's names read as polyamp reads them
    ],
)
def test_jmp_compat_get_policy_reads_jmps_grammar(name: str, dtypes: tuple[str, str, str]) -> None:
    policy = jc.get_policy(name)
    got = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    assert got == tuple(getattr(jnp, d) for d in dtypes)
    assert all(isinstance(d, type) and d.__module__ == "jax.numpy" for d in got)  # JAX's scalar types, as jmp's
    assert policy.policy == polyamp.Policy(param=dtypes[0], compute=dtypes[1], output=dtypes[2])
    assert str(policy) == "p={},c={},o={}".format(
        *({"float32": "full", "float16": "f16", "bfloat16": "bf16"}[d] for d in dtypes)
    )
    assert polyamp.Policy(str(policy)) == policy.policy  # jmp's text reads back in polyamp's grammar
    if name != "mixed_bfloat16":
        jmp = pytest.importorskip("jmp")
        theirs = jmp.get_policy(name)
        assert got == (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
        assert str(policy) == str(theirs)


def test_jmp_compat_policy_casts_floating_leaves_only() -> None:
    policy = jc.Policy(np.float32, "f16", jnp.bfloat16)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (jnp.float32, jnp.float16, jnp.bfloat16)
    tree = {"f": jnp.ones(2), "n": np.ones(2, np.float32), "i": jnp.ones(2, jnp.int32), "s": "x"}
    compute = policy.cast_to_compute(tree)
    assert (compute["f"].dtype, compute["n"].dtype, compute["i"].dtype, compute["s"]) == (
        jnp.float16,
        np.float16,
        jnp.int32,
        "x",
    )
    assert isinstance(compute["n"], np.ndarray)
    assert policy.cast_to_output(tree)["f"].dtype == jnp.bfloat16
    assert policy.cast_to_param({"h": jnp.ones(2, jnp.float16)})["h"].dtype == jnp.float32
    assert policy.with_output_dtype(jnp.float16) == jc.Policy(jnp.float32, jnp.float16, jnp.float16)
    assert jc.cast_to_full({"h": jnp.ones(1, jnp.float16)})["h"].dtype == jnp.float32
    assert jc.cast_to_half({"f": jnp.ones(1)})["f"].dtype == jc.half_dtype() == jnp.float16  # CPU


def test_jmp_compat_policy_errors_say_what_is_allowed() -> None:
    with pytest.raises(polyamp.InvalidPolicyError, match=r"Unknown dtype 'f64' in policy 'c=f64'.*no other dtype"):
        jc.get_policy("c=f64")
    with pytest.raises(polyamp.InvalidPolicyError, match=r"Unknown key 'x' in policy 'x=f16'.*p\|params"):
        jc.get_policy("x=f16")
    with pytest.raises(PolyampTypeError, match=r"get_policy\(\) takes a policy string.*Received: 16 \(of type int\)"):
        jc.get_policy(16)  # type: ignore[arg-type]
    with pytest.raises(polyamp.InvalidPolicyError, match=r"`compute_dtype` must be float32, float16 or bfloat16"):
        jc.Policy(jnp.float32, jnp.float64, jnp.float32)
    with pytest.raises(PolyampTypeError, match=r"`output_dtype` must be a dtype.*Received: None"):
        jc.Policy(jnp.float32, jnp.float16, None)


def _adjusted(loss_scale: object, pattern: str) -> list[tuple[float, int]]:
    got = []
    for char in pattern:
        loss_scale = loss_scale.adjust(jnp.bool_(char == "F"))  # type: ignore[attr-defined]
        got.append((float(loss_scale.loss_scale), int(loss_scale.counter)))  # type: ignore[attr-defined]
    return got


@pytest.mark.parametrize("factor", [2, 3])
def test_jmp_compat_dynamic_loss_scale_follows_polyamps_rule_and_equals_jmp(factor: int) -> None:
    pattern = "FFFOFFFFFFOOOOOOOFFF"
    ours = jc.DynamicLossScale(jnp.float32(64), period=3, factor=factor, min_loss_scale=2.0)
    config = LossScaleConfig(
        init_scale=64, growth_interval=3, growth_factor=factor, backoff_factor=1 / factor, min_scale=2.0
    )
    want = [(s.scale, s.growth_tracker) for s in config.states(pattern)]
    assert _adjusted(ours, pattern) == want
    jmp = pytest.importorskip("jmp")
    theirs = jmp.DynamicLossScale(jnp.float32(64), period=3, factor=factor, min_loss_scale=jnp.float32(2))
    assert _adjusted(theirs, pattern) == want


def test_jmp_compat_keeps_jmps_floor_of_one_where_polyamps_scalers_floor_at_a_lower_start() -> None:
    """From a scale of 0.5, an overflow: jmp (and jmp_compat, by its default min_loss_scale of 1) backs off to
    1.0; polyamp's own scalers, whose floor without min_scale is init_scale when that is below 1, keep 0.5."""
    jmp = pytest.importorskip("jmp")
    finite = jnp.asarray(False)
    theirs = jmp.DynamicLossScale(jnp.float32(0.5)).adjust(finite)
    ours = polyamp_jax.jmp_compat.DynamicLossScale(jnp.float32(0.5)).adjust(finite)
    assert float(theirs.loss_scale) == float(ours.loss_scale) == 1.0
    fn = LossScaler(init_scale=0.5, enabled=True).functional(backend="jax")
    assert fn.read(fn.update(fn.init(), jnp.asarray(1.0))).scale == 0.5


def test_jmp_compat_dynamic_loss_scale_rounds_a_factor_as_polyamp_does() -> None:
    """A factor float32 cannot hold (1.1): polyamp multiplies by the float64 factor (or its reciprocal) and rounds
    once; jmp rounds the factor to float32 first. The documented last-bit difference."""
    scale = float(np.float32(667903.1))
    ours = jc.DynamicLossScale(jnp.float32(scale), factor=1.1).adjust(jnp.bool_(False))
    config = LossScaleConfig(init_scale=scale, growth_factor=1.1, backoff_factor=1 / 1.1, min_scale=1.0)
    assert (
        float(ours.loss_scale) == config.next_state(config.initial_state(), True).scale == float(np.float32(607184.7))
    )
    jmp = pytest.importorskip("jmp")
    theirs = jmp.DynamicLossScale(jnp.float32(scale), factor=1.1).adjust(jnp.bool_(False))
    assert float(theirs.loss_scale) == float(np.float32(607184.6))


def test_jmp_compat_dynamic_loss_scale_is_a_pytree_of_scale_and_counter() -> None:
    loss_scale = jc.DynamicLossScale(2.0**15, period=5, factor=2, min_loss_scale=0.5)
    assert loss_scale.loss_scale.dtype == jnp.float32 and loss_scale.counter.dtype == jnp.int32
    leaves = jax.tree_util.tree_leaves(loss_scale)
    assert [(float(v), v.dtype) for v in leaves] == [(2.0**15, jnp.float32), (0, jnp.int32)]

    @jax.jit
    def step(loss_scale: jc.DynamicLossScale, finite: jax.Array) -> jc.DynamicLossScale:
        return loss_scale.adjust(finite)

    for _ in range(5):
        loss_scale = step(loss_scale, jnp.bool_(True))
    assert (float(loss_scale.loss_scale), int(loss_scale.counter)) == (2.0**16, 0)
    for _ in range(20):
        loss_scale = step(loss_scale, jnp.bool_(False))
    assert float(loss_scale.loss_scale) == 0.5  # min_loss_scale kept through jit (jmp's returns to 1 there)
    assert (loss_scale.period, loss_scale.factor, float(loss_scale.min_loss_scale)) == (5, 2, 0.5)
    grads = loss_scale.unscale({"g": jnp.ones(2, jnp.float16), "i": jnp.ones(2, jnp.int32)})
    assert (grads["g"].dtype, grads["g"].tolist(), grads["i"].tolist()) == (jnp.float16, [2.0, 2.0], [1, 1])
    scaled = loss_scale.scale(jnp.float16(3))
    assert (scaled.dtype, float(scaled)) == (jnp.float32, 1.5)  # in float32, as polyamp scales every loss


def test_jmp_compat_static_and_no_op_loss_scales() -> None:
    static = jc.StaticLossScale(4)
    assert jax.tree_util.tree_leaves(static) == [] and static.loss_scale == 4.0
    assert jax.jit(lambda s, x: s.scale(x))(static, jnp.float32(1.5)).tolist() == 6.0
    unscaled = static.unscale({"a": jnp.float32(6), "b": jnp.float16(2)})
    assert (unscaled["a"].tolist(), unscaled["b"].tolist(), unscaled["b"].dtype) == (1.5, 0.5, jnp.float16)
    assert static.adjust(jnp.bool_(False)) is static
    no_op = jc.NoOpLossScale()
    tree = {"a": jnp.ones(2)}
    assert no_op.scale(tree) is tree and no_op.unscale(tree) is tree and no_op.loss_scale == 1
    assert jax.tree_util.tree_leaves(no_op) == [] and no_op.adjust(jnp.bool_(False)) is no_op


def test_jmp_compat_all_finite_and_select_tree() -> None:
    assert bool(jc.all_finite({"a": jnp.ones(2), "i": jnp.ones(2, jnp.int32)})) is True
    assert bool(jc.all_finite({"a": jnp.ones(2), "b": float("nan")})) is False  # a Python number is checked too
    assert bool(jc.all_finite(None)) is True
    a, b = {"x": jnp.float32(1), "y": None}, {"x": jnp.float32(2), "y": None}
    assert jc.select_tree(jnp.bool_(True), a, b)["x"].tolist() == 1.0
    assert jc.select_tree(False, a, b)["x"].tolist() == 2.0
    assert jax.jit(jc.select_tree)(jnp.bool_(False), a, b)["x"].tolist() == 2.0


def test_jmp_compat_loss_scale_errors_say_what_is_allowed() -> None:
    with pytest.raises(PolyampTypeError, match=r"`loss_scale` must be a floating-point scalar.*dtype int32, shape"):
        jc.DynamicLossScale(jnp.asarray(1, jnp.int32))
    with pytest.raises(polyamp.InvalidConfigError, match=r"`loss_scale` must be a finite positive number.*-1\.0"):
        jc.DynamicLossScale(-1.0)
    with pytest.raises(PolyampTypeError, match=r"`counter` must be an int or a 0-d integer array.*dtype float32"):
        jc.DynamicLossScale(1.0, counter=jnp.float32(0))
    with pytest.raises(PolyampTypeError, match=r"`period` must be an int >= 1.*Received: 5\.0 \(of type float\)"):
        jc.DynamicLossScale(1.0, period=5.0)  # type: ignore[arg-type]
    with pytest.raises(
        polyamp.InvalidConfigError, match=r"`growth_factor` must be.*Received: growth_factor=1\.0.*factor"
    ):
        jc.DynamicLossScale(1.0, factor=1)
    with pytest.raises(
        polyamp.InvalidConfigError, match=r"`min_scale` must be.*min_scale=0\.0.*min_scale its min_loss"
    ):
        jc.DynamicLossScale(1.0, min_loss_scale=0.0)
    with pytest.raises(PolyampTypeError, match=r"`min_loss_scale` is a setting of the rule"):
        jax.jit(lambda m: jc.DynamicLossScale(1.0, min_loss_scale=m).loss_scale)(jnp.float32(1))
    with pytest.raises(polyamp.InvalidConfigError, match=r"StaticLossScale\(0\.0\).*`init_scale` must be"):
        jc.StaticLossScale(0)
    with pytest.raises(PolyampTypeError, match=r"StaticLossScale holds its scale as a setting"):
        jax.jit(lambda s: jc.StaticLossScale(s).loss_scale)(jnp.float32(2))
    with pytest.raises(PolyampTypeError, match=r"adjust\(grads_finite\) takes a boolean scalar.*shape \(2,\)"):
        jc.DynamicLossScale(1.0).adjust(jnp.array([True, False]))
    with pytest.raises(PolyampTypeError, match=r"select_tree\(pred, a, b\) takes a boolean scalar.*dtype float32"):
        jc.select_tree(jnp.float32(1), None, None)


def test_a_loss_scaler_handed_jax_arrays_says_how_to_scale_in_jax() -> None:
    assert polyamp.backend_api.detect_backend(jnp.ones(1)) == "jax"
    scaler = LossScaler(enabled=True)
    with pytest.raises(PolyampTypeError, match=r"polyamp_jax\.loss_scaled"):
        scaler.scale(jnp.ones(()))
    with pytest.raises(PolyampTypeError, match="optax transformation"):
        polyamp_jax.loss_scaled(object())  # type: ignore[arg-type]
    with pytest.raises(PolyampTypeError, match="holding one loss_scaled"):
        polyamp_jax.records(optax.sgd(0.1).init(_params()))


def test_a_steady_state_step_makes_no_host_transfer() -> None:
    """The jitted step with the transformation (scaling, a spike rule and records on) reads nothing to the
    host and sends nothing from it: JAX's transfer guard refuses any implicit transfer."""
    tx = polyamp_jax.loss_scaled(optax.adam(1e-3), enabled=True, spike=SpikeRule("grad_norm", window=4))
    params = _params()
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x):  # type: ignore[no-untyped-def]
        grads = jax.grad(lambda p: polyamp_jax.scale_loss(opt_state, _loss(p, x)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    batches = [jax.device_put(x) for x in _batches(6)]
    params, opt_state = step(params, opt_state, batches[0])  # compiled here
    with jax.transfer_guard("disallow"):
        for x in batches[1:]:
            params, opt_state = step(params, opt_state, x)
    assert len(polyamp_jax.records(opt_state)) == 6


def _manual_mixed(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The same computation cast by hand: the dense layer in float16, log-softmax and mean in float32."""
    h = jax.nn.relu(x.astype(jnp.float16) @ params["w"].astype(jnp.float16) + params["b"].astype(jnp.float16))
    h = h.astype(jnp.float32)
    return jnp.mean(jax.nn.log_softmax(h - jax.lax.stop_gradient(h.max(-1, keepdims=True))))


def _net(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["w"] + params["b"])
    return jnp.mean(jax.nn.log_softmax(h - jax.lax.stop_gradient(h.max(-1, keepdims=True))))


def test_autocast_runs_by_op_class_under_jit_and_grad() -> None:
    params, x = _params(), _batches(1)[0]
    region = polyamp_jax.autocast(_net, policy="mixed_float16", cast_outputs=False)
    assert jax.eval_shape(region, params, x).dtype == jnp.float32  # a mean of a log-softmax: float32
    jaxpr = str(jax.make_jaxpr(region)(params, x))
    assert "f16[5,3] = dot_general" in jaxpr and "f32[5,3] = exp" in jaxpr
    got = jax.jit(jax.grad(polyamp_jax.autocast(_net, policy="mixed_float16")))(params, x)
    want = jax.grad(_manual_mixed)(params, x)
    for name in params:
        assert got[name].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=2e-3, atol=1e-5)
    plain = polyamp_jax.autocast(_net, policy="float32")  # float32: fn as it is
    assert float(plain(params, x)) == float(_net(params, x))
    with polyamp.policy_scope("mixed_bfloat16"):  # None: the policy in effect when called
        assert "bf16[5,3] = dot_general" in str(jax.make_jaxpr(polyamp_jax.autocast(_net))(params, x))


def test_autocast_keeps_explicit_casts_control_flow_and_captured_arrays() -> None:
    params, x = _params(), _batches(1)[0]
    captured = jnp.ones(3)

    def fn(p: dict[str, jax.Array], xb: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        h = xb @ p["w"]
        kept = h.astype(jnp.float32) * 2  # an explicit cast: float32
        looped = jax.lax.fori_loop(0, 3, lambda i, v: v * 1.5, h)  # control flow: as traced, compute dtype
        return kept, looped, h + captured  # the captured float32 array promotes

    kept, looped, promoted = jax.eval_shape(
        polyamp_jax.autocast(fn, policy="mixed_float16", cast_outputs=False), params, x
    )
    assert (kept.dtype, looped.dtype, promoted.dtype) == (jnp.float32, jnp.float16, jnp.float32)
    outputs = polyamp_jax.autocast(fn, policy="params=float32,compute=float16,output=bfloat16")(params, x)
    assert {o.dtype for o in outputs} == {jnp.dtype(jnp.bfloat16)}


def test_autocast_runs_remat_bodies_by_op_class_and_keeps_them_checkpointed() -> None:
    """A jax.checkpoint (jax.remat) body runs by op class, as the same code outside one does (a softmax's exp in
    float32, its matmul in float16), and stays a checkpoint; its values and gradients are those without it."""
    w = jnp.linspace(-1.0, 1.0, 20).reshape(4, 5)
    x = jnp.linspace(-3.0, 3.0, 12).reshape(3, 4)

    def body(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.nn.softmax(x @ w)

    remat = polyamp_jax.autocast(lambda w, x: jax.checkpoint(body)(w, x), policy="mixed_float16")
    plain = polyamp_jax.autocast(body, policy="mixed_float16")
    closed = jax.make_jaxpr(remat)(w, x)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("remat2", "checkpoint")]
    inner = str(eqn.params["jaxpr"])
    assert "f32[3,5] = exp" in inner and "f16[3,5] = exp" not in inner and "f16[3,5] = dot_general" in inner
    assert str(jax.make_jaxpr(plain)(w, x)).count("f32[3,5] = exp") == 1
    np.testing.assert_array_equal(np.asarray(remat(w, x)), np.asarray(plain(w, x)))
    grad_remat = jax.jit(jax.grad(lambda w: jnp.sum(remat(w, x)[:, 0])))(w)
    grad_plain = jax.jit(jax.grad(lambda w: jnp.sum(plain(w, x)[:, 0])))(w)
    assert grad_remat.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grad_remat), np.asarray(grad_plain), rtol=1e-6, atol=1e-7)


def test_autocast_keeps_custom_derivative_rules() -> None:
    """jax.nn.relu's custom JVP rule gives 0 at 0, where its body (max(x, 0)) gives 0.5: under autocast the rule
    is kept (run by class) under grad, jit, vmap, jvp and second derivatives, as without autocast; a
    jax.custom_vjp function runs as written, with its rule. A custom_jvp defined inside the function, whose rule
    closes over values traced there, is differentiated through its body, with a warning."""
    relu = polyamp_jax.autocast(jax.nn.relu, policy="mixed_float16")
    xs = jnp.asarray([-1.0, 0.0, 2.0])
    assert np.asarray(jax.vmap(jax.grad(relu))(xs)).tolist() == [0.0, 0.0, 1.0]
    assert np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(relu(v))))(xs)).tolist() == [0.0, 0.0, 1.0]
    assert float(jax.grad(relu)(jnp.float32(0.0))) == float(jax.grad(jax.nn.relu)(jnp.float32(0.0))) == 0.0
    out, tangent = jax.jvp(relu, (xs,), (jnp.ones(3),))
    assert (out.dtype, tangent.dtype, np.asarray(tangent).tolist()) == (jnp.float32, jnp.float32, [0.0, 0.0, 1.0])
    square = polyamp_jax.autocast(lambda v: jnp.sum(jax.nn.relu(v) ** 2), policy="mixed_float16")
    assert np.asarray(jax.hessian(square)(jnp.asarray([0.0, 1.0]))).tolist() == [[0.0, 0.0], [0.0, 2.0]]

    @jax.custom_vjp
    def sine(v: jax.Array) -> jax.Array:
        return jnp.sin(v)

    sine.defvjp(lambda v: (jnp.sin(v), v), lambda v, g: (g * 3.0,))
    assert float(jax.grad(polyamp_jax.autocast(sine, policy="mixed_float16"))(jnp.float32(0.5))) == 3.0

    def closing(v: jax.Array, a: jax.Array) -> jax.Array:
        @jax.custom_jvp
        def scaled_exp(u: jax.Array) -> jax.Array:
            return jnp.exp(u) * a

        scaled_exp.defjvp(lambda primals, tangents: (scaled_exp(primals[0]), 7.0 * tangents[0]))
        return scaled_exp(v)

    with pytest.warns(UserWarning, match=r"custom JVP rule of 'scaled_exp' uses values traced inside"):
        slope = jax.grad(polyamp_jax.autocast(closing, policy="mixed_float16"))(jnp.float32(1.0), jnp.float32(2.0))
    assert float(slope) == pytest.approx(2.0 * math.e, rel=1e-3)


def test_replicas_skip_together_over_a_named_axis() -> None:
    """Two replicas (a vmap with an axis name, as pmap/shard_map give one) with different gradients: when one
    overflows, both skip and keep one scale; without the axis name each decides on its own."""
    params = _params()

    def run(axis_name: str | None) -> tuple[np.ndarray, list[float]]:
        tx = polyamp_jax.loss_scaled(optax.sgd(0.1), enabled=True, axis_name=axis_name)
        state = tx.init(params)
        stacked = jax.tree_util.tree_map(lambda leaf: jnp.stack([leaf, leaf]), (params, state))

        def step(p, s, bad):  # type: ignore[no-untyped-def]
            grads = jax.tree_util.tree_map(lambda leaf: jnp.where(bad, jnp.inf, jnp.ones_like(leaf)), p)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        replicated = jax.jit(jax.vmap(step, axis_name="replicas"))
        new_params, new_state = replicated(*stacked, jnp.asarray([False, True]))  # replica 1 overflows
        moved = np.asarray(jnp.any(new_params["w"] != stacked[0]["w"], axis=(1, 2)))
        return moved, [float(s) for s in np.asarray(new_state.scaler["scaler"]["scale"])]

    moved, scales = run("replicas")
    assert moved.tolist() == [False, False] and scales == [32768.0, 32768.0]
    moved, scales = run(None)
    assert moved.tolist() == [True, False] and scales == [65536.0, 32768.0]


def test_flax_nnx_optimizer_takes_the_transformation() -> None:
    """Flax NNX: ``nnx.Optimizer(model, loss_scaled(...))``, the loss scaled with the optimizer's state inside
    ``nnx.jit``; the overflowing step is skipped (parameters unchanged, recorded) and the others train."""
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):  # type: ignore[misc]
        def __init__(self, rngs: object) -> None:
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l2(jax.nn.relu(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, polyamp_jax.loss_scaled(optax.adam(1e-2), enabled=True), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y, bad):  # type: ignore[no-untyped-def]
        def loss_fn(model):  # type: ignore[no-untyped-def]
            loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
            return polyamp_jax.scale_loss(optimizer.opt_state, loss), loss

        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.inf, g), grads)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    x, y = jnp.asarray(rng.normal(size=(32, 8)).astype("float32")), jnp.asarray(rng.integers(0, 4, 32))
    losses, kernels = [], []
    for index in range(6):
        kernels.append(np.asarray(model.l1.kernel[...]))
        losses.append(float(step(model, optimizer, x, y, jnp.asarray(index == 3))))
    assert kernels[4].tobytes() == kernels[3].tobytes()  # the skipped step left the weights bitwise as they were
    assert kernels[3].tobytes() != kernels[2].tobytes()
    assert losses[4] == losses[3] and losses[5] < losses[4] and losses[3] < losses[0]  # step 3 changed nothing
    records = polyamp_jax.records(optimizer.opt_state)
    assert [(r.skipped, r.reason) for r in records] == [(i == 3, "overflow" if i == 3 else None) for i in range(6)]
    assert polyamp_jax.state_dict(optimizer.opt_state)["scale"] == 32768.0


def test_records_name_the_gradients_of_a_skipped_step_in_the_functional_form() -> None:
    """init(grads=...) counts, in the jitted step and only when it skips, which gradients held inf/NaN; the
    record of that step names them by their place in the tree, once."""
    fn = polyamp.LossScaler(enabled=True).functional(backend="jax")
    params = {"params": {"Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}, "scale": jnp.ones(())}}
    state = fn.init(grads=params)

    @jax.jit
    def step(state: Any, grads: Any) -> Any:
        grads, found_inf = fn.unscale(state, grads)
        return fn.update(state, found_inf, grads=grads)

    finite = jax.tree_util.tree_map(jnp.ones_like, params)
    bad = {**finite, "params": {**finite["params"], "Dense_0": {**finite["params"]["Dense_0"]}}}
    kernel = jnp.ones((2, 3)).at[0, 0].set(jnp.inf).at[1, 2].set(-jnp.inf).at[0, 1].set(jnp.nan)
    bad["params"]["Dense_0"]["kernel"] = kernel
    for grads in (finite, bad, finite):
        state = step(state, grads)
    records = fn.records(state)
    assert [(r.iteration, r.skipped, r.reason) for r in records] == [
        (0, False, None),
        (1, True, "overflow"),
        (2, False, None),
    ]
    assert [(g.name, g.layer, g.inf, g.neg_inf, g.nan, g.size) for g in records[1].gradients] == [
        ("params/Dense_0/kernel", "params/Dense_0", 1, 1, 1, 6)
    ]
    assert records[0].gradients == records[2].gradients == ()
    assert fn.records(state)[1].gradients == records[1].gradients  # attached once, not again on a later read
    # A state loaded from a state dict keeps counting for the same gradients; its records start anew.
    loaded = fn.load_state_dict(fn.state_dict(state), like=state)
    loaded = step(loaded, bad)
    assert [g.name for g in fn.records(loaded)[0].gradients] == ["params/Dense_0/kernel"]
    with pytest.raises(polyamp.ScalerUsageError, match=r"update\(\) needs grads=: this state counts"):
        fn.update(state, jnp.asarray(0.0))
    with pytest.raises(polyamp.PolyampTypeError, match=r"received 1 gradients, but the state counts 3"):
        fn.update(state, jnp.asarray(0.0), grads=[jnp.ones(3)])


@pytest.mark.parametrize(
    "dtype",
    ["float16", pytest.param("bfloat16", marks=pytest.mark.slow), pytest.param("float32", marks=pytest.mark.slow)],
)
def test_non_finite_counts_and_the_finite_check_are_exact(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counts of +inf, -inf and NaN per gradient, and all_finite, equal numpy's on planted values, for
    every float dtype and a 0-d leaf; leaves too large for int32 counts take the plain isfinite check, which
    agrees."""
    from polyamp_jax import _functional

    rng = np.random.default_rng(7)
    leaves = []
    for shape in [(), (5,), (17, 9), (3, 4, 6)]:
        values = rng.normal(size=shape).astype(np.float32)
        flat = values.reshape(-1)
        picks = rng.choice(flat.size, size=min(flat.size, 7), replace=False)
        flat[picks] = rng.choice(np.array([np.inf, -np.inf, np.nan, 1.0], np.float32), size=picks.size)
        leaves.append(jnp.asarray(values).astype(dtype))
    leaves.append(jnp.ones((4,), jnp.int32))  # not floating: counted as finite
    leaves.append(jnp.asarray(rng.normal(size=(6,)).astype(np.float32)).astype(dtype))  # finite
    expected = []
    for leaf in leaves:
        data = np.asarray(leaf.astype(jnp.float32))
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            expected.append([0, 0, 0, data.size])
            continue
        expected.append(
            [int(np.sum(data == np.inf)), int(np.sum(data == -np.inf)), int(np.sum(np.isnan(data))), data.size]
        )
    assert np.asarray(jax.jit(_functional._counts)(leaves)).tolist() == expected
    for limit in (_functional._COUNTABLE, 1):  # 1: every leaf takes the plain check
        monkeypatch.setattr(_functional, "_COUNTABLE", limit)
        for leaf, row in zip(leaves, expected, strict=True):
            assert bool(jax.jit(polyamp_jax.all_finite)([leaf])) is (sum(row[:3]) == 0)
        assert bool(polyamp_jax.all_finite(leaves)) is False
        assert bool(polyamp_jax.all_finite(leaves[-2:])) is True


def test_the_check_and_the_counts_of_a_skipped_step_are_one_pass_over_each_gradient() -> None:
    """A loss_scaled step that counts which gradients held inf/NaN reads each gradient once for the finite
    check and the counts together: XLA compiles the step to one three-count reduction per gradient and no
    conditional (a conditional over the gradients costs a copy of them on XLA's CPU backend)."""
    params = {"a": jnp.ones((64, 32)), "b": jnp.ones(32), "c": {"d": jnp.ones((8, 8, 2))}}
    with polyamp.policy_scope("mixed_float16"):
        tx = polyamp_jax.loss_scaled(optax.adam(1e-3))
    cpu = jax.devices("cpu")[0]  # the HLO of XLA's CPU backend, on any machine
    params, state = jax.device_put((params, tx.init(params)), cpu)
    hlo = jax.jit(tx.update).lower(params, state, params).compile().as_text()
    reductions = [line for line in hlo.splitlines() if " reduce(" in line]
    assert sum("(s32[], s32[], s32[]) reduce(" in line for line in reductions) == 3
    # The only reductions over all of a 2-d or 3-d gradient are those counts (the check reads no gradient again).
    assert [line.split("reduce(")[0].split("= ")[1] for line in reductions if "dimensions={0,1}" in line] == [
        "(s32[], s32[], s32[]) "
    ]
    assert [line.split("reduce(")[0].split("= ")[1] for line in reductions if "dimensions={0,1,2}" in line] == [
        "(s32[], s32[], s32[]) "
    ]
    assert "conditional(" not in hlo


def test_loss_scaled_records_name_the_overflowing_parameter() -> None:
    params = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}}
    with polyamp.policy_scope("mixed_float16"):
        tx = polyamp_jax.loss_scaled(optax.sgd(0.1))
    opt_state = tx.init(params)
    grads = {"dense": {"kernel": jnp.full((3, 2), jnp.inf), "bias": jnp.ones(2)}}
    _, opt_state = jax.jit(tx.update)(grads, opt_state, params)
    (record,) = polyamp_jax.records(opt_state)
    assert record.skipped and [(g.name, g.inf, g.size) for g in record.gradients] == [("dense/kernel", 6, 6)]
    assert record.layers == ("dense",)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale", [2.0**25, 3 * 2.0**20, 1000.0])
def test_half_precision_gradients_are_unscaled_as_torchs_kernel_unscales_them(dtype: str, scale: float) -> None:
    """A float16 or bfloat16 gradient is multiplied by the float32 reciprocal of the scale in float32 and rounded
    once to its dtype, bit for bit as torch's unscale kernel (GradScaler's) does; the reciprocal rounded to
    float16 would be 0 at 2**25 and 6% off at 3 * 2**20."""
    torch = pytest.importorskip("torch")
    values = [3000.0, 1.0, 65504.0, -7.5, 6.1e-5, 0.0]
    fn = LossScaler(init_scale=scale, enabled=True).functional(backend="jax")
    (ours,), found_inf = jax.jit(fn.unscale)(fn.init(), [jnp.asarray(values, dtype)])
    theirs = torch.tensor(values, dtype=getattr(torch, dtype))
    found = torch.zeros(1)
    inverse = torch.tensor(scale, dtype=torch.float64).reciprocal().float()  # GradScaler's reciprocal
    torch._amp_foreach_non_finite_check_and_unscale_([theirs], found, inverse)
    assert ours.dtype == jnp.dtype(dtype) and float(found_inf) == float(found) == 0.0
    assert np.asarray(ours.astype(jnp.float32)).tobytes() == theirs.float().numpy().tobytes()
    assert np.asarray(ours.astype(jnp.float32))[0] != 0.0


def _ceiling_run(path: str, steps: int) -> tuple[list[float], list[float], list[Any]]:
    """``steps`` jitted steps of one JAX path growing the scale at every step from 2**120, each on a gradient of
    1.0 (times the scale): the scales after each step, the unscaled gradients (or SGD's updates, negated) and
    the records (none for jmp_compat, which keeps none)."""
    params = jnp.zeros(3)
    if path == "loss_scaled":
        tx = polyamp_jax.loss_scaled(optax.sgd(1.0), init_scale=2.0**120, growth_interval=1, enabled=True)
        opt_state = tx.init(params)

        @jax.jit
        def step(opt_state: Any) -> tuple[Any, Any]:
            grads = jax.grad(lambda p: polyamp_jax.scale_loss(opt_state, jnp.sum(p)))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return -updates, opt_state

        scales, values = [], []
        for _ in range(steps):
            update, opt_state = step(opt_state)
            scales.append(polyamp_jax.state_dict(opt_state)["scale"])
            values.append(float(update[0]))
        return scales, values, polyamp_jax.records(opt_state)
    if path == "functional":
        fn = LossScaler(init_scale=2.0**120, growth_interval=1, enabled=True).functional(backend="jax")

        @jax.jit
        def fn_step(state: Any) -> tuple[Any, Any]:
            grads, found_inf = fn.unscale(state, jax.grad(lambda p: fn.scale(state, jnp.sum(p)))(params))
            return grads, fn.update(state, found_inf)

        state = fn.init()
        scales, values = [], []
        for _ in range(steps):
            grads, state = fn_step(state)
            scales.append(fn.read(state).scale)
            values.append(float(grads[0]))
        return scales, values, fn.records(state)
    loss_scale = polyamp_jax.jmp_compat.DynamicLossScale(jnp.float32(2.0**120), period=1)

    @jax.jit
    def jmp_step(loss_scale: Any) -> tuple[Any, Any]:
        grads = loss_scale.unscale(jax.grad(lambda p: loss_scale.scale(jnp.sum(p)))(params))
        return grads, loss_scale.adjust(polyamp_jax.jmp_compat.all_finite(grads))

    scales, values = [], []
    for _ in range(steps):
        grads, loss_scale = jmp_step(loss_scale)
        scales.append(float(loss_scale.loss_scale))
        values.append(float(grads[0]))
    return scales, values, []


@pytest.mark.parametrize("path", ["loss_scaled", "functional", "jmp_compat"])
def test_the_scale_stops_where_its_float32_reciprocal_stops_being_normal_on_every_jax_path(path: str) -> None:
    """Growing at every finite step, each JAX path stops the scale at 2**126 (the core's RECIPROCAL_CEILING),
    where the float32 reciprocal that unscales is still a normal number: every step's gradient comes back as
    1.0 (above it XLA on CPU flushes the reciprocal to 0, and every update was -0.0 while the step was recorded
    as applied). The records replay the same scales."""
    scales, values, records = _ceiling_run(path, 10)
    expected = [2.0**121, 2.0**122, 2.0**123, 2.0**124, 2.0**125] + [2.0**126] * 5
    assert scales == expected
    assert values == [1.0] * 10
    if path != "jmp_compat":
        assert [(r.skipped, r.scale, r.next_scale) for r in records] == list(
            zip([False] * 10, [2.0**120, *expected[:-1]], expected, strict=True)
        )


def test_a_scale_above_the_ceiling_is_refused_on_every_jax_path() -> None:
    """A scale JAX cannot unscale by (above 2**126) is refused with what was received and what is allowed: as a
    setting, as a static scale, and in a state dict (a torch run that grew there), which then changes nothing."""
    with pytest.raises(polyamp.InvalidConfigError, match=r"`init_scale` must be at most 8\.5070591730234\d*e\+37"):
        polyamp_jax.loss_scaled(optax.sgd(1.0), init_scale=2.0**127)
    with pytest.raises(polyamp.InvalidConfigError, match=r"StaticLossScale\(1\.7014118346046923e\+38\) cannot run"):
        polyamp_jax.jmp_compat.StaticLossScale(2.0**127)
    fn = LossScaler(growth_interval=4, enabled=True).functional(backend="jax")
    state = fn.init()
    saved = {**fn.state_dict(state), "scale": 2.0**127, "growth_interval": 2}
    with pytest.raises(polyamp.StateDictError, match=r"scale=1\.7014118346046923e\+38 is above 8\.5070591730234"):
        fn.load_state_dict(saved)
    assert (
        fn.config.growth_interval == 4 and fn.read(fn.load_state_dict({**saved, "scale": 2.0**126})).scale == 2.0**126
    )


def test_a_flag_that_is_not_one_scalar_is_refused() -> None:
    """apply_if_finite and update take one flag: an array of flags (which jnp.where would broadcast into the
    trees, giving a scalar parameter the shape (2,) and mixing both trees element by element) is refused with
    a PolyampTypeError saying what was received, as jmp_compat's select_tree refuses it. Scalars of any kind
    are taken."""
    fn = LossScaler(enabled=True).functional(backend="jax")
    state = fn.init()
    applied, current = {"w": jnp.float32(1.0)}, {"w": jnp.float32(2.0)}
    for flag in (jnp.asarray([0.0, 1.0]), np.asarray([True, False]), [0.0, 1.0]):
        with pytest.raises(PolyampTypeError, match=r"takes one flag: a scalar.*Received: .*Reduce several flags"):
            fn.apply_if_finite(flag, applied, current)
        with pytest.raises(PolyampTypeError, match=r"update\(\) takes one flag"):
            fn.update(state, flag)
    with pytest.raises(PolyampTypeError, match=r"of shape \(2,\)"):
        jax.jit(fn.apply_if_finite)(jnp.asarray([0.0, 1.0]), applied, current)
    for flag, expected in ((jnp.asarray(1.0), 2.0), (jnp.asarray(False), 1.0), (True, 2.0), (np.float32(0.0), 1.0)):
        chosen = fn.apply_if_finite(flag, applied, current)
        assert chosen["w"].shape == () and float(chosen["w"]) == expected
    assert fn.read(fn.update(state, jnp.asarray(1.0))).scale == 32768.0


def test_a_loss_scaled_state_pickles() -> None:
    """pickle round-trips a loss_scaled state (its functional scaler included: no local function in it), and
    training on from the copy gives the same parameters, optimizer state and scale, bit for bit."""
    import pickle

    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    tx = polyamp_jax.loss_scaled(optax.adam(1e-2), enabled=True, growth_interval=2, axis_name=None)

    @jax.jit
    def step(params: Any, opt_state: Any, bad: Any) -> tuple[Any, Any]:
        grads = jax.grad(lambda p: polyamp_jax.scale_loss(opt_state, jnp.sum(jnp.sin(p["w"]))))(params)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.nan, g), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for bad in (False, True, False):
        params, opt_state = step(params, opt_state, jnp.asarray(bad))
    copy = pickle.loads(pickle.dumps(opt_state))
    assert isinstance(copy, polyamp_jax.LossScaledState) and copy.fn.config == opt_state.fn.config
    ours, theirs = (params, copy), (params, opt_state)
    for bad in (False, False, True):
        ours, theirs = step(*ours, jnp.asarray(bad)), step(*theirs, jnp.asarray(bad))
    leaves = [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(ours)]
    assert leaves == [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(theirs)]
    assert polyamp_jax.state_dict(ours[1]) == polyamp_jax.state_dict(theirs[1])


def test_settings_loaded_after_a_jitted_step_reach_the_step_or_are_refused() -> None:
    """A state dict with other settings, once a jitted step traced the functional scaler's update: loading it
    into that scaler raises (the step holds the old growth_interval as a constant) and changes nothing;
    restore() gives a scaler that follows the dict, whose jitted step grows every 2 steps, and whose state
    dicts load back. Before any compiled step, load_state_dict adopts the settings as it always did."""
    fn = LossScaler(growth_interval=4, enabled=True).functional(backend="jax")

    def make_step(fn: Any) -> Any:
        @jax.jit
        def step(state: Any) -> Any:
            _, found_inf = fn.unscale(state, [jnp.ones(3)])
            return fn.update(state, found_inf)

        return step

    state = make_step(fn)(fn.init())
    saved = {**fn.state_dict(state), "growth_interval": 2, "_growth_tracker": 0}
    with pytest.raises(polyamp.ScalerUsageError, match=r"growth_interval: 4 -> 2.*fn\.restore\(state_dict\)"):
        fn.load_state_dict(saved)
    assert fn.config.growth_interval == 4 and fn.read(state).growth_tracker == 1
    resumed, loaded = fn.restore(saved)
    assert resumed is not fn and resumed.config.growth_interval == 2 and fn.config.growth_interval == 4
    step = make_step(resumed)
    scales = []
    for _ in range(5):
        loaded = step(loaded)
        scales.append(resumed.read(loaded).scale)
    assert scales == LossScaleConfig(growth_interval=2).trajectory("FFFFF")
    back = LossScaler(enabled=True)
    back.load_state_dict(resumed.state_dict(loaded))  # a state polyamp's own loader takes
    assert (back.config.growth_interval, back.get_state().growth_tracker) == (2, 1)
    assert fn.restore(fn.state_dict(state))[0] is fn  # the same settings: the same scaler
    fresh = LossScaler(growth_interval=4, enabled=True).functional(backend="jax")
    adopted = fresh.load_state_dict(saved)  # nothing traced yet: adopted, and a later jit follows it
    assert fresh.config.growth_interval == 2
    assert fresh.read(make_step(fresh)(make_step(fresh)(adopted))).scale == 131072.0


def test_loss_scaled_settings_loaded_after_a_jitted_step_travel_with_the_state() -> None:
    """polyamp_jax.load_state_dict with other settings, after the step was jitted: the restored state carries
    them (its own functional scaler, as Flax's DynamicScale carries its fields), so the same jitted step
    traces anew and grows every 2 steps; its state dict loads back, and the transformation's fresh states keep
    growth_interval 4."""
    params = {"w": jnp.ones(3)}
    tx = polyamp_jax.loss_scaled(optax.sgd(0.0), enabled=True, growth_interval=4)

    @jax.jit
    def step(opt_state: Any) -> Any:
        grads = jax.grad(lambda p: polyamp_jax.scale_loss(opt_state, jnp.sum(p["w"])))(params)
        return tx.update(grads, opt_state, params)[1]

    opt_state = step(tx.init(params))
    saved = {**polyamp_jax.state_dict(opt_state), "growth_interval": 2, "_growth_tracker": 0}
    loaded = polyamp_jax.load_state_dict(opt_state, saved)
    scales = []
    for _ in range(5):
        loaded = step(loaded)
        scales.append(polyamp_jax.state_dict(loaded)["scale"])
    assert scales == LossScaleConfig(growth_interval=2).trajectory("FFFFF")
    written = polyamp_jax.state_dict(loaded)
    assert (written["growth_interval"], written["_growth_tracker"]) == (2, 1)
    LossScaler(enabled=True).load_state_dict(written)
    assert [r.next_scale for r in polyamp_jax.records(loaded)] == scales
    assert polyamp_jax.state_dict(step(tx.init(params)))["growth_interval"] == 4


def test_records_are_each_states_own() -> None:
    """The records of a loss_scaled state are its own: two states of one transformation keep theirs (one
    skipped, the other never did); an older state gives only its own iterations, also when read after a
    later one; init() starts a new run and leaves the others as they were; a state stepped again from an older
    one (a rollback) reads its own iterations from where it differs, with the scales its rule gives, and the
    first branch's states still read theirs."""
    params = {"w": jnp.ones(3)}
    tx = polyamp_jax.loss_scaled(optax.sgd(0.1), enabled=True, growth_interval=2)

    @jax.jit
    def step(opt_state: Any, bad: Any) -> Any:
        grads = jax.grad(lambda p: polyamp_jax.scale_loss(opt_state, jnp.sum(p["w"])))(params)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.inf, g), grads)
        return tx.update(grads, opt_state, params)[1]

    def seen(opt_state: Any) -> list[tuple[int, bool, float | None, float | None]]:
        return [(r.iteration, r.skipped, r.scale, r.next_scale) for r in polyamp_jax.records(opt_state)]

    a0, b0 = tx.init(params), tx.init(params)
    a1 = step(a0, False)
    a2 = step(a1, True)
    a3 = step(a2, False)
    b1 = step(b0, False)
    first_branch = [(0, False, 65536.0, 65536.0), (1, True, 65536.0, 32768.0), (2, False, 32768.0, 32768.0)]
    assert seen(a3) == first_branch
    assert seen(b1) == [(0, False, 65536.0, 65536.0)]
    assert seen(a1) == first_branch[:1] and seen(a0) == []
    assert seen(tx.init(params)) == [] and seen(a3) == first_branch and seen(b1) == seen(a1)
    rolled_back = step(step(a1, False), False)  # iteration 1 again, from a1: finite this time
    assert seen(rolled_back) == [
        (0, False, 65536.0, 65536.0),
        (1, False, 65536.0, 131072.0),
        (2, False, 131072.0, 131072.0),
    ]
    assert seen(a3) == first_branch and seen(a2) == first_branch[:2]
    assert polyamp_jax.state_dict(rolled_back)["scale"] == 131072.0
