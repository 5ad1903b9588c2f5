"""Gradient kernels for the torch scaler: check-and-unscale with torch's fused kernel, fused optimizer steps.

* `unscale_gradients` runs torch's ``_amp_foreach_non_finite_check_and_unscale_`` once per device and dtype
  over an optimizer's gradients (sparse gradients by their values), as ``torch.amp.GradScaler`` does.
* Optimizers that unscale inside their own fused kernel (``_step_supports_amp_scaling``: fused Adam,
  AdamW, SGD, Adagrad) get ``grad_scale`` and ``found_inf`` tensors through `fused_step` and skip on the
  device, with no host sync.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

from polyamp import ScalerUsageError
from polyamp.backend_api import rules
from polyamp_torch._framework import torch
from polyamp_torch._rule import ops_for

__all__ = [
    "PerDevice",
    "fused_amp_capable",
    "fused_step",
    "non_finite_counts",
    "unscale_and_clip_gradients",
    "unscale_gradients",
    "warn_bfloat16_scaling",
]


def non_finite_counts(tensor: torch.Tensor) -> torch.Tensor:
    """How many elements of ``tensor`` are +inf, -inf and NaN (`polyamp.backend_api.rules.non_finite_counts`):
    an int64 tensor of 3, on its device."""
    with torch.no_grad():
        counts: torch.Tensor = rules.non_finite_counts(ops_for(tensor), tensor)
        return counts


class PerDevice:
    """Copies of one tensor on each device that asks for it (model-parallel gradients)."""

    __slots__ = ("copies", "master")

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        copy = self.copies.get(device)
        if copy is None:
            copy = self.master.to(device=device, non_blocking=True, copy=True)
            self.copies[device] = copy
        return copy


_FLOAT16 = torch.float16
_BFLOAT16 = torch.bfloat16


def _gradients_by_device_and_dtype(
    optimizer: Any, *, allow_fp16: bool
) -> tuple[dict[tuple[torch.device, torch.dtype], list[torch.Tensor]], bool]:
    """The optimizer's gradients grouped by (device, dtype) for the fused kernel, and whether any is bfloat16.

    Raises before anything changes when a gradient is float16 and ``allow_fp16`` is False.
    """
    grouped: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    has_bfloat16 = False
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            dtype = grad.dtype
            if dtype is _FLOAT16 and not allow_fp16:
                raise ScalerUsageError(
                    f"Cannot unscale float16 gradients (a parameter of shape {tuple(param.shape)} has a float16 "
                    "gradient). Loss scaling needs float32 master parameters: 1/scale and the unscaled values "
                    "underflow in float16. Keep the parameters in float32 and let polyamp_torch.autocast() run "
                    "the float16 math (the 'mixed_float16' policy), or train with a bfloat16 policy without "
                    "loss scaling. For float16 parameters, wrap the optimizer in polyamp_torch.PrecisionOptimizer "
                    "(e.g. under 'params=float16,compute=float16,state=float32,rounding=kahan'), which forms each "
                    "update in float32."
                )
            if dtype is _BFLOAT16:
                has_bfloat16 = True
            if grad.is_sparse:
                # Duplicate indices of a float16 sparse grad may overflow once summed: check coalesced.
                if dtype is _FLOAT16:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            key = (grad.device, dtype)
            bucket = grouped.get(key)
            if bucket is None:
                grouped[key] = [grad]
            else:
                bucket.append(grad)
    return grouped, has_bfloat16


def warn_bfloat16_scaling(stacklevel: int = 5) -> None:
    """The one warning for loss scaling over bfloat16 gradients."""
    warnings.warn(
        "Loss scaling is enabled but the gradients are bfloat16. bfloat16 has float32's range, so "
        "scaling only costs time (and rounds, for non-power-of-two scales). Construct the LossScaler "
        "with enabled=False, or leave enabled=None under a bfloat16 policy.",
        UserWarning,
        stacklevel=stacklevel,
    )


def unscale_gradients(
    optimizer: Any,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    allow_fp16: bool,
    warn_bfloat16: bool,
    check_unscaled: bool = False,
) -> tuple[torch.Tensor | None, bool]:
    """Multiply the optimizer's gradients by ``inv_scale`` in place and check them for inf/NaN.

    torch's kernel checks the values it is given (the scaled gradients). With ``check_unscaled`` (scales
    below 1, where ``inv_scale > 1`` can overflow a finite value) a second pass checks the unscaled ones.

    Returns the found-inf flag on ``found_inf``'s device (None when no parameter has a gradient) and
    whether bfloat16 gradients were seen (warned about once when ``warn_bfloat16``).
    """
    home = inv_scale.device
    # As torch.no_grad(), at a fraction of the context manager's cost: the kernels write the gradients in place.
    grad_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        if not check_unscaled:
            # The common case: every gradient dense, of one dtype (not float16 or bfloat16), on the device of the
            # caller's fresh tensors. One kernel, nothing else (no call per gradient); any other case is left to
            # `_gradients_by_device_and_dtype`.
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            dtype = grads[0].dtype if grads else _FLOAT16
            if dtype is not _FLOAT16 and dtype is not _BFLOAT16 and home == found_inf.device:
                for grad in grads:
                    if grad.dtype is not dtype or grad.is_sparse or grad.device != home:
                        break
                else:
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
                    return found_inf, False
        grouped, has_bfloat16 = _gradients_by_device_and_dtype(optimizer, allow_fp16=allow_fp16)
        if has_bfloat16 and warn_bfloat16:
            warn_bfloat16_scaling()
        if not grouped:
            return None, has_bfloat16
        per_device_inv_scale = PerDevice(inv_scale)
        per_device_found_inf = PerDevice(found_inf)
        # The caller's fresh tensors serve their own device: no copies on the common single-device path.
        per_device_inv_scale.copies[home] = inv_scale
        per_device_found_inf.copies[found_inf.device] = found_inf
        ones = PerDevice(torch.ones((), dtype=torch.float32, device=home)) if check_unscaled else None
        for (device, dtype), grads in grouped.items():
            if dtype is _BFLOAT16 and device.type != "cpu":
                _check_and_unscale_bfloat16(
                    grads, per_device_found_inf.get(device), per_device_inv_scale.get(device), check_unscaled
                )
                continue
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, per_device_found_inf.get(device), per_device_inv_scale.get(device)
            )
            if ones is not None:  # inverse scale 1: the kernel only checks
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, per_device_found_inf.get(device), ones.get(device)
                )
    finally:
        torch._C._set_grad_enabled(grad_enabled)
    if len(per_device_found_inf.copies) == 1:  # every gradient is on found_inf's device
        return found_inf, has_bfloat16
    devices = {device for device, _ in grouped}
    flags = [flag for device, flag in per_device_found_inf.copies.items() if device in devices]
    if len(flags) == 1:
        return flags[0].to(found_inf.device, non_blocking=True), has_bfloat16
    return torch.stack([flag.to(found_inf.device, non_blocking=True) for flag in flags]).sum(), has_bfloat16


def unscale_and_clip_gradients(
    optimizer: Any,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    max_norm: float,
    norm_type: float,
    *,
    allow_fp16: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool] | None:
    """Unscale and clip ``optimizer``'s gradients in one multiply: the norm of the scaled gradients (one read),
    times ``inv_scale``, gives the norm ``torch.nn.utils.clip_grad_norm_`` would compute after `unscale_gradients`
    and its clip coefficient; the gradients are then multiplied once by ``inv_scale x coefficient``.

    For a power-of-two scale (the default growth and backoff keep it one) every value is bit for bit what
    unscaling then clipping gives, unless squares of gradient elements are subnormal at one scale and not the
    other. The flag is set when the norm is not finite: an inf or NaN gradient, or (the norm of the scaled
    gradients overflowing float32 while each element is finite) a false overflow the scale backs off from.

    Returns ``(flag, total_norm, has_bfloat16)``, flag and norm None without gradients; None (nothing changed)
    for sparse or sharded (DTensor) gradients, float16 gradients, gradients on several devices, or a norm other
    than 2 and inf.
    """
    if norm_type not in (2.0, math.inf):
        return None
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is not None and (grad.is_sparse or hasattr(grad, "to_local")):
                return None
    grouped, has_bfloat16 = _gradients_by_device_and_dtype(optimizer, allow_fp16=allow_fp16)
    if not grouped:
        return None, None, has_bfloat16
    if len({device for device, _ in grouped}) != 1 or next(iter(grouped))[0] != found_inf.device:
        return None
    if any(dtype is _FLOAT16 for _, dtype in grouped):
        return None  # the norm of scaled float16 gradients, kept in float16, would overflow at 65504
    grad_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        norms: list[torch.Tensor] = []
        for grads in grouped.values():
            norms.extend(torch._foreach_norm(grads, norm_type))
        scaled_norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        # Exact for a power-of-two scale; in the norms' dtype, as torch's clip_grad_norm_ computes it.
        total_norm = (scaled_norm * inv_scale).to(scaled_norm.dtype)
        coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        found_inf.copy_(torch.logical_not(torch.isfinite(scaled_norm)).to(found_inf.dtype))
        multiplier = coefficient.to(torch.float32) * inv_scale
        for grads in grouped.values():
            torch._foreach_mul_(grads, multiplier)
    finally:
        torch._C._set_grad_enabled(grad_enabled)
    return found_inf, total_norm, has_bfloat16


def _check_and_unscale_bfloat16(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, check_unscaled: bool
) -> None:
    """``_amp_foreach_non_finite_check_and_unscale_`` for bfloat16 gradients on an accelerator.

    torch's CUDA kernel has no bfloat16 form (its CPU kernel has). The same result on the device, with no host
    read: the largest magnitude of each gradient (inf, or NaN, when any element is) sets ``found_inf`` to 1, then
    one foreach multiply by ``inv_scale`` (rounded to bfloat16 as the CPU kernel rounds it).
    """

    def flag() -> torch.Tensor:
        peaks = torch.stack(torch._foreach_norm(grads, float("inf")))
        return torch.logical_not(torch.isfinite(peaks)).any()

    found_inf.masked_fill_(flag(), 1.0)
    torch._foreach_mul_(grads, inv_scale)
    if check_unscaled:
        found_inf.masked_fill_(flag(), 1.0)


_TAKES_GRAD_SCALER: dict[type, bool] = {}


def takes_grad_scaler(step_type: type) -> bool:
    """Whether an optimizer's ``step`` takes the scaler itself (torch's legacy ``grad_scaler=`` protocol)."""
    # A plain dict cache (not functools.lru_cache) keeps this traceable by torch.compile.
    known = _TAKES_GRAD_SCALER.get(step_type)
    if known is None:
        try:
            known = "grad_scaler" in inspect.signature(step_type.step).parameters  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            known = False
        _TAKES_GRAD_SCALER[step_type] = known
    return known


def fused_amp_capable(optimizer: Any) -> bool:
    """True for optimizers that take ``grad_scale``/``found_inf`` and skip on the device."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and not takes_grad_scaler(type(optimizer))


