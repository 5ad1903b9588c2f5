"""`Float8DotGeneral`: a Flax Linen ``dot_general`` module running a `polyamp.Float8Recipe`.

It takes the place of Flax's ``nn.Fp8DotGeneral`` (``nn.Dense(..., dot_general_cls=polyamp_jax.Float8DotGeneral)``)
and keeps delayed scaling's state the way Flax does: an amax history and a scale per operand in the
``_overwrite_with_gradient`` collection, under Flax's names and shapes, whose "gradients" are their next values
(``flax.training.train_state.TrainState.apply_gradients`` writes them over the old ones). The arithmetic is
polyamp's device rules (`polyamp.backend_api.rules.fp8`): with a float32 compute dtype a run is bit for bit
Flax's ``Fp8DirectDotGeneralOp`` (parameters, scales, histories); with bfloat16 each value is scaled in float32
and rounded once, where Flax scales it in bfloat16 first. Under a dynamic recipe the module keeps no state and
runs `polyamp_jax.float8_dot_general`.

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
from polyamp_jax._float8 import layout_of, product, resolve_recipe
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


def add_counts(limbs: Any, counts: Any) -> Any:
    """Counts kept as float32 limbs (``[..., 0] * 2**24 + [..., 1]``, each below 2**24, so exact and finite as
    a "gradient" must be) plus int32 ``counts``."""
    low = limbs[..., 1].astype(jnp.int32) + (counts & 0xFFFFFF)
    high = limbs[..., 0].astype(jnp.int32) + (counts >> 24) + (low >> 24)
    return jnp.stack([high, low & 0xFFFFFF], -1).astype(_F32)


def _formats(recipe: Float8Recipe) -> list[fp8.Float8Format]:
    return [fp8.FORMATS[recipe.format_of(role)] for role in _NAMES]


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _delayed(
    x: Any, w: Any, xs: Any, xh: Any, ws: Any, wh: Any, gs: Any, gh: Any, limbs: Any, recipe: Float8Recipe
) -> Any:
    """``x @ w`` ((M, K) by (K, N)) under delayed scaling, in ``x``'s dtype; ``limbs`` the cast counts
    (`add_counts`), whose "gradient" is them with this step's counts added."""
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
    limbs = add_counts(limbs, jnp.stack([x_counts, w_counts, g_counts]))
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
    dynamic recipe it holds nothing and runs `float8_dot_general`.

    The input is cast to the kernel's dtype (the layer's compute dtype), as Flax's module does; the kernel is
    the right operand.

    Attributes:
        recipe: A `polyamp.Float8Recipe`, a preset's name, or None: the policy in effect's recipe when it has
            one, else ``float8_delayed``. The recipe's ``modules``, ``skip`` and ``alignment`` do not apply: the
            module is placed by hand.
        record: Under delayed scaling, also count what each training step's casts lose (the values saturated,
            the nonzero values flushed to zero, the nonzero values, per operand) in a ``cast_counts`` variable
            of the same collection, which the backward pass updates with the state; read them with
            `polyamp_jax.float8_records`.
    """

    recipe: Float8Recipe | str | None = None
    record: bool = False

    def chosen_recipe(self) -> Float8Recipe:
        """The recipe the module runs (see ``recipe``)."""
        if self.recipe is None:
            return get_policy().float8 or Float8Recipe.preset("float8_delayed")
        return resolve_recipe(self.recipe, where="polyamp_jax.Float8DotGeneral")

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
        (lhs_contract, rhs_contract), batch = dimension_numbers
        if any(batch) or out_sharding is not None:
            raise PolyampValueError(
                "polyamp_jax.Float8DotGeneral runs a linear layer's product: no batch dimensions and "
                f"out_sharding=None. Received: dimension_numbers={dimension_numbers!r}, out_sharding={out_sharding!r}."
            )
        rhs = jnp.asarray(rhs)
        lhs = jnp.asarray(lhs, rhs.dtype)
        dtype = jnp.dtype(preferred_element_type or rhs.dtype)
        contract = (tuple(lhs_contract), tuple(rhs_contract))
        if recipe.scaling != "delayed":
            if self.record:
                raise PolyampValueError(
                    "polyamp_jax.Float8DotGeneral(record=True) counts the casts of delayed scaling "
                    f"('float8_delayed'), whose state it is kept with. Received the recipe {recipe.spec!r}: run "
                    "the layer under 'float8_delayed', or leave record=False."
                )
            return product(lhs, rhs, contract, recipe, dtype)
        state = [self._meta(role, what, recipe) for role in _NAMES for what in ("scale", "amax_history")]
        if self.record:
            limbs = self.variable(OVERWRITE_WITH_GRADIENT, "cast_counts", jnp.zeros, (3, 3, 2), _F32).value
        else:
            limbs = jnp.zeros((3, 3, 2), _F32)
        layout = layout_of(lhs.shape, rhs.shape, *contract)
        x2, w2 = layout.x2(lhs.astype(dtype)), layout.w2(rhs.astype(dtype))
        return layout.output(_delayed(x2, w2, *(v.value for v in state), limbs, recipe))

    def _meta(self, role: str, what: str, recipe: Float8Recipe) -> Any:
        shape = (recipe.amax_history_length,) if what == "amax_history" else (1,)
        init = jnp.zeros if what == "amax_history" else jnp.ones
        return self.variable(OVERWRITE_WITH_GRADIENT, f"{_NAMES[role]}_{what}", init, shape, _F32)
