"""`DynamicScale`: a drop-in for Flax's ``flax.training.dynamic_scale.DynamicScale`` run by polyamp's scaler.

Flax's class and this one take the same fields and give the same ``value_and_grad``; the scale here follows
`polyamp.LossScaleConfig`'s rule through `polyamp.FunctionalLossScaler` (over `JaxFunctional`), with Flax's
settings translated into polyamp's once, when the object is made:

* Flax grows the scale on the ``growth_interval + 1``-th finite step in a row (its ``fin_steps`` counts up to
  ``growth_interval`` before the growing step): polyamp's ``growth_interval`` is Flax's plus one, and
  ``fin_steps`` is polyamp's ``growth_tracker``.
* Flax backs off on every non-finite step: ``hysteresis=1``.
* Flax multiplies the float32 scale by its factors in float32: polyamp's factors are Flax's rounded to float32,
  whose products polyamp rounds the same way.
* Flax's ``minimum_scale`` is polyamp's ``min_scale``; ``None`` (no floor in Flax, where the scale can fall to
  float32's subnormals and zero) keeps polyamp's lowest floor, float32's smallest normal number 2**-126.
* Flax caps a growing scale at float32's largest value: polyamp's ``max_scale``, so a product that would be
  inf grows to it, as in Flax. The scale then stops at 2**126, the ceiling of every JAX scale in polyamp
  (`polyamp.backend_api.rules.RECIPROCAL_CEILING`, the largest power of two whose float32 reciprocal is a normal
  number). polyamp unscales by multiplying with that reciprocal, and XLA (on CPU) flushes a subnormal one to
  zero, which would turn every gradient into zero; Flax divides, so its scale can go on to float32's largest
  value. The two differ only there.

The gradients come back in float32, as Flax gives them. polyamp unscales them by multiplying with the float32
reciprocal of the scale (its rule on every backend); Flax divides. The two are equal bit for bit whenever the
scale is a power of two, which it always is with the default factors and a power-of-two start; otherwise they
may differ in the last bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from polyamp import (
    FunctionalLossScaler,
    InvalidConfigError,
    LossScaleConfig,
    LossScaler,
    LossScaleState,
    PolyampTypeError,
    PolyampValueError,
)
from polyamp.backend_api.arguments import INT32_MAX, describe
from polyamp.backend_api.rules import RECIPROCAL_CEILING, to_float32

__all__ = ["DynamicScale", "DynamicScaleResult"]

#: float32's smallest normal number: Flax's default ``minimum_scale`` and the lowest floor polyamp keeps.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
#: float32's largest value, Flax's cap on a growing scale (a product that would be inf grows to it).
FLOAT32_MAX = float(np.finfo(np.float32).max)
_STATIC = ("growth_factor", "backoff_factor", "growth_interval", "minimum_scale")


class DynamicScaleResult(NamedTuple):
    """``(dynamic_scale, finite, aux, grad)``: what the function `DynamicScale.value_and_grad` makes returns, as
    Flax's does."""

    dynamic_scale: DynamicScale
    finite: Any
    aux: Any
    grad: Any


def _error(field: str, value: object, allowed: str, fix: str = "") -> PolyampValueError:
    tail = f" {fix}" if fix else ""
    return InvalidConfigError(f"DynamicScale's `{field}` must be {allowed}. Received: {field}={describe(value)}.{tail}")


