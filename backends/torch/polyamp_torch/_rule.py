"""The loss-scale state machine on the device: polyamp's rule as tensor ops, never read to the host.

With the standard rule (dynamic, hysteresis 1, no bounds: `LossScaleConfig.is_standard_rule`) torch's own fused
``_amp_update_scale_`` kernel does the update, and one clamp keeps the scale at polyamp's floor. Otherwise the same rule, plus hysteresis and the min/max
bounds, is a handful of elementwise ops with ``torch.where`` instead of Python branches, so it never
synchronises and traces under ``torch.compile``. Products are formed in float64 and rounded to float32,
as torch's kernel and polyamp's reference do (MPS has no float64; there they are float32 products).
"""

from __future__ import annotations

from polyamp import LossScaleConfig
from polyamp_torch._framework import torch

__all__ = ["DeviceState", "advance"]


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


def _times(scale: torch.Tensor, factor: float) -> torch.Tensor:
    if scale.device.type == "mps":
        return scale * factor
    return (scale.double() * factor).float()


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
    scale, tracker, hysteresis_left = state.scale, state.growth_tracker, state.hysteresis_left
    overflow = found_inf > 0
    next_tracker = tracker + 1
    grow = ~overflow & (next_tracker >= config.growth_interval)
    grown = _times(scale, config.growth_factor)
    if config.max_scale_f32 is not None:
        grown = torch.clamp(grown, max=config.max_scale_f32)
    hysteresis_after = hysteresis_left - 1
    back_off = overflow & (hysteresis_after <= 0)
    backed = torch.clamp(_times(scale, config.backoff_factor), min=config.floor_f32)
    new_scale = torch.where(grow & torch.isfinite(grown), grown, torch.where(back_off, backed, scale))
    refill = back_off | grow
    new_hysteresis = torch.where(refill, config.hysteresis, torch.where(overflow, hysteresis_after, hysteresis_left))
    tracker.copy_(torch.where(overflow | grow, 0, next_tracker))
    hysteresis_left.copy_(new_hysteresis)
    scale.copy_(new_scale)
