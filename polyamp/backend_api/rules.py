"""The device rules, each written once over `ArrayOps`: a backend's device computes the loss-scale rule, the
spike rule, the record codes and the non-finite counts by calling these with its framework's namespace
(`polyamp._src.rules` holds them); ``to_float32`` is the scale's rounding, ``RECIPROCAL_CEILING`` the highest
scale whose float32 reciprocal is normal. ``fp8`` holds the FP8 rules: scales from amaxes, saturating casts,
MX block exponents, delayed scaling's amax history and the cast counts of the records."""

from polyamp._src.rules import *  # noqa: F403
from polyamp._src.scaling import RECIPROCAL_CEILING as RECIPROCAL_CEILING
from polyamp._src.scaling import to_float32 as to_float32
