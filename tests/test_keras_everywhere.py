"""polyamp_keras.LossScaleOptimizer on every Keras backend: TensorFlow, JAX and PyTorch, one trajectory.

The tests run in this process on its Keras backend; `test_on_every_keras_backend` runs this module again in
a subprocess per other backend (Keras picks its backend once per process), and
`test_conformance_suite_on_every_keras_backend` runs polyamp's conformance suite there, with the torch
target beside it for the cross-framework resume (a state dict saved on torch-cpu continues on keras-<b>-cpu).
"""

from __future__ import annotations

import importlib.util
import json
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402
from polyamp import BackendMismatchError, LossScaleConfig, PolyampTypeError, PolyampValueError  # noqa: E402
from polyamp_keras.testing import apply, gradients, keras_backend  # noqa: E402

if TYPE_CHECKING:
    from conftest import RunOnKerasBackend

ops = keras.ops
BACKEND = keras_backend()
HERE = Path(__file__).resolve()


def _installed(backend: str) -> bool:
    return importlib.util.find_spec(backend) is not None


def _model(seed: int = 0) -> Any:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])


def _step(model: Any, optimizer: Any, x: Any, y: Any, *, overflow: bool = False, scaled: bool = True) -> None:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = list(model.trainable_variables)
    _, grads = gradients(lambda: loss_fn(y, model(x, training=True)), variables, optimizer, scaled=scaled)
    grads = list(grads)
    if overflow:
        grads[0] = ops.scatter_update(grads[0], [[0, 0]], ops.convert_to_tensor([math.inf], dtype=grads[0].dtype))
    apply(optimizer, grads, variables)


def _data(seed: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    return ops.convert_to_tensor(rng.normal(size=(8, 6)).astype("float32")), ops.convert_to_tensor(
        rng.integers(0, 3, size=(8,))
    )


def _state(optimizer: Any) -> tuple[float, int, int]:
    state = optimizer.state_dict()
    return state["scale"], state["_growth_tracker"], state["hysteresis_left"]


# -- the rule, the skip and the custom loops ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"growth_interval": 2},
        {"growth_interval": 2, "hysteresis": 2, "min_scale": 4096.0, "max_scale": 2.0**17},
        {"init_scale": 1000.0, "growth_factor": 1.37, "backoff_factor": 0.61, "growth_interval": 1},
    ],
    ids=["default", "hysteresis_bounds", "odd_factors"],
)
def test_custom_loop_follows_the_reference_and_skips_bitwise(settings: dict[str, Any]) -> None:
    pattern = "FFOFFOOFFFFO"
    model = _model()
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01), **settings)
    optimizer.build(model.trainable_variables)
    states = []
    for step, char in enumerate(pattern):
        before = [
            np.array(ops.convert_to_numpy(v))
            for v in [*model.trainable_variables, *optimizer.inner_optimizer.variables]
        ]
        _step(model, optimizer, *_data(step), overflow=char == "O")
        after = [
            np.array(ops.convert_to_numpy(v))
            for v in [*model.trainable_variables, *optimizer.inner_optimizer.variables]
        ]
        if char == "O":  # parameters, slots and iterations bitwise unchanged
            assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
        states.append(_state(optimizer))
    reference = LossScaleConfig(**settings).states(pattern)
    assert states == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in reference]
    records = optimizer.records()  # one per apply, replayed by the core: the same schema as polyamp.LossScaler's
    assert [(r.iteration, r.reason, r.mode, r.next_scale) for r in records] == [
        (i, "overflow" if c == "O" else None, "scaling", s.scale) for i, (c, s) in enumerate(zip(pattern, reference))
    ]
    assert int(ops.convert_to_numpy(optimizer.skipped_steps)) == pattern.count("O")
    assert int(ops.convert_to_numpy(optimizer.iterations)) == pattern.count("F")


