"""`KerasDevice`: the tape-style device form of a loss scaler over ``keras.ops`` and Keras variables.

`polyamp.LossScaler` drives it (it implements `polyamp.backend_api.TapeDevice` and the optional protocols for
records, the guard, the spike rule, provenance, replicas and compilation); it decides nothing itself. It runs
on every Keras backend, eagerly and in compiled steps: the skip is a ``cond`` on the device flag (on JAX, a
Python branch when the flag is a concrete value, since ``jax.lax.cond`` cannot assign variables), and the
rule's update another.

Two ways to hold the state:

* standalone (``add_variable=None``): the device makes its variables when first used
  (`polyamp_tensorflow`'s device form extends it and makes them with ``tf.init_scope``);
* owned: an optimizer hands its ``add_variable`` and calls `build` from its own ``build``, so the variables are
  the optimizer's (saved with it, written through its ``assign``); before that the host state stands in.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from polyamp import LossScaleConfig, LossScaleState, PolyampTypeError, ScalerUsageError, SpikeRule
from polyamp.backend_api import StepOutcome, rules
from polyamp.backend_api.arguments import describe, wrong_object_error
from polyamp.backend_api.records import ring_codes
from polyamp_keras._gradients import (
    all_finite,
    all_replicas_finite,
    gradient_counts,
    is_sparse,
    read_once,
    refuse_loss_scale_factor,
    sparse_values,
    unscale,
    unscale_and_check,
)
from polyamp_keras._keras import keras
from polyamp_keras._rule import OPS, ScaleState, advance, advance_on_flag, counter_dtype, device_cond, read_scalar
from polyamp_keras._spikes import SpikeWindow, grad_norm, loss_statistic

__all__ = ["KerasDevice", "clipping_folded", "folded_clip_norm"]

ops = keras.ops

#: Keras's ``Optimizer.add_variable(shape=, dtype=, initializer=, aggregation=, name=)``.
AddVariable = Callable[..., Any]


def _tensorflow() -> Any:
    """TensorFlow when it is Keras's backend, else None."""
    return sys.modules.get("tensorflow") if keras.backend.backend() == "tensorflow" else None


def _standalone_variable(*, shape: Any, dtype: str, initializer: Any, aggregation: str, name: str) -> Any:
    return keras.Variable(initializer(shape, dtype), dtype=dtype, trainable=False, name=name, aggregation=aggregation)


