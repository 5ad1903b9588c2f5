"""`TensorFlowLossScaler`: polyamp's loss scaler bound to TensorFlow from construction, and trackable."""

from __future__ import annotations

import json
from typing import Any

from polyamp import LossScaler, StateDictError
from polyamp.backend_api.arguments import describe
from polyamp_tensorflow._framework import tf

__all__ = ["TensorFlowLossScaler"]

#: The keys of what a `tf.train.Checkpoint` holds for a scaler (`TensorFlowLossScaler.serialize`).


class TensorFlowLossScaler(LossScaler, tf.train.experimental.PythonState):  # type: ignore[misc]
    """A `polyamp.LossScaler` bound to TensorFlow from construction; same arguments, same methods, and a
    trackable object, so a ``tf.train.Checkpoint`` (and ``tf.train.CheckpointManager``) saves and restores it.

    Every ``LossScaler`` bound to TensorFlow (also ``polyamp.LossScaler()`` after its first TensorFlow tensor
    or Keras optimizer) has the same methods and semantics; this class binds up front and is trackable:

        scaler = polyamp_tensorflow.TensorFlowLossScaler()

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled = scaler.scale(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            scaler.apply_gradients(opt, zip(grads, model.trainable_variables))

        checkpoint = tf.train.Checkpoint(model=model, optimizer=opt, scaler=scaler)

    A checkpoint holds the scaler's `state_dict` (settings, scale, growth tracker, hysteresis, spike window,
    skip count); restoring it loads it as `load_state_dict` does (validated first, all or nothing, between
    iterations only).

    Several optimizers in one iteration: ``scaler.step(opt, zip(grads, vars))`` for each, then one
    ``scaler.update()``.
    """

    _bound_backend = "tensorflow"

    def serialize(self) -> str:
        """What ``tf.train.Checkpoint`` saves: the state dict (the skip count included), as JSON.

        Raises:
            ScalerUsageError: an iteration is in progress (its overflow checks would not be saved).
        """
        self._refuse_mid_iteration("A TensorFlowLossScaler was saved by tf.train.Checkpoint")
        return json.dumps(self.state_dict())

    def deserialize(self, string_value: Any) -> None:
        """Restore what `serialize` saved (``tf.train.Checkpoint.restore``), as `load_state_dict` does.

        Raises:
            StateDictError: the checkpoint's entry is not a scaler's, or its state dict is malformed; the scaler
                is left unchanged.
            ScalerUsageError: an iteration is in progress.
        """
        text = string_value.decode("utf-8") if isinstance(string_value, bytes) else string_value
        try:
            saved = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise StateDictError(
                f"Cannot restore this TensorFlowLossScaler: the checkpoint's entry for it is not the JSON its save "
                f"wrote ({exc}). The scaler was left unchanged."
            ) from exc
        if not isinstance(saved, dict):
            raise StateDictError(
                f"Cannot restore this TensorFlowLossScaler: the checkpoint's entry for it holds {describe(saved)}, "
                "not a state dict. The scaler was left unchanged."
            )
        self.load_state_dict(saved)
