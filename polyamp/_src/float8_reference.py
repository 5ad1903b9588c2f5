"""The FP8 reference quantizer: the device rules of `polyamp._src.rules.fp8` run over NumPy and ml_dtypes.

It is what every backend's FP8 casts are tested against, on any machine: the same functions a device calls
with its own `ArrayOps`, here with NumPy's. Importing it imports NumPy and ml_dtypes (``pip install
ml_dtypes``; JAX and TensorFlow install it too); ``import polyamp`` does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from polyamp._src.errors import PolyampValueError
from polyamp._src.float8 import CAST_ROLES
from polyamp._src.rules import fp8
from polyamp._src.rules._ops import ArrayOps

__all__ = ["OPS", "NumpyOps", "current_scale", "delayed_linear", "delayed_step", "linear", "mx_quantize", "quantize"]


class NumpyOps(ArrayOps):
    """polyamp's array vocabulary over NumPy, with ml_dtypes' bfloat16 and FP8 dtypes by name."""

    def __init__(self) -> None:
        super().__init__(np)

    def dtype(self, spec: Any) -> Any:
        if isinstance(spec, str):
            return np.dtype(getattr(ml_dtypes, spec)) if hasattr(ml_dtypes, spec) else np.dtype(spec)
        return spec


#: The reference's vocabulary.
OPS = NumpyOps()


def _format(name: str) -> fp8.Float8Format:
    if name not in fp8.FORMATS:
        raise PolyampValueError(f"An FP8 format is one of {', '.join(map(repr, fp8.FORMATS))}. Received: {name!r}.")
    return fp8.FORMATS[name]


def current_scale(x: Any, fmt: str, *, axis: int | None = None, power_of_two: bool = False) -> np.ndarray:
    """The multiplying scale of current (dynamic) scaling for ``x``: one (shape ``()``) or one per slice
    along ``axis`` (that axis kept with size 1), float32."""
    with np.errstate(all="ignore"):
        return np.asarray(
            fp8.scale_from_amax(OPS, fp8.amax(OPS, np.asarray(x), axis), _format(fmt), power_of_two=power_of_two)
        )


def quantize(x: Any, scale: Any, fmt: str, *, divide: bool = False, dtype: str = "float32") -> np.ndarray:
    """``x`` cast to ``fmt`` (an ml_dtypes array) with a multiplying ``scale`` (or a dequantizing one,
    ``divide=True``), saturating at the format's max; the scaling in ``dtype`` (e.g. ``"bfloat16"``, as
    Keras's float8 layers scale in their compute dtype)."""
    with np.errstate(all="ignore"):
        return np.asarray(fp8.quantize(OPS, np.asarray(x), np.asarray(scale), _format(fmt), divide=divide, dtype=dtype))


def mx_quantize(x: Any, fmt: str, *, block: int = 32, rounding: str = "rceil") -> tuple[np.ndarray, np.ndarray]:
    """``x`` in MX form: the biased E8M0 exponents (uint8) per ``block`` values of the last axis, and the
    values in ``fmt`` (see `polyamp._src.rules.fp8.mx_quantize`)."""
    if rounding not in fp8.MX_ROUNDINGS:
        raise PolyampValueError(
            f"MX rounding is one of {', '.join(map(repr, fp8.MX_ROUNDINGS))}. Received: {rounding!r}."
        )
    with np.errstate(all="ignore"):
        exponents, values = fp8.mx_quantize(OPS, np.asarray(x), _format(fmt), block=block, rounding=rounding)
    return np.asarray(exponents), np.asarray(values)


