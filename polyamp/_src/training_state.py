"""The training state a policy describes: master copy, optimizer-state dtype and update rounding.

The rules every backend's precision optimizer follows, stated once, with a pure-Python reference for each:

- **The update is formed in float32.** For each parameter the optimizer runs on float32 working copies of the
  weight (the master copy when one is kept, else the stored weight), its gradient and its floating slots;
  the slots are then stored back in the state dtype, rounded to nearest.
- **It is written with the plan's rounding** (`write_update`): to nearest; stochastically (bfloat16 only: a
  uniformly random 16-bit integer is added to the float32 bit pattern, whose low 16 bits are then dropped,
  which rounds up with probability equal to the distance from the lower neighbour, so the expected stored
  value is the float32 value); or with Kahan compensation, where a buffer in the weight dtype carries what
  the last write lost: ``y = c + (target - w)``, ``w' = round(w + y)``, ``c' = round(y - (w' - w))``, each
  operation one float32 operation (no fused multiply-add), so every backend writes the same bits.
- **A float32 master copy** is updated instead of the weight and written back to nearest after each step.
- **A skipped step writes nothing**: weights, master copy, slots and compensation buffers keep their bits.
- **What is a slot** (`is_state_slot`): a floating entry of the optimizer's state with at least one dimension (a
  moment, a momentum buffer, a factored second moment of any shape); scalars and step counters keep their dtype.
- **Checkpoints** store each state tensor in the dtype of the plan it was saved under; loading it under
  another plan converts it with one note through ``logging.getLogger("polyamp")``: what happens to the master
  copies, the compensation buffers and the slots, and what is said, is `checkpoint_changes`'s decision.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from typing import Final, NamedTuple

from polyamp._src.errors import InvalidConfigError, describe
from polyamp._src.policy import _PRESETS, Policy, PolicyLike

__all__ = [
    "COUNTER_KEYS",
    "ITEMSIZE",
    "KAHAN_KEY",
    "MASTER_KEY",
    "CheckpointChanges",
    "MeasuredStateBytes",
    "StateBytes",
    "TrainingStateWarning",
    "checkpoint_changes",
    "conversion_note",
    "is_state_slot",
    "round_to",
    "state_bytes",
    "state_bytes_table",
    "stochastic_round_bfloat16",
    "unplanned_hazard_message",
    "write_update",
]

#: Bytes per element of each dtype a policy can hold.
ITEMSIZE: Final = {"float32": 4, "bfloat16": 2, "float16": 2}

#: The names under which precision optimizers keep their own per-parameter state, next to the optimizer's slots.
MASTER_KEY: Final = "polyamp_master"
KAHAN_KEY: Final = "polyamp_compensation"


#: State keys that count steps, never slots, whatever their dtype (torch keeps ``step`` as a float32 tensor).
COUNTER_KEYS: Final = frozenset({"step", "count", "iterations"})


def is_state_slot(*, floating: bool, ndim: int, key: str | None = None, param_ndim: int | None = None) -> bool:
    """Whether an optimizer-state entry is a slot, kept in the plan's ``state_dtype``: a floating array with at
    least one dimension (Adam's moments, a momentum buffer, Adafactor's factored row and column statistics), or
    any floating entry of a scalar parameter (``param_ndim == 0``: its moments are scalars too). Other scalars,
    step counters and a precision optimizer's own master copies and compensation buffers are not."""
    return (
        floating and (ndim >= 1 or param_ndim == 0) and key not in COUNTER_KEYS and key not in (MASTER_KEY, KAHAN_KEY)
    )


class CheckpointChanges(NamedTuple):
    """What loading a checkpoint saved under one plan does under another (`checkpoint_changes`).

    ``master`` and ``compensation`` say what becomes of the master copies and the Kahan compensation buffers of
    the low-precision weights: ``"keep"`` (saved and planned, same dtype), ``"convert"`` (saved in another dtype:
    cast to the planned one), ``"make"`` (planned, not saved: the master copy made from the weights, the
    compensation at zero), ``"drop"`` (saved, not planned), ``"none"`` (neither). ``notes`` are the sentences
    to log, in order; empty when nothing changes.
    """

    master: str
    compensation: str
    notes: tuple[str, ...]


