"""Runs in a fresh process for tests/test_distributed_tf.py: Keras on JAX with ``keras.distribution.DataParallel``
over two CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``, ``KERAS_BACKEND=jax``, set by the
test), and prints one JSON object of results.

Usage: ``python distributed_jax_worker.py <checkpoint folder>``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import keras
import numpy as np

import polyamp_keras

BATCH = 16  # two shards of 8 rows: rows 8-15 of each batch are device 1's


def make_model() -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1, dtype="float32")]
    )
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01), init_scale=1024.0, growth_interval=3)
    model.compile(optimizer, "mse")
    return model


def data(overflow_row: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [1.5]], "float32")).astype("float32")
    if overflow_row is not None:
        x[overflow_row] = 1e5  # beyond float16: this sample's forward pass overflows
    return x, y


def shards(variable: Any) -> list[np.ndarray]:
    """The value of a variable on each device holding it."""
    return [np.asarray(shard.data) for shard in variable.value.addressable_shards]


def trained(distributed: bool) -> dict[str, Any]:
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=keras.distribution.list_devices("cpu")) if distributed else None
    )
    model = make_model()
    optimizer = model.optimizer
    x, y = data()
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # builds everything
    before = [w.copy() for w in model.get_weights()]
    slots_before = [np.asarray(v.numpy()).copy() for v in optimizer.inner_optimizer.variables]
    bad_x, bad_y = data(overflow_row=BATCH + 13)  # the second batch; row 13 of it is on device 1
    model.fit(bad_x[BATCH : 2 * BATCH], bad_y[BATCH : 2 * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    skipped = {
        "weights_unchanged": all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True)),
        "slots_unchanged": all(
            np.array_equal(a, np.asarray(v.numpy()))
            for a, v in zip(slots_before, optimizer.inner_optimizer.variables, strict=True)
        ),
        "state": optimizer.state_dict(),
    }
    losses = model.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0).history["loss"]
    own = [optimizer.dynamic_scale, optimizer.step_counter, optimizer.hysteresis_left]
    result = {
        "devices": [str(d) for d in keras.distribution.list_devices("cpu")],
        "skipped": skipped,
        "losses": losses,
        "state": optimizer.state_dict(),
        "iterations": int(np.asarray(optimizer.iterations.numpy())),
        "weights": [w.tolist() for w in model.get_weights()],
        "copies": [len(shards(v)) for v in own + model.trainable_variables],
        "identical": all(
            all(np.array_equal(s, shards(v)[0]) for s in shards(v)) for v in own + model.trainable_variables
        ),
    }
    if distributed:
        folder = sys.argv[1]
        model.save(f"{folder}/jax_distributed.keras")
        keras.distribution.set_distribution(None)
        loaded = keras.models.load_model(f"{folder}/jax_distributed.keras")
        result["loaded_single_state"] = loaded.optimizer.state_dict()
        single = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01))
        single.load_state_dict(optimizer.state_dict())
        result["state_dict_single"] = single.state_dict()
    keras.distribution.set_distribution(None)
    return result


def main() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    results = {"distributed": trained(True), "single": trained(False), "backend": keras.backend.backend()}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
