"""`SpikeRule`: skip a step whose loss or gradient norm is an outlier against the recent ones.

The rule, exactly (the backends compute it on the device in float64; `SpikeRule.decide` is the reference):

* The statistic ``x`` of an iteration is its loss (``on="loss"``: the value passed to ``scale``, summed when
  several are) or the global L2 norm of its unscaled gradients (``on="grad_norm"``; one optimizer per
  iteration).
* The window holds the statistics of the last ``window`` iterations whose step was *applied*; iterations
  skipped for any reason (overflow, non-finite, spike) and non-finite statistics never enter it.
* With ``n`` values in the window, ``mu`` their mean and ``sigma`` their population standard deviation
  (``sqrt(mean((v - mu)**2))``), the iteration is a spike when ``n >= warmup``, ``sigma > 0`` and
  ``x - mu > threshold * sigma`` (one-sided: only upward spikes; ``two_sided=True`` uses ``|x - mu|``).
  A non-finite ``x`` is never a spike: the overflow check and the guard handle it.
* A spike skips the step like an overflow (parameters, slots and counters unchanged, ``step_skipped``
  true, counted in ``skipped_steps``, recorded with reason ``"loss_spike"`` / ``"grad_spike"``), but the
  loss-scale rule sees a finite iteration: the scale does not back off for it.
* The window also counts ``run``, the spikes since a statistic last entered it (iterations skipped for another
  reason, and non-finite statistics, leave it unchanged). With ``max_consecutive`` set (the default:
  ``max(1, window // 2)``), an iteration with ``run >= max_consecutive`` is never a spike: the loss or norm
  settled at a new level. If its step is applied and ``x`` is finite, the window *re-bases*: it is emptied,
  then ``x`` enters it (so decisions resume once ``warmup`` values of the new level are in), ``run`` returns to
  0, the record says ``rebased=True`` and ``logging.getLogger("polyamp")`` warns once. ``max_consecutive=None``
  never re-bases: a lasting shift then skips every later step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from polyamp._src.errors import PolyampValueError, describe, type_error
from polyamp._src.records import SkipReason

__all__ = ["MAX_WINDOW", "SpikeRule", "check_spike"]

_ON = ("loss", "grad_norm")
#: The largest ``window`` (and ``warmup``) a `SpikeRule` accepts: the window is a device buffer that every step
#: reduces, so its size is its cost.
MAX_WINDOW: Final = 65_536


@dataclass(frozen=True)
class SpikeRule:
    """Skip steps whose loss (``on="loss"``) or gradient norm (``on="grad_norm"``) is an outlier.

    Args:
        on: "loss" or "grad_norm".
        window: How many applied iterations the statistics come from (default 128; 2 to `MAX_WINDOW`,
            65,536).
        threshold: The z-score above which an iteration is a spike (default 6.0).
        warmup: How many values the window must hold before any decision (default: ``window``).
        two_sided: Also skip downward outliers (a bool; default False: only upward spikes).
        max_consecutive: After this many consecutive spikes the next statistic is accepted and the window
            re-bases at it (a lasting level shift, not an outlier; see the module's rule). ``"auto"`` (default):
            ``max(1, window // 2)``; an int >= 1; None: never (every step after a lasting shift is skipped).

    Raises:
        PolyampValueError: (a ``ValueError``) an argument is out of its range (the message says which, and what
            is allowed).
        PolyampTypeError: (a ``TypeError``) ``two_sided`` is not a bool.

    >>> rule = SpikeRule("loss", window=4, threshold=3.0)
    >>> rule.decide([1.0, 1.1, 0.9, 1.0, 5.0, 1.05, 1.0])
    [False, False, False, False, True, False, False]
    """

    on: str = "loss"
    window: int = 128
    threshold: float = 6.0
    warmup: int | None = None
    two_sided: bool = False
    max_consecutive: int | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.on, str) or self.on not in _ON:
            raise PolyampValueError(
                f"SpikeRule(on=...) must be 'loss' or 'grad_norm'. Received: {describe(self.on)}. 'loss' watches "
                "the value passed to scale(); 'grad_norm' the global norm of the unscaled gradients."
            )
        for name, value in (("window", self.window), ("warmup", self.warmup)):
            if value is None and name == "warmup":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= MAX_WINDOW:
                raise PolyampValueError(
                    f"SpikeRule({name}=...) must be an int from 2 to {MAX_WINDOW:,}. Received: {describe(value)}. "
                    f"The window lives on the device and is read every step; {MAX_WINDOW:,} applied steps are "
                    "far more than an outlier test needs (the default is 128)."
                )
        if self.warmup is not None and self.warmup > self.window:
            raise PolyampValueError(
                f"SpikeRule(warmup={self.warmup}) cannot exceed window={self.window}: the window never holds more "
                "values than its size, so no step would ever be checked."
            )
        threshold = self.threshold
        try:
            usable = (
                not isinstance(threshold, bool)
                and isinstance(threshold, (int, float))
                and math.isfinite(threshold)
                and threshold > 0
            )
        except OverflowError:  # an int beyond float's range, e.g. 10**400
            usable = False
        if not usable:
            raise PolyampValueError(
                f"SpikeRule(threshold=...) must be a finite positive number (a z-score), e.g. threshold=6.0. "
                f"Received: {describe(threshold)}."
            )
        if not isinstance(self.two_sided, bool):
            raise type_error(
                "`SpikeRule(two_sided=...)`",
                "a bool",
                self.two_sided,
                fix="Pass True to also skip downward outliers, False (default) for upward spikes only.",
            )
        _check_max_consecutive(self.max_consecutive)

    @property
    def reason(self) -> SkipReason:
        """The skip reason of this rule's spikes: ``"loss_spike"`` or ``"grad_spike"``."""
        return "loss_spike" if self.on == "loss" else "grad_spike"

    @property
    def min_values(self) -> int:
        """``warmup``, or ``window`` when not given."""
        return self.window if self.warmup is None else self.warmup

    @property
    def consecutive_limit(self) -> int | None:
        """``max_consecutive`` resolved: ``max(1, window // 2)`` for ``"auto"``; None: no bound."""
        if self.max_consecutive == "auto":
            return max(1, self.window // 2)
        return self.max_consecutive

    def rebases(self, run: int) -> bool:
        """Whether ``run`` consecutive spikes reached the bound: the next statistic is accepted, re-basing."""
        limit = self.consecutive_limit
        return limit is not None and run >= limit

    def is_spike(self, window: Sequence[float], x: float, run: int = 0) -> bool:
        """The decision for statistic ``x`` given the window's values (oldest first), in float64, after ``run``
        consecutive spikes (at ``max_consecutive`` nothing is a spike).

        As on the devices, a sum or square beyond float64's range is inf, not an error: a window whose mean or
        standard deviation is not finite (values above ~1.3e154, whose squares overflow) decides no spike.
        """
        n = len(window)
        if n < self.min_values or not math.isfinite(x) or self.rebases(run):
            return False
        try:
            mu = math.fsum(window) / n
            # squares as float products (inf beyond float64's range, where ``** 2`` raises)
            sigma = math.sqrt(math.fsum((v - mu) * (v - mu) for v in window) / n)
        except OverflowError:  # a sum beyond float64: inf on the devices, whose mean or sigma is then not finite
            return False
        if not (math.isfinite(sigma) and sigma > 0):
            return False
        deviation = abs(x - mu) if self.two_sided else x - mu
        return deviation > self.threshold * sigma

    def decide(self, values: Iterable[float], skipped_otherwise: Iterable[bool] | None = None) -> list[bool]:
        """The reference over a trace: whether each iteration is a spike. ``skipped_otherwise[i]`` marks
        iterations skipped for another reason (an overflow), which neither spike nor enter the window.

        A spike adds 1 to ``run``; an applied iteration with a finite statistic empties the window first when
        ``run`` reached ``max_consecutive`` (it re-bases), enters it and sets ``run`` to 0; anything else leaves
        both unchanged (`rebased` gives the iterations that re-based).
        """
        return [spike for spike, _ in self._trace(values, skipped_otherwise)]

    def rebased(self, values: Iterable[float], skipped_otherwise: Iterable[bool] | None = None) -> list[bool]:
        """Over the same trace as `decide`: whether each iteration re-based the window."""
        return [rebase for _, rebase in self._trace(values, skipped_otherwise)]

    def _trace(self, values: Iterable[float], skipped_otherwise: Iterable[bool] | None) -> list[tuple[bool, bool]]:
        values = list(values)
        other = [False] * len(values) if skipped_otherwise is None else list(skipped_otherwise)
        window: list[float] = []
        run = 0
        result = []
        for x, skipped in zip(values, other, strict=True):
            spike = not skipped and self.is_spike(window, x, run)
            rebase = False
            if spike:
                run += 1
            elif not skipped and math.isfinite(x):
                rebase = self.rebases(run)
                if rebase:
                    window.clear()
                window.append(x)
                if len(window) > self.window:
                    window.pop(0)
                run = 0
            result.append((spike, rebase))
        return result


def _check_max_consecutive(value: object) -> None:
    if value is None or (isinstance(value, str) and value == "auto"):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolyampValueError(
            f"SpikeRule(max_consecutive=...) must be an int >= 1, 'auto' (max(1, window // 2)) or None (never "
            f"re-base the window). Received: {describe(value)}."
        )


def check_spike(spike: object) -> SpikeRule | None:
    """Validate a ``spike`` argument: None or a `SpikeRule`."""
    if spike is not None and not isinstance(spike, SpikeRule):
        raise type_error("`spike`", "None or a polyamp.SpikeRule, e.g. SpikeRule('loss', window=128)", spike)
    return spike
