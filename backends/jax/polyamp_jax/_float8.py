"""FP8 matrix products for JAX: ``dot_general`` with a `polyamp.Float8Recipe`'s casts, forward and backward.

A linear layer's product ``x @ w`` runs three matmuls: the output (input by weight), the grad-input
(grad-output by weight) and the grad-weight (input by grad-output). Each operand is cast to FP8 by the core's
device rules (`polyamp.backend_api.rules.fp8`) over `JaxOps`, the product of the FP8 arrays accumulates in
float32 (``jax.lax.dot_general`` with ``preferred_element_type=float32``, as Flax's ``fp8_ops`` calls it) and
the scales are applied to it. Rowwise scales run along the contracted axis of each matmul; with
``grad_weight_high_precision`` the grad-weight matmul stays in the compute dtype and the grad-input one takes
the weight with one scale; MX is emulated, as polyamp_torch does: the operands are cast to FP8 and back with
their block exponents and multiplied in the compute dtype.

Every product is first brought to one layout, ``x`` as (M, K) and ``w`` as (K, N) (the free axes of each
flattened, the contracted ones last for ``x`` and first for ``w``), so that a ``dot_general`` of any rank with
no batch dimensions runs the same casts as a 2-D one.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import jax
import jax.numpy as jnp

from polyamp import Float8Recipe, Policy, PolyampValueError, get_policy
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.rules import fp8
from polyamp_jax._functional import OPS

__all__ = [
    "COUNTS_SHAPE",
    "DYNAMIC_RECIPES",
    "Layout",
    "check_dynamic",
    "dynamic_product",
    "float8_counts",
    "float8_dot_general",
    "layout_of",
    "product",
    "resolve_recipe",
]

_F32: Final = jnp.float32
#: The recipes a stateless product runs: every preset but delayed scaling, which keeps state in a module.
DYNAMIC_RECIPES: Final = ("float8_tensorwise", "float8_rowwise", "float8_rowwise_gw_hp", "mxfp8")


def resolve_recipe(recipe: Float8Recipe | str | None, *, where: str) -> Float8Recipe:
    """``recipe`` as a `Float8Recipe`: one given, a preset's policy text, or (None) the FP8 recipe of the
    policy in effect.

    Raises:
        PolyampValueError: None while the policy in effect has no FP8 recipe.
    """
    if isinstance(recipe, Float8Recipe):
        return recipe
    if isinstance(recipe, str):
        chosen = Policy(recipe).float8
        if chosen is None:
            raise PolyampValueError(
                f"{where} takes an FP8 recipe such as 'float8_rowwise'. Received: {recipe!r}, a policy without one."
            )
        return chosen
    if recipe is None:
        found = get_policy().float8
        if found is None:
            raise PolyampValueError(
                f"{where} found no FP8 recipe: the policy in effect ({get_policy().name!r}) has none. Pass "
                "recipe='float8_rowwise' (or another preset), or set a policy such as 'mixed_bfloat16+float8_rowwise'."
            )
        return found
    raise PolyampValueError(
        f"{where} takes a polyamp.Float8Recipe, a preset's name or None. Received: {describe(recipe)}."
    )


def _format(recipe: Float8Recipe, role: str) -> fp8.Float8Format:
    return fp8.FORMATS[recipe.format_of(role)]


# -- the layout: any batch-free dot_general as (M, K) @ (K, N) -------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a ``dot_general`` of ``x`` (the input) and ``w`` (the weight) maps onto ``(M, K) @ (K, N)``."""

    x_perm: tuple[int, ...]
    w_perm: tuple[int, ...]
    x_free: tuple[int, ...]
    w_free: tuple[int, ...]
    contracted: int

    @property
    def in_features(self) -> int:
        return self.contracted

    @property
    def out_features(self) -> int:
        return math.prod(self.w_free)

    def x2(self, x: Any) -> Any:
        return jnp.reshape(jnp.transpose(x, self.x_perm), (math.prod(self.x_free), self.contracted))

    def w2(self, w: Any) -> Any:
        return jnp.reshape(jnp.transpose(w, self.w_perm), (self.contracted, self.out_features))

    def output(self, out: Any) -> Any:
        return jnp.reshape(out, (*self.x_free, *self.w_free))


def layout_of(
    x_shape: Sequence[int], w_shape: Sequence[int], x_contract: Sequence[int], w_contract: Sequence[int]
) -> Layout:
    """The `Layout` of a product contracting ``x_contract`` of ``x`` with ``w_contract`` of ``w`` (in pairs)."""
    x_rest = [i for i in range(len(x_shape)) if i not in x_contract]
    w_rest = [i for i in range(len(w_shape)) if i not in w_contract]
    return Layout(
        x_perm=(*x_rest, *x_contract),
        w_perm=(*w_contract, *w_rest),
        x_free=tuple(int(x_shape[i]) for i in x_rest),
        w_free=tuple(int(w_shape[i]) for i in w_rest),
        contracted=math.prod(int(x_shape[i]) for i in x_contract),
    )


