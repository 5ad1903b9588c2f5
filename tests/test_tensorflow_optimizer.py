"""polyamp_tensorflow.LossScaleOptimizer against keras.mixed_precision.LossScaleOptimizer, side by side."""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_tensorflow  # noqa: E402
from polyamp import InvalidConfigError, PolyampTypeError, ScalerUsageError  # noqa: E402

INTERVAL = 3
STEPS = 12
OVERFLOWS = frozenset({1, 2, 6, 7, 8})


@pytest.fixture(autouse=True)
def mixed_float16() -> Iterator[None]:
    polyamp.set_policy("mixed_float16")
    yield
    polyamp.set_policy("float32")


def make_model() -> Any:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = keras.layers.Dense(3)(hidden)
    return keras.Model(inputs, outputs)


def data(step: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(step)
    return rng.normal(size=(8, 6)).astype("float32"), rng.integers(0, 3, size=(8,))


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def grads_of(model: Any, optimizer: Any, step: int) -> list[Any]:
    x, y = data(step)
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
        scaled = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    if step in OVERFLOWS:  # plant an inf in the (scaled) gradient of the first kernel
        grads[0] = tf.tensor_scatter_nd_update(grads[0], [[0, 0]], [math.inf])
    return grads


def run(optimizer: Any, function: bool) -> tuple[Any, list[float], list[int]]:
    model = make_model()

    def apply(grads: list[Any]) -> None:
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    step_fn = tf.function(apply) if function else apply
    scales, iterations = [], []
    for step in range(STEPS):
        step_fn(grads_of(model, optimizer, step))
        scales.append(float(optimizer.dynamic_scale.numpy()))
        iterations.append(int(optimizer.iterations.numpy()))
    return model, scales, iterations


def assert_same_variables(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and np.array_equal(keras.ops.convert_to_numpy(x), keras.ops.convert_to_numpy(y)), (
            x.name
        )


@pytest.mark.parametrize("function", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_same_trajectory_and_variables_as_keras(function: bool, inner: str) -> None:
    def inner_optimizer() -> Any:
        return keras.optimizers.SGD(0.1, momentum=0.9) if inner == "sgd" else keras.optimizers.Adam(1e-2)

    native = keras.mixed_precision.LossScaleOptimizer(
        inner_optimizer(), initial_scale=2.0**16, dynamic_growth_steps=INTERVAL
    )
    ours = polyamp_tensorflow.LossScaleOptimizer(inner_optimizer(), growth_interval=INTERVAL)
    native_model, native_scales, native_iterations = run(native, function)
    our_model, our_scales, our_iterations = run(ours, function)
    assert our_scales == native_scales
    assert our_scales == polyamp.LossScaleConfig(growth_interval=INTERVAL).trajectory(
        [s in OVERFLOWS for s in range(STEPS)]
    )
    assert (
        our_iterations
        == native_iterations
        == [sum(1 for s in range(i + 1) if s not in OVERFLOWS) for i in range(STEPS)]
    )
    assert_same_variables(native_model.trainable_variables, our_model.trainable_variables)
    assert_same_variables(native.inner_optimizer.variables, ours.inner_optimizer.variables)
    assert int(ours.skipped_steps.numpy()) == len(OVERFLOWS)


def test_skipped_step_leaves_variables_slots_and_iterations_unchanged() -> None:
    model = make_model()
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    optimizer.apply_gradients(zip(grads_of(model, optimizer, 0), model.trainable_variables))
    before = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables + optimizer.inner_optimizer.variables]
    grads = grads_of(model, optimizer, 1)  # step 1 overflows
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    after = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables + optimizer.inner_optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(optimizer.iterations.numpy()) == 1 and bool(optimizer.last_skipped.numpy())


def test_learning_rate_schedule_does_not_advance_on_skipped_steps() -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(schedule))
    model = make_model()
    for step in range(4):  # steps 1 and 2 overflow
        optimizer.apply_gradients(zip(grads_of(model, optimizer, step), model.trainable_variables))
    assert float(optimizer.learning_rate.numpy()) == 0.5**2  # two applied steps


def test_growth_stops_short_of_inf_where_keras_reaches_it() -> None:
    model = make_model()
    ours = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(0.0), init_scale=2.0**127, growth_interval=1)
    native = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=2.0**127, dynamic_growth_steps=1
    )
    for optimizer in (ours, native):
        grads = [tf.zeros_like(v) for v in model.trainable_variables]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    assert float(ours.dynamic_scale.numpy()) == 2.0**127
    assert math.isinf(float(native.dynamic_scale.numpy()))  # Keras 3 has no finite guard


