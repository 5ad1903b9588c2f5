"""`LossScaler`: the framework-neutral loss scaler users construct, bound to a backend on first use.

Everything around a step is decided here, once for every framework (see `polyamp._src.iteration` for the
stages): when scaling is enabled, which calls are misuse, when a step is skipped and what
``step_skipped`` / ``skipped_steps`` answer, what a state dict holds, when state may be loaded or pickled.
The bound backend's device form (`polyamp.backend_api.ImperativeDevice` or `TapeDevice`) only performs the
device operations: scale, check-and-unscale, apply-or-skip, the device update of the rule.

The parts around the loop live in modules of their own: binding and the device's capabilities
(`polyamp._src.binding`), each optimizer's outcome and the record history (`polyamp._src.step_history`),
the spike rule's iteration side (`polyamp._src.spike_driver`), the signature and pickles
(`polyamp._src.persistence`), the stages and misuse of one iteration (`polyamp._src.iteration`).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from threading import get_ident
from typing import TYPE_CHECKING, Any, ClassVar, Final

from polyamp._src import registry
from polyamp._src.backend import FunctionalBackend, ScalerDevice
from polyamp._src.binding import DeviceCapabilities, make_device
from polyamp._src.enabling import check_enabled, resolve_enabled
from polyamp._src.errors import (
    BackendMismatchError,
    InvalidConfigError,
    PolyampTypeError,
    ScalerUsageError,
    describe,
    type_error,
)
from polyamp._src.functional import FunctionalLossScaler, FunctionalMode
from polyamp._src.global_policy import get_policy
from polyamp._src.grad_scaler_api import GradScalerSpelling
from polyamp._src.iteration import Iteration, Stage, no_gradients_error, not_scaled_error
from polyamp._src.persistence import Pickled, derive_signature
from polyamp._src.records import (
    DEFAULT_HISTORY,
    Recorder,
    StepRecord,
    check_guard,
    check_history,
    check_on_min_scale,
)
from polyamp._src.run_summary import RunSummary
from polyamp._src.scaling import NOT_GIVEN, LossScaleConfig, LossScaleState, NotGiven, settings_doc, to_float32
from polyamp._src.spike_driver import SpikeDriver
from polyamp._src.spikes import SpikeRule, check_spike
from polyamp._src.state_dict import (
    is_disabled_torch_state,
    parse_skipped_steps,
    parse_spike_run,
    parse_spike_window,
    parse_state_dict,
    to_state_dict,
)
from polyamp._src.step_history import OutcomeRecord, RecordHistory, StepOutcomes

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from polyamp._src.scaling import LossScaleSettings

__all__ = ["LossScaler", "bind_arguments"]

#: The loop methods of each style, in the order error messages list them.
_STYLE_METHODS: Final = {
    "imperative": ("scale", "unscale_", "step", "update", "step_skipped", "skipped_steps"),
    "tape": ("scale", "unscale", "apply_gradients", "step", "update", "step_skipped", "skipped_steps"),
}


def bind_arguments(
    caller: str, positional_names: tuple[str, ...], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Name positional arguments as ``positional_names`` and merge them with the keywords, as Python would.

    Raises:
        PolyampTypeError: too many positional arguments, or one given both ways.
    """
    if len(args) > len(positional_names):
        raise PolyampTypeError(
            f"{caller} takes at most {len(positional_names)} positional arguments ({', '.join(positional_names)}); "
            f"received {len(args)}. Pass the other settings by keyword."
        )
    arguments = dict(zip(positional_names, args, strict=False))
    for key, value in kwargs.items():
        if key in arguments:
            raise PolyampTypeError(f"{caller} got two values for {key!r} (positional and keyword).")
        arguments[key] = value
    return arguments


