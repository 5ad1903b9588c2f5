"""The spike rule of a `polyamp_keras._device.KerasDevice`: its window in variables and the decision's device
operations (`polyamp.backend_api.SpikeDevice`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyamp import SpikeRule
from polyamp_keras._device_variables import DeviceVariables, _Slot
from polyamp_keras._keras import keras
from polyamp_keras._spikes import SpikeWindow, grad_norm, loss_statistic

__all__ = ["SpikeMethods", "finish_window"]

ops = keras.ops


class SpikeMethods(DeviceVariables):
    """The spike rule's device operations, over the windows this device holds."""

    def new_spike_state(self, rule: SpikeRule) -> _Slot:
        """The rule's window (its variables made now, or by `build` on an owned device); the loss statistic is
        the core's to hold."""
        slot = _Slot()
        self._windows.append((slot, rule))
        if self._variables is not None or not self._owned:
            self._build_window(slot, rule)
        return slot

    def _build_window(self, slot: _Slot, rule: SpikeRule) -> None:
        if slot.value is not None:
            return
        slot.value = SpikeWindow(rule, self._add_variable)
        if slot.pending is not None:
            slot.value.write(*slot.pending)
            slot.pending = None

    def read_spike_window(self, state: _Slot) -> list[float]:
        return (
            list(state.pending[0])
            if state.value is None and state.pending
            else ([] if state.value is None else state.value.read())
        )

    def read_spike_run(self, state: _Slot) -> int:
        if state.value is None:
            return int(state.pending[1]) if state.pending else 0
        return int(state.value.read_run())

    def write_spike_window(self, state: _Slot, values: list[float], run: int = 0) -> None:
        if state.value is None:
            state.pending = (list(values), run)
        else:
            state.value.write(values, run)

    def spike_statistic(self, loss: Any) -> Any:
        return loss_statistic(loss)

    def spike_grad_norm(self, grads: Sequence[Any], *, unscaled: bool) -> Any:
        return grad_norm(grads, None if unscaled else self.scale_value())

    def spike_check(self, state: _Slot, x: Any) -> Any:
        return ops.cast(state.value.is_spike(x), "float32")

    def spike_finish(self, state: _Slot, x: Any, spike: Any, overflow: Any) -> Any:
        return finish_window(state.value, x, spike, overflow)


def finish_window(window: SpikeWindow, x: Any, spike: Any, overflow: Any) -> Any:
    """End an iteration for the spike rule (`polyamp.backend_api.SpikeDevice.spike_finish`): the statistic
    enters ``window`` when the step was applied; returns 1 for a skip by the rule alone, -1 for a re-base."""
    return window.finish(x, spike, overflow)
