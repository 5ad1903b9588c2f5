"""Hardening: storms, soaks, hostile input and threads. Each test pins a defect found by attacking polyamp.

The promise: a run never writes a non-finite value into the weights; every backend follows the reference
step by step for every accepted setting, also at extreme scales; a bad input is a PolyampError of the right
built-in that names the value, and changes nothing; one scaler shared by threads fails with a clear error.
"""

from __future__ import annotations

import copy
import decimal
import gc
import json
import math
import pickle
import random
import threading
import weakref
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyamp
from polyamp import (
    InvalidConfigError,
    LossScaleConfig,
    LossScaler,
    PolyampError,
    PolyampTypeError,
    PolyampValueError,
    ScalerUsageError,
    StateDictError,
)
from polyamp.backend_api import BackendSpec
from polyamp.backend_api.policies import PolicyOverrides

torch = pytest.importorskip("torch")

import polyamp_torch  # noqa: E402

# -- D1: a long run of overflows never leads to NaN weights -------------------------------------------------


def _linear_step(model: Any, opt: Any, scaler: Any, *, nan: bool) -> None:
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    if nan:
        model.weight.grad[0, 0] = math.nan
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adam"])
def test_150_overflows_then_a_finite_step_keeps_the_weights_finite(fused: bool) -> None:
    def run(scaler: Any) -> Any:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters(), fused=True) if fused else torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(150):
            _linear_step(model, opt, scaler, nan=True)
        _linear_step(model, opt, scaler, nan=False)
        return model

    if not fused:  # the defect, in torch itself: 1/scale overflows to inf and SGD applies it
        assert not torch.isfinite(run(torch.amp.GradScaler("cpu")).weight).all()
    scaler = polyamp_torch.TorchLossScaler("cpu")
    model = run(scaler)
    assert torch.isfinite(model.weight).all() and torch.isfinite(model.bias).all()
    assert scaler.get_scale() == 1.0 and not bool(scaler.step_skipped())