class _Slot:
    """A holder the core keeps (a history ring, a spike window), filled when the variables exist."""

    __slots__ = ("pending", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.pending: Any = None  # what to write once the variables exist (a spike window loaded early)


class KerasDevice:
    """polyamp's loss-scaler state in Keras variables, and the device operations of a step, on every Keras
    backend.

    Args:
        config: The scaler's settings.
        state: The state to start from.
        add_variable: None: the device makes its own variables when first used. Else an optimizer's
            ``add_variable`` (Keras's signature): the variables are made by `build`, and are the optimizer's.
        assign: How an owned variable is written (the optimizer's ``assign``); None: ``variable.assign``.
        assign_add: How a counter is incremented (the optimizer's ``assign_add``); None:
            ``variable.assign_add``.
        scale_variables: With ``add_variable``: a function giving the variables of the scale and growth
            tracker to use (an optimizer that already has them, e.g. Keras's ``dynamic_scale`` and
            ``step_counter``), called by `build`; None makes them.
    """

    def __init__(
        self,
        config: LossScaleConfig,
        state: LossScaleState,
        *,
        add_variable: AddVariable | None = None,
        assign: Callable[[Any, Any], Any] | None = None,
        assign_add: Callable[[Any, Any], Any] | None = None,
        scale_variables: Callable[[], tuple[Any, Any]] | None = None,
    ) -> None:
        self._config = config
        self._host_state = state
        self._owned = add_variable is not None
        self._add_variable: AddVariable = add_variable or self._make_standalone
        self._assign = assign
        self._assign_add = assign_add
        # The rule's finite half as a branch on TensorFlow, where a branch is an operation of the step
        # (see `advance`); Keras's other backends select.
        self._branch = _tensorflow() is not None
        self._scale_variables = scale_variables
        self._variables: ScaleState | None = None
        self._traced = False
        self._history = _Slot()
        self._windows: list[tuple[_Slot, SpikeRule]] = []
        self._record: Any = None  # an owned device's one outcome variable
        self._finite: Any = None  # the finite flag's eager constant (not on TensorFlow, whose graphs make their own)
        # The flag of the step last built in a graph and the boolean it was made from (weakly: see `_overflowed`).
        self._made: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None
        # Per list of variables applied: their names, and the counts of the last skipped step with its iteration
        # (one variable, `provenance_rows`).
        self._provenance: dict[tuple[int, ...], tuple[list[Any], list[str], Any]] = {}

    # -- variables ---------------------------------------------------------------------------------------

    def _make_standalone(self, *, shape: Any, dtype: str, initializer: Any, aggregation: str, name: str) -> Any:
        """A variable of a standalone device (`polyamp_tensorflow` makes its own outside function graphs)."""
        return _standalone_variable(
            shape=shape, dtype=dtype, initializer=initializer, aggregation=aggregation, name=name
        )

    def _variable(self, name: str, dtype: str, value: Any, shape: Any = ()) -> Any:
        return self._add_variable(
            shape=shape,
            dtype=dtype,
            initializer=keras.initializers.Constant(value),
            aggregation="none",
            name=name,
        )

    def _write(self, variable: Any, value: Any) -> None:
        if self._assign is not None:
            self._assign(variable, value)
        elif is_sparse(value):  # TensorFlow's IndexedSlices: a scatter, as Keras's optimizers write them
            (variable.value if isinstance(variable, keras.Variable) else variable).scatter_update(value)
        else:
            variable.assign(value)

    def _add(self, variable: Any, value: Any) -> None:
        """``variable += value``, through the optimizer's ``assign_add`` when it has one: on TensorFlow that is
        one ``AssignAddVariableOp`` on the backing variable, where a Keras variable's own ``assign_add`` reads,
        adds and assigns."""
        if self._assign_add is not None:
            self._assign_add(variable, value)
        else:
            variable.assign_add(value)

    @property
    def built(self) -> bool:
        """Whether the variables exist."""
        return self._variables is not None

    def build(self, variables: Sequence[Any] = ()) -> None:
        """Make the variables (an owned device: called from the optimizer's ``build``): the scale state, the
        record ring, spike windows and, for ``variables`` (the optimizer's), the skipped step's counts."""
        if self._variables is not None:
            return
        state = self._host_state
        if self._scale_variables is not None:
            scale, tracker = self._scale_variables()
            tf = _tensorflow()
            # Written now, once: Keras on TensorFlow builds an optimizer while it traces the first step, and an
            # assignment inside that trace would belong to a graph that need not be the one that runs.
            with tf.init_scope() if tf is not None else contextlib.nullcontext():
                self._write(scale, state.scale)
                self._write(tracker, ops.cast(state.growth_tracker, tracker.dtype))
        else:
            scale = self._variable("loss_scale", "float32", state.scale)
            tracker = self._variable("growth_tracker", "int32", state.growth_tracker)
        self._variables = ScaleState(
            scale,
            tracker,
            self._variable("hysteresis_left", "int32", state.hysteresis_left),
            self._variable("skipped_steps", counter_dtype(), 0),
        )
        if self._owned:
            self._record = self._add_variable(
                shape=(), dtype="bool", initializer=keras.initializers.Zeros(), aggregation="none", name="last_skipped"
            )
        self._build_history()
        if self._owned:
            self._provenance_slot(list(variables))
        for slot, rule in self._windows:
            self._build_window(slot, rule)

    def _state(self) -> ScaleState:
        if self._compiling_now():
            self._traced = True  # the settings are becoming constants of a graph
        if self._variables is None:
            if self._owned:
                raise ScalerUsageError(
                    "The loss scaler's variables belong to an optimizer that is not built yet: build it "
                    "(optimizer.build(model.trainable_variables)) before the first step."
                )
            self.build()
        assert self._variables is not None
        return self._variables

    def scale_value(self) -> Any:
        """The scale: its variable, or before an owned device is built the state's value."""
        if self._variables is None and self._owned:
            return ops.convert_to_tensor(self._host_state.scale, dtype="float32")
        return self._state().scale

    @property
    def record_variable(self) -> Any:
        """An owned device's variable holding whether the last step was skipped (None before `build`)."""
        return self._record

    def provenance_variable(self) -> Any:
        """An owned device's counts of the last skipped step's non-finite gradients, with that step's index in
        their last row (`provenance_rows`; None before `build`)."""
        if not self._provenance:
            return None
        return next(iter(self._provenance.values()))[2]

    def history_variables(self) -> tuple[Any, Any] | None:
        """The record ring's variables (codes, count), or None before they exist / without records."""
        return self._history.value  # type: ignore[no-any-return]

    def spike_window(self) -> SpikeWindow | None:
        """The spike rule's window (None without a rule or before it exists)."""
        return self._windows[0][0].value if self._windows else None

    @property
    def scale_state(self) -> ScaleState | None:
        """The scale's variables (None before they exist)."""
        return self._variables

    # -- state -------------------------------------------------------------------------------------------

    def read_state(self) -> LossScaleState:
        return self._host_state if self._variables is None else self._variables.read()

    def write_state(self, config: LossScaleConfig, state: LossScaleState | None) -> None:
        if self._traced and config != self._config:
            raise self.traced_settings_error(self._config, config)
        self._config = config
        if state is None:
            return
        self._host_state = state
        if self._variables is not None:
            self._variables.write(state)

    def traced_settings_error(self, old: LossScaleConfig, new: LossScaleConfig) -> ScalerUsageError:
        """The error for new settings once a compiled step traced the old ones as constants."""
        return ScalerUsageError(
            f"The loss-scaling settings would change ({old} -> {new}), but a compiled step (tf.function, jax.jit, "
            "model.fit) has already traced a step with this scaler: the settings are constants there, which would "
            "go on using the old ones. Change settings before the first compiled step, or make a new scaler (the "
            "scale and counters can be loaded at any time)."
        )

    @property
    def traced(self) -> bool:
        """Whether a compiled step traced the settings as constants."""
        return self._traced

    def note_traced(self) -> None:
        """A compiled step (``jax.jit``) is tracing the settings as constants."""
        self._traced = True

    def float16_in_use(self, *, since_last_iteration: bool = False, loss: Any = None) -> bool:
        """Whether Keras's own global dtype policy computes in float16 (e.g. set with
        ``keras.mixed_precision.set_global_policy("mixed_float16")``)."""
        return str(keras.config.dtype_policy().compute_dtype) == "float16"

    # -- the step ----------------------------------------------------------------------------------------

    def check_optimizer(self, method: str, optimizer: object) -> None:
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise wrong_object_error("keras", method, optimizer, "a Keras 3 optimizer (keras.optimizers.*)")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ScalerUsageError(
                f"{method}() received a LossScaleOptimizer, which scales by itself: the gradients would be "
                "unscaled twice. Pass the plain optimizer, or use the LossScaleOptimizer without this scaler."
            )
        refuse_loss_scale_factor(optimizer, "a polyamp LossScaler does the scaling")

    def scale(self, loss: Any) -> Any:
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(item) for item in loss)
        if not hasattr(loss, "dtype"):  # a Python number
            loss = ops.convert_to_tensor(loss, dtype="float32")
        # Like Keras, scale in at least float32: 2**16 is beyond float16's range.
        dtype = "float64" if keras.backend.standardize_dtype(loss.dtype) == "float64" else "float32"
        return ops.multiply(ops.cast(loss, dtype), ops.cast(self.scale_value(), dtype))

    def check_gradients(self, method: str, grads: Sequence[Any]) -> None:
        for grad in grads:
            if grad is not None and not (
                ops.is_tensor(grad) or is_sparse(grad) or isinstance(grad, keras.Variable) or _tf_tensor(grad)
            ):
                raise wrong_object_error(
                    "keras", method, grad, f"{keras.backend.backend()} tensors (None for variables without a gradient)"
                )

    def unscale(self, grads: Sequence[Any]) -> list[Any]:
        return unscale(grads, self.scale_value())

    def unscale_and_clip_values(self, grads: Sequence[Any], clip_norm: float, *, scaled: bool) -> tuple[list[Any], Any]:
        """`unscale` and a global-norm clip in one multiply (``unscale_and_clip_values``,
        `polyamp.backend_api.OptionalMethods`).

        The norm of the scaled float32 gradients divided by the scale is the norm of the unscaled ones (exactly,
        for a power-of-two scale), the clip factor is Keras's (and TensorFlow's) ``clip_by_global_norm`` formula,
        and each gradient is multiplied once by factor / scale. Other dtypes and sparse gradients are divided
        first, then clipped, as two steps.
        """
        return self.unscale_and_clip_by(grads, self.scale_value() if scaled else None, clip_norm)

    def unscale_and_clip_by(self, grads: Sequence[Any], scale: Any, clip_norm: float) -> tuple[list[Any], Any]:
        """`unscale_and_clip_values` by ``scale`` (a value; None: the gradients are not scaled)."""
        grads = list(grads)
        present = [g for g in grads if g is not None]
        scaled = scale is not None
        if scaled:
            scale = read_once(scale)  # used up to three times below: one read of a variable
        one_pass = scaled and all(
            not is_sparse(g) and keras.backend.standardize_dtype(g.dtype) == "float32" for g in present
        )
        values = grads if (one_pass or not scaled) else unscale(grads, scale)
        norm = self._global_norm([sparse_values(g) for g in values if g is not None])
        if one_pass:
            norm = ops.divide(norm, scale)
        factor = self._clip_factor(norm, clip_norm)
        multiplier = ops.divide(factor, scale) if one_pass else factor
        return [None if g is None else _times(g, multiplier) for g in values], norm

    def _global_norm(self, values: Sequence[Any]) -> Any:
        """Keras's ``global_norm``: the square root of the sum of the tensors' sums of squares."""
        return ops.sqrt(ops.sum(ops.stack([ops.sum(ops.square(v)) for v in values])))

    def _clip_factor(self, norm: Any, clip_norm: float) -> Any:
        """Keras's ``clip_by_global_norm`` factor: NaN when ``norm`` is not finite."""
        return ops.add(ops.multiply(clip_norm, ops.minimum(ops.divide(1.0, norm), 1.0 / clip_norm)), norm - norm)

    def apply(
        self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], *, unscaled: bool, veto: Any = None
    ) -> StepOutcome:
        """Unscale (unless ``unscaled``; variables overwritten with their gradient keep theirs), check, apply
        unless non-finite or ``veto`` (the spike rule's flag) is set; the returned flag is the overflow alone
        (what the loss-scale rule sees)."""
        outcome = self._step(optimizer, grads, variables, unscaled=unscaled, veto=veto, advancing=False)
        assert outcome is not None  # (only an advancing step declines)
        return outcome

    def apply_and_advance(
        self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], *, unscaled: bool
    ) -> StepOutcome | None:
        """`apply`, with the loss-scale rule advanced in the branch that applies (its finite half) or skips (its
        overflow half) (``apply_and_advance``, `polyamp.backend_api.OptionalMethods`): one branch per step on the
        flag, as in Keras's own ``LossScaleOptimizer``, where `update` would branch on it a second time. None under a
        ``tf.distribute`` strategy, whose apply is not made inside a branch here."""
        return self._step(optimizer, grads, variables, unscaled=unscaled, veto=None, advancing=True)

    def _step(
        self,
        optimizer: Any,
        grads: Sequence[Any],
        variables: Sequence[Any],
        *,
        unscaled: bool,
        veto: Any,
        advancing: bool,
    ) -> StepOutcome | None:
        tf = _tensorflow()
        context = None if tf is None or not tf.distribute.has_strategy() else tf.distribute.get_replica_context()
        if context is not None and advancing:
            return None
        state = self._state()
        variables = list(variables)
        if not optimizer.built:  # variables cannot be created inside the cond below
            optimizer.build(variables)
        clip_norm = None if unscaled else folded_clip_norm(optimizer, grads, variables)
        scaled_grads = list(grads)
        keep = [bool(getattr(v, "overwrite_with_gradient", False)) for v in variables]
        unscaled_grads: list[Any] | None
        if unscaled:
            unscaled_grads = scaled_grads
            finite = all_finite(unscaled_grads)
        elif clip_norm is not None:
            # The optimizer's global-norm clip folded into the unscale: one multiply per gradient, and the norm
            # says whether all are finite (it is inf or NaN when one is, or when their squares overflow).
            unscaled_grads, norm = self.unscale_and_clip_by(scaled_grads, state.scale, clip_norm)
            finite = ops.isfinite(norm)
        elif context is None and not self._config.checks_unscaled and keras.backend.backend() == "tensorflow":
            # As in Keras's own LossScaleOptimizer: where the scale cannot fall below 1, a gradient's unscaled
            # value is finite exactly when its scaled value is, so the scaled gradients are checked and divided
            # in the branch that applies them (None here). In a TensorFlow graph each division then feeds its
            # update directly, where dividing first makes every gradient pass through memory once more.
            unscaled_grads = None
            finite = all_finite(scaled_grads)
        else:
            unscaled_grads, finite = unscale_and_check(scaled_grads, state.scale, keep)
        finite = all_replicas_finite(finite)
        go = finite if veto is None else ops.logical_and(finite, ops.logical_not(ops.greater(veto, 0)))
        if context is not None:
            # Any strategy, one replica included (MirroredStrategy() on a one-GPU machine): the optimizer's
            # apply is a merge_call there too, which TensorFlow refuses inside a cond in a replica context.
            assert unscaled_grads is not None  # (divided up front under a strategy)
            _apply_across_replicas(tf, context, optimizer, go, unscaled_grads, variables)
        else:

            def apply() -> Any:
                applied = unscale(scaled_grads, state.scale, keep) if unscaled_grads is None else unscaled_grads
                with clipping_folded(optimizer, clip_norm is not None):
                    optimizer.apply(applied, variables)
                if advancing:
                    advance(state, False, self._config, self._add, branch=self._branch)
                return ops.convert_to_tensor(True)

            def skip() -> Any:
                # Which gradients were inf or NaN, for the records (a folded clip made them all NaN; unscaled_grads
                # None: the scaled ones, whose inf and NaN are the unscaled ones' at scales of 1 and above).
                if unscaled_grads is None:
                    named = scaled_grads
                else:
                    named = unscaled_grads if clip_norm is None else unscale(scaled_grads, state.scale)
                if veto is None:
                    self._count_non_finite(named, variables)
                else:  # a spike skips with finite gradients: count only when they are not
                    device_cond(finite, lambda: ops.convert_to_tensor(False), lambda: self._counted(named, variables))
                if advancing:  # (no veto: a skip is an overflow)
                    advance(state, True, self._config, self._add)
                return ops.convert_to_tensor(False)

            taken = _host_value(go)
            if taken is None:
                device_cond(go, apply, skip)
            else:
                # An eager step on PyTorch or JAX branches in Python anyway (Keras's cond reads the flag there):
                # the host knows the outcome, and the core then leaves out what only an overflow needs.
                (apply if taken else skip)()
                if taken and veto is None:
                    return StepOutcome(optimizer.iterations, self.finite_flag(), False)
                return StepOutcome(optimizer.iterations, ops.cast(ops.logical_not(finite), "float32"), not taken)
        overflow = ops.logical_not(finite)
        flag = ops.cast(overflow, "float32")
        if self._compiling_now():
            self._made = (weakref.ref(flag), weakref.ref(overflow))
        return StepOutcome(optimizer.iterations, flag, None)

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

    # -- the spike rule ----------------------------------------------------------------------------------

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

    # -- provenance, replicas ----------------------------------------------------------------------------

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

    def replica(self) -> int | None:
        """The replica of a ``tf.distribute`` strategy running this call (None outside one, with one, or on
        another Keras backend)."""
        tf = _tensorflow()
        if tf is None:
            return None
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return None
        return int(tf.get_static_value(context.replica_id_in_sync_group))

    def plain_apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> Any:
        return optimizer.apply(list(grads), list(variables))

    def combine(self, flags: Sequence[Any]) -> Any:
        return flags[0] if len(flags) == 1 else ops.max(ops.stack(list(flags)))

    # -- the update --------------------------------------------------------------------------------------

    def read_new_scale(self, new_scale: Any) -> float | None:
        if not ops.is_tensor(new_scale) and not isinstance(new_scale, keras.Variable) and not _tf_tensor(new_scale):
            raise PolyampTypeError(
                f"update(new_scale) takes a float or a one-element floating tensor. Received: {describe(new_scale)}."
            )
        size = int(np.prod(new_scale.shape)) if None not in tuple(new_scale.shape) else None
        if size != 1 or "float" not in keras.backend.standardize_dtype(new_scale.dtype):
            raise PolyampTypeError(
                f"update(new_scale) takes a float or a one-element floating tensor. Received: {describe(new_scale)}."
            )
        if self._compiling_now() or is_tracer(new_scale):
            return None  # a symbolic value: known only when the step runs
        return float(ops.convert_to_numpy(ops.reshape(new_scale, ())).item())

    def update(self, found_inf: Any, new_scale: Any) -> None:
        state = self._state()
        if new_scale is None:
            if found_inf is not None and found_inf is self._finite:  # known finite on the host: one half
                advance(state, False, self._config, self._add, branch=self._branch)
            else:
                overflow = self._overflowed(found_inf)
                advance_on_flag(state, found_inf, self._config, self._add, branch=self._branch, overflow=overflow)
            return
        if isinstance(new_scale, float):
            state.scale.assign(new_scale)
        else:
            state.scale.assign(self._checked_scale_tensor(ops.reshape(ops.cast(new_scale, "float32"), ())))
        if found_inf is not None:
            self.count_skip(found_inf)

    def _checked_scale_tensor(self, value: Any) -> Any:
        """A new scale the host could not read (symbolic), checked when the step runs where the framework can
        (`polyamp_tensorflow` asserts in the graph)."""
        return value

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

    def _compiling_now(self) -> bool:
        tf = _tensorflow()
        return tf is not None and not tf.executing_eagerly()

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


