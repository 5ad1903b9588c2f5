"""Loss-scaler state dicts, written and read as every polyamp scaler (and torch's GradScaler) writes and reads them;
and FP8 delayed scaling's state dict, which every backend's FP8 layers write and read alike."""

from polyamp._src.float8_state import (
    FLOAT8_STATE_FORMAT,
    LayerState,
    delayed_recipe,
    pack_float8_state,
    parse_float8_state,
)
from polyamp._src.state_dict import (
    FORMAT_VERSION,
    parse_skipped_steps,
    parse_spike_run,
    parse_spike_window,
    parse_state_dict,
    to_state_dict,
)

__all__ = [
    "FLOAT8_STATE_FORMAT",
    "FORMAT_VERSION",
    "LayerState",
    "delayed_recipe",
    "pack_float8_state",
    "parse_float8_state",
    "parse_skipped_steps",
    "parse_spike_run",
    "parse_spike_window",
    "parse_state_dict",
    "to_state_dict",
]
