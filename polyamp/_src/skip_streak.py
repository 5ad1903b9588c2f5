"""Runs of skipped steps, and the one cause they cannot recover from: parameters that hold inf or NaN.

A skipped step leaves the parameters as they were, so once a parameter holds inf or NaN every later gradient
is non-finite and every later step is skipped, while the skip records point at the data or the learning rate.
`SkipStreak` follows the consecutive iterations skipped for non-finite gradients as the records are read, and
when such a run reaches `STREAK_CHECK` iterations and is still going at the end of a read, asks the device once
which parameters are non-finite (a pass over the parameters, paid only while steps are being skipped; the
parameters cannot change within the run, since its steps were all skipped). If some are, one warning says
which and what to do, and the run's skip lines say so instead of blaming the data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final

from polyamp._src.provenance import NonFiniteGradient, non_finite_gradients

__all__ = ["STREAK_CHECK", "ParameterCheck", "SkipStreak", "non_finite_parameters_message"]

logger = logging.getLogger("polyamp")

#: After how many consecutive iterations skipped for non-finite gradients the parameters are checked (once
#: per run of skips).
STREAK_CHECK: Final = 2
#: A device's count of the non-finite values of each parameter, ``(name, +inf, -inf, NaN, size)``, or None when
#: it cannot tell.
ParameterCheck = Callable[[], "Sequence[tuple[str, int, int, int, int]] | None"]


def non_finite_parameters_message(first: int, parameters: Sequence[NonFiniteGradient]) -> str:
    """What to say when the parameters themselves hold inf or NaN, every step since iteration ``first`` skipped."""
    shown = "; ".join(p.describe() for p in parameters[:8])
    more = f"; and {len(parameters) - 8} more" if len(parameters) > 8 else ""
    return (
        f"every step since iteration {first} was skipped because the parameters themselves hold inf or NaN: "
        f"{shown}{more}. A skipped step leaves them as they are, so every later gradient is non-finite and every "
        "later step will be skipped: neither the data nor the learning rate is the cause now, and loss scaling "
        f"cannot help. Restore the last checkpoint saved before iteration {first} (parameters and optimizer "
        "state), then look at the steps applied just before it (an optimizer state that overflowed, such as "
        "Adam's moments after a huge loss; a learning rate too high)."
    )


class SkipStreak:
    """The run of consecutive iterations skipped for non-finite gradients at the end of the records read so far,
    and the non-finite parameters found during it (empty: not checked, or all finite)."""

    __slots__ = ("checked", "first", "length", "parameters")

    def __init__(self) -> None:
        self.length = 0
        self.first = 0
        self.checked = False
        self.parameters: tuple[NonFiniteGradient, ...] = ()

    def read(self, first: int, skipped: Sequence[bool], check: ParameterCheck | None, *, continued: bool) -> None:
        """Follow a batch of iterations (``skipped[i]``: iteration ``first + i`` was skipped for non-finite
        gradients); ``continued``: the batch follows the last one without a gap. Checks the parameters when a run
        reaches `STREAK_CHECK` and goes on to the batch's end."""
        trailing = 0
        for flag in reversed(skipped):
            if not flag:
                break
            trailing += 1
        if continued and trailing == len(skipped):
            if self.length == 0:
                self.first = first
            self.length += trailing
        else:
            self.length, self.first, self.checked, self.parameters = (
                trailing,
                first + len(skipped) - trailing,
                False,
                (),
            )
        if self.length >= STREAK_CHECK and not self.checked and check is not None:
            self.checked = True
            entries = check()
            if entries:
                self.parameters = non_finite_gradients(entries)
                if self.parameters:
                    logger.warning("polyamp: %s", non_finite_parameters_message(self.first, self.parameters))

    def explains(self, iteration: int) -> bool:
        """Whether ``iteration``'s skip is one of the run's whose parameters were found non-finite."""
        return bool(self.parameters) and iteration >= self.first

    def skip_line(self, iteration: int, reason: str) -> str:
        """A skip's log line when the parameters are the cause."""
        names = ", ".join(p.name for p in self.parameters[:8]) + (", ..." if len(self.parameters) > 8 else "")
        return (
            f"iteration {iteration}: step skipped ({reason}): the parameters hold inf or NaN ({names}); restore a "
            f"checkpoint from before iteration {self.first}."
        )
