"""`LossScaleOptimizer`: Keras 3's loss-scale optimizer with polyamp's rule, on every Keras backend."""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from polyamp import (
    BackendMismatchError,
    InvalidConfigError,
    LossScaleConfig,
    LossScaleState,
    PolyampTypeError,
    PolyampValueError,
    ScalerUsageError,
    SpikeRule,
    StateDictError,
)
from polyamp.backend_api import (
    MODE_CODES,
    NOT_GIVEN,
    NOT_SCALED_RULE,
    REBASE_BIT,
    SPIKE_BIT,
    Recorder,
    UnscaleStages,
    bind_arguments,
    check_enabled,
    check_guard,
    check_history,
    check_on_min_scale,
    check_spike,
    describe,
    detect_backend,
    non_finite_gradients,
    parse_spike_run,
    parse_spike_window,
    parse_state_dict,
    resolve_enabled,
    ring_codes,
    to_state_dict,
)
from polyamp_keras._gradients import (
    all_finite,
    all_replicas_finite,
    gradient_counts,
    refuse_loss_scale_factor,
    unscale,
)
from polyamp_keras._keras import keras
from polyamp_keras._rule import ScaleState, advance, counter_dtype, read_scalar
from polyamp_keras._spikes import SpikeWindow

try:  # what Keras's own LossScaleOptimizer.build uses: variables are tracked through add_variable only
    from keras.src.utils.tracking import no_automatic_dependency_tracking
except ImportError:  # pragma: no cover - a Keras without it tracks attributes harmlessly twice

    def no_automatic_dependency_tracking(function: Any) -> Any:
        return function


__all__ = ["KERAS_NAMES", "LossScaleOptimizer"]

ops = keras.ops

#: Keras's names for two of polyamp's settings, accepted (and written by get_config) for porting.
KERAS_NAMES = {"initial_scale": "init_scale", "dynamic_growth_steps": "growth_interval"}

#: Base-optimizer arguments Keras's LossScaleOptimizer refuses, and the defaults older Keras versions wrote
#: into saved configs (accepted at these values, so those configs load).
_INNER_ONLY_ARGUMENTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}

_TRACED_SETTINGS = (
    "{method} would change the loss-scaling settings ({old} -> {new}), but a compiled step (tf.function, "
    "jax.jit, model.fit) has already traced them: the settings are constants there, which would go on using "
    "the old ones. Load the state before the first compiled step, or build a new optimizer with the new "
    "settings (the scale and counters can be loaded at any time)."
)


def _split_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The loss-scaling settings among ``kwargs``; Keras's base-optimizer arguments are refused as Keras
    refuses them (or dropped at the defaults old configs carry), anything else is named."""
    names = LossScaleConfig.setting_names()
    settings = {key: value for key, value in kwargs.items() if key in names}
    unknown = []
    for key, value in kwargs.items():
        if key in names:
            continue
        if key in _INNER_ONLY_ARGUMENTS:
            default = _INNER_ONLY_ARGUMENTS[key]
            if value is default or (default is not None and value == default):
                continue
            raise PolyampValueError(
                f"LossScaleOptimizer does not support `{key}`. Instead, set `{key}` on the `inner_optimizer`. "
                f"Received: {key}={describe(value)}."
            )
        unknown.append(key)
    if unknown:
        raise PolyampValueError(
            f"LossScaleOptimizer does not support arguments: `{'`, `'.join(unknown)}`. Its loss-scaling settings "
            f"are: {', '.join(names)} (and Keras's initial_scale, dynamic_growth_steps)."
        )
    return settings


def _keras_settings(settings: dict[str, Any], keras_names: dict[str, Any]) -> dict[str, Any]:
    """polyamp's settings from polyamp's and Keras's spellings; both may be given only if they agree."""
    for keras_name, name in KERAS_NAMES.items():
        value = keras_names[keras_name]
        if value is NOT_GIVEN:
            continue
        if keras_name == "dynamic_growth_steps" and isinstance(value, float) and value.is_integer():
            value = int(value)  # Keras and tf.keras accept 2.0
        given = settings.get(name, NOT_GIVEN)
        if given is not NOT_GIVEN and given != value:
            raise PolyampTypeError(
                f"Give {name} or Keras's {keras_name}, not both (received {name}={given!r}, {keras_name}={value!r})."
            )
        settings[name] = value
    return settings


def _backend_of_tensors() -> str | None:
    """The polyamp backend whose tensors Keras computes with (None for JAX, which polyamp does not own)."""
    return {"tensorflow": "tensorflow", "torch": "torch"}.get(keras.backend.backend())


