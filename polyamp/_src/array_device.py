"""`ArrayDevice`: the stateful device work that every eager array framework does alike.

A device form keeps the scale and its counters, the skip count, the step records and the spike window as
arrays of its framework and advances them with the core's device rules. For a framework whose arrays are
values that can be replaced eagerly (NumPy, CuPy, MLX, ...), that work is the same apart from the namespace,
so it is written here once over `ArrayOps`; a backend subclasses `ArrayDevice`, sets `ops`, and adds only
what is its framework's own: checking its objects, scaling a loss, unscaling gradients and taking the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from polyamp._src.errors import PolyampTypeError
from polyamp._src.records import ring_codes, ring_values
from polyamp._src.rules import codes, loss_scale, spike
from polyamp._src.rules._ops import ArrayOps
from polyamp._src.scaling import LossScaleConfig, LossScaleState
from polyamp._src.spikes import SpikeRule

__all__ = ["ArrayDevice", "SpikeWindow"]


class SpikeWindow:
    """A `polyamp.SpikeRule` and its window as arrays (`polyamp.backend_api.rules.SpikeWindowArrays`)."""

    def __init__(self, rule: SpikeRule, arrays: spike.SpikeWindowArrays) -> None:
        self.rule = rule
        self.arrays = arrays


class ArrayDevice:
    """The scale, the skip count, the step records and the spike window of a device form, as arrays of
    `ops`'s namespace; the loop's found-inf flags are float32 scalars (0 finite, 1 not).

    It implements the state and flag methods of `polyamp.backend_api.ScalerDevice` and the `GuardingDevice`,
    `RecordingDevice` and `SpikeDevice` groups but for ``spike_grad_norm``, whose gradients a loop style
    holds its own way (`gradient_norm` computes it); a subclass gives `loss_values` and the rest of its loop
    style's device form, with `inverse_scale` to hand.
    """

    #: The framework's namespace for the device rules.
    ops: ClassVar[ArrayOps]
    #: The framework's name in messages.
    framework: ClassVar[str] = "this framework"

    def __init__(self, config: LossScaleConfig, state: LossScaleState) -> None:
        self._config = config
        self._scale = self._scale_arrays(state)
        self._skipped = self.ops.asarray(0, "int64")
        self._codes: list[int] = []
        self._count = 0

    def _scale_arrays(self, state: LossScaleState) -> loss_scale.ScaleArrays:
        ops = self.ops
        return loss_scale.ScaleArrays(
            ops.asarray(state.scale, "float32"),
            ops.asarray(state.growth_tracker, "int32"),
            ops.asarray(state.hysteresis_left, "int32"),
        )

    def inverse_scale(self) -> Any:
        """The reciprocal of the scale, formed in double and rounded to float32 (as every backend unscales)."""
        return self.ops.asarray(1.0 / float(self._scale.scale), "float32")

    def loss_values(self, loss: Any) -> list[Any]:
        """The loss (or each of a list of losses) as the float64 values the spike statistic reads."""
        raise NotImplementedError

    # -- the state and the flags ----------------------------------------------------------------------------

    def read_state(self) -> LossScaleState:
        scale, tracker, hysteresis_left = self._scale
        return LossScaleState(float(scale), int(tracker), int(hysteresis_left))

    def write_state(self, config: LossScaleConfig, state: LossScaleState | None) -> None:
        self._config = config
        if state is not None:
            self._scale = self._scale_arrays(state)

    def combine(self, flags: Sequence[Any]) -> Any:
        return self.ops.astype(self.ops.sum(self.ops.stack(flags)) > 0, "float32")

    def read_new_scale(self, new_scale: Any) -> float | None:
        raise PolyampTypeError(
            f"{self.framework}'s update(new_scale) takes a float; received {type(new_scale).__name__}. Pass "
            "the new scale as a Python float."
        )

    def update(self, found_inf: Any, new_scale: Any) -> None:
        if new_scale is not None:
            self._scale = self._scale._replace(scale=self.ops.asarray(new_scale, "float32"))
        else:
            with self.ops.quiet():  # a product beyond float32 is inf, which the rule does not keep
                self._scale = loss_scale.advance(self.ops, self._config, self._scale, found_inf > 0)
        self.count_skip(found_inf)

    def skipped(self, found_inf: Any) -> Any:
        return found_inf > 0

    def read_flag(self, found_inf: Any) -> bool:
        return bool(found_inf > 0)

    def finite_flag(self) -> Any:
        return self.ops.asarray(0.0, "float32")

    def new_record(self) -> list[Any]:
        return [self.finite_flag()]

    def write_record(self, record: list[Any], found_inf: Any) -> None:
        record[0] = found_inf

    def read_record(self, record: list[Any]) -> Any:
        return record[0]

    def skipped_steps(self) -> Any:
        return self._skipped

    def count_skip(self, flag: Any) -> None:
        if flag is not None:
            self._skipped = self._skipped + self.ops.astype(flag > 0, "int64")

    # -- the step records -------------------------------------------------------------------------------------

    def new_history(self, capacity: int) -> list[int]:
        self._codes = [0] * capacity
        self._count = 0
        return self._codes

    def write_history(self, history: list[int], base: int, flag: Any, spike: Any = None) -> None:
        overflow = None if flag is None else flag > 0
        history[self._count % len(history)] = int(codes.record_code(self.ops, base, overflow, spike))
        self._count += 1

    def read_history(self, history: list[int]) -> tuple[int, list[int]]:
        return self._count, ring_codes(self._count, list(history))

    # -- the spike rule ---------------------------------------------------------------------------------------

    def new_spike_state(self, rule: SpikeRule) -> SpikeWindow:
        return SpikeWindow(rule, self._window_arrays(rule, [], 0))

    def spike_statistic(self, loss: Any) -> Any:
        return spike.loss_statistic(self.ops, [self.ops.asarray(v, "float64") for v in self.loss_values(loss)])

    def gradient_norm(self, grads: Sequence[Any], *, unscaled: bool) -> Any:
        """The spike rule's gradient norm of ``grads`` (divided by the scale unless ``unscaled``)."""
        with self.ops.quiet():
            norm = spike.grad_norm(self.ops, [g for g in grads if g is not None])
        return norm if unscaled else norm / float(self._scale.scale)

    def spike_check(self, state: SpikeWindow, x: Any) -> Any:
        with self.ops.quiet():  # an inf window's mean and spread, as on a device
            return self.ops.astype(spike.is_spike(self.ops, state.rule, state.arrays, x), "float32")

    def spike_finish(self, state: SpikeWindow, x: Any, flag: Any, overflow: Any) -> Any:
        overflowed = None if overflow is None else overflow > 0
        state.arrays, only, rebase = spike.finish(self.ops, state.rule, state.arrays, x, flag > 0, overflowed)
        return self.ops.astype(codes.spike_flag(self.ops, only, rebase), "float32")

    def read_spike_window(self, state: SpikeWindow) -> list[float]:
        values, count, _ = state.arrays
        return [float(v) for v in ring_values(int(count), [float(v) for v in values])]

    def read_spike_run(self, state: SpikeWindow) -> int:
        return int(state.arrays.run)

    def write_spike_window(self, state: SpikeWindow, values: list[float], run: int = 0) -> None:
        state.arrays = self._window_arrays(state.rule, values, run)

    def _window_arrays(self, rule: SpikeRule, values: Sequence[float], run: int) -> spike.SpikeWindowArrays:
        kept = [float(v) for v in values][-rule.window :]
        ring = kept + [0.0] * (rule.window - len(kept))
        ops = self.ops
        return spike.SpikeWindowArrays(
            ops.asarray(ring, "float64"), ops.asarray(len(kept), "int64"), ops.asarray(run, "int64")
        )
