"""Training-state plans: the keys of master copies and compensation buffers, the rounding of updates, checkpoint
conversions and the byte counts."""

from polyamp._src.training_state import (
    COUNTER_KEYS,
    ITEMSIZE,
    KAHAN_KEY,
    MASTER_KEY,
    CheckpointChanges,
    MeasuredStateBytes,
    StateBytes,
    checkpoint_changes,
    conversion_note,
    is_state_slot,
    round_to,
    stochastic_round_bfloat16,
    unplanned_hazard_message,
    write_update,
)

__all__ = [
    "COUNTER_KEYS",
    "ITEMSIZE",
    "KAHAN_KEY",
    "MASTER_KEY",
    "CheckpointChanges",
    "MeasuredStateBytes",
    "StateBytes",
    "checkpoint_changes",
    "conversion_note",
    "is_state_slot",
    "round_to",
    "stochastic_round_bfloat16",
    "unplanned_hazard_message",
    "write_update",
]
