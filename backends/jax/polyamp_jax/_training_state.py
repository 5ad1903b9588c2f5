"""Reading and converting `precision`'s state: `convert_precision_state` (a state saved under one plan, made
the state of another) and `measure_state_bytes` (bytes per parameter, counted from the arrays)."""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from polyamp import Policy, PolyampTypeError, StateDictError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.forward_watch import LOGGER_NAME
from polyamp.backend_api.training_state import MeasuredStateBytes, checkpoint_changes
from polyamp_jax._optax import LossScaledState
from polyamp_jax._precision import PrecisionState, is_slot

__all__ = ["convert_precision_state", "measure_state_bytes"]


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray))


def _dtype(leaf: Any) -> str:
    return str(jnp.dtype(leaf.dtype).name)


def _fit(saved: Any, like: Any, what: str) -> Any:
    """The saved array ``saved`` in ``like``'s dtype; its shape must match."""
    if not _is_array(saved) or tuple(saved.shape) != tuple(like.shape):
        raise StateDictError(
            f"convert_precision_state: {what} must be an array of shape {tuple(like.shape)} (the state of the same "
            f"parameters and optimizer). Received: {describe(saved)}. Restore the checkpoint into the state of "
            "the plan it was saved under (old_tx.init(params)) and pass that."
        )
    return jnp.asarray(saved).astype(like.dtype)


def _parts(node: Any) -> PrecisionState:
    return node if isinstance(node, PrecisionState) else PrecisionState(node, None, None, None)


def _convert_trees(saved: Any, like: Any, what: str) -> Any:
    treedef: Any = jax.tree_util.tree_structure(like)
    try:
        saved_leaves = treedef.flatten_up_to(saved)
    except (TypeError, ValueError) as error:
        raise StateDictError(
            f"convert_precision_state: {what} does not have the structure of the optimizer's ({treedef}): "
            f"{error}. Received: {describe(saved)}. Was it saved for the same parameters and optimizer?"
        ) from None
    like_leaves = treedef.flatten_up_to(like)
    return treedef.unflatten([_fit(s, t, what) for s, t in zip(saved_leaves, like_leaves, strict=True)])


def _first_dtype(tree: Any, keep: Any = _is_array) -> str | None:
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(tree) if keep(leaf)]
    return _dtype(leaves[0]) if leaves else None


def _plan_of(state: PrecisionState, weights: str | None) -> Policy:
    """The training-state plan a `precision` state was made under, read from what it holds."""
    low = weights or "bfloat16"
    rounding = "kahan" if state.compensation is not None else ("stochastic" if state.key is not None else "nearest")
    master = "float32" if state.master is not None else low
    slots = _first_dtype(state.inner, is_slot) or master
    return Policy(f"params={low},compute={low},master={master},state={slots},rounding={rounding}")


def _convert_precision(saved: Any, like: Any, notes: dict[str, None]) -> Any:
    old, new = _parts(saved), _parts(like)
    weights = _first_dtype(new.compensation) or _first_dtype(old.compensation)
    changes = checkpoint_changes(
        _plan_of(new, weights),
        weights=weights,
        saved_master=_first_dtype(old.master),
        saved_compensation=_first_dtype(old.compensation),
        saved_slots=[_dtype(leaf) for leaf in jax.tree_util.tree_leaves(old.inner) if is_slot(leaf)],
    )
    notes.update(dict.fromkeys(changes.notes))
    inner = _convert_trees(old.inner, new.inner, "the optimizer's slots")
    master = new.master  # "make": the fresh state's, taken from the weights; "none"/"drop": None
    if changes.master in ("keep", "convert"):
        master = _convert_trees(old.master, new.master, "the master copy")
    compensation = new.compensation  # "make": the fresh state's zeros
    if changes.compensation in ("keep", "convert"):
        compensation = _convert_trees(old.compensation, new.compensation, "the compensation buffers")
    key = new.key
    if new.key is not None and old.key is not None:
        key = _convert_trees(old.key, new.key, "the stochastic rounding key")
    if not isinstance(like, PrecisionState):
        return inner
    return PrecisionState(inner, master, compensation, key)


