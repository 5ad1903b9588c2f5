"""The TensorFlow device form of a loss scaler: `polyamp_keras.KerasDevice` with what is TensorFlow's own.

`polyamp.LossScaler` drives it and decides every step semantic (stages, misuse, skip records). What it adds to
the Keras device form: variables made outside any function graph (``tf.init_scope``), so first use may be
inside ``tf.function``; TensorFlow's tensor types in the checks; a new scale given as a symbolic tensor is
checked in the graph; clipping folded into the unscale with TensorFlow's own global norm. Replicas under
``tf.distribute`` are the Keras device form's (on Keras's TensorFlow backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyamp.backend_api.arguments import wrong_object_error
from polyamp_keras.device import KerasDevice
from polyamp_tensorflow._framework import keras, tf

__all__ = ["TensorFlowDevice"]


class TensorFlowDevice(KerasDevice):
    """polyamp's loss-scaler state in TensorFlow variables, and the device operations of a step."""

    def _make_standalone(self, *, shape: Any, dtype: str, initializer: Any, aggregation: str, name: str) -> Any:
        with tf.init_scope():  # created eagerly even when first touched inside tf.function
            return tf.Variable(initializer(shape, dtype), dtype=dtype, trainable=False, name=name)

    def check_optimizer(self, method: str, optimizer: object) -> None:
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise wrong_object_error("tensorflow", method, optimizer, "a Keras 3 optimizer (keras.optimizers.*)")
        super().check_optimizer(method, optimizer)

    def scale(self, loss: Any) -> Any:
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(item) for item in loss)
        if not (tf.is_tensor(loss) or isinstance(loss, tf.Variable)):
            raise wrong_object_error("tensorflow", "scale", loss, "a TensorFlow tensor (or a list of them)")
        # Like Keras, scale in at least float32: 2**16 is beyond float16's range.
        dtype = tf.float64 if loss.dtype == tf.float64 else tf.float32
        return tf.cast(loss, dtype) * tf.cast(self._state().scale, dtype)

    def check_gradients(self, method: str, grads: Sequence[Any]) -> None:
        for grad in grads:
            if grad is not None and not (tf.is_tensor(grad) or isinstance(grad, (tf.IndexedSlices, tf.Variable))):
                raise wrong_object_error(
                    "tensorflow", method, grad, "TensorFlow tensors (None for variables without a gradient)"
                )

    def _global_norm(self, values: Sequence[Any]) -> Any:
        """TensorFlow's ``tf.linalg.global_norm`` (what ``tf.clip_by_global_norm`` computes)."""
        return tf.linalg.global_norm(list(values))

    def _clip_factor(self, norm: Any, clip_norm: float) -> Any:
        """``tf.clip_by_global_norm``'s factor, op for op: NaN when ``norm`` is not finite."""
        finite = clip_norm * tf.minimum(1.0 / norm, tf.constant(1.0, dtype=norm.dtype) / clip_norm)
        return finite + (norm - norm)

    def plain_apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> Any:
        return optimizer.apply_gradients(zip(grads, variables, strict=True))

    def _checked_scale_tensor(self, value: Any) -> Any:
        if tf.executing_eagerly():
            return value
        # symbolic: the core could not read it, so the graph checks it
        config = self._config
        ok = tf.math.is_finite(value) & (value >= config.floor_f32)
        if config.max_scale_f32 is not None:
            ok &= value <= config.max_scale_f32
        check = tf.debugging.Assert(
            ok,
            [
                "update(new_scale) needs a finite scale within [min_scale, max_scale] = "
                f"[{config.floor_f32!r}, {config.max_scale!r}] (without a min_scale, the floor is 1.0); "
                "the scale was left unchanged. Received:",
                value,
            ],
        )
        with tf.control_dependencies([check]):
            return tf.identity(value)
