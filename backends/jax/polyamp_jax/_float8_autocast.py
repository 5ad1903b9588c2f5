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
``skip`` patterns match Linen module paths; Equinox names its scopes after classes and Flax NNX opens none,
so their layers are chosen by shape (and those class names) alone.

With ``float8_counts=`` (records), each FP8 product counts what its casts lost into its layer's entry, keyed
by the path of its weight within the arguments, without the weight's own name, where the weight is a module's
field (``"layers.0"`` for an Equinox ``model.layers[0].weight`` or NNX state's ``layers[0]["kernel"]``), else
by its name (a Linen module path), else ``"dot_general_<k>"`` in the order the products run. A layer that runs
more than once in a step (a module called twice) has one entry, counting every run: each product records into
zeros made from the entry by `_tap`, whose backward pass adds the runs' counts, summed by JAX, to the entry
(`polyamp.backend_api.rules.fp8.add_digits`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import jax
import jax.extend.core as jcore
import jax.numpy as jnp

from polyamp import Float8Recipe, Policy, PolyampTypeError, PolyampValueError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.rules import fp8
from polyamp_jax._float8 import COUNTS_SHAPE, layout_of, product
from polyamp_jax._functional import OPS

__all__ = ["Float8Products", "check_counts", "layers_of", "ran_layers"]

#: Primitives whose output is still the weight when their operand is (a cast, a transpose, a reshape).
_FOLLOW: Final = frozenset({"convert_element_type", "transpose", "reshape", "copy", "copy_p", "squeeze", "expand_dims"})


def _scopes(eqn: Any) -> list[str]:
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    return [entry.name for entry in stack if type(entry).__name__ == "Scope"]


def _floating(value: Any) -> bool:
    return hasattr(value, "dtype") and bool(jnp.issubdtype(value.dtype, jnp.floating))


@jax.custom_vjp
def _tap(counts: Any) -> Any:
    """Zeros for a layer's products to record into; the gradient of ``counts`` is them plus what the products
    counted (their gradients, summed over the layer's runs)."""
    return jnp.zeros_like(counts)


def _tap_forward(counts: Any) -> tuple[Any, Any]:
    return jnp.zeros_like(counts), counts


def _tap_backward(counts: Any, runs: Any) -> tuple[Any]:
    return (fp8.add_digits(OPS, counts, runs),)


_tap.defvjp(_tap_forward, _tap_backward)


class Float8Products:
    """The FP8 state of one interpretation: the recipe, the variables holding weights (and the paths of the
    module fields among them), the enclosing scopes, the counts recorded into and the layers that ran."""

    def __init__(
        self,
        recipe: Float8Recipe,
        weights: dict[Any, Any],
        *,
        drop_root: bool,
        paths: dict[Any, str] | None = None,
        counts: Mapping[str, Any] | None = None,
    ) -> None:
        self.recipe = recipe
        self.stored = weights  # each parameter's variable, and its value as stored (float32, say)
        self.weights = set(weights)
        self.paths = dict(paths or {})  # a module field's variable (and what follows it): its path
        self.drop_root = drop_root
        self.prefix: list[str] = []
        # made here, in the caller's trace: a product inside a checkpoint body records into them too
        self.taps = {key: _tap(value) for key, value in (counts or {}).items()}
        self.layers: list[str] = []  # the record keys of the products run in FP8, in order, once each
        self._unnamed = 0

    def _is_weight(self, var: Any) -> bool:
        return isinstance(var, jcore.Var) and var in self.weights

    def _mark(self, outer: Any, inners: Any) -> None:
        """``inners`` stand for the weight ``outer``: they are weights, with its path."""
        for inner in inners:
            if isinstance(inner, jcore.Var):
                self.weights.add(inner)
                if outer in self.paths:
                    self.paths[inner] = self.paths[outer]

    def follow(self, eqn: Any) -> None:
        """Mark the outputs of ``eqn`` as weights when it only reshapes or casts one."""
        if eqn.primitive.name in _FOLLOW and eqn.invars and self._is_weight(eqn.invars[0]):
            self._mark(eqn.invars[0], eqn.outvars)

    @contextlib.contextmanager
    def call(self, eqn: Any, body: Any) -> Iterator[None]:
        """Inside the body of a call equation: its parameters that are weights, its scopes as a prefix."""
        for inner, outer in zip(body.invars, eqn.invars, strict=False):
            if self._is_weight(outer):
                self._mark(outer, [inner])
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
        key = self._key(eqn, eqn.invars[0] if weight_is_lhs else eqn.invars[1])
        return product(lhs, rhs, contract, self.recipe, compute, weight_is_lhs=weight_is_lhs, counts=self.taps.get(key))

    def _key(self, eqn: Any, weight: Any) -> str:
        """The record key of a product run in FP8 (see the module's description), noted in `layers`."""
        key = (self.paths.get(weight, "") if isinstance(weight, jcore.Var) else "") or self.name(eqn)
        if not key:
            key = f"dot_general_{self._unnamed}"
            self._unnamed += 1
        if key not in self.layers:
            self.layers.append(key)
        return key


#: The record keys of the FP8 layers the interpretations running now found (`layers_of`), or None.
_FOUND: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("polyamp_jax_float8_layers", default=None)

_HOW = "make them with polyamp_jax.float8_counts(forward, *args) (forward: the function autocast returned)"


def check_counts(counts: object, policy: Policy) -> None:
    """Refuse ``float8_counts=`` that is not a mapping of layer names to counts, or a policy without FP8."""
    if policy.float8 is None:
        raise PolyampValueError(
            f"polyamp_jax.autocast: float8_counts= records the casts of FP8 layers, and the policy {policy.name!r} "
            "runs none. Use a policy with an FP8 recipe ('mixed_bfloat16+float8_rowwise'), or leave float8_counts "
            "out."
        )
    if isinstance(counts, Mapping):
        wrong = [f"{name!r}: {describe(v)}" for name, v in counts.items() if tuple(jnp.shape(v)) != COUNTS_SHAPE]
        if not wrong:
            return
        received = ", ".join(wrong)
    else:
        received = describe(counts)
    raise PolyampValueError(
        "polyamp_jax.autocast: float8_counts= is a dict of layer names to cast counts, each an array of shape "
        f"{COUNTS_SHAPE} (the counts given before, or their gradient). Received: {received}; {_HOW}."
    )


def ran_layers(layers: list[str], counts: Mapping[str, Any] | None) -> None:
    """After an interpretation: note the FP8 layers it ran for `layers_of`, and refuse ``float8_counts=``
    whose names are not those layers'."""
    found = _FOUND.get()
    if found is not None:
        found.extend(name for name in layers if name not in found)
    if counts is None:
        return
    missing = [name for name in layers if name not in counts]
    unexpected = [name for name in counts if name not in layers]
    if missing or unexpected:
        wrong = [f"none for {missing}"] if missing else []
        wrong += [f"counts for {unexpected}, which it does not run"] if unexpected else []
        raise PolyampValueError(
            f"polyamp_jax.autocast: float8_counts= names the FP8 layers the function runs: {layers}. Received "
            f"{' and '.join(wrong)}; {_HOW}."
        )


def layers_of(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The record keys of the FP8 layers ``fn`` (made by `polyamp_jax.autocast`, or calling such functions)
    runs on these arguments, found by tracing it (nothing is computed)."""
    if not callable(fn):
        raise PolyampTypeError(
            "polyamp_jax.float8_counts(fn, *args, **kwargs) takes the function polyamp_jax.autocast returned and "
            f"the arguments it will be called with (or nothing, for one product's counts). Received: {describe(fn)}."
        )
    token = _FOUND.set([])
    try:
        jax.eval_shape(functools.partial(fn, **kwargs), *args)
        found = list(_FOUND.get() or [])
    finally:
        _FOUND.reset(token)
    if not found:
        raise PolyampValueError(
            f"polyamp_jax.float8_counts: {describe(fn)} ran no FP8 layer on these arguments. Pass the function "
            "polyamp_jax.autocast returned, under a policy with an FP8 recipe whose patterns and alignment take "
            "some of its products (polyamp_jax.autocast(model.apply, policy='mixed_bfloat16+float8_rowwise'))."
        )
    return found
