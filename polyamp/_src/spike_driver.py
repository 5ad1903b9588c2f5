"""The iteration's side of a `polyamp.SpikeRule`: its statistic, its decision and its window, on a device.

The rule itself (`polyamp.SpikeRule`, `polyamp._src.spikes`) is pure: given a window and a statistic, is it a
spike? `SpikeDriver` runs it for one scaler: it takes the iteration's statistic (the loss given to ``scale``,
or the unscaled gradients' norm at the first step), asks the device for the decision once per iteration (the
same flag for every optimizer of the iteration), and at the end of the iteration lets the statistic into the
window when the step was applied. The window (its values and ``run``, the spikes since a value last entered
it) is read and written for state dicts and pickles; a window loaded before the scaler bound waits here until
the device's window exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyamp._src.backend import Flag, SpikeDevice
from polyamp._src.errors import ScalerUsageError
from polyamp._src.spikes import SpikeRule

__all__ = ["SpikeDriver"]


class SpikeDriver:
    """One scaler's spike rule across iterations (a driver with ``rule=None`` decides nothing)."""

    __slots__ = ("_device", "_pending_run", "_pending_window", "_state", "flag", "rule", "x")

    def __init__(self, rule: SpikeRule | None, window: list[float] | None = None, run: int = 0) -> None:
        self.rule = rule
        self._device: SpikeDevice | None = None
        self._state: Any = None
        self._pending_window = window  # loaded before the scaler bound
        self._pending_run = run
        #: The iteration's statistic (a device scalar) and decision (a device flag), None until known.
        self.x: Any = None
        self.flag: Flag | None = None

    def bind(self, device: SpikeDevice) -> None:
        """Make the rule's window on ``device`` (holding a window loaded before)."""
        if self.rule is None:
            return
        self._device = device
        self._state = device.new_spike_state(self.rule)
        pending, self._pending_window = self._pending_window, None
        self.write_window(pending, self._pending_run)

    def observe_loss(self, loss: Any) -> None:
        """Take ``loss`` as the iteration's statistic, for a rule on the loss."""
        if self.rule is not None and self.rule.on == "loss" and self._device is not None:
            self.x = self._device.spike_statistic(loss)

    def decide(self, grad_norm: Callable[[], Any]) -> Flag | None:
        """The iteration's decision, made at its first step and the same for every optimizer of the iteration
        (None without a rule). ``grad_norm()`` gives the statistic of a ``"grad_norm"`` rule.

        Raises:
            ScalerUsageError: a loss rule has no loss (``scale`` was not called), or a gradient-norm rule sees a
                second optimizer in one iteration.
        """
        rule = self.rule
        if rule is None or self._device is None:
            return None
        if self.flag is None:
            if rule.on == "grad_norm":
                self.x = grad_norm()
            elif self.x is None:
                raise ScalerUsageError(
                    "A SpikeRule('loss') needs the iteration's loss: call scaler.scale(loss) (and backpropagate "
                    "it) before stepping, in every iteration."
                )
            self.flag = self._device.spike_check(self._state, self.x)
        elif rule.on == "grad_norm":
            raise ScalerUsageError(
                "A SpikeRule('grad_norm') watches the gradients of one optimizer per iteration; this iteration "
                "steps a second one. Use SpikeRule('loss') with several optimizers."
            )
        return self.flag

    def finish(self, overflow: Flag | None) -> Flag | None:
        """End the iteration: the statistic enters the window if the step was applied. Returns the flag of a
        skip by the rule alone (None when the rule decided nothing this iteration); counting it is the
        caller's."""
        flag, x = self.flag, self.x
        self.reset()
        if flag is None or self._device is None:
            return None
        return self._device.spike_finish(self._state, x, flag, overflow)

    def reset(self) -> None:
        """Forget the iteration's statistic and decision."""
        self.x = None
        self.flag = None

    def read_window(self) -> list[float] | None:
        """The window's values, oldest first (None without a rule; one host read when bound)."""
        if self.rule is None:
            return None
        if self._device is None:
            return list(self._pending_window or [])
        return list(self._device.read_spike_window(self._state))

    def read_run(self) -> int:
        """The window's ``run``: the spikes since a statistic last entered it (0 without a rule)."""
        if self.rule is None:
            return 0
        if self._device is None:
            return self._pending_run
        return int(self._device.read_spike_run(self._state))

    def write_window(self, values: list[float] | None, run: int = 0) -> None:
        """Make the window hold ``values`` and ``run`` (validated by the caller); None leaves it as it is."""
        if values is None or self.rule is None:
            return
        if self._device is None:
            self._pending_window = values  # written into the device's window when the scaler binds
            self._pending_run = run
            return
        self._device.write_spike_window(self._state, values, run)
