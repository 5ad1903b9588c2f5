"""FP8 cast records of a Flax model: what `Float8DotGeneral(record=True)`'s casts lost, per layer and operand.

The counts live in the ``_overwrite_with_gradient`` collection beside delayed scaling's state (``cast_counts``,
float32 limbs ``high * 2**24 + low`` that stay exact and finite as the collection's "gradients" must), so they
move through ``jax.jit``, ``TrainState.apply_gradients`` and checkpoints as the state does. `float8_records`
reads them all in one transfer, in the schema of ``polyamp_torch.record_float8``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from polyamp import PolyampValueError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.records import Float8CastRecord, cast_records
from polyamp_jax._float8_state import layer_names, node_at

__all__ = ["float8_records"]

_COUNTS = frozenset({"cast_counts"})


def float8_records(variables: Mapping[str, Any]) -> dict[str, dict[str, Float8CastRecord]]:
    """Each recording FP8 layer's `polyamp.backend_api.records.Float8CastRecord` per operand (input, weight,
    grad_output): what its casts lost over the training steps since its counts were zero (``model.init``).
    Layers are named as in `polyamp_jax.float8_state_dict`; one read from the device for all of them.

    Example:
        ```python
        dot = functools.partial(polyamp_jax.Float8DotGeneral, record=True)
        model = nn.Dense(64, dot_general_cls=dot)
        ...  # train with TrainState
        for layer, roles in polyamp_jax.float8_records(state.params).items():
            print(layer, roles["grad_output"].flushed_fraction, roles["input"].saturated)
        ```

    Raises:
        PolyampValueError: ``variables`` hold no layer built with ``record=True``.
    """
    layers = layer_names(variables, _COUNTS)
    if not layers:
        raise PolyampValueError(
            "polyamp_jax.float8_records() reads the counts of FP8 layers built with "
            "Float8DotGeneral(record=True) (functools.partial(polyamp_jax.Float8DotGeneral, record=True) as "
            f"dot_general_cls), from the model's variables. Received: {describe(variables)} without any."
        )
    limbs = jax.device_get([node_at(variables, path)["cast_counts"] for path in layers.values()])
    counts = [
        (np.asarray(value, np.float32).astype(np.int64) @ np.array([1 << 24, 1], np.int64)).tolist() for value in limbs
    ]
    return cast_records(list(layers), counts)
