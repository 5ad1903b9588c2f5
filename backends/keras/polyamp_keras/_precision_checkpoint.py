"""Loading a `polyamp_keras.PrecisionOptimizer`'s variables from a Keras weights store: checked against this
optimizer's state, and converted when the store was saved under another plan."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from polyamp import Policy, StateDictError
from polyamp.backend_api.training_state import checkpoint_changes
from polyamp_keras._keras import keras
from polyamp_keras._precision_layout import _LOW, _dtype, _inner_name, _Layout, _numpy_dtype

__all__ = ["CheckpointMethods"]

ops = keras.ops
_logger = logging.getLogger("polyamp")

if TYPE_CHECKING:  # a part of PrecisionOptimizer, whose Keras base has no type information
    _Optimizer = Any
else:
    _Optimizer = object


class CheckpointMethods(_Optimizer):  # type: ignore[misc]
    """The weights store's side of a `polyamp_keras.PrecisionOptimizer`: its variables loaded and converted."""

    _layout: _Layout
    _policy: Policy

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Set `variables` from arrays (as `load_own_variables` does, converting a state saved under another
        plan)."""
        self.load_own_variables({str(i): w for i, w in enumerate(weights)})

    def load_own_variables(self, store: Any) -> None:
        """Load `variables` from a Keras weights store (``model.load_weights``, ``keras.models.load_model``).

        A store saved under another plan is converted (one note through ``logging.getLogger("polyamp")``):
        slots cast to this plan's state dtype (rounded to nearest), master copies initialised from the
        weights or dropped, compensation buffers started at zero or dropped.

        Raises:
            StateDictError: (a ``ValueError``) the store does not hold this optimizer's state under any plan
                (another model, another inner optimizer); nothing is changed.
        """
        if not self.built or self._layout.pass_through:
            super().load_own_variables(store)
            return
        saved = [np.asarray(store[str(i)]) for i in range(len(store.keys()))]
        values, notes = self._converted(saved)
        for variable, value in zip(self.variables, values, strict=True):
            variable.assign(value)
        if notes:
            _logger.warning(" ".join(notes))

    def _converted(self, saved: list[np.ndarray]) -> tuple[list[Any], list[str]]:
        """The values for `variables` from a saved list, and the notes on what was converted."""
        layout = self._layout
        slots, masters, compensations = layout.slots(), layout.masters(), layout.compensations()
        inner = list(self.inner_optimizer.variables)
        low = [entry for entry in layout.entries if entry.dtype in _LOW]
        extra = len(saved) - 1 - len(slots) - len(inner)
        if extra not in (0, len(low)):
            raise self._refuse(
                f"it holds {len(saved)} arrays, where this optimizer's state has {len(self.variables)} "
                f"(or {len(self.variables) - len(masters) - len(compensations) + len(low)} with master copies "
                "or compensation buffers)"
            )
        saved_seed, saved_slots = saved[0], saved[1 : 1 + len(slots)]
        saved_extra, saved_inner = saved[1 + len(slots) : 1 + len(slots) + extra], saved[1 + len(slots) + extra :]
        kind = None if not saved_extra else ("master" if saved_extra[0].dtype == np.float32 else "compensation")
        expected = [
            (self._seeds.state, saved_seed),
            *zip(slots, saved_slots, strict=True),
            *zip(inner, saved_inner, strict=True),
        ]
        if kind is not None:
            expected += [(entry.variable, array) for entry, array in zip(low, saved_extra, strict=True)]
        for variable, array in expected:
            if tuple(array.shape) != tuple(variable.shape):
                raise self._refuse(
                    f"an array of shape {array.shape} is where {variable.path!r} {tuple(variable.shape)} belongs"
                )
        saved_dtypes = [str(keras.backend.standardize_dtype(array.dtype)) for array in saved_slots]
        changes = checkpoint_changes(
            self._policy,
            weights=low[0].dtype if low else "float32",
            saved_master="float32" if kind == "master" else None,
            saved_compensation=str(saved_extra[0].dtype) if kind == "compensation" else None,
            saved_slots=[  # the slots kept in the state dtype (is_state_slot when they were made)
                dtype
                for slot, dtype in zip(slots, saved_dtypes, strict=True)
                if _dtype(slot) == self._policy.state_dtype
            ],
        )
        slot_values = []
        for slot, array, dtype in zip(slots, saved_slots, saved_dtypes, strict=True):
            planned = _dtype(slot)
            if keras.backend.is_float_dtype(planned) and dtype != planned:
                array = np.asarray(array, dtype=np.float32).astype(_numpy_dtype(planned))
            slot_values.append(array)
        master_values = []
        for entry in low:
            if entry.master is None:
                continue
            if changes.master in ("keep", "convert"):
                master_values.append(saved_extra[low.index(entry)])
            else:  # "make": from the weights (the model's layers load first)
                master_values.append(ops.cast(entry.variable.value, "float32"))
        compensation_values = []
        for entry in low:
            if entry.compensation is None:
                continue
            if changes.compensation in ("keep", "convert"):
                compensation_values.append(saved_extra[low.index(entry)])
            else:  # "make": zeros
                compensation_values.append(np.zeros(tuple(entry.variable.shape), _numpy_dtype(entry.dtype)))
        notes = list(changes.notes)
        values = [saved_seed, *slot_values, *master_values, *compensation_values, *saved_inner]
        return values, notes

    def _refuse(self, reason: str) -> StateDictError:
        return StateDictError(
            f"Cannot load the variables of PrecisionOptimizer {self.name!r} (plan {self._policy.name}, inner "
            f"{_inner_name(self.inner_optimizer)}): {reason}. The optimizer was left unchanged. Load a state saved "
            "from the same model and inner optimizer, or load the layers alone with "
            "model.load_weights(path, skip_mismatch=True)."
        )
