"""`Float8DotGeneral` and `Float8Einsum`: Flax Linen modules running a `polyamp.Float8Recipe`.

`Float8DotGeneral` takes the place of Flax's ``nn.Fp8DotGeneral`` (``nn.Dense(..., dot_general_cls=polyamp_jax.Float8DotGeneral)``)
and keeps delayed scaling's state the way Flax does: an amax history and a scale per operand in the
``_overwrite_with_gradient`` collection, under Flax's names and shapes, whose "gradients" are their next values
(``flax.training.train_state.TrainState.apply_gradients`` writes them over the old ones). The arithmetic is
polyamp's device rules (`polyamp.backend_api.rules.fp8`): with a float32 compute dtype a run is bit for bit
Flax's ``Fp8DirectDotGeneralOp`` (parameters, scales, histories); with bfloat16 each value is scaled in float32
and rounded once, where Flax scales it in bfloat16 first. Under a dynamic recipe the module keeps no state and
runs `polyamp_jax.float8_dot_general`. `Float8Einsum` does the same for Flax's ``nn.Fp8Einsum`` (bit for bit in
float32), the product of its ``jnp.einsum`` running as `Float8DotGeneral`'s. With ``record=True`` either counts
what its casts lose beside that state.

Importing this module imports Flax.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from polyamp import Float8Recipe, PolyampValueError, get_policy
from polyamp.backend_api.rules import fp8
from polyamp_jax._float8 import float8_counts, layout_of, product, resolve_recipe
from polyamp_jax._float8_state import FLAX_NAMES as _NAMES
from polyamp_jax._functional import OPS

__all__ = ["Float8DotGeneral"]

_F32 = jnp.float32


def _cast(x: Any, scale: Any, history: Any, fmt: fp8.Float8Format, recipe: Float8Recipe) -> tuple[Any, Any, Any, Any]:
    """One delayed cast, as Flax's ``fp8_ops`` orders it: the next scale from the history as it was, ``x``
    cast with that scale, and the history with ``x``'s amax pushed; and what the cast lost
    (`polyamp.backend_api.rules.fp8.cast_counts`)."""
    scale = fp8.delayed_scale(OPS, history, scale, fmt, margin=recipe.margin, amax_compute=recipe.amax_compute)
    history = fp8.push_amax(OPS, history, fp8.amax(OPS, x))
    values = fp8.scaled(OPS, x, scale, divide=True)
    cast = fp8.saturating_cast(OPS, values, fmt)
    return cast, scale, history, fp8.cast_counts(OPS, x, values, cast, fmt)


def _formats(recipe: Float8Recipe) -> list[fp8.Float8Format]:
    return [fp8.FORMATS[recipe.format_of(role)] for role in _NAMES]


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _delayed(
    x: Any, w: Any, xs: Any, xh: Any, ws: Any, wh: Any, gs: Any, gh: Any, limbs: Any, recipe: Float8Recipe
) -> Any:
    """``x @ w`` ((M, K) by (K, N)) under delayed scaling, in ``x``'s dtype; ``limbs`` the cast counts
    (`polyamp.backend_api.rules.fp8.add_counts`), whose "gradient" is them with this step's counts added."""
    return _delayed_forward(x, w, xs, xh, ws, wh, gs, gh, limbs, recipe)[0]


def _delayed_forward(
    x: Any, w: Any, xs: Any, xh: Any, ws: Any, wh: Any, gs: Any, gh: Any, limbs: Any, recipe: Float8Recipe
) -> tuple[Any, tuple[Any, ...]]:
    input_format, weight_format, _ = _formats(recipe)
    xq, xs, xh, x_counts = _cast(x, xs, xh, input_format, recipe)
    wq, ws, wh, w_counts = _cast(w, ws, wh, weight_format, recipe)
    out = jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
    saved = (xq, wq, xs, xh, ws, wh, gs, gh, limbs, x_counts, w_counts, jnp.zeros((), x.dtype))
    return (out * (xs * ws)).astype(x.dtype), saved


