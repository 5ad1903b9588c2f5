"""The loss-scale state on the device and its update, never read to the host.

With the standard rule (dynamic, hysteresis 1, no bounds: `LossScaleConfig.is_standard_rule`) torch's own fused
``_amp_update_scale_`` kernel does the update, and one clamp keeps the scale at polyamp's floor. Otherwise
polyamp's device rule (`polyamp.backend_api.rules.advance`) computes it over `TorchOps`, with no Python branch
on a tensor, so it never synchronises and traces under ``torch.compile`` (MPS has no float64; there the
products are float32 ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyamp import LossScaleConfig
from polyamp.backend_api import rules
from polyamp.backend_api.rules import ArrayOps
from polyamp_torch._framework import torch

__all__ = ["OPS", "DeviceState", "TorchOps", "advance", "ops_for"]

ScaleArrays = rules.ScaleArrays


class DeviceState:
    """The scaler's state tensors on one device: scale (float32), growth tracker and hysteresis (int32)."""

    __slots__ = ("growth_tracker", "hysteresis_left", "scale", "skipped")

    def __init__(self, scale: float, growth_tracker: int, hysteresis_left: int, device: torch.device) -> None:
        self.scale = torch.full((), scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.full((), growth_tracker, dtype=torch.int32, device=device)
        self.hysteresis_left = torch.full((), hysteresis_left, dtype=torch.int32, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)

    def fill(self, scale: float, growth_tracker: int, hysteresis_left: int) -> None:
        self.scale.fill_(scale)
        self.growth_tracker.fill_(growth_tracker)
        self.hysteresis_left.fill_(hysteresis_left)


class TorchOps(ArrayOps):
    """polyamp's array vocabulary over torch: torch's own functions (array-api-compat's torch namespace adds
    type-promotion checks to every call of the eager step), with torch's spelling of the casts."""

    def __init__(self) -> None:
        super().__init__(torch)

    def asarray(self, value: Any, dtype: Any) -> torch.Tensor:
        return torch.tensor(value, dtype=self.dtype(dtype))

    def astype(self, x: torch.Tensor, dtype: Any) -> torch.Tensor:
        return x.to(self.dtype(dtype))

    def arange_like(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(n, dtype=like.dtype, device=like.device)

    def max(self, x: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        return torch.max(x) if axis is None else torch.amax(x, dim=axis, keepdim=True)

    def global_norm(self, arrays: Sequence[torch.Tensor]) -> torch.Tensor:
        """torch's fused per-tensor norms, then the norm of those (on the first tensor's device)."""
        norms = torch._foreach_norm(list(arrays))
        total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(arrays[0].device) for n in norms]))
        return total

    def stop_gradient(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


#: The vocabulary on every device but MPS, which has no float64.
OPS = TorchOps()


class _Float32Ops(TorchOps):
    @property
    def has_float64(self) -> bool:
        return False

    def float64(self) -> None:
        return None


_MPS_OPS = _Float32Ops()


def ops_for(tensor: torch.Tensor) -> TorchOps:
    """The vocabulary for computing on ``tensor``'s device."""
    return _MPS_OPS if tensor.device.type == "mps" else OPS


def advance(state: DeviceState, found_inf: torch.Tensor, config: LossScaleConfig, *, finite: bool = False) -> None:
    """Apply one update of ``config``'s rule in place; ``found_inf`` > 0 means a non-finite gradient.

    ``finite``: the host already read ``found_inf`` as 0. Then the scale can only stay or grow, and the floor
    needs no clamp (the rule applies the floor on back-off only).
    """
    if not config.dynamic:
        return
    if config.is_standard_rule:
        torch._amp_update_scale_(
            state.scale,
            state.growth_tracker,
            found_inf,
            config.growth_factor,
            config.backoff_factor,
            config.growth_interval,
        )
        if not finite:
            state.scale.clamp_(min=config.floor_f32)  # torch's kernel has no floor; polyamp's rule stops at it
        return
    arrays = ScaleArrays(state.scale, state.growth_tracker, state.hysteresis_left)
    new = rules.advance(ops_for(state.scale), config, arrays, found_inf > 0)
    for variable, value in zip(arrays, new, strict=True):
        if value is not variable:
            variable.copy_(value)
