"""The FP8 device rules, written once over `ArrayOps`: scales from amaxes, saturating casts, MX block scales,
delayed scaling's amax history, and the counts the records keep.

Every backend computes its FP8 casts with these functions and its own `ArrayOps`; the reference quantizer
(`polyamp._src.float8_reference`) is the same functions over NumPy and ml_dtypes. The arithmetic follows
the libraries it must equal bit for bit:

* current scaling (`scale_from_amax`, `quantize`) is torchao's ``tensor_to_scale`` / ``to_fp8_saturated``:
  ``scale = max / max(amax, 1e-12)`` rounded to float32 (torchao divides in float64; a float32 division
  rounds the same, so no device needs float64), optionally rounded down to a power of two as
  ``exp2(floor(log2(scale)))``, and the value cast as ``clip(x * scale, -max, max)``;
* MX (`mx_quantize`) is torchao's ``to_mx``: one E8M0 exponent per 32 values, the block's largest magnitude
  rounded down (``"floor"``, the OCP rule), up (``"ceil"``) or its ratio to the format's max rounded up
  (``"rceil"``, cuBLAS and Transformer Engine). The exponents are exact here (no ``log2`` rounding decides
  them), which torchao's ``"rceil"`` computes with a float32 ``log2`` off Blackwell GPUs;
* delayed scaling (`delayed_scale`, `push_amax`) is Keras's ``compute_float8_scale`` /
  ``compute_float8_amax_history`` and Flax's ``fp8_ops``: the stored scale is the dequantizing one
  (``amax / max``), the value is cast as ``clip(x / scale, -max, max)``, and an amax of 0 or inf keeps the
  previous scale (here also an amax below ``max * 2**-126``, where those two store a scale of 0).

No finite input gives a non-finite scale or cast: an amax of 0 gives the scale of an amax of 1e-12, values
past the format's max saturate to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from polyamp._src.rules._ops import ArrayOps
from polyamp._src.scaling import to_float32

__all__ = [
    "AMAX_EPSILON",
    "COUNT_DIGIT",
    "FORMATS",
    "MX_ROUNDINGS",
    "Float8Format",
    "add_counts",
    "add_digits",
    "amax",
    "cast_counts",
    "counts_from_digits",
    "delayed_scale",
    "exp2_exact",
    "mx_dequantize",
    "mx_quantize",
    "mx_scaled",
    "push_amax",
    "quantize",
    "saturating_cast",
    "scale_from_amax",
    "scaled",
]


@dataclass(frozen=True)
class Float8Format:
    """An 8-bit floating format: its short name, its dtype name (torch, JAX, ml_dtypes and Keras spell it
    alike), its largest finite value and the exponent of the largest power of two below that value."""

    name: str
    dtype: str
    max: float
    max_pow2: int


#: The formats of FP8 training, by their short names (OCP's E4M3 without infinities, and E5M2).
FORMATS: Final = {
    "e4m3": Float8Format("e4m3", "float8_e4m3fn", 448.0, 8),
    "e5m2": Float8Format("e5m2", "float8_e5m2", 57344.0, 15),
}

#: The smallest amax a scale is computed from (torchao's ``EPS``): an all-zero tensor gets a finite scale.
AMAX_EPSILON: Final = 1e-12
_EPSILON_F32: Final = to_float32(AMAX_EPSILON)  # just below 1e-12: amax <= it exactly when amax < 1e-12
_MIN_NORMAL: Final = 2.0**-126
_E8M0_BIAS: Final = 127
# The scale of an amax of 1e-12 per format, rounded to float32 once (no host arithmetic while tracing).
_AT_EPSILON: Final = {fmt.name: to_float32(fmt.max / AMAX_EPSILON) for fmt in FORMATS.values()}
_MAX_FACTOR: Final = 2.0**126  # the largest quantizing factor whose reciprocal (the stored scale) is normal

#: How an MX block's shared exponent is rounded (see `mx_quantize`).
MX_ROUNDINGS: Final = ("floor", "ceil", "rceil")


def _divide(ops: ArrayOps, number: float, x: Any) -> Any:
    """``number / x`` correctly rounded: array by array (torch computes a Python number divided by a tensor
    as the number times the tensor's reciprocal, which can be one unit in the last place away)."""
    return ops.full_like(x, number) / x


def amax(ops: ArrayOps, x: Any, axis: int | None = None) -> Any:
    """The largest magnitude of ``x`` as float32: of the whole array, or along ``axis`` (kept, size 1)."""
    return ops.astype(ops.max(ops.abs(x), axis), "float32")


def scale_from_amax(
    ops: ArrayOps, amax_: Any, fmt: Float8Format, *, power_of_two: bool = False, margin: int = 0
) -> Any:
    """The multiplying scale (float32) that maps ``amax_`` to the format's max.

    ``max / amax`` with amax at least `AMAX_EPSILON`, divided by ``2 ** margin``; with ``power_of_two``
    rounded down to a power of two as torchao does (``exp2(floor(log2(scale)))`` in float32, which takes a
    scale within a few units in the last place below ``2**k`` to ``2**k``; the saturating cast keeps the
    values finite then).
    """
    at_epsilon = _AT_EPSILON.get(fmt.name) or to_float32(fmt.max / AMAX_EPSILON)
    tiny = amax_ <= _EPSILON_F32
    quotient = _divide(ops, fmt.max, ops.where(tiny, ops.full_like(amax_, 1.0), amax_))
    scale = ops.where(tiny, ops.full_like(amax_, at_epsilon), quotient)
    if margin:
        scale = scale / float(2**margin)
    if power_of_two:
        scale = ops.exp2(ops.floor(ops.log2(scale)))
    return scale


def scaled(ops: ArrayOps, x: Any, scale: Any, *, divide: bool = False, dtype: str = "float32") -> Any:
    """``x`` in float32 times ``scale`` (current scaling), or divided by it (delayed scaling's stored
    dequantizing scale).

    ``dtype`` names another dtype both are cast to first: Keras's ``quantize("float8")`` layers scale in
    their compute dtype (bfloat16 under ``"mixed_bfloat16"``), which rounds differently from float32.
    """
    if dtype == "float32":
        wide = ops.astype(x, "float32")
    else:
        wide, scale = ops.astype(x, dtype), ops.astype(scale, dtype)
    return wide / scale if divide else wide * scale


def saturating_cast(ops: ArrayOps, values: Any, fmt: Float8Format) -> Any:
    """``values`` clamped to the format's range, then cast to it (NaN stays NaN)."""
    return ops.astype(ops.clip(values, -fmt.max, fmt.max), fmt.dtype)


def quantize(
    ops: ArrayOps, x: Any, scale: Any, fmt: Float8Format, *, divide: bool = False, dtype: str = "float32"
) -> Any:
    """``x`` cast to ``fmt`` with ``scale``: `scaled` (in ``dtype``), then `saturating_cast`."""
    return saturating_cast(ops, scaled(ops, x, scale, divide=divide, dtype=dtype), fmt)


def cast_counts(ops: ArrayOps, x: Any, values: Any, cast: Any, fmt: Float8Format) -> Any:
    """What a cast lost, as three int32 counts: the values past the format's max (saturated), the nonzero
    values that became zero (flushed), and the nonzero values.

    Args:
        ops: The array vocabulary.
        x: The values before scaling.
        values: ``x`` scaled (`scaled`).
        cast: The cast of ``values`` (`saturating_cast`).
        fmt: The format cast to.
    """
    magnitude = ops.abs(values)
    saturated = ops.logical_and(magnitude > fmt.max, ops.isfinite(magnitude))
    nonzero = x != 0
    flushed = ops.logical_and(nonzero, ops.astype(cast, "float32") == 0)
    return ops.stack([ops.sum(ops.astype(found, "int32")) for found in (saturated, flushed, nonzero)])


# -- cast counts kept as two float32 digits --------------------------------------------------------------------

#: The base of the two digits cast counts are kept in on a device (``low + high * COUNT_DIGIT``, each digit a
#: float32 whole number below it): a digit plus a step's low digit stays below ``2**24``, where float32 holds
#: every integer exactly, so the totals stay exact up to ``2**47``.
COUNT_DIGIT: Final = 2**23


def add_counts(ops: ArrayOps, digits: Any, counts: Any) -> Any:
    """``digits`` plus ``counts``, carried: the new digits.

    Counts that reach a variable as its "gradient" (Keras's ``overwrite_with_gradient``, Flax's
    ``_overwrite_with_gradient`` collection) must be finite floats; two float32 digits keep them exact.

    Args:
        ops: The array vocabulary.
        digits: float32 of shape ``counts.shape + (2,)``: ``[..., 0]`` the low digit, ``[..., 1]`` the high
            one, each a whole number in ``[0, COUNT_DIGIT)`` (the high one below ``2**24``).
        counts: Non-negative int32 counts (`cast_counts`).

    Returns:
        float32 digits of the same shape holding ``low + high * COUNT_DIGIT + counts``, exact while the total
        stays below ``2**47``.
    """
    counts = ops.astype(counts, "int32")
    low_part = ops.remainder(counts, COUNT_DIGIT)
    # a multiple of 2**23 below 2**31 is exact in float32, so is its quotient by 2**23
    high_part = ops.astype(counts - low_part, "float32") / float(COUNT_DIGIT)
    low = digits[..., 0] + ops.astype(low_part, "float32")
    carry = ops.astype(low >= float(COUNT_DIGIT), "float32")
    high = digits[..., 1] + high_part + carry
    return ops.stack([low - carry * float(COUNT_DIGIT), high], axis=-1)


def add_digits(ops: ArrayOps, digits: Any, more: Any) -> Any:
    """``digits`` plus ``more``, both in `add_counts`'s two digits, carried: the new digits.

    ``more`` may be a sum of several `add_counts` results (the counts of one layer's products, added up by
    the backward pass when the layer runs more than once in a step), whose low digit may pass
    ``COUNT_DIGIT``: it is carried first, so the result is exact whenever ``more`` is (a float32 sum of
    whole numbers is exact below ``2**24``: always for the digits of one or two products).
    """

    def carried(low: Any) -> tuple[Any, Any]:
        carry = ops.floor(low / float(COUNT_DIGIT))  # a power of two: the quotient is exact
        return low - carry * float(COUNT_DIGIT), carry

    more_low, more_carry = carried(more[..., 0])
    low, carry = carried(digits[..., 0] + more_low)  # both below 2**23: the sum is exact
    high = digits[..., 1] + more[..., 1] + more_carry + carry
    return ops.stack([low, high], axis=-1)


def counts_from_digits(digits: Sequence[Any]) -> list[Any]:
    """The integers that nested lists of digit pairs (``[low, high]``, as `add_counts` keeps them, read to
    the host with ``tolist()``) hold, in the same nesting."""
    return [
        int(item[0]) + int(item[1]) * COUNT_DIGIT
        if len(item) == 2 and not isinstance(item[0], Sequence)
        else counts_from_digits(item)
        for item in digits
    ]


# -- MX: 32-value blocks sharing an E8M0 exponent ------------------------------------------------------------


def _floor_log2(ops: ArrayOps, m: Any) -> Any:
    """``floor(log2(m))`` exactly, as float32, for finite normal ``m`` (a float32 ``log2`` may round a value
    just below ``2**k`` up to ``k``; the two comparisons with exact powers of two correct that)."""
    e = ops.floor(ops.log2(ops.maximum(m, ops.full_like(m, _MIN_NORMAL))))
    e = ops.where(ops.exp2(e) > m, e - 1.0, e)
    return ops.where(ops.exp2(e + 1.0) <= m, e + 1.0, e)


def _float32_exponent(ops: ArrayOps, m: Any) -> Any:
    """The unbiased exponent field of float32 ``m >= 0``: ``floor(log2(m))`` for normal values, -127 for zero
    and subnormals, 128 for inf and NaN."""
    finite = ops.isfinite(m)
    safe = ops.where(finite, m, ops.full_like(m, 1.0))
    e = ops.where(safe < _MIN_NORMAL, ops.full_like(m, -127.0), _floor_log2(ops, safe))
    return ops.where(finite, e, ops.full_like(m, 128.0))


def mx_quantize(
    ops: ArrayOps, x: Any, fmt: Float8Format, *, block: int = 32, rounding: str = "rceil"
) -> tuple[Any, Any]:
    """``x`` in MX form: one biased E8M0 exponent (uint8) per ``block`` values along the last axis, and the
    values cast to ``fmt`` with it (torchao's ``to_mx``, its scaling modes ``FLOOR``, ``CEIL``, ``RCEIL``).

    Returns:
        ``(exponents, values)``: exponents of shape ``x.shape[:-1] + (x.shape[-1] // block,)`` (255 for a
        block holding NaN), values of ``x``'s shape in ``fmt``.
    """
    exponents, values = mx_scaled(ops, x, fmt, block=block, rounding=rounding)
    return exponents, saturating_cast(ops, values, fmt)


def mx_scaled(ops: ArrayOps, x: Any, fmt: Float8Format, *, block: int = 32, rounding: str = "rceil") -> tuple[Any, Any]:
    """`mx_quantize` before its cast: the exponents, and ``x`` scaled by them (float32, ``x``'s shape), which
    `saturating_cast` casts and `cast_counts` counts."""
    shape = tuple(x.shape)
    blocks = ops.reshape(ops.astype(x, "float32"), (*shape[:-1], shape[-1] // block, block))
    m = ops.max(ops.abs(blocks), -1)
    nan = ops.isnan(m)
    if rounding == "rceil":
        exponent, values = _rceil(ops, blocks, m, fmt)
    else:
        e = _float32_exponent(ops, m)
        if rounding == "ceil":
            safe = ops.where(ops.isfinite(m), m, ops.full_like(m, 1.0))
            above = ops.where(safe < _MIN_NORMAL, m > 0, ops.exp2(ops.maximum(e, ops.full_like(e, -126.0))) < safe)
            e = e + ops.astype(ops.logical_or(above, nan), "float32")
        unbiased = ops.clip(e - float(fmt.max_pow2), -float(_E8M0_BIAS), float(_E8M0_BIAS + 1))
        exponent = ops.where(nan, ops.full_like(m, 255.0), unbiased + float(_E8M0_BIAS))
        scale = ops.where(
            nan, ops.full_like(m, math.inf), ops.maximum(ops.exp2(unbiased), ops.full_like(m, _MIN_NORMAL))
        )
        values = blocks / scale
    return ops.astype(ops.reshape(exponent, (*shape[:-1], shape[-1] // block)), "uint8"), ops.reshape(values, shape)


def mx_dequantize(ops: ArrayOps, exponents: Any, values: Any, *, block: int = 32) -> Any:
    """MX values brought back to float32: each ``block`` of FP8 ``values`` (along the last axis) times
    ``2 ** (exponent - 127)`` of its E8M0 exponent, and NaN throughout a block whose exponent is 255 (E8M0's NaN).
    The inverse of `mx_quantize` up to the cast's rounding; emulated MX matmuls multiply these."""
    exponent = ops.astype(exponents, "float32")
    scale = ops.where(exponent == 255.0, ops.full_like(exponent, math.nan), ops.exp2(exponent - 127.0))
    shape = tuple(values.shape)
    blocks = ops.reshape(ops.astype(values, "float32"), (*shape[:-1], shape[-1] // block, block))
    return ops.reshape(blocks * ops.reshape(scale, (*tuple(scale.shape), 1)), shape)


def exp2_exact(xp: Any, x: Any) -> Any:
    """``2 ** x`` over the namespace ``xp`` with every whole ``x`` exact (``ldexp`` of 1): for namespaces whose
    ``exp2`` is ``exp(x * ln 2)``, as XLA's on the CPU (a unit in the last place off at most integers), which
    would make the power-of-two scales and MX exponents above not powers of two. An `ArrayOps` over such a
    namespace uses it as its ``exp2``."""
    whole = xp.logical_and(xp.isfinite(x), xp.floor(x) == x)
    exponent = xp.astype(xp.clip(xp.where(whole, x, 0.0), -150.0, 128.0), xp.int32)
    return xp.where(whole, xp.ldexp(xp.ones_like(x), exponent), xp.exp2(x))


def _rceil(ops: ArrayOps, blocks: Any, m: Any, fmt: Float8Format) -> tuple[Any, Any]:
    """RCEIL: the exponent of ``amax / max`` rounded up, clamped to E8M0's range (254 for an inf amax, 255
    for NaN); the values multiplied by its reciprocal."""
    descale = m / ops.full_like(m, fmt.max)
    finite = ops.isfinite(descale)
    safe = ops.where(finite, descale, ops.full_like(descale, 1.0))
    e = _floor_log2(ops, safe)
    e = e + ops.astype(ops.exp2(e) < safe, "float32")
    e = ops.where(
        safe <= 2.0**-127, ops.full_like(e, -127.0), ops.where(safe < _MIN_NORMAL, ops.full_like(e, -126.0), e)
    )
    biased = ops.clip(e, -float(_E8M0_BIAS), float(_E8M0_BIAS)) + float(_E8M0_BIAS)
    biased = ops.where(finite, biased, ops.where(ops.isnan(descale), ops.full_like(e, 255.0), ops.full_like(e, 254.0)))
    reciprocal = ops.where(
        biased == 255.0,
        descale,
        ops.where(
            biased == 254.0,
            ops.full_like(e, 2.0**-127),
            ops.where(biased == 0.0, ops.full_like(e, 1.0), ops.exp2(float(_E8M0_BIAS) - biased)),
        ),
    )
    return biased, blocks * reciprocal


# -- delayed scaling: an amax history per cast, the dequantizing scale ----------------------------------------


def push_amax(ops: ArrayOps, history: Any, amax_: Any) -> Any:
    """The history with ``amax_`` written at position 0 after rolling it one place towards the front (Keras's
    and Flax's ``roll(history, -1)`` then ``[0] = amax``): position 0 holds the newest amax, the others the
    previous ``len - 1`` in order from the oldest."""
    newest = ops.reshape(ops.astype(amax_, "float32"), (1,))
    if history.shape[0] == 1:
        return newest
    return ops.concat([newest, history[2:], history[:1]])


def delayed_scale(
    ops: ArrayOps, history: Any, scale: Any, fmt: Float8Format, *, margin: int = 0, amax_compute: str = "max"
) -> Any:
    """The next dequantizing scale (``amax / max * 2 ** margin``, float32) from an amax history; an amax of 0
    or inf keeps ``scale``, and so does an amax so small that the scale would not be a normal float32 (Keras
    and Flax store a scale of 0 or a subnormal one there, which turns the next cast of zeros into NaN).

    Args:
        ops: The array vocabulary.
        history: The amax history (float32, newest first; see `push_amax`).
        scale: The current dequantizing scale.
        fmt: The format cast to.
        margin: Powers of two of headroom.
        amax_compute: ``"max"`` (the history's largest) or ``"most_recent"`` (its newest).
    """
    amax_ = ops.max(history) if amax_compute == "max" else history[0]
    previous = _divide(ops, 1.0, scale)
    usable = ops.logical_and(amax_ > 0.0, ops.isfinite(amax_))
    safe = ops.where(usable, amax_, ops.full_like(amax_, 1.0))
    factor = _divide(ops, fmt.max, safe) / float(2**margin)
    usable = ops.logical_and(usable, factor <= _MAX_FACTOR)
    return _divide(ops, 1.0, ops.where(usable, factor, previous))