# -- the casts ----------------------------------------------------------------------------------------------


def _current(
    x: Any, fmt: fp8.Float8Format, axis: int | None, power_of_two: bool, found: list[Any] | None = None
) -> tuple[Any, Any]:
    """``x`` cast with its own scale (one, or one per slice along ``axis``): the FP8 values and the
    dequantizing scale (the scale's reciprocal); with ``found``, what the cast lost is appended to it."""
    scale = fp8.scale_from_amax(OPS, fp8.amax(OPS, x, axis), fmt, power_of_two=power_of_two)
    values = fp8.scaled(OPS, x, scale)
    cast = fp8.saturating_cast(OPS, values, fmt)
    if found is not None:
        found.append(fp8.cast_counts(OPS, x, values, cast, fmt))
    return cast, 1.0 / scale


def _scaled_dot(a: Any, a_inv: Any, b: Any, b_inv: Any, dtype: Any) -> Any:
    """``(a * a_inv) @ (b * b_inv).T`` for FP8 ``a`` (M, K) and ``b`` (N, K): the FP8 product accumulated in
    float32, times the two dequantizing scales (``a_inv`` of shape () or (M, 1), ``b_inv`` () or (N, 1))."""
    out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
    return (out * (a_inv * b_inv.T)).astype(dtype)


def _mx(x: Any, fmt: fp8.Float8Format, recipe: Float8Recipe, found: list[Any] | None = None) -> Any:
    """``x`` (2-D) cast to MX along its last axis (zero-padded to whole blocks) and back, in ``x``'s dtype;
    with ``found``, what the cast lost is appended to it."""
    columns = x.shape[1]
    pad = -columns % recipe.mx_block
    wide = jnp.pad(x.astype(_F32), ((0, 0), (0, pad)))
    exponents, scaled = fp8.mx_scaled(OPS, wide, fmt, block=recipe.mx_block, rounding=recipe.mx_rounding)
    values = fp8.saturating_cast(OPS, scaled, fmt)
    if found is not None:
        found.append(fp8.cast_counts(OPS, wide, scaled, values, fmt))
    back = fp8.mx_dequantize(OPS, exponents, values, block=recipe.mx_block)
    return back[:, :columns].astype(x.dtype)


def _mx_dot(
    a: Any, b: Any, recipe: Float8Recipe, roles: tuple[str, str], found: tuple[list[Any] | None, ...] = (None, None)
) -> Any:
    """``a @ b.T`` (both (·, K)) with each operand cast to MX along K and back, in ``a``'s dtype; what each
    cast lost appended to its list in ``found`` (None: not counted)."""
    lhs, rhs = (
        _mx(v, _format(recipe, role), recipe, counts) for v, role, counts in zip((a, b), roles, found, strict=True)
    )
    return jax.lax.dot_general(lhs, rhs.astype(lhs.dtype), (((1,), (1,)), ((), ())))


# -- the dynamic product ------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dynamic(x: Any, w: Any, digits: Any, recipe: Float8Recipe, dtype: Any, record: bool) -> Any:
    """``x @ w`` for ``x`` (M, K) and ``w`` (K, N) with the recipe's casts, in ``dtype``. Each operand is cast
    to FP8 from its own dtype (a float32 weight directly, as polyamp_torch casts its parameter). With
    ``record``, the "gradient" of ``digits`` (cast counts, `polyamp.backend_api.rules.fp8.add_counts`) is them
    with the counts of the input's and weight's casts and the grad-input product's grad-output cast added."""
    return _dynamic_forward(x, w, digits, recipe, dtype, record)[0]


def _dynamic_forward(
    x: Any, w: Any, digits: Any, recipe: Float8Recipe, dtype: Any, record: bool
) -> tuple[Any, tuple[Any, ...]]:
    found: list[Any] | None = [] if record else None
    if recipe.granularity == "mx":
        out = _mx_dot(x.astype(dtype), w.T.astype(dtype), recipe, ("input", "weight"), (found, found))
    else:
        axis = None if recipe.granularity == "tensor" else 1
        a, a_inv = _current(x, _format(recipe, "input"), axis, recipe.power_of_two, found)
        b, b_inv = _current(w.T, _format(recipe, "weight"), axis, recipe.power_of_two, found)
        out = _scaled_dot(a, a_inv, b, b_inv, dtype)
    return out, (x, w, digits, found or [])


