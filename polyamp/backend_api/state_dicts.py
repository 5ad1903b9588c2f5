"""Loss-scaler state dicts, written and read as every polyamp scaler (and torch's GradScaler) writes and reads them."""

from polyamp._src.state_dict import (
    FORMAT_VERSION,
    parse_skipped_steps,
    parse_spike_run,
    parse_spike_window,
    parse_state_dict,
    to_state_dict,
)

__all__ = [
    "FORMAT_VERSION",
    "parse_skipped_steps",
    "parse_spike_run",
    "parse_spike_window",
    "parse_state_dict",
    "to_state_dict",
]