@pytest.mark.parametrize("guard", [None, False])
def test_guard_skips_a_non_finite_step_under_bfloat16_and_records_it(guard: bool | None) -> None:
    """enabled=None under mixed_bfloat16: no scaling; the guard (default) skips the step with an inf gradient,
    bitwise, counts and records it; guard=False applies it (the weights go non-finite)."""
    model = _model()
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01), enabled=None, guard=guard)
    optimizer.build(model.trainable_variables)
    watched = [*model.trainable_variables, *optimizer.inner_optimizer.variables]
    with polyamp.policy_scope("mixed_bfloat16"):
        for step in range(5):
            before = [np.array(ops.convert_to_numpy(v)) for v in watched]
            _step(model, optimizer, *_data(step), overflow=step == 2)
            if step == 2 and guard is None:
                assert all(np.array_equal(a, np.array(ops.convert_to_numpy(v))) for a, v in zip(before, watched))
    records = [(r.iteration, r.skipped, r.reason, r.mode, r.scale) for r in optimizer.records()]
    finite = all(np.isfinite(ops.convert_to_numpy(v)).all() for v in model.trainable_variables)
    if guard is None:
        assert records == [(i, i == 2, "non_finite" if i == 2 else None, "guarding", None) for i in range(5)]
        named = [(g.name, g.layer, g.inf, g.neg_inf, g.nan, g.size) for g in optimizer.records()[2].gradients]
        kernel = model.trainable_variables[0]
        assert named == [(kernel.path, kernel.path.rpartition("/")[0], 1, 0, 0, 48)]
        assert int(ops.convert_to_numpy(optimizer.skipped_steps)) == 1 and finite
        assert int(ops.convert_to_numpy(optimizer.iterations)) == 4
    else:
        assert records == [(i, False, None, "off", None) for i in range(5)] and not finite


def _spike_run(policy: str, rule: polyamp.SpikeRule) -> dict[str, Any]:
    """20 custom-loop steps with planted outliers (inputs x25 at steps 9 and 15) and an inf gradient at 12."""
    model = _model()
    variables = list(model.trainable_variables)
    enabled = True if policy == "mixed_float16" else None
    optimizer = polyamp_keras.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), enabled=enabled, spike=rule, growth_interval=3
    )
    optimizer.build(variables)
    watched = [*variables, *optimizer.inner_optimizer.variables]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    stats, skipped, unchanged = [], [], []
    with polyamp.policy_scope(policy):
        for step in range(20):
            x, y = _data(step)
            if step in (9, 15):
                x = x * 25.0
            loss, grads = gradients(
                lambda x=x, y=y: loss_fn(y, model(x, training=True)), variables, optimizer, scaled=True
            )
            grads = list(grads)
            if step == 12:
                grads[0] = ops.scatter_update(grads[0], [[0, 0]], ops.convert_to_tensor([math.inf], grads[0].dtype))
            scale = optimizer.get_scale() if optimizer.enabled else 1.0
            if rule.on == "loss":
                stats.append(float(np.float64(ops.convert_to_numpy(loss))))
            else:
                norm = math.sqrt(
                    sum(float(np.sum(np.square(ops.convert_to_numpy(g).astype(np.float64)))) for g in grads)
                )
                stats.append(norm / scale)
            before = [np.array(ops.convert_to_numpy(v)) for v in watched]
            apply(optimizer, grads, variables)
            skipped.append(bool(ops.convert_to_numpy(optimizer.last_skipped)))
            unchanged.append(all(np.array_equal(a, np.array(ops.convert_to_numpy(v))) for a, v in zip(before, watched)))
    return {"stats": stats, "skipped": skipped, "unchanged": unchanged, "optimizer": optimizer}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_spike_rule_follows_the_reference_and_skips_bitwise(policy: str) -> None:
    """SpikeRule('loss') (TensorFlow, PyTorch) / ('grad_norm') (JAX): the planted outliers are skipped as the
    reference decides, bitwise; the inf step skips for its own reason and only it backs the scale off."""
    rule = polyamp.SpikeRule("grad_norm" if BACKEND == "jax" else "loss", window=6, threshold=4.0)
    run = _spike_run(policy, rule)
    overflow = [step == 12 for step in range(20)]
    spikes = rule.decide(run["stats"], overflow)
    assert [i for i, s in enumerate(spikes) if s] == [9, 15]
    assert run["skipped"] == [s or o for s, o in zip(spikes, overflow, strict=True)]
    assert all(u for u, s in zip(run["unchanged"], run["skipped"], strict=True) if s)
    optimizer = run["optimizer"]
    records = optimizer.records()
    nonfinite = "overflow" if policy == "mixed_float16" else "non_finite"
    assert [(r.iteration, r.reason) for r in records if r.skipped] == [
        (9, rule.reason),
        (12, nonfinite),
        (15, rule.reason),
    ]
    assert int(ops.convert_to_numpy(optimizer.skipped_steps)) == 3
    assert int(ops.convert_to_numpy(optimizer.iterations)) == 17
    if policy == "mixed_float16":  # spikes are finite steps for the scale rule
        states = LossScaleConfig(growth_interval=3).states(overflow)
        assert [r.next_scale for r in records] == [s.scale for s in states]