def test_hysteresis_and_bounds_follow_the_reference() -> None:
    model = make_model()
    kwargs = dict(init_scale=64.0, growth_interval=2, hysteresis=2, min_scale=16.0, max_scale=128.0)
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(0.01), **kwargs)
    pattern = "FFFFOOOOOOFFFF"
    scales = []
    for char in pattern:
        grads = [tf.ones_like(v) for v in model.trainable_variables]
        if char == "O":
            grads[1] = grads[1] * math.nan
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        scales.append(float(optimizer.dynamic_scale.numpy()))
    assert scales == polyamp.LossScaleConfig(**kwargs).trajectory(pattern)


def test_static_scale_still_skips() -> None:
    model = make_model()
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(0.1), init_scale=256.0, dynamic=False)
    for step in range(3):
        optimizer.apply_gradients(zip(grads_of(model, optimizer, step), model.trainable_variables))
    assert float(optimizer.dynamic_scale.numpy()) == 256.0
    assert int(optimizer.iterations.numpy()) == 1 and int(optimizer.skipped_steps.numpy()) == 2


def test_tf_keras_2_loop_moves_weights_by_exactly_the_true_gradient() -> None:
    """get_scaled_loss / get_unscaled_gradients / apply_gradients, the seed's tf.keras-2 loop."""
    x = tf.constant([[1.0, -2.0, 0.5]])

    def step(optimizer: Any, w: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * x)  # d loss / d w = x
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_gradients = tape.gradient(scaled_loss, [w])
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        optimizer.apply_gradients(zip(gradients, [w]))

    w = tf.Variable([[0.0, 0.0, 0.0]])
    step(polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(1.0)), w)
    assert np.array_equal(w.numpy(), -x.numpy())

    native_w = tf.Variable([[0.0, 0.0, 0.0]])
    native = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0**16)
    native.get_scaled_loss = native.scale_loss  # Keras 3 dropped the tf.keras 2 names
    native.get_unscaled_gradients = lambda grads: [g / native.initial_scale for g in grads]
    step(native, native_w)
    assert np.array_equal(native_w.numpy(), -x.numpy() / 2.0**16)  # Keras 3 divides a second time


def test_unscaled_gradients_are_recognised_inside_tf_function() -> None:
    w = tf.Variable([1.0, 2.0])
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(1.0))

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            scaled = optimizer.get_scaled_loss(tf.reduce_sum(w * w))
        grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, [w]))
        optimizer.apply_gradients(zip(grads, [w]))

    step()
    assert np.allclose(w.numpy(), [-1.0, -2.0])


def test_clipped_unscaled_gradients_are_not_unscaled_again() -> None:
    w = tf.Variable([0.0, 0.0])
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    with tf.GradientTape() as tape:
        scaled = optimizer.get_scaled_loss(tf.reduce_sum(w * tf.constant([3.0, 4.0])))
    grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, [w]))
    clipped, _ = tf.clip_by_global_norm(grads, 1.0)
    optimizer.apply_gradients(zip(clipped, [w]))
    np.testing.assert_allclose(w.numpy(), [-0.6, -0.8], rtol=1e-6)


def test_mixing_unscaled_and_scaled_gradients_is_an_error() -> None:
    a, b = tf.Variable([1.0]), tf.Variable([2.0])
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    with tf.GradientTape() as tape:
        scaled = optimizer.scale_loss(tf.reduce_sum(a * b))
    ga, gb = tape.gradient(scaled, [a, b])
    (ga,) = optimizer.get_unscaled_gradients([ga])
    with pytest.raises(ScalerUsageError, match="mix of gradients"):
        optimizer.apply_gradients(zip([ga, gb], [a, b]))
    assert a.numpy()[0] == 1.0 and b.numpy()[0] == 2.0


