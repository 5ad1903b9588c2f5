"""Which matrix products of a function under `polyamp_jax.autocast` run in FP8, and running them.

Under a policy with a dynamic `polyamp.Float8Recipe`, a ``dot_general`` equation runs in FP8
(`polyamp_jax._float8`) when it is a linear layer's product: two floating operands, no batch dimensions,
and a layer the recipe takes (`polyamp.Float8Recipe.skip_reason`) with its contracted size as
``in_features`` and the weight's free size as ``out_features``. The weight is the operand that comes from
the model's parameters (a Flax Linen ``"params"`` leaf, an Equinox module's array), followed through
casts, transposes and reshapes; where neither or both operands do, it is the right one (``x @ w``, as
Flax's layers call ``dot_general``). A layer's name is its JAX name stack: the scopes of
``jax.named_scope``, which Flax Linen opens per module (``"encoder.dense"``; a Linen ``apply`` drops the root
module's own name, as torch's ``named_modules`` does), or ``""`` outside any scope, so ``modules`` and
``skip`` patterns match Linen module paths; Equinox and Flax NNX modules open no scope, and their layers are
chosen by shape alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Final

import jax.extend.core as jcore
import jax.numpy as jnp

from polyamp import Float8Recipe
from polyamp_jax._float8 import layout_of, product

__all__ = ["Float8Products"]

#: Primitives whose output is still the weight when their operand is (a cast, a transpose, a reshape).
_FOLLOW: Final = frozenset({"convert_element_type", "transpose", "reshape", "copy", "copy_p", "squeeze", "expand_dims"})


def _scopes(eqn: Any) -> list[str]:
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return [entry.name for entry in stack if type(entry).__name__ == "Scope"]


def _floating(value: Any) -> bool:
    return hasattr(value, "dtype") and bool(jnp.issubdtype(value.dtype, jnp.floating))


class Float8Products:
    """The FP8 state of one interpretation: the recipe, the variables holding weights, the enclosing scopes."""

    def __init__(self, recipe: Float8Recipe, weights: dict[Any, Any], *, drop_root: bool) -> None:
        self.recipe = recipe
        self.stored = weights  # each parameter's variable, and its value as stored (float32, say)
        self.weights = set(weights)
        self.drop_root = drop_root
        self.prefix: list[str] = []

    def _is_weight(self, var: Any) -> bool:
        return isinstance(var, jcore.Var) and var in self.weights

    def follow(self, eqn: Any) -> None:
        """Mark the outputs of ``eqn`` as weights when it only reshapes or casts one."""
        if eqn.primitive.name in _FOLLOW and eqn.invars and self._is_weight(eqn.invars[0]):
            self.weights.update(v for v in eqn.outvars if isinstance(v, jcore.Var))

    @contextlib.contextmanager
    def call(self, eqn: Any, body: Any) -> Iterator[None]:
        """Inside the body of a call equation: its parameters that are weights, its scopes as a prefix."""
        self.weights.update(
            inner for inner, outer in zip(body.invars, eqn.invars, strict=False) if self._is_weight(outer)
        )
        scopes = _scopes(eqn)
        self.prefix.extend(scopes)
        try:
            yield
        finally:
            del self.prefix[len(self.prefix) - len(scopes) :]

    def name(self, eqn: Any) -> str:
        """The layer name of ``eqn``: its scopes joined by dots."""
        scopes = [*self.prefix, *_scopes(eqn)]
        if self.drop_root and scopes:
            scopes = scopes[1:]
        return ".".join(scopes)

    def product(self, eqn: Any, values: list[Any], compute: Any) -> Any | None:
        """``eqn``'s product in FP8 in the compute dtype, or None when it is not a linear layer's the recipe takes."""
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
        if lhs_batch or rhs_batch or len(values) != 2 or not all(_floating(v) for v in values):
            return None
        lhs, rhs = values
        weight_is_lhs = self._is_weight(eqn.invars[0]) and not self._is_weight(eqn.invars[1])
        contract = (tuple(lhs_contract), tuple(rhs_contract))
        if weight_is_lhs:
            layout = layout_of(rhs.shape, lhs.shape, contract[1], contract[0])
        else:
            layout = layout_of(lhs.shape, rhs.shape, *contract)
        if self.recipe.skip_reason(self.name(eqn), layout.in_features, layout.out_features) is not None:
            return None
        # the weight is cast to FP8 from its stored dtype where the product reads the parameter itself
        lhs, rhs = (
            self.stored.get(var, value) if isinstance(var, jcore.Var) else value
            for var, value in zip(eqn.invars, values, strict=True)
        )
        return product(lhs, rhs, contract, self.recipe, compute, weight_is_lhs=weight_is_lhs)
