"""The spike rule on the device: `polyamp.SpikeRule`'s decision and window as array operations.

The window is a ring of the last ``rule.window`` accepted statistics (``values``), how many were accepted
since the last re-base (``count``) and the spikes since one was accepted (``run``), as a `SpikeWindowArrays`.
`is_spike` and `finish` follow `polyamp.SpikeRule.decide` (the reference) with no branch on an array's
value; the statistics are computed in `statistic_dtype`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from polyamp._src.rules._ops import ArrayOps
from polyamp._src.spikes import SpikeRule

__all__ = ["SpikeWindowArrays", "finish", "grad_norm", "is_spike", "loss_statistic", "statistic_dtype"]


class SpikeWindowArrays(NamedTuple):
    """The spike rule's window as arrays: ``values`` (the ring, of `statistic_dtype`), ``count`` and ``run``
    (integer scalars)."""

    values: Any
    count: Any
    run: Any


def statistic_dtype(ops: ArrayOps) -> str:
    """The dtype of the rule's statistics: float64, or float32 where the namespace computes no float64 (JAX
    without ``jax_enable_x64``)."""
    return "float64" if ops.has_float64 else "float32"


def loss_statistic(ops: ArrayOps, loss: Any) -> Any:
    """The loss as a scalar of `statistic_dtype` (a list or tuple of losses: their sum), without gradient."""
    dtype = statistic_dtype(ops)
    losses = loss if isinstance(loss, (list, tuple)) else [loss]
    return ops.sum(ops.stack([ops.sum(ops.astype(ops.stop_gradient(value), dtype)) for value in losses]))


def grad_norm(ops: ArrayOps, grads: Iterable[Any]) -> Any:
    """The global L2 norm of the gradients (None entries left out) in `statistic_dtype`."""
    dtype = statistic_dtype(ops)
    present = [ops.astype(grad, dtype) for grad in grads if grad is not None]
    return ops.global_norm(present) if present else ops.asarray(0.0, dtype)


def is_spike(ops: ArrayOps, rule: SpikeRule, window: SpikeWindowArrays, x: Any) -> Any:
    """A boolean scalar: whether the statistic ``x`` (of the window's dtype) is a spike.

    Not before ``rule.min_values`` values, not for a non-finite ``x``, not when the window's spread is 0 or
    not finite, and not once ``run`` reached the rule's bound (a level shift, accepted).
    """
    values, count, run = window
    n = ops.minimum(count, ops.full_like(count, rule.window))
    mask = ops.arange_like(rule.window, count) < n
    denominator = ops.astype(ops.maximum(n, ops.full_like(n, 1)), values.dtype)
    zero = ops.zeros_like(values)
    mu = ops.sum(ops.where(mask, values, zero)) / denominator
    sigma = ops.sqrt(ops.sum(ops.where(mask, ops.square(values - mu), zero)) / denominator)
    deviation = x - mu
    if rule.two_sided:
        deviation = ops.abs(deviation)
    checks = [
        n >= rule.min_values,
        ops.isfinite(sigma),
        sigma > 0,
        deviation > sigma * rule.threshold,
        ops.isfinite(x),
    ]
    limit = rule.consecutive_limit
    if limit is not None:
        checks.append(run < limit)
    spike = checks[0]
    for check in checks[1:]:
        spike = ops.logical_and(spike, check)
    return spike


def finish(
    ops: ArrayOps, rule: SpikeRule, window: SpikeWindowArrays, x: Any, spike: Any, overflow: Any = None
) -> tuple[SpikeWindowArrays, Any, Any]:
    """End an iteration for the rule: ``x`` enters the window when the step was applied (neither ``spike``
    nor ``overflow``, boolean scalars; None: not set) and is finite, emptying the window first when ``run``
    reached the rule's bound (a re-base) and setting ``run`` to 0; a skip by the rule alone adds 1 to ``run``.

    Returns:
        The new window, whether the step was skipped by the rule alone, and whether it re-based the window
        (boolean scalars).
    """
    values, count, run = window
    only = spike if overflow is None else ops.logical_and(spike, ops.logical_not(overflow))
    blocked = spike if overflow is None else ops.logical_or(spike, overflow)
    accept = ops.logical_and(ops.logical_not(blocked), ops.isfinite(x))
    limit = rule.consecutive_limit
    if limit is None:
        rebase = ops.logical_and(accept, ops.zeros_like(accept))
    else:
        rebase = ops.logical_and(accept, run >= limit)
    count = ops.where(rebase, ops.zeros_like(count), count)
    at = ops.logical_and(ops.arange_like(rule.window, count) == ops.remainder(count, rule.window), accept)
    new = SpikeWindowArrays(
        ops.where(at, ops.astype(x, values.dtype), values),
        count + ops.astype(accept, count.dtype),
        ops.where(accept, ops.zeros_like(run), run + ops.astype(only, run.dtype)),
    )
    return new, only, rebase