def _delayed_backward(recipe: Float8Recipe, saved: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
    xq, wq, xs, xh, ws, wh, gs, gh, limbs, x_counts, w_counts, like = saved
    gq, gs, gh, g_counts = _cast(g, gs, gh, _formats(recipe)[2], recipe)
    grad_x = jax.lax.dot_general(gq, wq, (((1,), (1,)), ((), ())), preferred_element_type=_F32) * (ws * gs)
    grad_w = jax.lax.dot_general(gq, xq, (((0,), (0,)), ((), ())), preferred_element_type=_F32).T * (xs * gs)
    limbs = fp8.add_counts(OPS, limbs, jnp.stack([x_counts, w_counts, g_counts]))
    # the collection's "gradients" are its next values (Flax's overwrite-with-gradient)
    return grad_x.astype(like.dtype), grad_w.astype(like.dtype), xs, xh, ws, wh, gs, gh, limbs


_delayed.defvjp(_delayed_forward, _delayed_backward)


class Float8DotGeneral(nn.Module):
    """A Linen ``dot_general`` in FP8 by ``recipe``: ``nn.Dense(features, dot_general_cls=Float8DotGeneral)``, or
    ``functools.partial(Float8DotGeneral, recipe="float8_rowwise")`` for another recipe.

    Under delayed scaling (``float8_delayed``, the default when the policy in effect has no FP8 recipe) it
    holds, as Flax's ``nn.Fp8DotGeneral`` does, ``input_amax_history``, ``kernel_amax_history``,
    ``output_grad_amax_history`` (the recipe's ``amax_history_length``, float32) and ``input_scale``,
    ``kernel_scale``, ``output_grad_scale`` (shape (1,)) in the ``_overwrite_with_gradient`` collection: train
    with ``flax.training.train_state.TrainState`` (which writes the collection's gradients over it) or do the
    same by hand. Each operand is cast with the scale computed from its history before this step (Flax's
    order), the product of the FP8 arrays accumulates in float32 and is multiplied by the two scales. Under a
    dynamic recipe it runs `float8_dot_general` and holds no state (only its counts, with ``record``).

    The input is cast to the kernel's dtype (the layer's compute dtype), as Flax's module does; the kernel is
    the right operand.

    Attributes:
        recipe: A `polyamp.Float8Recipe`, a preset's name, or None: the policy in effect's recipe when it has
            one, else ``float8_delayed``. The recipe's ``modules``, ``skip`` and ``alignment`` do not apply: the
            module is placed by hand.
        record: Also count what each training step's casts lose (the values saturated, the nonzero values
            flushed to zero, the nonzero values, per operand: under a dynamic recipe the input's and weight's
            casts of the forward and the grad-input product's grad-output cast, as ``polyamp_torch`` counts) in
            a ``cast_counts`` variable of the ``_overwrite_with_gradient`` collection, which the backward pass
            updates as delayed scaling's state; read them with `polyamp_jax.float8_records`.
    """

    recipe: Float8Recipe | str | None = None
    record: bool = False

    def chosen_recipe(self) -> Float8Recipe:
        """The recipe the module runs (see ``recipe``)."""
        return _chosen(self.recipe, "polyamp_jax.Float8DotGeneral")

    @nn.compact
    def __call__(
        self,
        lhs: Any,
        rhs: Any,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> Any:
        recipe = self.chosen_recipe()
        state, counts = _variables(self, recipe, self.record)
        rhs = jnp.asarray(rhs)
        lhs = jnp.asarray(lhs, rhs.dtype)
        dtype = jnp.dtype(preferred_element_type or rhs.dtype)
        where = "polyamp_jax.Float8DotGeneral"
        return _product(lhs, rhs, dimension_numbers, dtype, recipe, state, counts, where, out_sharding)


class Float8Einsum(nn.Module):
    """An einsum of an input and a kernel in FP8 by ``recipe``, in the place of Flax's ``nn.Fp8Einsum``:
    ``Float8Einsum()("...k,kn->...n", x, kernel)``.

    It keeps the state Flax's module keeps (under delayed scaling the six variables of `Float8DotGeneral`, in
    the ``_overwrite_with_gradient`` collection; `polyamp_jax.float8_state_dict` reads them) and computes the
    einsum with ``jnp.einsum``, whose product of the two operands runs as `Float8DotGeneral`'s: in float32 bit
    for bit Flax's ``Fp8Einsum``. As in Flax's module, the left operand is cast to the right one's dtype, and
    the first operand of the product ``jnp.einsum`` forms is taken as the input, the second as the kernel (the
    order of the equation's operands, unless ``jnp.einsum`` swaps them to spare a transpose of the result).

    Attributes:
        recipe: As `Float8DotGeneral`'s.
        record: As `Float8DotGeneral`'s: the counts in a ``cast_counts`` variable, read with
            `polyamp_jax.float8_records`.
    """

    recipe: Float8Recipe | str | None = None
    record: bool = False

    def chosen_recipe(self) -> Float8Recipe:
        """The recipe the module runs (see ``recipe``)."""
        return _chosen(self.recipe, "polyamp_jax.Float8Einsum")

    @nn.compact
    def __call__(self, eqn: str, lhs: Any, rhs: Any, precision: Any = None, preferred_element_type: Any = None) -> Any:
        recipe = self.chosen_recipe()
        state, counts = _variables(self, recipe, self.record)
        rhs = jnp.asarray(rhs)
        lhs = jnp.asarray(lhs).astype(rhs.dtype)
        where = "polyamp_jax.Float8Einsum"

        def dot_general(a: Any, b: Any, dimension_numbers: Any, precision: Any = None, **kwargs: Any) -> Any:
            dtype = jnp.dtype(kwargs.pop("preferred_element_type", None) or b.dtype)
            return _product(a, b, dimension_numbers, dtype, recipe, state, counts, where, kwargs.get("out_sharding"))

        return jnp.einsum(
            eqn, lhs, rhs, precision=precision, preferred_element_type=preferred_element_type, _dot_general=dot_general
        )


def _chosen(recipe: Float8Recipe | str | None, where: str) -> Float8Recipe:
    """The recipe a module runs: ``recipe``, or the policy in effect's, else ``float8_delayed``."""
    if recipe is None:
        return get_policy().float8 or Float8Recipe.preset("float8_delayed")
    return resolve_recipe(recipe, where=where)


def _variables(module: nn.Module, recipe: Float8Recipe, record: bool) -> tuple[list[Any] | None, Any | None]:
    """A module's FP8 variables' values: delayed scaling's six under Flax's names (None under a dynamic
    recipe), and the cast counts (None without ``record``)."""
    counts = module.variable(OVERWRITE_WITH_GRADIENT, "cast_counts", float8_counts).value if record else None
    if recipe.scaling != "delayed":
        return None, counts
    state = []
    for role in _NAMES:
        for what in ("scale", "amax_history"):
            shape = (recipe.amax_history_length,) if what == "amax_history" else (1,)
            init = jnp.zeros if what == "amax_history" else jnp.ones
            state.append(module.variable(OVERWRITE_WITH_GRADIENT, f"{_NAMES[role]}_{what}", init, shape, _F32).value)
    return state, counts


def _product(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    dtype: Any,
    recipe: Float8Recipe,
    state: list[Any] | None,
    counts: Any | None,
    where: str,
    out_sharding: Any = None,
) -> Any:
    """A linear layer's product of input ``lhs`` and kernel ``rhs`` in FP8, in ``dtype``: by a dynamic recipe,
    or under delayed scaling with ``state`` (whose "gradients" are its next values, as are the counts')."""
    (lhs_contract, rhs_contract), batch = dimension_numbers
    if any(batch) or out_sharding is not None:
        raise PolyampValueError(
            f"{where} runs a linear layer's product: no batch dimensions and out_sharding=None. Received: "
            f"dimension_numbers={dimension_numbers!r}, out_sharding={out_sharding!r}."
        )
    contract = (tuple(lhs_contract), tuple(rhs_contract))
    if state is None:
        return product(lhs, rhs, contract, recipe, dtype, counts=counts)
    limbs = float8_counts() if counts is None else counts
    layout = layout_of(lhs.shape, rhs.shape, *contract)
    x2, w2 = layout.x2(lhs.astype(dtype)), layout.w2(rhs.astype(dtype))
    return layout.output(_delayed(x2, w2, *state, limbs, recipe))