def convert_precision_state(saved: Any, like: Any) -> Any:
    """``saved``, a state saved under one training-state plan, as the state of another: the one ``like`` is.

    ``like`` is the new transformation's fresh state (``new_tx.init(params)``, ``params`` the restored weights in
    the new plan's parameter dtype): a `precision` state, a `loss_scaled` state around one, or a plain optax
    state. ``saved`` is the checkpoint restored into the state of the plan it was saved under (e.g.
    ``old_tx.init(params)`` as orbax's or flax.serialization's target), of the same three kinds. Its slots are
    cast to the new state dtype, its master copies, compensation buffers and random key kept where the new plan
    has them; a master copy the checkpoint lacks is taken from the weights (``like``'s), compensation buffers it
    lacks start at zero, and the loss-scaler state is ``saved``'s. What changed is said in one warning through
    ``logging.getLogger("polyamp")`` (`polyamp.backend_api.training_state.conversion_note`), never silently.

    Returns:
        The converted state, with ``like``'s structure and dtypes.

    Raises:
        StateDictError: ``saved`` does not hold the state of the same parameters and optimizer (a structure or a
            shape differs); nothing is logged.
        PolyampTypeError: one of ``saved`` and ``like`` is a `loss_scaled` state and the other is not.
    """
    notes: dict[str, None] = {}  # ordered, without repeats
    if isinstance(like, LossScaledState) or isinstance(saved, LossScaledState):
        if not (isinstance(like, LossScaledState) and isinstance(saved, LossScaledState)):
            raise PolyampTypeError(
                "convert_precision_state: saved and like must both be loss_scaled states or neither. "
                f"Received: saved={describe(saved)}, like={describe(like)}."
            )
        converted: Any = LossScaledState(saved.scaler, _convert_precision(saved.inner, like.inner, notes), like.fn)
    else:
        converted = _convert_precision(saved, like, notes)
    if notes:
        logging.getLogger(LOGGER_NAME).warning(" ".join(notes))
    return converted


def _bytes(tree: Any, keep: Any = _is_array) -> int:
    return sum(
        int(leaf.size) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(tree) if keep(leaf)
    )


def measure_state_bytes(params: Any, opt_state: Any, grads: Any = None) -> MeasuredStateBytes:
    """The training state, counted from the arrays (``.per_parameter``: bytes per parameter).

    Args:
        params: The parameters (their floating leaves are the parameters counted).
        opt_state: The optimizer state: a `precision` state, a `loss_scaled` state (its scaler's arrays are not
            counted) or any optax state.
        grads: The gradients; None counts them in the parameter dtype (what ``jax.grad`` gives).

    Returns:
        A `polyamp.backend_api.training_state.MeasuredStateBytes`: the bytes of the weights, gradients, master copies,
        slots and compensation buffers, as `polyamp.state_bytes` plans them (``breakdown()`` per parameter): ``state``
        counts the optimizer's floating slots (leaves with at least one dimension; step counts and scalars are left
        out).

    Raises:
        PolyampTypeError: ``params`` holds no floating array.
    """
    floating = [
        leaf
        for leaf in jax.tree_util.tree_leaves(params)
        if _is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    count = sum(int(leaf.size) for leaf in floating)
    if count == 0:
        raise PolyampTypeError(f"measure_state_bytes: params holds no floating array. Received: {describe(params)}.")
    state = jax.tree_util.tree_map(
        lambda node: node.inner if isinstance(node, LossScaledState) else node,
        opt_state,
        is_leaf=lambda node: isinstance(node, LossScaledState),
    )
    plans = [
        node
        for node in jax.tree_util.tree_leaves(state, is_leaf=lambda n: isinstance(n, PrecisionState))
        if isinstance(node, PrecisionState)
    ]
    weights = _bytes(floating)
    return MeasuredStateBytes(
        parameters=count,
        weights=weights,
        gradients=weights if grads is None else _bytes(grads),
        master=sum(_bytes(plan.master) for plan in plans),
        state=_bytes(state, lambda leaf: _is_array(leaf) and is_slot(leaf))
        - sum(_bytes((plan.master, plan.compensation)) for plan in plans),
        compensation=sum(_bytes(plan.compensation) for plan in plans),
    )
