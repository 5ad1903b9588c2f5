"""Global-norm clipping folded into the unscale on TensorFlow: `LossScaler.unscale_and_clip(grads, clip_norm)`
against `unscale` + ``tf.clip_by_global_norm`` run side by side, eagerly and in ``tf.function``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_tensorflow  # noqa: F401,E402  (registers the backend)

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="Keras runs on another backend")


def _model() -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4)])
    return model


def _batch(step: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(300 + step)
    return rng.standard_normal((16, 8)).astype("float32"), rng.standard_normal((16, 4)).astype("float32")


def _scaled_gradients(scaler: Any, step: int) -> tuple[Any, list[Any]]:
    """A fresh model and its gradients of the scaled loss on batch ``step``."""
    model = _model()
    x, y = _batch(step)
    with tf.GradientTape() as tape:
        scaled = scaler.scale(tf.reduce_mean(tf.square(model(x) - y)))
    return model, tape.gradient(scaled, model.trainable_variables)


def _train(fold: bool, clip_norm: float, compiled: bool, steps: int = 10, inf_at: tuple[int, ...] = (3, 6)) -> Any:
    model = _model()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    scaler = polyamp.LossScaler(enabled=True, init_scale=2.0**10, growth_interval=2)
    norms = []

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
            scaled = scaler.scale(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        if fold:
            clipped, norm = scaler.unscale_and_clip(grads, clip_norm)
        else:
            clipped, norm = tf.clip_by_global_norm(scaler.unscale(grads), clip_norm)
        scaler.step(optimizer, zip(clipped, model.trainable_variables))
        scaler.update()
        return norm

    run = tf.function(step) if compiled else step
    for index in range(steps):
        x, y = _batch(index)
        if index in inf_at:
            x[0, 0] = math.inf
        norms.append(np.asarray(run(tf.constant(x), tf.constant(y))))
    weights = [np.asarray(v.numpy()) for v in model.trainable_variables]
    return weights, norms, float(scaler.get_scale()), [r.skipped for r in scaler.records()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("clip_norm", [0.05, 100.0])  # clipping every step, and never
def test_folded_clip_equals_unscale_then_clip_by_global_norm(clip_norm: float, compiled: bool) -> None:
    ours, ours_norms, ours_scale, ours_skips = _train(True, clip_norm, compiled)
    theirs, their_norms, their_scale, their_skips = _train(False, clip_norm, compiled)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    for a, b in zip(ours_norms, their_norms, strict=True):
        assert (np.isnan(a) and np.isnan(b)) or a.view(np.uint32) == b.view(np.uint32)
    assert ours_scale == their_scale
    assert ours_skips == their_skips and ours_skips[:10] == [i in (3, 6) for i in range(10)]


def test_folded_clip_multiplies_each_gradient_once() -> None:
    scaler = polyamp.LossScaler(enabled=True)
    _, grads = _scaled_gradients(scaler, 0)
    graph = tf.function(lambda g: scaler.unscale_and_clip(g, 1.0)).get_concrete_function(grads).graph
    # element-wise ops over whole gradients: one multiply each, no division (unscale then clip makes two)
    over_tensors = [
        op.type
        for op in graph.get_operations()
        if op.type in ("Mul", "RealDiv", "Div") and op.outputs and op.outputs[0].shape.rank
    ]
    assert over_tensors == ["Mul"] * len(grads)


def test_misuse_is_refused_and_a_disabled_scaler_only_clips() -> None:
    scaler = polyamp.LossScaler(enabled=True)
    model, grads = _scaled_gradients(scaler, 1)
    x, y = _batch(1)
    for bad in (0.0, -1.0, math.nan, "1", True):
        with pytest.raises(polyamp.PolyampError, match="clip_norm"):
            scaler.unscale_and_clip(grads, bad)  # type: ignore[arg-type]
    clipped, _ = scaler.unscale_and_clip(grads, 1.0)
    with pytest.raises(polyamp.ScalerUsageError, match="already unscaled"):
        scaler.unscale_and_clip(clipped, 1.0)
    off = polyamp.LossScaler(enabled=False)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    plain = tape.gradient(loss, model.trainable_variables)
    ours, norm = off.unscale_and_clip(plain, 0.01)
    theirs, their_norm = tf.clip_by_global_norm(plain, 0.01)
    assert np.asarray(norm) == np.asarray(their_norm)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
