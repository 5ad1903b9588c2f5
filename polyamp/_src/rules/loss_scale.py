"""The loss-scale rule on the device: `polyamp.LossScaleConfig.next_state` as array operations.

Every backend advances its scale with these functions (a fused kernel of the framework's may stand in for
`advance` where it computes the same values: torch's ``_amp_update_scale_`` for the standard rule). They
take and return a `ScaleArrays` of scalars, branch only on the config (host data, fixed when a step is
traced) and never on an array's value, so they run eagerly, under ``jax.jit``, ``tf.function`` and
``torch.compile``. Each product is rounded to float32 from the exact product with the float64 factor, as the
reference does, so trajectories agree bit for bit across frameworks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from polyamp._src.rules._ops import ArrayOps
from polyamp._src.scaling import LossScaleConfig, to_float32

__all__ = [
    "ScaleArrays",
    "advance",
    "after_count",
    "after_finite",
    "after_growth",
    "after_overflow",
    "at_interval",
    "backed_off",
    "count_increments",
    "grown",
    "times",
]


class ScaleArrays(NamedTuple):
    """A loss scaler's state as scalars of a framework: ``scale`` (float32), ``growth_tracker`` and
    ``hysteresis_left`` (integers; their dtypes are kept)."""

    scale: Any
    growth_tracker: Any
    hysteresis_left: Any


def times(ops: ArrayOps, scale: Any, factor: float) -> Any:
    """The float32 ``scale`` times the Python float ``factor``, correctly rounded to float32.

    A float32 product of two float32 values is already the correctly rounded exact product, so only a factor
    that float32 cannot hold exactly takes the float64 product (a float32 one on a device without float64).
    """
    context = None if to_float32(factor) == factor else ops.float64()
    if context is None:
        return scale * factor  # (a Python float takes the array's dtype in every framework)
    with context:
        return ops.astype(ops.astype(scale, "float64") * factor, "float32")


def grown(ops: ArrayOps, config: LossScaleConfig, scale: Any) -> Any:
    """The scale after one growth: times ``growth_factor``, capped at ``max_scale``, kept where the product
    is not finite."""
    product = times(ops, scale, config.growth_factor)
    if config.max_scale_f32 is not None:
        product = ops.minimum(product, ops.full_like(product, config.max_scale_f32))
    return ops.where(ops.isfinite(product), product, scale)


def backed_off(ops: ArrayOps, config: LossScaleConfig, scale: Any) -> Any:
    """The scale after one back-off: times ``backoff_factor``, at least the floor (`LossScaleConfig.floor_f32`)."""
    product = times(ops, scale, config.backoff_factor)
    return ops.maximum(product, ops.full_like(product, config.floor_f32))


def at_interval(ops: ArrayOps, config: LossScaleConfig, state: ScaleArrays) -> Any:
    """True when a finite step grows the scale: the tracker is one short of ``growth_interval``."""
    return state.growth_tracker >= config.growth_interval - 1


def after_overflow(ops: ArrayOps, config: LossScaleConfig, state: ScaleArrays) -> ScaleArrays:
    """The state after a step with a non-finite gradient: the tracker reset, one overflow taken from the
    hysteresis, and a back-off once it is used up."""
    if not config.dynamic:
        return state
    tracker = ops.zeros_like(state.growth_tracker)
    if config.hysteresis == 1:
        return ScaleArrays(backed_off(ops, config, state.scale), tracker, state.hysteresis_left)
    left = state.hysteresis_left - 1
    back_off = left <= 0
    return ScaleArrays(
        ops.where(back_off, backed_off(ops, config, state.scale), state.scale),
        tracker,
        ops.where(back_off, ops.full_like(left, config.hysteresis), left),
    )


def after_growth(ops: ArrayOps, config: LossScaleConfig, state: ScaleArrays) -> ScaleArrays:
    """The state after a finite step at the interval (`at_interval`): grown, the tracker reset, the
    hysteresis refilled."""
    hysteresis = state.hysteresis_left
    if config.hysteresis > 1:
        hysteresis = ops.full_like(hysteresis, config.hysteresis)
    return ScaleArrays(grown(ops, config, state.scale), ops.zeros_like(state.growth_tracker), hysteresis)


def count_increments(config: LossScaleConfig) -> ScaleArrays:
    """What a finite step below the interval adds to each value (one to the tracker, nothing else), as
    numbers: a backend whose variables add in place (``assign_add``) applies them as such."""
    return ScaleArrays(0, 1, 0)


def after_count(ops: ArrayOps, config: LossScaleConfig, state: ScaleArrays) -> ScaleArrays:
    """The state after a finite step below the interval: the step counted (`count_increments`)."""
    increments = count_increments(config)
    return ScaleArrays(*(value + step if step else value for value, step in zip(state, increments, strict=True)))


def after_finite(ops: ArrayOps, config: LossScaleConfig, state: ScaleArrays) -> ScaleArrays:
    """The state after a finite step: `after_growth` at the interval, else `after_count` (selected, with no
    branch)."""
    if not config.dynamic:
        return state
    grow = at_interval(ops, config, state)
    growth = after_growth(ops, config, state)
    counted = after_count(ops, config, state)
    return ScaleArrays(*(_select(ops, grow, a, b) for a, b in zip(growth, counted, strict=True)))


def advance(ops: ArrayOps, config: LossScaleConfig, state: ScaleArrays, overflow: Any) -> ScaleArrays:
    """The state after one step; ``overflow`` is a boolean scalar (a gradient was inf or NaN).

    The select form: both halves are computed and one is chosen per value, with no branch. A backend whose
    branches are cheaper than the few scalar operations of a half (TensorFlow graphs) branches on
    ``overflow`` and `at_interval` and calls `after_overflow`, `after_growth` and `after_count` itself.
    """
    if not config.dynamic:
        return state
    finite = after_finite(ops, config, state)
    overflowed = after_overflow(ops, config, state)
    return ScaleArrays(*(_select(ops, overflow, a, b) for a, b in zip(overflowed, finite, strict=True)))


def _select(ops: ArrayOps, condition: Any, x: Any, y: Any) -> Any:
    return y if x is y else ops.where(condition, x, y)
