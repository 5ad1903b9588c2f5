"""The training state of Keras optimizers: the hazard of bfloat16/float16 weights updated without a plan, and
the bytes per parameter the state takes, counted from the optimizer's variables.

The hazard is said where every Keras optimizer passes once, when it is built over a model's variables: once
per process, polyamp wraps Keras's ``BaseOptimizer.build`` (the one every optimizer's ``build`` calls through
``super()``); after it, an optimizer stepping bfloat16/float16 variables with no plan of its own (a plain
Keras optimizer, polyamp's `LossScaleOptimizer` around one) gets one `polyamp.TrainingStateWarning`. A
`PrecisionOptimizer` says it for its own plan (under a plan without a master copy that rounds to nearest).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import numpy as np

from polyamp import Policy, PolyampTypeError, PolyampValueError, TrainingStateWarning
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.training_state import ITEMSIZE, MeasuredStateBytes, unplanned_hazard_message
from polyamp_keras._keras import keras

__all__ = ["measure_state_bytes", "warn_unplanned_updates"]

_MARK = "__polyamp_warns_unplanned__"
#: What a plain optimizer does with bfloat16/float16 weights: no master copy, rounding to nearest.
_NO_PLAN = Policy("bfloat16")
_said: weakref.WeakSet[Any] = weakref.WeakSet()


def _dtype(variable: Any) -> str:
    return str(keras.backend.standardize_dtype(variable.dtype))


def _say_once(optimizer: Any, variables: Any) -> None:
    if getattr(type(optimizer), "_polyamp_plans_training_state", False) or optimizer in _said:
        return
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return  # its inner optimizer steps the weights, and says it
    try:
        dtypes = [_dtype(v) for v in variables]
    except (TypeError, AttributeError):  # not a list of variables: Keras's own build reports it
        return
    message = unplanned_hazard_message(type(optimizer).__name__, dtypes, _NO_PLAN)
    if message is not None:
        _said.add(optimizer)
        warnings.warn(TrainingStateWarning(message), stacklevel=4)


def warn_unplanned_updates() -> None:
    """Make every Keras optimizer built over bfloat16/float16 variables without a training-state plan warn
    once (idempotent; see the module's docstring)."""
    base = next(
        (c for c in keras.optimizers.Optimizer.__mro__ if c.__name__ == "BaseOptimizer" and "build" in vars(c)), None
    )
    if base is None:
        return  # a Keras laid out differently: no warning rather than a guess
    original = vars(base)["build"]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def build(self: Any, variables: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, variables, *args, **kwargs)
        _say_once(self, variables)
        return result

    setattr(build, _MARK, True)
    base.build = build


def _bytes(variables: Any) -> int:
    total = 0
    for variable in variables:
        dtype = _dtype(variable)
        size = ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize
        total += int(np.prod(tuple(variable.shape), dtype=np.int64)) * size
    return total


def measure_state_bytes(optimizer: Any) -> MeasuredStateBytes:
    """Count the training state of a built Keras optimizer from its variables.

    Args:
        optimizer: A built Keras optimizer: a plain one, a `PrecisionOptimizer`, or either inside
            `LossScaleOptimizer` (Keras's or polyamp's; the loss scale is not per-parameter state).

    Returns:
        A `MeasuredStateBytes`; ``measure_state_bytes(optimizer).per_parameter`` is the bytes per parameter (AdamW: 10
        under ``"bfloat16_kahan"``, 8 under ``"bfloat16_stochastic"``, 16 under ``"bfloat16_float32_master"``).

    Raises:
        PolyampTypeError: ``optimizer`` is not a Keras optimizer.
        PolyampValueError: it is not built yet (it has no variables to count).
    """
    from polyamp_keras._precision import PrecisionOptimizer

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise PolyampTypeError(f"measure_state_bytes() takes a Keras optimizer. Received: {describe(optimizer)}.")
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if not optimizer.built:
        raise PolyampValueError(
            f"measure_state_bytes() counts a built optimizer's variables; {type(optimizer).__name__} is not built yet. "
            "Call optimizer.build(model.trainable_variables) (model.fit builds it) first."
        )
    trainable = list(optimizer._trainable_variables)
    weights = _bytes(trainable)
    parameters = sum(int(np.prod(tuple(v.shape), dtype=np.int64)) for v in trainable)
    if isinstance(optimizer, PrecisionOptimizer):
        return MeasuredStateBytes(
            parameters,
            weights,
            weights,
            _bytes(optimizer.master_variables),
            _bytes(optimizer.slot_variables),
            _bytes(optimizer.compensation_variables),
        )
    scalars = {id(optimizer._iterations), id(optimizer._learning_rate)}
    slots = [v for v in optimizer.variables if id(v) not in scalars]
    return MeasuredStateBytes(parameters, weights, weights, 0, _bytes(slots), 0)