def finish_window(window: SpikeWindow, x: Any, spike: Any, overflow: Any) -> Any:
    """End an iteration for the spike rule (`polyamp.backend_api.SpikeDevice.spike_finish`): the statistic
    enters ``window`` when the step was applied; returns 1 for a skip by the rule alone, -1 for a re-base."""
    return window.finish(x, spike, overflow)


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


def _apply_across_replicas(
    tf: Any, context: Any, optimizer: Any, finite: Any, grads: list[Any], variables: list[Any]
) -> None:
    """Apply or skip under a ``tf.distribute`` strategy, every replica alike (``finite`` is already reduced).

    The optimizer's apply sums the gradients across replicas (a ``merge_call`` in strategies that need one),
    which TensorFlow does not allow inside a ``cond`` in a replica context; so the ``cond`` is taken in the
    cross-replica context and applies in each replica from there, as Keras's own optimizers do. Strategies
    that need no ``merge_call`` take the ``cond`` in each replica: all of them take the same branch.
    """

    def applied(optimizer: Any, grads: list[Any], variables: list[Any]) -> Any:
        optimizer.apply(grads, variables)
        return tf.constant(True)

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        tf.cond(finite, lambda: applied(optimizer, grads, variables), lambda: tf.constant(False))
        return

    def cross_replica(distribution: Any, finite: Any, grads: list[Any]) -> Any:
        def apply() -> Any:
            distribution.extended.call_for_each_replica(applied, args=(optimizer, grads, variables))
            return tf.constant(True)

        return tf.cond(distribution.experimental_local_results(finite)[0], apply, lambda: tf.constant(False))

    context.merge_call(cross_replica, args=(finite, grads))


