"""Hardening, round two: each test pins a defect found by attacking polyamp's arguments, saved files, logs and
distribution strategies.

The promise stays the one of tests/test_hardening.py: a bad input is a PolyampError of the right built-in that
names the value and changes nothing; a run never writes a non-finite value into the weights.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # before TensorFlow, in a process that imports both

import polyamp  # noqa: E402
from polyamp import (  # noqa: E402
    FunctionalLossScaler,
    InvalidConfigError,
    LossScaleConfig,
    LossScaleState,
    PolyampTypeError,
    PolyampValueError,
    SpikeRule,
    StateDictError,
)
from polyamp._src.records import LOGGED_SKIPS, MAX_HISTORY, Recorder, StepRecord  # noqa: E402
from polyamp._src.spikes import MAX_WINDOW  # noqa: E402

HERE = Path(__file__).resolve()
#: Set in the subprocess that runs the Keras tests on JAX.
SUBPROCESS = os.environ.get("POLYAMP_ROUND2_SUBPROCESS") == "1"


# -- SpikeRule: wrong exception types, silent accepts ------------------------------------------------------------


def test_a_threshold_beyond_floats_range_is_a_value_error_naming_it() -> None:
    with pytest.raises(PolyampValueError, match=r"threshold=\.\.\.\) must be a finite positive number") as caught:
        SpikeRule(threshold=10**400)
    assert "(of type int)" in str(caught.value) and "1000000" in str(caught.value)


@pytest.mark.parametrize("value", ["yes", None, 1, math.nan], ids=["str", "none", "int", "nan"])
def test_two_sided_must_be_a_bool(value: object) -> None:
    with pytest.raises(PolyampTypeError, match=r"`SpikeRule\(two_sided=\.\.\.\)` must be a bool\. Received: "):
        SpikeRule(two_sided=value)  # type: ignore[arg-type]
    assert SpikeRule(two_sided=True).two_sided is True


@pytest.mark.parametrize("field", ["window", "warmup"])
@pytest.mark.parametrize("value", [MAX_WINDOW + 1, 10**8, 10**12])
def test_window_and_warmup_are_bounded(field: str, value: int) -> None:
    kwargs = {"window": MAX_WINDOW, field: value}
    with pytest.raises(PolyampValueError, match=rf"SpikeRule\({field}=\.\.\.\) must be an int from 2 to 65,536\."):
        SpikeRule(**kwargs)  # type: ignore[arg-type]


def test_the_largest_window_is_accepted() -> None:
    assert MAX_WINDOW == 65_536
    assert SpikeRule(window=MAX_WINDOW, warmup=MAX_WINDOW).min_values == MAX_WINDOW


def test_on_must_be_a_string() -> None:
    # an array holding 'loss' compared equal to 'loss' element-wise and was taken as one
    with pytest.raises(PolyampValueError, match=r"must be 'loss' or 'grad_norm'\. Received: array\(\['loss'\]"):
        SpikeRule(on=np.array(["loss"]))  # type: ignore[arg-type]


#: Statistics whose squared deviations (above ~1.3e154) or sums (above ~1.8e308) overflow float64.
HUGE_TRACES = {
    "squares_overflow": [1e200, 1.0, 1.0, 1.0, 1.0, 2e154, 1.0, 1.0],
    "sum_overflows": [1e308, 1e308, 1e308, 1e308, 1.0, 1e308],
    "big_but_representable": [1e150, 1.1e150, 0.9e150, 1e150, 5e150, 1e150],
}


def test_the_reference_decides_huge_statistics_without_overflowing() -> None:
    rule = SpikeRule("loss", window=4, threshold=3.0)
    assert rule.decide(HUGE_TRACES["squares_overflow"]) == [False] * 8
    assert rule.decide(HUGE_TRACES["sum_overflows"]) == [False] * 6
    assert rule.decide(HUGE_TRACES["big_but_representable"]) == [False] * 4 + [True, False]
    assert rule.is_spike([0.0, 0.0, 0.0, 2e154], 1e155) is False  # sigma is inf on the devices: no spike


def _torch_decisions(rule: SpikeRule, trace: list[float]) -> list[bool]:
    weight = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scaler = polyamp.LossScaler(spike=rule)
    skipped = []
    for value in trace:
        optimizer.zero_grad()
        scaler.scale(weight * value).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped.append(bool(scaler.step_skipped(optimizer)))
    return skipped


def _tensorflow_decisions(rule: SpikeRule, trace: list[float]) -> list[bool]:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    weight = tf.Variable(1.0, dtype=tf.float64)
    optimizer = keras.optimizers.SGD(0.0)
    scaler = polyamp.LossScaler(spike=rule, backend="tensorflow")
    skipped = []
    for value in trace:
        with tf.GradientTape() as tape:
            loss = scaler.scale(weight * value)
        scaler.apply_gradients(optimizer, [(tape.gradient(loss, weight), weight)])
        skipped.append(bool(scaler.step_skipped()))
    return skipped


@pytest.mark.parametrize("trace", list(HUGE_TRACES), ids=list(HUGE_TRACES))
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_the_devices_decide_huge_statistics_as_the_reference(backend: str, trace: str) -> None:
    rule = SpikeRule("loss", window=4, threshold=3.0)
    run = _torch_decisions if backend == "torch" else _tensorflow_decisions
    assert run(rule, HUGE_TRACES[trace]) == rule.decide(HUGE_TRACES[trace])


# -- history, FunctionalLossScaler.init, overflow patterns, get_backend ------------------------------------------


@pytest.mark.parametrize("history", [MAX_HISTORY + 1, 10**9])
def test_history_is_bounded(history: int) -> None:
    with pytest.raises(PolyampValueError, match=r"`history` must be an int from 1 to 65,536") as caught:
        polyamp.LossScaler(history=history)
    assert f"Received: {history} (of type int)" in str(caught.value)
    assert polyamp.LossScaler(history=MAX_HISTORY).state_dict()["scale"] == 65536.0


class _StubDevice:
    """A functional device that hands back the host state it is initialised with."""

    def init(self, state: LossScaleState) -> LossScaleState:
        return state


def _functional(**settings: Any) -> FunctionalLossScaler:
    stub: Any = lambda config: _StubDevice()  # noqa: E731 - a FunctionalDevice factory for init() alone
    return FunctionalLossScaler(stub, LossScaleConfig(**settings), True)


@pytest.mark.parametrize(
    ("state", "fragment"),
    [
        (LossScaleState(math.nan), "finite positive number representable in float32. Received: scale=nan"),
        (LossScaleState(0.0), "Received: scale=0.0"),
        (LossScaleState(math.inf), "Received: scale=inf"),
        (LossScaleState(-2.0), "Received: scale=-2.0"),
        (LossScaleState(1e39), "Received: scale=1e+39"),  # finite in float64, inf in float32
        (LossScaleState(1e-40), "scale=1e-40 is below min_scale"),  # a float32 subnormal
        (LossScaleState(1024.0, growth_tracker=2000), "growth tracker must be in [0, growth_interval=2000)"),
        (LossScaleState(1024.0, hysteresis_left=0), "hysteresis_left must be in [1, hysteresis=1]"),
    ],
)
def test_functional_init_refuses_impossible_states(state: LossScaleState, fragment: str) -> None:
    with pytest.raises(InvalidConfigError) as caught:
        _functional().init(state)
    assert "FunctionalLossScaler.init() cannot start from this state" in str(caught.value)
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    "state",
    [LossScaleState("1024"), LossScaleState(1024.0, growth_tracker=1.5), 1024.0],  # type: ignore[arg-type]
    ids=["str_scale", "float_tracker", "not_a_state"],
)
def test_functional_init_refuses_wrong_types(state: Any) -> None:
    with pytest.raises(PolyampTypeError, match=r"FunctionalLossScaler\.init"):
        _functional().init(state)


def test_functional_init_takes_a_valid_state_rounded_to_float32() -> None:
    functional = _functional(hysteresis=2, min_scale=0.5)
    # the state's "scaler" entry is what the device made from the (validated, rounded) host state
    assert functional.init(LossScaleState(np.float64(3.0000001), 5, 2))["scaler"] == LossScaleState(3.0, 5, 2)
    assert functional.init()["scaler"] == LossScaleState(65536.0, 0, 2)


@pytest.mark.parametrize(
    "pattern",
    [[np.array([True, False])], [np.array([True])], [np.array([[False]])], np.array(False)],
    ids=["two_flags_in_one_item", "one_element_array", "nested_array", "zero_d_array"],
)
def test_an_overflow_pattern_takes_only_scalar_flags(pattern: Any) -> None:
    with pytest.raises(PolyampTypeError, match=r"overflow pattern") as caught:
        LossScaleConfig().trajectory(pattern)
    assert "array(" in str(caught.value)


def test_an_overflow_pattern_takes_numpy_bools() -> None:
    config = LossScaleConfig(growth_interval=2)
    assert config.trajectory([np.False_, np.True_]) == config.trajectory("FO") == [65536.0, 32768.0]
    assert config.trajectory(np.array([False, True])) == [65536.0, 32768.0]


def test_get_backend_with_an_array_is_a_type_error_naming_it() -> None:
    with pytest.raises(PolyampTypeError, match=r"must be a string such as 'torch'\. Received: array\(\[1\., 2\.\]\)"):
        polyamp.backend_api.get_backend(np.array([1.0, 2.0]))  # type: ignore[arg-type]


# -- the logging of skipped steps is rate-limited ----------------------------------------------------------------


def _polyamp_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "polyamp"]


def test_a_storm_of_guarded_skips_logs_a_handful_of_lines(caplog: pytest.LogCaptureFixture) -> None:
    """200 guarded steps with a NaN gradient (a bfloat16 storm): 8 lines, then one each at 16, 32, 64, 128."""
    caplog.set_level(logging.INFO, logger="polyamp")
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = polyamp.LossScaler()
    with polyamp.policy_scope("mixed_bfloat16"):
        for _ in range(200):
            optimizer.zero_grad()
            scaler.scale((weight * math.nan).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
    records = scaler.records()
    assert len([r for r in records if r.skipped]) == 200 and int(scaler.skipped_steps()) == 200
    lines = _polyamp_lines(caplog)
    assert all(level == logging.WARNING for level, _ in lines)
    assert [message.split(":")[1].strip() for _, message in lines[:LOGGED_SKIPS]] == [
        f"iteration {i}" for i in range(LOGGED_SKIPS)
    ]
    assert "further ones are summarised when their count reaches 16, 32, 64" in lines[LOGGED_SKIPS - 1][1]
    summaries = [message for _, message in lines[LOGGED_SKIPS:]]
    assert [m.split(" steps skipped")[0] for m in summaries] == [
        "polyamp: 16",
        "polyamp: 32",
        "polyamp: 64",
        "polyamp: 128",
    ]
    assert "16 steps skipped (non_finite) so far, 8 since the last such line, in iterations 8 to 15" in summaries[0]
    assert "128 steps skipped (non_finite) so far, 64 since the last such line, in iterations 64 to 127" in summaries[3]
    assert "The last one: iteration 127: step skipped (non_finite)" in summaries[3]
    assert len(lines) == LOGGED_SKIPS + 4


def test_each_reason_has_its_own_budget(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="polyamp")
    recorder = Recorder(64, "ignore")
    config = LossScaleConfig()
    reasons = ["non_finite"] * 20 + ["loss_spike"] * 3
    for i, reason in enumerate(reasons):
        record = StepRecord(i, True, reason, "guarding", None, None)  # type: ignore[arg-type]
        recorder._report(record, config)
    lines = [message for _, message in _polyamp_lines(caplog)]
    assert len(lines) == LOGGED_SKIPS + 1 + 3
    assert [line for line in lines if "(loss_spike)" in line] == [
        lines[-3],
        lines[-2],
        lines[-1],
    ] and lines[-1].startswith("polyamp: iteration 22: step skipped (loss_spike)")


# -- Keras: a corrupted saved scale is refused; from_config names what is wrong ----------------------------------


def _keras() -> Any:
    return pytest.importorskip("keras")


def _keras_model_and_optimizer() -> tuple[Any, Any]:
    keras = _keras()
    import polyamp_keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01), growth_interval=4)
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _fit_once(model: Any) -> None:
    model.fit(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), batch_size=4, epochs=1, verbose=0)


def _saved_weights(tmp_path: Path, edits: dict[str, Any]) -> tuple[Path, dict[str, np.ndarray]]:
    """A model.weights.h5 after one step, with some of the optimizer's variables (by name) overwritten; and the
    optimizer's entries as a store (``store[str(i)]``)."""
    h5py = pytest.importorskip("h5py")
    model, optimizer = _keras_model_and_optimizer()
    _fit_once(model)
    path = tmp_path / "model.weights.h5"
    model.save_weights(str(path))
    index = {name: i for i, name in enumerate(v.name for v in optimizer.variables)}
    with h5py.File(path, "r+") as file:
        for name, value in edits.items():
            file[f"optimizer/vars/{index[name]}"][...] = value
        store = {key: np.asarray(file[f"optimizer/vars/{key}"]) for key in file["optimizer/vars"]}
    return path, store