def test_jit_compiled_loop_runs_and_matches_eager() -> None:
    results = []
    for jit in (False, True):
        model = make_model()
        optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-2), growth_interval=INTERVAL)
        optimizer.build(model.trainable_variables)

        def train_step(x: Any, y: Any, bad: Any, model: Any = model, optimizer: Any = optimizer) -> Any:
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x, training=True)) * bad
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        step = tf.function(train_step, jit_compile=True) if jit else train_step
        for i in range(6):
            x, y = data(i)
            step(tf.constant(x), tf.constant(y), tf.constant(math.inf if i == 2 else 1.0))
        results.append((model, float(optimizer.dynamic_scale.numpy()), int(optimizer.iterations.numpy())))
    (eager_model, eager_scale, eager_iterations), (jit_model, jit_scale, jit_iterations) = results
    assert (jit_scale, jit_iterations) == (eager_scale, eager_iterations) == (65536.0, 5)
    for a, b in zip(eager_model.trainable_variables, jit_model.trainable_variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_fit_under_polyamp_policy_trains_and_keras_does_not_wrap_again() -> None:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(4),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    assert [layer.compute_dtype for layer in model.layers[:2]] == ["float16", "float16"]
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    assert model.optimizer is optimizer
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 10)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int32")
    history = model.fit(x, y, epochs=4, batch_size=32, verbose=0, callbacks=[polyamp_tensorflow.LossScaleCallback()])
    losses = history.history["loss"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert history.history["loss_scale"] == [65536.0] * 4
    assert history.history["skipped_steps"] == [0] * 4


def test_model_save_and_load_keep_scale_counter_and_settings(tmp_path: Path) -> None:
    model = make_model()
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-2), growth_interval=5, hysteresis=2)
    model.compile(optimizer=optimizer, loss=LOSS)
    for step in range(4):  # steps 1 and 2 overflow: one backoff (hysteresis 2)
        optimizer.apply_gradients(zip(grads_of(model, optimizer, step), model.trainable_variables))
    saved_state = optimizer.state_dict()
    assert (saved_state["scale"], saved_state["_growth_tracker"], saved_state["hysteresis_left"]) == (32768.0, 1, 2)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is polyamp_tensorflow.LossScaleOptimizer
    assert loaded.optimizer.state_dict() == saved_state
    assert int(loaded.optimizer.skipped_steps.numpy()) == 2
    assert_same_variables(model.trainable_variables, loaded.trainable_variables)


def test_a_file_saved_with_the_counts_and_their_index_as_two_variables_loads_its_state() -> None:
    """A weights file written while a skipped step's non-finite counts and that step's index were two variables
    (``non_finite_counts`` one row shorter, then a scalar ``non_finite_at``) holds one entry more than the
    optimizer has: it is read with the two joined, so the scale, the counters and the provenance load (Keras
    itself would warn about the count and load nothing). A store of another shape is left to Keras."""
    model = make_model()
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-2), growth_interval=5, hysteresis=2)
    model.compile(optimizer=optimizer, loss=LOSS)
    for step in range(4):  # steps 1 and 2 overflow
        optimizer.apply_gradients(zip(grads_of(model, optimizer, step), model.trainable_variables))
    values = [np.asarray(v.numpy()) for v in optimizer.variables]
    (at,) = [i for i, v in enumerate(optimizer.variables) if v.path.endswith("non_finite_counts")]
    joined = values[at]
    assert joined[-1, 0] == 2  # the index of the last skipped iteration
    old = [*values[:at], joined[:-1], np.asarray(joined[-1, 0], dtype="int32"), *values[at + 1 :]]
    old_store = {str(i): value for i, value in enumerate(old)}

    fresh_model = make_model()
    fresh = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-2), growth_interval=5, hysteresis=2)
    fresh_model.compile(optimizer=fresh, loss=LOSS)
    fresh.build(fresh_model.trainable_variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # Keras's "Skipping variable loading" is one
        fresh.load_own_variables(old_store)
    assert fresh.state_dict() == optimizer.state_dict()
    for a, b in zip(fresh.variables, values, strict=True):
        np.testing.assert_array_equal(a.numpy(), b)

    other = make_model()
    untouched = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-2), growth_interval=5, hysteresis=2)
    other.compile(optimizer=untouched, loss=LOSS)
    untouched.build(other.trainable_variables)
    before = [np.asarray(v.numpy()) for v in untouched.variables]
    odd = dict(old_store)
    odd[str(at + 1)] = np.zeros((2,), dtype="int32")  # not a scalar index: not the old layout
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        untouched.load_own_variables(odd)
    for a, b in zip(untouched.variables, before, strict=True):
        np.testing.assert_array_equal(a.numpy(), b)


def test_gradient_accumulation_drops_overflowing_micro_batches() -> None:
    w = tf.Variable([0.0, 0.0])
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(1.0, gradient_accumulation_steps=2))
    micro = [tf.constant([1.0, 2.0]), tf.constant([math.inf, 0.0]), tf.constant([3.0, 4.0]), tf.constant([5.0, 6.0])]
    for grad in micro:
        optimizer.apply_gradients([(grad * optimizer.get_scale(), w)])
    # Micro-batch 2 overflowed and was dropped: the update used the mean of micro-batches 1 and 3.
    # Micro-batch 4 opened the next window.
    assert np.array_equal(w.numpy(), [-2.0, -3.0])
    assert int(optimizer.iterations.numpy()) == 1 and int(optimizer.skipped_steps.numpy()) == 1