def test_a_periodic_inf_for_10000_steps_never_corrupts_the_weights() -> None:
    """An inf every 50 steps (which no scale cures): the scale settles at the floor, training goes on."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = polyamp_torch.TorchLossScaler("cpu")
    for step in range(10_000):
        _linear_step(model, opt, scaler, nan=step % 50 == 49)
    assert torch.isfinite(model.weight).all()
    assert scaler.get_scale() == 1.0 and int(scaler.skipped_steps()) == 200
    # The reference agrees: 16 halvings from 2**16 reach the floor, which holds.
    assert LossScaleConfig().trajectory([i % 50 == 49 for i in range(10_000)])[-1] == 1.0


def test_below_one_with_min_scale_the_unscaled_gradients_are_checked() -> None:
    """With min_scale < 1, 1/scale > 1 can overflow a finite scaled gradient: that step is skipped."""
    param = torch.nn.Parameter(torch.zeros(2))
    for fused in (False, True):
        opt = torch.optim.Adam([param], fused=True) if fused else torch.optim.SGD([param], lr=1.0)
        scaler = polyamp_torch.TorchLossScaler("cpu", init_scale=2.0**-100, min_scale=2.0**-120)
        scaler.scale(param.sum()).backward()
        param.grad.fill_(2.0**40)  # finite; unscaled: 2**140, beyond float32
        scaler.step(opt)
        scaler.update()
        assert bool(scaler.step_skipped(opt)) and torch.equal(param.detach(), torch.zeros(2))
        param.grad = None


def test_the_floor_is_1_without_min_scale_and_settings_below_float32s_normals_are_refused() -> None:
    assert LossScaleConfig().floor_f32 == 1.0 and not LossScaleConfig().checks_unscaled
    assert LossScaleConfig(init_scale=0.25).floor_f32 == 0.25
    assert LossScaleConfig(min_scale=2.0**-126).checks_unscaled
    assert LossScaleConfig(backoff_factor=1e-300).trajectory("OO") == [1.0, 1.0]
    for bad in ({"min_scale": 1e-40, "init_scale": 1e-40}, {"init_scale": 1e-45}, {"min_scale": 0.0}):
        with pytest.raises(InvalidConfigError, match="2\\*\\*-126"):
            LossScaleConfig(**bad)


def test_a_native_checkpoint_below_the_floor_resumes_at_the_floor_with_a_warning() -> None:
    native = torch.amp.GradScaler("cpu", init_scale=2.0**-130 * 8)
    scaler = polyamp_torch.TorchLossScaler("cpu")
    state = dict(native.state_dict(), scale=0.0)
    with pytest.warns(UserWarning, match="below the lowest scale polyamp uses"):
        scaler.load_state_dict(state)
    assert scaler.get_scale() == 1.0


# -- D2: every backend follows the reference at extreme scales ------------------------------------------------

EXTREME = [
    {"init_scale": 2.0**-100, "min_scale": 2.0**-126, "growth_interval": 5},
    {"init_scale": 3.0e-37, "min_scale": 1.2e-38, "backoff_factor": 0.3, "growth_factor": 1.7, "growth_interval": 3},
    {"init_scale": 2.0**120, "growth_factor": 2.0**5, "growth_interval": 1, "backoff_factor": 1e-30},
]


def _torch_states(config: dict[str, Any], pattern: list[bool]) -> list[tuple[float, int, int]]:
    scaler = polyamp_torch.TorchLossScaler("cpu", **config)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.0)
    states = []
    for overflow in pattern:
        scaler.scale(param.sum() * 0.0).backward()
        if overflow:
            param.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        state = scaler.get_state()
        states.append((state.scale, state.growth_tracker, state.hysteresis_left))
    return states


# -- D6, D7: TensorFlow's traced settings and unscale stages ------------------------------------------------


def test_tensorflow_refuses_new_settings_once_traced_and_takes_new_state() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    scaler = polyamp.LossScaler(growth_interval=10, enabled=True)
    w = tf.Variable([1.0])
    opt = keras.optimizers.SGD(0.0)
    opt.build([w])

    @tf.function
    def step(bad: Any) -> None:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w) * bad)
        scaler.apply_gradients(opt, zip(tape.gradient(scaled, [w]), [w]))

    step(tf.constant(1.0))
    with pytest.raises(ScalerUsageError, match="already traced a step"):
        scaler.load_state_dict(dict(scaler.state_dict(), hysteresis=3, hysteresis_left=3))
    assert scaler.config.hysteresis == 1
    state = dict(scaler.state_dict(), scale=1024.0, _growth_tracker=9)
    scaler.load_state_dict(state)  # same settings: the scale and counters load at any time
    step(tf.constant(1.0))
    assert scaler.get_scale() == 2048.0
    with pytest.raises(ScalerUsageError, match="already traced"):
        scaler.set_growth_factor(4.0)


def test_an_unscale_left_without_its_apply_does_not_leak_into_the_next_iteration() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    scaler = polyamp.LossScaler(enabled=True)
    w = tf.Variable([0.0])
    opt = keras.optimizers.SGD(1.0)

    def grads() -> list[Any]:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w * 3.0))
        return tape.gradient(scaled, [w])

    scaler.unscale(grads())  # inspected, never applied
    scaler.apply_gradients(opt, zip(grads(), [w]))  # fresh scaled gradients: unscaled once, here
    assert w.numpy()[0] == -3.0  # not -3 * 65536
    first = grads()
    scaler.unscale(first)
    with pytest.raises(ScalerUsageError, match="scaled gradients that were passed to unscale"):
        scaler.apply_gradients(opt, zip(first, [w]))


def test_keras_optimizer_refuses_new_settings_after_fit_traced_them() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import polyamp_keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.0), enabled=True)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, batch_size=4, verbose=0)
    with pytest.raises(ScalerUsageError, match="has already traced them"):
        optimizer.load_state_dict(dict(optimizer.state_dict(), hysteresis=3, hysteresis_left=3))
    assert optimizer.state_dict()["hysteresis"] == 1
    optimizer.load_state_dict(dict(optimizer.state_dict(), scale=1024.0))  # same settings: the scale loads
    model.fit(x, np.full((4, 1), np.inf, "float32"), batch_size=4, verbose=0)
    assert optimizer.get_scale() == 512.0 and tf.executing_eagerly()


def test_keras_optimizer_unscaled_gradients_left_unapplied_do_not_leak_into_the_next_iteration() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import polyamp_keras

    w = tf.Variable([0.0])
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(1.0), enabled=True)

    def grads() -> list[Any]:
        with tf.GradientTape() as tape:
            scaled = optimizer.scale_loss(tf.reduce_sum(w * 3.0))
        return tape.gradient(scaled, [w])

    optimizer.get_unscaled_gradients(grads())  # inspected, never applied
    optimizer.apply_gradients(zip(grads(), [w]))  # fresh scaled gradients: unscaled once, here
    assert w.numpy()[0] == -3.0  # not -3 * 65536
    refs = []
    for _ in range(50):
        scaled = grads()
        refs.append(weakref.ref(scaled[0]))
        optimizer.get_unscaled_gradients(scaled)
        del scaled
    gc.collect()
    assert sum(ref() is not None for ref in refs) <= 1  # only the last stage holds its gradients


def test_unscale_stages_do_not_pile_up() -> None:
    tf = pytest.importorskip("tensorflow")
    scaler = polyamp.LossScaler(enabled=True, backend="tensorflow")
    refs = []
    for _ in range(200):
        scaler.scale(tf.constant(1.0))
        grads = [tf.ones((64, 64))]
        refs.append(weakref.ref(grads[0]))
        scaler.unscale(grads)
        del grads
    gc.collect()
    assert sum(ref() is not None for ref in refs) <= 1  # only the last stage holds its gradients


# -- D8, D9, D10: hostile input is a PolyampError and changes nothing ------------------------------------------


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: LossScaler(init_scale=10**400), InvalidConfigError),
        (lambda: LossScaler(growth_factor=10**400), InvalidConfigError),
        (lambda: LossScaleConfig(max_scale=-(10**400)), InvalidConfigError),
        (lambda: LossScaleConfig().trajectory(5), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: LossScaleConfig().trajectory((2.0,)), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: PolicyOverrides().resolve(3), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: PolicyOverrides({"head": None}), PolyampValueError),  # type: ignore[dict-item]
        (lambda: PolicyOverrides(["ab"]), PolyampTypeError),  # type: ignore[list-item]
        (lambda: BackendSpec(name="a", target="a:b", frameworks="mylib", install_hint="x"), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: BackendSpec(name="a", target="a:b", frameworks=5, install_hint="x"), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: LossScaler(growth_intervall=3), PolyampTypeError),  # type: ignore[call-arg]
    ],
)
def test_hostile_arguments_are_polyamp_errors(call: Any, error: type) -> None:
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, PolyampError)


@pytest.mark.parametrize(
    "change",
    [
        {"scale": 10**400},
        {"growth_interval": 10**400},
        {"polyamp_format": np.array([1, 1])},
        {"polyamp_format": np.True_},
        {"polyamp_format": 1 + 0j},
        {"polyamp_format": decimal.Decimal(1)},
        {"enabled": 1},
        {"min_scale": 1e-40},
    ],
    ids=repr,
)
def test_hostile_state_dicts_are_refused_and_change_nothing(change: dict[str, Any]) -> None:
    scaler = LossScaler(growth_interval=7, enabled=True)
    before = scaler.state_dict()
    with pytest.raises(StateDictError) as info:
        scaler.load_state_dict({**before, **change})
    assert scaler.state_dict() == before
    if "polyamp_format" in change:  # a malformed value, not a newer format: no advice to upgrade
        assert "must be an int" in str(info.value) and "Upgrade" not in str(info.value)


@pytest.mark.parametrize(
    "new_scale",
    [torch.tensor(math.nan), torch.tensor(math.inf), torch.tensor(0.0), torch.tensor(-5.0), torch.tensor(2.0**30)],
    ids=["nan", "inf", "zero", "negative", "above_max"],
)
def test_update_with_a_bad_tensor_scale_is_refused(new_scale: Any) -> None:
    scaler = polyamp_torch.TorchLossScaler("cpu", max_scale=2.0**20)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    with pytest.raises(InvalidConfigError):
        scaler.update(new_scale)
    scaler.update(torch.tensor(512.0))
    assert scaler.get_scale() == 512.0
    scaler.load_state_dict(scaler.state_dict())  # its own state dict still loads


@pytest.mark.parametrize("new_scale", [math.nan, -5.0, 0.0, 2.0**30])
def test_update_with_a_bad_symbolic_scale_in_a_tf_function_is_refused(new_scale: float) -> None:
    """Inside a tf.function the value is known only when the graph runs: the graph checks it then."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    scaler = polyamp.LossScaler(enabled=True, max_scale=2.0**20, backend="tensorflow")
    w = tf.Variable([1.0])
    opt = keras.optimizers.SGD(0.0)
    opt.build([w])

    @tf.function
    def step(value: Any) -> None:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w))
        scaler.step(opt, zip(tape.gradient(scaled, [w]), [w]))
        scaler.update(new_scale=value)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"update\(new_scale\) needs a finite scale"):
        step(tf.constant(new_scale))
    assert scaler.get_scale() == 65536.0
    step(tf.constant(512.0))
    assert scaler.get_scale() == 512.0
    scaler.load_state_dict(scaler.state_dict())  # its own state dict still loads