def _snapshot(optimizer: Any) -> list[bytes]:
    return [np.asarray(_keras().ops.convert_to_numpy(v)).tobytes() for v in optimizer.variables]


CORRUPT_SCALES = {"zero": 0.0, "subnormal": 1e-42, "nan": math.nan, "inf": math.inf, "negative": -4.0}


@pytest.mark.parametrize("value", list(CORRUPT_SCALES.values()), ids=list(CORRUPT_SCALES))
def test_keras_corrupted_saved_scale_is_refused_and_the_optimizer_unchanged(tmp_path: Path, value: float) -> None:
    path, store = _saved_weights(tmp_path, {"dynamic_scale": value})
    model, optimizer = _keras_model_and_optimizer()
    _fit_once(model)
    before = _snapshot(optimizer)
    with pytest.raises(StateDictError) as caught:
        optimizer.load_own_variables(store)
    message = str(caught.value)
    shown = repr(float(np.float32(value)))
    assert "dynamic_scale (entry 'optimizer/vars/" in message and f"= {shown}" in message
    assert "The optimizer was left unchanged" in message and "h5py.File('model.weights.h5', 'r+')" in message
    assert "skip_mismatch=True" in message
    assert _snapshot(optimizer) == before
    # through Keras, which wraps the refusal into its own ValueError
    with pytest.raises(ValueError, match="Cannot load the variables of LossScaleOptimizer"):
        model.load_weights(str(path))
    assert _snapshot(optimizer) == before
    _fit_once(model)
    assert all(np.isfinite(_keras().ops.convert_to_numpy(w)).all() for w in model.trainable_variables)


