"""`precision`: any optax optimizer following the policy's training-state plan (master copy, state dtype,
rounding), as an optax transformation.

The rules are the core's (``polyamp.backend_api.training_state.write_update`` is their reference): the inner optimizer
runs on float32 working copies of the weights (or master copies), gradients and slots; the slots are stored back in
the plan's state dtype; the new weights are written with the plan's rounding. optax transformations return
updates that ``optax.apply_updates`` adds to the parameters, so the transformation performs the write itself and
returns, in float32, the difference between the written weight and the stored one: ``params + updates``
(computed in float32, then cast to the parameter dtype by ``optax.apply_updates``) gives back the written
weight.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from polyamp import FunctionalLossScaler, InvalidConfigError, Policy, PolyampTypeError, TrainingStateWarning, get_policy
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.policies import PolicyLike
from polyamp.backend_api.training_state import is_state_slot, unplanned_hazard_message

__all__ = ["PrecisionState", "is_slot", "precision", "warn_unplanned"]

_LOW = ("bfloat16", "float16")


class PrecisionState(NamedTuple):
    """The state of `precision`, a pytree of arrays.

    Attributes:
        inner: The wrapped optimizer's state; its floating slots (leaves with at least one dimension: moments,
            factored second moments) in the plan's state dtype, its counters and scalars as it keeps them.
        master: None, or (``keeps_master`` plans) a tree like the parameters holding the float32 master copy of
            each bfloat16/float16 parameter (None for the others).
        compensation: None, or (``rounding="kahan"``) a tree like the parameters holding each bfloat16/float16
            parameter's compensation buffer, in its dtype (None for the others).
        key: None, or (``rounding="stochastic"``) the PRNG key (``uint32[2]``) the random bits of the next
            write are drawn from.
    """

    inner: Any
    master: Any
    compensation: Any
    key: Any


def is_slot(leaf: Any) -> bool:
    """True for an optimizer-state leaf the plan's state dtype applies to (the core's
    `polyamp.backend_api.training_state.is_state_slot`): a floating array with at least one dimension (a moment).
    Scalars (step counts, injected hyperparameters) keep their dtype."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and is_state_slot(
        floating=bool(jnp.issubdtype(dtype, jnp.floating)), ndim=int(getattr(leaf, "ndim", 0))
    )


