"""The records of a `polyamp_keras._device.KerasDevice`: each step's flag, the ring of record codes and the
provenance of a skipped step (the counts of its non-finite gradients), in variables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from polyamp.backend_api import rules
from polyamp.backend_api.records import ring_codes
from polyamp_keras._device_variables import DeviceVariables, _Slot, _tensorflow
from polyamp_keras._gradients import gradient_counts
from polyamp_keras._keras import keras
from polyamp_keras._rule import OPS, counter_dtype, read_scalar

__all__ = ["RecordMethods", "provenance_rows", "record_code", "unread_rows", "write_ring_entry"]

ops = keras.ops


class RecordMethods(DeviceVariables):
    """The records' and the provenance's device side (`polyamp.backend_api.RecordingDevice`)."""

    def _overflowed(self, flag: Any) -> Any:
        """``flag > 0``: in a graph, for the flag of the step just built, the boolean it was made from (each
        record would otherwise compare it again, an operation per step each)."""
        made = self._made
        if made is not None and made[0]() is flag:
            overflow = made[1]()
            if overflow is not None:
                return overflow
        return ops.greater(flag, 0)

    def _provenance_slot(self, variables: Sequence[Any]) -> tuple[list[Any], list[str], Any]:
        key = tuple(id(v) for v in variables)
        slot = self._provenance.get(key)
        if slot is None:
            names = [str(getattr(v, "path", None) or v.name) for v in variables]
            slot = (
                list(variables),  # held, so the ids in the key stay theirs
                names,
                # One variable: a compiled step pays for each variable it captures, written or not.
                self._variable(
                    "non_finite_counts", "int32", unread_rows(max(1, len(names))), shape=(max(1, len(names)) + 1, 4)
                ),
            )
            self._provenance[key] = slot
        return slot

    def _count_non_finite(self, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """In the branch that skips: each gradient's +inf/-inf/NaN counts, for the records (see
        `polyamp.NonFiniteGradient`); finite steps never run it."""
        if self._history.value is None or not grads:
            return
        key = tuple(id(v) for v in variables)
        if self._owned and key not in self._provenance:
            return  # an owned device counts the variables it was built for (no variables made in a step)
        slot = self._provenance_slot(variables)

        def count() -> Any:
            self._write(slot[2], provenance_rows(gradient_counts(grads), self._history.value[1]))
            return ops.convert_to_tensor(True)

        tf = _tensorflow()
        outlined = None
        if tf is not None and self._compiling_now():
            # One call of a function kept whole (not inlined): the operations of a branch not taken are still
            # visited at every step of a graph (some thirty here), a call once.
            try:
                outlined = tf.function(count, autograph=False, experimental_attributes={"_noinline": True})
            except (TypeError, ValueError):  # a TensorFlow that no longer takes the attribute: inline
                outlined = None
        (outlined or count)()

    def _counted(self, grads: Sequence[Any], variables: Sequence[Any]) -> Any:
        self._count_non_finite(grads, variables)
        return ops.convert_to_tensor(True)

    # -- records -----------------------------------------------------------------------------------------

    def skipped(self, found_inf: Any) -> Any:
        return self._overflowed(found_inf)

    def read_flag(self, found_inf: Any) -> bool:
        return bool(ops.convert_to_numpy(ops.greater(found_inf, 0.0)))

    def finite_flag(self) -> Any:
        if _tensorflow() is not None:  # a constant of the graph being built (or eager)
            return ops.convert_to_tensor(0.0, dtype="float32")
        if self._finite is None:  # one eager constant, recognised by `update`
            self._finite = ops.convert_to_tensor(0.0, dtype="float32")
        return self._finite

    def new_record(self) -> Any:
        if self._owned:
            self._state()
            return self._record
        return self._variable("step_skipped", "float32", 0.0)

    def write_record(self, record: Any, found_inf: Any) -> None:
        if keras.backend.standardize_dtype(record.dtype) == "bool":
            record.assign(self._overflowed(found_inf))
        else:
            record.assign(ops.cast(found_inf, "float32"))

    def read_record(self, record: Any) -> Any:
        return ops.cast(ops.convert_to_tensor(record), "float32")

    def skipped_steps(self) -> Any:
        """The count as a new tensor (a copy, never the variable itself: a value kept follows no later skip, and
        under ``tf.distribute`` it is a tensor, not a mirrored variable)."""
        if self._variables is None and self._owned:
            return ops.convert_to_tensor(0, dtype=counter_dtype())
        return ops.copy(self._state().skipped_steps)

    def count_skip(self, found_inf: Any) -> None:
        """Count a guarded iteration as skipped when ``found_inf`` is set; the rule does not run."""
        skipped = self._state().skipped_steps
        self._add(skipped, ops.cast(self._overflowed(found_inf), skipped.dtype))

    def compiling(self) -> bool:
        """Whether a step is being compiled (records are read eagerly only)."""
        return self._compiling_now()

    def new_history(self, capacity: int) -> _Slot:
        # A ring of mode codes and the count of entries written, in variables: written inside graphs too.
        self._history.pending = capacity
        if self._variables is not None or not self._owned:
            self._build_history()
        return self._history

    def _build_history(self) -> None:
        slot = self._history
        if slot.value is None and slot.pending is not None:
            capacity = slot.pending
            slot.value = (
                self._variable("step_codes", "int32", 0, shape=(capacity,)),
                self._variable("recorded_steps", "int32", 0),
            )
            slot.pending = None

    def write_history(self, history: _Slot, base: int, found_inf: Any, spike: Any = None) -> None:
        codes, count = history.value
        overflow = None if found_inf is None else self._overflowed(found_inf)
        write_ring_entry(
            codes, ops.convert_to_tensor(count), record_code(base, found_inf, spike, overflow), self._write
        )
        self._add(count, ops.convert_to_tensor(1, dtype=count.dtype))

    def read_history(self, history: _Slot) -> tuple[int, list[int]]:
        if history.value is None:
            return 0, []
        codes, count = history.value
        total = int(read_scalar(count))
        return total, ring_codes(total, ops.convert_to_numpy(codes).tolist())

    # -- provenance --------------------------------------------------------------------------------------

    def read_provenance(self) -> list[tuple[int, list[tuple[str, int, int, int, int]]]]:
        found = []
        for _, names, variable in self._provenance.values():
            rows = ops.convert_to_numpy(variable).tolist()  # one read: the counts and the index row
            index = int(rows[-1][0])
            if index >= 0:
                found.append((index, [(n, *row) for n, row in zip(names, rows[:-1], strict=False)]))
                self._write(variable, ops.convert_to_tensor(unread_rows(len(rows) - 1)))
        return found

    def non_finite_parameters(self, optimizers: Sequence[Any]) -> list[tuple[str, int, int, int, int]] | None:
        """(name, +inf, -inf, NaN, size) counts of each variable this device applied steps to (the ones whose
        gradients it counts), one host read per list of variables; None when a variable holds no value to read
        (Keras on JAX keeps them outside the variables during ``fit``)."""
        found = []
        for variables, names, _ in self._provenance.values():
            try:
                values = [v.value if isinstance(v, keras.Variable) else v for v in variables]
            except TypeError:  # Keras on JAX, inside fit: the values live outside the variables
                return None
            if any(value is None for value in values):
                return None
            rows = ops.convert_to_numpy(gradient_counts(values)).tolist()
            found += [(name, *row) for name, row in zip(names, rows, strict=True)]
        return found


def provenance_rows(counts: Any, index: Any) -> Any:
    """The value of the provenance variable: ``counts`` (per gradient, +inf, -inf, NaN and size), then one row
    ``(index, 0, 0, 0)``, the index of the skipped step they are of (-1: none, or read already)."""
    index_row = ops.concatenate([ops.reshape(ops.cast(index, "int32"), (1, 1)), ops.zeros((1, 3), dtype="int32")], 1)
    return ops.concatenate([ops.cast(counts, "int32"), index_row], axis=0)


def unread_rows(gradients: int) -> np.ndarray:
    """The provenance variable holding no skipped step: zero counts for ``gradients`` gradients, index -1."""
    rows = np.zeros((gradients + 1, 4), dtype="int32")
    rows[-1, 0] = -1
    return rows


def record_code(base: int, flag: Any, spike: Any = None, overflow: Any = None) -> Any:
    """An iteration's record code (`polyamp.backend_api.rules.record_code`) from its float32 flags: ``flag``
    (> 0: skipped) and ``spike`` (the spike rule's); ``overflow``: ``flag > 0``, when the caller has it."""
    if flag is not None and overflow is None:
        overflow = ops.greater(flag, 0)
    return rules.record_code(OPS, base, overflow, spike)


def write_ring_entry(
    codes: Any, count: Any, code: Any, write: Callable[[Any, Any], Any], *, scatter: bool = True
) -> None:
    """Write ``code`` at ``count % capacity`` of the ring ``codes``: one element (a scatter, through
    ``write``, an optimizer's ``assign``) where TensorFlow can (no distribution strategy, ``scatter``), else
    the whole ring (a scatter is not defined on ``tf.distribute``'s mirrored variables, nor recorded by a
    ``StatelessScope``; JAX arrays are written whole anyway)."""
    capacity = int(codes.shape[0])
    index = ops.mod(ops.cast(count, "int32"), capacity)
    tf = _tensorflow()
    if scatter and tf is not None and not tf.distribute.has_strategy():
        # A scalar index and value: a scatter takes them as they are (no reshape to one element).
        write(codes, tf.IndexedSlices(tf.cast(code, tf.int32), index, (capacity,)))
        return
    ring = ops.convert_to_tensor(codes)
    write(codes, ops.where(ops.equal(ops.arange(capacity, dtype="int32"), index), code, ring))