def _number(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PolyampTypeError(f"DynamicScale's `{field}` must be a real number. Received: {field}={describe(value)}.")
    return float(value)


def _settings(
    growth_factor: object, backoff_factor: object, growth_interval: object, minimum_scale: object
) -> dict[str, Any]:
    """polyamp's settings for Flax's (everything but ``init_scale``), validated with Flax's names.

    Raises:
        PolyampTypeError / InvalidConfigError: a value Flax's rule has no polyamp equivalent for.
    """
    growth = to_float32(_number("growth_factor", growth_factor))
    if not (math.isfinite(growth) and growth > 1):
        raise _error("growth_factor", growth_factor, "a finite number > 1 (in float32)", "e.g. growth_factor=2.0.")
    backoff = to_float32(_number("backoff_factor", backoff_factor))
    if not 0 < backoff < 1:
        raise _error("backoff_factor", backoff_factor, "in the open interval (0, 1) (in float32)", "e.g. 0.5.")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral):
        raise PolyampTypeError(
            f"DynamicScale's `growth_interval` must be an int. Received: growth_interval={describe(growth_interval)}."
        )
    if not 0 <= int(growth_interval) < INT32_MAX:
        raise _error(
            "growth_interval",
            growth_interval,
            f"an int in [0, {INT32_MAX - 1}] (the scale grows on the growth_interval+1-th finite step in a row)",
            "e.g. growth_interval=2000.",
        )
    if minimum_scale is None:
        floor = FLOAT32_TINY
    else:
        floor = _number("minimum_scale", minimum_scale)
        if not (math.isfinite(floor) and FLOAT32_TINY <= floor <= RECIPROCAL_CEILING):
            raise _error(
                "minimum_scale",
                minimum_scale,
                "None or a number from 2**-126 (float32's smallest normal number, Flax's default) to 2**126",
                "polyamp keeps the scale a normal float32 number, where its reciprocal and the unscaled gradients "
                "are finite; pass minimum_scale=None or a value >= 2**-126.",
            )
    return {
        "growth_factor": growth,
        "backoff_factor": backoff,
        "growth_interval": int(growth_interval) + 1,
        "hysteresis": 1,
        "min_scale": floor,
        "max_scale": FLOAT32_MAX,  # Flax's jnp.minimum(scale * growth_factor, float32's max)
        "dynamic": True,
    }


def _concrete(field: str, value: Any) -> Any:
    """``value`` as a host number (a Python number, a NumPy or concrete JAX scalar).

    Raises:
        PolyampTypeError: it is traced or not a scalar.
    """
    if isinstance(value, jax.core.Tracer) or np.ndim(value) != 0:
        raise PolyampTypeError(
            f"DynamicScale(...) and DynamicScale.replace({field}=...) take a concrete number for `{field}`: "
            "polyamp restarts its step records from it. Received: "
            f"{field}={describe(value)}. Make or replace a DynamicScale outside jax.jit (and outside pmap's "
            "replicas: unreplicate first), then pass it in."
        )
    return np.asarray(value).item()


