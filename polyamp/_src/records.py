"""What happened at each step, and what polyamp says about it: skip reasons, step records, scale collapse.

Every iteration a `polyamp.LossScaler` ends is in one of three modes, decided by the core when the iteration
starts:

* **scaling**: the loss was multiplied by the scale; a non-finite gradient skips the step with reason
  ``"overflow"`` and backs the scale off;
* **guarding**: scaling is off (bfloat16 and float32 policies), but the gradients are still checked: a
  non-finite gradient skips the step with reason ``"non_finite"``, and nothing else changes;
* **off**: the optimizer just steps.

(An iteration ended by ``update(new_scale=...)`` scales but does not run the rule: its code is ``"set"``.)

The backend keeps one small code per iteration on the device (`MODE_CODES`: the mode plus the iteration's
device flag), in a ring of ``capacity`` entries, so recording costs no host synchronisation. The core reads
the ring in batches, replays the loss-scale rule from the last state it knows to give each record its scale,
logs what deserves it through ``logging.getLogger("polyamp")`` and applies ``on_min_scale``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal, TypeVar

from polyamp._src.errors import PolyampError, PolyampValueError, describe
from polyamp._src.provenance import NonFiniteGradient
from polyamp._src.run_summary import RunSummary, RunTally
from polyamp._src.scaling import LossScaleConfig, LossScaleState
from polyamp._src.skip_streak import ParameterCheck, SkipStreak

__all__ = [
    "LOGGED_SKIPS",
    "MAX_HISTORY",
    "MODE_CODES",
    "ON_MIN_SCALE",
    "REBASE_BIT",
    "SKIP_REASONS",
    "SPIKE_BIT",
    "Recorder",
    "ScaleCollapseError",
    "SkipReason",
    "StepRecord",
    "advance",
    "check_guard",
    "check_history",
    "check_on_min_scale",
    "ring_codes",
    "ring_values",
]

T = TypeVar("T")

logger = logging.getLogger("polyamp")

SkipReason = Literal["overflow", "non_finite", "loss_spike", "grad_spike"]
#: The reasons a step is skipped for: a non-finite gradient while scaling, or while guarding; an outlier
#: loss or gradient norm (`polyamp.SpikeRule`).
SKIP_REASONS: Final = ("overflow", "non_finite", "loss_spike", "grad_spike")
#: Added to an iteration's code when its step was skipped by the spike rule (and not for non-finite values).
SPIKE_BIT: Final = 8
#: Added to an iteration's code when its statistic re-based the spike rule's window (`polyamp.SpikeRule`'s
#: ``max_consecutive``); the iteration applied its step.
REBASE_BIT: Final = 16
#: The code of an iteration is its mode's base plus 1 when the iteration's flag is set (a step skipped).
MODE_CODES: Final = {"scaling": 0, "guarding": 2, "off": 4, "set": 6}
_MODE_NAMES: Final = {value: name for name, value in MODE_CODES.items()}
#: What ``on_min_scale`` may be.
ON_MIN_SCALE: Final = ("warn", "raise", "ignore")
DEFAULT_HISTORY: Final = 256
#: The largest ``history`` a scaler accepts: the ring of step codes lives on the device and is read in one
#: batch, so its size is what each read costs.
MAX_HISTORY: Final = 65_536
#: How many skipped steps of each reason are logged one line each; after that, one summary line when the
#: reason's count reaches a power of two (16, 32, 64, ...), so a storm of skips logs a handful of lines.
LOGGED_SKIPS: Final = 8

_COLLAPSE_CAUSES = (
    "Likely causes: weights pretrained in bfloat16 (or with values beyond float16's range, 65504) trained in "
    "float16; a learning rate too high, so the loss diverges; a NaN or inf in the data. What to do: prefer "
    "'mixed_bfloat16' on hardware that has it (no scaling needed); check the data for non-finite values; lower "
    "the learning rate; run `python -m polyamp doctor --check <checkpoint>` to find weights float16 cannot hold."
)


class ScaleCollapseError(PolyampError, RuntimeError):
    """The loss scale reached its floor and the scaler was created with ``on_min_scale="raise"``."""


@dataclass(frozen=True)
class StepRecord:
    """One iteration a loss scaler ended.

    Attributes:
        iteration: The iteration's index among those this scaler ended, from 0.
        skipped: Whether the iteration skipped a step (an optimizer's gradients held inf or NaN).
        reason: ``"overflow"`` (scaling found inf/NaN), ``"non_finite"`` (the guard found inf/NaN),
            ``"loss_spike"`` / ``"grad_spike"`` (the spike rule, `polyamp.SpikeRule`), or None.
        mode: ``"scaling"``, ``"guarding"`` or ``"off"``.
        scale: The scale the iteration's loss was multiplied by (None when not scaling, or when the scale
            cannot be told: records were lost, or a scale was set from a tensor inside a compiled function).
        next_scale: The scale after the iteration's update (None likewise).
        gradients: For a skipped step, the parameters whose gradients held inf/-inf/NaN, with the counts
            (see `polyamp.NonFiniteGradient`); empty when not skipped, or when the backend could not tell
            (a fused torch optimizer, which skips on the device without the host learning of it in time).
        rebased: Whether the iteration's statistic re-based the spike rule's window: it came after
            ``max_consecutive`` consecutive spikes, so the loss (or gradient norm) settled at a new level and the
            window restarted from it (see `polyamp.SpikeRule`).
    """

    iteration: int
    skipped: bool
    reason: SkipReason | None
    mode: str
    scale: float | None
    next_scale: float | None
    gradients: tuple[NonFiniteGradient, ...] = field(default=())
    rebased: bool = False

    @property
    def layers(self) -> tuple[str, ...]:
        """The modules or layers holding the non-finite gradients, in parameter order, each once."""
        return tuple(dict.fromkeys(g.layer for g in self.gradients))

    def _where(self) -> str:
        if not self.gradients:
            return ""
        shown = "; ".join(g.describe() for g in self.gradients[:8])
        more = f"; and {len(self.gradients) - 8} more" if len(self.gradients) > 8 else ""
        return f" Non-finite gradients in {', '.join(self.layers)}: {shown}{more}."

    def message(self) -> str:
        """The record as one log line."""
        if not self.skipped and self.rebased:
            return (
                f"iteration {self.iteration}: step applied after a run of spikes: the statistic the SpikeRule "
                "watches shifted to a new level and stayed there (max_consecutive spikes in a row), so this "
                "iteration is accepted and the rule's window re-based at it; spikes are decided again once the "
                "window holds `warmup` values of the new level. Pass SpikeRule(max_consecutive=...) to change "
                "the bound."
            )
        if not self.skipped:
            return f"iteration {self.iteration}: step applied ({self.mode}, scale {_fmt(self.scale)})"
        if self.reason in ("loss_spike", "grad_spike"):
            what = "loss" if self.reason == "loss_spike" else "gradient norm"
            return (
                f"iteration {self.iteration}: step skipped ({self.reason}): its {what} was an outlier against the "
                "recent steps' (see the SpikeRule). Parameters, optimizer slots and step counters are unchanged; "
                "the loss scale is not backed off for it."
            )
        if self.reason == "overflow":
            return (
                f"iteration {self.iteration}: step skipped (overflow): a gradient was inf or NaN at loss scale "
                f"{_fmt(self.scale)}; the scale is now {_fmt(self.next_scale)}. Parameters, optimizer slots and "
                "step counters are unchanged. Occasional overflows are how dynamic loss scaling finds its scale."
                + self._where()
            )
        return (
            f"iteration {self.iteration}: step skipped (non_finite): a gradient was inf or NaN without loss "
            "scaling (the guard of bfloat16/float32 training). Parameters, optimizer slots and step counters are "
            "unchanged. Repeated non-finite gradients point at the data (a NaN or inf in a batch), a learning "
            "rate too high, or an operation that overflows; polyamp_torch.watch_forward / "
            "polyamp_keras.watch_forward name the layer that produced it." + self._where()
        )


def _fmt(scale: float | None) -> str:
    if scale is None:
        return "unknown"
    return f"{scale:g}"


def ring_values(count: int, ring: Sequence[T]) -> list[T]:
    """The values a ring holds, oldest first, after ``count`` writes at ``count % len(ring)`` (for a device
    that keeps a history in a fixed-size ring: step codes, the spike rule's window)."""
    capacity = len(ring)
    kept = min(count, capacity)
    return [ring[(count - kept + i) % capacity] for i in range(kept)]


def ring_codes(count: int, ring: Sequence[int]) -> list[int]:
    """`ring_values` of a ring of step codes, as ints."""
    return [int(code) for code in ring_values(count, ring)]


def check_guard(guard: object) -> bool | None:
    """Validate a ``guard`` argument: True, False or None (guard whenever the policy turns scaling off)."""
    if guard is not None and not isinstance(guard, bool):
        raise PolyampValueError(
            f"`guard` must be None (check gradients whenever the policy turns scaling off), True or False. "
            f"Received: {describe(guard)}."
        )
    return guard


def check_on_min_scale(value: object) -> str:
    """Validate an ``on_min_scale`` argument."""
    if value not in ON_MIN_SCALE:
        raise PolyampValueError(
            f"`on_min_scale` must be one of {', '.join(repr(v) for v in ON_MIN_SCALE)}. Received: "
            f"{describe(value)}. 'warn' (default) logs a warning when the loss scale reaches its floor, 'raise' "
            "stops the run with ScaleCollapseError, 'ignore' says nothing."
        )
    return str(value)


def check_history(value: object) -> int:
    """Validate a ``history`` argument (how many records the scaler keeps): an int from 1 to `MAX_HISTORY`.

    Raises:
        PolyampValueError: (a ``ValueError``) anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_HISTORY:
        raise PolyampValueError(
            f"`history` must be an int from 1 to {MAX_HISTORY:,}: how many iterations the scaler records between "
            f"reads and keeps for records(). Received: {describe(value)}. The default is {DEFAULT_HISTORY}; "
            "read the records more often (records(), the Keras LossScaleCallback) rather than keeping more."
        )
    return value


def advance(config: LossScaleConfig, state: LossScaleState, code: int) -> LossScaleState:
    """The rule's state after an iteration whose ring code is ``code``, from ``state`` before it: a scaling
    iteration runs the rule (a skip by the spike rule alone counts as finite); the other modes leave it."""
    spiked = bool(code & SPIKE_BIT)
    code &= SPIKE_BIT - 1
    if _MODE_NAMES[code - code % 2] != "scaling":
        return state
    return config.next_state(state, code % 2 == 1 and not spiked)


class _Run:
    """Consecutive scaling iterations that stepped, kept unmade until the records are read: ``steps`` of them
    from iteration ``first``, the first taken at ``state`` (None: unknown), replayed under ``config``.

    A batch of records is read every ``history // 2`` iterations, on the training loop's path; almost all are
    of this kind, and a record nobody reads costs nothing this way."""

    __slots__ = ("config", "first", "state", "steps")

    def __init__(self, first: int, steps: int, state: LossScaleState | None, config: LossScaleConfig) -> None:
        self.first, self.steps, self.state, self.config = first, steps, state, config

    def drop(self, count: int) -> None:
        """Forget the first ``count`` iterations (fewer than ``steps``)."""
        if self.state is not None:
            self.state = self.config.after_finite(self.state, count)
        self.first += count
        self.steps -= count

    def made(self) -> list[StepRecord]:
        """The records, made directly rather than through the frozen field-by-field ``__init__``."""
        if self.state is None:
            scales: list[float | None] = [None] * (self.steps + 1)
        else:
            known, after = self.config.finite_run(self.state, self.steps)
            scales = [*known, after.scale]
        new = object.__new__
        records = []
        for index in range(self.steps):
            record = new(StepRecord)
            record.__dict__.update(
                iteration=self.first + index,
                skipped=False,
                reason=None,
                mode="scaling",
                scale=scales[index],
                next_scale=scales[index + 1],
                gradients=(),
                rebased=False,
            )
            records.append(record)
        return records


class Recorder:
    """The host side of the step records: the last known state, the kept records, logging and collapse.

    ``read_state`` reads the device state (a host sync), used only when the replay cannot tell the scale.

    Threads: `lock` makes each `consume` one step, so whichever threads read the records at once, every ring
    entry becomes one record, each skip is logged once and a collapse warns once. A caller that keeps more
    beside the recorder (`polyamp.LossScaler`'s history shares this lock; a functional scaler's run books hold
    their own around each read) holds its lock around the whole read.

    Skipped steps are logged (``"overflow"`` at INFO, the other reasons at WARNING) one line each for the first
    `LOGGED_SKIPS` of each reason; after that, one line when the reason's count reaches a power of two, saying
    how many were skipped since the last line, in which iterations, and the last one's message. The records
    keep every skip.
    """

    def __init__(self, capacity: int, on_min_scale: str, spike_reason: SkipReason = "loss_spike") -> None:
        self.capacity = capacity
        self.spike_reason = spike_reason
        self.on_min_scale = on_min_scale
        self._kept: deque[StepRecord | _Run] = deque()  # the last `capacity` records, runs not made yet
        self._size = 0  # records in `_kept`
        self.read_count = 0  # ring entries consumed so far
        self.anchor: LossScaleState | None = None  # the state after the last consumed entry, when known
        self.lost = 0
        self.gradients: dict[int, tuple[NonFiniteGradient, ...]] = {}  # by iteration, until its record is made
        self.set_scales: dict[int, float] = {}  # the scale update(new_scale=...) set, by iteration
        self._collapsed = False  # inside a collapse episode (warned once; re-armed when the scale grows)
        self._skip_counts: dict[str, int] = {}  # skipped steps by reason, for the rate limit of their log lines
        self._quiet_since: dict[str, int] = {}  # by reason: the first iteration skipped since its last line
        self.streak = SkipStreak()  # the run of skips the records end with, and non-finite parameters behind it
        self.tally = RunTally()  # every record made, for `summary`
        #: Held while entries are consumed (reentrant: a caller may hold it around its read of the ring).
        self.lock = threading.RLock()

    def __getstate__(self) -> dict[str, object]:
        saved = dict(self.__dict__)
        del saved["lock"]  # (a lock belongs to its process; a copy gets its own)
        return saved

    def __setstate__(self, saved: dict[str, object]) -> None:
        self.__dict__.update(saved)
        self.lock = threading.RLock()

    @property
    def records(self) -> deque[StepRecord]:
        """The last ``capacity`` records, oldest first."""
        with self.lock:
            return self._made()

    def _made(self) -> deque[StepRecord]:
        kept = self._kept
        if any(isinstance(item, _Run) for item in kept):
            made: deque[StepRecord | _Run] = deque()
            for item in kept:
                if isinstance(item, _Run):
                    made.extend(item.made())
                else:
                    made.append(item)
            self._kept = kept = made
        return kept  # type: ignore[return-value]  # every run is made now

    def _keep(self, item: StepRecord | _Run, size: int) -> None:
        """Add ``item`` (``size`` records), forgetting the oldest beyond ``capacity``."""
        self._kept.append(item)
        self._size += size
        excess = self._size - self.capacity
        while excess > 0:
            head = self._kept[0]
            if isinstance(head, _Run) and head.steps > excess:
                head.drop(excess)
                self._size -= excess
                return
            self._kept.popleft()
            dropped = head.steps if isinstance(head, _Run) else 1
            self._size -= dropped
            excess -= dropped

    def summary(self, upto: int | None = None) -> RunSummary:
        """The summary of every iteration consumed (up to, not including, ``upto`` when given)."""
        with self.lock:
            return self.tally.summary(upto)

    def attach(self, iteration: int, gradients: tuple[NonFiniteGradient, ...]) -> None:
        """The non-finite gradients of ``iteration`` (added to those already attached)."""
        if gradients:
            self.gradients[iteration] = self.gradients.get(iteration, ()) + gradients

    def attach_set_scale(self, iteration: int, scale: float) -> None:
        """``iteration`` ended with ``update(new_scale=scale)``: its record's ``next_scale``."""
        self.set_scales[iteration] = scale

    def find(self, iteration: int) -> StepRecord | None:
        """The kept record of ``iteration``, or None (not read yet, lost, or no longer kept)."""
        for record in reversed(self.records):  # the one wanted is usually among the last
            if record.iteration == iteration:
                return record
            if record.iteration < iteration:
                break
        return None

    def amend(self, iteration: int, gradients: tuple[NonFiniteGradient, ...]) -> None:
        """Add ``gradients`` to the kept record of ``iteration``, made before they could be counted (records
        already handed out stay as they were)."""
        if not gradients:
            return
        for position in range(len(self.records) - 1, -1, -1):
            record = self.records[position]
            if record.iteration == iteration:
                self.records[position] = replace(record, gradients=record.gradients + gradients)
                self.tally.add_layers(iteration, tuple(dict.fromkeys(g.layer for g in gradients)))
                return
            if record.iteration < iteration:
                return

    def reanchor(self, state: LossScaleState | None) -> None:
        """The state is now ``state`` (loaded, set or read), or unknown (None)."""
        self.anchor = state

    def restart(self, count: int, state: LossScaleState | None) -> None:
        """The device's ring was replaced (variables loaded from a checkpoint): its ``count`` entries belong to the
        run that wrote them, not to this one, and the state is now ``state`` (None: unknown)."""
        self.read_count = count
        self.anchor = state
        self.gradients.clear()
        self.streak = SkipStreak()
        self.tally = RunTally(count)

    def rewind(self, iteration: int, state: LossScaleState | None) -> None:
        """Forget the records from ``iteration`` on (their iterations ran again otherwise, from an older state):
        the ring is read again from ``iteration``, where the rule's state was ``state`` (None: unknown)."""
        kept = [record for record in self.records if record.iteration < iteration]
        self._kept = deque(kept)
        self._size = len(kept)
        self.read_count = iteration
        self.anchor = state
        self.tally.rewind(iteration, state)
        for stale in [i for i in self.gradients if i >= iteration]:
            del self.gradients[stale]

    def consume(
        self,
        count: int,
        codes: Sequence[int],
        config: LossScaleConfig,
        read_state: Callable[[], LossScaleState | None],
        check_parameters: ParameterCheck | None = None,
    ) -> None:
        """Turn the ring's entries since the last read into records: ``count`` entries were written in all,
        ``codes`` are the most recent ones (at most ``capacity``). Entries another thread consumed meanwhile are
        not consumed again. ``check_parameters``: the device's count of non-finite parameters, asked once per run
        of skipped iterations (`polyamp._src.skip_streak`)."""
        with self.lock:
            self._consume(count, codes, config, read_state, check_parameters)

    def _consume(
        self,
        count: int,
        codes: Sequence[int],
        config: LossScaleConfig,
        read_state: Callable[[], LossScaleState | None],
        check_parameters: ParameterCheck | None,
    ) -> None:
        new = count - self.read_count
        if new <= 0:
            return
        kept = list(codes)[-new:] if new <= len(codes) else list(codes)
        missing = new - len(kept)
        state = self.anchor
        if missing:
            self.lost += missing
            logger.warning(
                "polyamp: %d iterations ended without being recorded: more than history=%d iterations passed "
                "between two reads of the records. Read them more often (scaler.records(), the Keras "
                "LossScaleCallback) or pass a larger history=.",
                missing,
                self.capacity,
            )
            state = None
        first = count - len(kept)
        self.tally.unrecorded(first)
        skipped = [bool(code & 1) and not code & SPIKE_BIT for code in kept]
        self.streak.read(first, skipped, check_parameters, continued=not missing)
        offset = 0
        while offset < len(kept):
            code = kept[offset]
            if code == 0:  # the common case, a run at a time: scaling iterations that stepped
                end = offset + 1
                while end < len(kept) and kept[end] == 0:
                    end += 1
                steps = end - offset
                run = _Run(first + offset, steps, state, config)
                self.tally.add_run(first + offset, steps, state, config)
                if self._collapsed:  # the records may end the collapse episode: made and reported now
                    for record in run.made():
                        self._keep(record, 1)
                        self._report(record, config)
                else:
                    self._keep(run, steps)  # (which may drop the run's oldest)
                if state is not None:
                    state = config.after_finite(state, steps)
                offset = end
                continue
            iteration = first + offset
            offset += 1
            before = state
            if state is not None:
                state = advance(config, state, code)
            rebased = bool(code & REBASE_BIT)
            spiked = bool(code & SPIKE_BIT)
            code &= SPIKE_BIT - 1
            base = code - code % 2
            mode = _MODE_NAMES[base]
            flagged = code % 2 == 1
            scaled = mode in ("scaling", "set")
            record = StepRecord(
                iteration=iteration,
                skipped=flagged,
                reason=(self.spike_reason if spiked else "overflow" if scaled else "non_finite") if flagged else None,
                mode="scaling" if scaled else mode,
                scale=None if not scaled or before is None else before.scale,
                # update(new_scale) sets the scale after the iteration (known when it was a float); the scaler
                # re-anchors there
                next_scale=self.set_scales.pop(iteration, None)
                if mode == "set"
                else None
                if mode != "scaling" or state is None
                else state.scale,
                gradients=self.gradients.pop(iteration, ()) if flagged and not spiked else (),
                rebased=rebased and not flagged,
            )
            self._keep(record, 1)
            self.tally.add(record)
            self._report(record, config)
        self.read_count = count
        for stale in [i for i in self.gradients if i < count]:
            del self.gradients[stale]
        for stale in [i for i in self.set_scales if i < count]:
            del self.set_scales[stale]
        if state is None:
            state = read_state()
            if state is not None:
                self.tally.now(state)
        self.anchor = state

    def _log_skip(self, record: StepRecord, reason: str) -> None:
        level = logging.INFO if reason == "overflow" else logging.WARNING
        streak = self.streak
        text = streak.skip_line(record.iteration, reason) if streak.explains(record.iteration) else record.message()
        count = self._skip_counts.get(reason, 0) + 1
        self._skip_counts[reason] = count
        if count <= LOGGED_SKIPS:
            tail = ""
            if count == LOGGED_SKIPS:
                tail = (
                    f" (The first {LOGGED_SKIPS} {reason} skips are logged one line each; further ones are "
                    "summarised when their count reaches 16, 32, 64, ...; records() has each.)"
                )
            logger.log(level, "polyamp: %s%s", text, tail)
            return
        first = self._quiet_since.setdefault(reason, record.iteration)
        if count & (count - 1):
            return  # not a power of two: summarised later
        del self._quiet_since[reason]
        since = count - max(LOGGED_SKIPS, count // 2)
        logger.log(
            level,
            "polyamp: %d steps skipped (%s) so far, %d since the last such line, in iterations %d to %d "
            "(records() has each; the next summary comes at %d). The last one: %s",
            count,
            reason,
            since,
            first,
            record.iteration,
            2 * count,
            text,
        )

    def _report(self, record: StepRecord, config: LossScaleConfig) -> None:
        if record.rebased:
            logger.warning("polyamp: %s", record.message())
        if not record.skipped and not self._collapsed:
            return  # an applied step outside a collapse episode: nothing to log, nothing to re-arm
        if record.skipped and record.reason is not None:
            self._log_skip(record, record.reason)
        if record.mode != "scaling" or record.next_scale is None or not config.dynamic:
            return
        at_floor = record.next_scale <= config.floor_f32 and record.reason == "overflow"
        if record.next_scale > config.floor_f32:
            self._collapsed = False
        if not at_floor or self._collapsed:
            return
        self._collapsed = True
        floor = "min_scale" if config.min_scale is not None else "the floor of 1.0 (no min_scale given)"
        text = (
            f"polyamp: the loss scale collapsed: iteration {record.iteration} overflowed at scale "
            f"{_fmt(record.scale)} and the scale reached {floor}, {config.floor_f32:g}. Steps keep being skipped "
            f"while gradients overflow even at this scale. {_COLLAPSE_CAUSES}"
        )
        if self.on_min_scale == "raise":
            raise ScaleCollapseError(text + " (on_min_scale='raise'; 'warn' logs this instead.)")
        if self.on_min_scale == "warn":
            logger.warning("%s", text)
