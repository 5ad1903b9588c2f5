"""Gradients as polyamp's Keras loss scaling handles them: unscaling, the finite check, double-unscale guards.

Keras ops only, so the same code runs on every Keras backend. TensorFlow's sparse gradients
(``tf.IndexedSlices``: values, indices, dense shape) are recognised by their shape, not imported.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from polyamp import ScalerUsageError
from polyamp_keras._keras import keras

__all__ = [
    "all_finite",
    "all_replicas_finite",
    "gradient_counts",
    "is_sparse",
    "non_finite_counts",
    "refuse_loss_scale_factor",
    "unscale",
]

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


def non_finite_counts(tensor: Any) -> Any:
    """How many elements of ``tensor`` are +inf, -inf and NaN: an int32 tensor of 3."""
    infinite = ops.isinf(tensor)
    return ops.stack(
        [
            ops.sum(ops.cast(ops.logical_and(infinite, ops.greater(tensor, 0)), "int32")),
            ops.sum(ops.cast(ops.logical_and(infinite, ops.less(tensor, 0)), "int32")),
            ops.sum(ops.cast(ops.isnan(tensor), "int32")),
        ]
    )


def gradient_counts(grads: Sequence[Any]) -> Any:
    """Per gradient, (+inf, -inf, NaN, size) as an int32 tensor of shape (len(grads), 4); None gives zeros,
    a sparse gradient is counted on its values (for `polyamp.NonFiniteGradient`)."""
    rows = []
    for grad in grads:
        if grad is None:
            rows.append(ops.zeros((4,), dtype="int32"))
            continue
        values = grad.values if is_sparse(grad) else grad
        size = 1
        for dim in values.shape:
            size *= int(dim)
        rows.append(ops.concatenate([non_finite_counts(values), ops.convert_to_tensor([size], dtype="int32")]))
    return ops.stack(rows)


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


def all_replicas_finite(finite: Any) -> Any:
    """``finite`` (a boolean scalar) reduced over the replicas of a ``tf.distribute`` strategy: True only if
    every replica's gradients are finite, so every replica takes the same apply-or-skip decision.

    Under a strategy the gradients are still per replica when they are checked (the inner optimizer sums
    them across replicas when it applies), so one replica can overflow while another does not. Outside a
    replica context with several replicas (no strategy, one replica, or Keras on JAX / PyTorch, where the
    gradients of sharded data are already global), ``finite`` is returned as is.
    """
    if keras.backend.backend() != "tensorflow":
        return finite
    tf = sys.modules["tensorflow"]  # imported: it is Keras's backend
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return finite
    overflowed = tf.cast(tf.logical_not(tf.cast(finite, tf.bool)), tf.float32)
    return tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, overflowed), 0.0)


def refuse_loss_scale_factor(optimizer: Any, when: str) -> None:
    """Raise if a Keras optimizer would divide by its own ``loss_scale_factor`` on top of polyamp's unscaling."""
    if optimizer.loss_scale_factor is not None:
        raise ScalerUsageError(
            f"The optimizer has loss_scale_factor={optimizer.loss_scale_factor!r} set and would divide the "
            f"gradients a second time. Leave loss_scale_factor unset when {when}."
        )
