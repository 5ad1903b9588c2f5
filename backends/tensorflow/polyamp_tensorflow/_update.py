"""polyamp's loss-scale rule as Keras ops on variables: no Python branch on a tensor value.

Used by `LossScaleOptimizer` and by the TensorFlow `LossScaler`, eagerly, inside ``tf.function`` and under
``jit_compile=True``. Each product is formed in float64 and rounded to float32, as polyamp's reference
and torch's kernel do, so the trajectories agree bit for bit across backends.
"""

from __future__ import annotations

from typing import Any, Protocol

from polyamp import LossScaleConfig
from polyamp._src.scaling import to_float32
from polyamp_tensorflow._framework import keras

__all__ = [
    "ScaleVariables",
    "UnscaleTracker",
    "advance",
    "all_finite",
    "refuse_loss_scale_factor",
    "to_python",
    "unscale",
]

ops = keras.ops


class ScaleVariables(Protocol):
    """Where the state lives: variables with ``assign`` (Keras or tf.Variables)."""

    scale: Any  # float32
    growth_tracker: Any  # int32
    hysteresis_left: Any  # int32
    skipped_steps: Any  # int64, iterations with a skipped step
    last_skipped: Any  # bool, whether the most recent step was skipped


def to_python(value: Any) -> Any:
    """A scalar variable or tensor as a Python number (via ``.numpy()``: numpy 2 warns on ``np.array`` of TF
    tensors)."""
    tensor = ops.convert_to_tensor(value)
    if hasattr(tensor, "numpy") and keras.backend.backend() == "tensorflow":
        return tensor.numpy().item()
    return ops.convert_to_numpy(tensor).item()


def _times(scale: Any, factor: float) -> Any:
    # A float32 product of two float32 values is the correctly rounded exact product, which is what
    # rounding the float64 product gives; only factors float32 cannot hold exactly need the float64 detour.
    if to_float32(factor) == factor:
        return ops.multiply(scale, ops.cast(factor, "float32"))
    return ops.cast(ops.multiply(ops.cast(scale, "float64"), factor), "float32")


def advance(state: ScaleVariables, overflow: bool, config: LossScaleConfig) -> None:
    """One update of ``config``'s rule, for a step that overflowed or not.

    ``overflow`` is a Python bool: callers run this inside the two branches of the apply-or-skip
    ``cond``, where it is known, so each branch builds only its half of the rule (a few scalar ops).
    """
    state.last_skipped.assign(overflow)
    if overflow:
        state.skipped_steps.assign_add(ops.cast(1, "int64"))
    if not config.dynamic:
        return
    scale = ops.convert_to_tensor(state.scale)
    if overflow:
        state.growth_tracker.assign(ops.cast(0, "int32"))
        backed = _times(scale, config.backoff_factor)
        if config.min_scale_f32 is not None:
            backed = ops.maximum(backed, config.min_scale_f32)
        if config.hysteresis == 1:
            state.scale.assign(backed)
            return
        hysteresis_after = ops.convert_to_tensor(state.hysteresis_left) - 1
        back_off = hysteresis_after <= 0
        state.scale.assign(ops.where(back_off, backed, scale))
        state.hysteresis_left.assign(ops.where(back_off, config.hysteresis, hysteresis_after))
        return
    next_tracker = ops.convert_to_tensor(state.growth_tracker) + 1
    grow = next_tracker >= config.growth_interval
    grown = _times(scale, config.growth_factor)
    if config.max_scale_f32 is not None:
        grown = ops.minimum(grown, config.max_scale_f32)
    state.scale.assign(ops.where(ops.logical_and(grow, ops.isfinite(grown)), grown, scale))
    state.growth_tracker.assign(ops.cast(ops.where(grow, 0, next_tracker), "int32"))
    if config.hysteresis > 1:
        state.hysteresis_left.assign(
            ops.cast(ops.where(grow, config.hysteresis, ops.convert_to_tensor(state.hysteresis_left)), "int32")
        )


def unscale(grads: list[Any], scale: Any, skip: list[bool] | None = None) -> list[Any]:
    """Divide each gradient by the scale (as Keras's LossScaleOptimizer does); None stays None.

    ``skip[i]`` leaves gradient i alone (variables that are overwritten with their gradient).
    """
    from polyamp_tensorflow._framework import tf

    result = []
    for index, grad in enumerate(grads):
        if grad is None or (skip is not None and skip[index]):
            result.append(grad)
        elif isinstance(grad, tf.IndexedSlices):
            values = grad.values / ops.cast(scale, grad.values.dtype)
            result.append(tf.IndexedSlices(values, grad.indices, grad.dense_shape))
        else:
            result.append(ops.divide(grad, scale))
    return result


def all_finite(grads: list[Any]) -> Any:
    """A boolean scalar: no gradient holds inf or NaN."""
    from polyamp_tensorflow._framework import tf

    checks = []
    for grad in grads:
        if grad is None:
            continue
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        checks.append(ops.all(ops.isfinite(values)))
    if not checks:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(checks))


class UnscaleTracker:
    """Which gradients were unscaled, so `apply_gradients` never divides them twice.

    Each ``unscale(grads)`` call opens a pending stage; the next ``apply_gradients`` consumes it and takes
    its gradients as unscaled: the tensors ``unscale`` returned, or new tensors made from them (clipping
    returns new tensors). Two mistakes are caught instead of silently mis-scaling: passing the scaled
    gradients that went into ``unscale``, and mixing its outputs with other gradients. Bookkeeping is in
    Python, so inside ``tf.function`` it happens once per trace, consistently.
    """

    def __init__(self) -> None:
        # (ids of scaled inputs, ids of unscaled outputs, strong references keeping those ids unique)
        self._pending: list[tuple[set[int], set[int], list[Any]]] = []

    def record(self, inputs: list[Any], outputs: list[Any]) -> None:
        self._pending.append(
            ({id(g) for g in inputs if g is not None}, {id(g) for g in outputs if g is not None}, [*inputs, *outputs])
        )

    def consume(self, grads: list[Any], where: str) -> bool:
        """True if ``grads`` are to be taken as unscaled (a pending ``unscale`` is consumed)."""
        from polyamp import ScalerUsageError

        if not self._pending:
            return False
        ids = [id(g) for g in grads if g is not None]
        inputs, outputs, _ = self._pending[0]
        if any(i in inputs for i in ids):
            self._pending.clear()
            raise ScalerUsageError(
                f"{where} received the scaled gradients that were passed to unscale()/get_unscaled_gradients(). "
                "Pass the unscaled gradients it returned (clipped or transformed as you like)."
            )
        returned = [i in outputs for i in ids]
        if any(returned) and not all(returned):
            self._pending.clear()
            raise ScalerUsageError(
                f"{where} received a mix of gradients returned by unscale()/get_unscaled_gradients() and "
                "other gradients: some would be divided by the loss scale twice or not at all. Unscale all "
                "of them together, or none and let apply_gradients do it."
            )
        self._pending.pop(0)
        return True


def refuse_loss_scale_factor(optimizer: Any, when: str) -> None:
    """Raise if a Keras optimizer would divide by its own ``loss_scale_factor`` on top of polyamp's unscaling."""
    from polyamp import ScalerUsageError

    if optimizer.loss_scale_factor is not None:
        raise ScalerUsageError(
            f"The optimizer has loss_scale_factor={optimizer.loss_scale_factor!r} set and would divide the "
            f"gradients a second time. Leave loss_scale_factor unset when {when}."
        )