def _dynamic_backward(
    recipe: Float8Recipe, dtype: Any, record: bool, saved: tuple[Any, ...], g: Any
) -> tuple[Any, Any, Any]:
    x, w, digits, found = saved
    found_grad: list[Any] | None = [] if record else None
    g = g.astype(dtype)
    if recipe.granularity == "mx":
        grad_x = _mx_dot(g, w.astype(dtype), recipe, ("grad_output", "weight"), (found_grad, None))
        grad_w = _mx_dot(g.T, x.T.astype(dtype), recipe, ("grad_output", "input")).T
    else:
        row = recipe.granularity == "row"
        axis = 1 if row else None
        two = recipe.power_of_two
        gq, g_inv = _current(g, _format(recipe, "grad_output"), axis, two, found_grad)
        weight_rows = row and not recipe.grad_weight_high_precision
        wq, w_inv = _current(w, _format(recipe, "weight"), 1 if weight_rows else None, two)
        grad_x = _scaled_dot(gq, g_inv, wq, w_inv, dtype)
        if recipe.grad_weight_high_precision:
            grad_w = jax.lax.dot_general(g.T, x.T.astype(dtype), (((1,), (1,)), ((), ()))).T
        else:
            gt, gt_inv = _current(g.T, _format(recipe, "grad_output"), axis, two)
            xt, xt_inv = _current(x.T, _format(recipe, "input"), axis, two)
            grad_w = _scaled_dot(gt, gt_inv, xt, xt_inv, dtype).T
    # the counts' "gradient" is their next value (overwrite-with-gradient)
    totals = fp8.add_counts(OPS, digits, jnp.stack([*found, *found_grad])) if found_grad else jnp.zeros_like(digits)
    return grad_x.astype(x.dtype), grad_w.astype(w.dtype), totals


_dynamic.defvjp(_dynamic_forward, _dynamic_backward)

#: The shape of a product's cast counts: operand (input, weight, grad_output), count (saturated, flushed,
#: nonzero), digit (`polyamp.backend_api.rules.fp8.add_counts`).
COUNTS_SHAPE: Final = (3, 3, 2)


