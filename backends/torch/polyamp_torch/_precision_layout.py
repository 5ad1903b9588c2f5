"""The state the optimizer inside a `PrecisionOptimizer` keeps for each parameter, found by running its own step
once on meta tensors, so that a checkpoint is checked against what the next real step will read.

Meta tensors have shapes and dtypes but no memory, and operations on them only compute the result's shape and
dtype: the probe costs no memory and no arithmetic. It runs the inner optimizer's step function itself (not
through ``Optimizer.step``'s hooks, which must not see it) over float32 meta copies of the parameters, each with a
meta gradient, under the checkpoint's hyperparameters, with the fused, foreach, capturable and differentiable
forms turned off (they keep the same keys, shapes and kinds of state). An optimizer whose step cannot run on
meta tensors (one that reads a value to the host, as ASGD and Adafactor do, or that needs sparse gradients)
gives no layout: the checkpoint is then checked by the looser rules of `polyamp_torch._precision_checkpoint`.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from polyamp_torch._framework import torch

__all__ = ["Kept", "state_layout"]

#: The options that pick a kernel rather than the algorithm: off in the probe (the meta device has no fused
#: kernels and cannot be captured).
_KERNEL_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


class Kept(NamedTuple):
    """What the inner optimizer keeps under one key of a parameter's state: a tensor of ``shape``, floating or
    not (``floating``); ``tensor`` False for anything else (None, a number), which is not checked."""

    tensor: bool
    shape: tuple[int, ...] = ()
    floating: bool = False


def _kept(value: object) -> Kept:
    if isinstance(value, torch.Tensor):
        return Kept(True, tuple(value.shape), value.is_floating_point())
    return Kept(False)


def state_layout(
    optimizer: torch.optim.Optimizer, groups: Sequence[dict[str, Any]], values: Sequence[Mapping[str, Any]]
) -> dict[torch.Tensor, dict[str, Kept]] | None:
    """For each parameter of ``groups`` (the optimizer's ``param_groups``), what ``optimizer`` keeps in its state
    after a step under the hyperparameters ``values`` (one mapping per group, without ``"params"``); None when
    its step cannot run on meta tensors. The optimizer is left as it was."""
    probes: list[tuple[torch.Tensor, torch.Tensor]] = []
    probe_groups = []
    for group, given in zip(groups, values, strict=True):
        metas = []
        for param in group["params"]:
            meta = torch.nn.Parameter(torch.empty(param.shape, dtype=torch.float32, device="meta"))
            meta.grad = torch.empty_like(meta)
            metas.append(meta)
            probes.append((param, meta))
        options = {key: False for key in _KERNEL_OPTIONS if group.get(key)}
        probe_groups.append({**group, **given, **options, "params": metas})
    step = type(optimizer).step
    if getattr(step, "hooked", False):  # torch's wrapper running the step hooks: call what it wraps
        step = step.__wrapped__  # type: ignore[attr-defined]
    own_groups, own_state = optimizer.param_groups, optimizer.state
    optimizer.param_groups, optimizer.state = probe_groups, defaultdict(dict)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(optimizer)
        made = optimizer.state
    except Exception:  # any optimizer may fail on meta tensors in its own way: then there is no layout
        return None
    finally:
        optimizer.param_groups, optimizer.state = own_groups, own_state
    return {param: {key: _kept(value) for key, value in made.get(meta, {}).items()} for param, meta in probes}