def test_fused_step_without_gradients_and_step_skipped_of_a_non_optimizer() -> None:
    scaler = polyamp_torch.TorchLossScaler("cpu")
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([param], fused=True)
    scaler.scale(param.sum())
    with pytest.raises(ScalerUsageError, match="none of the optimizer's parameters has a gradient"):
        scaler.step(opt)
    with pytest.raises(PolyampTypeError, match=r"step_skipped\(\) takes a torch.optim.Optimizer"):
        scaler.step_skipped(0.0)


# -- D11: a failed call leaves no trace; a public way back -------------------------------------------------------


def test_step_without_gradients_leaves_no_trace() -> None:
    scaler = polyamp_torch.TorchLossScaler("cpu")
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.5)
    scaler.scale(param.sum())  # forgot backward
    with pytest.raises(ScalerUsageError):
        scaler.step(opt)
    pickle.dumps(scaler)  # between iterations still
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(param.detach(), torch.full((2,), 0.5))


def test_a_refused_unscale_leaves_no_trace() -> None:
    scaler = polyamp_torch.TorchLossScaler("cpu")
    model = torch.nn.Linear(2, 1).half()  # float16 parameters: unscaling their gradients is refused
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler.scale(model(torch.ones(1, 2, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ScalerUsageError, match="float16 gradients"):
        scaler.unscale_(opt)
    pickle.dumps(scaler)  # between iterations still: the refused call left no record behind
    scaler.load_state_dict(scaler.state_dict())
    model.float()  # the fix the message suggests; the parameters (and the optimizer) stay the same objects
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)  # not "already called": the refused call recorded nothing
    scaler.step(opt)
    scaler.update()
    assert not bool(scaler.step_skipped(opt))


def test_discard_iteration_and_update_with_a_new_scale_recover_at_any_point() -> None:
    scaler = polyamp_torch.TorchLossScaler("cpu")
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.5)
    scaler.scale(param.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(ScalerUsageError):
        scaler.load_state_dict(scaler.state_dict())
    scaler.discard_iteration()  # e.g. after an exception inside the training step
    scaler.load_state_dict(scaler.state_dict())
    copy.deepcopy(scaler)
    scaler.update(new_scale=1024.0)  # between iterations, as torch.amp.GradScaler allows
    assert scaler.get_scale() == 1024.0


# -- threads ------------------------------------------------------------------------------------------------------


def test_one_scaler_shared_by_two_threads_says_so() -> None:
    scaler = polyamp_torch.TorchLossScaler("cpu")
    param = torch.nn.Parameter(torch.ones(2))
    scaler.scale(param.sum()).backward()  # this thread's iteration is open
    errors: list[BaseException] = []

    def other() -> None:
        try:
            scaler.scale(param.sum())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], ScalerUsageError)
    assert "started by another thread" in str(errors[0]) and "own LossScaler" in str(errors[0])


