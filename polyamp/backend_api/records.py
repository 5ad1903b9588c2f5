"""Step records: the codes a device keeps per iteration (`polyamp.backend_api.rules.record_code` writes them), the ring
they live in, the recorder that reads them, and the names of non-finite gradients."""

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

__all__ = [
    "MODE_CODES",
    "REBASE_BIT",
    "SKIP_REASONS",
    "SPIKE_BIT",
    "GradientCounts",
    "Recorder",
    "SkipReason",
    "layer_of",
    "non_finite_gradients",
    "ring_codes",
    "ring_values",
]
