"""`loss_scaled`: polyamp's loss scaling as an optax transformation.

It wraps any optax transformation. Its state holds polyamp's functional state (the scale, counters, the
step-record ring and, with a `polyamp.SpikeRule`, the spike window) beside the inner state, as arrays, so the
whole step stays in one ``jax.jit`` with no host read. The semantics are `polyamp.FunctionalLossScaler`'s, the
same as `polyamp.LossScaler`'s on every backend.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from polyamp import FunctionalLossScaler, LossScaler, Policy, PolyampTypeError, SpikeRule, StepRecord
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.records import RunSummary, log_every
from polyamp_jax._dynamic_scale import DynamicScale
from polyamp_jax._functional import JaxFunctional, non_finite_parameters
from polyamp_jax._precision import PrecisionState, warn_unplanned

__all__ = [
    "LossScaledState",
    "load_state_dict",
    "log_summary",
    "loss_scaled",
    "records",
    "scale_loss",
    "scaler_of",
    "state_dict",
    "summary",
]


@jax.tree_util.register_pytree_node_class
class LossScaledState:
    """The state of `loss_scaled`: ``scaler`` (polyamp's functional state: a dict of arrays), ``inner`` (the
    wrapped transformation's state), and, as static data, the `polyamp.FunctionalLossScaler` that reads them.

    It pickles, and once Flax is imported, ``flax.serialization`` (msgpack checkpoints) writes it as
    ``{"scaler": its arrays, "inner": the inner state's}`` and restores it into a target state."""

    def __init__(self, scaler: Any, inner: Any, fn: FunctionalLossScaler) -> None:
        self.scaler = scaler
        self.inner = inner
        self.fn = fn
        if not _registered:
            _register_with_flax()

    def tree_flatten(self) -> tuple[tuple[Any, Any], FunctionalLossScaler]:
        return (self.scaler, self.inner), self.fn

    @classmethod
    def tree_unflatten(cls, fn: FunctionalLossScaler, children: tuple[Any, Any]) -> LossScaledState:
        return cls(children[0], children[1], fn)

    def __repr__(self) -> str:
        return f"LossScaledState(mode={self.fn.mode!r}, scaler={self.scaler!r}, inner={self.inner!r})"


_registered = False


def _arrays(scaler: Mapping[str, Any]) -> dict[str, Any]:
    """The functional state ``scaler`` without its static parts (the gradients' names), for serialization."""
    return {key: {k: v for k, v in value.items() if k != "names"} for key, value in scaler.items()}


def _register_with_flax() -> None:
    """Once Flax is imported, its serialization writes a `LossScaledState` as ``{"scaler", "inner"}`` (the
    scaler's arrays, the inner state's state dict) and restores it into a target state, whose static parts
    (the functional scaler, the gradients' names) it keeps. Flax is never imported here."""
    global _registered
    serialization = sys.modules.get("flax.serialization")
    if _registered or serialization is None:
        return

    def to_state(value: LossScaledState) -> dict[str, Any]:
        return {
            "scaler": serialization.to_state_dict(_arrays(value.scaler)),
            "inner": serialization.to_state_dict(value.inner),
        }

    def from_state(target: LossScaledState, state: Mapping[str, Any]) -> LossScaledState:
        scaler = serialization.from_state_dict(_arrays(target.scaler), state["scaler"], name="scaler")
        if "provenance" in target.scaler:
            scaler["provenance"]["names"] = target.scaler["provenance"]["names"]
        inner = serialization.from_state_dict(target.inner, state["inner"], name="inner")
        return LossScaledState(scaler, inner, target.fn)

    serialization.register_serialization_state(LossScaledState, to_state, from_state, override=True)
    _registered = True


def loss_scaled(
    inner: optax.GradientTransformation,
    *positional: Any,
    enabled: bool | None = None,
    guard: bool | None = None,
    spike: SpikeRule | None = None,
    history: int = 256,
    on_min_scale: str = "warn",
    axis_name: Any = None,
    **settings: Any,
) -> optax.GradientTransformationExtraArgs:
    """``inner`` with polyamp's dynamic loss scaling: the gradients it receives (of a loss scaled with
    `scale_loss`) are unscaled and checked; a step with an inf or NaN gradient (or a spike) is skipped, the
    updates are negative zeros (which ``optax.apply_updates`` adds to every parameter without changing its bits,
    a zero's sign included) and ``inner``'s state stays as it was, bitwise; the scale follows polyamp's rule.

    Args:
        inner: Any optax transformation (``optax.adamw(1e-3)``, a chain, ...), or `precision` around one to
            follow the policy's training-state plan (``loss_scaled(precision(optax.adamw(1e-3)))``).
        *positional, **settings: polyamp's loss-scaling settings (see `polyamp.LossScaleConfig`), as for
            `polyamp.LossScaler`.
        enabled: As `polyamp.LossScaler`'s, decided when the transformation is made: None (default) scales
            under a float16 policy (``polyamp.set_policy("mixed_float16")``) and guards under bfloat16 and
            float32 ones.
        guard: As `polyamp.LossScaler`'s: check and skip without scaling.
        spike: A `polyamp.SpikeRule`. ``on="grad_norm"`` decides on the unscaled gradients; ``on="loss"``
            needs the step's unscaled loss as ``tx.update(grads, state, params, loss=loss)``.
        history: How many step records the state's ring holds (read them with `records`).
        on_min_scale: As `polyamp.LossScaler`'s.
        axis_name: None, or the named axis (``pmap``, ``shard_map``, ``vmap``) over which replicas hold different
            gradients (optimizer sharding, unsynchronised replicas): the found-inf flag is reduced over it with
            one ``pmax``, so every replica skips a step one of them overflowed. Data-parallel steps that
            average the gradients first (``lax.pmean``) need none.

    Returns:
        An ``optax.GradientTransformationExtraArgs``; its state is a `LossScaledState`.

    Raises:
        InvalidConfigError / PolyampTypeError: a setting is invalid, or ``inner`` is not an optax
            transformation.

    Warns:
        TrainingStateWarning: once, at the first ``init`` with bfloat16/float16 parameters when ``inner`` is not
            `precision`: a plain optimizer rounds each update to nearest, and small ones are lost.

    Example:
        ```python
        tx = polyamp_jax.loss_scaled(optax.adam(1e-3))
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, x, y):
            def scaled_loss(p):
                return polyamp_jax.scale_loss(opt_state, loss_fn(p, x, y))
            grads = jax.grad(scaled_loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
        ```
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise PolyampTypeError(
            f"loss_scaled() wraps an optax transformation (such as optax.adam(1e-3)). Received: {describe(inner)}."
        )
    scaler = LossScaler(
        *positional, enabled=enabled, guard=guard, spike=spike, history=history, on_min_scale=on_min_scale, **settings
    )
    fn = scaler.functional(backend="jax", make_device=functools.partial(JaxFunctional, axis_name=axis_name))
    wrapped = optax.with_extra_args_support(inner)
    warned = False

    def init(params: Any) -> LossScaledState:
        nonlocal warned
        inner_state = wrapped.init(params)
        if not warned and not _follows_a_plan(inner_state):
            # A plain optimizer writes bfloat16/float16 weights to nearest, whatever the policy plans.
            warned = warn_unplanned("The optax optimizer inside polyamp_jax.loss_scaled", params, Policy("bfloat16"))
        # The state counts which gradients held inf/NaN in a skipped step (named by their place in params).
        return LossScaledState(fn.init(grads=params), inner_state, fn)

    def update(updates: Any, state: LossScaledState, params: Any = None, **extra: Any) -> tuple[Any, LossScaledState]:
        loss = extra.pop("loss", None)
        scaler_state = state.scaler
        fn = _state_scaler(state)  # a loaded state's settings travel with it (load_state_dict)
        if fn.mode != "off" and _follows_a_plan(state.inner):
            # A plan forms its update in float32: unscaled there, a float16 gradient below 2**-24 keeps its value.
            updates = jax.tree_util.tree_map(_float32_if_low, updates)

        def keep(applied: tuple[Any, Any]) -> tuple[Any, Any]:
            # -0.0, not 0.0: x + -0.0 is x for every x, while -0.0 + 0.0 is +0.0.
            return jax.tree_util.tree_map(lambda u: jnp.full_like(u, -0.0), applied[0]), state.inner

        out = fn.step(
            scaler_state, updates, lambda grads: wrapped.update(grads, state.inner, params, **extra), keep, loss=loss
        )
        new_updates, new_inner = out.result
        return new_updates, LossScaledState(out.state, new_inner, fn)

    return optax.GradientTransformationExtraArgs(init, update)


def _float32_if_low(leaf: Any) -> Any:
    dtype = getattr(leaf, "dtype", None)
    return leaf.astype(jnp.float32) if dtype in (jnp.float16, jnp.bfloat16) else leaf


def _state_scaler(state: Any) -> FunctionalLossScaler:
    """The functional scaler of ``state``, a `LossScaledState`.

    Raises:
        PolyampTypeError: ``state`` is not one (the state of another transformation).
    """
    if not isinstance(state, LossScaledState):
        raise PolyampTypeError(
            "The update of polyamp_jax.loss_scaled takes the state its init returned (a LossScaledState). "
            f"Received: {describe(state)}."
        )
    return state.fn


def _follows_a_plan(inner_state: Any) -> bool:
    """True when the wrapped optimizer is `precision` (its state holds a `PrecisionState`)."""

    def is_plan(node: Any) -> bool:
        return isinstance(node, PrecisionState)

    return any(is_plan(node) for node in jax.tree_util.tree_leaves(inner_state, is_leaf=is_plan))


def _find(tree: Any, method: str) -> LossScaledState | DynamicScale:
    """The `LossScaledState` or `DynamicScale` in ``tree`` (itself, inside a chain's tuple of states, a Flax
    ``TrainState``, ...)."""
    kinds = (LossScaledState, DynamicScale)
    found = [
        node
        for node in jax.tree_util.tree_leaves(tree, is_leaf=lambda n: isinstance(n, kinds))
        if isinstance(node, kinds)
    ]
    if len(found) != 1:
        raise PolyampTypeError(
            f"polyamp_jax.{method} takes a state holding one loss_scaled() state (tx.init(params) of a "
            "polyamp_jax.loss_scaled transformation, alone or in a chain) or one polyamp_jax.DynamicScale (alone or "
            f"in a Flax TrainState). Found {len(found)} in {describe(tree)}."
        )
    return found[0]


def _view(tree: Any, method: str) -> tuple[FunctionalLossScaler, Any]:
    """The functional scaler and functional state of the one polyamp state in ``tree``."""
    node = _find(tree, method)
    if isinstance(node, DynamicScale):
        return node.scaler, node._functional_state()
    return node.fn, node.scaler


def scaler_of(opt_state: Any) -> FunctionalLossScaler:
    """The `polyamp.FunctionalLossScaler` of the `loss_scaled` state (or the `DynamicScale`) in ``opt_state``."""
    return _view(opt_state, "scaler_of()")[0]


def scale_loss(opt_state: Any, loss: Any) -> Any:
    """``loss`` times the current scale of the `loss_scaled` state in ``opt_state`` (``loss`` itself when not
    scaling). Differentiate this, and give the gradients to the transformation's ``update``."""
    fn, state = _view(opt_state, "scale_loss()")
    return fn.scale(state, loss)


def records(opt_state: Any, params: Any = None) -> list[StepRecord]:
    """The most recent steps' records (one host read), as `polyamp.LossScaler.records` gives them, of the
    `loss_scaled` state or the `DynamicScale` in ``opt_state`` (e.g. a Flax ``TrainState``): the record of the
    most recent step skipped for inf/NaN gradients names them (``gradients``: their place in the parameters,
    e.g. ``"params/Dense_0/kernel"``, and how many +inf, -inf and NaN each held) where the state counts them.

    With ``params``, during a run of skipped steps the parameters are checked once: when some hold inf or NaN,
    which skips every later step, a warning names them and says to restore a checkpoint."""
    fn, state = _view(opt_state, "records()")
    return fn.records(state, check_parameters=None if params is None else lambda: non_finite_parameters(params))


def summary(opt_state: Any, params: Any = None) -> RunSummary:
    """The run of the `loss_scaled` state or the `DynamicScale` in ``opt_state`` in one line (``str()`` of the
    result), as `polyamp.LossScaler.summary` gives it: its steps, the skipped ones by reason and iteration, the
    loss scale's path and the parameters' layers that held inf/NaN gradients. One host read, as `records`
    (``params`` as there); it covers every step of the state's run read so far: call it (or `records`, or
    `log_summary`) at least every ``history`` steps.

    Example:
        ```python
        print(polyamp_jax.summary(opt_state))  # 200 steps, 2 skipped (overflow at 50, 51), scale 2^16 -> 2^15
        ```
    """
    fn, state = _view(opt_state, "summary()")
    return fn.summary(state, check_parameters=None if params is None else lambda: non_finite_parameters(params))


def log_summary(
    opt_state: Any,
    step: int,
    *,
    every: int = 100,
    progress: Any = None,
    write: Callable[[str], object] | None = None,
) -> RunSummary | None:
    """Show `summary` of ``opt_state`` every ``every`` steps; call it once per step, after the jitted step returns
    the new state. The other steps it returns at once: no host read, so the host keeps dispatching steps ahead.

    Args:
        opt_state: The optimizer state holding the `loss_scaled` state or the `DynamicScale` (e.g. a Flax
            ``TrainState``).
        step: The index of the step that just ended, from 0, as a Python int (a JAX array would be read to the host
            every step). The summary is shown after steps ``every - 1``, ``2 * every - 1``, ...
        every: How many steps between two summaries; at most the state's ``history``, so no record is lost.
        progress: A tqdm bar: the summary's short form (``"5 skipped, scale 2^13"``) becomes its postfix, and
            nothing is printed unless ``write`` is given.
        write: Where the line goes (``logging.info``, ``tqdm.write``); default: ``print``, unless ``progress``
            is given.

    Returns:
        The `polyamp.backend_api.records.RunSummary` on the steps it is shown, else None.

    Raises:
        PolyampTypeError / PolyampValueError: ``step`` or ``every`` is not a count, ``progress`` has no
            ``set_postfix_str``, or ``opt_state`` holds no polyamp state (checked when the summary is read).
    """
    return log_every(lambda: summary(opt_state), step, every, progress, write)


def state_dict(opt_state: Any) -> dict[str, Any]:
    """The loss-scaler state dict of the `loss_scaled` state or the `DynamicScale` in ``opt_state``,
    interchangeable with `polyamp.LossScaler.state_dict`'s on every backend (and torch's ``GradScaler``'s)."""
    fn, state = _view(opt_state, "state_dict()")
    return fn.state_dict(state)


def load_state_dict(opt_state: Any, saved: Any) -> Any:
    """``opt_state`` with its loss-scaler state (a `loss_scaled` state or a `DynamicScale`) restored from a state
    dict of any backend's scaler.

    The dict's settings (``growth_interval``, ...) are the restored state's, carried with it, as Flax's
    ``DynamicScale`` carries its own: a jitted step given it traces anew and follows them; the transformation
    and its other states keep theirs.

    Raises:
        StateDictError: the dict is malformed, or holds a scale JAX cannot hold (nothing changes).
        InvalidConfigError: a `DynamicScale` cannot follow the dict's settings (hysteresis, a fixed scale).
    """
    node = _find(opt_state, "load_state_dict()")
    restored: LossScaledState | DynamicScale
    if isinstance(node, DynamicScale):
        restored = node._loaded(saved)
    else:
        # The dict's settings travel with the state: a state with other settings than the transformation's
        # holds its own functional scaler, and a jitted step traces anew for it.
        fn, loaded = node.fn.restore(saved, like=node.scaler)
        restored = LossScaledState(loaded, node.inner, fn)
    return jax.tree_util.tree_map(
        lambda n: restored if n is node else n,
        opt_state,
        is_leaf=lambda n: isinstance(n, (LossScaledState, DynamicScale)),
    )