# -- soaks: long random runs, device against reference ------------------------------------------------------------

SOAK_CONFIGS = [
    {},
    {"growth_interval": 7, "hysteresis": 3, "min_scale": 4.0, "max_scale": 2.0**20},
    {"growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 3, "min_scale": 2.0**-100, "init_scale": 5.0},
]


@pytest.mark.parametrize("index", range(len(SOAK_CONFIGS)))
def test_a_10000_step_soak_on_torch_matches_the_reference(index: int) -> None:
    config = {**SOAK_CONFIGS[index], "growth_interval": SOAK_CONFIGS[index].get("growth_interval", 25)}
    rng = random.Random(index)
    pattern = [rng.random() < 0.05 for _ in range(10_000)]
    scaler = polyamp_torch.TorchLossScaler("cpu", **config)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.0)
    reference = LossScaleConfig(**config).states(pattern)
    scales = torch.empty(len(pattern))
    for step, overflow in enumerate(pattern):
        scaler.scale(param.sum() * 0.0).backward()
        if overflow:
            param.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales[step] = scaler.device_form._state.scale  # type: ignore[union-attr]  # device copy, no host read
    assert scales.tolist() == [s.scale for s in reference]


def test_cross_backend_resume_at_odd_factors_follows_the_reference() -> None:
    pytest.importorskip("tensorflow")
    config = {"growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 3, "min_scale": 2.0**-60}
    rng = random.Random(7)
    pattern = [rng.random() < 0.4 for _ in range(120)]
    half = 60
    torch_first = _torch_states(config, pattern[:half])
    saved = json.loads(json.dumps(polyamp_torch.TorchLossScaler("cpu", **config).state_dict()))
    reference = LossScaleConfig(**config).states(pattern)
    assert torch_first == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in reference[:half]]
    saved.update(scale=reference[half - 1].scale, _growth_tracker=reference[half - 1].growth_tracker)
    import tensorflow as tf

    import polyamp_tensorflow

    scaler = polyamp_tensorflow.TensorFlowLossScaler(enabled=True)
    scaler.load_state_dict(saved)
    w = tf.Variable([0.0])
    import keras

    opt = keras.optimizers.SGD(0.0)
    got = []
    for overflow in pattern[half:]:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w) * (math.inf if overflow else 0.0))
        scaler.apply_gradients(opt, zip(tape.gradient(scaled, [w]), [w]))
        state = scaler.get_state()
        got.append((state.scale, state.growth_tracker, state.hysteresis_left))
    assert got == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in reference[half:]]