def test_follows_the_policy_by_the_rule_of_every_scaler_and_scales_under_float32_as_keras_does() -> None:
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD())
    scaler = polyamp.LossScaler()
    assert optimizer.enabled_setting is None and optimizer.get_config()["enabled"] is None
    seen = {}
    for policy in ("mixed_float16", "mixed_bfloat16", "float32"):
        with polyamp.policy_scope(policy):
            seen[policy] = (optimizer.enabled, optimizer.scaler.guarding, scaler.enabled)
    # As polyamp.LossScaler under mixed precision (the guard under bfloat16); under float32, which names no mixed
    # precision, it scales, as Keras's own LossScaleOptimizer always does.
    assert seen == {
        "mixed_float16": (True, False, True),
        "mixed_bfloat16": (False, True, False),
        "float32": (True, False, False),
    }
    with polyamp.policy_scope("mixed_bfloat16"):  # given explicitly, the setting wins
        assert polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(), enabled=True).enabled


def test_bfloat16_policy_disables_scaling() -> None:
    polyamp.set_policy("mixed_bfloat16")
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(1.0), enabled=None)
    assert not optimizer.enabled and optimizer.get_scale() == 1.0
    loss = tf.constant(3.0)
    assert optimizer.scale_loss(loss) is loss
    w = tf.Variable([1.0])
    optimizer.apply_gradients([(tf.constant([0.5]), w)])
    assert w.numpy()[0] == 0.5


def test_state_dict_round_trip_and_load_before_build() -> None:
    source = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(0.1), growth_interval=4)
    model = make_model()
    for step in range(3):
        source.apply_gradients(zip(grads_of(model, source, step), model.trainable_variables))
    target = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    target.load_state_dict(source.state_dict())
    assert target.state_dict() == source.state_dict()
    target.build(model.trainable_variables)
    assert target.state_dict() == source.state_dict()


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "fragment"),
    [
        (("adam",), {}, PolyampTypeError, "must be a Keras 3 optimizer"),
        ((), {"growth_factor": 1.0}, InvalidConfigError, "`growth_factor` must be"),
        ((), {"init_scale": 8.0, "initial_scale": 4.0}, PolyampTypeError, "not both"),
        ((), {"growth_interval": 10, "dynamic_growth_steps": 4}, PolyampTypeError, "not both"),
        ((), {"enabled": "yes"}, PolyampTypeError, "`enabled` must be None or a bool"),
    ],
)
def test_construction_errors(args: tuple[Any, ...], kwargs: dict[str, Any], error: type, fragment: str) -> None:
    with pytest.raises(error) as info:
        polyamp_tensorflow.LossScaleOptimizer(*(args or (keras.optimizers.SGD(),)), **kwargs)
    assert fragment in str(info.value)


def test_wrapping_a_loss_scale_optimizer_again_is_an_error() -> None:
    inner = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(PolyampTypeError, match="already a LossScaleOptimizer"):
        polyamp_tensorflow.LossScaleOptimizer(inner)


def test_inner_loss_scale_factor_would_divide_twice() -> None:
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    optimizer.inner_optimizer.loss_scale_factor = 128.0
    w = tf.Variable([1.0])
    with pytest.raises(ScalerUsageError, match="loss_scale_factor"):
        optimizer.apply_gradients([(tf.constant([1.0]), w)])
    assert w.numpy()[0] == 1.0


def test_keras_names_are_accepted_for_porting() -> None:
    optimizer = polyamp_tensorflow.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=1024.0, dynamic_growth_steps=7
    )
    assert optimizer.loss_scale_config.init_scale == 1024.0 and optimizer.loss_scale_config.growth_interval == 7


def test_callback_needs_a_polyamp_optimizer() -> None:
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(), loss=LOSS)
    x, y = data(0)
    with pytest.raises(PolyampTypeError, match="LossScaleCallback needs a model compiled with"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[polyamp_tensorflow.LossScaleCallback()])


def test_callback_values_reach_later_callbacks_and_tensorboard(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    class Recorder(keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            seen.append(dict(logs or {}))

    model = make_model()
    model.compile(optimizer=polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss=LOSS)
    x, y = data(0)
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path))
    model.fit(x, y, epochs=2, verbose=0, callbacks=[polyamp_tensorflow.LossScaleCallback(), Recorder(), board])
    assert [(logs["loss_scale"], logs["skipped_steps"]) for logs in seen] == [(65536.0, 0), (65536.0, 0)]
    tags = set()
    for event_file in tmp_path.rglob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(event_file)):
            tags.update(value.tag for value in event.summary.value)
    assert {"epoch_loss_scale", "epoch_skipped_steps"} <= tags


# -- settings once fit traced them; unscaled gradients left unapplied -------------------------------------------


def test_keras_optimizer_refuses_new_settings_after_fit_traced_them() -> None:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(0.0), enabled=True)
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
    w = tf.Variable([0.0])
    optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.SGD(1.0), enabled=True)

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
