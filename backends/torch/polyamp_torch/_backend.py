"""The object polyamp's registry loads for the "torch" backend."""

from __future__ import annotations

from polyamp import LossScaleConfig, LossScaleState
from polyamp_torch._framework import torch
from polyamp_torch._scaler import TorchScalerImpl

__all__ = ["TorchBackend"]


class TorchBackend:
    """polyamp's PyTorch backend: recognises torch objects and makes device-side loss scalers."""

    name = "torch"

    def owns(self, obj: object) -> bool:
        return isinstance(obj, (torch.Tensor, torch.optim.Optimizer))

    def make_scaler(self, config: LossScaleConfig, state: LossScaleState, enabled: bool) -> TorchScalerImpl:
        return TorchScalerImpl(config, state, enabled)