# -- fuzzing settings and state dicts ------------------------------------------------------------------------------

hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.just(np.float32(2.0)),
    st.just(decimal.Decimal("0.5")),
    st.just([1.0]),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*LossScaleConfig.setting_names(), "enabled", "nonsense"]), hostile_values))
def test_fuzzed_settings_give_a_scaler_or_a_polyamp_error(kwargs: dict[str, Any]) -> None:
    try:
        scaler = LossScaler(**kwargs)
    except PolyampError as exc:
        assert isinstance(exc, (ValueError, TypeError))
        return
    config = scaler.config
    assert math.isfinite(config.floor_f32) and config.floor_f32 >= 2.0**-126
    config.trajectory("FOFO")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*LossScaler(enabled=True).state_dict(), "extra"]), hostile_values))
def test_fuzzed_state_dicts_load_or_change_nothing(change: dict[str, Any]) -> None:
    scaler = LossScaler(growth_interval=9, hysteresis=2, enabled=True)
    before = scaler.state_dict()
    try:
        scaler.load_state_dict({**before, **change})
    except PolyampError as exc:
        assert isinstance(exc, (ValueError, TypeError, RuntimeError))
        assert scaler.state_dict() == before
        return
    state = scaler.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state["scale"] >= scaler.config.floor_f32