@pytest.mark.parametrize(
    ("edits", "fragment"),
    [
        ({"step_counter": 4}, "growth tracker must be in [0, growth_interval=4). Received: 4"),
        ({"step_counter": -1}, "growth tracker must be in [0, growth_interval=4). Received: -1"),
        ({"hysteresis_left": 0}, "hysteresis_left must be in [1, hysteresis=1]. Received: 0"),
        ({"skipped_steps": -3}, "is -3, a count that cannot be negative"),
    ],
    ids=["tracker_at_interval", "tracker_negative", "hysteresis_zero", "negative_count"],
)
def test_keras_impossible_saved_counters_are_refused(tmp_path: Path, edits: dict[str, Any], fragment: str) -> None:
    _, store = _saved_weights(tmp_path, edits)
    _, optimizer = _keras_model_and_optimizer()
    before = _snapshot(optimizer)
    with pytest.raises(StateDictError) as caught:
        optimizer.load_own_variables(store)
    assert fragment in str(caught.value)
    assert _snapshot(optimizer) == before


def test_keras_a_valid_saved_state_loads_and_the_records_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="polyamp")
    path, _ = _saved_weights(tmp_path, {"dynamic_scale": 1024.0})
    model, optimizer = _keras_model_and_optimizer()
    model.load_weights(str(path))
    assert optimizer.get_scale() == 1024.0
    assert optimizer.state_dict()["_growth_tracker"] == 1
    _fit_once(model)
    records = optimizer.records()
    assert [(r.iteration, r.scale) for r in records] == [(1, 1024.0)]  # the saved run's step is not replayed
    assert not [r for r in caplog.records if r.name == "polyamp" and "without being recorded" in r.getMessage()]


