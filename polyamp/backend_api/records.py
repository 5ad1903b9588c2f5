"""Step records: the codes a device keeps per iteration (`polyamp.backend_api.rules.record_code` writes them), the ring
they live in, the recorder that reads them, the names of non-finite gradients, and the run summary every scaler's
``summary()`` returns (`RunSummary`) with the logging hook's rule (`log_every`)."""

from polyamp._src.backend import GradientCounts
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
    "MODE_CODES",
    "REBASE_BIT",
    "SKIP_REASONS",
    "SPIKE_BIT",
    "GradientCounts",
    "Recorder",
    "RunSummary",
    "SkipReason",
    "layer_of",
    "log_every",
    "non_finite_gradients",
    "ring_codes",
    "ring_values",
]
