"""jmp's public API over polyamp: ``from polyamp_jax import jmp_compat as jmp``.

DeepMind's jmp is no longer developed; this module gives its public names (``jmp.__all__``) over polyamp's
policy and loss scaler, so code written for jmp runs on polyamp unchanged:

* ``Policy``, ``get_policy``, ``half_dtype``, ``cast_to_full``, ``cast_to_half`` - a `Policy` holds a
  `polyamp.Policy` (its `policy`) and casts with `polyamp_jax.cast_to_compute` and friends; `get_policy` reads
  jmp's grammar (``"c=f16"``: parameters float32, compute and output float16; unspecified keys follow the one
  before, a bare dtype sets all three) and builds the polyamp policy it means.
* ``DynamicLossScale``, ``StaticLossScale``, ``NoOpLossScale``, ``LossScale`` - each runs polyamp's
  `polyamp.FunctionalLossScaler` over JAX arrays: scaling, unscaling (by the float32 reciprocal of the scale)
  and the scale's update are polyamp's rule (`polyamp.LossScaleConfig`) with jmp's arguments translated:
  ``period`` is ``growth_interval``, ``factor`` is ``growth_factor`` and ``1 / factor`` ``backoff_factor``,
  ``min_loss_scale`` is ``min_scale`` (hysteresis 1). `NoOpLossScale` is the scaler with scaling off.
* ``all_finite``, ``select_tree`` - `polyamp_jax.all_finite` and the functional scaler's
  ``apply_if_finite``.

Where it differs from jmp (tests/test_upstream_jax.py runs jmp's own tests against this module):

* Policies hold float32, float16 or bfloat16 only (no float64); a dtype attribute is JAX's scalar type
  (``jnp.float16``), whatever was passed, and compares equal to NumPy's.
* The scale is a float32 array. A loss scale or ``min_loss_scale`` given as an integer array, a scale of 0
  (static, or as ``min_loss_scale``) and a non-integer ``period`` are refused with a polyamp error where jmp
  warns or runs on. Bad predicates for ``adjust`` and `select_tree` raise `polyamp.PolyampTypeError`, not
  ``AssertionError``.
* Each growth (times ``factor``) and backoff (times ``1 / factor``) is polyamp's: the float32 scale times the
  float64 factor, rounded once to float32. jmp rounds the factor to float32 first and multiplies (or divides)
  in float32. With integer factors (jmp's default 2, or 3) the scales are the same; with a factor float32
  cannot hold (1.1, say) they can differ in their last bits.
* ``min_loss_scale`` is kept through ``jax.jit`` and other tree maps (jmp's flattening drops it, so it
  returns to 1 there).
* The scale grows to 2**126 at most (jmp's goes on to float32's largest power of two, whose float32
  reciprocal XLA on CPU flushes to zero, so that every unscaled gradient is zero), and a `StaticLossScale`
  above 2**126 is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

import polyamp
import polyamp.backend_api
from polyamp import FunctionalLossScaler, InvalidConfigError, InvalidPolicyError, LossScaler, PolyampTypeError
from polyamp.backend_api.arguments import INT32_MAX, describe
from polyamp.backend_api.rules import RECIPROCAL_CEILING, to_float32
from polyamp_jax._casting import cast_to_compute, cast_to_output, cast_to_param, cast_tree
from polyamp_jax._functional import all_finite as _all_finite

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "select_tree",
]

T = TypeVar("T")

# -- policies -------------------------------------------------------------------------------------------------

#: jmp's short name of each dtype, as its ``str(policy)`` writes it (polyamp's spec grammar reads them too).
_SHORT_NAMES = {"float32": "full", "float16": "f16", "bfloat16": "bf16"}
_JMP_KEYS = {"p": 0, "params": 0, "c": 1, "compute": 1, "o": 2, "output": 2}
_DTYPES_ALLOWED = (
    "float32 (full, f32), float16 (f16), bfloat16 (bf16) or half (float16; bfloat16 on TPU) - polyamp's policies "
    "hold no other dtype"
)


def _dtype_name(value: Any, what: str) -> str:
    """The canonical name of a dtype a policy can hold, read by `polyamp.Policy`."""
    if value is None:
        raise PolyampTypeError(
            f"`{what}` must be a dtype: jnp.float32, jnp.float16 or jnp.bfloat16 (or its NumPy type or name). "
            "Received: None."
        )
    try:
        return polyamp.Policy(param=value).param_dtype
    except InvalidPolicyError:
        raise InvalidPolicyError(
            f"`{what}` must be float32, float16 or bfloat16 (a JAX or NumPy dtype or type, such as jnp.float16, or a "
            f"name such as 'f16'): polyamp's policies hold no other dtype. Received: {describe(value)}."
        ) from None


@dataclasses.dataclass(frozen=True)
class Policy:
    """jmp's ``Policy``: the dtypes of parameters, computation and outputs, and casts of pytrees to them.

    The dtypes are held as JAX's scalar types (``jnp.float32``, ``jnp.float16``, ``jnp.bfloat16``), which
    compare equal to NumPy's. Casting changes floating-point array leaves only (`polyamp_jax.cast_tree`).

    Args:
        param_dtype: The parameters' dtype.
        compute_dtype: The dtype computation runs in.
        output_dtype: The outputs' dtype.

    Raises:
        InvalidPolicyError: a dtype is not float32, float16 or bfloat16.
        PolyampTypeError: a dtype is None.

    Example:
        ```python
        policy = jmp_compat.Policy(jnp.float32, jnp.float16, jnp.float32)
        polyamp.set_policy(policy.policy)  # the same policy for polyamp_jax.autocast and loss_scaled
        ```
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, getattr(jnp, _dtype_name(getattr(self, field), field)))

    @property
    def policy(self) -> polyamp.Policy:
        """The same dtypes as a `polyamp.Policy` (for `polyamp.set_policy`, `polyamp_jax.autocast`, ...)."""
        return polyamp.Policy(param=self.param_dtype, compute=self.compute_dtype, output=self.output_dtype)

    def cast_to_param(self, x: T) -> T:
        """``x`` with its floating-point leaves in the parameter dtype."""
        return cast_to_param(x, self.policy)

    def cast_to_compute(self, x: T) -> T:
        """``x`` with its floating-point leaves in the compute dtype."""
        return cast_to_compute(x, self.policy)

    def cast_to_output(self, x: T) -> T:
        """``x`` with its floating-point leaves in the output dtype."""
        return cast_to_output(x, self.policy)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """This policy with another output dtype."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        names = (np.dtype(d).name for d in (self.param_dtype, self.compute_dtype, self.output_dtype))
        return "p={},c={},o={}".format(*(_SHORT_NAMES[name] for name in names))


def half_dtype() -> Any:
    """jmp's half-precision dtype for this machine: ``jnp.bfloat16`` on TPU, ``jnp.float16`` elsewhere."""
    return jnp.bfloat16 if jax.local_devices()[0].platform == "tpu" else jnp.float16


