"""FP8 cast records in JAX: what the casts of `Float8DotGeneral(record=True)` (any recipe), of
`float8_dot_general(..., counts=...)` and of a function `autocast` made (``float8_counts=``) lost, per layer and
operand.

The counts are float32 digits (`polyamp.backend_api.rules.fp8.add_counts`, ``low + high * 2**23``, exact and
finite as an overwrite-with-gradient value must be): a module keeps them as ``cast_counts`` in the
``_overwrite_with_gradient`` collection beside delayed scaling's state, so they move through ``jax.jit``,
``TrainState.apply_gradients`` and checkpoints as that state does; the functional form threads them as the
user does any state. `float8_records` reads them all in one transfer, in the schema of
``polyamp_torch.record_float8``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from polyamp import PolyampValueError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.records import Float8CastRecord, cast_records
from polyamp.backend_api.rules import fp8
from polyamp_jax._float8 import COUNTS_SHAPE
from polyamp_jax._float8_state import OVERWRITE_WITH_GRADIENT, layer_names, node_at

__all__ = ["float8_records"]

_COUNTS = frozenset({"cast_counts"})


def _counts(value: Any) -> bool:
    return hasattr(value, "shape") and tuple(np.shape(value)) == COUNTS_SHAPE


def float8_records(variables: Mapping[str, Any]) -> dict[str, dict[str, Float8CastRecord]]:
    """Each recording FP8 layer's `polyamp.backend_api.records.Float8CastRecord` per operand (input, weight,
    grad_output): what its casts lost over the training steps since its counts were zero.

    Args:
        variables: A Flax model's variables holding layers built with ``Float8DotGeneral(record=True)`` or
            ``Float8Einsum(record=True)`` (layers named as in `polyamp_jax.float8_state_dict`), or a mapping of
            names to counts: those of `float8_dot_general`, or of a function `polyamp_jax.autocast` made
            (both from `polyamp_jax.float8_counts`). One read from the device for all of them.

    Example:
        ```python
        dot = functools.partial(polyamp_jax.Float8DotGeneral, record=True)
        model = nn.Dense(64, dot_general_cls=dot)
        ...  # train with TrainState
        for layer, roles in polyamp_jax.float8_records(state.params).items():
            print(layer, roles["grad_output"].flushed_fraction, roles["input"].saturated)
        ```

    Raises:
        PolyampValueError: ``variables`` hold no recording layer and are not a mapping of counts.
    """
    if isinstance(variables, Mapping) and OVERWRITE_WITH_GRADIENT not in variables and variables:
        if all(_counts(value) for value in variables.values()):
            names = [str(name) for name in variables]
            return _read(names, list(variables.values()))
    layers = layer_names(variables, _COUNTS)
    if not layers:
        raise PolyampValueError(
            "polyamp_jax.float8_records() reads the counts of FP8 layers built with "
            "Float8DotGeneral(record=True) (functools.partial(polyamp_jax.Float8DotGeneral, record=True) as "
            "dot_general_cls) from the model's variables, or a dict of names to the counts of "
            f"float8_dot_general(..., counts=...). Received: {describe(variables)} without any."
        )
    return _read(list(layers), [node_at(variables, path)["cast_counts"] for path in layers.values()])


def _read(names: list[str], counts: list[Any]) -> dict[str, dict[str, Float8CastRecord]]:
    digits = jax.device_get(counts)
    return cast_records(names, [fp8.counts_from_digits(np.asarray(d, np.float32).tolist()) for d in digits])
