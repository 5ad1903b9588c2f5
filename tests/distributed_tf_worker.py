"""Runs in a fresh process for tests/test_distributed_tf.py: tf.distribute.MirroredStrategy over two logical CPU
devices (which must be configured before TensorFlow initialises), and prints one JSON object of results.

Usage: ``python distributed_tf_worker.py <checkpoint folder>``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np
import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402

PATTERN = "FFOFFFOOF"  # O: replica 1 alone sees an overflowing sample
SETTINGS = dict(init_scale=1024.0, growth_interval=2, hysteresis=1)
TWO = ["/cpu:0", "/cpu:1"]
#: One strategy for the whole process: strategies created one after another in a process can hand out the same
#: collective instance keys, and their all-reduces then meet each other.
STRATEGY = tf.distribute.MirroredStrategy(TWO)


def components(variable: Any) -> list[np.ndarray]:
    """The value of a variable on each replica (a Keras variable holds a tf.Variable, mirrored or not)."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    return [np.asarray(v.numpy()) for v in getattr(variable, "values", (variable,))]


def replicated(variables: list[Any]) -> bool:
    """Every variable has one copy per replica."""
    return all(len(components(v)) == len(TWO) for v in variables)


def same_everywhere(variables: list[Any]) -> bool:
    """Every variable holds bitwise the same value on every replica."""
    return all(all(c.tobytes() == components(v)[0].tobytes() for c in components(v)) for v in variables)


def snapshot(variables: list[Any]) -> list[bytes]:
    return [c.tobytes() for v in variables for c in components(v)]


def per_replica_bad(strategy: Any, overflow: bool) -> Any:
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(math.inf if overflow and ctx.replica_id_in_sync_group == 1 else 1.0)
    )


def custom_loop(kind: str, function: bool) -> dict[str, Any]:
    """A Dense layer trained with polyamp's optimizer (``kind="optimizer"``) or the tape scaler
    (``"scaler"``) inside strategy.run; PATTERN's overflows happen on replica 1 only."""
    strategy = STRATEGY
    with strategy.scope():
        layer = keras.layers.Dense(2, kernel_initializer="ones", dtype="mixed_float16")
        layer.build((None, 3))
        variables = layer.trainable_variables
        inner = keras.optimizers.Adam(0.01)
        if kind == "optimizer":
            optimizer = polyamp_keras.LossScaleOptimizer(inner, **SETTINGS)
            scaler = None
        elif kind == "guard":  # no scaling: the guard alone skips the non-finite steps
            optimizer = polyamp_keras.LossScaleOptimizer(inner, **SETTINGS, enabled=False, guard=True)
            scaler = None
        else:
            optimizer = inner
            scaler = polyamp.LossScaler(**SETTINGS, enabled=True)
        optimizer.build(variables)

    def step(bad: Any) -> Any:
        x = tf.ones((2, 3)) * bad
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(layer(x), "float32") - 0.5))
            scaled = optimizer.scale_loss(loss) if scaler is None else scaler.scale(loss)
        grads = tape.gradient(scaled, variables)
        if scaler is None:
            optimizer.apply(grads, variables)
        else:
            scaler.apply_gradients(optimizer, zip(grads, variables))
        return loss

    run = lambda bad: strategy.run(step, args=(bad,))  # noqa: E731
    if function:
        run = tf.function(run)
    states, skips_unchanged, identical, skip_counts = [], [], [], []
    watched = variables + list(inner.variables)
    counted = tf.function(scaler.skipped_steps) if scaler is not None else None
    for char in PATTERN:
        before = snapshot(watched)
        run(per_replica_bad(strategy, char == "O"))
        if char == "O":
            skips_unchanged.append(snapshot(watched) == before)
        if scaler is not None and counted is not None:
            skip_counts.append(read_count(scaler.skipped_steps) + read_count(counted))
        if scaler is None:
            state = optimizer.state_dict()
            own = [optimizer.dynamic_scale, optimizer.step_counter, optimizer.hysteresis_left]
        else:
            state = scaler.state_dict()
            held = scaler.device_form._variables  # type: ignore[union-attr]
            own = [held.scale, held.growth_tracker, held.hysteresis_left]
        states.append([state["scale"], state["_growth_tracker"], state["hysteresis_left"]])
        identical.append(same_everywhere(own + watched) and replicated(own + watched))
    config = polyamp.LossScaleConfig(**SETTINGS)
    reference = [[s.scale, s.growth_tracker, s.hysteresis_left] for s in config.states(PATTERN)]
    if kind == "guard":  # the rule does not run
        initial = config.initial_state()
        reference = [[initial.scale, initial.growth_tracker, initial.hysteresis_left]] * len(PATTERN)
    return {
        "states": states,
        "reference": reference,
        "skips_unchanged": skips_unchanged,
        "identical": identical,
        "finite": all(np.isfinite(c).all() for v in watched for c in components(v)),
        "iterations": int(inner.iterations.numpy()),
        "finite_steps": PATTERN.count("F"),
        "records": [[r.iteration, r.reason, r.scale, r.next_scale] for r in (scaler or optimizer).records()],
        "skip_counts": skip_counts,
    }


