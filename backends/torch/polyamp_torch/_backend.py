"""The object polyamp's registry loads for the "torch" backend."""

from __future__ import annotations

from polyamp import LossScaleConfig, LossScaleState
from polyamp_torch._device import TorchDevice

__all__ = ["TorchBackend"]


class TorchBackend:
    """polyamp's PyTorch backend: makes device forms of loss scalers that keep their state in tensors."""

    name = "torch"

    def make_device(self, config: LossScaleConfig, state: LossScaleState) -> TorchDevice:
        return TorchDevice(config, state)