def test_spike_rule_on_the_gradient_norm_follows_the_reference() -> None:
    if BACKEND == "jax":
        pytest.skip("JAX runs SpikeRule('grad_norm') in test_spike_rule_follows_the_reference_and_skips_bitwise")
    rule = polyamp.SpikeRule("grad_norm", window=6, threshold=4.0)
    run = _spike_run("mixed_float16", rule)
    overflow = [step == 12 for step in range(20)]
    spikes = rule.decide(run["stats"], overflow)
    assert [i for i, s in enumerate(spikes) if s] == [9, 15]
    assert run["skipped"] == [s or o for s, o in zip(spikes, overflow, strict=True)]


def test_spike_rule_travels_in_the_config() -> None:
    rule = polyamp.SpikeRule("grad_norm", window=6, threshold=4.0, two_sided=True)
    config = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), spike=rule).get_config()
    assert config["spike"] == {
        "on": "grad_norm",
        "window": 6,
        "threshold": 4.0,
        "warmup": None,
        "two_sided": True,
        "max_consecutive": "auto",
    }
    restored = polyamp_keras.LossScaleOptimizer.from_config(config)
    assert restored.spike == rule
    assert polyamp_keras.LossScaleOptimizer.from_config(dict(config, spike=None)).spike is None
    with pytest.raises(PolyampTypeError, match=r"polyamp\.SpikeRule"):
        polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), spike={"on": "loss"})


def test_spike_rule_rebases_after_a_lasting_level_shift(caplog: pytest.LogCaptureFixture) -> None:
    """The gradient norm settles at a new level (x2 from step 40): steps 40..47 are skipped (window 16, 8
    consecutive spikes), step 48 re-bases the window with one warning, every later step is applied; the run of
    spikes travels in the state dict."""
    rule = polyamp.SpikeRule("grad_norm", window=16, threshold=6.0)
    model = _model()
    variables = list(model.trainable_variables)
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.01), enabled=False, guard=True, spike=rule)
    optimizer.build(variables)
    base = [np.full(tuple(v.shape), 0.01, "float32") for v in variables]
    norm = math.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in base))
    stats, skipped = [], []
    with caplog.at_level("WARNING", logger="polyamp"):
        for step in range(64):
            factor = np.float32((1.0 if step < 40 else 2.0) * (1.0025 if step % 2 else 0.9975))
            apply(optimizer, [ops.convert_to_tensor(g * factor) for g in base], variables)
            stats.append(norm * float(factor))
            skipped.append(bool(ops.convert_to_numpy(optimizer.last_skipped)))
            if step == 44:
                assert optimizer.state_dict()["spike_run"] == 5
        records = optimizer.records()
    assert skipped == rule.decide(stats) and sum(skipped) == 8 and skipped[40:48] == [True] * 8
    assert [r.iteration for r in records if r.rebased] == [48] == [i for i, r in enumerate(rule.rebased(stats)) if r]
    assert len([r for r in caplog.records if "re-based" in r.getMessage()]) == 1
    assert optimizer.state_dict()["spike_run"] == 0