def _check_norm_bound(name: str, value: object) -> None:
    """A clipping norm bound: a real number > 0 (``inf`` clips nothing), a NumPy scalar too."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise InvalidConfigError(f"`{name}` must be a number > 0. Received: {describe(value)}.")


def _not_compiling() -> bool:
    return False


#: How many iterations a scaler that follows the policy and does not scale asks its device whether the loss was
#: computed in float16 anyway (a one-time probe; see ``LossScaler._probe_float16``).
FLOAT16_PROBES: Final = 3


class LossScaler(GradScalerSpelling, Pickled):
    """Dynamic loss scaling for float16 training, one semantics for every framework.

        The scaler multiplies the loss by a scale before backpropagation so small float16 gradients do not
        flush to zero, divides the gradients by it before the optimizer step, skips steps whose gradients hold
        inf or NaN, and adapts the scale (see `LossScaleConfig` for the exact rule and a worked trace; with the
        defaults it reproduces ``torch.amp.GradScaler`` bit for bit).

        The scaler binds to a framework the first time it sees one of its tensors or optimizers (or at once with
        ``backend=`` or `bind`); from then on its scale, growth counter and hysteresis live on that framework's
        device, and its loop methods are that framework's: ``scale`` / ``unscale_`` / ``step`` / ``update``
        (PyTorch), ``scale`` / ``unscale`` / ``apply_gradients`` (TensorFlow; ``apply_gradients`` is ``step``
        then ``update``, and several optimizers in one iteration use ``step`` each, then one ``update``).

        Args:
            *positional: The first settings by position: init_scale, growth_factor, backoff_factor,
                growth_interval (``torch.amp.GradScaler``'s order).
            enabled: None (default) follows the policy in effect each iteration (see
                `polyamp.backend_api.arguments.resolve_enabled`): on under ``"mixed_float16"``, off under bfloat16 and
                float32 policies. True or False fixes it. A disabled scaler returns the loss itself from ``scale``, just
                steps, and reports scale 1.0.
            backend: "torch" or "tensorflow" (or a registered third-party name) to bind at once; None binds on
                first use from the type of what it is given.
            guard: Whether iterations that do not scale still check the gradients and skip a step whose
                gradients hold inf or NaN (reason ``"non_finite"``), bitwise unchanged otherwise. None (default):
                whenever the policy turns scaling off (``enabled=None`` under bfloat16 and float32 policies);
                True: also with ``enabled=False``; False: never (a plain step, as ``torch.amp.GradScaler``'s
                when disabled).
            on_min_scale: What happens when an overflow leaves the scale at its floor (``min_scale``, or 1.0):
                "warn" (default; logs a warning naming the likely causes, once per collapse), "raise"
                (`polyamp.ScaleCollapseError` when the records are read) or "ignore".
            history: How many iterations are recorded on the device between reads, and kept by `records`
                (default 256).
            spike: A `polyamp.SpikeRule` to also skip steps whose loss or gradient norm is an outlier (reason
                ``"loss_spike"`` / ``"grad_spike"``), decided on the device; None (default) skips only
                non-finite steps.
            process_group: None (default): each process decides its skips from its own gradients, which is
                right whenever every rank holds the same gradients (data parallelism such as DDP, whose
                backward already all-reduced them). A framework process group (``torch.distributed``'s)
                whose ranks hold *different* gradients (optimizer sharding, pipeline stages): the found-inf
                flag of every optimizer step is reduced over it (one max all-reduce, on the device), so all
                its ranks skip together. Binds the scaler to the group's framework at once.
            skip_on_device: False (default): a step that is not fused is taken or skipped on the host, which
                reads the found-inf flag once per step (as ``torch.amp.GradScaler`` does; on a GPU, a sync).
                True: where the device can (PyTorch: SGD, Adam and AdamW in their for-loop and foreach forms,
                SGD with momentum past its first step, every state tensor on the gradients' device, no step hooks,
                which run only on applied steps as with GradScaler), the step runs and a
                masked commit on the device keeps the old parameters and optimizer state where the flag is
                set, so no step reads the flag on the host; it costs a copy of the stepped parameters and
                their state per step. `step` then returns the optimizer's result either way, and the records
                say which steps were skipped. Fused optimizers skip on the device either way.
            **settings: The loss-scaling settings, each defined (with its range) by `LossScaleConfig`:
    {settings}

        Raises:
            InvalidConfigError: (a ``ValueError``) a setting is out of range.
            PolyampTypeError: (a ``TypeError``) a setting has the wrong type, or is not a setting.
            UnknownBackendError / BackendNotInstalledError: ``backend`` is unknown or its framework is missing.

        Backends offer subclasses bound from construction (``polyamp_torch.TorchLossScaler``,
        ``polyamp_tensorflow.TensorFlowLossScaler``).

        Example:
            ```python
            # PyTorch; a TensorFlow loop uses apply_gradients instead of step/update
            import polyamp, polyamp_torch

            polyamp.set_policy("mixed_float16")
            scaler = polyamp.LossScaler()          # scales while the policy computes in float16
            for x, y in loader:
                opt.zero_grad(set_to_none=True)
                with polyamp_torch.autocast():
                    loss = loss_fn(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            ```

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
    #: The names positional arguments take, in order.
    positional_arguments: ClassVar[tuple[str, ...]] = LossScaleConfig.setting_names()[:4]
    #: The value of ``enabled`` when it is not given.
    default_enabled: ClassVar[bool | None] = None
    #: Whether a scaler of this class that follows the policy (``enabled=None``) scales under a float32 policy,
    #: which names no mixed precision (`polyamp.backend_api.arguments.resolve_enabled`): False here (it scales then only
    #: where the backend reports float16 compute); True in a class standing for a framework's own class that
    #: always scales (the one Keras's ``LossScaleOptimizer`` runs).
    scales_under_float32: ClassVar[bool] = False

    def __init__(
        self,
        *positional: Any,
        enabled: bool | NotGiven | None = NOT_GIVEN,
        backend: str | None = None,
        guard: bool | None = None,
        on_min_scale: str = "warn",
        history: int = DEFAULT_HISTORY,
        spike: SpikeRule | None = None,
        process_group: Any = None,
        skip_on_device: bool = False,
        **settings: Unpack[LossScaleSettings],
    ) -> None:
        caller = f"{type(self).__name__}()"
        arguments = bind_arguments(caller, self.positional_arguments, positional, settings)
        if enabled is not NOT_GIVEN:
            if "enabled" in arguments:
                raise PolyampTypeError(f"{caller} got two values for 'enabled' (positional and keyword).")
            arguments["enabled"] = enabled
        self._take_options(arguments)
        enabled = check_enabled(arguments.pop("enabled", self.default_enabled))
        guard = check_guard(guard)
        spike = check_spike(spike)
        history = check_history(history)
        on_min_scale = check_on_min_scale(on_min_scale)
        if not isinstance(skip_on_device, bool):
            raise type_error("`skip_on_device`", "True or False", skip_on_device)
        config = LossScaleConfig.from_settings(arguments, caller=caller)
        if backend is not None and not isinstance(backend, str):
            raise type_error("`backend`", "None or a backend name such as 'torch' or 'tensorflow'", backend)
        bound = type(self).bound_backend
        if bound is not None:
            if backend not in (None, bound):
                raise PolyampTypeError(
                    f"{type(self).__name__} is bound to {bound}; it cannot take backend={backend!r}. "
                    "Use polyamp.LossScaler for another backend."
                )
            backend = bound
        if process_group is not None:
            owner = registry.detect_backend(process_group)
            if owner is None or backend not in (None, owner):
                raise PolyampTypeError(
                    f"{caller} takes process_group=None or a process group of its framework (for PyTorch, a "
                    f"torch.distributed.ProcessGroup such as dist.new_group(ranks)). Received: "
                    f"{describe(process_group)}" + (f" with backend={backend!r}." if owner is not None else ".")
                )
            backend = owner
        self._setup(
            config,
            config.initial_state(),
            process_group=process_group,
            enabled=enabled,
            guard=guard,
            spike=spike,
            on_min_scale=on_min_scale,
            history=history,
            skip_on_device=skip_on_device,
        )
        if backend is not None:
            self.bind(backend)

    def _setup(
        self,
        config: LossScaleConfig,
        state: LossScaleState,
        *,
        process_group: Any,
        enabled: bool | None,
        guard: bool | None,
        spike: SpikeRule | None,
        on_min_scale: str,
        history: int,
        skip_on_device: bool = False,
        spike_window: list[float] | None = None,
        spike_run: int = 0,
        skipped_steps: int = 0,
    ) -> None:
        """Every attribute of an unbound scaler, from validated options (the constructor's and a pickle's)."""
        self._process_group = process_group
        # Iterations skipped before the device's count began (a loaded state dict's or a pickle's count, less
        # the device's count then): `skipped_steps` adds it.
        self._skipped_before = skipped_steps
        self._config = config
        self._enabled_setting = enabled
        self._guard_setting = guard
        self._skip_on_device = skip_on_device
        self._spikes = SpikeDriver(spike, spike_window, spike_run)
        self._host_state = state
        recorder = Recorder(history, on_min_scale, spike.reason if spike else "loss_spike")
        recorder.reanchor(state)
        self._history = RecordHistory(recorder, config)
        self._outcomes = StepOutcomes()
        self._device: Any = None
        self._capabilities: DeviceCapabilities | None = None
        self._compiling: Any = _not_compiling
        self._replica: Any = None  # the device's replica hook (None: one iteration)
        # The types of objects seen to be the bound framework's: later calls with them skip the lookup.
        self._own_types: dict[type, bool] = {}
        self._float16_probes = FLOAT16_PROBES
        self._group_iterations = 0  # iterations ended or discarded, for the process group's reductions
        self._backend_name: str | None = None
        self._warned_unscaled_loss = False
        self._adapter_device = False
        # The single-replica iteration is made up front: a first call traced by a compiler (torch.compile)
        # then finds it instead of constructing it, which dynamo cannot trace (a graph break).
        self._iterations: dict[Any, Iteration] = {None: Iteration()}

    def _take_options(self, arguments: dict[str, Any]) -> None:
        """Subclasses pop (and keep) their backend's own constructor options from ``arguments`` here."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = derive_signature(cls, LossScaler.__init__)  # type: ignore[attr-defined]

    # -- binding -----------------------------------------------------------------------------------------

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
        self._history.bind(device, capabilities, self._outcomes.optimizers)
        if capabilities.spike:
            self._spikes.bind(device)  # type: ignore[arg-type]  # a SpikeDevice
        return device

    @property
    def device_form(self) -> ScalerDevice | None:
        """The bound backend's device form (None before binding): where the scale and counters live."""
        return self._device  # type: ignore[no-any-return]

    def _device_for(self, method: str, obj: object) -> Any:
        device = self._device
        if device is not None:
            if self._adapter_device or self._own_types.get(type(obj), False):
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
            offered = _STYLE_METHODS[str(self._style)]
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

    # -- enabled -----------------------------------------------------------------------------------------

    @property
    def _iteration(self) -> Iteration:
        """The iteration in progress: one per replica where the device runs the step once per replica (see
        ``ScalerDevice.replica``), else one."""
        hook = self._replica
        if hook is None:
            return self._iterations[None]
        replica = hook()
        iteration = self._iterations.get(replica)
        if iteration is None:
            iteration = self._iterations[replica] = Iteration()
        return iteration

    def _decide_enabled(self, *, starting: bool = False, loss: Any = None) -> bool:
        if self._enabled_setting is not None:
            return self._enabled_setting
        hint = None if self._capabilities is None else self._capabilities.float16_in_use
        in_use = bool(hint(since_last_iteration=starting, loss=loss)) if hint is not None else False
        return resolve_enabled(None, float16_in_use=in_use, scales_under_float32=self.scales_under_float32)

    def _begin(self, loss: Any = None, iteration: Iteration | None = None) -> bool:
        """Whether this iteration scales, decided at its first call (``loss``: the loss it starts from, when it
        starts in ``scale``) and kept until it ends. ``iteration``: `_iteration`, when the caller has it."""
        if iteration is None:
            iteration = self._iteration
        enabled = iteration.enabled
        # A compiler tracing the step (torch.compile) cannot trace the thread lookup; it runs in one thread.
        thread = None if self._compiling() else get_ident()
        if enabled is None:
            iteration.enabled = enabled = self._decide_enabled(starting=True, loss=loss)
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

    def functional_iteration(self, grads: Sequence[Any], method: str) -> tuple[FunctionalMode, bool]:
        """One iteration whose device work is the functional form's (`FunctionalLossScaler` over state an
        adapter holds, e.g. a jitted stateless step): the host-side decisions, made as `apply_gradients` makes
        them, and the iteration ended.

        Decides whether the iteration scales (or guards, or is off), applies the iteration rule and takes a
        pending `unscale` stage of ``grads``; the caller runs the functional form in that mode, whose
        ``update`` writes the iteration's record into the same ring this scaler's `records` reads.

        Args:
            grads: The gradients the step receives (to match a pending `unscale` stage).
            method: The caller's name, for errors.

        Returns:
            The mode (``"scaling"``, ``"guarding"`` or ``"off"``) and whether ``grads`` are unscaled already.

        Raises:
            ScalerUsageError: as `apply_gradients` (a loss not scaled in this iteration, gradients that went
                into `unscale`).
        """
        enabled = self._begin()
        iteration = self._iteration
        unscaled = False
        mode: FunctionalMode
        if enabled:
            self._require_scaled(method)
            stage = iteration.stages.check(grads, method)
            if stage is not None:
                iteration.stages.consume(stage)
                unscaled = True
            mode = "scaling"
        else:
            mode = "guarding" if iteration.guarding else "off"
        iteration.close()
        self._history.written_elsewhere()
        return mode, unscaled

    @property
    def enabled(self) -> bool:
        """Whether this scaler scales: in this iteration once it started, else if it started now."""
        decided = self._iteration.enabled
        return self._decide_enabled() if decided is None else decided

    @property
    def enabled_setting(self) -> bool | None:
        """The ``enabled`` argument: True, False, or None (follow the policy)."""
        return self._enabled_setting

    @property
    def backend(self) -> str | None:
        """The name of the bound backend, or None before first use."""
        return self._backend_name

    @property
    def process_group(self) -> Any:
        """The process group the found-inf flags are reduced over, or None (no reduction)."""
        return self._process_group

    @property
    def dynamic(self) -> bool:
        """Whether the scale adapts (False: fixed at ``init_scale``)."""
        return self._config.dynamic

    @property
    def spike(self) -> SpikeRule | None:
        """The `polyamp.SpikeRule` given as ``spike``, or None."""
        return self._spikes.rule

    @property
    def options(self) -> dict[str, Any]:
        """The constructor options besides the settings (``enabled``, ``guard``, ``spike``, ``on_min_scale``,
        ``history``) as given: with `config`'s settings, what makes an equal scaler (an adapter's
        ``get_config``)."""
        return self._options()

    @property
    def history(self) -> int:
        """How many iterations are recorded on the device between reads, and kept by `records`."""
        return self._history.recorder.capacity

    @property
    def config(self) -> LossScaleConfig:
        """The validated settings, which also run the reference state machine."""
        return self._config

    # -- the training loop -------------------------------------------------------------------------------

    def scale(self, loss: Any) -> Any:
        """Multiply a loss (or a list/tuple of losses) by the current scale.

        A disabled scaler returns ``loss`` itself. Binds the scaler to the loss's framework on first use.
        New losses mean new, scaled gradients: a pending TensorFlow-style ``unscale`` stage ends here.

        Raises:
            BackendMismatchError: (a ``TypeError``) the loss belongs to another framework than the scaler.
        """
        if self._device is None and registry.detect_backend(loss) is None and not self.enabled:
            return loss  # a disabled scaler passes anything through, as torch's does
        device = self._device_for("scale", loss)
        iteration = self._iteration
        enabled = self._begin(loss, iteration)
        if self._spikes.rule is not None and (enabled or iteration.guarding):
            self._spikes.observe_loss(loss)
        if not enabled:
            self._probe_float16(loss)
            return loss
        iteration.stages.clear()
        scaled = device.scale(loss)
        iteration.scaled = True
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

    def unscale_(self, optimizer: Any) -> None:
        """PyTorch: divide the optimizer's gradients by the scale in place and check them for inf/NaN.

        Optional, for inspecting or clipping gradients before `step`. At most once per optimizer per
        `update`.

        Raises:
            ScalerUsageError: a second call for this optimizer in the iteration, or a call after its step.
        """
        device = self._styled("unscale_", "imperative", optimizer)
        device.check_optimizer("unscale_", optimizer)
        if not self._begin():
            return
        self._require_scaled("unscale_()")
        self._iteration.check_unscale(optimizer, "unscale_()")
        self._iteration.mark(optimizer, Stage.UNSCALED, device.unscale_gradients(optimizer))

    def unscale_and_clip_(self, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> tuple[bool, Any]:
        """PyTorch: `unscale_` with gradient-norm clipping folded in, where the device can fold it.

        Returns ``(folded, total_norm)``: ``(True, norm)`` when the gradients were unscaled and clipped in one
        pass (``norm``: the total norm of the unscaled gradients, as ``torch.nn.utils.clip_grad_norm_`` returns
        it); ``(False, None)`` when they were only unscaled (the device cannot fold this case, or the scaler is
        not scaling) and the caller clips. Same rules as `unscale_`.
        """
        device = self._styled("unscale_", "imperative", optimizer)
        device.check_optimizer("unscale_", optimizer)
        _check_norm_bound("max_norm", max_norm)
        if not self._begin():
            return False, None
        self._require_scaled("unscale_()")
        self._iteration.check_unscale(optimizer, "unscale_()")
        fold = None if self._capabilities is None else self._capabilities.unscale_and_clip
        folded = None if fold is None else fold(optimizer, float(max_norm), float(norm_type))
        if folded is None:
            self._iteration.mark(optimizer, Stage.UNSCALED, device.unscale_gradients(optimizer))
            return False, None
        flag, total_norm = folded
        self._iteration.mark(optimizer, Stage.UNSCALED, flag)
        return True, total_norm

    def unscale(self, grads: Iterable[Any]) -> list[Any]:
        """TensorFlow: return the gradients divided by the scale (None entries stay None).

        The next `apply_gradients` (or `step`) takes its gradients as unscaled: these, or tensors made from
        them (clipped). Passing the scaled originals instead raises `ScalerUsageError`.
        """
        grads = list(grads)
        device = self._styled("unscale", "tape", grads)
        device.check_gradients("unscale", grads)
        if not self._begin():
            return grads
        self._require_scaled("unscale()")
        unscaled = device.unscale(grads)
        self._iteration.stages.record(grads, unscaled, method="unscale()")
        return unscaled  # type: ignore[no-any-return]

    def unscale_and_clip(self, grads: Iterable[Any], clip_norm: float) -> tuple[list[Any], Any]:
        """TensorFlow: `unscale` and ``tf.clip_by_global_norm(..., clip_norm)`` in one multiply of the gradients.

        Returns ``(clipped, global_norm)`` as ``tf.clip_by_global_norm`` does: the unscaled gradients clipped to
        a global norm of ``clip_norm`` (None entries stay None) and their global norm before clipping. The next
        `apply_gradients` (or `step`) takes them as unscaled, as after `unscale`. For a power-of-two scale the
        values are bit for bit those of the two steps. When the scaler is not scaling, this is the clipping alone.
        """
        grads = list(grads)
        device = self._styled("unscale", "tape", grads)
        device.check_gradients("unscale_and_clip", grads)
        _check_norm_bound("clip_norm", clip_norm)
        fold = None if self._capabilities is None else self._capabilities.unscale_and_clip_values
        if fold is None:
            raise PolyampTypeError(
                f"The {self._backend_name!r} backend's scaler cannot clip gradients in the unscale; call unscale() "
                "and clip the gradients it returns."
            )
        if not self._begin():
            return fold(grads, float(clip_norm), scaled=False)  # type: ignore[no-any-return]
        self._require_scaled("unscale_and_clip()")
        clipped, norm = fold(grads, float(clip_norm), scaled=True)
        self._iteration.stages.record(grads, clipped, method="unscale_and_clip()")
        return clipped, norm

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless one of its gradients is inf or NaN.

        PyTorch: ``step(optimizer, *args, **kwargs)`` unscales (unless `unscale_` did), then calls
        ``optimizer.step(*args, **kwargs)`` unless a gradient is non-finite; returns its result, or None when
        skipped. TensorFlow: ``step(optimizer, grads_and_vars)`` applies or skips in the graph. Either way,
        each optimizer steps once per iteration; `update` ends the iteration.

        Raises:
            ScalerUsageError: the optimizer already stepped in this iteration, has no gradients, or a closure
                was passed while scaling.
        """
        if self._device is None:  # the optimizer's backend decides the loop style
            owner = registry.detect_backend(optimizer)
            if owner is not None:
                self.bind(owner)
        capabilities = self._capabilities
        if capabilities is not None and capabilities.style == "tape":
            if kwargs.keys() - {"grads_and_vars"} or len(args) + len(kwargs) != 1:
                raise PolyampTypeError(
                    "A TensorFlow-style step takes (optimizer, grads_and_vars). Received "
                    f"{len(args)} positional and {sorted(kwargs)} keyword arguments after the optimizer."
                )
            pairs = args[0] if args else kwargs["grads_and_vars"]
            device = self._styled("step", "tape", optimizer)
            return self._apply(device, optimizer, pairs, "step()")
        device = self._styled("step", "imperative", optimizer)
        device.check_optimizer("step", optimizer)
        iteration = self._iteration
        enabled = self._begin(None, iteration)
        stage = iteration.check_step(optimizer, "step()")
        if not enabled:
            closure = "closure" in kwargs or (args and callable(args[0]))
            checked = device.check_gradients_finite(optimizer) if iteration.guarding and not closure else None
            if checked is None:  # not guarding, no gradients, or a closure that recomputes them in the step
                result = device.plain_step(optimizer, args, kwargs)
                iteration.mark(optimizer, Stage.STEPPED, None)
                self._remember(optimizer, device.finite_flag(), False)
                return result
            skip = self._spike_decision(device, optimizer, checked)
            outcome = self._device_step(device, optimizer, skip, args, kwargs)
            iteration.mark(optimizer, Stage.STEPPED, checked)
            self._remember(optimizer, skip, outcome.skipped)
            return outcome.result
        if not iteration.scaled:
            self._require_scaled("step()")
        if "closure" in kwargs or (args and callable(args[0])):
            raise ScalerUsageError(
                "step() with a closure is not supported while loss scaling is enabled: the closure would "
                "recompute gradients that are scaled but never unscaled. Compute the loss and gradients before "
                "step(), or use a bfloat16 policy without loss scaling."
            )
        own_scaling = self._capabilities.step_own_scaling if self._capabilities is not None else None
        if own_scaling is not None:
            result = own_scaling(optimizer, self, args, kwargs)
            if result is not NotImplemented:
                # The optimizer scaled by itself (through this scaler's public methods); record what it checked.
                checked = iteration.found_inf_of(optimizer)
                iteration.mark(optimizer, Stage.STEPPED, checked)
                self._remember(optimizer, device.finite_flag() if checked is None else checked, None)
                return result
        found_inf = None
        if stage is Stage.UNSCALED:
            found_inf = iteration.found_inf_of(optimizer)
            if found_inf is None:
                raise no_gradients_error()
        elif self._spikes.rule is not None or not device.unscales_in_step(optimizer):
            # (A spike rule decides before the step, on unscaled gradients: a fused optimizer then gets them
            # unscaled, with the combined flag.)
            found_inf = device.unscale_gradients(optimizer)
            if found_inf is None:
                raise no_gradients_error()
            iteration.mark(optimizer, Stage.UNSCALED, found_inf)  # the gradients are unscaled now, whatever follows
        if self._spikes.rule is None:
            outcome = self._device_step(device, optimizer, found_inf, args, kwargs)
            iteration.mark(optimizer, Stage.STEPPED, outcome.found_inf)
            self._remember(optimizer, outcome.found_inf, outcome.skipped)
            return outcome.result
        skip = self._spike_decision(device, optimizer, found_inf)
        outcome = self._device_step(device, optimizer, skip, args, kwargs)
        iteration.mark(optimizer, Stage.STEPPED, found_inf)  # the scale rule sees overflows only
        self._remember(optimizer, skip, outcome.skipped)
        return outcome.result

    def _device_step(self, device: Any, optimizer: Any, flag: Any, args: Any, kwargs: Any) -> Any:
        """The device's step, or with ``skip_on_device`` its masked step where it has one and can take it."""
        if self._skip_on_device and flag is not None and self._capabilities is not None:
            masked = self._capabilities.step_on_device
            outcome = None if masked is None else masked(optimizer, flag, args, kwargs)
            if outcome is not None:
                return outcome
        return device.step(optimizer, flag, args, kwargs)

    def _spike_decision(self, device: Any, optimizer: Any, found_inf: Any) -> Any:
        """``found_inf`` combined with the spike rule's flag (imperative devices)."""
        self._spikes.decide(lambda: device.spike_grad_norm(optimizer))
        return self._with_spike(device, found_inf)

    def apply_gradients(self, optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        """TensorFlow: `step` then `update` in one call: unscale (unless done), check, apply or skip, update.

        Usable eagerly and inside ``tf.function`` (also ``jit_compile=True``): the skip is decided in the
        graph, with no Python branch on a tensor value. Returns what the optimizer's apply returns.
        """
        device = self._styled("apply_gradients", "tape", optimizer)
        result = self._apply(device, optimizer, grads_and_vars, "apply_gradients()", ends=True)
        self._finish(device, None, "apply_gradients()")
        return result

    def _apply(
        self, device: Any, optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]], method: str, *, ends: bool = False
    ) -> Any:
        """Check, unscale, apply or skip. ``ends``: `_finish` ends the iteration right after, with no
        ``new_scale`` (``apply_gradients``)."""
        device.check_optimizer(method.removesuffix("()"), optimizer)
        pairs = [tuple(pair) for pair in grads_and_vars]
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        device.check_gradients(method.removesuffix("()"), grads)
        enabled = self._begin()
        iteration = self._iteration
        iteration.check_step(optimizer, method)
        if not enabled:
            if not iteration.guarding:
                result = device.plain_apply(optimizer, grads, variables)
                iteration.mark(optimizer, Stage.STEPPED, None)
                self._remember(optimizer, device.finite_flag(), False)
                return result
            veto = self._spikes.decide(lambda: device.spike_grad_norm(grads, unscaled=True))
            outcome = device.apply(optimizer, grads, variables, unscaled=True, veto=veto)  # check, apply or skip
            iteration.mark(optimizer, Stage.STEPPED, outcome.found_inf)
            self._remember(optimizer, self._with_spike(device, outcome.found_inf), outcome.skipped)
            return outcome.result
        self._require_scaled(method)
        stage = iteration.stages.check(grads, method)
        veto = self._spikes.decide(lambda: device.spike_grad_norm(grads, unscaled=stage is not None))
        outcome = None
        fused = None if self._capabilities is None else self._capabilities.apply_and_advance
        if fused is not None and ends and veto is None and not iteration.flagged and self._ends_plainly(None):
            # The iteration is this step alone and ends in `_finish`'s few steps: the rule advances on this
            # step's flag there, so the device may advance it in the branch that applies or skips.
            outcome = fused(optimizer, grads, variables, unscaled=stage is not None)
            iteration.advanced = outcome is not None and outcome.found_inf is not None
        if outcome is None:
            outcome = device.apply(optimizer, grads, variables, unscaled=stage is not None, veto=veto)
        if stage is not None:
            iteration.stages.consume(stage)
        iteration.mark(optimizer, Stage.STEPPED, outcome.found_inf)  # overflows only: the rule's input
        self._remember(optimizer, self._with_spike(device, outcome.found_inf), outcome.skipped)
        return outcome.result

    def _with_spike(self, device: Any, found_inf: Any) -> Any:
        flag = self._spikes.flag
        return found_inf if flag is None else device.combine([found_inf, flag])

    def update(self, new_scale: Any = None) -> None:
        """End the iteration: advance the loss-scale rule once, after every optimizer's `step`.

        Args:
            new_scale: Set the scale to this value instead (a positive float within ``[min_scale,
                max_scale]``, or the framework's one-element tensor). Allowed at any point, also
                between iterations, as with ``torch.amp.GradScaler``.

        Raises:
            ScalerUsageError: nothing was stepped or unscaled in this iteration (and no ``new_scale``).
        """
        if self._device is None:
            if new_scale is not None:
                value, _ = self._checked_new_scale(new_scale)
                if not isinstance(value, float):
                    raise ScalerUsageError(
                        "update(new_scale=<tensor>) was called before the scaler saw any tensor; pass a float."
                    )
                self._host_state = LossScaleState(
                    value, self._host_state.growth_tracker, self._host_state.hysteresis_left
                )
                return
            if not self.enabled:
                self._iteration.close()
                return
            raise ScalerUsageError(
                "LossScaler.update() was called before the scaler saw any tensor; call "
                "scaler.scale(loss).backward() and scaler.step(optimizer) first in each iteration."
            )
        uncompiled = self._capabilities.run_uncompiled if self._capabilities is not None else None
        if uncompiled is not None:
            # Traced, the iteration's host bookkeeping (records, provenance, counters) would specialise the
            # compiled code on values that change every iteration; run outside the trace, it is exact. Always,
            # not only while tracing: torch.compile can run this frame untraced yet compile each function it
            # calls as a frame of its own (seen with mode="reduce-overhead" on CUDA), each specialised anew on
            # every iteration's records, and its CUDA graphs would own the state made there.
            uncompiled(self._finish, self._device, new_scale, "update()")
            return
        self._finish(self._device, new_scale, "update()")

    def _finish(self, device: Any, new_scale: Any, method: str) -> None:
        """End the iteration, holding the history's lock: a reader in another thread (`records`, `get_state`)
        sees the device state and the records at one iteration. torch.compile never traces this (`update` runs
        it uncompiled: dynamo cannot trace a lock); ``tf.function`` takes the lock only while tracing.

        Training's steady state ends here in few steps: an iteration opened by this thread (not in a compiled
        region) in which some optimizer has a flag and that `_ends_plainly`. Its end is what `_end_iteration`
        makes of the same iteration: the rule advanced on the iteration's flag (`_iteration_flag`; already, when
        the device advanced it with an ``apply_gradients`` step), that flag as the last outcome, the iteration
        closed and recorded as a "scaling" iteration, skipped as its flag says. (Between a step's kernels, each
        call the host makes costs several times its price in a tight loop.) `_end_iteration` ends every other
        iteration."""
        with self._history.lock:
            iteration = self._iteration
            flagged = iteration.flagged
            if flagged and iteration.thread == get_ident() and self._ends_plainly(new_scale):
                clean, flag = self._iteration_flag(device, iteration)
                if not iteration.advanced:  # (else the device advanced the rule with the step)
                    device.update(flag, None)
                self._outcomes.write_last(device, flag, None)
                iteration.close()
                history = self._history
                history.write("scaling", None if clean else flag, history.host_skip)
                return
            self._end_iteration(device, new_scale, method)

    def _ends_plainly(self, new_scale: Any) -> bool:
        """Whether the current iteration, once some optimizer has a flag, ends by advancing the rule on that
        flag and recording it, nothing more: it scales, and there is no ``new_scale``, spike rule or process
        group. (`_finish` takes its few steps for it when this thread opened it, out of a compiled region.)"""
        return bool(
            new_scale is None and self._iteration.enabled and self._spikes.rule is None and self._process_group is None
        )

    def _end_iteration(self, device: Any, new_scale: Any, method: str) -> None:
        iteration = self._iteration
        history = self._history
        if not self._begin(None, iteration) and new_scale is None:
            if iteration.guarding and iteration.flagged:
                clean, combined = self._iteration_flag(device, iteration)
                if not clean:
                    device.count_skip(combined)
                spike_only = self._finish_spike(device, combined)
                self._outcomes.write_last(
                    device, self._with_flag(device, combined, spike_only), False if clean else None
                )
                history.write("guarding", None if clean else combined, history.host_skip, spike_only)
            else:
                self._outcomes.write_last(device, device.finite_flag(), False)
                history.write("off", None, False)
            iteration.close()
            self._count_group_iteration()
            return
        # the value for the device, and the scale as a float when the host knows it (a tensor read eagerly)
        value, known = (None, None) if new_scale is None else self._checked_new_scale(new_scale)
        if value is None and not iteration.flagged:
            iteration.check_update(method)
            raise ScalerUsageError(
                f"{method} was called but none of the optimizers unscaled in this iteration had gradients, "
                "so there is nothing to base the update on. Call scaler.scale(loss).backward() first."
            )
        clean, combined = self._iteration_flag(device, iteration)
        skipped_on_host = history.host_skip
        if not iteration.advanced:  # (else the device advanced the rule with the step)
            device.update(combined, value)
        spike_only = None if self._spikes.rule is None else self._finish_spike(device, combined)
        if combined is not None:
            self._outcomes.write_last(device, self._with_flag(device, combined, spike_only), None)
        iteration.close()
        if self._process_group is not None:
            self._count_group_iteration()
        if value is not None:
            if combined is not None:  # the iteration counts as skipped or not, but the rule did not run
                history.write("set", combined, False, spike_only, set_scale=known)
            history.reanchor_after_set(value)
        elif combined is not None:
            history.write("scaling", None if clean else combined, skipped_on_host, spike_only)

    def _iteration_flag(self, device: Any, iteration: Iteration) -> tuple[bool, Any]:
        """Whether the host knows the iteration was finite, and the flag standing for the iteration (None
        when no step has a flag). Known finite (`_known_finite`): the flag is the device's finite flag (nothing
        to combine, the device may leave out what only an overflow needs, and the record needs no flag read back
        later); else the steps' flags combined."""
        flagged = iteration.flagged
        if not flagged:
            return False, None
        if self._known_finite(flagged):
            return True, device.finite_flag()
        return False, device.combine(iteration.found_infs())

    def _known_finite(self, flags: int) -> bool:
        """Whether the host knows the iteration was finite, given how many of its optimizers have a flag: some
        have, each step read its flag as "not skipped" to the host, and no spike rule decided on the device."""
        return flags > 0 and self._history.host_clean == flags and self._spikes.flag is None

    def _finish_spike(self, device: Any, overflow: Any) -> Any:
        """End the iteration for the spike rule: its statistic enters the window if the step was applied, a
        skip by the rule alone is counted; returns that skip's flag (None without a decision)."""
        only = self._spikes.finish(overflow)
        if only is not None:
            device.count_skip(only)
        return only

    @staticmethod
    def _with_flag(device: Any, flag: Any, spike_only: Any) -> Any:
        return flag if spike_only is None else device.combine([flag, spike_only])

    # -- records -----------------------------------------------------------------------------------------

    def records(self) -> list[StepRecord]:
        """The most recent iterations' records (at most ``history``), oldest first: skipped or not, why, and
        the scale, as `polyamp.StepRecord`.

        Reads the iterations recorded on the device since the last call in one host read, logs the skipped
        ones through ``logging.getLogger("polyamp")`` (``"non_finite"`` at WARNING, ``"overflow"``, which is
        dynamic scaling at work, at INFO) and applies ``on_min_scale``. The scaler also reads them by itself
        every ``history // 2`` iterations and right after a step it already knows was skipped, so nothing is
        lost between calls. Inside a compiled function (``tf.function``, ``torch.compile``) nothing is read.

        Raises:
            ScaleCollapseError: with ``on_min_scale="raise"``, a record shows the scale reaching its floor.
        """
        return self._history.read()

    def last_record(self) -> StepRecord | None:
        """The record of the last iteration this scaler ended (see `records`), or None before the first."""
        records = self.records()
        return records[-1] if records else None

    def restored_on_device(self) -> None:
        """Say that the bound device's variables were restored by the framework itself (an optimizer's
        weights loaded from a Keras file): the records go on from the restored ring, replayed from the
        restored state. Read `records` before restoring: those records belong to the state replaced.

        Raises:
            ScalerUsageError: the scaler is not bound.
        """
        if self._device is None:
            raise ScalerUsageError("restored_on_device() needs a bound scaler: nothing was restored on a device.")
        self._skipped_before = 0  # the restored variables hold the run's skip count
        self._history.restart(self._device.read_state())

    def discard_iteration(self) -> None:
        """Forget the current iteration without updating the scale: its stages, checks and pending unscaled
        gradients, as if it never started.

        For recovering after an exception in the middle of a training step (the next iteration starts
        clean); the scale, counters and skip records stay as they were.

        With a ``process_group``, every rank reduces its found-inf flags with the others at each ``unscale_``
        and ``step``, so a rank may discard an iteration alone only after those reductions; otherwise call it on
        every rank for the same iteration. A rank that discards alone before its reductions would pair its next
        iteration's reductions with the others' current ones: each reduction carries the rank's iteration
        count, so this is detected on the device, the affected steps are skipped on every rank, and the next
        read of the records (`records`, or the scaler's own reads) raises `ScalerUsageError` naming the cause.
        """
        self._iteration.close()
        self._history.reset_iteration()
        self._spikes.reset()
        self._count_group_iteration()

    def _count_group_iteration(self) -> None:
        """Tell a device that reduces flags over a process group that this rank's iteration ended."""
        if self._process_group is not None and self._device is not None:
            self._group_iterations += 1
            self._device.set_group_iteration(self._group_iterations)

    def _checked_new_scale(self, new_scale: Any) -> tuple[Any, float | None]:
        """``update(new_scale)``'s argument validated: (what the device sets, its value when the host knows it)."""
        if isinstance(new_scale, bool) or not isinstance(new_scale, numbers.Real):
            if registry.detect_backend(new_scale) != self._backend_name or self._backend_name is None:
                raise type_error("update(new_scale)", "a float or a one-element tensor", new_scale)
            # A framework tensor: the device checks its shape and dtype and reads it (one host sync), and its
            # value is checked like a float's; a symbolic tensor in a compiled function is taken as is.
            number = self._device.read_new_scale(new_scale)
            known = None if number is None else self._checked_new_scale(number)[1]
            return new_scale, known
        try:
            value = to_float32(float(new_scale))
        except OverflowError:
            value = math.inf
        config = self._config
        if not (math.isfinite(value) and value > 0):
            raise InvalidConfigError(f"update(new_scale) needs a finite positive scale. Received: {new_scale!r}.")
        if value < config.floor_f32 or (config.max_scale_f32 is not None and value > config.max_scale_f32):
            raise InvalidConfigError(
                f"update(new_scale={new_scale!r}) is outside [min_scale, max_scale] = "
                f"[{config.floor_f32!r}, {config.max_scale!r}] (without a min_scale, the floor is 1.0)."
            )
        return value, value

    # -- what happened ------------------------------------------------------------------------------------

    def _remember(self, optimizer: Any, found_inf: Any, skipped: bool | None) -> None:
        self._outcomes.write(self._device, optimizer, found_inf, skipped)
        self._history.note_step(optimizer, skipped)

    def _record_of(self, optimizer: Any) -> OutcomeRecord | None:
        return self._outcomes.of(optimizer) if self._device is not None else None

    def is_unscaled(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s gradients hold their true (unscaled) values now: True after `unscale_` in
        this iteration, and whenever the scaler does not scale this iteration; False while they are still
        scaled. Clipping, or reading gradient norms, belongs after the point where this is True."""
        if not self.enabled:
            return True
        return self._iteration.stage(optimizer) is Stage.UNSCALED

    def step_skipped(self, optimizer: Any = None) -> Any:
        """Whether a step was skipped for non-finite gradients, without a host sync.

        Returns the framework's boolean scalar tensor (``bool(...)`` reads it to the host when you want):
        with ``optimizer``, whether that optimizer's most recent step through this scaler was skipped; with
        no optimizer, whether the last completed iteration skipped a step. Steps taken while scaling was
        disabled count as not skipped.

        Raises:
            ScalerUsageError: the scaler has not stepped ``optimizer`` (or finished an iteration) yet.
        """
        if optimizer is None:
            last = self._outcomes.last
            if last is None:
                raise ScalerUsageError(
                    "step_skipped() was called before this LossScaler stepped any optimizer: it answers for the "
                    "last iteration, once update() (or apply_gradients()) has ended one."
                )
            return self._device.skipped(self._device.read_record(last.storage))
        if self._device is not None:
            self._device.check_optimizer("step_skipped", optimizer)
        record = self._record_of(optimizer)
        if record is None:
            raise ScalerUsageError(
                f"step_skipped(optimizer): {describe(optimizer)} has not been stepped by this scaler."
            )
        return self._device.skipped(self._device.read_record(record.storage))

    def was_skipped(self, optimizer: Any) -> bool | None:
        """The host answer to ``step_skipped(optimizer)``, or None if this scaler never stepped it.

        Reads the device only when the step did not already (fused optimizers skip on the device).
        """
        record = self._record_of(optimizer)
        if record is None:
            return None
        if record.host is None:
            record.host = self._device.read_flag(self._device.read_record(record.storage))
        return record.host

    def skipped_steps(self) -> Any:
        """How many iterations had a skipped step since this scaler was created, as a device integer tensor: the
        count as of this call (no host read; a tensor returned earlier does not follow later iterations). Safe
        from any thread: read between two updates.

        The count goes on from a loaded state dict's (`load_state_dict`) or a pickle's. Before the scaler is bound
        this is a Python int (0 for a new scaler).
        """
        if self._device is None:
            return self._skipped_before
        count = self._between_updates(self._device.skipped_steps)
        return count + self._skipped_before if self._skipped_before else count

    def _between_updates(self, read: Callable[[], Any]) -> Any:
        """``read()`` under the records' lock, which `update` holds while it ends an iteration: a reader in
        another thread never sees the device state halfway through one. (A compiler cannot trace the lock; a
        traced function runs in one thread, so it reads without it.)"""
        if self._compiling():
            return read()
        with self._history.lock:
            return read()

    # -- state -------------------------------------------------------------------------------------------

    def get_state(self) -> LossScaleState:
        """The scale and counters (reading a device state synchronises). Safe from another thread: the
        state is read between two updates, never halfway through one."""
        if self._device is None:
            return self._host_state
        return self._between_updates(self._device.read_state)  # type: ignore[no-any-return]

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Reading a device scale synchronises."""
        if not self.enabled:
            return 1.0
        return float(self.get_state().scale)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's settings and state as a JSON-serialisable dict.

        Its keys include those of ``torch.amp.GradScaler.state_dict()``, so either can load the other's;
        a dict saved from one backend resumes on another with the same trajectory. It also holds the count of
        skipped iterations (``skipped_steps``), so that a resumed run's `skipped_steps` counts on (GradScaler
        reads its own keys only). Save it at the start of an iteration or after `update`.
        """
        spikes = self._spikes
        return to_state_dict(
            self._config,
            self.get_state(),
            self._enabled_setting,
            spikes.read_window(),
            spikes.read_run(),
            skipped_steps=int(self.skipped_steps()),
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore settings and state from `state_dict` output (polyamp's or torch's GradScaler's).

        Everything is validated first; on any error the scaler is unchanged. `skipped_steps` goes on from the
        dict's count (from 0 for a GradScaler dict, which has none). A disabled scaler (``enabled=False``) loads
        its own state dicts (settings, scale and spike window kept for when it is enabled again) and takes
        ``{}``, what ``torch.amp.GradScaler(enabled=False).state_dict()`` gives, as nothing to restore, as
        GradScaler does.

        Raises:
            StateDictError: (a ``ValueError``) the dict is malformed, inconsistent, or from a disabled scaler
                while this one is not disabled.
            ScalerUsageError: an iteration is in progress (after a step or unscale, before update).
        """
        disabled = self._enabled_setting is False
        if disabled and is_disabled_torch_state(state_dict):
            self._refuse_mid_iteration("load_state_dict() was called")
            return
        config, state = parse_state_dict(state_dict, self._config, loader_disabled=disabled)
        rule = self._spikes.rule
        window = parse_spike_window(state_dict, None if rule is None else rule.window)
        run = parse_spike_run(state_dict)
        skipped = parse_skipped_steps(state_dict)
        self._refuse_mid_iteration("load_state_dict() was called")
        with self._history.lock:  # a reader in another thread sees the old state and records, or the new
            self.records()  # the records so far belong to the state being replaced
            counted = 0 if self._device is None else int(self._device.skipped_steps())
            self._skipped_before = skipped - counted
            if self._device is not None:
                self._device.write_state(config, state)
            self._config = config
            self._host_state = state
            self._history.follow(config)
            self._history.recorder.reanchor(state)
        self._spikes.write_window(window, run)

    def _refuse_mid_iteration(self, what: str) -> None:
        if any(iteration.is_open for iteration in self._iterations.values()):
            raise ScalerUsageError(
                f"{what} in the middle of an iteration (after step() or unscale, before update()): the "
                "overflow checks already made would be lost. Do it between iterations: before the first step() "
                "or after update()."
            )

    def _change_setting(self, name: str, value: Any) -> None:
        config = self._config.replace(**{name: value})
        with self._history.lock:  # the records so far are replayed under the rule they ran with
            self.records()
            if self._device is not None:
                self._device.write_state(config, None)
            self._config = config
            self._history.follow(config)

    # -- the functional form ------------------------------------------------------------------------------

    def functional(
        self, backend: str | None = None, *, make_device: Callable[[LossScaleConfig], Any] | None = None
    ) -> FunctionalLossScaler:
        """This scaler's settings as pure functions of a state, for jitted steps (see `FunctionalLossScaler`).

        Whether the functions scale is decided now (``enabled``, or the policy in effect); the guard, the
        record history and the spike rule follow this scaler's ``guard``, ``history``, ``spike`` and
        ``on_min_scale``. The functional state starts from the settings' initial state (`FunctionalLossScaler.init`;
        ``load_state_dict(scaler.state_dict())`` resumes from this scaler's).

        Args:
            backend: The backend whose ``make_functional`` to use; None uses the bound backend.
            make_device: ``make(config)`` giving the functional device form to use instead of the backend's
                (an adapter's, e.g. one that reduces the found-inf flag over a named axis); ``backend`` then
                only names it in messages.

        Raises:
            PolyampTypeError: no backend given and none bound, the backend has no functional form, or its
                functional form cannot guard (``guard=True`` on a scaler that does not scale) or apply ``spike``.
        """
        name = backend or self._backend_name
        if name is None:
            raise PolyampTypeError("functional() needs a backend: bind the scaler first or pass backend='...'.")
        if make_device is None:
            backend_object = registry.get_backend(name)
            if not isinstance(backend_object, FunctionalBackend):
                raise PolyampTypeError(f"The {name!r} backend offers no functional (stateless) form.")
            make_device = backend_object.make_functional
        recorder = self._history.recorder
        return FunctionalLossScaler(
            make_device,
            self._config,
            self.enabled,
            setting=self._enabled_setting,
            guard=self._guard_setting,
            history=recorder.capacity,
            spike=self._spikes.rule,
            on_min_scale=recorder.on_min_scale,
            backend=name,
        )

    # -- Python protocols --------------------------------------------------------------------------------

    def _options(self) -> dict[str, Any]:
        """The constructor options this scaler keeps (`polyamp._src.persistence.PICKLED_OPTIONS`)."""
        recorder = self._history.recorder
        return {
            "enabled": self._enabled_setting,
            "guard": self._guard_setting,
            "spike": self._spikes.rule,
            "on_min_scale": recorder.on_min_scale,
            "history": recorder.capacity,
            "skip_on_device": self._skip_on_device,
        }

    def _saved_state(self) -> dict[str, Any]:
        """What a pickle holds besides the options: settings, state, backend and spike window."""
        if self._process_group is not None:
            raise ScalerUsageError(
                "A LossScaler with a process_group cannot be pickled or copied: the group belongs to this process. "
                "Save scaler.state_dict() and load it into a scaler constructed with the group."
            )
        return {
            "config": self._config,
            "state": self.get_state(),
            "backend": self._backend_name,
            "spike_window": self._spikes.read_window(),
            "spike_run": self._spikes.read_run(),
            "skipped_steps": int(self.skipped_steps()),
        }

    def _restore(self, saved: dict[str, Any], options: dict[str, Any]) -> None:
        """Become the scaler a pickle describes (`_saved_state` and `_options`), bound again if it was."""
        self._setup(
            saved["config"],
            saved["state"],
            process_group=None,
            spike_window=saved.get("spike_window"),
            spike_run=saved.get("spike_run", 0),
            skipped_steps=saved.get("skipped_steps", 0),
            **options,
        )
        if saved["backend"] is not None:
            self.bind(saved["backend"])

    def __repr__(self) -> str:
        settings = "".join(
            f", {name}={value!r}"
            for name, value in self._config.settings().items()
            if name != "init_scale" and value is not None  # the scale stands for it; unset bounds are left out
        )
        return (
            f"{type(self).__name__}(scale={self.get_scale()!r}{settings}, enabled={self._enabled_setting!r}, "
            f"backend={self._backend_name!r})"
        )

    def summary(self) -> RunSummary:
        """The run so far in one line (``str()`` of the result), e.g. ``200 steps, 5 skipped (overflow at 50, 51,
        120-122), scale 2^16 -> 2^13``: how many iterations ended, the skipped ones by reason and iteration, the
        loss scale's path and the layers named by non-finite gradients, as a `RunSummary` (its fields hold the
        numbers).

        It covers every iteration recorded since the scaler was created (or its variables were restored by the
        framework), not only the ``history`` records `records` keeps, and reads the device as `records` does:
        one host read, nothing inside a compiled function. ``polyamp_torch.log_summary`` prints it every N steps.
        """
        return self._history.summary()


LossScaler.__doc__ = (LossScaler.__doc__ or "").replace("{settings}", settings_doc(indent=12))


LossScaler.__signature__ = derive_signature(LossScaler, LossScaler.__init__)  # type: ignore[attr-defined]
