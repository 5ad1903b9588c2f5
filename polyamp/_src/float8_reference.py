"""The FP8 reference quantizer: the device rules of `polyamp._src.rules.fp8` run over NumPy and ml_dtypes.

It is what every backend's FP8 casts are tested against, on any machine: the same functions a device calls
with its own `ArrayOps`, here with NumPy's. Importing it imports NumPy and ml_dtypes (``pip install
ml_dtypes``; JAX and TensorFlow install it too); ``import polyamp`` does not.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from polyamp._src.errors import PolyampValueError
from polyamp._src.rules import fp8
from polyamp._src.rules._ops import ArrayOps

__all__ = ["OPS", "NumpyOps", "current_scale", "delayed_step", "mx_quantize", "quantize"]


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
