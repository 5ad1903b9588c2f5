"""The FP8 cast counts a recorded Keras layer keeps on the device (see `polyamp_keras.record_float8`).

A recorded layer holds ``float8_counts``, a float32 variable of shape ``(3, 3, 2)``: per operand (input, weight,
grad_output) and per count (saturated, flushed, nonzero, `polyamp.backend_api.rules.fp8.cast_counts`) two
integer digits, ``low + high * 2**23`` (`polyamp.backend_api.rules.fp8.add_counts`, exact up to ``2**47``). The
counts reach it as its "gradient" (Keras's ``overwrite_with_gradient``), the previous value plus the step's
counts, since a backward pass cannot write a variable on every Keras backend.
"""

from __future__ import annotations

from typing import Any

from polyamp.backend_api.rules import fp8
from polyamp_keras._keras import keras
from polyamp_keras._rule import OPS

__all__ = ["SHAPE", "delivered"]

ops = keras.ops
#: The variable's shape: operand, count, digit.
SHAPE = (3, 3, 2)


def delivered(previous: Any, rows: dict[int, list[Any]]) -> Any:
    """The "gradient" of a layer's ``float8_counts`` from one custom-gradient op: for each operand index in
    ``rows``, its ``previous`` totals plus the counts found (int32 ``(3,)`` each), and zeros for the others, so
    the ops of one layer call, each delivering its own operands, sum to the new totals."""
    out = []
    for role in range(SHAPE[0]):
        found = rows.get(role)
        if found:
            total = previous[role]
            for counts in found:
                total = fp8.add_counts(OPS, total, counts)
            out.append(total)
        else:
            out.append(ops.zeros_like(previous[role]))
    return ops.stack(out)