def _is_floating(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _is_low(leaf: Any) -> bool:
    return _is_floating(leaf) and jnp.dtype(leaf.dtype).name in _LOW


def _cast_slots(tree: Any, dtype: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf: leaf.astype(dtype) if is_slot(leaf) else leaf, tree)


def _to_float32(leaf: Any) -> Any:
    return leaf.astype(jnp.float32) if _is_floating(leaf) else leaf


def _round_to_nearest(value: Any, dtype: Any) -> Any:
    """``value`` (float32) rounded to nearest-even in ``dtype``, as float32 (``round_to`` of the core).

    bfloat16 is rounded on the bit pattern (integer operations, which no compiler pass rewrites); float16 through
    a conversion kept apart from the conversion back by an optimization barrier, so that XLA cannot fold the
    pair away under its ``xla_allow_excess_precision`` default.
    """
    if jnp.dtype(dtype) == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(value, jnp.uint32)
        rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
        return jnp.where(jnp.isnan(value), value, jax.lax.bitcast_convert_type(rounded, jnp.float32))
    return jax.lax.optimization_barrier(value.astype(dtype)).astype(jnp.float32)  # type: ignore[no-untyped-call]


def _round_stochastically(value: Any, key: Any) -> Any:
    """``value`` (float32) rounded to bfloat16 with 16 random bits drawn from ``key``, as float32."""
    random16 = jax.random.bits(key, value.shape, jnp.uint16).astype(jnp.uint32)
    bits = jax.lax.bitcast_convert_type(value, jnp.uint32)
    rounded = jax.lax.bitcast_convert_type((bits + random16) & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isnan(value), value, rounded)


def _update_for(written: Any, stored: Any) -> Any:
    """The float32 update ``u`` with ``stored + u == written`` (both float32 views of the parameter dtype).

    ``-0.0`` is the additive identity of every value (``+0.0 + -0.0`` is ``+0.0``), so an unchanged weight keeps
    its bits, a negative zero included."""
    return jnp.where(written == stored, jnp.float32(-0.0), written - stored)


def warn_unplanned(optimizer: str, params: Any, plan: Policy) -> bool:
    """Warn (`polyamp.TrainingStateWarning`) when an optimizer following ``plan`` steps bfloat16/float16
    ``params`` with no master copy and nearest rounding; return whether it warned."""
    dtypes = [jnp.dtype(leaf.dtype).name for leaf in jax.tree_util.tree_leaves(params) if _is_low(leaf)]
    message = unplanned_hazard_message(optimizer, dtypes, plan)
    if message is None:
        return False
    warnings.warn(TrainingStateWarning(message), stacklevel=3)
    return True


def _holds_loss_scaling(tree: Any) -> bool:
    def is_scaled(node: Any) -> bool:
        return isinstance(getattr(node, "fn", None), FunctionalLossScaler)

    return any(is_scaled(node) for node in jax.tree_util.tree_leaves(tree, is_leaf=is_scaled))


def _check_seed(seed: object) -> int:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise InvalidConfigError(
            f"`seed` must be an int in [0, 2**32) (the seed of stochastic rounding's random bits). "
            f"Received: {describe(seed)}."
        )
    return seed


def precision(
    inner: optax.GradientTransformation, policy: PolicyLike | None = None, *, seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """``inner`` (any optax optimizer) following the training-state plan of ``policy``: master copy, state
    dtype and rounding of the update (see ``docs/guide/training-state.md``).

    Each step, ``inner`` runs on float32 working copies: the master copy (``keeps_master`` plans) or the stored
    weight, the gradient and every floating slot. The slots are stored back in ``policy.state_dtype`` (rounded
    to nearest), and each bfloat16/float16 weight is written with the plan's rounding: to nearest (a float32
    master copy keeps the exact value), stochastically (bfloat16: random bits from a key in the state) or with
    a Kahan compensation buffer (in the parameter dtype). float32 parameters take ``inner``'s updates as they
    are: under the default plan the transformation is ``inner``, bit for bit.

    The updates are float32: ``optax.apply_updates(params, updates)`` (and ``nnx.Optimizer``, a Flax
    ``TrainState``) add them in float32 and cast the sum to the parameter dtype, which gives back the written
    weight bit for bit. (One exception: with a float32 master copy, a weight written more than 2**15 times
    smaller than the stored one can be off by half a float32 unit in the last place of the stored weight; the
    master copy holds the exact value, and the next step writes from it.)

    Wrap it in `loss_scaled` for loss scaling, the guard and spike skips:
    ``loss_scaled(precision(optax.adamw(1e-3)))``; a skipped step leaves this state (slots, master copies,
    compensation buffers, key) bitwise as it was.

    Args:
        inner: Any optax transformation (``optax.adamw(1e-3)``, a chain, ...), not one holding `loss_scaled`.
        policy: The policy whose plan to follow (a `polyamp.Policy` or spec); None: the policy in effect when
            the transformation is made (`polyamp.get_policy`).
        seed: The seed of stochastic rounding's random bits (kept in the state, so a resumed run draws the same
            bits).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a `PrecisionState`; its ``update`` needs
        ``params``.

    Raises:
        PolyampTypeError: ``inner`` is not an optax transformation, or ``update`` is called without ``params``.
        InvalidConfigError: ``seed`` is not an int in [0, 2**32); ``inner`` holds `loss_scaled` (put it
            outside); a float16 parameter under a stochastic plan (defined for bfloat16).
        InvalidPolicyError: ``policy`` is not a policy.

    Warns:
        TrainingStateWarning: once, at the first ``init`` with bfloat16/float16 parameters, under a plan with
            neither a master copy nor a rounding (``"bfloat16"``): updates smaller than half a unit in the last
            place round away.

    Example:
        ```python
        polyamp.set_policy("bfloat16_kahan")
        tx = polyamp_jax.loss_scaled(polyamp_jax.precision(optax.adamw(1e-3)))
        params = polyamp_jax.cast_to_param(params)  # bfloat16
        opt_state = tx.init(params)  # moments and compensation buffers in bfloat16
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ```
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise PolyampTypeError(
            f"precision() wraps an optax transformation (such as optax.adamw(1e-3)). Received: {describe(inner)}."
        )
    plan = get_policy() if policy is None else Policy(policy)
    seed = _check_seed(seed)
    wrapped = optax.with_extra_args_support(inner)
    state_dtype = jnp.dtype(plan.state_dtype)
    warned = False

    def init(params: Any) -> PrecisionState:
        nonlocal warned
        leaves, treedef = _flatten(params)
        if plan.rounding == "stochastic":
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
                if _is_floating(leaf) and jnp.dtype(leaf.dtype) == jnp.float16:
                    raise InvalidConfigError(
                        f"Stochastic rounding (policy {plan.name!r}) is defined for bfloat16 weights; the parameter "
                        f"{jax.tree_util.keystr(path)} is float16. Keep it in bfloat16, or use a Kahan plan "
                        "(rounding='kahan')."
                    )
        if not warned:
            warned = warn_unplanned(f"polyamp_jax.precision (policy {plan.name!r})", params, plan)
        working = [_to_float32(leaf) for leaf in leaves]
        inner_state = wrapped.init(treedef.unflatten(working))
        if _holds_loss_scaling(inner_state):
            raise InvalidConfigError(
                "precision() received an optimizer holding polyamp_jax.loss_scaled: a skipped step must leave the "
                "precision state (compensation, random key) as it was, so loss scaling goes outside. Write "
                "loss_scaled(precision(optimizer)), not precision(loss_scaled(optimizer))."
            )
        master = compensation = key = None
        if plan.keeps_master:
            master = treedef.unflatten([w if _is_low(p) else None for p, w in zip(leaves, working, strict=True)])
        if plan.rounding == "kahan":
            compensation = treedef.unflatten([jnp.zeros_like(p) if _is_low(p) else None for p in leaves])
        if plan.rounding == "stochastic":
            key = jax.random.PRNGKey(seed)
        return PrecisionState(_cast_slots(inner_state, state_dtype), master, compensation, key)

    def update(updates: Any, state: PrecisionState, params: Any = None, **extra: Any) -> tuple[Any, PrecisionState]:
        if params is None:
            raise PolyampTypeError(
                "polyamp_jax.precision's update writes the new weights itself and needs them: call "
                "tx.update(grads, opt_state, params). Received: params=None."
            )
        if not isinstance(state, PrecisionState):
            raise PolyampTypeError(
                f"polyamp_jax.precision's update takes the state its init made (a PrecisionState). "
                f"Received: {describe(state)}."
            )
        leaves, treedef = _flatten(params)
        masters = _per_leaf(treedef, state.master)
        buffers = _per_leaf(treedef, state.compensation)
        working = [m if m is not None else _to_float32(p) for p, m in zip(leaves, masters, strict=True)]
        grads = jax.tree_util.tree_map(_to_float32, updates)
        steps, new_inner = wrapped.update(
            grads, _cast_slots(state.inner, jnp.float32), treedef.unflatten(working), **extra
        )
        steps = treedef.flatten_up_to(steps)
        key = state.key
        keys: list[Any] = [None] * len(leaves)
        if key is not None:
            key, *keys = jax.random.split(key, len(leaves) + 1)
        out, new_masters, new_buffers = [], [], []
        for p, w32, u, m, c, k in zip(leaves, working, steps, masters, buffers, keys, strict=True):
            if not _is_low(p):
                out.append(u)
                new_masters.append(m)
                new_buffers.append(c)
                continue
            target = jnp.asarray(w32 + u).astype(jnp.float32)
            stored = p.astype(jnp.float32)
            if m is not None:
                written, c = _round_to_nearest(target, p.dtype), None
            else:
                written, c = _write(target, stored, p.dtype, plan.rounding, c, k)
            new_masters.append(None if m is None else target)
            new_buffers.append(c)
            out.append(_update_for(written, stored))
        return treedef.unflatten(out), PrecisionState(
            _cast_slots(new_inner, state_dtype),
            None if state.master is None else treedef.unflatten(new_masters),
            None if state.compensation is None else treedef.unflatten(new_buffers),
            key,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _write(target: Any, stored: Any, dtype: Any, rounding: str, c: Any, key: Any) -> tuple[Any, Any]:
    """The written weight (as float32) of ``target`` over the ``stored`` weight, and the new compensation."""
    if rounding == "stochastic":
        return _round_stochastically(target, key), c
    if rounding != "kahan":
        return _round_to_nearest(target, dtype), c
    # The core's write_update: one float32 operation each, in its order.
    delta = target - stored
    y = c.astype(jnp.float32) + delta
    written = _round_to_nearest(stored + y, dtype)
    return written, _round_to_nearest(y - (written - stored), dtype).astype(dtype)


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return leaves, treedef


def _per_leaf(treedef: Any, tree: Any) -> list[Any]:
    if tree is None:
        return [None] * treedef.num_leaves
    return list(treedef.flatten_up_to(tree))
