"""The loss-scale state of a `polyamp_keras.LossScaleOptimizer`: its state dicts, and its variables loaded
from a Keras weights file, checked before anything is assigned."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from polyamp import (
    FunctionalLossScaler,
    InvalidConfigError,
    LossScaler,
    LossScaleState,
    PolyampTypeError,
    StateDictError,
)
from polyamp.backend_api import ScalerAdapter
from polyamp.backend_api.arguments import describe

__all__ = ["StateMethods"]

if TYPE_CHECKING:  # a part of LossScaleOptimizer, whose Keras base has no type information
    _Optimizer = Any
else:
    _Optimizer = object


class _Store(dict):  # type: ignore[type-arg]
    """A variable store (``store[str(i)]``) rebuilt from a Keras one, keeping its entry path for messages."""

    def __init__(self, values: dict[str, Any], entry_path: str | None) -> None:
        super().__init__(values)
        if entry_path:
            self._h5_entry_path = entry_path


class StateMethods(_Optimizer):  # type: ignore[misc]
    """The state dicts and the weights file's loss-scale state of a `polyamp_keras.LossScaleOptimizer`."""

    _scaler: LossScaler
    _adapter: ScalerAdapter
    _functional: dict[str, FunctionalLossScaler]

    def state_dict(self) -> dict[str, Any]:
        """The loss-scaler state as `polyamp.LossScaler.state_dict` gives it (portable across backends)."""
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a polyamp (or torch GradScaler) loss-scaler state dict; validated first, all or nothing.

        A disabled optimizer (``enabled=False``) loads its own state dicts and takes ``{}`` (a disabled
        GradScaler's) as nothing to restore, as `polyamp.LossScaler` does.

        Raises:
            StateDictError: the dict is malformed (nothing changes).
            ScalerUsageError: gradients unscaled by `get_unscaled_gradients` wait for their apply, or the
                settings would change after a compiled step traced them.
        """
        self._scaler.load_state_dict(state_dict)
        config = self._scaler.config
        self.dynamic_growth_steps = config.growth_interval
        if not self.built:
            self.initial_scale = self._scaler.get_state().scale
        self._functional = {}

    def load_own_variables(self, store: Any) -> None:
        """Load the variables from a Keras weights file (``model.load_weights``, ``keras.models.load_model``),
        refusing a loss-scale state this optimizer cannot be in.

        A scale of 0, a subnormal, inf or NaN in a file (corrupted, or edited) would write NaN into the weights
        at the first step or skip every step for ever; the scale, growth counter, hysteresis and counters are
        checked against the optimizer's settings before anything is assigned. Keras wraps the refusal into the
        ``ValueError`` of ``load_weights`` / ``load_model`` (``skip_mismatch=True`` makes it a warning and loads
        the layers alone).

        A file saved while a skipped step's non-finite counts and its index were two variables (one more entry
        than this optimizer has) is read with the two joined, as the optimizer now holds them.

        Args:
            store: Keras's variable store for this optimizer (``store[str(i)]``: the i-th variable's value).

        Raises:
            StateDictError: (a ``ValueError``) the saved state is impossible; the optimizer is left unchanged.
        """
        store = self._joined_provenance(store)
        if not self.built or len(store.keys()) != len(self.variables):
            super().load_own_variables(store)  # Keras warns and loads nothing
            return
        self._saved_state(store)
        self.records()  # the records so far belong to the state being replaced
        super().load_own_variables(store)
        self._adapter.restored_on_device()

    def _joined_provenance(self, store: Any) -> Any:
        """``store`` as this optimizer's variables lay out, when it was saved with the non-finite counts and
        their step's index as two variables (``non_finite_counts`` of one row fewer, then a scalar
        ``non_finite_at``); any other store as it is."""
        counts = self._device.provenance_variable()  # None before build
        if counts is None or len(store.keys()) != len(self.variables) + 1:
            return store
        at = next(i for i, variable in enumerate(self.variables) if variable is counts)
        old_counts, old_index = np.asarray(store[str(at)]), np.asarray(store[str(at + 1)])
        if old_counts.shape != (int(counts.shape[0]) - 1, 4) or old_index.size != 1:
            return store
        joined = _Store({str(i): store[str(i)] for i in range(at)}, getattr(store, "_h5_entry_path", None))
        joined[str(at)] = np.concatenate([old_counts, [[int(old_index.reshape(())), 0, 0, 0]]]).astype("int32")
        for i in range(at + 1, len(self.variables)):
            joined[str(i)] = store[str(i + 1)]
        return joined

    def _saved_state(self, store: Any) -> tuple[LossScaleState, int]:
        """The loss-scale state and the count of recorded steps a store holds, validated."""
        index = {id(variable): i for i, variable in enumerate(self.variables)}
        entry = str(getattr(store, "_h5_entry_path", "") or "optimizer")
        scale_at = f"{entry}/vars/{index[id(self.dynamic_scale)]}"
        values: dict[str, Any] = {}
        where: dict[str, str] = {}
        for name, variable in (
            ("dynamic_scale", self.dynamic_scale),
            ("step_counter", self.step_counter),
            ("hysteresis_left", self.hysteresis_left),
            ("skipped_steps", self.skipped_steps),
            ("recorded_steps", self.recorded_steps),
        ):
            i = index[id(variable)]
            where[name] = f"{name} (entry '{entry}/vars/{i}')"
            value = np.asarray(store[str(i)])
            if value.size != 1:
                raise self._refuse_file(scale_at, f"{where[name]} has shape {value.shape}, where a scalar belongs.")
            values[name] = value.reshape(()).item()
        for name in ("step_counter", "hysteresis_left", "skipped_steps", "recorded_steps"):
            if isinstance(values[name], bool) or not isinstance(values[name], int):
                raise self._refuse_file(scale_at, f"{where[name]} is {describe(values[name])}, where an int belongs.")
        for name in ("skipped_steps", "recorded_steps"):
            if values[name] < 0:
                raise self._refuse_file(scale_at, f"{where[name]} is {values[name]}, a count that cannot be negative.")
        scale = values["dynamic_scale"]
        state = LossScaleState(scale, values["step_counter"], values["hysteresis_left"])
        try:
            self._scaler.config.check_state(state)
        except (InvalidConfigError, PolyampTypeError) as exc:
            held = ", ".join(
                f"{where[name]} = {values[name]!r}" for name in ("dynamic_scale", "step_counter", "hysteresis_left")
            )
            raise self._refuse_file(
                scale_at,
                f"its loss-scale state is impossible for this optimizer's settings: {exc} The file holds {held}. "
                "A scale of 0 or a subnormal would write NaN into the weights at the first step; inf or NaN "
                "would skip every step for ever.",
            ) from exc
        return state, values["recorded_steps"]

    def _refuse_file(self, scale_at: str, reason: str) -> StateDictError:
        return StateDictError(
            f"Cannot load the variables of LossScaleOptimizer {self.name!r} from this weights file: {reason} The "
            "optimizer was left unchanged. To fix the file: restore an earlier checkpoint; or rewrite the entry "
            "with h5py (in a model.keras archive, the model.weights.h5 inside it), e.g. "
            f"`with h5py.File('model.weights.h5', 'r+') as f: f['{scale_at}'][...] = "
            f"{self._scaler.config.init_scale!r}` for the scale; or load the layers alone with "
            "model.load_weights(path, skip_mismatch=True), which keeps this optimizer's fresh state."
        )
