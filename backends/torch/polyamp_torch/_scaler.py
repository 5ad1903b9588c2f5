"""`TorchLossScaler`: polyamp's loss scaler bound to PyTorch, a drop-in for ``torch.amp.GradScaler``."""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from polyamp import LossScaler
from polyamp.backend_api.arguments import type_error
from polyamp_torch._framework import torch

__all__ = ["TorchLossScaler"]


class TorchLossScaler(LossScaler):
    """A `polyamp.LossScaler` bound to PyTorch from construction, and a drop-in for ``torch.amp.GradScaler``.

    It takes GradScaler's arguments in GradScaler's order, ``(device, init_scale, growth_factor,
    backoff_factor, growth_interval, enabled)``, and is enabled by default as GradScaler is; polyamp's
    extra settings (``hysteresis``, ``min_scale``, ``max_scale``, ``dynamic``) are keywords. Pass
    ``enabled=None`` to follow polyamp's policy instead, as ``polyamp.LossScaler()`` does by default. Every
    ``LossScaler`` bound to torch (also ``polyamp.LossScaler()`` after its first torch tensor) has the same
    methods and semantics; this class only binds up front (useful for type checkers and ``isinstance``):

        scaler = polyamp_torch.TorchLossScaler("cuda")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)               # optional, e.g. before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                   # skipped if a gradient is inf/NaN
        scaler.update()
        scaler.step_skipped(optimizer)           # bool tensor, no host sync

    Args:
        device: The device type the training runs on ("cuda", "cpu", ...; default: wherever the loss is).
            As with GradScaler, ``"cuda"`` on a machine without CUDA disables the scaler with a warning.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: As ``torch.amp.GradScaler``'s.
        **settings: polyamp's other settings, see `polyamp.LossScaleConfig`.
    """

    _bound_backend = "torch"
    _positional_arguments: ClassVar[tuple[str, ...]] = (
        "device",
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "enabled",
    )
    _default_enabled: ClassVar[bool | None] = True
    _pickled_attributes: ClassVar[tuple[str, ...]] = ("device",)

    def _take_options(self, arguments: dict[str, Any]) -> None:
        device = arguments.pop("device", None)
        if isinstance(device, torch.device):
            device = device.type
        if device is not None and not isinstance(device, str):
            raise type_error(
                "`device`", "None, a device type string such as 'cuda' or 'cpu', or a torch.device", device
            )
        #: The device type given at construction (None: wherever the loss is).
        self.device = None if device is None else device.partition(":")[0]
        if self.device == "cuda" and arguments.get("enabled", True) and not torch.cuda.is_available():
            warnings.warn(
                "TorchLossScaler('cuda') is enabled, but CUDA is not available. Disabling, as "
                "torch.amp.GradScaler does; pass device='cpu' (or leave it out) to scale on the CPU.",
                UserWarning,
                stacklevel=4,
            )
            arguments["enabled"] = False