def _parse_dtype(value: str, policy_name: str) -> str:
    if value.strip() == "half":
        return str(np.dtype(half_dtype()).name)
    try:
        return polyamp.Policy(param=value).param_dtype
    except InvalidPolicyError:
        raise InvalidPolicyError(
            f"Unknown dtype {value!r} in policy {policy_name!r}: a dtype is {_DTYPES_ALLOWED}. "
            "Write a policy as 'p=f32,c=f16,o=f32' (keys p|params, c|compute, o|output) or one dtype for all three."
        ) from None


def get_policy(policy_name: str) -> Policy:
    """The policy ``policy_name`` names, in jmp's grammar.

    ``"c=f16"`` (parameters float32, compute and output float16), ``"p=f16,c=f16"``,
    ``"params=float32,compute=bfloat16,output=float32"``: keys ``p|params``, ``c|compute``, ``o|output``;
    parameters default to float32, compute to the parameters' dtype, output to the compute dtype. A bare dtype
    (``"f16"``, ``"half"``) is all three. polyamp's policy names (``"mixed_float16"``, ``"mixed_bfloat16"``) are
    read as `polyamp.Policy` reads them.

    Raises:
        InvalidPolicyError: an unknown key or dtype.
        PolyampTypeError: ``policy_name`` is not a string.
    """
    if not isinstance(policy_name, str):
        raise PolyampTypeError(
            f"get_policy() takes a policy string such as 'p=f32,c=f16,o=f32'. Received: {describe(policy_name)}."
        )
    text = policy_name.strip()
    if "=" not in text:
        if text.lower() in polyamp.backend_api.policies.POLICY_NAMES:
            named = polyamp.Policy(text)
            return Policy(named.param_dtype, named.compute_dtype, named.output_dtype)
        dtype = _parse_dtype(text, policy_name)
        return Policy(dtype, dtype, dtype)
    chosen: list[str | None] = ["float32", None, None]
    for part in text.split(","):
        key, _, value = part.partition("=")
        index = _JMP_KEYS.get(key.strip())
        if index is None:
            raise InvalidPolicyError(
                f"Unknown key {key.strip()!r} in policy {policy_name!r}: the keys are p|params, c|compute and "
                "o|output, e.g. 'p=f32,c=f16,o=f32'."
            )
        chosen[index] = _parse_dtype(value, policy_name)
    param = chosen[0]
    compute = chosen[1] or param
    return Policy(param, compute, chosen[2] or compute)