@typing.overload
def float8_counts() -> jax.Array: ...
@typing.overload
def float8_counts(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> dict[str, jax.Array]: ...
def float8_counts(fn: Callable[..., Any] | None = None, /, *args: Any, **kwargs: Any) -> Any:
    """Zero cast counts: for one FP8 product, or for each FP8 layer of a function `autocast` made.

    ``float8_counts()`` are one product's: pass them as ``counts=`` to `float8_dot_general`.
    ``float8_counts(forward, *args, **kwargs)``, with ``forward`` a function `polyamp_jax.autocast` returned
    (or one calling it) and the arguments it will be called with, is ``{layer: counts}`` for every FP8 layer it
    runs on them (found by tracing, nothing is computed): pass them as ``forward(..., float8_counts=counts)``.
    Either way, take their gradient as their next value and read them with `float8_records`.

    Raises:
        PolyampValueError: ``forward`` runs no FP8 layer on those arguments.
    """
    if fn is None:
        return jnp.zeros(COUNTS_SHAPE, _F32)
    from polyamp_jax._float8_autocast import layers_of  # it builds on this module

    return {name: jnp.zeros(COUNTS_SHAPE, _F32) for name in layers_of(fn, args, kwargs)}


def dynamic_product(x: Any, w: Any, layout: Layout, recipe: Float8Recipe, dtype: Any, counts: Any | None = None) -> Any:
    """The product of input ``x`` and weight ``w`` laid out by ``layout``, with ``recipe``'s casts, in
    ``dtype``: the output has ``x``'s free axes, then ``w``'s. With ``counts``, their gradient is the
    totals with this product's cast counts added."""
    record = counts is not None
    digits = jnp.asarray(counts, _F32) if record else jnp.zeros(COUNTS_SHAPE, _F32)
    return layout.output(_dynamic(layout.x2(x), layout.w2(w), digits, recipe, jnp.dtype(dtype), record))


def check_dynamic(recipe: Float8Recipe, where: str) -> None:
    if recipe.scaling == "delayed":
        raise PolyampValueError(
            f"{where} runs the recipes that keep no state: {', '.join(DYNAMIC_RECIPES)} (and variants of them). "
            f"Delayed scaling keeps amax histories and scales between steps; use the Flax module "
            f"polyamp_jax.Float8DotGeneral for it (nn.Dense(..., dot_general_cls=polyamp_jax.Float8DotGeneral)). "
            f"Received: {recipe.spec!r}."
        )


def float8_dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    recipe: Float8Recipe | str | None = None,
    weight: str = "rhs",
    out_sharding: Any = None,
    counts: Any = None,
) -> Any:
    """``jax.lax.dot_general`` in FP8 by ``recipe``, forward and backward: a drop-in for the ``dot_general``
    argument of Flax's layers (``nnx.Linear(..., dot_general=functools.partial(polyamp_jax.float8_dot_general,
    recipe="float8_rowwise"))``) and for ``jnp.einsum``'s.

    The operands are cast to FP8 with their own scales (the recipe's formats and granularity, the core's device
    rules, as polyamp_torch's ``Float8Linear``), their product accumulates in float32 and the scales are
    applied to it; the result is in ``preferred_element_type``, or the operands' promoted dtype.

    Args:
        lhs, rhs, dimension_numbers: As ``jax.lax.dot_general``'s (no batch dimensions).
        precision: Ignored: the FP8 product takes no precision (as Flax's ``fp8_ops``).
        preferred_element_type: The result's dtype (None: the operands' promoted dtype).
        recipe: A dynamic `polyamp.Float8Recipe` or a preset's name (None: the policy in effect's).
        weight: Which operand is the weight (``"rhs"``, as Flax's layers pass the kernel, or ``"lhs"``): the
            formats and ``grad_weight_high_precision`` tell the two apart.
        out_sharding: Only None (Flax's layers pass it).
        counts: Cast counts to record into (`float8_counts`, or the last ones): their gradient is them with
            what this product's casts lost added (the input's and weight's casts in the forward, the
            grad-input product's grad-output cast in the backward, as ``polyamp_torch.record_float8`` counts),
            to be taken as their next value as Flax's ``_overwrite_with_gradient`` collection is; read them with
            `float8_records`. Nothing leaves the device until then. None: nothing is counted.

    Raises:
        PolyampValueError: delayed scaling (it keeps state: use `Float8DotGeneral`), batch dimensions, an
            ``out_sharding``, or ``counts`` not of `float8_counts`'s shape.

    Example:
        ```python
        def loss(w, counts):
            y = polyamp_jax.float8_dot_general(x, w, (((1,), (0,)), ((), ())), recipe="float8_rowwise", counts=counts)
            return jnp.mean(y**2)

        grad_w, counts = jax.grad(loss, argnums=(0, 1))(w, polyamp_jax.float8_counts())
        polyamp_jax.float8_records({"dense": counts})["dense"]["grad_output"].flushed
        ```
    """
    del precision
    where = "polyamp_jax.float8_dot_general"
    chosen = resolve_recipe(recipe, where=where)
    check_dynamic(chosen, where)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_batch or rhs_batch:
        raise PolyampValueError(
            f"{where} runs products without batch dimensions (a linear layer's). Received: dimension_numbers="
            f"{dimension_numbers!r}; keep batched products (attention's) in jax.lax.dot_general."
        )
    if out_sharding is not None:
        raise PolyampValueError(f"{where} takes out_sharding=None only. Received: {out_sharding!r}.")
    if weight not in ("lhs", "rhs"):
        raise PolyampValueError(f"{where}: weight is 'lhs' or 'rhs'. Received: {describe(weight)}.")
    if counts is not None and tuple(jnp.shape(counts)) != COUNTS_SHAPE:
        raise PolyampValueError(
            f"{where}: counts are an array of shape {COUNTS_SHAPE} (polyamp_jax.float8_counts(), or the gradient "
            f"of the last ones). Received: a {type(counts).__name__} of shape {tuple(jnp.shape(counts))}."
        )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    contract = (tuple(lhs_contract), tuple(rhs_contract))
    return product(lhs, rhs, contract, chosen, dtype, weight_is_lhs=weight == "lhs", counts=counts)


def product(
    lhs: Any,
    rhs: Any,
    contract: tuple[tuple[int, ...], tuple[int, ...]],
    recipe: Float8Recipe,
    dtype: Any,
    *,
    weight_is_lhs: bool = False,
    counts: Any = None,
) -> Any:
    """A batch-free ``dot_general`` of ``lhs`` and ``rhs`` in FP8 by a dynamic ``recipe``, in ``dtype``; with
    ``counts``, their gradient is the totals with what its casts lost added (`dynamic_product`)."""
    if not weight_is_lhs:
        return dynamic_product(lhs, rhs, layout_of(lhs.shape, rhs.shape, *contract), recipe, dtype, counts)
    layout = layout_of(rhs.shape, lhs.shape, contract[1], contract[0])
    swapped = dynamic_product(rhs, lhs, layout, recipe, dtype, counts)
    rhs_free = rhs.ndim - len(contract[1])
    order = (*range(rhs_free, swapped.ndim), *range(rhs_free))
    return jnp.transpose(swapped, order)
