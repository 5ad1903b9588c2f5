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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final

from polyamp._src import registry
from polyamp._src.binding import DeviceCapabilities
from polyamp._src.enabling import check_enabled
from polyamp._src.errors import (
    PolyampTypeError,
    describe,
    type_error,
)
from polyamp._src.grad_scaler_api import GradScalerSpelling
from polyamp._src.iteration import Iteration
from polyamp._src.persistence import Pickled, derive_signature
from polyamp._src.records import (
    DEFAULT_HISTORY,
    Recorder,
    check_guard,
    check_history,
    check_on_min_scale,
)
from polyamp._src.scaler_end import EndPart
from polyamp._src.scaler_imperative import ImperativePart
from polyamp._src.scaler_outcomes import OutcomesPart
from polyamp._src.scaler_start import StartPart
from polyamp._src.scaler_state import StatePart
from polyamp._src.scaler_tape import TapePart
from polyamp._src.scaling import NOT_GIVEN, LossScaleConfig, LossScaleState, NotGiven, settings_doc
from polyamp._src.spike_driver import SpikeDriver
from polyamp._src.spikes import SpikeRule, check_spike
from polyamp._src.step_history import RecordHistory, StepOutcomes

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from polyamp._src.scaling import LossScaleSettings

__all__ = ["LossScaler", "bind_arguments"]


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


def _not_compiling() -> bool:
    return False


#: How many iterations a scaler that follows the policy and does not scale asks its device whether the loss was
#: computed in float16 anyway (a one-time probe; see ``LossScaler._probe_float16``).
FLOAT16_PROBES: Final = 3


class LossScaler(StartPart, ImperativePart, TapePart, EndPart, OutcomesPart, StatePart, GradScalerSpelling, Pickled):
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
    _bound_backend: ClassVar[str | None] = None
    #: The names positional arguments take, in order.
    _positional_arguments: ClassVar[tuple[str, ...]] = LossScaleConfig.setting_names()[:4]
    #: The value of ``enabled`` when it is not given.
    _default_enabled: ClassVar[bool | None] = None
    #: Whether a scaler of this class that follows the policy (``enabled=None``) scales under a float32 policy,
    #: which names no mixed precision (`polyamp.backend_api.arguments.resolve_enabled`): False here (it scales then only
    #: where the backend reports float16 compute); True in a class standing for a framework's own class that
    #: always scales (the one Keras's ``LossScaleOptimizer`` runs).
    _scales_under_float32: ClassVar[bool] = False

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
        arguments = bind_arguments(caller, self._positional_arguments, positional, settings)
        if enabled is not NOT_GIVEN:
            if "enabled" in arguments:
                raise PolyampTypeError(f"{caller} got two values for 'enabled' (positional and keyword).")
            arguments["enabled"] = enabled
        self._take_options(arguments)
        enabled = check_enabled(arguments.pop("enabled", self._default_enabled))
        guard = check_guard(guard)
        spike = check_spike(spike)
        history = check_history(history)
        on_min_scale = check_on_min_scale(on_min_scale)
        if not isinstance(skip_on_device, bool):
            raise type_error("`skip_on_device`", "True or False", skip_on_device)
        config = LossScaleConfig.from_settings(arguments, caller=caller)
        if backend is not None and not isinstance(backend, str):
            raise type_error("`backend`", "None or a backend name such as 'torch' or 'tensorflow'", backend)
        bound = type(self)._bound_backend
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
        # That iteration, while the device runs one iteration per scaler (no replica hook): the calls of a step
        # read it here instead of through `_iteration`.
        self._only_iteration: Iteration | None = self._iterations[None]
        # Per imperative method, the optimizer it checked last (a weak reference): see `ImperativePart._check`.
        self._checked_optimizers: dict[str, Any] = {"unscale_": None, "step": None}
        # An imperative device's step, ``(optimizer, flag, args, kwargs) -> StepOutcome``, chosen when it binds.
        self._device_step: Any = None

    def _take_options(self, arguments: dict[str, Any]) -> None:
        """Subclasses pop (and keep) their backend's own constructor options from ``arguments`` here."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = derive_signature(cls, LossScaler.__init__)  # type: ignore[attr-defined]

    # -- enabled -----------------------------------------------------------------------------------------

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

    # -- records -----------------------------------------------------------------------------------------

    # -- state -------------------------------------------------------------------------------------------

    # -- Python protocols --------------------------------------------------------------------------------

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


LossScaler.__doc__ = (LossScaler.__doc__ or "").replace("{settings}", settings_doc(indent=12))


LossScaler.__signature__ = derive_signature(LossScaler, LossScaler.__init__)  # type: ignore[attr-defined]
