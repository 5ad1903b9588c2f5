"""The object polyamp's registry loads for the "tensorflow" backend."""

from __future__ import annotations

from polyamp import LossScaleConfig, LossScaleState
from polyamp_tensorflow._framework import keras, tf
from polyamp_tensorflow._scaler import TensorFlowScalerImpl

__all__ = ["TensorFlowBackend"]


class TensorFlowBackend:
    """polyamp's TensorFlow/Keras 3 backend: recognises TF and Keras objects, makes in-graph loss scalers."""

    name = "tensorflow"

    def owns(self, obj: object) -> bool:
        return tf.is_tensor(obj) or isinstance(obj, (tf.Variable, keras.Variable, keras.optimizers.Optimizer))

    def make_scaler(self, config: LossScaleConfig, state: LossScaleState, enabled: bool) -> TensorFlowScalerImpl:
        return TensorFlowScalerImpl(config, state, enabled)