def test_keras_from_config_names_what_is_wrong() -> None:
    keras = _keras()
    import polyamp_keras

    config = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1)).get_config()
    with pytest.raises(PolyampTypeError, match=r"'spike' holds \['bogus'\], which SpikeRule does not take"):
        polyamp_keras.LossScaleOptimizer.from_config(dict(config, spike={"bogus": 1}))
    without = {key: value for key, value in config.items() if key != "inner_optimizer"}
    with pytest.raises(PolyampValueError, match=r"needs 'inner_optimizer'.*Received the keys: \["):
        polyamp_keras.LossScaleOptimizer.from_config(without)
    with pytest.raises(PolyampTypeError, match=r"takes the dict get_config\(\) returned\. Received: \[\]"):
        polyamp_keras.LossScaleOptimizer.from_config([])  # type: ignore[arg-type]
    assert polyamp_keras.LossScaleOptimizer.from_config(config).get_config() == config


@pytest.mark.skipif(SUBPROCESS, reason="the subprocess runs the Keras tests on its own backend")
def test_jax_runs_the_keras_checks() -> None:
    """The same Keras tests on Keras's JAX backend, in a fresh process (Keras picks its backend once)."""
    if any(_missing(module) for module in ("jax", "keras", "h5py")):
        pytest.skip("jax, keras or h5py is not installed")
    env = dict(os.environ, KERAS_BACKEND="jax", POLYAMP_ROUND2_SUBPROCESS="1", TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, "-m", "pytest", str(HERE), "-q", "-p", "no:cacheprovider", "-k", "test_keras_"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=HERE.parent.parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in result.stdout.splitlines()[-1] and "skipped" not in result.stdout.splitlines()[-1]


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


# -- the tape scaler under a one-replica MirroredStrategy ---------------------------------------------------------


@pytest.mark.parametrize("function", [True, False], ids=["tf_function", "eager"])
def test_tape_scaler_under_a_one_replica_mirrored_strategy(function: bool) -> None:
    """What MirroredStrategy() gives on a one-GPU machine: the apply is a merge_call there too, which used to
    be taken inside a cond in the replica context ("merge_call called while defining a new graph")."""
    tf = pytest.importorskip("tensorflow")
    keras = _keras()
    if keras.backend.backend() != "tensorflow":
        pytest.skip("Keras runs on another backend here")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
        scaler = polyamp.LossScaler(enabled=True, init_scale=1024.0, growth_interval=2, backend="tensorflow")

    def step(x: Any, y: Any, bad: Any) -> None:
        with tf.GradientTape() as tape:
            loss = scaler.scale(tf.reduce_mean((model(x) - y) ** 2) * bad)
        grads = tape.gradient(loss, model.trainable_variables)
        scaler.apply_gradients(optimizer, zip(grads, model.trainable_variables))

    def train_step(x: Any, y: Any, bad: Any) -> None:
        strategy.run(step, args=(x, y, bad))

    run = tf.function(train_step) if function else train_step
    pattern = "FOFFF"
    x, y = tf.ones((4, 3)), tf.zeros((4, 2))
    skipped_unchanged = []
    for char in pattern:
        before = [v.numpy().copy() for v in model.trainable_variables]
        run(x, y, tf.constant(math.inf if char == "O" else 1.0))
        after = [v.numpy() for v in model.trainable_variables]
        skipped_unchanged.append(all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)))
    assert skipped_unchanged == [char == "O" for char in pattern]
    assert int(optimizer.iterations.numpy()) == pattern.count("F")
    assert int(scaler.skipped_steps().numpy()) == 1
    assert [r.next_scale for r in scaler.records()] == LossScaleConfig(init_scale=1024.0, growth_interval=2).trajectory(
        pattern
    )
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


