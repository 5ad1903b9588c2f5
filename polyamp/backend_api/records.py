"""Step records: the codes a device keeps per iteration (`polyamp.backend_api.rules.record_code` writes them), the ring
they live in, the recorder that reads them, the names of non-finite gradients, and the run summary every scaler's
``summary()`` returns (`RunSummary`) with the logging hook's rule (`log_every`); and the FP8 cast records
(`Float8CastRecord`, made by `cast_records` from the counts `polyamp.backend_api.rules.fp8.cast_counts` keeps)."""

from polyamp._src.backend import GradientCounts
from polyamp._src.float8 import CAST_ROLES, Float8CastRecord, cast_records
from polyamp._src.provenance import layer_of, non_finite_gradients
from polyamp._src.records import (
    MODE_CODES,
    REBASE_BIT,
    SKIP_REASONS,
    SPIKE_BIT,
    Recorder,
    SkipReason,
    ring_codes,
    ring_values,
)
from polyamp._src.run_summary import RunSummary, log_every

__all__ = [
    "CAST_ROLES",
    "MODE_CODES",
    "REBASE_BIT",
    "SKIP_REASONS",
    "SPIKE_BIT",
    "Float8CastRecord",
    "GradientCounts",
    "Recorder",
    "RunSummary",
    "SkipReason",
    "cast_records",
    "layer_of",
    "log_every",
    "non_finite_gradients",
    "ring_codes",
    "ring_values",
]
