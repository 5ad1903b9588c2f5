"""`KerasFunctional`: the functional device form over a `KerasDevice`'s variables, for stateless steps.

`polyamp.FunctionalLossScaler` gives it polyamp's semantics; it computes. Every function takes arrays and
returns new ones: it runs the device form's own code (the rule on `ScaleState`, the ring entry, the spike
window) inside Keras's ``StatelessScope`` with the device's variables mapped to the given values, so the
stateful and stateless steps of one optimizer share one implementation and give the same values, under
``jax.jit`` too. Where the stateful step branches on the device (the rule's two halves), the functional
one computes both and selects.

The trees are dicts named after the variables: ``{"scale", "growth_tracker", "hysteresis_left",
"skipped"}``, the ring ``{"codes", "count"}`` and the spike window ``{"values", "count", "run"}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from polyamp import LossScaleConfig, LossScaleState, SpikeRule
from polyamp.backend_api import rules
from polyamp.backend_api.records import ring_codes, ring_values
from polyamp_keras._device import KerasDevice
from polyamp_keras._device_records import record_code
from polyamp_keras._gradients import all_finite, unscale
from polyamp_keras._keras import keras
from polyamp_keras._rule import OPS

__all__ = ["KerasFunctional"]

ops = keras.ops
ScaleArrays = rules.ScaleArrays


def _run(pairs: Sequence[tuple[Any, Any]], fn: Callable[[], Any]) -> tuple[list[Any], Any]:
    """``fn()`` with each variable of ``pairs`` holding its value; the variables' values after it, and what
    ``fn`` returned."""
    with keras.StatelessScope(state_mapping=list(pairs)) as scope:
        result = fn()
        return [scope.get_current_value(variable) for variable, _ in pairs], result


class KerasFunctional:
    """`polyamp.backend_api.FunctionalDevice` (with records, the guard and the spike rule) over the
    variables of a built `KerasDevice`.

    Args:
        device: The device form whose variables (and their dtypes and shapes) the trees stand for.
        config: The settings of the rule.
        keep: Per gradient (in the order steps pass them), True to leave it undivided (a variable Keras
            overwrites with its gradient); None divides all.
    """

    def __init__(self, device: KerasDevice, config: LossScaleConfig, keep: Sequence[bool] | None = None) -> None:
        if not device.built:
            device.build()
        self._device = device
        self._config = config
        self._keep = None if keep is None else list(keep)

    # -- trees and variables -----------------------------------------------------------------------------

    def scale_variables(self) -> dict[str, Any]:
        state = self._device.scale_state
        assert state is not None
        return {
            "scale": state.scale,
            "growth_tracker": state.growth_tracker,
            "hysteresis_left": state.hysteresis_left,
            "skipped": state.skipped_steps,
        }

    def ring_variables(self) -> dict[str, Any] | None:
        value = self._device.history_variables()
        return None if value is None else {"codes": value[0], "count": value[1]}

    def window_variables(self) -> dict[str, Any] | None:
        window = self._device.spike_window()
        return None if window is None else {"values": window.ring, "count": window.count, "run": window.run}

    @staticmethod
    def _pairs(variables: Mapping[str, Any], tree: Mapping[str, Any]) -> list[tuple[Any, Any]]:
        return [(variables[key], tree[key]) for key in variables]

    @staticmethod
    def _tree(variables: Mapping[str, Any], values: list[Any]) -> dict[str, Any]:
        return dict(zip(variables, values, strict=True))

    # -- FunctionalDevice --------------------------------------------------------------------------------

    def init(self, state: LossScaleState, skipped: int = 0) -> dict[str, Any]:
        variables = self.scale_variables()
        return {
            "scale": ops.convert_to_tensor(state.scale, dtype="float32"),
            "growth_tracker": ops.convert_to_tensor(state.growth_tracker, dtype=variables["growth_tracker"].dtype),
            "hysteresis_left": ops.convert_to_tensor(state.hysteresis_left, dtype="int32"),
            "skipped": ops.convert_to_tensor(skipped, dtype=variables["skipped"].dtype),
        }

    def read(self, tree: Mapping[str, Any]) -> LossScaleState:
        return LossScaleState(
            float(ops.convert_to_numpy(tree["scale"])),
            int(ops.convert_to_numpy(tree["growth_tracker"])),
            int(ops.convert_to_numpy(tree["hysteresis_left"])),
        )

    def skipped_count(self, tree: Mapping[str, Any]) -> Any:
        return tree["skipped"]

    def scale(self, tree: Mapping[str, Any], loss: Any) -> Any:
        dtype = "float64" if keras.backend.standardize_dtype(loss.dtype) == "float64" else "float32"
        return ops.multiply(ops.cast(loss, dtype), ops.cast(tree["scale"], dtype))

    def unscale(self, tree: Mapping[str, Any], grads: Any) -> tuple[Any, Any]:
        unscaled = unscale(list(grads), tree["scale"], self._keep)
        return unscaled, self.check(tree, unscaled)

    def unscale_and_clip(self, tree: Mapping[str, Any], grads: Any, clip_norm: float) -> tuple[Any, Any]:
        """Unscaled and clipped by global norm in one multiply (`KerasDevice.unscale_and_clip_by`), and the
        flag: set when the norm is inf or NaN (a gradient is, or their squares overflow)."""
        clipped, norm = self._device.unscale_and_clip_by(list(grads), tree["scale"], clip_norm)
        return clipped, ops.cast(ops.logical_not(ops.isfinite(norm)), "float32")

    def update(self, tree: Mapping[str, Any], found_inf: Any) -> dict[str, Any]:
        overflow = ops.greater(found_inf, 0)
        arrays = ScaleArrays(tree["scale"], tree["growth_tracker"], tree["hysteresis_left"])
        new = rules.advance(OPS, self._config, arrays, overflow)
        skipped = tree["skipped"]
        return {**new._asdict(), "skipped": ops.add(skipped, ops.cast(overflow, skipped.dtype))}

    def cond(self, found_inf: Any, if_skipped: Callable[[], Any], if_applied: Callable[[], Any]) -> Any:
        """``if_skipped()`` when ``found_inf`` is set, else ``if_applied()``: only one of them runs."""
        return ops.cond(ops.logical_not(ops.greater(found_inf, 0)), if_applied, if_skipped)

    def select(self, found_inf: Any, if_skipped: Any, if_applied: Any) -> Any:
        flag = ops.greater(found_inf, 0)
        return _map2(lambda a, b: ops.where(flag, _value(a), _value(b)), if_skipped, if_applied)

    # -- FunctionalGuardingDevice ------------------------------------------------------------------------

    def check(self, tree: Mapping[str, Any], grads: Any) -> Any:
        return ops.cast(ops.logical_not(all_finite(list(grads))), "float32")

    def count_skip(self, tree: Mapping[str, Any], flag: Any) -> dict[str, Any]:
        skipped = tree["skipped"]
        return {**tree, "skipped": ops.add(skipped, ops.cast(ops.greater(flag, 0), skipped.dtype))}

    # -- FunctionalRecordingDevice -----------------------------------------------------------------------

    def ring_init(self, capacity: int) -> dict[str, Any]:
        return {"codes": ops.zeros((capacity,), dtype="int32"), "count": ops.zeros((), dtype="int32")}

    def ring_write(self, ring: Mapping[str, Any], base: int, flag: Any, spike: Any = None) -> dict[str, Any]:
        code = record_code(base, flag, spike)
        capacity = int(ring["codes"].shape[0])
        index = ops.mod(ops.cast(ring["count"], "int32"), capacity)
        codes = ops.where(ops.equal(ops.arange(capacity, dtype="int32"), index), code, ring["codes"])
        count = ring["count"]
        return {"codes": codes, "count": ops.add(count, ops.ones((), dtype=count.dtype))}

    def ring_read(self, ring: Mapping[str, Any]) -> tuple[int, list[int]]:
        total = int(ops.convert_to_numpy(ring["count"]))
        return total, ring_codes(total, ops.convert_to_numpy(ring["codes"]).tolist())

    # -- FunctionalSpikeDevice ---------------------------------------------------------------------------

    def window_init(self, rule: SpikeRule) -> dict[str, Any]:
        variables = self.window_variables()
        assert variables is not None
        return {key: ops.zeros(tuple(v.shape), dtype=v.dtype) for key, v in variables.items()}

    def spike_statistic(self, loss: Any) -> Any:
        return self._device.spike_statistic(loss)

    def spike_grad_norm(self, grads: Any) -> Any:
        return self._device.spike_grad_norm(list(grads), unscaled=True)

    def spike_check(self, rule: SpikeRule, window: Mapping[str, Any], x: Any) -> Any:
        return ops.cast(rules.is_spike(OPS, rule, _window(window), x), "float32")

    def spike_finish(
        self, rule: SpikeRule, window: Mapping[str, Any], x: Any, spike: Any, overflow: Any
    ) -> tuple[dict[str, Any], Any]:
        overflowed = None if overflow is None else ops.greater(overflow, 0)
        new, only, rebase = rules.finish(OPS, rule, _window(window), x, ops.greater(spike, 0), overflowed)
        return new._asdict(), rules.spike_flag(OPS, only, rebase)

    def combine(self, first: Any, second: Any) -> Any:
        return ops.maximum(first, second)

    def read_window(self, window: Mapping[str, Any]) -> tuple[list[float], int]:
        count = int(ops.convert_to_numpy(window["count"]))
        values = ring_values(count, ops.convert_to_numpy(window["values"]).tolist())
        return [float(v) for v in values], int(ops.convert_to_numpy(window["run"]))

    def write_window(self, window: Mapping[str, Any], values: list[float], run: int) -> dict[str, Any]:
        ring = window["values"]
        size = int(ring.shape[0])
        padded = np.zeros((size,), dtype=keras.backend.standardize_dtype(ring.dtype))
        padded[: len(values)] = values
        return {
            "values": ops.convert_to_tensor(padded),
            "count": ops.convert_to_tensor(len(values), dtype=window["count"].dtype),
            "run": ops.convert_to_tensor(run, dtype=window["run"].dtype),
        }


def _window(tree: Mapping[str, Any]) -> Any:
    return rules.SpikeWindowArrays(tree["values"], tree["count"], tree["run"])


def _value(x: Any) -> Any:
    """An array: a Keras variable's value (stateless steps may be handed variables), else ``x``."""
    return x.value if isinstance(x, keras.Variable) else x


def _map2(fn: Callable[[Any, Any], Any], first: Any, second: Any) -> Any:
    """``fn`` over the leaves of two trees of equal structure (lists, tuples, dicts; None stays None)."""
    if isinstance(first, Mapping):
        return {key: _map2(fn, first[key], second[key]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_map2(fn, a, b) for a, b in zip(first, second, strict=True))
    if first is None:
        return None
    return fn(first, second)