def test_spike_window_travels_in_the_state_dict_and_decides_at_once() -> None:
    rule = polyamp.SpikeRule("grad_norm", window=4, threshold=6.0)
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), spike=rule)
    state = optimizer.state_dict()
    assert state["spike_window"] == []
    optimizer.load_state_dict({**state, "spike_window": [0.5, 1.0, 1.25, 0.75, 1.5]})  # kept until it builds
    assert optimizer.state_dict()["spike_window"] == [1.0, 1.25, 0.75, 1.5]
    model = _model()
    optimizer.build(model.trainable_variables)
    assert optimizer.state_dict()["spike_window"] == [1.0, 1.25, 0.75, 1.5]
    x, y = _data(0)
    _step(model, optimizer, x * 1000.0, y)  # a gradient norm far above 1.125 + 6 * 0.28
    assert bool(ops.convert_to_numpy(optimizer.last_skipped))
    assert [r.reason for r in optimizer.records()] == ["grad_spike"]
    optimizer.load_state_dict({**state, "spike_window": [2.0, 3.0]})
    assert optimizer.state_dict()["spike_window"] == [2.0, 3.0]


def test_spike_rule_on_the_loss_needs_scale_loss_and_is_refused_on_jax() -> None:
    rule = polyamp.SpikeRule("loss", window=4)
    if BACKEND == "jax":
        with pytest.raises(PolyampValueError, match="SpikeRule\\('grad_norm'"):
            polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), spike=rule)
        return
    model = _model()
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), spike=rule)
    _, grads = gradients(lambda: ops.sum(model(_data(0)[0])), model.trainable_variables, optimizer, scaled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning for gradients of an unscaled loss
        with pytest.raises(polyamp.ScalerUsageError, match="needs the iteration's loss"):
            apply(optimizer, list(grads), model.trainable_variables)


def test_jax_stateless_step_under_jit_skips_and_updates() -> None:
    if BACKEND != "jax":
        pytest.skip("the jitted stateless step is JAX's")
    import jax

    model = _model()
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), growth_interval=2)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    opt_values = [v.value for v in optimizer.variables]

    @jax.jit
    def train_step(trainable: Any, opt_values: Any, x: Any, y: Any, bad: Any) -> Any:
        def scaled_loss(trainable: Any) -> Any:
            logits, _ = model.stateless_call(trainable, non_trainable, x)
            with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, opt_values, strict=True))):
                return optimizer.scale_loss(loss_fn(y, logits) * bad)

        grads = jax.grad(scaled_loss)(trainable)
        return optimizer.stateless_apply(opt_values, grads, trainable)

    start = [np.array(t) for t in trainable]
    for step, bad in enumerate([1.0, math.inf, 1.0, 1.0]):
        new_trainable, opt_values = train_step(trainable, opt_values, *_data(step), bad)
        if bad == math.inf:
            assert all(np.array_equal(a, b) for a, b in zip(new_trainable, trainable, strict=True))
        trainable = new_trainable
    for variable, value in zip(optimizer.variables, opt_values, strict=True):
        variable.assign(value)
    assert _state(optimizer) == (65536.0, 0, 1)  # FOFF at interval 2: back off to 2**15, grow back to 2**16
    assert not all(np.array_equal(a, np.array(b)) for a, b in zip(start, trainable, strict=True))


def test_jax_stateless_step_counts_non_finite_gradients_in_the_checks_own_pass() -> None:
    """On JAX, the jitted stateless step reads each gradient once for the finite check and a skip's
    (+inf, -inf, NaN) counts together (XLA merges the two: one three-count reduction per gradient), and the
    counts take no conditional of their own (the one left is the inner step's apply-or-skip); the record of a
    skipped step still names the gradient."""
    if BACKEND != "jax":
        pytest.skip("the jitted stateless step is JAX's")
    import jax

    model = _model()
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    optimizer.build(model.trainable_variables)
    cpu = jax.devices("cpu")[0]  # the HLO of XLA's CPU backend, on any machine
    trainable = jax.device_put([v.value for v in model.trainable_variables], cpu)
    opt_values = jax.device_put([v.value for v in optimizer.variables], cpu)
    step = jax.jit(optimizer.stateless_apply)
    grads = [jax.numpy.ones_like(t) for t in trainable]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # gradients given directly: no scale_loss() call
        hlo = step.lower(opt_values, grads, trainable).compile().as_text()
        bad = [g.at[(0,) * g.ndim].set(-math.inf) if i == 2 else g for i, g in enumerate(grads)]
        _, opt_values = step(opt_values, bad, trainable)
    reductions = [line for line in hlo.splitlines() if " reduce(" in line]
    assert sum("(s32[], s32[], s32[]) reduce(" in line for line in reductions) == len(trainable)
    # The two kernels' only whole-gradient reductions are those counts (the check reads no gradient again).
    assert {line.split("reduce(")[0].split("= ")[1] for line in reductions if "dimensions={0,1}" in line} == {
        "(s32[], s32[], s32[]) "
    }
    assert hlo.count(" conditional(") == 1
    for variable, value in zip(optimizer.variables, opt_values, strict=True):
        variable.assign(value)
    (record,) = optimizer.records()
    kernel = model.trainable_variables[2]
    assert record.skipped and [(g.name, g.inf, g.neg_inf, g.nan, g.size) for g in record.gradients] == [
        (kernel.path, 0, 1, 0, 24)
    ]


