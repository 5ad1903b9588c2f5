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
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from polyamp import LossScaleConfig, LossScaleState, PolyampTypeError, ScalerUsageError, SpikeRule
from polyamp.backend_api import StepOutcome
from polyamp.backend_api.arguments import describe, wrong_object_error
from polyamp_keras._device_records import RecordMethods
from polyamp_keras._device_spikes import SpikeMethods
from polyamp_keras._device_variables import AddVariable, _Slot, _tensorflow
from polyamp_keras._gradients import (
    all_finite,
    all_replicas_finite,
    is_sparse,
    read_once,
    refuse_loss_scale_factor,
    sparse_values,
    unscale,
    unscale_and_check,
)
from polyamp_keras._keras import keras, overwritten_by_gradient
from polyamp_keras._rule import ScaleState, advance, advance_on_flag, device_cond

__all__ = ["KerasDevice", "clipping_folded", "folded_clip_norm"]

ops = keras.ops


class KerasDevice(RecordMethods, SpikeMethods):
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
        keep = [overwritten_by_gradient(v) for v in variables]
        # Typed by a cast, not an annotation: AutoGraph cannot convert a function whose annotated name a nested
        # function reads.
        unscaled_grads = cast("list[Any] | None", None)
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

    # -- replicas ----------------------------------------------------------------------------------------

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
    if any(overwritten_by_gradient(v) for v in variables):
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
