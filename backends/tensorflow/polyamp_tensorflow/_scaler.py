"""`TensorFlowLossScaler`: polyamp's loss scaler bound to TensorFlow from construction, and trackable."""

from __future__ import annotations

import json
from typing import Any

from polyamp import LossScaler, StateDictError
from polyamp.backend_api.arguments import describe
from polyamp_tensorflow._framework import tf

__all__ = ["TensorFlowLossScaler"]

#: The keys of what a `tf.train.Checkpoint` holds for a scaler (`TensorFlowLossScaler.serialize`).
_SAVED_KEYS = ("state_dict", "skipped_steps")


class TensorFlowLossScaler(LossScaler, tf.train.experimental.PythonState):  # type: ignore[misc]
    """A `polyamp.LossScaler` bound to TensorFlow from construction; same arguments, same methods, and a
    trackable object, so a ``tf.train.Checkpoint`` (and ``tf.train.CheckpointManager``) saves and restores it.

    Every ``LossScaler`` bound to TensorFlow (also ``polyamp.LossScaler()`` after its first TensorFlow tensor
    or Keras optimizer) has the same methods and semantics; this class binds up front and is trackable::

        scaler = polyamp_tensorflow.TensorFlowLossScaler()

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled = scaler.scale(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            scaler.apply_gradients(opt, zip(grads, model.trainable_variables))

        checkpoint = tf.train.Checkpoint(model=model, optimizer=opt, scaler=scaler)

    A checkpoint holds the scaler's `state_dict` (settings, scale, growth tracker, hysteresis, spike window)
    and its count of skipped steps; restoring it loads them as `load_state_dict` does (validated first, all or
    nothing, between iterations only) and sets the count.

    Several optimizers in one iteration: ``scaler.step(opt, zip(grads, vars))`` for each, then one
    ``scaler.update()``.
    """

    bound_backend = "tensorflow"

    def serialize(self) -> str:
        """What ``tf.train.Checkpoint`` saves: the state dict and the count of skipped steps, as JSON.

        Raises:
            ScalerUsageError: an iteration is in progress (its overflow checks would not be saved).
        """
        self._refuse_mid_iteration("A TensorFlowLossScaler was saved by tf.train.Checkpoint")
        return json.dumps({"state_dict": self.state_dict(), "skipped_steps": self._device.saved_skip_count()})

    def deserialize(self, string_value: Any) -> None:
        """Restore what `serialize` saved (``tf.train.Checkpoint.restore``).

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
        count = saved.get("skipped_steps") if isinstance(saved, dict) else None
        if not isinstance(saved, dict) or sorted(saved) != sorted(_SAVED_KEYS):
            raise StateDictError(
                f"Cannot restore this TensorFlowLossScaler: the checkpoint's entry for it holds {describe(saved)}, "
                f"not an object with the keys {list(_SAVED_KEYS)}. The scaler was left unchanged."
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise StateDictError(
                "Cannot restore this TensorFlowLossScaler: 'skipped_steps' must be an int >= 0. Received: "
                f"{describe(count)}. The scaler was left unchanged."
            )
        self.load_state_dict(saved["state_dict"])
        self._device.restore_skip_count(count)
