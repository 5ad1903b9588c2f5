"""What polyamp's registry loads for Keras objects: who handles them, and the error for what polyamp's
``LossScaler`` cannot take."""

from __future__ import annotations

from polyamp import LossScaleConfig, LossScaleState, PolyampTypeError
from polyamp_keras._keras import keras

__all__ = ["KerasBackend", "backend_for"]


def backend_for(cls: type) -> str:
    """The polyamp backend that handles Keras objects of type ``cls``: the tensorflow backend while Keras
    runs on TensorFlow (Keras variables and optimizers are TensorFlow's there), else the keras backend."""
    return "tensorflow" if keras.backend.backend() == "tensorflow" else "keras"


class KerasBackend:
    """Keras on JAX or PyTorch: loss scaling goes through `polyamp_keras.LossScaleOptimizer`."""

    name = "keras"

    def make_device(self, config: LossScaleConfig, state: LossScaleState) -> object:
        backend = keras.backend.backend()
        raise PolyampTypeError(
            f"polyamp.LossScaler drives PyTorch and TensorFlow loops; it was handed a Keras object while Keras "
            f"runs on {backend}. With Keras on {backend}, wrap the Keras optimizer in "
            "polyamp_keras.LossScaleOptimizer(optimizer) (same settings and state dicts): optimizer.scale_loss(loss), "
            + (
                "then optimizer.stateless_apply(...) in a jitted step (model.fit does this)."
                if backend == "jax"
                else "backward(), then optimizer.apply(grads, variables) (model.fit does this)."
            )
        )
