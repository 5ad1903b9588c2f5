"""The FP8 cast counts a recorded Keras layer keeps on the device (see `polyamp_keras.record_float8`).

A recorded layer holds ``float8_counts``, a float32 variable of shape ``(3, 3, 2)``: per operand (input, weight,
grad_output) and per count (saturated, flushed, nonzero, `polyamp.backend_api.rules.fp8.cast_counts`) two
integer digits, ``low + high * 2**23``. The counts reach it as its "gradient" (Keras's
``overwrite_with_gradient``), the previous value plus the step's counts, since a backward pass cannot write a
variable on every Keras backend; float32 holds every integer below ``2**24`` exactly, and the digits keep each
sum below that, so the totals stay exact up to ``2**47``.
"""

from __future__ import annotations

from typing import Any

from polyamp_keras._keras import keras

__all__ = ["DIGIT", "SHAPE", "delivered"]

ops = keras.ops
#: The base of the two digits: a digit below it plus a step's low digit stays below ``2**24``.
DIGIT = 2**23
#: The variable's shape: operand, count, digit.
SHAPE = (3, 3, 2)


def _added(digits: Any, counts: Any) -> Any:
    """``digits`` (``(3, 2)``: a total per count) plus ``counts`` (three int32 counts), carried."""
    counts = ops.cast(counts, "int32")
    low = digits[:, 0] + ops.cast(ops.mod(counts, DIGIT), "float32")
    carry = ops.cast(low >= DIGIT, "float32")
    high = digits[:, 1] + ops.cast(ops.floor_divide(counts, DIGIT), "float32") + carry
    return ops.stack([low - carry * DIGIT, high], axis=-1)


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
                total = _added(total, counts)
            out.append(total)
        else:
            out.append(ops.zeros_like(previous[role]))
    return ops.stack(out)
