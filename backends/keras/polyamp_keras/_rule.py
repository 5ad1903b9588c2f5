"""polyamp's loss-scale rule on Keras variables, and the one holder of those variables.

`ScaleState` holds the state (scale, growth tracker, hysteresis, skip count) for the Keras
`LossScaleOptimizer` on every Keras backend and for the TensorFlow `LossScaler` device form; the functions
advance it with polyamp's device rule (`polyamp.backend_api.rules`) over `KerasOps`, with no Python branch on
a tensor value, so they run eagerly, in ``tf.function`` (also ``jit_compile=True``), under ``jax.jit``
(inside Keras's ``StatelessScope``) and on torch, with the same values as every other backend.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from polyamp import LossScaleConfig, LossScaleState
from polyamp.backend_api import rules
from polyamp.backend_api.rules import ArrayOps
from polyamp_keras._keras import keras

__all__ = [
    "OPS",
    "KerasOps",
    "ScaleState",
    "advance",
    "advance_on_flag",
    "counter_dtype",
    "device_cond",
    "read_scalar",
    "values",
]

ops = keras.ops
ScaleArrays = rules.ScaleArrays

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


class KerasOps(ArrayOps):
    """polyamp's array vocabulary over ``keras.ops``, which runs on every Keras backend (dtypes are Keras's
    names)."""

    def __init__(self) -> None:
        super().__init__(ops)

    def dtype(self, spec: Any) -> str:
        return str(keras.backend.standardize_dtype(spec))

    def asarray(self, value: Any, dtype: Any) -> Any:
        return ops.convert_to_tensor(value, dtype=self.dtype(dtype))

    def astype(self, x: Any, dtype: Any) -> Any:
        return ops.cast(x, self.dtype(dtype))

    def remainder(self, x: Any, y: Any) -> Any:
        return ops.mod(x, y)

    def arange_like(self, n: int, like: Any) -> Any:
        return ops.arange(n, dtype=self.dtype(like.dtype))

    def concat(self, arrays: Sequence[Any]) -> Any:
        return ops.concatenate(list(arrays))

    def stop_gradient(self, x: Any) -> Any:
        return ops.stop_gradient(x)

    def exp2(self, x: Any) -> Any:
        """``2 ** x``, exact at whole ``x`` on every backend: XLA's CPU ``exp2`` (JAX's) gives ``2**25`` as
        33554448, which would make the FP8 rules' power-of-two scales not powers of two."""
        if keras.backend.backend() != "jax":
            return ops.exp2(x)
        return rules.fp8.exp2_exact(sys.modules["jax.numpy"], x)  # Keras's backend here, so imported

    @property
    def has_float64(self) -> bool:
        """False on JAX without ``jax_enable_x64``, which computes float64 arrays in float32."""
        return keras.backend.backend() != "jax" or bool(sys.modules["jax"].config.jax_enable_x64)

    @property
    def has_int64(self) -> bool:
        return self.has_float64

    def float64(self) -> AbstractContextManager[Any]:
        if keras.backend.backend() == "jax":
            return sys.modules["jax"].enable_x64(True)  # type: ignore[no-any-return]  # jax: Keras's backend
        return contextlib.nullcontext()


#: The vocabulary every Keras device computes with.
OPS = KerasOps()


def values(state: ScaleState) -> ScaleArrays:
    """The current values of ``state``'s rule variables."""
    return ScaleArrays(
        ops.convert_to_tensor(state.scale),
        ops.convert_to_tensor(state.growth_tracker),
        ops.convert_to_tensor(state.hysteresis_left),
    )


def _store(state: ScaleState, old: ScaleArrays, new: ScaleArrays) -> None:
    """Assign to ``state``'s variables the values of ``new`` that are not ``old``'s."""
    for variable, before, after in zip(
        (state.scale, state.growth_tracker, state.hysteresis_left), old, new, strict=True
    ):
        if after is not before:
            variable.assign(ops.cast(after, variable.dtype))


