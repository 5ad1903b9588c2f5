"""What a step leaves on the device for the records: its code, and the counts of non-finite gradient values.

`record_code` writes the code `polyamp._src.records.Recorder.consume` reads back (the mode from
`MODE_CODES`, plus 1 for a skipped step, `SPIKE_BIT` for a skip by the spike rule alone and `REBASE_BIT`
for a re-based window); `non_finite_counts` counts a gradient's +inf, -inf and NaN values for
`polyamp.NonFiniteGradient`. Both are elementwise, so a backend that reads its flags to the host in a batch
can encode them there with NumPy in one call.
"""

from __future__ import annotations

import math
from typing import Any

from polyamp._src.records import REBASE_BIT, SPIKE_BIT
from polyamp._src.rules._ops import ArrayOps

__all__ = ["non_finite_counts", "record_code", "spike_flag"]


def spike_flag(ops: ArrayOps, only: Any, rebase: Any) -> Any:
    """The spike rule's outcome as one float32 flag: 1.0 for a skip by the rule alone, -1.0 for an
    iteration that re-based the window, 0.0 otherwise (`polyamp.backend_api.SpikeDevice.spike_finish`)."""
    return ops.astype(only, "float32") - ops.astype(rebase, "float32")


def record_code(ops: ArrayOps, base: Any, overflow: Any = None, spike: Any = None) -> Any:
    """An iteration's record code as int32.

    Args:
        ops: The array vocabulary.
        base: The mode's code (`MODE_CODES`), an int or an int array (a batch of iterations).
        overflow: None (nothing was checked), or booleans: a gradient was inf or NaN.
        spike: None (no spike rule), or `spike_flag`'s floats.
    """
    if spike is None:
        return ops.asarray(base, "int32") if overflow is None else ops.astype(overflow, "int32") + base
    spiked = spike > 0
    if overflow is None:
        overflow = ops.logical_and(spiked, ops.logical_not(spiked))
    code = ops.astype(ops.logical_or(overflow, spiked), "int32") + base
    code = code + ops.astype(ops.logical_and(spiked, ops.logical_not(overflow)), "int32") * SPIKE_BIT
    return code + ops.astype(spike < 0, "int32") * REBASE_BIT


def non_finite_counts(ops: ArrayOps, values: Any) -> Any:
    """How many +inf, -inf and NaN values the floating array ``values`` holds: three integers, int64 where
    the namespace has them (a gradient may hold more than 2**31 values), else int32."""
    dtype = "int64" if ops.has_int64 else "int32"
    classes = (values == math.inf, values == -math.inf, ops.isnan(values))
    return ops.stack([ops.astype(ops.sum(ops.astype(found, dtype)), dtype) for found in classes])
