"""`LossScaler`: the framework-neutral loss scaler users construct, bound to a backend on first use."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Final

from polyamp._src import registry
from polyamp._src.errors import (
    BackendMismatchError,
    PolyampTypeError,
    ScalerUsageError,
    describe,
)
from polyamp._src.global_policy import get_policy
from polyamp._src.scaling import LossScaleConfig, LossScaleState
from polyamp._src.state_dict import parse_state_dict, to_state_dict

__all__ = ["LossScaler", "resolve_enabled", "wrong_object_error"]

# The step methods a backend may offer, in the order the error messages list them.
_LOOP_METHODS: Final = ("scale", "unscale_", "step", "update", "unscale", "apply_gradients", "step_skipped")


def _detect(obj: object) -> str | None:
    owner = registry.backend_name_for(obj)
    if owner is None and isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, (list, tuple)):  # (grad, var) pairs
                item = item[0] if item else None
            if item is not None:
                return _detect(item)
    return owner


def resolve_enabled(enabled: object) -> bool:
    """``enabled`` as given, or (None) whether the global policy computes in float16 right now."""
    if enabled is None:
        return get_policy().needs_loss_scaling
    if not isinstance(enabled, bool):
        raise PolyampTypeError(f"`enabled` must be None or a bool. Received: enabled={describe(enabled)}.")
    return enabled


def wrong_object_error(bound: str, method: str, obj: object, expected: str) -> PolyampTypeError:
    """The error for a scaler bound to ``bound`` that was handed ``obj``: naming both frameworks when ``obj``
    belongs to another one (`BackendMismatchError`), else saying what ``method`` takes."""
    owner = _detect(obj)
    if owner is not None and owner != bound:
        return BackendMismatchError(
            f"This LossScaler is bound to {bound}, but {method}() received a {owner} object: {describe(obj)}. "
            "A LossScaler serves one framework; create one per framework (their state dicts are interchangeable)."
        )
    return PolyampTypeError(f"{method}() takes {expected}. Received: {describe(obj)}.")


class LossScaler:
    """Dynamic loss scaling for float16 training, one semantics for PyTorch and TensorFlow.

    The scaler multiplies the loss by a scale before backpropagation so small float16 gradients do not
    flush to zero, divides the gradients by it before the optimizer step, skips steps whose gradients hold
    inf or NaN, and adapts the scale (see `LossScaleConfig` for the exact rule and a worked trace; with the
    defaults it reproduces ``torch.amp.GradScaler`` bit for bit).

    The scaler binds to a framework the first time it sees one of its tensors or optimizers (or at once with
    ``backend=``); from then on its scale, growth counter and hysteresis live on that framework's device.

    Args:
        init_scale: Starting scale, 2**16 like torch (Keras 3 starts at 2**15).
        growth_factor: Multiplier after ``growth_interval`` consecutive finite steps; > 1.
        backoff_factor: Multiplier after an overflow; in (0, 1).
        growth_interval: Consecutive finite steps before the scale grows; >= 1.
        hysteresis: Overflows tolerated before a backoff; 1 backs off on every overflow.
        min_scale: Floor for the scale after backoff; None (the default) for none.
        max_scale: Cap for the scale after growth; None (the default) for none.
        dynamic: False keeps the scale at ``init_scale``; non-finite steps are still skipped.
        enabled: None (default) enables scaling iff the global policy computes in float16 at construction.
            A disabled scaler returns the loss itself from ``scale``, just steps, and reports scale 1.0.
        backend: "torch" or "tensorflow" (or a registered third-party name) to bind at once; None binds on
            first use from the type of what it is given.

    Raises:
        InvalidConfigError: (a ``ValueError``) a setting is out of range.
        PolyampTypeError: (a ``TypeError``) a setting has the wrong type.
        UnknownBackendError / BackendNotInstalledError: ``backend`` is unknown or its framework is missing.

    Backends offer subclasses bound from construction (``polyamp_torch.TorchLossScaler``,
    ``polyamp_tensorflow.TensorFlowLossScaler``): they set `bound_backend` and take the same arguments.

    Example (PyTorch; a TensorFlow loop uses ``apply_gradients`` instead of ``step``/``update``)::

        import polyamp, polyamp_torch

        polyamp.set_policy("mixed_float16")
        scaler = polyamp.LossScaler()          # enabled, since the policy computes in float16
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            with polyamp_torch.autocast():
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    The pure state machine, without a framework:

    >>> from polyamp import LossScaler
    >>> scaler = LossScaler(growth_interval=3, enabled=True)
    >>> scaler.get_scale(), scaler.backend
    (65536.0, None)
    >>> scaler.config.trajectory("FFFO")
    [65536.0, 65536.0, 131072.0, 65536.0]
    """

    #: Subclasses set this to bind every instance to one backend (``backend=`` may then be omitted).
    bound_backend: ClassVar[str | None] = None

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        dynamic: bool = True,
        enabled: bool | None = None,
        backend: str | None = None,
    ) -> None:
        config = LossScaleConfig(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            dynamic=dynamic,
        )
        enabled = resolve_enabled(enabled)
        if backend is not None and not isinstance(backend, str):
            raise PolyampTypeError(
                "`backend` must be None or a backend name such as 'torch' or 'tensorflow'. "
                f"Received: backend={describe(backend)}."
            )
        bound = type(self).bound_backend
        if bound is not None:
            if backend not in (None, bound):
                raise PolyampTypeError(
                    f"{type(self).__name__} is bound to {bound}; it cannot take backend={backend!r}. "
                    "Use polyamp.LossScaler for another backend."
                )
            backend = bound
        self._config = config
        self._enabled = enabled
        self._state = config.initial_state()
        self._impl: Any = None
        self._backend_name: str | None = None
        if backend is not None:
            self._bind(backend)

    # -- binding -----------------------------------------------------------------------------------------

    def _bind(self, name: str) -> Any:
        impl = registry.get_backend(name).make_scaler(self._config, self._state, self._enabled)
        self._impl = impl
        self._backend_name = name
        return impl

    def _impl_for(self, method: str, obj: object) -> Any:
        impl = self._impl
        owner = _detect(obj)
        if impl is not None:
            if owner is not None and owner != self._backend_name:
                raise wrong_object_error(str(self._backend_name), method, obj, "this framework's objects")
            return impl
        if owner is None:
            raise PolyampTypeError(
                f"LossScaler.{method}() cannot tell which framework {describe(obj)} belongs to. Pass a tensor "
                "or optimizer of PyTorch or TensorFlow, or bind the scaler up front with "
                "LossScaler(backend='torch') or LossScaler(backend='tensorflow')."
            )
        return self._bind(owner)

    def _bound_method(self, method: str, obj: object) -> Any:
        impl = self._impl_for(method, obj)
        function = getattr(impl, method, None)
        if function is None:
            offered = [m for m in _LOOP_METHODS if hasattr(impl, m)]
            raise PolyampTypeError(
                f"LossScaler.{method}() is not part of the {self._backend_name} backend's training loop. "
                f"A {self._backend_name}-bound scaler offers: {', '.join(m + '()' for m in offered)}."
            )
        return function

    @property
    def backend(self) -> str | None:
        """The name of the bound backend, or None before first use."""
        return self._backend_name

    @property
    def enabled(self) -> bool:
        """Whether this scaler scales at all (see ``enabled`` in the constructor)."""
        return self._enabled

    @property
    def dynamic(self) -> bool:
        """Whether the scale adapts (False: fixed at ``init_scale``)."""
        return self._config.dynamic

    @property
    def config(self) -> LossScaleConfig:
        """The validated settings, which also run the reference state machine."""
        return self._config

    # -- the training-loop methods (forwarded to the bound backend) ---------------------------------------

    def scale(self, loss: Any) -> Any:
        """Multiply a loss (or a list/tuple of losses) by the current scale.

        A disabled scaler returns ``loss`` itself. Binds the scaler to the loss's framework on first use.

        Raises:
            BackendMismatchError: (a ``TypeError``) the loss belongs to another framework than the scaler.
        """
        if not self._enabled:
            if self._impl is not None or _detect(loss) is not None:
                self._impl_for("scale", loss)  # binds, or rejects another framework's loss
            return loss
        return self._bound_method("scale", loss)(loss)

    def unscale_(self, optimizer: Any) -> None:
        """PyTorch: divide the optimizer's gradients by the scale in place and record non-finite ones.

        Optional, for inspecting or clipping gradients before `step`. At most once per optimizer per
        `update`.
        """
        return self._bound_method("unscale_", optimizer)(optimizer)  # type: ignore[no-any-return]

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """PyTorch: unscale (unless done) and call ``optimizer.step(*args, **kwargs)`` unless a gradient is
        non-finite; returns its result, or None when skipped."""
        return self._bound_method("step", optimizer)(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        """PyTorch: advance the state machine once per iteration, after every optimizer's `step`.

        Args:
            new_scale: Set the scale to this value instead (a float or one-element tensor).
        """
        if self._impl is None:
            if not self._enabled:
                return
            raise ScalerUsageError(
                "LossScaler.update() was called before the scaler saw any tensor; call "
                "scaler.scale(loss).backward() and scaler.step(optimizer) first in each iteration."
            )
        self._bound_method("update", None)(new_scale)

    def unscale(self, grads: Iterable[Any]) -> list[Any]:
        """TensorFlow: return the gradients divided by the scale (None entries stay None)."""
        grads = list(grads)
        return self._bound_method("unscale", grads)(grads)  # type: ignore[no-any-return]

    def apply_gradients(self, optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        """TensorFlow: unscale (unless done), check for non-finite gradients, apply or skip, update the scale.

        Usable eagerly and inside ``tf.function`` (also ``jit_compile=True``): the skip is decided in the
        graph, with no Python branch on a tensor value.
        """
        return self._bound_method("apply_gradients", optimizer)(optimizer, grads_and_vars)

    # -- what happened ------------------------------------------------------------------------------------

    def step_skipped(self, optimizer: Any = None) -> Any:
        """Whether the last step was skipped for non-finite gradients, without a host sync.

        Returns the framework's boolean scalar tensor (``bool(...)`` reads it to the host when you want):
        for ``optimizer``, whether its most recent step through this scaler was skipped; with no optimizer,
        whether any step of the last completed iteration was skipped. A disabled scaler never skips.

        Raises:
            ScalerUsageError: the scaler has not stepped ``optimizer`` (or anything) yet.
        """
        if self._impl is None:
            raise ScalerUsageError("step_skipped() was called before this LossScaler stepped any optimizer.")
        return self._bound_method("step_skipped", optimizer)(optimizer)

    def skipped_steps(self) -> Any:
        """How many iterations had a skipped step since this scaler was created, as a device integer tensor.

        Before the scaler is bound this is the Python int 0.
        """
        if self._impl is None:
            return 0
        return self._bound_method("skipped_steps", None)()

    # -- state -------------------------------------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Reading a device scale synchronises."""
        if not self._enabled:
            return 1.0
        if self._impl is not None:
            return float(self._impl.get_scale())
        return self._state.scale

    def _current_state(self) -> LossScaleState:
        return self._impl.get_state() if self._impl is not None else self._state

    def state_dict(self) -> dict[str, Any]:
        """The scaler's settings and state as a JSON-serialisable dict.

        Its keys include those of ``torch.amp.GradScaler.state_dict()``, so either can load the other's;
        a dict saved from one backend resumes on another with the same trajectory. Save it at the start of
        an iteration or after `update`.
        """
        return to_state_dict(self._config, self._current_state(), self._enabled)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore settings and state from `state_dict` output (polyamp's or torch's GradScaler's).

        Everything is validated first; on any error the scaler is unchanged.

        Raises:
            StateDictError: (a ``ValueError``) the dict is malformed, inconsistent, or from a disabled scaler.
        """
        config, state = parse_state_dict(state_dict, self._config)
        if self._impl is not None:
            self._impl.set_state(config, state)
        self._config = config
        self._state = state

    # -- torch.amp.GradScaler-compatible accessors -------------------------------------------------------

    def is_enabled(self) -> bool:
        """Same as `enabled` (torch's spelling)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        """The growth factor (torch's spelling)."""
        return self._config.growth_factor

    def get_backoff_factor(self) -> float:
        """The backoff factor (torch's spelling)."""
        return self._config.backoff_factor

    def get_growth_interval(self) -> int:
        """The growth interval (torch's spelling)."""
        return self._config.growth_interval

    # -- Python protocols --------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        between = getattr(self._impl, "between_iterations", None)
        if between is not None and not between():
            raise ScalerUsageError(
                "A LossScaler can be pickled or copied only between iterations (before the first step() or "
                "after update()): mid-iteration, the overflow checks already made would be lost."
            )
        return {
            "config": self._config,
            "enabled": self._enabled,
            "state": self._current_state(),
            "backend": self._backend_name,
        }

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self._config = saved["config"]
        self._enabled = saved["enabled"]
        self._state = saved["state"]
        self._impl = None
        self._backend_name = None
        if saved["backend"] is not None:
            self._bind(saved["backend"])

    def __repr__(self) -> str:
        config = self._config
        bounds = "".join(
            f", {name}={value!r}"
            for name, value in (("min_scale", config.min_scale), ("max_scale", config.max_scale))
            if value is not None
        )
        return (
            f"{type(self).__name__}(scale={self.get_scale()!r}, growth_factor={config.growth_factor!r}, "
            f"backoff_factor={config.backoff_factor!r}, growth_interval={config.growth_interval!r}, "
            f"hysteresis={config.hysteresis!r}{bounds}, dynamic={config.dynamic!r}, enabled={self._enabled!r}, "
            f"backend={self._backend_name!r})"
        )