def _tracing(values: Iterable[Any]) -> bool:
    """Whether the step is being compiled (so Python-side settings become constants of a graph)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        tf = sys.modules.get("tensorflow")
        return tf is not None and not tf.executing_eagerly()
    if backend == "jax":
        return any(type(value).__name__.endswith("Tracer") for value in values if value is not None)
    return False


@keras.saving.register_keras_serializable(package="polyamp", name="LossScaleOptimizer")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):  # type: ignore[misc]
    """A Keras 3 optimizer that scales the loss and skips non-finite steps, with polyamp's rule, on every
    Keras backend (TensorFlow, JAX, PyTorch).

    Use it where ``keras.mixed_precision.LossScaleOptimizer`` goes: in ``model.compile`` (Keras sees a
    loss-scale optimizer and does not wrap it again) and ``model.fit`` on any backend, in custom loops with
    ``scale_loss`` + ``apply`` / ``apply_gradients`` (TensorFlow, PyTorch) or ``stateless_apply`` (JAX, the
    jitted stateless step), and in tf.keras-2 loops with ``get_scaled_loss`` / ``get_unscaled_gradients``.

    Differences from Keras's own:

    * polyamp's state machine and defaults: starts at 2**16 (Keras: 2**15), any growth/backoff factor,
      hysteresis, ``min_scale``/``max_scale`` and a floor of 1.0 without one, growth that never reaches inf
      (Keras's can); ``dynamic=False`` keeps a fixed scale and still skips non-finite steps (Keras refuses it).
    * Never unscales twice: after ``get_unscaled_gradients``, the next apply takes its gradients as unscaled
      (as returned, or clipped), so the tf.keras-2 loop moves the weights by the true gradient (Keras 3's own
      divides by the scale a second time, keras#19479). An apply whose gradients did not come from
      ``scale_loss`` warns: they would be divided by the scale and train almost nothing.
    * The same trajectory on every backend, and state dicts interchangeable with polyamp's torch and
      TensorFlow scalers; ``get_config`` carries Keras's keys and polyamp's.

    A skipped step leaves the variables, the inner optimizer's slots and ``iterations`` unchanged, so
    learning-rate schedules do not advance. The decision is made on the device (``ops.cond``), so it works
    eagerly, in ``tf.function`` (also ``jit_compile=True``) and under ``jax.jit``.

    With the inner optimizer's ``gradient_accumulation_steps``, each micro-batch is checked on its own: an
    overflowing micro-batch is dropped (not accumulated, the accumulation window does not advance) and
    counts as an overflow for the scale; the update happens after that many finite micro-batches.

    Args:
        inner_optimizer: The Keras optimizer to wrap.
        *positional: The first settings by position, as for `polyamp.LossScaler`.
        enabled: True (default, as Keras's own always scales), False, or None to follow the policy in effect
            when the optimizer is used (polyamp's, or Keras's own global policy when that computes in float16):
            no scaling under bfloat16 policies. A disabled optimizer passes the loss and gradients straight
            to the inner optimizer.
        initial_scale, dynamic_growth_steps: Keras's names for ``init_scale`` and ``growth_interval``.
        name: The optimizer's name.
        guard: As `polyamp.LossScaler`'s: None (default) checks the gradients whenever the policy turns
            scaling off (``enabled=None`` under bfloat16/float32 policies) and skips a step whose gradients
            hold inf or NaN (reason ``"non_finite"``); True also with ``enabled=False``; False never.
        on_min_scale, history: As `polyamp.LossScaler`'s; `records` gives the step records.
        spike: A `polyamp.SpikeRule`, as `polyamp.LossScaler`'s: also skip a step whose loss
            (``on="loss"``, the value passed to ``scale_loss``; TensorFlow and PyTorch) or unscaled gradient
            norm (``on="grad_norm"``, every backend) is an outlier, decided on the device (reason
            ``"loss_spike"`` / ``"grad_spike"``; the scale does not back off for it). On JAX the optimizer
            never sees the loss's value (``fit`` scales it inside the gradient's trace): use
            ``on="grad_norm"`` there. Without ``jax_enable_x64`` JAX computes the rule in float32.
        **settings: polyamp's loss-scaling settings, see `polyamp.LossScaleConfig`.

    Raises:
        InvalidConfigError / PolyampTypeError: a setting is invalid.
        PolyampValueError: (a ``ValueError``) an argument Keras's LossScaleOptimizer refuses too.
    """

    def __init__(
        self,
        inner_optimizer: Any,
        *positional: Any,
        enabled: bool | None = True,
        initial_scale: Any = NOT_GIVEN,
        dynamic_growth_steps: Any = NOT_GIVEN,
        name: str | None = None,
        guard: bool | None = None,
        on_min_scale: str = "warn",
        history: int = 256,
        spike: SpikeRule | None = None,
        **kwargs: Any,
    ) -> None:
        guard = check_guard(guard)
        spike = _check_spike(spike)
        recorder = Recorder(
            check_history(history), check_on_min_scale(on_min_scale), spike.reason if spike else "loss_spike"
        )
        arguments = bind_arguments(
            "LossScaleOptimizer()", LossScaleConfig.setting_names()[:4], positional, _split_arguments(kwargs)
        )
        arguments = _keras_settings(
            arguments, {"initial_scale": initial_scale, "dynamic_growth_steps": dynamic_growth_steps}
        )
        config = LossScaleConfig.from_settings(arguments, caller="LossScaleOptimizer()")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise PolyampTypeError(
                f"`inner_optimizer` must be a Keras 3 optimizer such as keras.optimizers.Adam(). "
                f"Received: {describe(inner_optimizer)}."
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise PolyampTypeError(
                "`inner_optimizer` is already a LossScaleOptimizer; wrapping it again would scale the loss "
                "twice. Pass the plain optimizer."
            )
        enabled = check_enabled(enabled)
        super().__init__(
            inner_optimizer,
            initial_scale=config.initial_state().scale,
            dynamic_growth_steps=config.growth_interval,
            name=name,
        )
        self._polyamp_config = config
        self._polyamp_enabled = enabled
        self._polyamp_guard = guard
        self._recorder = recorder
        self._polyamp_initial_state = config.initial_state()
        recorder.reanchor(self._polyamp_initial_state)
        self._stages = UnscaleStages()
        self._grads_are_unscaled = False
        self._polyamp_traced = False
        self._step_enabled: bool | None = None
        self._scaled_since_apply = False
        self._warned_unscaled_loss = False
        self._warned_unguarded = False
        self._spike_rule = spike
        self._spike: SpikeWindow | None = None
        self._spike_loss: Any = None  # a loss given to scale_loss before the variables existed
        self._spike_pending: list[float] | None = None  # a window loaded before the variables existed
        self._spike_pending_run = 0
        self._spike_loss_given = False
        self._spike_now: tuple[Any, Any] | None = None  # (statistic, gradients finite) of the step being built

    # -- settings and state ------------------------------------------------------------------------------

    @property
    def spike(self) -> SpikeRule | None:
        """The `polyamp.SpikeRule` given as ``spike``, or None."""
        return self._spike_rule

    @property
    def loss_scale_config(self) -> LossScaleConfig:
        """The validated polyamp settings (see `polyamp.LossScaleConfig`)."""
        return self._polyamp_config

    def _decide_enabled(self) -> bool:
        if self._polyamp_enabled is not None:
            return self._polyamp_enabled
        keras_float16 = str(keras.config.dtype_policy().compute_dtype) == "float16"
        return resolve_enabled(None, float16_in_use=keras_float16)

    @property
    def enabled(self) -> bool:
        """Whether the loss is scaled: in the step in progress once it started, else if it started now."""
        return self._step_enabled if self._step_enabled is not None else self._decide_enabled()

    @property
    def enabled_setting(self) -> bool | None:
        """The ``enabled`` argument: True, False, or None (follow the policy)."""
        return self._polyamp_enabled

    def _begin(self) -> bool:
        if self._step_enabled is None:
            self._step_enabled = self._decide_enabled()
        return self._step_enabled

    @no_automatic_dependency_tracking  # type: ignore[untyped-decorator]
    def build(self, var_list: list[Any]) -> None:
        super().build(var_list)  # Keras's step_counter (our growth tracker) and dynamic_scale, the inner slots
        state = self._polyamp_initial_state
        self.step_counter.assign(state.growth_tracker)
        self.hysteresis_left = self.add_variable(
            shape=(),
            dtype="int32",
            initializer=keras.initializers.Constant(state.hysteresis_left),
            aggregation="none",
            name="hysteresis_left",
        )
        self.skipped_steps = self.add_variable(
            shape=(),
            dtype=counter_dtype(),
            initializer=keras.initializers.Zeros(),
            aggregation="none",
            name="skipped_steps",
        )
        self.last_skipped = self.add_variable(
            shape=(), dtype="bool", initializer=keras.initializers.Zeros(), aggregation="none", name="last_skipped"
        )
        self._scale_state = ScaleState(self.dynamic_scale, self.step_counter, self.hysteresis_left, self.skipped_steps)
        # The step records: one code per apply (mode and skip, see polyamp.StepRecord) in a ring, and a count.
        self.step_codes = self.add_variable(
            shape=(self._recorder.capacity,),
            dtype="int32",
            initializer=keras.initializers.Zeros(),
            aggregation="none",
            name="step_codes",
        )
        self.recorded_steps = self.add_variable(
            shape=(), dtype="int32", initializer=keras.initializers.Zeros(), aggregation="none", name="recorded_steps"
        )
        # The non-finite gradients of the last skipped step (counted in the branch that skips), and its index.
        self._gradient_names = [str(getattr(v, "path", None) or v.name) for v in var_list]
        self.non_finite_counts = self.add_variable(
            shape=(max(1, len(var_list)), 4),
            dtype="int32",
            initializer=keras.initializers.Zeros(),
            aggregation="none",
            name="non_finite_counts",
        )
        self.non_finite_at = self.add_variable(
            shape=(),
            dtype="int32",
            initializer=keras.initializers.Constant(-1),
            aggregation="none",
            name="non_finite_at",
        )
        self._checked_grads: list[Any] | None = None
        if self._spike_rule is not None:
            self._spike = SpikeWindow(self._spike_rule, self.add_variable)
            if self._spike_pending is not None:
                self._spike.write(self._spike_pending, self._spike_pending_run)
                self._spike_pending = None

    def _count_non_finite(self) -> None:
        """In the branch that skips: each checked gradient's +inf/-inf/NaN counts, for the records."""
        grads = self._checked_grads
        if grads is None or len(grads) != len(self._gradient_names) or _several_replicas():
            return
        if grads:
            self.non_finite_counts.assign(gradient_counts(grads))
            self.non_finite_at.assign(ops.convert_to_tensor(self.recorded_steps))

    def _record(self, mode: str, skipped: Any, spike: bool = False, rebased: Any = None) -> None:
        """Write this apply's code into the ring (on the device; inside compiled steps too); ``spike``: the
        step was skipped by the spike rule alone; ``rebased`` (a boolean scalar): its statistic re-based the
        rule's window."""
        capacity = self._recorder.capacity
        index = ops.mod(ops.convert_to_tensor(self.recorded_steps), capacity)
        code = MODE_CODES[mode] + (1 + SPIKE_BIT if spike else ops.cast(skipped, "int32"))
        if rebased is not None:
            code = code + ops.cast(rebased, "int32") * REBASE_BIT
        ring = ops.convert_to_tensor(self.step_codes)
        self.step_codes.assign(ops.where(ops.arange(capacity, dtype="int32") == index, code, ring))
        self.recorded_steps.assign_add(ops.cast(1, "int32"))

    def records(self) -> list[Any]:
        """The most recent steps' records (at most ``history``), as `polyamp.LossScaler.records` gives them:
        `polyamp.StepRecord` with the skip, its reason, the mode and the scale. Reads the ring in one host read,
        logs skips through ``logging.getLogger("polyamp")`` and applies ``on_min_scale``;
        `polyamp_keras.LossScaleCallback` calls it during ``fit``. Call it eagerly (not inside a compiled step).
        """
        if not self.built:
            return list(self._recorder.records)
        at = int(read_scalar(self.non_finite_at))
        if at >= 0:
            rows = ops.convert_to_numpy(self.non_finite_counts).tolist()
            entries = [(name, *row) for name, row in zip(self._gradient_names, rows, strict=False)]
            self._recorder.attach(at, non_finite_gradients(entries))
            self.non_finite_at.assign(-1)
        count = int(read_scalar(self.recorded_steps))
        codes = ring_codes(count, ops.convert_to_numpy(self.step_codes).tolist())
        self._recorder.consume(count, codes, self._polyamp_config, self._get_state)
        return list(self._recorder.records)

    def _guards(self) -> bool:
        guard = self._polyamp_guard
        return bool(self._polyamp_enabled is None if guard is None else guard)

    @property
    def loss_scale(self) -> Any:
        """The current loss scale (a float32 tensor; tf.keras 2's name). 1.0 when disabled."""
        if not self.enabled:
            return ops.convert_to_tensor(1.0)
        return ops.convert_to_tensor(self.dynamic_scale if self.built else self.initial_scale)

    def get_scale(self) -> float:
        """The current loss scale as a Python float (reads the variable)."""
        return float(read_scalar(self.loss_scale))

    def _get_state(self) -> LossScaleState:
        if not self.built:
            return self._polyamp_initial_state
        return self._scale_state.read()

    def state_dict(self) -> dict[str, Any]:
        """The loss-scaler state as `polyamp.LossScaler.state_dict` gives it (portable across backends)."""
        window, run = None, 0
        if self._spike_rule is not None:
            window = self._spike.read() if self._spike is not None else list(self._spike_pending or [])
            run = self._spike.read_run() if self._spike is not None else self._spike_pending_run
        return to_state_dict(self._polyamp_config, self._get_state(), self._polyamp_enabled, window, run)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a polyamp (or torch GradScaler) loss-scaler state dict; validated first, all or nothing.

        A disabled optimizer (``enabled=False``) loads its own state dicts and takes ``{}`` (a disabled
        GradScaler's) as nothing to restore, as `polyamp.LossScaler` does.

        Raises:
            StateDictError: the dict is malformed (nothing changes).
            ScalerUsageError: gradients unscaled by `get_unscaled_gradients` wait for their apply, or the
                settings would change after a compiled step traced them.
        """
        if self._polyamp_enabled is False and isinstance(state_dict, Mapping) and len(state_dict) == 0:
            return  # torch.amp.GradScaler(enabled=False).state_dict(): nothing to restore, as GradScaler's own load
        config, state = parse_state_dict(
            state_dict, self._polyamp_config, loader_disabled=self._polyamp_enabled is False
        )
        window = parse_spike_window(state_dict, None if self._spike_rule is None else self._spike_rule.window)
        run = parse_spike_run(state_dict)
        if config != self._polyamp_config and self._polyamp_traced:
            raise ScalerUsageError(
                _TRACED_SETTINGS.format(method="load_state_dict()", new=config, old=self._polyamp_config)
            )
        if self._stages.pending:
            raise ScalerUsageError(
                "load_state_dict() was called in the middle of an iteration (after get_unscaled_gradients(), "
                "before apply_gradients()). Load the state at the start of an iteration."
            )
        self._polyamp_config = config
        self._polyamp_initial_state = state
        self.dynamic_growth_steps = config.growth_interval
        if self.built:
            self.records()  # the records so far belong to the state being replaced
            self._scale_state.write(state)
        else:
            self.initial_scale = state.scale
        self._recorder.reanchor(state)
        if window is not None:
            if self._spike is not None:
                self._spike.write(window, run)
            else:
                self._spike_pending = window  # written when the optimizer builds
                self._spike_pending_run = run

    def load_own_variables(self, store: Any) -> None:
        """Load the variables from a Keras weights file (``model.load_weights``, ``keras.models.load_model``),
        refusing a loss-scale state this optimizer cannot be in.

        A scale of 0, a subnormal, inf or NaN in a file (corrupted, or edited) would write NaN into the weights
        at the first step or skip every step for ever; the scale, growth counter, hysteresis and counters are
        checked against the optimizer's settings before anything is assigned. Keras wraps the refusal into the
        ``ValueError`` of ``load_weights`` / ``load_model`` (``skip_mismatch=True`` makes it a warning and loads
        the layers alone).

        Args:
            store: Keras's variable store for this optimizer (``store[str(i)]``: the i-th variable's value).

        Raises:
            StateDictError: (a ``ValueError``) the saved state is impossible; the optimizer is left unchanged.
        """
        if not self.built or len(store.keys()) != len(self.variables):
            super().load_own_variables(store)  # Keras warns and loads nothing
            return
        state, recorded = self._saved_state(store)
        self.records()  # the records so far belong to the state being replaced
        super().load_own_variables(store)
        self._polyamp_initial_state = state
        self._recorder.restart(recorded, state)

    def _saved_state(self, store: Any) -> tuple[LossScaleState, int]:
        """The loss-scale state and the count of recorded steps a store holds, validated."""
        index = {id(variable): i for i, variable in enumerate(self.variables)}
        entry = str(getattr(store, "_h5_entry_path", "") or "optimizer")
        scale_at = f"{entry}/vars/{index[id(self.dynamic_scale)]}"
        values: dict[str, Any] = {}
        where: dict[str, str] = {}
        for name, variable in (
            ("dynamic_scale", self.dynamic_scale),
            ("step_counter", self.step_counter),
            ("hysteresis_left", self.hysteresis_left),
            ("skipped_steps", self.skipped_steps),
            ("recorded_steps", self.recorded_steps),
        ):
            i = index[id(variable)]
            where[name] = f"{name} (entry '{entry}/vars/{i}')"
            value = np.asarray(store[str(i)])
            if value.size != 1:
                raise self._refuse_file(scale_at, f"{where[name]} has shape {value.shape}, where a scalar belongs.")
            values[name] = value.reshape(()).item()
        for name in ("step_counter", "hysteresis_left", "skipped_steps", "recorded_steps"):
            if isinstance(values[name], bool) or not isinstance(values[name], int):
                raise self._refuse_file(scale_at, f"{where[name]} is {describe(values[name])}, where an int belongs.")
        for name in ("skipped_steps", "recorded_steps"):
            if values[name] < 0:
                raise self._refuse_file(scale_at, f"{where[name]} is {values[name]}, a count that cannot be negative.")
        scale = values["dynamic_scale"]
        state = LossScaleState(scale, values["step_counter"], values["hysteresis_left"])
        try:
            self._polyamp_config.check_state(state)
        except (InvalidConfigError, PolyampTypeError) as exc:
            held = ", ".join(
                f"{where[name]} = {values[name]!r}" for name in ("dynamic_scale", "step_counter", "hysteresis_left")
            )
            raise self._refuse_file(
                scale_at,
                f"its loss-scale state is impossible for this optimizer's settings: {exc} The file holds {held}. "
                "A scale of 0 or a subnormal would write NaN into the weights at the first step; inf or NaN "
                "would skip every step.",
            ) from exc
        return state, values["recorded_steps"]

    def _refuse_file(self, scale_at: str, reason: str) -> StateDictError:
        return StateDictError(
            f"Cannot load the variables of LossScaleOptimizer {self.name!r} from this weights file: {reason} The "
            "optimizer was left unchanged. To fix the file: restore an earlier checkpoint; or rewrite the entry "
            "with h5py (in a model.keras archive, the model.weights.h5 inside it), e.g. "
            f"`with h5py.File('model.weights.h5', 'r+') as f: f['{scale_at}'][...] = "
            f"{self._polyamp_config.init_scale!r}` for the scale; or load the layers alone with "
            "model.load_weights(path, skip_mismatch=True), which keeps this optimizer's fresh state."
        )

    # -- scaling -----------------------------------------------------------------------------------------

    def scale_loss(self, loss: Any) -> Any:
        """Multiply the loss by the current scale (Keras 3's name). A disabled optimizer returns it as is.

        New losses mean new, scaled gradients: a pending `get_unscaled_gradients` stage ends here.

        Raises:
            BackendMismatchError: the loss is another framework's tensor than Keras computes with.
        """
        owner, expected = detect_backend(loss), _backend_of_tensors()
        if owner is not None and owner != expected:
            raise BackendMismatchError(
                f"Keras runs on {keras.backend.backend()}, but scale_loss() received a {owner} object: "
                f"{describe(loss)}. Compute the loss with this Keras backend's tensors."
            )
        enabled = self._begin()
        if enabled or self._guards():
            self._take_spike_loss(loss)
        if not enabled:
            return loss
        self._stages.clear()
        self._scaled_since_apply = True
        return super().scale_loss(loss)

    def get_scaled_loss(self, loss: Any) -> Any:
        """tf.keras 2's name for `scale_loss`."""
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """Divide the gradients by the scale (tf.keras 2's API).

        The next `apply_gradients` takes its gradients as unscaled: these, or clipped/transformed versions
        of them. Passing the scaled gradients given here instead raises `polyamp.ScalerUsageError`.
        """
        grads = list(grads)
        if not self._begin():
            return grads
        result = unscale(grads, self.dynamic_scale if self.built else self.initial_scale)
        self._stages.record(grads, result, method="get_unscaled_gradients()")
        return result

    # -- applying ----------------------------------------------------------------------------------------

    def _start_apply(self, grads: list[Any]) -> bool:
        """The Python-side decisions of a step, made once per trace: enabled, unscale stage, misuse."""
        enabled = self._begin()
        self._step_enabled = None  # the step ends here; the next one decides anew
        scaled = self._scaled_since_apply
        self._scaled_since_apply = False
        if not enabled:
            self._stages.clear()
            return False
        refuse_loss_scale_factor(self.inner_optimizer, "a LossScaleOptimizer wraps it")
        stage = self._stages.check(grads, "apply_gradients()")
        self._grads_are_unscaled = stage is not None
        if stage is not None:
            self._stages.consume(stage)
        self._stages.clear()
        if stage is None and not scaled and not self._warned_unscaled_loss:
            self._warned_unscaled_loss = True
            warnings.warn(
                "LossScaleOptimizer.apply() was called before scale_loss() in this iteration (a custom "
                "train_step without `loss = self.optimizer.scale_loss(loss)`, or get_scaled_loss in tf.keras 2 "
                f"loops). {NOT_SCALED_RULE} This is said once per optimizer.",
                UserWarning,
                stacklevel=4,
            )
        if _tracing(grads):
            self._polyamp_traced = True
        return True

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        grads = list(grads)
        several = _several_replicas()
        if self._spike_rule is not None and several:
            raise ScalerUsageError(
                "LossScaleOptimizer(spike=...) decides on one replica's statistics, but this step runs under a "
                "tf.distribute strategy with several replicas. Use polyamp.LossScaler(spike=...) in a "
                "GradientTape loop there, or leave spike unset."
            )
        self._spike_now = None
        if not self._start_apply(grads):
            if self._guards() and several and not self._warned_unguarded:
                self._warned_unguarded = True
                logging.getLogger("polyamp").warning(
                    "polyamp: LossScaleOptimizer does not guard steps without scaling under a tf.distribute "
                    "strategy with several replicas (its apply reduces across replicas, which cannot run inside the "
                    "guard's cond): non-finite gradients are applied. Use polyamp.LossScaler(guard=True) with a "
                    "GradientTape loop there, or scaling (enabled=True)."
                )
            if self._guards() and not several:
                self._guarded_apply(grads, trainable_variables)
            else:
                self.inner_optimizer.apply(grads, trainable_variables)
                if self.built:
                    self._record("off", False)
            return
        super().apply(grads, trainable_variables)

    def _guarded_apply(self, grads: list[Any], trainable_variables: Any) -> None:
        """The guard, stateful: apply unless a gradient is non-finite (or the spike rule vetoes); the rule does
        not run."""
        variables = trainable_variables or self._trainable_variables
        if not self.built:
            self.build(list(variables))
        self._checked_grads = grads
        go = self._spike_decide(grads, True, all_finite(grads))

        context = _merge_call_context()
        if context is not None:  # a one-replica strategy (several replicas do not guard)
            context.merge_call(self._guarded_cross_replica, args=(go, grads, trainable_variables))
            return

        def applied() -> None:
            self.inner_optimizer.apply(grads, trainable_variables)
            self._outcome("guarding", "applied")

        ops.cond(go, applied, lambda: self._on_skip("guarding"))

    def _guarded_cross_replica(self, distribution: Any, go: Any, grads: Any, trainable_variables: Any) -> None:
        """The guard's ``cond`` in the cross-replica context: the inner optimizer's apply is a ``merge_call``,
        which TensorFlow refuses inside a ``cond`` in a replica context (as Keras's own LossScaleOptimizer does
        for its scaling step)."""

        def applied() -> None:
            distribution.extended.call_for_each_replica(
                self.inner_optimizer.apply, args=(grads,), kwargs={"trainable_variables": trainable_variables}
            )
            self._outcome("guarding", "applied")

        ops.cond(distribution.experimental_local_results(go)[0], applied, lambda: self._on_skip("guarding"))

    # -- the step's outcome and the spike rule -----------------------------------------------------------

    def _outcome(self, mode: str, kind: str) -> None:
        """The optimizer's own state after a step of ``mode`` ("scaling" or "guarding") that was ``kind``:
        "applied", skipped for non-finite gradients ("overflow") or by the spike rule ("spike")."""
        skipped = kind != "applied"
        self.last_skipped.assign(skipped)
        if mode == "scaling":
            advance(self._scale_state, kind == "overflow", self._polyamp_config)  # counts an overflow's skip
        if skipped and not (mode == "scaling" and kind == "overflow"):
            self.skipped_steps.assign_add(ops.cast(1, self.skipped_steps.dtype))
        if kind == "overflow":
            self._count_non_finite()
        rebased = None
        if kind == "applied" and self._spike is not None and self._spike_now is not None:
            rebased = self._spike.push(self._spike_now[0])
        if kind == "spike" and self._spike is not None:
            self._spike.note_spike()
        self._record(mode, skipped, spike=kind == "spike", rebased=rebased)

    def _on_skip(self, mode: str) -> None:
        """A skipped step's outcome: for non-finite gradients, or, with finite ones, by the spike rule."""
        if self._spike_now is None:
            self._outcome(mode, "overflow")
            return
        ops.cond(self._spike_now[1], lambda: self._outcome(mode, "spike"), lambda: self._outcome(mode, "overflow"))

    def _take_spike_loss(self, loss: Any) -> None:
        """``scale_loss``: the loss a ``SpikeRule("loss")`` decides on."""
        if self._spike_rule is None or self._spike_rule.on != "loss":
            return
        self._spike_loss_given = True
        if self._spike is None:  # not built yet: the first apply builds and takes it
            self._spike_loss = loss
            return
        assert self._spike.loss is not None
        self._spike.loss.assign(self._spike.loss_statistic(loss))

    def _spike_decide(self, grads: list[Any], unscaled: bool, finite: Any) -> Any:
        """``finite``, and not a spike: the decision to apply. Remembers the statistic and ``finite`` for the
        branches (None without a spike rule)."""
        window = self._spike
        if window is None:
            return finite
        if window.loss is None:
            x = window.grad_norm(grads, None if unscaled else self.dynamic_scale)
        else:
            if not self._spike_loss_given:
                raise ScalerUsageError(
                    "A SpikeRule('loss') needs the iteration's loss: call optimizer.scale_loss(loss) (and take the "
                    "gradients of its result) before every apply."
                )
            if self._spike_loss is not None:
                window.loss.assign(window.loss_statistic(self._spike_loss))
                self._spike_loss = None
            x = ops.convert_to_tensor(window.loss)
        self._spike_loss_given = False
        self._spike_now = (x, finite)
        return ops.logical_and(finite, ops.logical_not(window.is_spike(x)))

    def check_finite(self, grads: Any) -> Any:
        grads = list(grads)
        checked = grads
        if self._polyamp_config.checks_unscaled and not self._grads_are_unscaled:
            # Below scale 1 an unscaled gradient can overflow where its scaled value did not.
            checked = unscale(grads, self.dynamic_scale)
        self._checked_grads = checked  # for the skip branch's counts
        return self._spike_decide(grads, self._grads_are_unscaled, all_replicas_finite(all_finite(checked)))

    def _unscaled(self, grads: Any, variables: Any) -> list[Any]:
        if self._grads_are_unscaled:
            return list(grads)
        skip = [self._overwrite_variable_with_gradient(v) for v in variables]
        return unscale(list(grads), self.dynamic_scale, skip)

    def _stateful_handle_finite_grads(self, grads: Any, trainable_variables: Any) -> None:
        variables = trainable_variables or self._trainable_variables
        self.inner_optimizer.apply(self._unscaled(grads, variables), trainable_variables=trainable_variables)
        self._outcome("scaling", "applied")

    def _stateful_handle_non_finite_grads(self) -> None:
        self._on_skip("scaling")

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """The stateless step (JAX; what ``model.fit`` uses there): variables in, new values out, the skip
        decided inside the compiled step with ``ops.cond``."""
        if not self.built:
            raise PolyampValueError(
                "To call `stateless_apply`, LossScaleOptimizer must be built (its variables created). Build it "
                "with `optimizer.build(trainable_variables)`."
            )
        grads = list(grads)
        optimizer_variables = list(optimizer_variables)
        own = len(self._variables)
        self._spike_now = None
        if not self._start_apply(grads):
            if self._guards():
                return self._stateless_guarded(optimizer_variables, grads, trainable_variables)
            new_trainable, new_inner = self.inner_optimizer.stateless_apply(
                optimizer_variables[own:], grads, trainable_variables
            )
            mapping = list(zip(self.variables, optimizer_variables, strict=True))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                self._record("off", False)
                mine = [scope.get_current_value(v) for v in self._variables]
            return new_trainable, mine + list(new_inner)
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            go = self.check_finite(grads)
        return ops.cond(
            go,
            lambda: self._stateless_finite(optimizer_variables, grads, trainable_variables),
            lambda: self._stateless_non_finite(optimizer_variables, trainable_variables),
        )

    def _own_values(self, mapping: list[tuple[Any, Any]], mode: str, kind: str) -> list[Any]:
        """This optimizer's own variables after `_outcome` (stateless: the new values)."""
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self._outcome(mode, kind)
            return [scope.get_current_value(v) for v in self._variables]

    def _skipped_values(self, mapping: list[tuple[Any, Any]], mode: str) -> list[Any]:
        """`_on_skip`, stateless: both outcomes computed, the spike's kept when the gradients were finite."""
        overflow = self._own_values(mapping, mode, "overflow")
        if self._spike_now is None:
            return overflow
        spike = self._own_values(mapping, mode, "spike")
        return [ops.where(self._spike_now[1], a, b) for a, b in zip(spike, overflow, strict=True)]

    def _stateless_guarded(self, optimizer_variables: list[Any], grads: list[Any], trainable_variables: Any) -> Any:
        """The guard, stateless (JAX): apply unless a gradient is non-finite (or the spike rule vetoes); the
        rule does not run."""
        own = len(self._variables)
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        self._checked_grads = grads
        with keras.StatelessScope(state_mapping=mapping):
            go = self._spike_decide(grads, True, all_finite(grads))
        # The inner step runs as it would without polyamp (a cond around it compiles differently under jit and
        # can change the last bit); a select keeps its values, or the old ones when the step is skipped.
        new_trainable, new_inner = self.inner_optimizer.stateless_apply(
            optimizer_variables[own:], grads, trainable_variables
        )
        kept = ops.cond(
            go,
            lambda: self._own_values(mapping, "guarding", "applied"),
            lambda: self._skipped_values(mapping, "guarding"),
        )
        trainable = [ops.where(go, n, o) for n, o in zip(new_trainable, trainable_variables, strict=True)]
        inner = [ops.where(go, n, o) for n, o in zip(new_inner, optimizer_variables[own:], strict=True)]
        return trainable, list(kept) + inner

    def _stateless_finite(self, optimizer_variables: list[Any], grads: list[Any], trainable_variables: Any) -> Any:
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            unscaled = self._unscaled(grads, self._trainable_variables)  # with the step's scale, before its update
            new_trainable, new_inner = self.inner_optimizer.stateless_apply(
                self.inner_optimizer.variables, unscaled, trainable_variables
            )
        return new_trainable, self._own_values(mapping, "scaling", "applied") + list(new_inner)

    def _stateless_non_finite(self, optimizer_variables: list[Any], trainable_variables: Any) -> Any:
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        own = self._skipped_values(mapping, "scaling")
        return list(trainable_variables), own + optimizer_variables[len(self._variables) :]

    # -- serialisation -----------------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        config = self._polyamp_config
        keras_spellings = {keras_name: getattr(config, name) for keras_name, name in KERAS_NAMES.items()}
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **config.settings(),
            **keras_spellings,
            "enabled": self._polyamp_enabled,
            "guard": self._polyamp_guard,
            "on_min_scale": self._recorder.on_min_scale,
            "history": self._recorder.capacity,
            "spike": None if self._spike_rule is None else dataclasses.asdict(self._spike_rule),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> LossScaleOptimizer:
        """The optimizer a `get_config` dict describes (what ``keras.models.load_model`` calls).

        Args:
            config: The dict `get_config` returned (or Keras's own LossScaleOptimizer's).
            custom_objects: Passed on to Keras to deserialize the inner optimizer.

        Returns:
            A new, unbuilt `LossScaleOptimizer`.

        Raises:
            PolyampTypeError: (a ``TypeError``) ``config`` is not a dict, or its ``spike`` names a field a
                `polyamp.SpikeRule` does not have.
            PolyampValueError: (a ``ValueError``) ``config`` has no ``inner_optimizer``; or a setting is invalid
                (as for the constructor).
        """
        if not isinstance(config, Mapping):
            raise PolyampTypeError(
                f"LossScaleOptimizer.from_config() takes the dict get_config() returned. Received: {describe(config)}."
            )
        config = dict(config)
        if "inner_optimizer" not in config:
            raise PolyampValueError(
                "LossScaleOptimizer.from_config() needs 'inner_optimizer' (the serialized inner optimizer, as "
                f"get_config() writes it). Received the keys: {sorted(map(str, config))}."
            )
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        spike = config.get("spike")
        if isinstance(spike, Mapping):
            fields = [field.name for field in dataclasses.fields(SpikeRule)]
            unknown = sorted(str(key) for key in spike if key not in fields)
            if unknown:
                raise PolyampTypeError(
                    f"LossScaleOptimizer.from_config(): 'spike' holds {unknown}, which SpikeRule does not take. "
                    f"Its fields are: {', '.join(fields)}. Received: spike={describe(spike)}."
                )
            config["spike"] = SpikeRule(**spike)
        return cls(inner, **config)


def _check_spike(spike: Any) -> SpikeRule | None:
    rule = check_spike(spike)
    if rule is not None and rule.on == "loss" and keras.backend.backend() == "jax":
        raise PolyampValueError(
            "LossScaleOptimizer(spike=SpikeRule('loss')) cannot run on Keras's JAX backend: there the loss is "
            "scaled inside the gradient's trace (model.fit, jax.value_and_grad), so the optimizer never holds its "
            "value. Use SpikeRule('grad_norm', ...), which decides on the gradients the optimizer receives."
        )
    return rule


def _merge_call_context() -> Any:
    """The replica context of a ``tf.distribute`` strategy whose optimizer updates go through ``merge_call``
    (MirroredStrategy, one replica included), or None (no strategy, another Keras backend, or a strategy
    without ``merge_call``)."""
    tf = sys.modules.get("tensorflow")
    if tf is None or keras.backend.backend() != "tensorflow" or not tf.distribute.has_strategy():
        return None
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        return None
    return tf.distribute.get_replica_context()


def _several_replicas() -> bool:
    """Inside a tf.distribute replica context with more than one replica (the guard's own ``cond`` would
    contain the optimizer's cross-replica reduction there; the apply is then plain)."""
    tf = sys.modules.get("tensorflow")
    if tf is None or keras.backend.backend() != "tensorflow":
        return False
    context = tf.distribute.get_replica_context()
    return context is not None and context.num_replicas_in_sync > 1