@pytest.mark.parametrize("function", [True, False], ids=["tf_function", "eager"])
def test_guard_of_the_keras_optimizer_under_a_one_replica_mirrored_strategy(function: bool) -> None:
    """The guard (enabled=None under a float32 policy) took its cond around the inner optimizer's merge_call in the
    replica context, and failed there, model.fit included."""
    tf = pytest.importorskip("tensorflow")
    keras = _keras()
    import polyamp_keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip("tf.distribute needs Keras on TensorFlow")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01), enabled=False, guard=True)
        optimizer.build(model.trainable_variables)

    def step(x: Any, y: Any, bad: Any) -> None:
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(tf.reduce_mean((model(x) - y) ** 2) * bad)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    def train_step(x: Any, y: Any, bad: Any) -> None:
        strategy.run(step, args=(x, y, bad))

    run = tf.function(train_step) if function else train_step
    x, y = tf.ones((4, 3)), tf.zeros((4, 2))
    unchanged = []
    for bad in [1.0, math.nan, 1.0]:
        before = [v.numpy().copy() for v in model.trainable_variables]
        run(x, y, tf.constant(bad))
        unchanged.append(
            all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables, strict=True))
        )
    assert unchanged == [False, True, False]
    assert int(optimizer.iterations.numpy()) == 2 and int(optimizer.skipped_steps.numpy()) == 1
    assert [(r.mode, r.reason) for r in optimizer.records()] == [
        ("guarding", None),
        ("guarding", "non_finite"),
        ("guarding", None),
    ]
    with strategy.scope():
        fitted = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        fitted.compile(polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), enabled=None), "mse")
    history = fitted.fit(np.ones((8, 3), "float32"), np.zeros((8, 2), "float32"), batch_size=4, verbose=0)
    assert math.isfinite(history.history["loss"][-1]) and int(fitted.optimizer.iterations.numpy()) == 2
