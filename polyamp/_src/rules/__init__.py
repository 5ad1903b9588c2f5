"""The device rules, each written once over `ArrayOps`: the loss-scale rule, the spike rule, the record code, and
the FP8 casts (`fp8`).

`polyamp.LossScaleConfig.next_state` and `polyamp.SpikeRule.decide` are the host references; these are the
same rules as array operations, which every backend's device calls with its own `ArrayOps` (a framework's
fused kernel may stand in where it computes the same values, tested bit for bit). No backend writes a
rule's arithmetic itself.
"""

from polyamp._src.rules import fp8
from polyamp._src.rules._ops import ArrayOps
from polyamp._src.rules.codes import non_finite_counts, record_code, spike_flag
from polyamp._src.rules.loss_scale import (
    ScaleArrays,
    advance,
    after_count,
    after_finite,
    after_growth,
    after_overflow,
    at_interval,
    backed_off,
    count_increments,
    grown,
    times,
)
from polyamp._src.rules.spike import (
    SpikeWindowArrays,
    finish,
    grad_norm,
    is_spike,
    loss_statistic,
    statistic_dtype,
)

__all__ = [
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
]