def _host_value(flag: Any) -> bool | None:
    """``flag``'s value where the step branches in Python on it anyway (PyTorch; JAX outside a trace), else
    None (TensorFlow builds a ``cond``; a JAX tracer has no value)."""
    backend = keras.backend.backend()
    if backend == "torch" or (backend == "jax" and not is_tracer(flag)):
        return bool(ops.convert_to_numpy(flag))
    return None


def _tf_tensor(value: Any) -> bool:
    tf = _tensorflow()
    return tf is not None and (tf.is_tensor(value) or isinstance(value, tf.Variable))


def is_tracer(value: Any) -> bool:
    """A JAX tracer: a value of a step being compiled (``jax.jit``), with no value on the host."""
    return type(value).__name__.endswith("Tracer")


def folded_clip_norm(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> float | None:
    """The inner optimizer's ``global_clipnorm`` when the unscale can apply it in the same multiply, else None.

    Folded: a Keras optimizer that clips by global norm in its own `_clip_gradients` (no subclass override, no
    gradient accumulation, which clips the accumulated sum), dense float32 gradients, no variable overwritten
    with its gradient, no ``tf.distribute`` strategy (its optimizer aggregates across replicas first). The
    values are then those of Keras's ``clip_by_global_norm`` after the division, bit for bit for a
    power-of-two scale; anything else is unscaled and left to the optimizer, as before.
    """
    clip_norm = getattr(optimizer, "global_clipnorm", None)
    if not clip_norm or clip_norm <= 0 or getattr(optimizer, "clipnorm", None) or getattr(optimizer, "clipvalue", None):
        return None
    if not isinstance(optimizer, keras.optimizers.Optimizer) or getattr(optimizer, "gradient_accumulation_steps", None):
        return None
    if type(optimizer)._clip_gradients is not keras.optimizers.Optimizer._clip_gradients:
        return None
    if any(getattr(v, "overwrite_with_gradient", False) for v in variables):
        return None
    present = [g for g in grads if g is not None]
    if not present or any(is_sparse(g) or keras.backend.standardize_dtype(g.dtype) != "float32" for g in present):
        return None
    tf = _tensorflow()
    if tf is not None and tf.distribute.has_strategy():
        return None
    return float(clip_norm)


@contextlib.contextmanager
def clipping_folded(optimizer: Any, folded: bool) -> Iterator[None]:
    """While open, ``optimizer`` does not clip (its ``global_clipnorm`` is None) when ``folded``: the unscale
    has. The setting is back when it closes."""
    if not folded:
        yield
        return
    saved = optimizer.global_clipnorm
    optimizer.global_clipnorm = None
    try:
        yield
    finally:
        optimizer.global_clipnorm = saved


def _times(grad: Any, factor: Any) -> Any:
    """``grad`` times ``factor`` in ``grad``'s dtype (a sparse gradient by its values)."""
    if is_sparse(grad) and hasattr(grad, "dense_shape"):
        return type(grad)(
            ops.multiply(grad.values, ops.cast(factor, grad.values.dtype)), grad.indices, grad.dense_shape
        )
    return ops.multiply(grad, ops.cast(factor, grad.dtype))
