"""`clip_grad_norm_`: gradient clipping that cannot clip scaled gradients."""

from __future__ import annotations

import numbers
from typing import Any

from polyamp import InvalidConfigError, LossScaler
from polyamp.backend_api.arguments import wrong_object_error
from polyamp_torch._framework import torch

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    scaler: LossScaler, optimizer: Any, max_norm: float | torch.Tensor, norm_type: float = 2.0, **kwargs: Any
) -> Any:
    """``torch.nn.utils.clip_grad_norm_`` over ``optimizer``'s parameters, on unscaled gradients.

    Clipping gradients that are still multiplied by the loss scale clips them to a norm ``scale`` times too
    small: the weights barely move and the loss stays flat, with no error anywhere. This unscales first, then
    clips, and returns the total norm of the unscaled gradients, as torch's function does:

        scaler.scale(loss).backward()
        polyamp_torch.clip_grad_norm_(scaler, opt, 1.0)
        scaler.step(opt)
        scaler.update()

    When this iteration has not unscaled yet, the unscale and the clipping are one pass
    (`polyamp.LossScaler.unscale_and_clip_`): the norm is taken of the scaled gradients and the gradients are
    multiplied once by ``clip_coefficient / scale``, reading them twice instead of three times. For a
    power-of-two scale (what the default growth and backoff keep) the gradients and the norm are bit for bit those
    of ``scaler.unscale_(opt)`` followed by ``torch.nn.utils.clip_grad_norm_``. float16, sparse or sharded gradients,
    several devices, a norm other than 2 or inf, scales below 1, a process group, or ``kwargs``
    (``error_if_nonfinite``, ``foreach``, passed to torch's function) take the two-step path.

    ``max_norm`` takes what torch's function takes: a number (a NumPy scalar too) or a one-element tensor. A
    tensor goes to torch's function as it is (it is not read to the host: the two-step path, its value checked
    only on the CPU).

    With inf or NaN gradients the norm is non-finite and the scaler's step skips, as with ``unscale_`` +
    clipping by hand.
    """
    if not hasattr(optimizer, "param_groups"):
        raise wrong_object_error("torch", "clip_grad_norm_", optimizer, "a torch.optim.Optimizer")
    bound: Any = max_norm
    if isinstance(max_norm, torch.Tensor):
        _check_tensor_bound(max_norm)
    elif isinstance(max_norm, numbers.Real) and not isinstance(max_norm, bool) and max_norm > 0:
        bound = float(max_norm)
    if not scaler.is_unscaled(optimizer):
        if kwargs or isinstance(bound, torch.Tensor):  # torch's own options, or a tensor bound: its function clips
            scaler.unscale_(optimizer)
        else:
            folded, total_norm = scaler.unscale_and_clip_(optimizer, bound, norm_type)
            if folded:
                return torch.tensor(0.0) if total_norm is None else total_norm  # (torch's value without gradients)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    return torch.nn.utils.clip_grad_norm_(parameters, bound, norm_type, **kwargs)


def _check_tensor_bound(max_norm: torch.Tensor) -> None:
    """A tensor ``max_norm``: one element of a real dtype, > 0 where reading it costs nothing (on the CPU)."""
    real = not (max_norm.is_complex() or max_norm.dtype == torch.bool)
    if max_norm.numel() != 1 or not real or (max_norm.device.type == "cpu" and not bool(max_norm.reshape(()) > 0)):
        raise InvalidConfigError(
            "`max_norm` must be a number > 0 or a one-element tensor holding one, as torch's clip_grad_norm_ takes. "
            f"Received: a {str(max_norm.dtype).removeprefix('torch.')} tensor of shape {tuple(max_norm.shape)}"
            + (f" holding {max_norm.reshape(-1)[0].item()!r}." if max_norm.numel() == 1 and real else ".")
        )