def cast_to_full(tree: T) -> T:
    """``tree`` with its floating-point leaves in float32."""
    return cast_tree(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """``tree`` with its floating-point leaves in `half_dtype`."""
    return cast_tree(tree, half_dtype())


# -- loss scales ----------------------------------------------------------------------------------------------

_TRANSLATION = (
    "(polyamp's init_scale is jmp's loss_scale, growth_interval its period, growth_factor its factor and "
    "backoff_factor 1/factor, min_scale its min_loss_scale.)"
)
#: The config's initial scale where the scale travels in the loss scale itself: the highest a JAX scale holds,
#: so that it is never below ``min_scale`` (polyamp's check) whatever ``min_loss_scale`` is.
_HIGHEST_SCALE = RECIPROCAL_CEILING


def _functional(call: str, **arguments: Any) -> tuple[FunctionalLossScaler, dict[str, Any]]:
    """A JAX `polyamp.FunctionalLossScaler` with these settings and a fresh state, errors in jmp's names."""
    try:
        fn = LossScaler(history=1, **arguments).functional(backend="jax")
    except (InvalidConfigError, PolyampTypeError) as exc:
        raise type(exc)(f"{call} cannot run on polyamp's loss scaler: {exc} {_TRANSLATION}") from exc
    return fn, fn.init()


def _dynamic_settings(period: Any, factor: Any, min_loss_scale: float) -> tuple[FunctionalLossScaler, dict[str, Any]]:
    """The functional scaler of `DynamicLossScale`'s settings (their types checked here, their ranges by polyamp)."""
    call = f"DynamicLossScale(period={period!r}, factor={factor!r}, min_loss_scale={min_loss_scale!r})"
    if isinstance(period, bool) or not isinstance(period, numbers.Integral):
        raise PolyampTypeError(f"{call}: `period` must be an int >= 1, e.g. 2000. Received: {describe(period)}.")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise PolyampTypeError(f"{call}: `factor` must be a number > 1, e.g. 2. Received: {describe(factor)}.")
    return _dynamic_rule(int(period), float(factor), min_loss_scale)


@functools.lru_cache(maxsize=64)
def _dynamic_rule(period: int, factor: float, min_loss_scale: float) -> tuple[FunctionalLossScaler, dict[str, Any]]:
    return _functional(
        f"DynamicLossScale(period={period!r}, factor={factor!r}, min_loss_scale={min_loss_scale!r})",
        enabled=True,
        init_scale=_HIGHEST_SCALE,
        growth_interval=period,
        growth_factor=factor,
        backoff_factor=1.0 / factor if factor > 1 else 0.5,  # factor <= 1 is refused as growth_factor
        min_scale=min_loss_scale,
    )


@functools.lru_cache(maxsize=64)
def _static_rule(loss_scale: float) -> tuple[FunctionalLossScaler, dict[str, Any]]:
    return _functional(f"StaticLossScale({loss_scale!r})", enabled=True, init_scale=loss_scale, dynamic=False)


@functools.lru_cache(maxsize=1)
def _off() -> tuple[FunctionalLossScaler, dict[str, Any]]:
    return _functional("NoOpLossScale()", enabled=False, guard=False)


@functools.lru_cache(maxsize=1)
def _guard() -> FunctionalLossScaler:
    return _functional("select_tree()", enabled=False, guard=True)[0]


def _with_scale(state: dict[str, Any], scale: Any, counter: Any = None) -> dict[str, Any]:
    """``state`` holding ``scale`` (and ``counter`` as the growth tracker)."""
    tree = {**state["scaler"], "scale": scale}
    if counter is not None:
        tree["growth_tracker"] = counter
    return {**state, "scaler": tree}


def _is_tracer(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def _scalar(value: Any, what: str, kind: str, example: str) -> Any:
    """``value`` as a 0-d array of the ``kind`` of dtype ("floating" or "integer"), or a Python number."""
    if isinstance(value, bool):
        raise PolyampTypeError(f"`{what}` must be {example}. Received: {describe(value)}.")
    if isinstance(value, numbers.Real) and not hasattr(value, "dtype"):
        return value
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    wanted = jnp.floating if kind == "floating" else jnp.integer
    if dtype is None or shape != () or not jnp.issubdtype(dtype, wanted):
        held = f" (dtype {dtype}, shape {shape})" if dtype is not None else ""
        raise PolyampTypeError(f"`{what}` must be {example}. Received: {describe(value)}{held}.")
    return value


def _loss_scale(value: Any) -> Any:
    value = _scalar(value, "loss_scale", "floating", "a floating-point scalar, e.g. jnp.float32(2**15) or 2.0**15")
    if not hasattr(value, "dtype") and not (math.isfinite(to_float32(float(value))) and value > 0):
        raise InvalidConfigError(
            f"`loss_scale` must be a finite positive number, e.g. 2.0**15. Received: {describe(value)}."
        )
    return jnp.asarray(value, jnp.float32)  # polyamp holds the scale in float32


def _counter(value: Any) -> Any:
    if value is None:
        return jnp.zeros((), jnp.int32)
    value = _scalar(value, "counter", "integer", "an int or a 0-d integer array, e.g. jnp.int32(0)")
    if not hasattr(value, "dtype") and not 0 <= value <= INT32_MAX:
        raise InvalidConfigError(f"`counter` must be an int in [0, {INT32_MAX}]. Received: {describe(value)}.")
    return jnp.asarray(value, jnp.int32)


def _min_loss_scale(value: Any) -> Any:
    if value is None:
        return np.float32(1.0)  # jmp's default floor
    if _is_tracer(value):
        raise PolyampTypeError(
            "`min_loss_scale` is a setting of the rule, fixed when the loss scale is made: pass a Python float or a "
            f"concrete array, not a traced value. Received: {describe(value)}."
        )
    value = _scalar(value, "min_loss_scale", "floating", "a floating-point scalar, e.g. 1.0 or jnp.float32(1)")
    return np.float32(to_float32(float(np.asarray(value, np.float64))))


def _predicate(value: Any, call: str) -> Any:
    """``value`` as a boolean JAX scalar, or a clear error."""
    if isinstance(value, bool):
        return jnp.asarray(value)
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if dtype is None or shape != () or jnp.dtype(dtype) != jnp.bool_:
        held = f" (dtype {dtype}, shape {shape})" if dtype is not None else ""
        raise PolyampTypeError(
            f"{call} takes a boolean scalar: a 0-d bool array, such as all_finite(grads), or a Python bool. "
            f"Received: {describe(value)}{held}. Reduce an array of flags first, e.g. jnp.all(flags)."
        )
    return value


class _Scaling:
    """`scale` and `unscale` of the loss scales that scale, through the functional scaler ``_rule`` gives."""

    def _rule(self) -> tuple[FunctionalLossScaler, dict[str, Any]]:
        raise NotImplementedError

    def scale(self, tree: T) -> T:
        """Every leaf of ``tree`` times the scale (in at least float32)."""
        fn, state = self._rule()
        return jax.tree_util.tree_map(lambda leaf: fn.scale(state, leaf), tree)  # type: ignore[no-any-return]

    def unscale(self, tree: T) -> T:
        """Every floating-point leaf of ``tree`` times the float32 reciprocal of the scale."""
        fn, state = self._rule()
        return fn.unscale(state, tree)[0]  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """jmp's ``NoOpLossScale``: polyamp's loss scaler with scaling off; `scale` and `unscale` return their
    argument itself. An empty pytree."""

    @property
    def loss_scale(self) -> int:
        """1."""
        return 1

    def scale(self, tree: T) -> T:
        """``tree`` itself."""
        fn, state = _off()
        return fn.scale(state, tree)  # type: ignore[no-any-return]

    def unscale(self, tree: T) -> T:
        """``tree`` itself."""
        fn, state = _off()
        return fn.unscale(state, tree)[0]  # type: ignore[no-any-return]

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """This loss scale (it never changes)."""
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale(_Scaling):
    """jmp's ``StaticLossScale``: polyamp's loss scaler at a fixed scale (``dynamic=False``). The scale is a
    setting, not an array: an empty pytree.

    Args:
        loss_scale: The scale, a positive number from ``2**-126`` to ``2**126`` (the highest a JAX scale holds:
            above it, XLA on CPU flushes its float32 reciprocal to zero): a Python number or a concrete scalar
            array.

    Raises:
        InvalidConfigError: the scale is 0, negative, below 2**-126 or above 2**126.
        PolyampTypeError: the scale is not a number, or a traced value.
    """

    loss_scale: float

    def __post_init__(self) -> None:
        value = self.loss_scale
        if _is_tracer(value):
            raise PolyampTypeError(
                "StaticLossScale holds its scale as a setting: pass a Python number or a concrete array, not a "
                f"traced value (DynamicLossScale carries its scale as an array). Received: {describe(value)}."
            )
        if isinstance(value, bool) or not (
            isinstance(value, numbers.Real) or (getattr(value, "shape", None) == () and hasattr(value, "dtype"))
        ):
            raise PolyampTypeError(
                f"`loss_scale` must be a positive number, e.g. 2.0**15. Received: {describe(value)}."
            )
        number = float(np.asarray(value, np.float64))
        _static_rule(number)  # the settings are checked once, here
        object.__setattr__(self, "loss_scale", number)

    def _rule(self) -> tuple[FunctionalLossScaler, dict[str, Any]]:
        return _static_rule(self.loss_scale)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """This loss scale (it never changes)."""
        del grads_finite
        return self


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(_Scaling):
    """jmp's ``DynamicLossScale``: polyamp's dynamic loss-scale rule on a scale and counter carried as arrays.

    A pytree whose leaves are ``loss_scale`` and ``counter``; ``period``, ``factor`` and ``min_loss_scale`` are
    its static settings. `adjust` gives the next state by polyamp's rule (`polyamp.LossScaleConfig`) with
    ``growth_interval=period``, ``growth_factor=factor``, ``backoff_factor=1/factor``,
    ``min_scale=min_loss_scale`` and hysteresis 1: after ``period`` finite steps in a row the scale grows by
    ``factor`` (unless that is not finite); a non-finite step divides it by ``factor``, not below
    ``min_loss_scale``, and restarts the count.

    Args:
        loss_scale: The current scale: a Python number or a 0-d floating-point array; held in float32.
        counter: Finite steps in a row since the scale last changed: an int or a 0-d integer array (0 if None).
        period: Finite steps in a row before the scale grows, an int >= 1.
        factor: The growth factor (> 1); a backoff multiplies by ``1 / factor``.
        min_loss_scale: The floor of a backoff (1.0 if None): a Python number or a concrete 0-d floating-point
            array, at least ``2**-126``.

    Raises:
        PolyampTypeError: an argument of the wrong type (an integer array as a scale, a float ``period``, ...).
        InvalidConfigError: a setting out of range (``factor <= 1``, ``min_loss_scale`` of 0, ...).

    Example:
        ```python
        loss_scale = jmp_compat.DynamicLossScale(jnp.float32(2**15))
        grads = loss_scale.unscale(jax.grad(lambda p: loss_scale.scale(loss_fn(p)))(params))
        finite = jmp_compat.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        params = jmp_compat.select_tree(finite, optax.apply_updates(params, updates), params)
        ```
    """

    loss_scale: Any
    counter: Any = None
    period: int = 2000
    factor: float = 2
    min_loss_scale: Any = None

    def __post_init__(self) -> None:
        minimum = _min_loss_scale(self.min_loss_scale)
        _dynamic_settings(self.period, self.factor, float(minimum))  # the settings are checked once, here
        object.__setattr__(self, "loss_scale", _loss_scale(self.loss_scale))
        object.__setattr__(self, "counter", _counter(self.counter))
        object.__setattr__(self, "min_loss_scale", minimum)

    def _rule(self) -> tuple[FunctionalLossScaler, dict[str, Any]]:
        fn, state = _dynamic_settings(self.period, self.factor, float(self.min_loss_scale))
        return fn, _with_scale(state, self.loss_scale, self.counter)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next loss scale, given whether this step's gradients were all finite (a boolean scalar).

        Raises:
            PolyampTypeError: ``grads_finite`` is not a boolean scalar.
        """
        finite = _predicate(grads_finite, "DynamicLossScale.adjust(grads_finite)")
        fn, state = self._rule()
        tree = fn.update(state, jnp.logical_not(finite))["scaler"]
        return self._make(tree["scale"], tree["growth_tracker"], (self.period, self.factor, self.min_loss_scale))

    # -- pytree ------------------------------------------------------------------------------------------

    def tree_flatten(self) -> tuple[tuple[Any, Any], tuple[Any, Any, np.float32]]:
        return (self.loss_scale, self.counter), (self.period, self.factor, self.min_loss_scale)

    @classmethod
    def tree_unflatten(cls, meta: tuple[Any, Any, np.float32], children: tuple[Any, Any]) -> DynamicLossScale:
        return cls._make(children[0], children[1], meta)

    @classmethod
    def _make(cls, loss_scale: Any, counter: Any, meta: tuple[Any, Any, np.float32]) -> DynamicLossScale:
        """An instance from checked parts, with no check (JAX unflattens with placeholders and tracers)."""
        new = object.__new__(cls)
        values = (loss_scale, counter, *meta)
        for field, value in zip(("loss_scale", "counter", "period", "factor", "min_loss_scale"), values, strict=True):
            object.__setattr__(new, field, value)
        return new


def _empty_pytree(cls: type) -> None:
    jax.tree_util.register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)


_empty_pytree(NoOpLossScale)
_empty_pytree(StaticLossScale)

#: Any of the three loss scales.
LossScale: TypeAlias = NoOpLossScale | StaticLossScale | DynamicLossScale


def all_finite(tree: Any) -> Any:
    """A boolean scalar: no leaf of ``tree`` holds inf or NaN (`polyamp_jax.all_finite`; Python numbers are
    checked too). True for an empty tree."""
    return _all_finite(jax.tree_util.tree_map(jnp.asarray, tree))


def select_tree(pred: Any, a: T, b: T) -> T:
    """``a`` where ``pred`` (a boolean scalar) is true, else ``b``, leaf by leaf: the functional scaler's
    ``apply_if_finite``, which keeps ``b`` when a step is skipped.

    Raises:
        PolyampTypeError: ``pred`` is not a boolean scalar.
    """
    finite = _predicate(pred, "select_tree(pred, a, b)")
    return _guard().apply_if_finite(jnp.logical_not(finite), a, b)  # type: ignore[no-any-return]