def _fused_step(
    optimizer: Any, grad_scale: Any, found_inf: torch.Tensor, args: Any, kwargs: Any, binary: bool = False
) -> Any:
    # torch's Optimizer.step breaks the graph twice under torch.compile (pytorch#104053), so the step is
    # never part of a graph; running this block eagerly as one unit keeps the attribute hand-over exact.
    optimizer.grad_scale = grad_scale
    # torch's fused kernels skip only when found_inf == 1.0 and subtract it from the step counters, while a
    # polyamp flag is "set" when > 0: a sum of flags (the guard's check and the spike rule's decision, or
    # several devices' checks) can be 2.0, which would apply the step and count it back. Hand over 0.0 or 1.0
    # (``binary``: ``found_inf`` is one already, as the check kernel writes it).
    optimizer.found_inf = found_inf if binary else (found_inf > 0).to(found_inf.dtype)
    fresh = _fresh_momentum_buffers(optimizer)
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf
        if fresh:
            _clear_skipped_momentum(optimizer, fresh, found_inf)


def _fresh_momentum_buffers(optimizer: Any) -> list[Any]:
    """The parameters of a fused SGD with momentum that get their momentum buffer in this step.

    torch's fused SGD makes a first step's buffers with ``torch.empty_like`` and lets the kernel write them; a
    step the kernel skips (``found_inf`` set) leaves them uninitialised, and the next step, no longer a first
    one, adds the old memory's contents (often NaN) into the parameters. ``torch.amp.GradScaler`` hands its
    flag over the same way (and a first step that overflows is common at the initial scale)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    fresh = []
    for group in optimizer.param_groups:
        if not group.get("momentum"):
            continue
        for param in group["params"]:
            if param.grad is not None and optimizer.state.get(param, {}).get("momentum_buffer") is None:
                fresh.append(param)
    return fresh


def _clear_skipped_momentum(optimizer: Any, params: list[Any], found_inf: torch.Tensor) -> None:
    """Zero the momentum buffers a skipped first step left uninitialised (no host read: a select on the device).
    The next applied step then computes ``momentum * 0 + grad``, the first step's ``grad`` exactly (without
    dampening; with ``dampening`` it is ``(1 - dampening) * grad``, where a true first step takes ``grad``)."""
    for param in params:
        buffer = optimizer.state.get(param, {}).get("momentum_buffer")
        if buffer is None:
            continue
        skipped = found_inf.to(buffer.device, non_blocking=True) > 0
        buffer.copy_(torch.where(skipped, torch.zeros((), dtype=buffer.dtype, device=buffer.device), buffer))


fused_step = torch.compiler.disable(_fused_step)  # type: ignore[no-untyped-call]
