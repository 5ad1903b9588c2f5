"""polyamp's loss-scale rule on Keras variables, and the one holder of those variables.

`ScaleState` holds the state (scale, growth tracker, hysteresis, skip count) for the Keras
`LossScaleOptimizer` on every Keras backend and for the TensorFlow `LossScaler` device form; the functions
apply `polyamp.LossScaleConfig`'s rule to it with Keras ops and no Python branch on a tensor value, so they
run eagerly, in ``tf.function`` (also ``jit_compile=True``), under ``jax.jit`` (inside Keras's
``StatelessScope``) and on torch. Each product is formed in float64 and rounded to float32, as polyamp's
reference and torch's kernel do (on JAX with float64 enabled for that product only, since JAX computes in
float32 by default), so trajectories agree bit for bit across backends.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyamp import LossScaleConfig, LossScaleState
from polyamp.backend_api import to_float32
from polyamp_keras._keras import keras

__all__ = ["ScaleState", "advance", "advance_on_flag", "counter_dtype", "device_cond", "read_scalar"]

ops = keras.ops

#: ``make(name, dtype, initial_value)`` -> a variable with ``assign`` / ``assign_add``.
VariableFactory = Callable[[str, str, Any], Any]
#: ``add(variable, value)``: ``variable += value`` (an optimizer's ``assign_add``).
Adder = Callable[[Any, Any], Any]


@dataclass
class ScaleState:
    """The variables of a loss scaler: ``scale`` (float32), ``growth_tracker`` and ``hysteresis_left``
    (int32), ``skipped_steps`` (int64, iterations with a skipped step)."""

    scale: Any
    growth_tracker: Any
    hysteresis_left: Any
    skipped_steps: Any

    @classmethod
    def create(cls, state: LossScaleState, make: VariableFactory) -> ScaleState:
        """New variables holding ``state`` and a zero skip count, made by ``make``."""
        return cls(
            scale=make("loss_scale", "float32", state.scale),
            growth_tracker=make("growth_tracker", "int32", state.growth_tracker),
            hysteresis_left=make("hysteresis_left", "int32", state.hysteresis_left),
            skipped_steps=make("skipped_steps", counter_dtype(), 0),
        )

    def read(self) -> LossScaleState:
        """The host state (reads the variables)."""
        return LossScaleState(
            float(read_scalar(self.scale)),
            int(read_scalar(self.growth_tracker)),
            int(read_scalar(self.hysteresis_left)),
        )

    def write(self, state: LossScaleState) -> None:
        """Assign ``state`` to the variables (the skip count is kept)."""
        self.scale.assign(state.scale)
        self.growth_tracker.assign(state.growth_tracker)
        self.hysteresis_left.assign(state.hysteresis_left)


def read_scalar(value: Any) -> Any:
    """A scalar variable or tensor as a Python number (via ``.numpy()``: numpy 2 warns on ``np.array`` of TF
    tensors)."""
    tensor = ops.convert_to_tensor(value)
    if hasattr(tensor, "numpy") and keras.backend.backend() == "tensorflow":
        return tensor.numpy().item()
    return ops.convert_to_numpy(tensor).item()


def counter_dtype() -> str:
    """The dtype of the skip counter: int64, or int32 on JAX, which computes in 32 bits by default (asking
    for int64 there only warns and truncates)."""
    if keras.backend.backend() == "jax" and not sys.modules["jax"].config.jax_enable_x64:
        return "int32"
    return "int64"


def _float64() -> Any:
    """A context in which the backend computes float64: JAX turns it off by default (and would silently
    compute the detour below in float32); the other backends have it."""
    if keras.backend.backend() == "jax":
        return sys.modules["jax"].enable_x64(True)  # jax is imported: it is Keras's backend
    return contextlib.nullcontext()


def _times(scale: Any, factor: float) -> Any:
    # A float32 product of two float32 values is the correctly rounded exact product, which is what
    # rounding the float64 product gives; only factors float32 cannot hold exactly need the float64 detour.
    if to_float32(factor) == factor:
        return ops.multiply(scale, ops.cast(factor, "float32"))
    with _float64():
        # The factor as a float64 tensor: a bare Python float would become Keras's floatx (float32) on some
        # backends, rounding the factor before the product.
        product = ops.multiply(ops.cast(scale, "float64"), ops.convert_to_tensor(factor, dtype="float64"))
        return ops.cast(product, "float32")


def advance(
    state: ScaleState, overflow: bool, config: LossScaleConfig, add: Adder | None = None, *, branch: bool = False
) -> None:
    """One update of ``config``'s rule, for a step that overflowed or not, and the skip count.

    ``overflow`` is a Python bool: callers run this inside the two branches of a ``cond`` on the device
    flag, where it is known, so each branch builds only its half of the rule (a few scalar ops). ``add``
    increments a counter (an optimizer's ``assign_add``); None: the variable's own ``assign_add``.

    ``branch``: the finite half branches on the growth test, so that the steps that do not grow (all but
    one in ``growth_interval``) run one increment of the tracker; else it selects, with no branch, every
    step. For a backend whose branch is an operation of the step (TensorFlow), where each operation costs a
    few microseconds; the values are the same either way. Not under a ``StatelessScope`` (an assignment inside
    a traced branch would leave it) nor where a branch reads its predicate to the host (PyTorch).
    """
    if overflow:
        _increment(state.skipped_steps, add)
    if not config.dynamic:
        return
    scale = ops.convert_to_tensor(state.scale)
    if overflow:
        state.growth_tracker.assign(ops.cast(0, "int32"))
        backed = ops.maximum(_times(scale, config.backoff_factor), config.floor_f32)
        if config.hysteresis == 1:
            state.scale.assign(backed)
            return
        hysteresis_after = ops.convert_to_tensor(state.hysteresis_left) - 1
        back_off = hysteresis_after <= 0
        state.scale.assign(ops.where(back_off, backed, scale))
        state.hysteresis_left.assign(ops.where(back_off, config.hysteresis, hysteresis_after))
        return
    if branch:
        _branch_on_growth(state, config, add)
        return
    next_tracker = ops.convert_to_tensor(state.growth_tracker) + 1
    grow = next_tracker >= config.growth_interval
    grown = _grown(scale, config)
    state.scale.assign(ops.where(ops.logical_and(grow, ops.isfinite(grown)), grown, scale))
    # In the tracker's own dtype: Keras's LossScaleOptimizer keeps its step counter in int64, and a round trip
    # through int32 would be two casts per step.
    state.growth_tracker.assign(ops.cast(ops.where(grow, 0, next_tracker), state.growth_tracker.dtype))
    if config.hysteresis > 1:
        state.hysteresis_left.assign(
            ops.cast(ops.where(grow, config.hysteresis, ops.convert_to_tensor(state.hysteresis_left)), "int32")
        )


def _increment(variable: Any, add: Adder | None) -> None:
    one = ops.cast(1, variable.dtype)  # int32 on JAX without x64
    if add is None:
        variable.assign_add(one)
    else:
        add(variable, one)


def _grown(scale: Any, config: LossScaleConfig) -> Any:
    """The scale after a growth: multiplied by the growth factor, capped at ``max_scale``."""
    grown = _times(scale, config.growth_factor)
    return grown if config.max_scale_f32 is None else ops.minimum(grown, config.max_scale_f32)


def _grow(state: ScaleState, config: LossScaleConfig) -> Any:
    """The finite half of `advance` at the interval: the scale multiplied (unless the product is not finite),
    the tracker reset, the hysteresis refilled."""
    scale = ops.convert_to_tensor(state.scale)
    grown = _grown(scale, config)
    state.scale.assign(ops.where(ops.isfinite(grown), grown, scale))
    state.growth_tracker.assign(ops.cast(0, state.growth_tracker.dtype))
    if config.hysteresis > 1:
        state.hysteresis_left.assign(ops.cast(config.hysteresis, "int32"))
    return ops.convert_to_tensor(True)


def _at_interval(state: ScaleState, config: LossScaleConfig) -> Any:
    # tracker + 1 >= interval, without the addition (equal for every integer, and it cannot overflow).
    return ops.greater_equal(state.growth_tracker, config.growth_interval - 1)


def _count(state: ScaleState, add: Adder | None) -> Any:
    """The finite half of `advance` below the interval: the step counted."""
    _increment(state.growth_tracker, add)
    return ops.convert_to_tensor(False)


def _branch_on_growth(state: ScaleState, config: LossScaleConfig, add: Adder | None) -> None:
    """The finite half of `advance` as a branch: grow at the interval, else count the step."""
    ops.cond(_at_interval(state, config), lambda: _grow(state, config), lambda: _count(state, add))


def advance_on_flag(
    state: ScaleState,
    found_inf: Any,
    config: LossScaleConfig,
    add: Adder | None = None,
    *,
    branch: bool = False,
    overflow: Any = None,
) -> None:
    """`advance` decided on the device: ``found_inf`` is a float32 flag (``> 0``: a gradient was non-finite);
    ``overflow``: ``found_inf > 0``, when the caller has it."""

    def on_overflow() -> Any:
        advance(state, True, config, add)
        return ops.convert_to_tensor(True)

    def on_finite() -> Any:
        advance(state, False, config, add)
        return ops.convert_to_tensor(False)

    if overflow is None:
        overflow = ops.greater(found_inf, 0.0)
    if branch and config.dynamic:
        # One branch for the common step (finite, below the interval: one increment) and one for the rest (an
        # overflow, or growth), instead of a branch on the flag and another on the growth test inside it.
        def rare() -> Any:
            return ops.cond(overflow, on_overflow, lambda: _grow(state, config))

        ops.cond(ops.logical_or(overflow, _at_interval(state, config)), rare, lambda: _count(state, add))
        return
    device_cond(overflow, on_overflow, on_finite)


def device_cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """``ops.cond``, except on JAX with a concrete ``pred`` (an eager step): a Python branch there, since
    ``jax.lax.cond`` traces both branches and a variable assigned in one would hold a leaked tracer. Under
    ``jax.jit`` the stateless step computes values, not assignments (see `polyamp_keras.LossScaleOptimizer`)."""
    if keras.backend.backend() == "jax" and not type(pred).__name__.endswith("Tracer"):
        return true_fn() if bool(ops.convert_to_numpy(pred)) else false_fn()
    return ops.cond(pred, true_fn, false_fn)