def delayed_step(
    x: Any, history: Any, scale: Any, fmt: str, *, margin: int = 0, amax_compute: str = "max"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One cast under delayed scaling: ``x`` cast with the stored dequantizing ``scale``, the next scale
    (from ``history`` as it was) and the history with ``x``'s amax pushed, as Keras and Flax do.

    Returns:
        ``(cast, next_scale, next_history)``.
    """
    spec = _format(fmt)
    x = np.asarray(x)
    history = np.asarray(history, np.float32)
    scale = np.asarray(scale, np.float32)
    with np.errstate(all="ignore"):
        cast = fp8.quantize(OPS, x, scale, spec, divide=True)
        next_scale = fp8.delayed_scale(OPS, history, scale, spec, margin=margin, amax_compute=amax_compute)
        next_history = fp8.push_amax(OPS, history, fp8.amax(OPS, x))
    return np.asarray(cast), np.asarray(next_scale, np.float32), np.asarray(next_history)


def _dequantized(x: np.ndarray, fmt: str, recipe: Any, axis: int | None) -> np.ndarray:
    """``x`` cast by ``recipe`` with its own scale (one, or one per slice along ``axis``) and brought back, in
    float64: the operand an FP8 matmul multiplies. MX blocks run along the last axis."""
    if recipe.granularity == "mx":
        columns = x.shape[-1]
        padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -columns % recipe.mx_block)])  # whole blocks
        exponents, cast = mx_quantize(padded, fmt, block=recipe.mx_block, rounding=recipe.mx_rounding)
        # E8M0's 255 is NaN: a block holding a NaN comes back all NaN, as the MX format decodes it.
        exponent = exponents.astype(np.float64)
        scale = np.where(exponents == 255, np.nan, np.exp2(exponent - 127.0)).repeat(recipe.mx_block, axis=-1)
        return (cast.astype(np.float64) * scale)[..., :columns]
    scale = current_scale(x, fmt, axis=axis, power_of_two=recipe.power_of_two)
    return quantize(x, scale, fmt).astype(np.float64) / scale.astype(np.float64)


def linear(x: Any, weight: Any, upstream: Any, recipe: Any) -> dict[str, np.ndarray]:
    """A linear layer ``x @ weight.T`` under a dynamic (current-scaling or MX) recipe, forward and backward:
    the ``"output"``, ``"grad_input"`` and ``"grad_weight"`` (for the gradient ``upstream`` of the output),
    each the float64 product of the FP8 operands brought back, rounded once to float32.

    Each matmul's operands are cast along its contracted axis: the output's input and weight by rows; the
    grad-input's grad-output by rows and weight by columns (by tensor with ``grad_weight_high_precision``);
    the grad-weight's grad-output and input by columns, or in full precision with
    ``grad_weight_high_precision``. A device's result differs from this by its float32 accumulation (and
    torchao's rowwise kernels round to bfloat16): the conformance cases bound that difference.
    """
    x, weight, upstream = (np.asarray(a, np.float32) for a in (x, weight, upstream))
    fx, fw, fg = (recipe.format_of(role) for role in ("input", "weight", "grad_output"))
    rows = recipe.granularity == "row"
    if recipe.granularity == "mx":
        output = _dequantized(x, fx, recipe, None) @ _dequantized(weight, fw, recipe, None).T
        grad_input = _dequantized(upstream, fg, recipe, None) @ _dequantized(weight.T, fw, recipe, None).T
        grad_weight = _dequantized(upstream.T, fg, recipe, None) @ _dequantized(x.T, fx, recipe, None).T
    else:
        along = -1 if rows else None
        output = _dequantized(x, fx, recipe, along) @ _dequantized(weight, fw, recipe, along).T
        by_columns = 0 if rows and not recipe.grad_weight_high_precision else None
        grad_input = _dequantized(upstream, fg, recipe, along) @ _dequantized(weight, fw, recipe, by_columns)
        if recipe.grad_weight_high_precision:
            grad_weight = upstream.T.astype(np.float64) @ x.astype(np.float64)
        else:
            columns = 0 if rows else None
            grad_weight = _dequantized(upstream, fg, recipe, columns).T @ _dequantized(x, fx, recipe, columns)
    return {
        "output": output.astype(np.float32),
        "grad_input": grad_input.astype(np.float32),
        "grad_weight": grad_weight.astype(np.float32),
    }


def delayed_linear(
    xs: Sequence[Any], weight: Any, upstreams: Sequence[Any], recipe: Any, state: dict[str, Any] | None = None
) -> tuple[list[np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Training steps of one linear layer ``x @ weight.T`` under delayed scaling with a fixed weight: each
    step casts its input and the weight in the forward and the output's gradient ``upstream`` in the
    backward, each with its stored scale, then stores the next scale and history (`delayed_step`).

    Args:
        state: Per operand ``(amax_history, scale)`` to start from; None: zeros and a scale of 1.

    Returns:
        Each step's output (the float64 product of the operands brought back, rounded to float32) and the
        state after the last step.
    """
    fresh = (np.zeros(recipe.amax_history_length, np.float32), np.ones((), np.float32))
    current = {role: tuple(np.asarray(v, np.float32) for v in (state or {}).get(role, fresh)) for role in CAST_ROLES}
    outputs = []
    for x, upstream in zip(xs, upstreams, strict=True):
        operands = {}
        for role, value in (("input", x), ("weight", weight), ("grad_output", upstream)):
            history, scale = current[role]
            cast, next_scale, next_history = delayed_step(
                value, history, scale, recipe.format_of(role), margin=recipe.margin, amax_compute=recipe.amax_compute
            )
            operands[role] = cast.astype(np.float64) * scale.astype(np.float64)
            current[role] = (next_history, next_scale)
        outputs.append((operands["input"] @ operands["weight"].T).astype(np.float32))
    return outputs, {role: (history, scale) for role, (history, scale) in current.items()}
