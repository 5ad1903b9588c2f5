"""`TensorFlowLossScaler`: polyamp's loss scaler bound to TensorFlow from construction."""

from __future__ import annotations

from polyamp import LossScaler

__all__ = ["TensorFlowLossScaler"]


class TensorFlowLossScaler(LossScaler):
    """A `polyamp.LossScaler` bound to TensorFlow from construction; same arguments, same methods.

    Every ``LossScaler`` bound to TensorFlow (also ``polyamp.LossScaler()`` after its first TensorFlow tensor
    or Keras optimizer) has the same methods and semantics; this class only binds up front::

        scaler = polyamp_tensorflow.TensorFlowLossScaler()

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled = scaler.scale(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            scaler.apply_gradients(opt, zip(grads, model.trainable_variables))

    Several optimizers in one iteration: ``scaler.step(opt, zip(grads, vars))`` for each, then one
    ``scaler.update()``.
    """

    bound_backend = "tensorflow"
