"""Gradients as polyamp's Keras loss scaling handles them: unscaling, the finite check, double-unscale guards.

Keras ops, so the same code runs on every Keras backend; on Keras's PyTorch backend, which runs every
operation eagerly, dense float32 gradients are unscaled and checked with torch's foreach kernels instead
(`unscale_and_check`: the same values bit for bit, in two kernels for all gradients). TensorFlow's sparse
gradients (``tf.IndexedSlices``: values, indices, dense shape) are recognised by their shape, not imported.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyamp import ScalerUsageError
from polyamp_keras._keras import keras

__all__ = [
    "all_finite",
    "all_replicas_finite",
    "gradient_counts",
    "is_sparse",
    "non_finite_counts",
    "refuse_loss_scale_factor",
    "sparse_values",
    "unscale",
    "unscale_and_check",
]

ops = keras.ops

_COUNTABLE = 2**31  # a tensor with fewer elements has int32 counts that cannot wrap


#: Per type: whether its objects are sparse gradients (asked once per type: steps ask for every gradient).
_SPARSE_TYPES: dict[type, bool] = {}


def is_sparse(grad: Any) -> bool:
    """True for a sparse gradient (embedding lookups): TensorFlow's ``IndexedSlices`` (values at indices) or a
    JAX sparse array (``jax.experimental.sparse.BCOO``: data at indices)."""
    kind = type(grad)
    known = _SPARSE_TYPES.get(kind)
    if known is None:
        known = all(hasattr(grad, attr) for attr in ("values", "indices", "dense_shape")) or all(
            hasattr(grad, attr) for attr in ("data", "indices", "todense", "nse")
        )
        _SPARSE_TYPES[kind] = known
    return known


def sparse_values(grad: Any) -> Any:
    """The values a gradient stores: a sparse gradient's entries (``values`` / ``data``), else the gradient."""
    if not is_sparse(grad):
        return grad
    return grad.values if hasattr(grad, "dense_shape") else grad.data


def read_once(value: Any) -> Any:
    """``value`` as a tensor: a variable read once. (On TensorFlow, ``ops.convert_to_tensor`` gives a variable
    back, and in a graph every operation using it reads it anew.)"""
    if keras.backend.backend() == "tensorflow":
        return sys.modules["tensorflow"].convert_to_tensor(value)  # imported: it is Keras's backend
    return ops.convert_to_tensor(value)


def unscale(grads: Sequence[Any], scale: Any, skip: Sequence[bool] | None = None) -> list[Any]:
    """Divide each gradient by the scale (as Keras's LossScaleOptimizer does); None stays None.

    ``skip[i]`` leaves gradient i alone (variables that are overwritten with their gradient). A scale variable
    is read once for all of them (in a TensorFlow graph each read is an operation of its own).
    """
    scale = read_once(scale)
    result = []
    for index, grad in enumerate(grads):
        if grad is None or (skip is not None and skip[index]):
            result.append(grad)
        elif is_sparse(grad) and hasattr(grad, "dense_shape"):
            values = ops.divide(grad.values, ops.cast(scale, grad.values.dtype))
            result.append(type(grad)(values, grad.indices, grad.dense_shape))
        elif is_sparse(grad):  # JAX's BCOO: Keras's ops divide it as a sparse array
            result.append(ops.divide(grad, ops.cast(scale, grad.dtype)))
        else:
            result.append(ops.divide(grad, scale))
    return result