def advance(
    state: ScaleState, overflow: bool, config: LossScaleConfig, add: Adder | None = None, *, branch: bool = False
) -> None:
    """One update of ``config``'s rule (`polyamp.backend_api.rules`), for a step that overflowed or not, and
    the skip count.

    ``overflow`` is a Python bool: callers run this inside the two branches of a ``cond`` on the device
    flag, where it is known, so each branch builds only its half of the rule (a few scalar ops). ``add``
    increments a counter (an optimizer's ``assign_add``); None: the variable's own ``assign_add``.

    ``branch``: the finite half branches on the growth test (`rules.at_interval`), so that the steps that do
    not grow (all but one in ``growth_interval``) run only the tracker's count; else it selects, with no
    branch. For a backend whose branch is an operation of the step (TensorFlow), where every operation run
    costs; the values are the same either way. Not under a ``StatelessScope`` (an assignment inside
    a traced branch would leave it) nor where a branch reads its predicate to the host (PyTorch).
    """
    if overflow:
        _increment(state.skipped_steps, add)
    if not config.dynamic:
        return
    old = values(state)
    if overflow:
        _store(state, old, rules.after_overflow(OPS, config, old))
    elif branch:
        _branch_on_growth(state, config, add)
    else:
        _store(state, old, rules.after_finite(OPS, config, old))


def _increment(variable: Any, add: Adder | None, step: int = 1) -> None:
    value = ops.cast(step, variable.dtype)  # int32 on JAX without x64
    if add is None:
        variable.assign_add(value)
    else:
        add(variable, value)


def _grow(state: ScaleState, config: LossScaleConfig) -> Any:
    """The finite half of the rule at the interval (`rules.after_growth`)."""
    old = values(state)
    _store(state, old, rules.after_growth(OPS, config, old))
    return ops.convert_to_tensor(True)


def _count(state: ScaleState, config: LossScaleConfig, add: Adder | None) -> Any:
    """The finite half of the rule below the interval (`rules.after_count`), as additions in place
    (`rules.count_increments`): one ``AssignAddVariableOp`` per counter on TensorFlow, where a Keras variable's
    own ``assign_add`` is a read, an add and an assign."""
    variables = (state.scale, state.growth_tracker, state.hysteresis_left)
    for variable, step in zip(variables, rules.count_increments(config), strict=True):
        if step:
            _increment(variable, add, step)
    return ops.convert_to_tensor(False)


def _at_interval(state: ScaleState, config: LossScaleConfig) -> Any:
    return rules.at_interval(OPS, config, ScaleArrays(None, ops.convert_to_tensor(state.growth_tracker), None))


def _branch_on_growth(state: ScaleState, config: LossScaleConfig, add: Adder | None) -> None:
    """The finite half of `advance` as a branch: grow at the interval, else count the step."""
    ops.cond(_at_interval(state, config), lambda: _grow(state, config), lambda: _count(state, config, add))


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
        # One branch for the common step (finite, below the interval: the count) and one for the rest (an
        # overflow, or growth), instead of a branch on the flag and another on the growth test inside it.
        def rare() -> Any:
            return ops.cond(overflow, on_overflow, lambda: _grow(state, config))

        ops.cond(ops.logical_or(overflow, _at_interval(state, config)), rare, lambda: _count(state, config, add))
        return
    device_cond(overflow, on_overflow, on_finite)


def device_cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """``ops.cond``, except on JAX with a concrete ``pred`` (an eager step): a Python branch there, since
    ``jax.lax.cond`` traces both branches and a variable assigned in one would hold a leaked tracer. Under
    ``jax.jit`` the stateless step computes values, not assignments (see `polyamp_keras.LossScaleOptimizer`)."""
    if keras.backend.backend() == "jax" and not type(pred).__name__.endswith("Tracer"):
        return true_fn() if bool(ops.convert_to_numpy(pred)) else false_fn()
    return ops.cond(pred, true_fn, false_fn)