def checkpoint_changes(
    plan: Policy,
    *,
    weights: str | None,
    saved_master: str | None,
    saved_compensation: str | None,
    saved_slots: Iterable[str] = (),
) -> CheckpointChanges:
    """The one decision every backend applies when a precision optimizer's checkpoint is loaded.

    Args:
        plan: The plan of the optimizer loading the checkpoint.
        weights: The dtype of the weights (``"bfloat16"``, ``"float16"``; for float32 weights nothing of the plan
            applies but the slots' dtype); None for low-precision weights whose dtype the caller cannot see.
        saved_master: The dtype the checkpoint's master copies are in, None when it has none.
        saved_compensation: The dtype of the checkpoint's compensation buffers, None when it has none.
        saved_slots: The dtypes of the checkpoint's floating slots (`is_state_slot`).
    """
    low = weights in ("bfloat16", "float16", None)
    of_weights = "the weights" if weights is None else f"the {weights} weights"
    wants_master = low and plan.keeps_master
    wants_compensation = low and plan.rounding == "kahan"
    notes: list[str] = []
    if wants_master and saved_master is None:
        master = "make"
        notes.append(
            f"The checkpoint has no master copies (it was saved under another plan): they are made from "
            f"{of_weights}, exactly."
        )
    elif wants_master:
        master = "keep" if saved_master == "float32" else "convert"
        if master == "convert":
            notes.append(conversion_note("The master copies", str(saved_master), "float32"))
    elif saved_master is not None:
        master = "drop"
        notes.append(
            f"The checkpoint's {saved_master} master copies are dropped: the current plan keeps none, and "
            f"{of_weights} stand as loaded (rounded to nearest from them when saved). Load under the plan it was "
            "saved with to keep them."
        )
    else:
        master = "none"
    if wants_compensation and saved_compensation is None:
        compensation = "make"
        notes.append(
            "The checkpoint has no Kahan compensation buffers (it was saved under another plan): they start at zero."
        )
    elif wants_compensation:
        compensation = "keep" if saved_compensation == (weights or saved_compensation) else "convert"
        if compensation == "convert":
            notes.append(conversion_note("The Kahan compensation buffers", str(saved_compensation), str(weights)))
    elif saved_compensation is not None:
        compensation = "drop"
        notes.append(
            f"The checkpoint's Kahan compensation buffers are dropped: the current plan writes updates with "
            f"{plan.rounding} rounding" + (" into a float32 master copy." if plan.keeps_master else ".")
        )
    else:
        compensation = "none"
    for saved in dict.fromkeys(saved_slots):
        if saved != plan.state_dtype:
            notes.append(conversion_note("The optimizer's slots", saved, plan.state_dtype))
    return CheckpointChanges(master, compensation, tuple(notes))


class TrainingStateWarning(UserWarning):
    """Weights in bfloat16/float16 are updated without a master copy or a rounding plan: small updates round away."""


def _f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def _bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def _from_bits(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0])


def round_to(value: float, dtype: str) -> float:
    """``value`` (a float32 value) rounded to nearest (ties to even) in ``dtype``, as a Python float."""
    value = _f32(value)
    if dtype == "float32" or math.isnan(value) or math.isinf(value):
        return value
    if dtype == "bfloat16":
        bits = _bits(value)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return _from_bits(rounded)
    if dtype == "float16":
        try:
            return float(struct.unpack("<e", struct.pack("<e", value))[0])
        except OverflowError:  # beyond float16's range (rounding to nearest)
            return math.copysign(math.inf, value)
    raise InvalidConfigError(f"round_to: dtype must be float32, bfloat16 or float16. Received: {describe(dtype)}.")


def stochastic_round_bfloat16(value: float, random16: int) -> float:
    """``value`` (float32) rounded to bfloat16 stochastically with the 16 random bits ``random16`` (0..65535)."""
    value = _f32(value)
    if math.isnan(value) or math.isinf(value):
        return value
    return _from_bits((_bits(value) + (random16 & 0xFFFF)) & 0xFFFF0000)


def write_update(
    weight: float,
    target: float,
    *,
    dtype: str,
    rounding: str,
    compensation: float = 0.0,
    random16: int = 0,
) -> tuple[float, float]:
    """The reference write of one element: ``(new weight, new compensation)``.

    Args:
        weight: The stored weight (a value of ``dtype``).
        target: The float32 value the optimizer computed for it from the float32 working copy.
        dtype: The weight dtype.
        rounding: ``"nearest"``, ``"stochastic"`` (``random16`` are the random bits) or ``"kahan"``
            (``compensation`` is the buffer's value, in ``dtype``).
    """
    if rounding == "nearest":
        return round_to(target, dtype), compensation
    if rounding == "stochastic":
        return stochastic_round_bfloat16(target, random16), compensation
    delta = _f32(_f32(target) - weight)
    y = _f32(compensation + delta)
    new = round_to(_f32(weight + y), dtype)
    return new, round_to(_f32(y - _f32(new - weight)), dtype)


class StateBytes(NamedTuple):
    """Bytes per parameter of the training state under one plan (weights, gradients, master copy, optimizer
    slots, Kahan compensation)."""

    weights: int
    gradients: int
    master: int
    state: int
    compensation: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.master + self.state + self.compensation