def test_gradient_counts_are_exact_per_gradient_eagerly_and_compiled() -> None:
    """The skip branch's provenance counts: (+inf, -inf, NaN, size) per gradient, None as zeros, float16 and
    float64 values by their own classes (1e300 is finite in float64), exact eagerly and compiled."""
    from polyamp_keras._gradients import _counts_each, gradient_counts

    a = np.zeros((5, 7), dtype="float32")
    a[0, 1] = a[4, 6] = math.inf
    a[2, 2] = -math.inf
    a[1, 0] = a[3, 3] = a[3, 4] = math.nan
    b = np.array([1.0, -math.inf, 3.0], dtype="float16")
    wide = np.array([1e300, -1e300, math.nan, math.inf], dtype="float64")
    arrays = [a, None, b, np.zeros((0, 4), dtype="float32"), np.array(math.nan, dtype="float32")]
    expected = [[2, 1, 3, 35], [0, 0, 0, 0], [0, 1, 0, 3], [0, 0, 0, 0], [0, 0, 1, 1]]
    if BACKEND != "jax":  # JAX computes in 32 bits unless jax_enable_x64
        arrays.append(wide)
        expected.append([1, 0, 1, 4])
    grads = [None if x is None else ops.convert_to_tensor(x, dtype=str(x.dtype)) for x in arrays]
    results = {
        "eager": gradient_counts(grads),
        "each": _counts_each(grads, [None if g is None else int(np.prod(g.shape)) for g in grads]),
    }
    present = [g for g in grads if g is not None]

    def compiled(*tensors: Any) -> Any:
        it = iter(tensors)
        return gradient_counts([None if g is None else next(it) for g in grads])

    if BACKEND == "jax":
        import jax

        results["jit"] = jax.jit(compiled)(*present)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        results["xla"] = tf.function(compiled, jit_compile=True)(*present)
    for how, counts in results.items():
        assert keras.backend.standardize_dtype(counts.dtype) == "int32", how
        assert ops.convert_to_numpy(counts).tolist() == expected, how


@pytest.mark.parametrize("scale", [65536.0, 3.0, 2.0**-10])
def test_unscale_and_check_equals_the_keras_operations_bit_for_bit(scale: float) -> None:
    """The unscale and finite check in one (torch's foreach kernels on Keras's PyTorch backend): the values of
    `unscale` bit for bit (``-0.0``, inf, NaN, results of an inexact division) and `all_finite`'s answer."""
    from polyamp_keras._gradients import _torch_unscale_and_check, all_finite, unscale, unscale_and_check

    rng = np.random.default_rng(3)
    a = rng.normal(size=(5, 7)).astype("float32") * 1e4
    a[0, 0] = -0.0
    b = rng.normal(size=(3,)).astype("float32")
    c = np.array([1.0, math.inf, -math.inf, math.nan], dtype="float32")
    scale_variable = keras.Variable(scale, dtype="float32")
    for arrays, all_finite_expected in (([a, None, b], True), ([a, b, c], False), ([None, c], False)):
        grads = [None if x is None else ops.convert_to_tensor(x) for x in arrays]
        unscaled, finite = unscale_and_check(grads, scale_variable)
        expected = unscale(grads, scale_variable)
        assert [g is None for g in unscaled] == [g is None for g in expected]
        for ours, theirs in zip(unscaled, expected, strict=True):
            if ours is not None:
                ours_bits = ops.convert_to_numpy(ours).view("int32")
                assert (ours_bits == ops.convert_to_numpy(theirs).view("int32")).all()
        assert bool(ops.convert_to_numpy(finite)) is bool(ops.convert_to_numpy(all_finite(expected)))
        assert bool(ops.convert_to_numpy(finite)) is all_finite_expected
        if BACKEND == "torch":  # the fused path is the one taken there
            assert _torch_unscale_and_check(grads, scale_variable) is not None


