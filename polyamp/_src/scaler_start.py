"""Binding to a backend and starting an iteration: the device form and its capabilities, the enabled rule, the guard,
and the iteration rule a stateless step follows.

A part of `polyamp.LossScaler` (`polyamp._src.loss_scaler` joins them).
"""

from __future__ import annotations

import warnings
from functools import partial
from threading import get_ident
from typing import Any, cast

from polyamp._src import registry
from polyamp._src.backend import ImperativeDevice, ScalerDevice
from polyamp._src.binding import DeviceCapabilities, make_device
from polyamp._src.enabling import resolve_enabled
from polyamp._src.errors import (
    BackendMismatchError,
    PolyampTypeError,
    ScalerUsageError,
    describe,
)
from polyamp._src.global_policy import get_policy
from polyamp._src.iteration import Iteration, not_scaled_error
from polyamp._src.scaler_base import STYLE_METHODS, ScalerBase
from polyamp._src.scaler_imperative import masked_step

__all__ = ["StartPart"]


class StartPart(ScalerBase):
    """Binding to a backend and starting an iteration."""

    def bind(self, backend: str, device: ScalerDevice | None = None) -> ScalerDevice:
        """Bind to ``backend`` now (a no-op if already bound to it) and return the device form.

        Args:
            backend: The backend's registered name.
            device: A device form to bind instead of the one the backend makes: an adapter's, made from this
                scaler's `config` and `get_state` (e.g. `polyamp_keras.KerasDevice` over an optimizer's own
                variables). Its capabilities are read as for any device.

        Raises:
            BackendMismatchError: the scaler is bound to another backend.
            UnknownBackendError / BackendNotInstalledError: no such backend, or its framework is missing.
            PolyampTypeError: the backend's device form offers no loop style polyamp knows.
        """
        if self._device is not None:
            if backend == self._backend_name and (device is None or device is self._device):
                return self._device  # type: ignore[no-any-return]
            if backend == self._backend_name:
                raise BackendMismatchError(
                    f"This LossScaler is already bound to a {backend} device form; bind(device=...) is for an "
                    "unbound scaler."
                )
            raise BackendMismatchError(
                f"This LossScaler is bound to {self._backend_name}; it cannot bind to {backend!r} as well. "
                "Create one LossScaler per framework (their state dicts are interchangeable)."
            )
        given = device
        device, capabilities = make_device(
            backend,
            self._config,
            self._host_state,
            self._process_group,
            spike=self._spikes.rule is not None,
            device=device,
        )
        self._device, self._capabilities, self._backend_name = device, capabilities, backend
        self._adapter_device = given is not None
        self._compiling = capabilities.compiling
        self._replica = capabilities.replica
        if capabilities.replica is not None:
            self._only_iteration = None  # one iteration per replica: `_iteration` finds this replica's
        self._history.bind(device, capabilities, self._outcomes.optimizers)
        if capabilities.spike:
            self._spikes.bind(device)  # type: ignore[arg-type]  # a SpikeDevice
        if capabilities.style == "imperative":
            # The device's step, chosen once: with skip_on_device, its masked step where it has one.
            masked = capabilities.step_on_device if self._skip_on_device else None
            step = cast(ImperativeDevice, device).step
            self._device_step = step if masked is None else partial(masked_step, device, masked)
        return device

    @property
    def device_form(self) -> ScalerDevice | None:
        """The bound backend's device form (None before binding): where the scale and counters live."""
        return self._device  # type: ignore[no-any-return]

    def _device_for(self, method: str, obj: object) -> Any:
        device = self._device
        if device is not None:
            if self._adapter_device or type(obj) in self._own_types:
                return device
            # An adapter's device checks what it is given itself (Keras on torch computes with torch tensors).
            owner = registry.detect_backend(obj)
            if owner is not None and owner != self._backend_name:
                raise registry.wrong_object_error(str(self._backend_name), method, obj, "this framework's objects")
            # (Lists are looked into each time; and not while a compiler traces the call: torch.compile would
            # guard on the dict and compile anew.)
            remember = owner is not None and not isinstance(obj, (list, tuple)) and len(self._own_types) < 64
            if remember and not self._compiling():
                self._own_types[type(obj)] = True
            return device
        owner = registry.detect_backend(obj)
        if owner is None:
            names = ", ".join(repr(name) for name in registry.backend_specs())
            raise PolyampTypeError(
                f"LossScaler.{method}() cannot tell which framework {describe(obj)} belongs to. Pass a tensor "
                f"or optimizer of a framework polyamp has a backend for ({names}), or bind the scaler up front "
                "with LossScaler(backend=<one of those names>)."
            )
        return self.bind(owner)

    def _styled(self, method: str, style: str, obj: object) -> Any:
        device = self._device_for(method, obj)
        capabilities = self._capabilities
        if capabilities is None or capabilities.style != style:
            offered = STYLE_METHODS[str(self._style)]
            raise PolyampTypeError(
                f"LossScaler.{method}() is not part of the {self._backend_name} backend's training loop. "
                f"A {self._backend_name}-bound scaler offers: {', '.join(m + '()' for m in offered)}."
            )
        return device

    @property
    def _style(self) -> str | None:
        capabilities = self._capabilities
        return None if capabilities is None else capabilities.style

    @property
    def capabilities(self) -> DeviceCapabilities | None:
        """What the bound device form can do (None before binding), read once when the scaler bound."""
        return self._capabilities

    @property
    def _iteration(self) -> Iteration:
        """The iteration in progress: one per replica where the device runs the step once per replica (see
        ``ScalerDevice.replica``), else one (also `_only_iteration`)."""
        only = self._only_iteration
        if only is not None:
            return only
        replica = self._replica()
        iteration = self._iterations.get(replica)
        if iteration is None:
            iteration = self._iterations[replica] = Iteration()
        return iteration

    def _decide_enabled(self, *, starting: bool = False, loss: Any = None) -> bool:
        """Whether scaling is on now: the setting, else the policy's rule (`resolve_enabled`) given the device's
        float16 hint. ``starting``: an iteration starts (from ``loss``, when it starts in ``scale``), and the
        hint counts from here on."""
        if self._enabled_setting is not None:
            return self._enabled_setting
        hint = None if self._capabilities is None else self._capabilities.float16_in_use
        in_use = bool(hint(since_last_iteration=starting, loss=loss)) if hint is not None else False
        return resolve_enabled(None, float16_in_use=in_use, scales_under_float32=self._scales_under_float32)

    def _begin(self, loss: Any = None, iteration: Iteration | None = None) -> bool:
        """Whether this iteration scales, decided at its first call (``loss``: the loss it starts from, when it
        starts in ``scale``) and kept until it ends. ``iteration``: `_iteration`, when the caller has it."""
        if iteration is None:
            iteration = self._only_iteration or self._iteration
        enabled = iteration.enabled
        # A compiler tracing the step (torch.compile) cannot trace the thread lookup; it runs in one thread.
        thread = None if self._compiling() else get_ident()
        if enabled is None:
            enabled = self._enabled_setting
            if enabled is None:  # `_decide_enabled(starting=True, loss=loss)`, in place: every iteration asks it
                hint = None if self._capabilities is None else self._capabilities.float16_in_use
                in_use = bool(hint(since_last_iteration=True, loss=loss)) if hint is not None else False
                enabled = resolve_enabled(None, float16_in_use=in_use, scales_under_float32=self._scales_under_float32)
            iteration.enabled = enabled
            self._history.iteration_opened()
            self._outcomes.iteration_opened()
            iteration.guarding = not enabled and self._guards()
            iteration.thread = thread
        elif thread is not None and iteration.thread != thread:
            if iteration.thread is None:  # opened inside a compiled region
                iteration.thread = thread
                return enabled
            raise ScalerUsageError(
                "This LossScaler is in the middle of an iteration started by another thread. A scaler serves one "
                "training loop: its stages and checks belong to one thread at a time. Give each thread its own "
                "LossScaler (their state dicts are interchangeable), or finish the iteration (update()) first."
            )
        return enabled

    def _guards(self) -> bool:
        """Whether an iteration that does not scale checks the gradients (see ``guard``)."""
        guard = self._guard_setting
        if guard is None:
            guard = self._enabled_setting is None
        if not guard:
            return False
        supported = self._capabilities is not None and self._capabilities.guarding
        if not supported and self._guard_setting:
            raise PolyampTypeError(
                f"guard=True, but the {self._backend_name!r} backend's device form cannot check gradients without "
                "scaling (it has no check_gradients_finite/count_skip). Pass guard=None or False."
            )
        return supported

    @property
    def guarding(self) -> bool:
        """Whether this iteration (or one starting now) checks gradients without scaling."""
        if self._iteration.enabled is not None:
            return self._iteration.guarding
        return not self.enabled and self._device is not None and self._guards()

    def _require_scaled(self, method: str) -> None:
        """The iteration rule: an iteration that scales unscales only gradients of a loss scaled in it (a
        ``unscaled_loss_warning``, `polyamp.backend_api.OptionalMethods`, warns once instead)."""
        if self._iteration.scaled:
            return
        warning = None if self._capabilities is None else self._capabilities.unscaled_loss_warning
        if warning is None:
            raise not_scaled_error(f"LossScaler.{method}")
        if not self._warned_unscaled_loss:
            self._warned_unscaled_loss = True
            warnings.warn(warning(method), UserWarning, stacklevel=4)

    def scale(self, loss: Any) -> Any:
        """Multiply a loss (or a list/tuple of losses) by the current scale.

        A disabled scaler returns ``loss`` itself. Binds the scaler to the loss's framework on first use.
        New losses mean new, scaled gradients: a pending TensorFlow-style ``unscale`` stage ends here.

        Raises:
            BackendMismatchError: (a ``TypeError``) the loss belongs to another framework than the scaler.
        """
        device = self._device
        if device is None or not (self._adapter_device or type(loss) in self._own_types):  # (else `_device_for`'s)
            if device is None and registry.detect_backend(loss) is None and not self.enabled:
                return loss  # a disabled scaler passes anything through, as torch's does
            device = self._device_for("scale", loss)
        iteration = self._only_iteration or self._iteration
        enabled = self._begin(loss, iteration)
        if self._spikes.rule is not None and (enabled or iteration.guarding):
            self._spikes.observe_loss(loss)
        if not enabled:
            self._probe_float16(loss)
            return loss
        scaled = device.scale(loss)
        iteration.loss_scaled()
        return scaled

    def _probe_float16(self, loss: Any) -> None:
        """Warn once when a scaler that follows the policy does not scale a loss computed in float16 (the
        framework's own float16 autocast beside polyamp's float32 policy): its gradients would underflow.
        Asked of the device in the first eager iterations only, where it can tell (``float16_computed``); a
        traced call leaves the count alone, so compiled code is not specialised on it."""
        if self._float16_probes <= 0 or self._enabled_setting is not None or self._compiling():
            return
        self._float16_probes -= 1
        probe = None if self._capabilities is None else self._capabilities.float16_computed
        if probe is None:
            return
        if get_policy().compute_dtype != "float32" or not probe(loss):
            return
        self._float16_probes = 0
        warnings.warn(
            f"This LossScaler does not scale: enabled=None follows polyamp's policy, which is "
            f"{get_policy().name!r}, but the loss was computed in float16 (e.g. under the framework's own "
            "float16 autocast). Unscaled float16 gradients underflow to zero (and overflow to inf). Set the "
            "policy (polyamp.set_policy('mixed_float16'), with polyamp's autocast), or pass enabled=True "
            "(polyamp_torch.TorchLossScaler() scales by default, as torch.amp.GradScaler does).",
            UserWarning,
            stacklevel=3,
        )
