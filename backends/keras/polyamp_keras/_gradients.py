"""Gradients as polyamp's Keras loss scaling handles them: unscaling, the finite check, double-unscale guards.

Keras ops only, so the same code runs on every Keras backend. TensorFlow's sparse gradients
(``tf.IndexedSlices``: values, indices, dense shape) are recognised by their shape, not imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyamp import ScalerUsageError
from polyamp_keras._keras import keras

__all__ = ["all_finite", "is_sparse", "refuse_loss_scale_factor", "unscale"]

ops = keras.ops


def is_sparse(grad: Any) -> bool:
    """True for a TensorFlow ``IndexedSlices`` gradient (embedding lookups): values at indices."""
    return all(hasattr(grad, attr) for attr in ("values", "indices", "dense_shape"))


def unscale(grads: Sequence[Any], scale: Any, skip: Sequence[bool] | None = None) -> list[Any]:
    """Divide each gradient by the scale (as Keras's LossScaleOptimizer does); None stays None.

    ``skip[i]`` leaves gradient i alone (variables that are overwritten with their gradient).
    """
    result = []
    for index, grad in enumerate(grads):
        if grad is None or (skip is not None and skip[index]):
            result.append(grad)
        elif is_sparse(grad):
            values = ops.divide(grad.values, ops.cast(scale, grad.values.dtype))
            result.append(type(grad)(values, grad.indices, grad.dense_shape))
        else:
            result.append(ops.divide(grad, scale))
    return result


def all_finite(grads: Sequence[Any]) -> Any:
    """A boolean scalar: no gradient holds inf or NaN."""
    checks = []
    for grad in grads:
        if grad is None:
            continue
        values = grad.values if is_sparse(grad) else grad
        checks.append(ops.all(ops.isfinite(values)))
    if not checks:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(checks))


def refuse_loss_scale_factor(optimizer: Any, when: str) -> None:
    """Raise if a Keras optimizer would divide by its own ``loss_scale_factor`` on top of polyamp's unscaling."""
    if optimizer.loss_scale_factor is not None:
        raise ScalerUsageError(
            f"The optimizer has loss_scale_factor={optimizer.loss_scale_factor!r} set and would divide the "
            f"gradients a second time. Leave loss_scale_factor unset when {when}."
        )
