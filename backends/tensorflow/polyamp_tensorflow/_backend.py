"""The object polyamp's registry loads for the "tensorflow" backend."""

from __future__ import annotations

from polyamp import LossScaleConfig, LossScaleState
from polyamp_tensorflow._device import TensorFlowDevice

__all__ = ["TensorFlowBackend"]


class TensorFlowBackend:
    """polyamp's TensorFlow/Keras 3 backend: makes device forms of loss scalers that keep their state in
    ``tf.Variable``s and decide in the graph."""

    name = "tensorflow"

    def make_device(self, config: LossScaleConfig, state: LossScaleState) -> TensorFlowDevice:
        return TensorFlowDevice(config, state)