#: (settings, overflow rate): the default rule at its floor of 1.0, and odd factors with hysteresis that spend
#: most of the run far below 1, often at min_scale.
SOAK_CONFIGS = [
    ({"growth_interval": 25}, 0.1),
    ({"growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 3, "hysteresis": 2, "init_scale": 5.0,
      "min_scale": 2.0**-100, "max_scale": 2.0**20}, 0.3),
]  # fmt: skip


@pytest.mark.parametrize("index", range(len(SOAK_CONFIGS)))
def test_a_10000_step_soak_follows_the_reference(index: int) -> None:
    """10,000 apply calls with random overflows (a compiled loop on TensorFlow and JAX, eager on PyTorch): the
    scale after every step is the reference's, bit for bit, also far below 1 and at the floor."""
    config, rate = SOAK_CONFIGS[index]
    pattern = np.random.default_rng(index).random(10_000) < rate
    w = keras.Variable(np.zeros(2, "float32"))
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.0), **config)
    optimizer.build([w])
    bad, finite = np.array([math.inf, 0.0], "float32"), np.zeros(2, "float32")
    grads = np.where(pattern[:, None], bad, finite)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # gradients given directly: no scale_loss() call
        if BACKEND == "tensorflow":
            import tensorflow as tf

            @tf.function
            def loop(grads: Any) -> Any:
                scales = tf.TensorArray(tf.float32, size=grads.shape[0])
                for i in tf.range(grads.shape[0]):
                    optimizer.apply([grads[i]], [w])
                    scales = scales.write(i, optimizer.dynamic_scale.value)
                return scales.stack()

            scales = loop(tf.constant(grads)).numpy()
        elif BACKEND == "jax":
            import jax

            index_of_scale = [v.path for v in optimizer.variables].index(optimizer.dynamic_scale.path)

            def body(carry: Any, grad: Any) -> Any:
                opt_values, value = carry
                new_values, new_opt_values = optimizer.stateless_apply(opt_values, [grad], [value])
                return (new_opt_values, new_values[0]), new_opt_values[index_of_scale]

            start = ([v.value for v in optimizer.variables], w.value)
            _, scales = jax.jit(lambda start, grads: jax.lax.scan(body, start, grads))(start, grads)
            scales = np.asarray(scales)
        else:
            import torch

            device_scales = []
            with torch.no_grad():
                for grad in ops.convert_to_tensor(grads):
                    optimizer.apply([grad], [w])
                    device_scales.append(optimizer.dynamic_scale.value.clone())  # no host read per step
            scales = torch.stack(device_scales).cpu().numpy()
    expected = [s.scale for s in LossScaleConfig(**config).states(pattern.tolist())]
    assert scales.tolist() == expected


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_fit_trains_with_the_optimizer(policy: str) -> None:
    with polyamp.policy_scope(policy):
        model = polyamp_keras.cast_outputs(_model())
        optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01))
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        assert model.optimizer is optimizer  # Keras does not wrap it again
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 6)).astype("float32")
        y = (x[:, 0] > 0).astype("int64")
        history = model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[polyamp_keras.LossScaleCallback()])
    losses = history.history["loss"]
    assert losses[-1] < losses[0] and all(math.isfinite(v) for v in losses)
    # Under bfloat16 it follows the policy, as every polyamp scaler does: no scaling, the guard on; the callback
    # logs the skips alone there (a scale of 1.0 would say nothing).
    if policy == "mixed_float16":
        assert history.history["loss_scale"][-1] == 65536.0
    else:
        assert "loss_scale" not in history.history
    assert history.history["skipped_steps"][-1] == 0