def state_bytes(policy: PolicyLike, *, slots: int = 2) -> StateBytes:
    """Bytes per parameter of the training state ``policy`` plans for an optimizer with ``slots`` floating
    slots per parameter (AdamW: 2, SGD with momentum: 1); gradients are in the parameter dtype.

    >>> tuple(state_bytes(name).total for name in ("mixed_bfloat16", "bfloat16_kahan", "bfloat16_stochastic"))
    (16, 10, 8)
    """
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 0:
        raise InvalidConfigError(f"`slots` must be an int >= 0 (AdamW: 2). Received: {describe(slots)}.")
    plan = Policy(policy)
    param = ITEMSIZE[plan.param_dtype]
    return StateBytes(
        weights=param,
        gradients=param,
        master=ITEMSIZE[plan.master_dtype] if plan.keeps_master else 0,
        state=slots * ITEMSIZE[plan.state_dtype],
        compensation=param if plan.rounding == "kahan" else 0,
    )


class MeasuredStateBytes(NamedTuple):
    """An optimizer's training state as counted from its tensors by a backend's ``measure_state_bytes``
    (`polyamp_torch.measure_state_bytes`, `polyamp_keras.measure_state_bytes`, `polyamp_jax.measure_state_bytes`).

    ``parameters`` is the number of trainable elements; the other fields are bytes in all: the weights, their
    gradients, the master copies, the optimizer's per-parameter slots (moments; step counters and other scalars
    left out) and the Kahan compensation buffers. Compare ``per_parameter`` with the plan's
    `state_bytes` total.
    """

    parameters: int
    weights: int
    gradients: int
    master: int
    state: int
    compensation: int

    @property
    def total(self) -> int:
        """All the bytes."""
        return self.weights + self.gradients + self.master + self.state + self.compensation

    @property
    def per_parameter(self) -> float:
        """Bytes per parameter (``total / parameters``): AdamW measures 16 in float32 or with a float32 master copy,
        10 under ``"bfloat16_kahan"``, 8 under ``"bfloat16_stochastic"``."""
        return self.total / self.parameters if self.parameters else 0.0

    def breakdown(self) -> dict[str, float]:
        """Each part in bytes per parameter: ``weights``, ``gradients``, ``master``, ``state``, ``compensation``."""
        count = self.parameters or 1
        return {key: value / count for key, value in self._asdict().items() if key != "parameters"}


#: The plans the doctor compares: the float32 default, the mixed policies and the training-state presets.
TABLE_POLICIES: Final = ("float32", "mixed_bfloat16", "bfloat16", *_PRESETS)


def state_bytes_table(
    parameters: int | None = None, *, slots: int = 2, policies: Iterable[PolicyLike] = TABLE_POLICIES
) -> list[dict[str, object]]:
    """One row per policy: its name, `StateBytes` fields, ``per_parameter`` and (given ``parameters``) ``total``."""
    rows: list[dict[str, object]] = []
    for policy in policies:
        plan = Policy(policy)
        counted = state_bytes(plan, slots=slots)
        row: dict[str, object] = {"policy": plan.name, **counted._asdict(), "per_parameter": counted.total}
        if parameters is not None:
            row["total"] = counted.total * parameters
        rows.append(row)
    return rows


def unplanned_hazard_message(optimizer: str, dtypes: Iterable[str], policy: Policy) -> str | None:
    """The one warning for an optimizer stepping bfloat16/float16 weights with no master copy and nearest
    rounding (the plan of the pure "bfloat16"/"float16" policies); None when there is nothing to say."""
    low = sorted({d for d in dtypes if d in ("bfloat16", "float16")})
    if not low or policy.keeps_master or policy.rounding != "nearest":
        return None
    kinds = " and ".join(low)
    return (
        f"{optimizer} updates {kinds} weights directly, rounding each update to nearest: an update smaller than "
        f"half a unit in the last place (for bfloat16 about 0.4% of the weight) is lost, so training stalls "
        f"as the learning rate decays. Keep a float32 master copy (policy 'bfloat16_float32_master', 16 bytes "
        f"per parameter with AdamW) or write the updates with compensation ('bfloat16_kahan', 10 bytes) or "
        f"stochastic rounding ('bfloat16_stochastic', 8 bytes), through polyamp_torch.PrecisionOptimizer, "
        f"polyamp_keras.PrecisionOptimizer or polyamp_jax.precision. This is said once per optimizer."
    )


def conversion_note(what: str, saved: str, planned: str) -> str:
    """The note logged when a checkpoint's state tensors (``what``, plural) are converted to the plan's dtype."""
    lossy = ITEMSIZE.get(planned, 4) < ITEMSIZE.get(saved, 4)
    return (
        f"{what} were saved in {saved} and are loaded as {planned}, the dtype the current plan keeps them in"
        + (" (rounded to nearest)" if lossy else " (exactly)")
        + ". Load under the plan they were saved with to keep them as they were."
    )
