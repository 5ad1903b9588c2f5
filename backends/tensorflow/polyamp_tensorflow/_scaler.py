"""The TensorFlow loss scaler: what `polyamp.LossScaler` becomes when it meets TensorFlow tensors.

State lives in non-trainable ``tf.Variable``s created outside any function graph (``tf.init_scope``), so the
first use may happen inside ``tf.function``. ``apply_gradients`` unscales (unless `unscale` already did),
checks for non-finite values, applies or skips with ``tf.cond`` and advances the state with
`polyamp_tensorflow._update.advance`: no Python branch on a tensor value, so it runs eagerly, in
``tf.function`` and with ``jit_compile=True``.

As with torch's ``unscale_``, unscaling is a stage: after `unscale`, the next ``apply_gradients`` takes its
gradients as unscaled (as returned, or clipped/transformed), so nothing is divided twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from polyamp import (
    LossScaleConfig,
    LossScaler,
    LossScaleState,
    ScalerUsageError,
)
from polyamp._src.loss_scaler import wrong_object_error
from polyamp_tensorflow._framework import keras, tf
from polyamp_tensorflow._update import UnscaleTracker, advance, all_finite, refuse_loss_scale_factor, unscale

__all__ = ["TensorFlowLossScaler", "TensorFlowScalerImpl"]


class _Variables:
    """The scaler's state variables (see `polyamp_tensorflow._update.ScaleVariables`)."""

    def __init__(self, state: LossScaleState) -> None:
        with tf.init_scope():  # created eagerly even when first touched inside tf.function
            self.scale = tf.Variable(state.scale, dtype=tf.float32, trainable=False, name="loss_scale")
            self.growth_tracker = tf.Variable(
                state.growth_tracker, dtype=tf.int32, trainable=False, name="growth_tracker"
            )
            self.hysteresis_left = tf.Variable(
                state.hysteresis_left, dtype=tf.int32, trainable=False, name="hysteresis_left"
            )
            self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_steps")
            self.last_skipped = tf.Variable(False, dtype=tf.bool, trainable=False, name="last_skipped")


def _reject(method: str, obj: object, expected: str) -> Exception:
    return wrong_object_error("tensorflow", method, obj, expected)


class TensorFlowScalerImpl:
    """The device form of a polyamp loss scaler for TensorFlow (see the module docstring)."""

    def __init__(self, config: LossScaleConfig, state: LossScaleState, enabled: bool) -> None:
        self._config = config
        self._enabled = enabled
        self._host_state = state
        self._variables: _Variables | None = None
        self._unscaled = UnscaleTracker()
        self._stepped: set[int] = set()

    def _state(self) -> _Variables:
        if self._variables is None:
            self._variables = _Variables(self._host_state)
        return self._variables

    # -- state -------------------------------------------------------------------------------------------

    def get_state(self) -> LossScaleState:
        if self._variables is None:
            return self._host_state
        v = self._variables
        return LossScaleState(float(v.scale.numpy()), int(v.growth_tracker.numpy()), int(v.hysteresis_left.numpy()))

    def set_state(self, config: LossScaleConfig, state: LossScaleState) -> None:
        self._config = config
        self._host_state = state
        if self._variables is not None:
            self._variables.scale.assign(state.scale)
            self._variables.growth_tracker.assign(state.growth_tracker)
            self._variables.hysteresis_left.assign(state.hysteresis_left)

    def get_scale(self) -> float:
        if self._variables is None:
            return self._host_state.scale
        return float(self._variables.scale.numpy())

    # -- the loop ----------------------------------------------------------------------------------------

    def scale(self, loss: Any) -> Any:
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(item) for item in loss)
        if not (tf.is_tensor(loss) or isinstance(loss, tf.Variable)):
            raise _reject("scale", loss, "a TensorFlow tensor (or a list of them)")
        # Like Keras, scale in at least float32: 2**16 is beyond float16's range.
        dtype = tf.float64 if loss.dtype == tf.float64 else tf.float32
        return tf.cast(loss, dtype) * tf.cast(self._state().scale, dtype)

    def unscale(self, grads: list[Any]) -> list[Any]:
        self._check_grads("unscale", grads)
        if not self._enabled:
            return grads
        result = unscale(grads, self._state().scale)
        self._unscaled.record(grads, result)
        return result

    def _check_grads(self, method: str, grads: list[Any]) -> None:
        for grad in grads:
            if grad is not None and not (tf.is_tensor(grad) or isinstance(grad, (tf.IndexedSlices, tf.Variable))):
                raise _reject(method, grad, "TensorFlow tensors (None for variables without a gradient)")

    def apply_gradients(self, optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise _reject("apply_gradients", optimizer, "a Keras 3 optimizer (keras.optimizers.*)")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ScalerUsageError(
                "apply_gradients() received a LossScaleOptimizer, which scales by itself: the gradients would "
                "be unscaled twice. Pass the plain optimizer, or use the LossScaleOptimizer without this scaler."
            )
        refuse_loss_scale_factor(optimizer, "a polyamp LossScaler does the scaling")
        pairs = [tuple(pair) for pair in grads_and_vars]
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        self._check_grads("apply_gradients", grads)
        self._stepped.add(id(optimizer))
        if not self._enabled:
            return optimizer.apply_gradients(pairs)
        state = self._state()
        already_unscaled = self._unscaled.consume(grads, "apply_gradients()")
        if not optimizer.built:  # variables cannot be created inside the cond below
            optimizer.build(variables)
        unscaled = grads if already_unscaled else unscale(grads, state.scale)
        finite = all_finite(unscaled)
        config = self._config

        def apply() -> Any:
            optimizer.apply(unscaled, variables)
            advance(state, False, config)
            return tf.constant(True)

        def skip() -> Any:
            advance(state, True, config)
            return tf.constant(False)

        tf.cond(finite, apply, skip)
        return optimizer.iterations

    # -- what happened -----------------------------------------------------------------------------------

    def step_skipped(self, optimizer: Any = None) -> Any:
        if optimizer is not None and id(optimizer) not in self._stepped:
            raise ScalerUsageError("step_skipped(optimizer): this optimizer has not been stepped by this scaler.")
        if not self._enabled:
            return tf.constant(False)
        if self._variables is None or not self._stepped:
            raise ScalerUsageError("step_skipped() was called before the first apply_gradients().")
        return tf.convert_to_tensor(self._variables.last_skipped)

    def skipped_steps(self) -> Any:
        return tf.convert_to_tensor(self._state().skipped_steps)


class TensorFlowLossScaler(LossScaler):
    """A `polyamp.LossScaler` bound to TensorFlow from construction; same arguments, same methods.

    ``polyamp.LossScaler()`` becomes the same thing on first use with a TensorFlow tensor or Keras optimizer::

        scaler = polyamp_tensorflow.TensorFlowLossScaler()

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled = scaler.scale(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            scaler.apply_gradients(opt, zip(grads, model.trainable_variables))
    """

    bound_backend = "tensorflow"