def test_the_state_variables_answer_before_the_optimizer_is_built() -> None:
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), growth_interval=5, hysteresis=2)
    optimizer.load_state_dict({**optimizer.state_dict(), "scale": 1024.0, "_growth_tracker": 3})
    names = ("dynamic_scale", "step_counter", "hysteresis_left", "skipped_steps")

    def read() -> list[Any]:
        return [ops.convert_to_numpy(getattr(optimizer, name)).item() for name in names]

    assert not optimizer.built and read() == [1024.0, 3, 2, 0] == [optimizer.get_scale(), 3, 2, 0]
    model = _model()
    seen: list[list[Any]] = []

    class Watch(keras.callbacks.Callback):  # a user's callback reads them before the first step
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if batch == 0:  # (Keras on JAX holds no variable's value during later batches, `iterations` neither)
                seen.append([float(optimizer.dynamic_scale), int(optimizer.skipped_steps), int(optimizer.iterations)])

    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(0)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[Watch()])
    assert seen == [[1024.0, 0, 0]]
    # Built: Keras's variables, holding what the attributes answered before.
    assert all(isinstance(getattr(optimizer, name), keras.Variable) for name in names)
    assert read() == [2048.0, 0, 2, 0]  # two finite steps: the tracker reached 5 and the scale grew
    assert optimizer.dynamic_scale in optimizer.variables and optimizer.skipped_steps in optimizer.variables


def test_non_finite_variables_behind_a_run_of_skips_are_named(caplog: Any) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="polyamp")
    model = _model()
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    optimizer.build(model.trainable_variables)
    with polyamp.policy_scope("mixed_bfloat16"):  # the guard: no scaling, non-finite steps skipped
        _step(model, optimizer, *_data(0))
        kernel = model.layers[-1].kernel
        kernel.assign(ops.scatter_update(kernel.value, [[2, 1]], ops.convert_to_tensor([math.nan])))
        for step in range(1, 4):
            _step(model, optimizer, *_data(step))
    assert [r.reason for r in optimizer.records()] == [None, "non_finite", "non_finite", "non_finite"]
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "polyamp" and "parameters themselves hold inf or NaN" in r.getMessage()
    ]
    assert len(warnings) == 1 and "since iteration 1" in warnings[0]
    assert f"{kernel.path} (1 NaN of 24)" in warnings[0] and "dense/kernel " not in warnings[0]


def test_save_and_load_keep_scale_counters_and_settings(tmp_path: Path) -> None:
    model = _model()
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), growth_interval=5, hysteresis=2)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    optimizer.build(model.trainable_variables)
    for step, char in enumerate("FOOF"):
        _step(model, optimizer, *_data(step), overflow=char == "O")
    saved = optimizer.state_dict()
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is polyamp_keras.LossScaleOptimizer
    assert loaded.optimizer.state_dict() == saved


def test_state_dicts_travel_between_keras_torch_and_tensorflow_scalers() -> None:
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(), growth_interval=3, min_scale=2.0)
    optimizer.load_state_dict({**optimizer.state_dict(), "scale": 1024.0, "_growth_tracker": 2})
    as_json = json.loads(json.dumps(optimizer.state_dict()))
    scaler = polyamp.LossScaler(enabled=True)
    scaler.load_state_dict(as_json)
    assert scaler.get_state().scale == 1024.0 and scaler.config == optimizer.loss_scale_config


# -- Keras-compatibility: what Keras's own LossScaleOptimizer accepts --------------------------------------------


def test_config_carries_keras_keys_and_polyamps() -> None:
    config = polyamp_keras.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=256.0, dynamic_growth_steps=7
    ).get_config()
    assert (config["initial_scale"], config["dynamic_growth_steps"]) == (256.0, 7)
    assert (config["init_scale"], config["growth_interval"], config["hysteresis"]) == (256.0, 7, 1)
    keras_config = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0).get_config()
    restored = polyamp_keras.LossScaleOptimizer.from_config(keras_config)  # Keras's own config loads
    assert restored.loss_scale_config.init_scale == 8.0


