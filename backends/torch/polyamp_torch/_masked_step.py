"""A step that is not fused, skipped on the device (``LossScaler(skip_on_device=True)``).

torch's for-loop and foreach optimizers take no found-inf flag, so ``GradScaler`` reads it to the host to decide
whether to call ``optimizer.step()`` (a sync per step on a GPU). Here the optimizer always steps, on a copy of
what it is about to change taken just before, and a masked commit puts the old values back wherever the flag
is set: ``torch.where(skip, old, new)`` into each parameter and state tensor, on the flag's device. A skipped
step leaves the parameters, the moments and the step counters bitwise as they were; an applied one is the
optimizer's own step, untouched. Nothing is read to the host.

Taken only where that holds exactly: `torch.optim.SGD`, `Adam` and `AdamW` (not subclasses, whose step may keep
other state); SGD with momentum past its first step (its momentum buffer starts as a copy of the first gradient,
which a commit cannot restore to "none"), SGD without momentum (it keeps no state) and Adam and AdamW from their
first (their state starts at zeros, which a skipped first step leaves); every parameter and state tensor on the
flag's device (a CUDA Adam that is not capturable keeps its step counts on the CPU, which only a host read can
restore); and no step hooks registered (the optimizer's own or torch's global ones): ``GradScaler`` never calls
``step()`` for a skipped step, so its hooks run only on applied ones, while here a hook would run on a skipped
step too, a post-hook seeing the parameters before the commit restores them (an EMA of the weights taking in a
NaN that stays). Otherwise the caller decides on the host, as ``GradScaler`` does. Cost: a copy of the stepped
parameters and their state per step (transient memory of that size) and one ``where`` per tensor.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from polyamp.backend_api import StepOutcome
from polyamp_torch._framework import torch

__all__ = ["masked_step"]

#: The optimizers whose step changes only their parameters and ``optimizer.state[p]``'s tensors.
_MASKABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
#: torch's module of ``Optimizer``, holding the global step hooks.
_OPTIMIZER_MODULE = importlib.import_module("torch.optim.optimizer")


def _has_step_hooks(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` runs step hooks: the optimizer's own (``register_step_pre_hook``,
    ``register_step_post_hook``) or torch's global ones (``register_optimizer_step_pre_hook``, ...)."""
    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(_OPTIMIZER_MODULE, "_global_optimizer_pre_hooks", None)
        or getattr(_OPTIMIZER_MODULE, "_global_optimizer_post_hooks", None)
    )


def _stepped(optimizer: Any, device: torch.device) -> list[tuple[torch.Tensor, dict[str, Any]]] | None:
    """The parameters the step will change, each with its state (empty: the step makes it); None where the
    commit could not be exact."""
    stepped = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.device != device:
                return None
            state = optimizer.state.get(param)
            if not state:
                # A first step makes the state. Adam's and AdamW's start at zeros (step count included), which a
                # commit can put back, and their step count goes on the parameter's device only when capturable.
                # SGD with momentum starts its buffer as a copy of the first gradient, which a commit cannot put
                # back; SGD without momentum keeps no state at all.
                if type(optimizer) is torch.optim.SGD:
                    if group["momentum"] != 0:
                        return None
                elif not (device.type == "cpu" or group.get("capturable")):
                    return None
                state = {}
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device != device:
                    return None
            stepped.append((param, state))
    return stepped or None


def masked_step(
    optimizer: Any, found_inf: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> StepOutcome | None:
    """``optimizer.step(*args, **kwargs)``, undone on the device where ``found_inf > 0``; None (nothing done)
    where that cannot be exact."""
    if type(optimizer) not in _MASKABLE or _has_step_hooks(optimizer):
        return None
    stepped = _stepped(optimizer, found_inf.device)
    if stepped is None:
        return None
    with torch.no_grad():  # each parameter and state tensor the step was given, beside a copy of its values
        saved = [
            (
                param,
                param.clone(),
                {key: (value, value.clone()) for key, value in state.items() if torch.is_tensor(value)},
            )
            for param, state in stepped
        ]
    result = optimizer.step(*args, **kwargs)
    with torch.no_grad():
        skip = found_inf > 0
        for param, old_param, old_state in saved:
            torch.where(skip, old_param, param, out=param)
            state = optimizer.state[param]
            for key, now in list(state.items()):
                if not torch.is_tensor(now):
                    continue
                given, old = old_state.get(key, (now, None))
                if old is None:  # state the step made: back to its start, zeros
                    old = torch.zeros_like(now)
                if now is given:
                    torch.where(skip, old, now, out=now)
                else:  # the step put a new tensor there
                    state[key] = torch.where(skip, old, now)
    return StepOutcome(result, found_inf, None)
