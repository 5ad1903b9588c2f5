"""Policy casting of pytrees, jmp-style: only floating-point array leaves change dtype."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from polyamp import Policy, get_policy

__all__ = ["cast_to_compute", "cast_to_output", "cast_to_param", "cast_tree", "module_dtypes"]

T = TypeVar("T")


def _policy(policy: Policy | str | None) -> Policy:
    if policy is None:
        return get_policy()
    if isinstance(policy, Policy):
        return policy
    return Policy(policy)


def cast_tree(tree: T, dtype: Any) -> T:
    """``tree`` with every floating-point array leaf (JAX or NumPy) cast to ``dtype``; integer, boolean and
    non-array leaves are left as they are (jmp's rule)."""
    target = jnp.dtype(dtype)

    def cast(leaf: Any) -> Any:
        if isinstance(leaf, (jax.Array, np.ndarray)) and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.astype(target)
        return leaf

    return jax.tree_util.tree_map(cast, tree)  # type: ignore[no-any-return]


def cast_to_compute(tree: T, policy: Policy | str | None = None) -> T:
    """Floating leaves of ``tree`` in the policy's compute dtype (``policy`` None: the policy in effect,
    `polyamp.get_policy`; a string is parsed by `polyamp.Policy`)."""
    return cast_tree(tree, _policy(policy).compute_dtype)


def cast_to_param(tree: T, policy: Policy | str | None = None) -> T:
    """Floating leaves of ``tree`` in the policy's parameter dtype."""
    return cast_tree(tree, _policy(policy).param_dtype)


def cast_to_output(tree: T, policy: Policy | str | None = None) -> T:
    """Floating leaves of ``tree`` in the policy's output dtype."""
    return cast_tree(tree, _policy(policy).output_dtype)


def module_dtypes(policy: Policy | str | None = None) -> dict[str, Any]:
    """The policy as the dtype arguments of Flax's layers (Linen and NNX): ``{"dtype": compute,
    "param_dtype": param}``, e.g. ``nn.Dense(64, **polyamp_jax.module_dtypes())``: parameters kept in the
    parameter dtype, each layer computing in the compute dtype (and the normalisations' statistics in float32,
    as Flax computes them). Functions outside layers (softmax, losses) run as written; `autocast` gives them
    their op classes too."""
    chosen = _policy(policy)
    return {"dtype": jnp.dtype(chosen.compute_dtype), "param_dtype": jnp.dtype(chosen.param_dtype)}