def test_float_dynamic_growth_steps_and_old_base_optimizer_keys() -> None:
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(), dynamic_growth_steps=2.0)
    assert optimizer.loss_scale_config.growth_interval == 2
    old = {**optimizer.get_config(), "weight_decay": None, "use_ema": False, "ema_momentum": 0.99}
    assert polyamp_keras.LossScaleOptimizer.from_config(old).loss_scale_config.growth_interval == 2


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"foo": True, "bar": 3}, "does not support arguments: `foo`, `bar`"),
        ({"clipnorm": 1.0}, "does not support `clipnorm`. Instead, set `clipnorm` on the `inner_optimizer`"),
    ],
)
def test_arguments_keras_refuses_are_value_errors(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PolyampValueError, match=fragment.replace("`", ".").replace("(", r"\(")) as info:
        polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)
    assert isinstance(info.value, ValueError)


def test_policy_overrides_map_keeps_keras_regex_keys_and_refuses_ambiguous_paths() -> None:
    bfloat16, float16 = keras.DTypePolicy("bfloat16"), keras.DTypePolicy("float16")
    policy_map = polyamp_keras.PolicyOverridesMap(default_policy="float32", overrides={"model/head": "mixed_bfloat16"})
    policy_map["model/decoder/.*"] = float16
    assert policy_map["model/decoder/layer_0"] is float16
    assert policy_map["model/head/dense"].name == "mixed_bfloat16"  # polyamp's override, by ancestor
    assert policy_map["model/other"].name == "float32"
    policy_map["model/decoder/attention/.*"] = bfloat16
    with pytest.raises(ValueError, match="matches multiple dtype policy specification keys"):
        policy_map["model/decoder/attention/output"]


# -- misuse that trains nothing, and another framework's loss ------------------------------------------------------


def test_an_apply_without_scale_loss_warns() -> None:
    model = _model()
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(model.trainable_variables)
    with pytest.warns(UserWarning, match=r"before scale_loss\(\) in this iteration") as warned:
        _step(model, optimizer, *_data(0), scaled=False)
    from polyamp.backend_api.arguments import NOT_SCALED_RULE

    assert any(NOT_SCALED_RULE in str(w.message) for w in warned)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, optimizer, *_data(1))
    assert not [w for w in caught if "scale_loss" in str(w.message)]


def test_another_frameworks_loss_is_refused() -> None:
    other = "torch" if BACKEND != "torch" else "tensorflow"
    if not _installed(other):
        pytest.skip(f"{other} is not installed")
    if other == "torch":
        import torch

        loss: Any = torch.tensor(1.0)
    else:
        import tensorflow as tf

        loss = tf.constant(1.0)
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(BackendMismatchError, match=f"Keras runs on {BACKEND}, but scale_loss"):
        optimizer.get_scaled_loss(loss)


def test_a_loss_scaler_handed_keras_objects_off_tensorflow_says_what_to_use() -> None:
    if BACKEND == "tensorflow":
        assert polyamp.backend_api.backend_name_for(keras.Variable(1.0)) == "tensorflow"
        return
    assert polyamp.backend_api.backend_name_for(keras.Variable(1.0)) == "keras"
    with pytest.raises(PolyampTypeError, match=r"polyamp_keras\.LossScaleOptimizer"):
        polyamp.LossScaler(enabled=True).apply_gradients(keras.optimizers.SGD(), [])


# -- the other backends, in subprocesses -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_on_every_keras_backend(backend: str, run_on_keras_backend: RunOnKerasBackend) -> None:
    run_on_keras_backend(backend, HERE)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_conformance_suite_on_every_keras_backend(backend: str, run_on_keras_backend: RunOnKerasBackend) -> None:
    result = run_on_keras_backend(backend, "polyamp.conformance", "--backend", "keras", "--backend", "torch")
    pair = f"keras-{backend}-cpu+torch-cpu"
    assert any(line.split()[1:3] == [pair, "passed"] for line in result.stdout.splitlines() if len(line.split()) > 2), (
        "the cross-backend case (a torch state dict resuming on Keras-on-" + backend + ") did not pass"
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert " failed" not in summary and "xpassed" not in summary, summary
