"""A run in one line: how many steps, which were skipped and why, where the loss scale went.

`RunSummary` is what every scaler's ``summary()`` returns (`polyamp.LossScaler.summary`, the Keras
``LossScaleOptimizer.summary``, `polyamp.FunctionalLossScaler.summary`, ``polyamp_jax.summary``); ``str()`` of it
is one line, e.g. ``"200 steps, 5 skipped (overflow at 50, 51, 120-122), scale 2^16 -> 2^13"``.

`RunTally` builds it from the step records (`polyamp.StepRecord`): a scaler's `Recorder` hands it every record
it makes, so a summary covers the whole run, not only the ``history`` records kept. It keeps the skipped
iterations as ranges and the scale, the mode and the named layers where they change, so its size follows the
skips and the scale's changes, not the steps.

`log_every` is the logging hook the backends expose (``polyamp_torch.log_summary``, ``polyamp_jax.log_summary``):
it reads the records every ``every`` steps and does nothing in between.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polyamp._src.errors import PolyampTypeError, PolyampValueError, describe
from polyamp._src.scaling import LossScaleConfig, LossScaleState

if TYPE_CHECKING:
    from polyamp._src.records import StepRecord

__all__ = ["RunSummary", "RunTally", "log_every"]

#: How many iterations (or ranges of them) a reason lists before eliding the middle.
_LISTED = 6
#: How many layers the line names.
_NAMED_LAYERS = 5


@dataclass(frozen=True)
class RunSummary:
    """A run's step records in a few numbers; ``str(summary)`` is one line.

    Attributes:
        first: The first iteration summarised (0 unless the run was resumed from a Keras weights file, or a
            functional state's older records were lost).
        steps: How many iterations it covers (``first`` to ``first + steps - 1``).
        skips: The skipped iterations by reason (``"overflow"``, ``"non_finite"``, ``"loss_spike"``,
            ``"grad_spike"``), as ranges of consecutive iterations, in the order the reasons first occurred.
        scale_start, scale_end: The loss scale of the first scaled iteration, and the scale now (after the last
            iteration's update); None when no iteration scaled or the scale could not be told.
        scale_min, scale_max: The smallest and largest scale along the way (None likewise).
        modes: How many iterations ran in each mode: ``"scaling"``, ``"guarding"`` (checked without scaling,
            the bfloat16 and float32 policies) or ``"off"``.
        layers: The layers (modules) named by the skipped steps' non-finite gradients, in the order they first
            occurred (empty where the backend could not tell, see `polyamp.StepRecord.gradients`).
        unrecorded: Iterations that ended without a record (more than ``history`` between two reads).

    >>> from polyamp.backend_api.records import RunSummary
    >>> summary = RunSummary(0, 200, {"overflow": (range(50, 52), range(120, 123))}, 65536.0, 8192.0, 8192.0,
    ...                      65536.0, {"scaling": 200})
    >>> print(summary)
    200 steps, 5 skipped (overflow at 50, 51, 120-122), scale 2^16 -> 2^13
    >>> summary.skipped, summary.iterations()
    (5, [50, 51, 120, 121, 122])
    """

    first: int
    steps: int
    skips: Mapping[str, tuple[range, ...]]
    scale_start: float | None
    scale_end: float | None
    scale_min: float | None
    scale_max: float | None
    modes: Mapping[str, int]
    layers: tuple[str, ...] = ()
    unrecorded: int = 0

    @classmethod
    def of(cls, records: Iterable[StepRecord]) -> RunSummary:
        """The summary of ``records`` (`polyamp.StepRecord`, oldest first); iterations missing between them count
        as unrecorded."""
        tally: RunTally | None = None
        for record in records:
            if tally is None:
                tally = RunTally(record.iteration)
            tally.add(record)
        return (tally or RunTally()).summary()

    @property
    def skipped(self) -> int:
        """How many iterations skipped their step."""
        return sum(len(r) for ranges in self.skips.values() for r in ranges)

    def iterations(self, reason: str | None = None) -> list[int]:
        """The skipped iterations (of ``reason`` only, when given), in order."""
        return sorted(i for name, ranges in self.skips.items() if reason in (None, name) for r in ranges for i in r)

    def __str__(self) -> str:
        if self.steps == 0:
            return "no steps recorded"
        parts = [f"{self.steps} step{'' if self.steps == 1 else 's'}"]
        if self.first:
            parts[0] += f" (iterations {self.first}-{self.first + self.steps - 1})"
        parts.append(self._skipped_text())
        parts.append(self._scale_text())
        if self.layers:
            named = ", ".join(self.layers[:_NAMED_LAYERS])
            more = len(self.layers) - _NAMED_LAYERS
            parts.append(f"non-finite gradients in {named}" + (f" and {more} more" if more > 0 else ""))
        if self.unrecorded:
            parts.append(f"{self.unrecorded} not recorded")
        return ", ".join(parts)

    def brief(self) -> str:
        """The skips and the scale now, for a progress bar's postfix: ``"5 skipped, scale 2^13"``."""
        text = f"{self.skipped} skipped"
        if self.modes.get("scaling") and self.scale_end is not None:
            text += f", scale {_scale(self.scale_end)}"
        return text

    def _skipped_text(self) -> str:
        if not self.skips:
            return "none skipped"
        counted = len(self.skips) > 1
        details = []
        for reason, ranges in self.skips.items():
            listed, elided = _listed(ranges)
            count = sum(len(r) for r in ranges)
            details.append(f"{count} {reason} at {listed}" if counted or elided else f"{reason} at {listed}")
        return f"{self.skipped} skipped ({'; '.join(details)})"

    def _scale_text(self) -> str:
        scaled = self.modes.get("scaling", 0)
        guarded = self.modes.get("guarding", 0)
        if not scaled:
            return "no loss scaling (gradients checked)" if guarded else "no loss scaling or checks"
        start, end, low, high = self.scale_start, self.scale_end, self.scale_min, self.scale_max
        if start is None or end is None or low is None or high is None:
            text = "scale unknown"
        else:
            text = f"scale {_scale(start)}" if start == end else f"scale {_scale(start)} -> {_scale(end)}"
            bounds = [f"min {_scale(low)}"] if low < min(start, end) else []
            bounds += [f"max {_scale(high)}"] if high > max(start, end) else []
            if bounds:
                text += f" ({', '.join(bounds)})"
        if guarded:
            text += f", {guarded} guarded without scaling"
        return text


def _scale(value: float) -> str:
    """``2^k`` for a power of two (``1`` for 1.0), else the number."""
    mantissa, exponent = math.frexp(value)
    if mantissa == 0.5:
        return "1" if exponent == 1 else f"2^{exponent - 1}"
    return f"{value:g}"


def _listed(ranges: tuple[range, ...]) -> tuple[str, bool]:
    """The iterations of ``ranges`` as text (two in a row listed, three or more as a range), the middle elided
    past `_LISTED`; and whether it was."""
    parts: list[str] = []
    for r in ranges:
        parts += [str(i) for i in r] if len(r) <= 2 else [f"{r.start}-{r[-1]}"]
    if len(parts) <= _LISTED + 1:
        return ", ".join(parts), False
    return ", ".join([*parts[:_LISTED], "...", parts[-1]]), True


class RunTally:
    """What a `RunSummary` needs from every record of a run, fed record by record (`add`) or by runs of
    scaling iterations that stepped (`add_run`, which are not made into records unless read).

    Args:
        first: The run's first iteration.
    """

    def __init__(self, first: int = 0) -> None:
        self.first = first
        self.end = first  # one past the last iteration added
        self._skips: list[list[Any]] = []  # [reason, start, stop): consecutive skips of one reason, by start
        self._scales: list[tuple[int, float]] = []  # (iteration, the scale from it on), where it changed
        # (iteration, the mode from it on), where it changed; "unrecorded" for iterations without a record
        self._modes: list[tuple[int, str]] = []
        self._layers: list[tuple[int, tuple[str, ...]]] = []  # skipped iterations' layers

    def unrecorded(self, stop: int) -> None:
        """The iterations up to ``stop`` ended without a record."""
        if stop > self.end:
            self._mode_from(self.end, "unrecorded")
            self.end = stop

    def add(self, record: StepRecord) -> None:
        """One record (the next iteration, or a later one: those between are unrecorded)."""
        iteration = record.iteration
        self.unrecorded(iteration)
        self._mode_from(iteration, record.mode)
        if record.scale is not None:
            self._scale_from(iteration, record.scale)
        if record.next_scale is not None:
            self._scale_from(iteration + 1, record.next_scale)
        if record.skipped and record.reason is not None:
            last = self._skips[-1] if self._skips else None
            if last is not None and last[0] == record.reason and last[2] == iteration:
                last[2] = iteration + 1
            else:
                self._skips.append([record.reason, iteration, iteration + 1])
            self.add_layers(iteration, record.layers)
        self.end = iteration + 1

    def add_run(self, first: int, steps: int, state: LossScaleState | None, config: LossScaleConfig) -> None:
        """``steps`` scaling iterations that stepped, from ``first``, the first at ``state`` (None: unknown)."""
        self.unrecorded(first)
        self._mode_from(first, "scaling")
        if state is not None:
            self._scale_from(first, state.scale)
            if config.dynamic:  # a finite run only grows: one point per growth, every growth_interval steps
                interval = config.growth_interval
                scale, at = state.scale, first + max(1, interval - state.growth_tracker)
                while at <= first + steps:
                    grown = config.next_state(LossScaleState(scale, interval - 1, config.hysteresis), False).scale
                    if grown == scale:
                        break  # at the cap: no further growth changes it
                    scale = grown
                    self._scale_from(at, scale)
                    at += interval
        self.end = first + steps

    def add_layers(self, iteration: int, layers: tuple[str, ...]) -> None:
        """The layers named by ``iteration``'s non-finite gradients (also those counted after its record)."""
        if layers:
            bisect.insort(self._layers, (iteration, layers))

    def rewind(self, iteration: int, state: LossScaleState | None) -> None:
        """Forget the iterations from ``iteration`` on (they run again, from ``state``; None: unknown)."""
        self._skips = [
            [reason, start, min(stop, iteration)] for reason, start, stop in self._skips if start < iteration
        ]
        self._scales = [point for point in self._scales if point[0] < iteration]
        self._modes = [point for point in self._modes if point[0] < iteration]
        self._layers = [entry for entry in self._layers if entry[0] < iteration]
        self.end = max(self.first, min(self.end, iteration))
        if state is not None:
            self.now(state)

    def now(self, state: LossScaleState) -> None:
        """The rule's state after the last iteration added, read from the device where the records could not
        replay it: the scale now, when that iteration scaled."""
        if self._modes and self._modes[-1][1] == "scaling" and self.end > self.first:
            self._scale_from(self.end, state.scale)

    def _scale_from(self, iteration: int, scale: float) -> None:
        points = self._scales
        if points and points[-1][0] == iteration:
            points[-1] = (iteration, scale)
            if len(points) > 1 and points[-2][1] == scale:
                points.pop()
        elif not points or points[-1][1] != scale:
            points.append((iteration, scale))

    def _mode_from(self, iteration: int, mode: str) -> None:
        if not self._modes or self._modes[-1][1] != mode:
            self._modes.append((iteration, mode))

    def _mode_at(self, iteration: int) -> str | None:
        index = bisect.bisect_right(self._modes, iteration, key=lambda point: point[0])
        return self._modes[index - 1][1] if index else None

    def summary(self, upto: int | None = None) -> RunSummary:
        """The summary of the iterations added, up to (not including) ``upto`` when given."""
        stop = self.end if upto is None else max(self.first, min(self.end, upto))
        skips: dict[str, tuple[range, ...]] = {}
        for reason, start, end in self._skips:
            if start < stop:
                skips[reason] = (*skips.get(reason, ()), range(start, min(end, stop)))
        # the scale at `stop` is the one after the last iteration's update, when that iteration scaled
        last_scaled = stop > self.first and self._mode_at(stop - 1) == "scaling"
        scales = [scale for iteration, scale in self._scales if iteration < stop or (iteration == stop and last_scaled)]
        modes: dict[str, int] = {}
        for index, (iteration, mode) in enumerate(self._modes):
            until = self._modes[index + 1][0] if index + 1 < len(self._modes) else stop
            if iteration < stop:
                modes[mode] = modes.get(mode, 0) + min(until, stop) - iteration
        unrecorded = modes.pop("unrecorded", 0)
        layers = tuple(dict.fromkeys(layer for iteration, named in self._layers if iteration < stop for layer in named))
        return RunSummary(
            first=self.first,
            steps=stop - self.first,
            skips=skips,
            scale_start=scales[0] if scales else None,
            scale_end=scales[-1] if scales else None,
            scale_min=min(scales) if scales else None,
            scale_max=max(scales) if scales else None,
            modes=modes,
            layers=layers,
            unrecorded=unrecorded,
        )


def log_every(
    read: Callable[[], RunSummary],
    step: object,
    every: object,
    progress: Any = None,
    write: Callable[[str], object] | None = None,
) -> RunSummary | None:
    """The logging hook's rule, for every backend: after iteration ``step`` (from 0), when ``step + 1`` is a
    multiple of ``every``, ``read()`` the summary and show it: as ``progress``'s postfix (a tqdm bar:
    ``set_postfix_str``), and through ``write`` (default: ``print``, unless a bar is given); return it. Any other
    step returns None and reads nothing.

    Raises:
        PolyampTypeError / PolyampValueError: ``step`` or ``every`` is not a count, or ``progress`` has no
            ``set_postfix_str``.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise PolyampTypeError(
            f"`step` must be the index of the iteration that just ended, an int from 0 (a Python int: a device "
            f"value would be read to the host every step). Received: {describe(step)}."
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise PolyampValueError(
            f"`every` must be an int of at least 1: the summary is read and shown every `every` steps. "
            f"Received: {describe(every)}."
        )
    if progress is not None and not callable(getattr(progress, "set_postfix_str", None)):
        raise PolyampTypeError(
            f"`progress` must be a progress bar with set_postfix_str, such as a tqdm bar, or None. "
            f"Received: {describe(progress)}."
        )
    if (step + 1) % every:
        return None
    summary = read()
    if progress is not None:
        progress.set_postfix_str(summary.brief())
    if write is not None:
        write(f"polyamp: {summary}")
    elif progress is None:
        print(f"polyamp: {summary}", flush=True)
    return summary