def _functional(config: LossScaleConfig) -> FunctionalLossScaler:
    return LossScaler(enabled=True, **config.settings()).functional(backend="jax")


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicScale:
    """Dynamic loss scaling for ``jax.value_and_grad``, a drop-in for ``flax.training.dynamic_scale.DynamicScale``
    whose scale follows polyamp's rule (`polyamp.FunctionalLossScaler`), with polyamp's step records and state
    dicts.

    Porting is the import: ``from polyamp_jax import DynamicScale`` in place of ``from
    flax.training.dynamic_scale import DynamicScale``. The fields, `value_and_grad` and its result are Flax's,
    the object is a pytree (a field of a Flax ``TrainState``, an argument and result of ``jax.jit`` and
    ``pmap``), and the trajectory of the scale, ``fin_steps`` and the finite flag are Flax's step for step.
    `polyamp_jax.records` and `polyamp_jax.state_dict` read it (alone or inside a ``TrainState``); the state
    dict is interchangeable with torch's and polyamp's other scalers'.

    Attributes:
        growth_factor: How much the scale grows after ``growth_interval + 1`` finite steps in a row (Flax's
            counting: the growing step is the one after ``growth_interval`` finite steps). Default: 2.0.
        backoff_factor: How much the scale shrinks after a non-finite gradient. Default: 0.5.
        growth_interval: Finite steps in a row before the one that grows the scale. Default: 2000.
        fin_steps: Finite steps in a row since the scale last changed (a JAX int32 scalar).
        scale: The current scale the loss is multiplied by (a JAX float32 scalar). Default: 65536.0.
        minimum_scale: The floor of the scale, or None (polyamp's lowest, 2**-126). Default: 2**-126.

    Raises:
        PolyampTypeError / InvalidConfigError: a setting with no polyamp equivalent (``growth_factor <= 1``, a
            floor below float32's normal numbers, ...), ``fin_steps`` outside ``[0, growth_interval]``, a scale
            outside ``[minimum_scale, 2**126]``, or a traced ``scale``/``fin_steps`` (make it outside
            ``jax.jit``).

    Example:
        ```python
        dynamic_scale = polyamp_jax.DynamicScale(growth_interval=2000)
        state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3),
                                  dynamic_scale=dynamic_scale)

        @jax.jit
        def train_step(state, x, y):
            grad_fn = state.dynamic_scale.value_and_grad(lambda p: loss_fn(p, x, y))
            dynamic_scale, is_fin, loss, grads = grad_fn(state.params)
            new_state = state.apply_gradients(grads=grads)
            select = functools.partial(jnp.where, is_fin)
            return new_state.replace(
                params=jax.tree_util.tree_map(select, new_state.params, state.params),
                opt_state=jax.tree_util.tree_map(select, new_state.opt_state, state.opt_state),
                dynamic_scale=dynamic_scale,
            ), loss
        ```
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    fin_steps: Any = 0
    scale: Any = 65536.0
    minimum_scale: float | None = FLOAT32_TINY
    # polyamp's bookkeeping: the skip count and the step-record ring (arrays), and the functional scaler that
    # reads them (static). Both are made here, from the fields, and carried by value_and_grad.
    _records: Any = dataclasses.field(default=None, init=False, repr=False)
    _scaler: FunctionalLossScaler | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        settings = _settings(self.growth_factor, self.backoff_factor, self.growth_interval, self.minimum_scale)
        scale = _concrete("scale", self.scale)
        fin_steps = _concrete("fin_steps", self.fin_steps)
        start = _number("scale", scale)
        if not (math.isfinite(start) and settings["min_scale"] <= start <= RECIPROCAL_CEILING):
            raise _error(
                "scale",
                scale,
                f"a number from minimum_scale ({settings['min_scale']!r}) to 2**126 (above it, the float32 "
                "reciprocal polyamp unscales with is subnormal, which XLA flushes to zero)",
            )
        if isinstance(fin_steps, bool) or not isinstance(fin_steps, numbers.Integral):
            raise PolyampTypeError(
                f"DynamicScale's `fin_steps` must be an int. Received: fin_steps={describe(fin_steps)}."
            )
        if not 0 <= int(fin_steps) <= int(self.growth_interval):
            raise _error("fin_steps", fin_steps, f"an int in [0, growth_interval={self.growth_interval}]")
        config = LossScaleConfig(init_scale=start, **settings)
        scaler = _functional(config)
        self._adopt(scaler, scaler.init(LossScaleState(to_float32(start), int(fin_steps), config.hysteresis)))
        _register_with_flax()

    # -- polyamp's functional state ----------------------------------------------------------------------

    def _adopt(self, scaler: FunctionalLossScaler, state: Mapping[str, Any]) -> None:
        """Hold ``scaler`` and its functional ``state`` (at construction)."""
        tree = state["scaler"]
        object.__setattr__(self, "scale", tree["scale"])
        object.__setattr__(self, "fin_steps", tree["growth_tracker"])
        object.__setattr__(self, "_records", {"skipped": tree["skipped"], "ring": state["ring"]})
        object.__setattr__(self, "_scaler", scaler)

    @property
    def scaler(self) -> FunctionalLossScaler:
        """The `polyamp.FunctionalLossScaler` whose rule this object follows (``polyamp_jax.scaler_of``)."""
        assert self._scaler is not None
        return self._scaler

    def _functional_state(self) -> dict[str, Any]:
        """This object's state as `scaler`'s functional state (the scale, Flax's ``fin_steps`` as the growth
        tracker, the skip count and the record ring)."""
        records = self._records
        return {
            "scaler": {
                "scale": jnp.asarray(self.scale, jnp.float32),
                "growth_tracker": jnp.asarray(self.fin_steps, jnp.int32),
                "hysteresis_left": jnp.asarray(self.scaler.config.hysteresis, jnp.int32),
                "skipped": records["skipped"],
            },
            "ring": records["ring"],
        }

    def _with_functional_state(self, state: Mapping[str, Any]) -> DynamicScale:
        """A copy holding ``state`` (what `scaler`'s functions returned for `_functional_state`)."""
        tree = state["scaler"]
        return self._rebuilt(
            (tree["growth_tracker"], tree["scale"], {"skipped": tree["skipped"], "ring": state["ring"]})
        )

    @classmethod
    def _from_config(cls, config: LossScaleConfig, state: LossScaleState) -> DynamicScale:
        """The DynamicScale following ``config`` (a loaded state dict's settings) from ``state``.

        Raises:
            InvalidConfigError: ``config`` has no Flax equivalent (hysteresis, a fixed scale, a cap below
                2**126).
        """
        if (
            not config.dynamic
            or config.hysteresis != 1
            or (config.max_scale or RECIPROCAL_CEILING) < RECIPROCAL_CEILING
        ):
            raise InvalidConfigError(
                "Flax's DynamicScale has no hysteresis, no fixed scale and no cap on the scale below 2**126, so it "
                f"cannot follow these settings: dynamic={config.dynamic!r}, hysteresis="
                f"{config.hysteresis!r}, max_scale={config.max_scale!r}. Load this state dict into "
                "polyamp_jax.loss_scaled(...) or polyamp.LossScaler(...), which take every setting."
            )
        fields = {
            "growth_factor": config.growth_factor,
            "backoff_factor": config.backoff_factor,
            "growth_interval": config.growth_interval - 1,
            "minimum_scale": config.floor_f32,
        }
        start = min(max(config.init_scale, config.floor_f32), RECIPROCAL_CEILING)
        mapped = LossScaleConfig(init_scale=start, **_settings(**fields))
        scaler = _functional(mapped)
        made = cls.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(made, name, value)
        made._adopt(scaler, scaler.init(state))
        return made

    def _loaded(self, saved: Any) -> DynamicScale:
        """A DynamicScale resuming from a state dict (of any backend's scaler): the core reads and checks it, and
        its settings are adopted where Flax's rule can follow them (`_from_config`)."""
        probe = _functional(self.scaler.config)
        state = probe.load_state_dict(saved)
        loaded = self._from_config(probe.config, probe.read(state))
        records = {**loaded._records, "skipped": state["scaler"]["skipped"]}  # the count goes on
        return loaded._rebuilt((loaded.fin_steps, loaded.scale, records))

    # -- Flax's API --------------------------------------------------------------------------------------

    def replace(self, **updates: Any) -> DynamicScale:
        """A copy with some fields changed, as Flax's ``struct`` classes give one; polyamp's step records start
        anew from it (so ``scale`` and ``fin_steps`` must be concrete), as after a state dict is loaded."""
        unknown = sorted(set(updates) - {"fin_steps", "scale", *_STATIC})
        if unknown:
            raise PolyampTypeError(
                f"DynamicScale.replace() takes the fields {['fin_steps', 'scale', *_STATIC]}. Received: {unknown}."
            )
        fields = {name: getattr(self, name) for name in ("fin_steps", "scale", *_STATIC)}
        return DynamicScale(**{**fields, **updates})

    def value_and_grad(
        self,
        fun: Callable[..., Any],
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: str | None = None,
    ) -> Callable[..., DynamicScaleResult]:
        """``jax.value_and_grad(fun, argnums, has_aux)`` of the loss times the scale, as Flax's.

        The function it returns takes ``fun``'s arguments and returns a `DynamicScaleResult`
        ``(dynamic_scale, finite, aux, grad)``: this object after the step (the scale grown, backed off or
        kept by polyamp's rule), whether every gradient is finite (a boolean scalar: apply the step only then,
        e.g. with ``jnp.where``), the value (``(loss, aux)`` with ``has_aux``) and the gradients in float32,
        both divided by the scale.

        Args:
            fun: The loss function, returning a scalar (or ``(scalar, aux)`` with ``has_aux``).
            argnums: Which positional arguments to differentiate, as for ``jax.value_and_grad``.
            has_aux: Whether ``fun`` returns ``(loss, aux)``.
            axis_name: The named axis (``pmap``, ``shard_map``) over which the gradients are averaged
                (``lax.pmean``) before they are unscaled and checked, so every replica takes one decision.
        """
        scaler = self.scaler
        state = self._functional_state()

        def scaled(*args: Any) -> tuple[Any, Any]:
            out = fun(*args)
            loss, aux = out if has_aux else (out, None)
            return scaler.scale(state, loss), aux

        grad_fn = jax.value_and_grad(scaled, argnums, has_aux=True)

        @functools.wraps(fun)
        def wrapped(*args: Any) -> DynamicScaleResult:
            (scaled_loss, aux), grads = grad_fn(*args)
            grads = jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.float32), grads)  # Flax's float32
            if axis_name is not None:
                grads = jax.lax.pmean(grads, axis_name)  # type: ignore[no-untyped-call]
            # Flax's API leaves the inner step to the caller: the iteration's step has none.
            out = scaler.step(state, grads, lambda unscaled: unscaled, lambda applied: applied)
            grads, found_inf = out.grads, out.found_inf
            loss, _ = scaler.unscale(state, scaled_loss)
            assert found_inf is not None  # a DynamicScale always scales
            new = self._with_functional_state(out.state)
            return DynamicScaleResult(
                new, jnp.logical_not(jnp.asarray(found_inf) > 0), (loss, aux) if has_aux else loss, grads
            )

        return wrapped

    # -- pytree ------------------------------------------------------------------------------------------

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], tuple[Any, ...]]:
        children = (
            (jax.tree_util.GetAttrKey("fin_steps"), self.fin_steps),
            (jax.tree_util.GetAttrKey("scale"), self.scale),
            (jax.tree_util.GetAttrKey("_records"), self._records),
        )
        return children, (*(getattr(self, name) for name in _STATIC), self._scaler)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        children, aux = self.tree_flatten_with_keys()
        return tuple(child for _, child in children), aux

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: Sequence[Any]) -> DynamicScale:
        made = cls.__new__(cls)
        for name, value in zip(_STATIC, aux[:-1], strict=True):
            object.__setattr__(made, name, value)
        object.__setattr__(made, "_scaler", aux[-1])
        for name, value in zip(("fin_steps", "scale", "_records"), children, strict=True):
            object.__setattr__(made, name, value)
        return made

    def _rebuilt(self, children: Sequence[Any]) -> DynamicScale:
        return self.tree_unflatten(self.tree_flatten()[1], children)


_registered = False


def _register_with_flax() -> None:
    """Once Flax is imported, its serialization (``flax.serialization.to_state_dict``, msgpack checkpoints of a
    ``TrainState``) writes and reads a DynamicScale as Flax's own: ``{"fin_steps", "scale"}``. Flax is never
    imported here."""
    global _registered
    serialization = sys.modules.get("flax.serialization")
    if _registered or serialization is None:
        return

    def to_state(value: DynamicScale) -> dict[str, Any]:
        return {"fin_steps": value.fin_steps, "scale": value.scale}

    def from_state(target: DynamicScale, state: Mapping[str, Any]) -> DynamicScale:
        return target.replace(fin_steps=state["fin_steps"], scale=state["scale"])

    serialization.register_serialization_state(DynamicScale, to_state, from_state, override=True)
    _registered = True