def read_count(skipped_steps: Any) -> list[int | str]:
    """``int(skipped_steps())``, as a user reads it (eagerly or from a tf.function), or the error it raises."""
    try:
        return [int(skipped_steps())]
    except Exception as error:
        return [f"{type(error).__name__}: {error}"]


def make_model() -> Any:
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1, dtype="float32")]
    )


def data(overflow_rows: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [1.5]], "float32")).astype("float32")
    for row in overflow_rows:
        x[row] = 1e5  # beyond float16: the forward pass overflows for this sample
    return x, y


def fit(folder: str) -> dict[str, Any]:
    """model.fit under MirroredStrategy, mixed_float16; batch 16, so replica 1 gets rows 8-15 of each batch.
    Row 13 of the first batch overflows: replica 1 only. Then checkpoints to and from one device."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = STRATEGY
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = make_model()
        optimizer = polyamp_keras.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), init_scale=1024.0, growth_interval=1000
        )
        model.compile(optimizer, "mse")
    x, y = data((13,))
    first = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    weights_finite = all(np.isfinite(w).all() for w in model.get_weights())
    after_overflow = {"iterations": int(optimizer.iterations.numpy()), "scale": optimizer.get_scale()}
    clean_x, clean_y = data()
    history = model.fit(clean_x, clean_y, batch_size=16, epochs=4, shuffle=False, verbose=0).history["loss"]
    own = [optimizer.dynamic_scale, optimizer.step_counter, optimizer.hysteresis_left]
    result: dict[str, Any] = {
        "first_epoch_loss": first.history["loss"][0],
        "weights_finite": weights_finite,
        "after_overflow": after_overflow,
        "losses": history,
        "identical": same_everywhere(own + model.trainable_variables + list(optimizer.inner_optimizer.variables)),
        "replicated": replicated(own + model.trainable_variables),
        "state": optimizer.state_dict(),
    }
    # Distributed -> one device: model.save / load_model, and state_dict into a fresh single-device optimizer.
    model.save(f"{folder}/distributed.keras")
    keras.mixed_precision.set_global_policy("mixed_float16")
    loaded = keras.models.load_model(f"{folder}/distributed.keras")
    result["loaded_single_state"] = loaded.optimizer.state_dict()
    result["loaded_single_weights_equal"] = all(
        np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True)
    )
    single = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    single.load_state_dict(optimizer.state_dict())
    result["state_dict_single"] = single.state_dict()
    before = loaded.optimizer.iterations.numpy()
    loaded.fit(clean_x, clean_y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    result["single_resumed_steps"] = int(loaded.optimizer.iterations.numpy() - before)
    # One device -> distributed: load the single-device save under the strategy and train on.
    loaded.save(f"{folder}/single.keras")
    with strategy.scope():
        again = keras.models.load_model(f"{folder}/single.keras")
    result["loaded_distributed_state"] = again.optimizer.state_dict()
    result["single_saved_state"] = loaded.optimizer.state_dict()
    again.fit(clean_x, clean_y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    held = again.optimizer
    result["distributed_resumed_state"] = held.state_dict()
    result["loaded_distributed_identical"] = same_everywhere(
        [held.dynamic_scale, held.step_counter, *again.trainable_variables]
    )
    result["loaded_distributed_mirrored"] = replicated([held.dynamic_scale, held.step_counter])
    keras.mixed_precision.set_global_policy("float32")
    return result


def jit(devices: list[str], which: str) -> str:
    """model.fit with jit_compile=True under MirroredStrategy over ``devices``: "ok" or the error's type and
    first line. ``which`` is "polyamp" or "plain" (a bare Adam, for comparison)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = STRATEGY if devices == TWO else tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = make_model()
        inner = keras.optimizers.Adam(0.01)
        optimizer = polyamp_keras.LossScaleOptimizer(inner) if which == "polyamp" else inner
        model.compile(optimizer, "mse", jit_compile=True)
    x, y = data((13,))
    try:
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    except Exception as error:
        cross_device = "Trying to access resource" in str(error)
        return f"{type(error).__name__}" + (": a variable on another device" if cross_device else "")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    finite = all(np.isfinite(w).all() for w in model.get_weights())
    return "ok" if finite else "non-finite weights"


def main() -> None:
    folder = sys.argv[1]
    results = {
        f"{kind}-{'function' if function else 'eager'}": custom_loop(kind, function)
        for kind in ("optimizer", "guard", "scaler")
        for function in (False, True)
    }
    results["fit"] = fit(folder)
    results["jit_one_device"] = jit(TWO[:1], "polyamp")
    results["jit_two_devices"] = {which: jit(TWO, which) for which in ("polyamp", "plain")}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