# -- the same on TensorFlow / Keras ------------------------------------------------------------------------------


def _tensorflow_states(config: dict[str, Any], pattern: list[bool]) -> list[tuple[float, int, int]]:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import polyamp_tensorflow

    scaler = polyamp_tensorflow.TensorFlowLossScaler(enabled=True, **config)
    w = tf.Variable([0.0, 0.0])
    opt = keras.optimizers.SGD(0.0)
    opt.build([w])

    @tf.function
    def step(bad: Any) -> Any:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w * bad))
        scaler.apply_gradients(opt, zip(tape.gradient(scaled, [w]), [w]))
        return scaler.device_form._state().scale  # type: ignore[union-attr]

    states = []
    for overflow in pattern:
        step(tf.constant(math.inf if overflow else 0.0))
        state = scaler.get_state()
        states.append((state.scale, state.growth_tracker, state.hysteresis_left))
    return states


@pytest.mark.parametrize("index", range(len(EXTREME)))
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_storms_at_extreme_scales_follow_the_reference(backend: str, index: int) -> None:
    """TensorFlow's CPU kernels flush subnormals to zero: scales stay normal, so no backend diverges."""
    config = EXTREME[index]
    pattern = [True] * 200 + [False] * 20 + [random.Random(index).random() < 0.3 for _ in range(80)]
    expected = [(s.scale, s.growth_tracker, s.hysteresis_left) for s in LossScaleConfig(**config).states(pattern)]
    states = _torch_states(config, pattern) if backend == "torch" else _tensorflow_states(config, pattern)
    assert states == expected


@pytest.mark.parametrize("index", [1, 2])
def test_a_10000_step_soak_on_tensorflow_matches_the_reference(index: int) -> None:
    config = {**SOAK_CONFIGS[index]}
    rng = random.Random(100 + index)
    pattern = [rng.random() < 0.1 for _ in range(10_000)]
    expected = [(s.scale, s.growth_tracker, s.hysteresis_left) for s in LossScaleConfig(**config).states(pattern)]
    assert _tensorflow_states(config, pattern) == expected


@pytest.mark.parametrize("which", ["tensorflow_scaler", "keras_optimizer"])
def test_200_nan_steps_then_20_finite_ones_train_on_finite_weights(which: str) -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import polyamp_tensorflow

    w = tf.Variable([1.0, 2.0])
    if which == "keras_optimizer":
        optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(0.01), enabled=True)

        def step(bad: float) -> None:
            with tf.GradientTape() as tape:
                scaled = optimizer.scale_loss(tf.reduce_sum(w * w) * bad)
            optimizer.apply_gradients(zip(tape.gradient(scaled, [w]), [w]))

        def skipped() -> bool:
            return bool(optimizer.last_skipped.numpy())

        scale = optimizer.get_scale
    else:
        scaler = polyamp_tensorflow.TensorFlowLossScaler(enabled=True)
        inner = keras.optimizers.SGD(0.01)

        def step(bad: float) -> None:
            with tf.GradientTape() as tape:
                scaled = scaler.scale(tf.reduce_sum(w * w) * bad)
            scaler.apply_gradients(inner, zip(tape.gradient(scaled, [w]), [w]))

        def skipped() -> bool:
            return bool(scaler.step_skipped())

        scale = scaler.get_scale
    for _ in range(200):
        step(math.nan)
    assert scale() == 1.0 and np.array_equal(w.numpy(), [1.0, 2.0])
    for _ in range(20):
        step(1.0)
        assert not skipped()  # training goes on: never stuck skipping
    assert np.isfinite(w.numpy()).all() and w.numpy()[0] < 1.0
