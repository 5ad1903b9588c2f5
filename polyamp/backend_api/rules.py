"""The device rules, each written once over `ArrayOps`: a backend's device computes the loss-scale rule, the
spike rule, the record codes and the non-finite counts by calling these with its framework's namespace
(`polyamp._src.rules` holds them); ``to_float32`` is the scale's rounding, ``RECIPROCAL_CEILING`` the highest
scale whose float32 reciprocal is normal. ``fp8`` holds the FP8 rules: scales from amaxes, saturating casts,
MX block exponents, delayed scaling's amax history and the cast counts of the records."""

from polyamp._src.rules import (
    ArrayOps,
    ScaleArrays,
    SpikeWindowArrays,
    advance,
    after_count,
    after_finite,
    after_growth,
    after_overflow,
    at_interval,
    backed_off,
    count_increments,
    finish,
    fp8,
    grad_norm,
    grown,
    is_spike,
    loss_statistic,
    non_finite_counts,
    record_code,
    spike_flag,
    statistic_dtype,
    times,
)
from polyamp._src.scaling import RECIPROCAL_CEILING, to_float32

__all__ = [
    "RECIPROCAL_CEILING",
    "ArrayOps",
    "ScaleArrays",
    "SpikeWindowArrays",
    "advance",
    "after_count",
    "after_finite",
    "after_growth",
    "after_overflow",
    "at_interval",
    "backed_off",
    "count_increments",
    "finish",
    "fp8",
    "grad_norm",
    "grown",
    "is_spike",
    "loss_statistic",
    "non_finite_counts",
    "record_code",
    "spike_flag",
    "statistic_dtype",
    "times",
    "to_float32",
]
