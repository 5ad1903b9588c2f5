"""The TensorFlow device form of a loss scaler: its state in ``tf.Variable``s, the skip decided in the graph.

It implements `polyamp.backend_api.TapeDevice`; `polyamp.LossScaler` drives it and decides every step
semantic (stages, misuse, skip records). Variables are created outside any function graph
(``tf.init_scope``), so first use may be inside ``tf.function``. `apply` checks the gradients and applies
or skips them with a ``cond``, and `update` advances the rule with another, so nothing branches in Python on
a tensor value: it runs eagerly, in ``tf.function`` and with ``jit_compile=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyamp import LossScaleConfig, LossScaleState, PolyampTypeError, ScalerUsageError
from polyamp.backend_api import REBASE_BIT, SPIKE_BIT, StepOutcome, describe, ring_codes, wrong_object_error
from polyamp_keras.device import (
    ScaleState,
    SpikeWindow,
    advance_on_flag,
    all_finite,
    all_replicas_finite,
    gradient_counts,
    refuse_loss_scale_factor,
    unscale,
)
from polyamp_tensorflow._framework import keras, tf

__all__ = ["TensorFlowDevice"]

ops = keras.ops


def _variable(name: str, dtype: str, value: Any) -> tf.Variable:
    with tf.init_scope():  # created eagerly even when first touched inside tf.function
        return tf.Variable(value, dtype=dtype, trainable=False, name=name)


def _apply_across_replicas(context: Any, optimizer: Any, finite: Any, grads: list[Any], variables: list[Any]) -> None:
    """Apply or skip under a ``tf.distribute`` strategy, every replica alike (``finite`` is already reduced).

    The optimizer's apply sums the gradients across replicas (a ``merge_call`` in strategies that need one),
    which TensorFlow does not allow inside a ``cond`` in a replica context; so the ``cond`` is taken in the
    cross-replica context and applies in each replica from there, as Keras's own optimizers do. Strategies
    that need no ``merge_call`` take the ``cond`` in each replica: all of them take the same branch.
    """
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        tf.cond(finite, lambda: _applied(optimizer, grads, variables), lambda: tf.constant(False))
        return

    def cross_replica(distribution: Any, finite: Any, grads: list[Any]) -> Any:
        def apply() -> Any:
            distribution.extended.call_for_each_replica(_applied, args=(optimizer, grads, variables))
            return tf.constant(True)

        return tf.cond(distribution.experimental_local_results(finite)[0], apply, lambda: tf.constant(False))

    context.merge_call(cross_replica, args=(finite, grads))


def _applied(optimizer: Any, grads: list[Any], variables: list[Any]) -> Any:
    optimizer.apply(grads, variables)
    return tf.constant(True)


class TensorFlowDevice:
    """polyamp's loss-scaler state in TensorFlow variables, and the device operations of a step."""

    def __init__(self, config: LossScaleConfig, state: LossScaleState) -> None:
        self._config = config
        self._host_state = state
        self._variables: ScaleState | None = None
        self._traced = False
        self._history: tuple[tf.Variable, tf.Variable] | None = None
        # Per list of variables applied: their names, the counts of the last skipped step, and its iteration.
        self._provenance: dict[tuple[int, ...], tuple[list[Any], list[str], tf.Variable, tf.Variable]] = {}

    def _state(self) -> ScaleState:
        if not tf.executing_eagerly():
            self._traced = True  # the settings are becoming constants of a graph
        if self._variables is None:
            self._variables = ScaleState.create(self._host_state, _variable)
        return self._variables

    # -- state -------------------------------------------------------------------------------------------

    def read_state(self) -> LossScaleState:
        return self._host_state if self._variables is None else self._variables.read()

    def write_state(self, config: LossScaleConfig, state: LossScaleState | None) -> None:
        if self._traced and config != self._config:
            raise ScalerUsageError(
                f"The loss-scaling settings would change ({self._config} -> {config}), but a tf.function has "
                "already traced a step with this scaler: the settings are constants in that graph, which would "
                "go on using the old ones. Change settings before the first traced step, or create a new "
                "LossScaler (its state can be loaded at any time)."
            )
        self._config = config
        if state is None:
            return
        self._host_state = state
        if self._variables is not None:
            self._variables.write(state)

    def float16_in_use(self, *, since_last_iteration: bool = False, loss: Any = None) -> bool:
        """Whether Keras's own global dtype policy computes in float16 (e.g. set with
        ``keras.mixed_precision.set_global_policy("mixed_float16")``)."""
        return str(keras.config.dtype_policy().compute_dtype) == "float16"

    # -- the step ----------------------------------------------------------------------------------------

    def check_optimizer(self, method: str, optimizer: object) -> None:
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise wrong_object_error("tensorflow", method, optimizer, "a Keras 3 optimizer (keras.optimizers.*)")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ScalerUsageError(
                "apply_gradients() received a LossScaleOptimizer, which scales by itself: the gradients would "
                "be unscaled twice. Pass the plain optimizer, or use the LossScaleOptimizer without this scaler."
            )
        refuse_loss_scale_factor(optimizer, "a polyamp LossScaler does the scaling")

    def scale(self, loss: Any) -> Any:
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(item) for item in loss)
        if not (tf.is_tensor(loss) or isinstance(loss, tf.Variable)):
            raise wrong_object_error("tensorflow", "scale", loss, "a TensorFlow tensor (or a list of them)")
        # Like Keras, scale in at least float32: 2**16 is beyond float16's range.
        dtype = tf.float64 if loss.dtype == tf.float64 else tf.float32
        return tf.cast(loss, dtype) * tf.cast(self._state().scale, dtype)

    def check_gradients(self, method: str, grads: Sequence[Any]) -> None:
        for grad in grads:
            if grad is not None and not (tf.is_tensor(grad) or isinstance(grad, (tf.IndexedSlices, tf.Variable))):
                raise wrong_object_error(
                    "tensorflow", method, grad, "TensorFlow tensors (None for variables without a gradient)"
                )

    def unscale(self, grads: Sequence[Any]) -> list[Any]:
        return unscale(grads, self._state().scale)

    def apply(
        self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], *, unscaled: bool, veto: Any = None
    ) -> StepOutcome:
        """Unscale (unless ``unscaled``), check, apply unless non-finite or ``veto`` (the spike rule's flag) is
        set; the returned flag is the overflow alone (what the loss-scale rule sees)."""
        state = self._state()
        if not optimizer.built:  # variables cannot be created inside the cond below
            optimizer.build(list(variables))
        unscaled_grads = list(grads) if unscaled else unscale(grads, state.scale)
        finite = all_replicas_finite(all_finite(unscaled_grads))
        go = finite if veto is None else tf.logical_and(finite, tf.logical_not(veto > 0))
        context = tf.distribute.get_replica_context()
        if context is not None and tf.distribute.has_strategy():
            # Any strategy, one replica included (MirroredStrategy() on a one-GPU machine): the optimizer's
            # apply is a merge_call there too, which TensorFlow refuses inside a cond in a replica context.
            _apply_across_replicas(context, optimizer, go, unscaled_grads, list(variables))
        else:

            def apply() -> Any:
                optimizer.apply(unscaled_grads, list(variables))
                return tf.constant(True)

            def skip() -> Any:
                if veto is None:
                    self._count_non_finite(unscaled_grads, variables)
                else:  # a spike skips with finite gradients: count only when they are not
                    tf.cond(finite, lambda: tf.constant(False), lambda: self._counted(unscaled_grads, variables))
                return tf.constant(False)

            tf.cond(go, apply, skip)
        return StepOutcome(optimizer.iterations, tf.cast(tf.logical_not(finite), tf.float32), None)

    def _count_non_finite(self, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """In the branch that skips: each gradient's +inf/-inf/NaN counts, for the records (see
        `polyamp.NonFiniteGradient`); finite steps never run it."""
        if self._history is None:
            return
        key = tuple(id(v) for v in variables)
        slot = self._provenance.get(key)
        if slot is None:
            names = [str(getattr(v, "path", None) or v.name) for v in variables]
            slot = (
                list(variables),  # held, so the ids in the key stay theirs
                names,
                _variable("non_finite_counts", "int32", [[0, 0, 0, 0]] * len(names)),
                _variable("non_finite_at", "int64", -1),
            )
            self._provenance[key] = slot
        slot[2].assign(gradient_counts(grads))
        slot[3].assign(self._history[1])  # this iteration's index: its history entry is written next

    def _counted(self, grads: Sequence[Any], variables: Sequence[Any]) -> Any:
        self._count_non_finite(grads, variables)
        return tf.constant(True)

    # -- the spike rule ----------------------------------------------------------------------------------

    def new_spike_state(self, rule: Any) -> SpikeWindow:
        """The rule's window: polyamp_keras's, on variables made eagerly (also when first touched in a graph); the
        loss statistic is the core's to hold."""

        def make(*, shape: Any, dtype: str, initializer: Any, aggregation: str, name: str) -> tf.Variable:
            return _variable(name, dtype, initializer(shape, dtype))

        return SpikeWindow(rule, make, holds_loss=False)

    def read_spike_window(self, state: SpikeWindow) -> list[float]:
        return state.read()

    def read_spike_run(self, state: SpikeWindow) -> int:
        return state.read_run()

    def write_spike_window(self, state: SpikeWindow, values: list[float], run: int = 0) -> None:
        state.write(values, run)

    def spike_statistic(self, loss: Any) -> Any:
        if isinstance(loss, (list, tuple)):
            return tf.add_n([tf.reduce_sum(tf.cast(value, tf.float64)) for value in loss])
        return tf.reduce_sum(tf.cast(tf.stop_gradient(loss), tf.float64))

    def spike_grad_norm(self, grads: Sequence[Any], *, unscaled: bool) -> Any:
        values = [
            tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g, tf.float64) for g in grads if g is not None
        ]
        norm = tf.linalg.global_norm(values)
        return norm if unscaled else norm / tf.cast(self._state().scale, tf.float64)

    def spike_check(self, state: SpikeWindow, x: Any) -> Any:
        return tf.cast(state.is_spike(x), tf.float32)

    def spike_finish(self, state: SpikeWindow, x: Any, spike: Any, overflow: Any) -> Any:
        blocked = spike > 0 if overflow is None else (spike > 0) | (overflow > 0)
        only = spike > 0 if overflow is None else (spike > 0) & tf.logical_not(overflow > 0)
        rebased = state.push(x, applied=tf.logical_not(blocked), spiked=only)
        return tf.cast(only, tf.float32) - tf.cast(rebased, tf.float32)  # -1: re-based (SpikeDevice)

    def read_provenance(self) -> list[tuple[int, list[tuple[str, int, int, int, int]]]]:
        found = []
        for _, names, counts, at in self._provenance.values():
            index = int(at.numpy())
            if index >= 0:
                found.append((index, [(n, *row) for n, row in zip(names, counts.numpy().tolist(), strict=True)]))
                at.assign(-1)
        return found

    def replica(self) -> int | None:
        """The replica of a ``tf.distribute`` strategy running this call (None outside one, or with one)."""
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return None
        return int(tf.get_static_value(context.replica_id_in_sync_group))

    def plain_apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> Any:
        return optimizer.apply_gradients(zip(grads, variables, strict=True))

    def combine(self, flags: Sequence[Any]) -> Any:
        return flags[0] if len(flags) == 1 else tf.reduce_max(tf.stack(list(flags)))

    def read_new_scale(self, new_scale: Any) -> float | None:
        if not (tf.is_tensor(new_scale) or isinstance(new_scale, tf.Variable)) or (
            new_scale.shape.num_elements() != 1 or not new_scale.dtype.is_floating
        ):
            raise PolyampTypeError(
                f"update(new_scale) takes a float or a one-element floating tensor. Received: {describe(new_scale)}."
            )
        if not tf.executing_eagerly():
            return None  # a symbolic tensor: its value is known only when the graph runs
        return float(tf.reshape(new_scale, ()).numpy())

    def update(self, found_inf: Any, new_scale: Any) -> None:
        state = self._state()
        if new_scale is None:
            advance_on_flag(state, found_inf, self._config)
            return
        if tf.is_tensor(new_scale) or isinstance(new_scale, tf.Variable):
            value = tf.reshape(tf.cast(new_scale, tf.float32), ())
            if not tf.executing_eagerly():  # symbolic: the core could not read it, so the graph checks it
                config = self._config
                ok = tf.math.is_finite(value) & (value >= config.floor_f32)
                if config.max_scale_f32 is not None:
                    ok &= value <= config.max_scale_f32
                check = tf.debugging.Assert(
                    ok,
                    [
                        "update(new_scale) needs a finite scale within [min_scale, max_scale] = "
                        f"[{config.floor_f32!r}, {config.max_scale!r}] (without a min_scale, the floor is 1.0); "
                        "the scale was left unchanged. Received:",
                        value,
                    ],
                )
                with tf.control_dependencies([check]):
                    value = tf.identity(value)
            state.scale.assign(value)
        elif isinstance(new_scale, float):
            state.scale.assign(new_scale)
        else:
            raise PolyampTypeError(f"update(new_scale) takes a float or a tensor. Received: {describe(new_scale)}.")
        if found_inf is not None:
            state.skipped_steps.assign_add(tf.cast(found_inf > 0, tf.int64))

    # -- records -----------------------------------------------------------------------------------------

    def skipped(self, found_inf: Any) -> Any:
        return tf.greater(found_inf, 0.0)

    def read_flag(self, found_inf: Any) -> bool:
        return bool(tf.greater(found_inf, 0.0).numpy())

    def finite_flag(self) -> Any:
        return tf.constant(0.0)

    def new_record(self) -> tf.Variable:
        return _variable("step_skipped", "float32", 0.0)

    def write_record(self, record: tf.Variable, found_inf: Any) -> None:
        record.assign(found_inf)

    def read_record(self, record: tf.Variable) -> Any:
        return tf.convert_to_tensor(record)

    def skipped_steps(self) -> Any:
        return tf.convert_to_tensor(self._state().skipped_steps)

    def count_skip(self, found_inf: Any) -> None:
        """Count a guarded iteration as skipped when ``found_inf`` is set; the rule does not run."""
        self._state().skipped_steps.assign_add(tf.cast(found_inf > 0, tf.int64))

    def compiling(self) -> bool:
        """Whether a function is being traced (records are read eagerly only)."""
        return not tf.executing_eagerly()

    def new_history(self, capacity: int) -> tuple[tf.Variable, tf.Variable]:
        # A ring of mode codes and the count of entries written, in variables: written inside graphs too.
        self._history = (_variable("history_codes", "int32", [0] * capacity), _variable("history_count", "int64", 0))
        return self._history

    def write_history(
        self, history: tuple[tf.Variable, tf.Variable], base: int, found_inf: Any, spike: Any = None
    ) -> None:
        codes, count = history
        code = tf.constant(base, tf.int32)
        overflow = tf.constant(False) if found_inf is None else found_inf > 0
        spiked = tf.constant(False) if spike is None else spike > 0
        code += tf.cast(overflow | spiked, tf.int32)
        code += tf.cast(spiked & tf.logical_not(overflow), tf.int32) * SPIKE_BIT
        if spike is not None:
            code += tf.cast(spike < 0, tf.int32) * REBASE_BIT
        size = tf.size(codes, out_type=tf.int64)
        index = tf.math.floormod(tf.convert_to_tensor(count), size)
        # A whole-ring assign (a scatter is not defined on tf.distribute's mirrored variables).
        codes.assign(tf.where(tf.range(size) == index, code, tf.convert_to_tensor(codes)))
        count.assign_add(1)

    def read_history(self, history: tuple[tf.Variable, tf.Variable]) -> tuple[int, list[int]]:
        codes, count = history
        total = int(count.numpy())
        return total, ring_codes(total, codes.numpy().tolist())