def non_finite_counts(tensor: Any) -> Any:
    """How many elements of ``tensor`` are +inf, -inf and NaN: an int32 tensor of 3.

    On Keras's JAX backend, in one pass over ``tensor`` (one variadic reduction): `all_finite` and
    `gradient_counts` both build it from the same gradient, so XLA computes it once for both, and the counts
    of a skipped step cost a compiled step no second pass and no conditional (whose operands XLA's CPU backend
    copies). There, XLA's CPU backend also runs this pass faster than ``all(isfinite(tensor))``.
    """
    if keras.backend.backend() == "jax":
        jax = sys.modules["jax"]  # imported: it is Keras's backend
        value = jax.numpy.asarray(tensor)
        zero = jax.numpy.int32(0)
        sums = jax.lax.reduce(
            (
                (value == np.inf).astype("int32"),
                (value == -np.inf).astype("int32"),
                jax.numpy.isnan(value).astype("int32"),
            ),
            (zero, zero, zero),
            lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2]),
            tuple(range(value.ndim)),
        )
        return jax.numpy.stack(sums)
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
    a sparse gradient is counted on its values (for `polyamp.NonFiniteGradient`).

    On TensorFlow, with static shapes, all gradients are counted in one pass: flattened, joined, classified
    element by element and summed per gradient with one segment sum, a handful of operations in a graph (or an
    XLA ``cond`` branch) instead of a dozen per gradient. On JAX each gradient is counted in the one pass that
    `all_finite` makes over it (`non_finite_counts`). Keras's PyTorch segment sum adds in float32 (inexact past
    2**24 elements), and that backend runs eagerly, so it counts gradient by gradient, as any backend does for
    a shape known only at run time.
    """
    values = [None if grad is None else sparse_values(grad) for grad in grads]
    known = [0 if v is None else _static_size(v) for v in values]
    if keras.backend.backend() != "tensorflow" or None in known:
        return _counts_each(values, known)
    sizes = [int(size) for size in known if size is not None]  # all of them
    present = [(index, v) for index, v in enumerate(values) if v is not None and sizes[index]]
    size_column = ops.convert_to_tensor(np.asarray(sizes, dtype="int32").reshape(-1, 1))
    if not present:
        return ops.concatenate([ops.zeros((len(values), 3), dtype="int32"), size_column], axis=1)
    # One dtype that holds every value's class exactly: float32 (float16 and bfloat16 widen exactly), or float64.
    common = "float64" if any(keras.backend.standardize_dtype(v.dtype) == "float64" for _, v in present) else "float32"
    flat = ops.concatenate([ops.reshape(ops.cast(v, common), (-1,)) for _, v in present])
    infinite = ops.isinf(flat)
    classes = ops.stack(
        [
            ops.logical_and(infinite, ops.greater(flat, 0)),
            ops.logical_and(infinite, ops.less(flat, 0)),
            ops.isnan(flat),
        ],
        axis=1,
    )
    segments = np.repeat(np.arange(len(values), dtype="int32"), sizes)  # gradient i's elements are segment i
    counts = ops.segment_sum(ops.cast(classes, "int32"), ops.convert_to_tensor(segments), num_segments=len(values))
    return ops.concatenate([counts, size_column], axis=1)


def _static_size(tensor: Any) -> int | None:
    """The number of elements of ``tensor``, or None when a dimension is known only at run time."""
    size = 1
    for dim in tensor.shape:
        if dim is None:
            return None
        size *= int(dim)
    return size


def _counts_each(values: Sequence[Any], sizes: Sequence[int | None]) -> Any:
    """`gradient_counts` gradient by gradient (values already taken out of sparse gradients)."""
    rows = []
    for tensor, size in zip(values, sizes, strict=True):
        if tensor is None:
            rows.append(ops.zeros((4,), dtype="int32"))
            continue
        if size is None:
            count = ops.reshape(ops.cast(ops.size(tensor), "int32"), (1,))
        else:
            count = ops.convert_to_tensor([size], dtype="int32")
        rows.append(ops.concatenate([non_finite_counts(tensor), count]))
    return ops.stack(rows)


def all_finite(grads: Sequence[Any]) -> Any:
    """A boolean scalar: no gradient holds inf or NaN (on Keras's JAX backend, from `non_finite_counts`)."""
    jax_counts = keras.backend.backend() == "jax"
    checks = []
    for grad in grads:
        if grad is None:
            continue
        values = sparse_values(grad)
        size = _static_size(values) if jax_counts else None
        if size is not None and size < _COUNTABLE:  # int32 counts that cannot wrap
            checks.append(ops.all(ops.equal(non_finite_counts(values), 0)))
        else:
            checks.append(ops.all(ops.isfinite(values)))
    if not checks:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(checks))


def unscale_and_check(grads: Sequence[Any], scale: Any, skip: Sequence[bool] | None = None) -> tuple[list[Any], Any]:
    """`unscale` and `all_finite` of the result: the unscaled gradients and a boolean scalar, True when none
    holds inf or NaN.

    On Keras's PyTorch backend, where each Keras operation is a separate eager call (a dozen per gradient for
    the division and the check), dense float32 gradients on the scale's device are divided with one
    ``torch._foreach_div`` and checked with torch's fused ``_amp_foreach_non_finite_check_and_unscale_`` at
    inverse scale 1 (which leaves the values as they are): the same values bit for bit. Anything else takes
    the Keras operations.
    """
    if keras.backend.backend() == "torch" and not any(skip or ()):
        fused = _torch_unscale_and_check(grads, scale)
        if fused is not None:
            return fused
    unscaled = unscale(grads, scale, skip)
    return unscaled, all_finite(unscaled)


def _torch_unscale_and_check(grads: Sequence[Any], scale: Any) -> tuple[list[Any], Any] | None:
    torch = sys.modules["torch"]  # imported: it is Keras's backend
    scale = ops.convert_to_tensor(scale)
    present = [grad for grad in grads if grad is not None]
    if not present or scale.dtype != torch.float32:
        return None
    for grad in present:
        if (
            type(grad) is not torch.Tensor
            or grad.layout != torch.strided
            or grad.dtype != torch.float32
            or grad.device != scale.device
            or grad.requires_grad
        ):
            return None
    with torch.no_grad():
        divided = iter(torch._foreach_div(present, scale))
        unscaled = [None if grad is None else next(divided) for grad in grads]
        found = torch.zeros((), dtype=torch.float32, device=scale.device)
        one = torch.ones((), dtype=torch.float32, device=scale.device)
        torch._amp_foreach_non_finite_check_and_unscale_([g for g in unscaled if g is not None], found, one)
    return unscaled, found == 0


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
