"""`LossScaleOptimizer`: Keras 3's loss-scale optimizer with polyamp's rule, on every Keras backend."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from polyamp import (
    BackendMismatchError,
    FunctionalLossScaler,
    LossScaleConfig,
    LossScaler,
    LossScaleState,
    PolyampTypeError,
    PolyampValueError,
    ScalerUsageError,
    SpikeRule,
)
from polyamp.backend_api import ScalerAdapter, detect_backend
from polyamp.backend_api.arguments import (
    NOT_GIVEN,
    NOT_SCALED_RULE,
    bind_arguments,
    check_enabled,
    check_guard,
    check_history,
    check_on_min_scale,
    describe,
)
from polyamp.backend_api.records import RunSummary
from polyamp_keras._device import KerasDevice, clipping_folded, folded_clip_norm, is_tracer
from polyamp_keras._device_records import provenance_rows
from polyamp_keras._functional import KerasFunctional
from polyamp_keras._gradients import gradient_counts, refuse_loss_scale_factor, unscale
from polyamp_keras._keras import keras, overwritten_by_gradient
from polyamp_keras._optimizer_settings import KERAS_NAMES, _check_spike, _keras_settings, _split_arguments
from polyamp_keras._optimizer_state import StateMethods
from polyamp_keras._rule import counter_dtype, read_scalar

try:  # what Keras's own LossScaleOptimizer.build uses: variables are tracked through add_variable only
    from keras.src.utils.tracking import no_automatic_dependency_tracking
except ImportError:  # pragma: no cover - a Keras without it tracks attributes harmlessly twice

    def no_automatic_dependency_tracking(function: Any) -> Any:
        return function


__all__ = ["KERAS_NAMES", "LossScaleOptimizer"]

ops = keras.ops


_TRACED_SETTINGS = (
    "{method} would change the loss-scaling settings ({old} -> {new}), but a compiled step (tf.function, "
    "jax.jit, model.fit) has already traced them: the settings are constants there, which would go on using "
    "the old ones. Load the state before the first compiled step, or build a new optimizer with the new "
    "settings (the scale and counters can be loaded at any time)."
)


def _backend_of_tensors() -> str | None:
    """The polyamp backend whose tensors Keras computes with (None for JAX, which polyamp does not own)."""
    return {"tensorflow": "tensorflow", "torch": "torch", "jax": "jax"}.get(keras.backend.backend())


def _state_variable(name: str, doc: str) -> property:
    """An attribute holding one of the loss-scale state's variables once the optimizer is built (Keras's
    ``build`` and polyamp's assign them), and before that the value it will start from, as a tensor (as
    ``get_scale`` and ``iterations`` answer before the build)."""

    def get(self: LossScaleOptimizer) -> Any:
        variable = self.__dict__.get("_state_variables", {}).get(name)
        return self._unbuilt_value(name) if variable is None else variable

    def assign(self: LossScaleOptimizer, variable: Any) -> None:
        self.__dict__.setdefault("_state_variables", {})[name] = variable

    return property(get, assign, doc=doc)


def _listed(result: tuple[Any, Any]) -> tuple[list[Any], list[Any]]:
    return list(result[0]), list(result[1])


class _OptimizerDevice(KerasDevice):
    """`polyamp_keras.KerasDevice` over a `LossScaleOptimizer`'s own variables (made by its ``add_variable``,
    written by its ``assign`` and ``assign_add``; the scale and growth tracker are Keras's ``dynamic_scale`` and
    ``step_counter``), speaking the optimizer's names in its messages."""

    def __init__(self, optimizer: Any, config: LossScaleConfig, state: LossScaleState) -> None:
        super().__init__(
            config,
            state,
            add_variable=optimizer.add_variable,
            assign=optimizer.assign,
            assign_add=optimizer.assign_add,
            scale_variables=lambda: (optimizer.dynamic_scale, optimizer.step_counter),
        )

    def unscaled_loss_warning(self, method: str) -> str:
        return (
            f"LossScaleOptimizer.{'apply()' if method.startswith('apply') else method} was called before "
            "scale_loss() in this iteration (a custom train_step without `loss = self.optimizer.scale_loss(loss)`, "
            f"or get_scaled_loss in tf.keras 2 loops). {NOT_SCALED_RULE} This is said once per optimizer."
        )

    def traced_settings_error(self, old: LossScaleConfig, new: LossScaleConfig) -> ScalerUsageError:
        return ScalerUsageError(_TRACED_SETTINGS.format(method="load_state_dict()", old=old, new=new))


class _OptimizerScaler(LossScaler):
    """The `polyamp.LossScaler` a `LossScaleOptimizer` runs: it follows the policy as every scaler does, and
    under a float32 policy scales, as Keras's own loss-scale optimizer always does."""

    _scales_under_float32 = True


@keras.saving.register_keras_serializable(package="polyamp", name="LossScaleOptimizer")
class LossScaleOptimizer(StateMethods, keras.optimizers.LossScaleOptimizer):  # type: ignore[misc]
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
        enabled: None (default) follows the policy in effect when the optimizer is used, by the rule every polyamp
            scaler follows (`polyamp.backend_api.arguments.resolve_enabled`): scaling under ``"mixed_float16"``
            (polyamp's, or Keras's own global policy), none under bfloat16 policies (the guard checks instead), and
            under a float32 policy scaling, as Keras's own optimizer always does. True or False fixes it. A disabled
            optimizer passes the loss and gradients straight to the inner optimizer.
        initial_scale, dynamic_growth_steps: Keras's names for ``init_scale`` and ``growth_interval``.
        name: The optimizer's name.
        guard: As `polyamp.LossScaler`'s: None (default) checks the gradients whenever the policy turns
            scaling off (``enabled=None`` under bfloat16 policies) and skips a step whose gradients
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
        enabled: bool | None = None,
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
        history = check_history(history)
        on_min_scale = check_on_min_scale(on_min_scale)
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
        # The core's scaler makes every decision; its device form is this optimizer's variables.
        scaler = _OptimizerScaler(
            enabled=enabled, guard=guard, on_min_scale=on_min_scale, history=history, spike=spike, **config.settings()
        )
        self._device = _OptimizerDevice(self, config, scaler.get_state())
        scaler.bind("keras", self._device)
        self._scaler = scaler
        self._adapter = ScalerAdapter(scaler)  # the scaler's hooks for this adapter, made once
        self._functional: dict[str, FunctionalLossScaler] = {}

    # -- settings and state ------------------------------------------------------------------------------

    @property
    def scaler(self) -> LossScaler:
        """The `polyamp.LossScaler` this optimizer runs (bound to its variables): every decision is its."""
        return self._scaler

    @property
    def spike(self) -> SpikeRule | None:
        """The `polyamp.SpikeRule` given as ``spike``, or None."""
        return self._scaler.spike

    @property
    def loss_scale_config(self) -> LossScaleConfig:
        """The validated polyamp settings (see `polyamp.LossScaleConfig`)."""
        return self._scaler.config

    @property
    def enabled(self) -> bool:
        """Whether the loss is scaled: in the step in progress once it started, else if it started now."""
        return self._scaler.enabled

    @property
    def enabled_setting(self) -> bool | None:
        """The ``enabled`` argument: True, False, or None (follow the policy)."""
        return self._scaler.enabled_setting

    dynamic_scale = _state_variable(
        "dynamic_scale", "The loss scale's variable (Keras's name); before `build`, the scale it starts from."
    )
    step_counter = _state_variable(
        "step_counter",
        "The growth tracker's variable (Keras's name): finite steps since the scale last changed; before `build`, "
        "the count it starts from.",
    )
    hysteresis_left = _state_variable(
        "hysteresis_left", "Overflows left before the scale backs off; before `build`, the count it starts from."
    )
    skipped_steps = _state_variable(
        "skipped_steps",
        "The variable counting the skipped steps (``int(optimizer.skipped_steps)`` reads it); before `build`, 0.",
    )

    def _unbuilt_value(self, name: str) -> Any:
        """What a state variable holds before the optimizer builds it: the state it will start from."""
        state = self._scaler.get_state()
        if name == "dynamic_scale":
            return ops.convert_to_tensor(state.scale, dtype="float32")
        if name == "hysteresis_left":
            return ops.convert_to_tensor(state.hysteresis_left, dtype="int32")
        value = state.growth_tracker if name == "step_counter" else 0
        return ops.convert_to_tensor(value, dtype=counter_dtype())

    @no_automatic_dependency_tracking  # type: ignore[untyped-decorator]
    def build(self, var_list: list[Any]) -> None:
        super().build(var_list)  # Keras's step_counter (the growth tracker) and dynamic_scale, the inner slots
        # The scaler's variables, made through add_variable so they are this optimizer's (saved with it): the
        # hysteresis, the skip count, the last step's outcome, the step records' ring and its count, the
        # skipped step's non-finite counts with its index (one variable), and a SpikeRule's window.
        self._device.build(list(var_list))
        state = self._device.scale_state
        assert state is not None
        self.__dict__["_state_variables"].update(
            hysteresis_left=state.hysteresis_left, skipped_steps=state.skipped_steps
        )
        self.last_skipped = self._device.record_variable
        history = self._device.history_variables()
        assert history is not None
        self.step_codes, self.recorded_steps = history
        self._functional = {}

    def records(self) -> list[Any]:
        """The most recent steps' records (at most ``history``), as `polyamp.LossScaler.records` gives them:
        `polyamp.StepRecord` with the skip, its reason, the mode and the scale. Reads the ring in one host read,
        logs skips through ``logging.getLogger("polyamp")`` and applies ``on_min_scale``;
        `polyamp_keras.LossScaleCallback` calls it during ``fit``. Call it eagerly (not inside a compiled step).
        """
        return self._scaler.records()

    def summary(self) -> RunSummary:
        """The run so far in one line (``str()`` of the result), as `polyamp.LossScaler.summary` gives it: the
        steps, the skipped ones by reason and iteration, the loss scale's path and the layers of non-finite
        gradients, over every step since the optimizer was built. Call it eagerly, e.g. after ``fit``."""
        return self._scaler.summary()

    @property
    def loss_scale(self) -> Any:
        """The current loss scale (a float32 tensor; tf.keras 2's name). 1.0 when disabled."""
        if not self.enabled:
            return ops.convert_to_tensor(1.0)
        return ops.convert_to_tensor(self._device.scale_value())

    def get_scale(self) -> float:
        """The current loss scale as a Python float (reads the variable)."""
        return float(read_scalar(self.loss_scale))

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
        return self._scaler.scale(loss)

    def get_scaled_loss(self, loss: Any) -> Any:
        """tf.keras 2's name for `scale_loss`."""
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """Divide the gradients by the scale (tf.keras 2's API).

        The next `apply_gradients` takes its gradients as unscaled: these, or clipped/transformed versions
        of them. Passing the scaled gradients given here instead raises `polyamp.ScalerUsageError`.
        """
        return self._scaler.unscale(list(grads))

    # -- applying ----------------------------------------------------------------------------------------

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        grads = list(grads)
        if self._scaler.spike is not None and _several_replicas():
            raise ScalerUsageError(
                "LossScaleOptimizer(spike=...) decides on one replica's statistics, but this step runs under a "
                "tf.distribute strategy with several replicas. Use polyamp.LossScaler(spike=...) in a "
                "GradientTape loop there, or leave spike unset."
            )
        if trainable_variables is None:
            variables = list(self._trainable_variables)
        else:
            variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        if self._scaler.enabled:
            refuse_loss_scale_factor(self.inner_optimizer, "a LossScaleOptimizer wraps it")
        self._scaler.apply_gradients(self.inner_optimizer, list(zip(grads, variables, strict=True)))

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """The stateless step (JAX; what ``model.fit`` uses there): variables in, new values out.

        The scaler's host-side decisions are `polyamp.backend_api.ScalerAdapter.functional_iteration`'s, the device values
        `polyamp.FunctionalLossScaler`'s over this optimizer's variables; a skipped step's parameters and
        inner optimizer state are the old ones, selected inside the compiled step.
        """
        if not self.built:
            raise PolyampValueError(
                "To call `stateless_apply`, LossScaleOptimizer must be built (its variables created). Build it "
                "with `optimizer.build(trainable_variables)`."
            )
        grads = list(grads)
        # Values (a caller may hand the variables themselves, as Keras's own tests do).
        optimizer_variables = [v.value if isinstance(v, keras.Variable) else v for v in optimizer_variables]
        trainable = [v.value if isinstance(v, keras.Variable) else v for v in trainable_variables]
        if any(is_tracer(value) for value in [*grads, *trainable]):
            self._device.note_traced()
        mode, unscaled = self._adapter.functional_iteration(grads, "stateless_apply()")
        if mode == "scaling":
            refuse_loss_scale_factor(self.inner_optimizer, "a LossScaleOptimizer wraps it")
        fn = self._functional_form(mode)
        device = fn.device
        assert isinstance(device, KerasFunctional)
        own = self._variables
        values = {id(variable): value for variable, value in zip(own, optimizer_variables, strict=False)}
        inner_values = optimizer_variables[len(own) :]
        state = self._functional_state(device, values)
        clip_norm = None
        if mode == "scaling" and not unscaled and self._scaler.spike is None:  # a rule watches unclipped norms
            clip_norm = folded_clip_norm(self.inner_optimizer, grads, self._trainable_variables)
        scaled_grads, scale, unscale_with = grads, None, None
        if clip_norm is not None:  # the inner optimizer's global-norm clip, in the unscale's multiply
            scale = state["scaler"]["scale"]
            unscale_with = lambda tree, given: device.unscale_and_clip(tree, given, clip_norm)  # noqa: E731
        elif unscaled:  # handed unscaled gradients: checked only
            unscale_with = lambda tree, given: (given, device.check(tree, given))  # noqa: E731
        # Guarding on JAX, the inner step runs as it would without polyamp (a cond around it compiles differently
        # under jit and can change the last bit) and a select keeps its values, or the old ones when skipped;
        # elsewhere it runs only when the step is applied (lazy): a skipped step costs no update and no select
        # over every parameter and slot, and an inner step that writes into the arrays it is given (Keras's
        # torch optimizers update in place) leaves a skipped step's arrays alone.
        lazy = not (mode == "guarding" and keras.backend.backend() == "jax")
        with clipping_folded(self.inner_optimizer, clip_norm is not None):
            out = fn.step(
                state,
                grads,
                lambda unscaled_grads: _listed(
                    self.inner_optimizer.stateless_apply(inner_values, unscaled_grads, trainable)
                ),
                lambda applied: (list(trainable), list(inner_values)),
                unscale=unscale_with,
                lazy=lazy,
            )
        new_trainable, new_inner = out.result
        if mode == "off":
            return list(new_trainable), self._own_values(device, out.state, values, None, grads) + list(new_inner)
        # Provenance (which gradients were not finite) counts the unscaled ones: a folded clip made them all NaN.
        named = out.grads if scale is None else scaled_grads
        own_values = self._own_values(device, out.state, values, out.skipped, named, out.found_inf, scale)
        return list(new_trainable), own_values + list(new_inner)

    def _functional_form(self, mode: str) -> FunctionalLossScaler:
        """The functional form of this optimizer's scaler for iterations of ``mode``, over its variables."""
        fn = self._functional.get(mode)
        if fn is None:
            keep = [overwritten_by_gradient(v) for v in self._trainable_variables]
            device = self._device
            fn = FunctionalLossScaler(
                lambda config: KerasFunctional(device, config, keep),
                self._scaler.config,
                mode == "scaling",
                setting=None if mode == "guarding" else self._scaler.enabled_setting,
                guard=mode == "guarding",
                history=self._scaler.history,
                spike=self._scaler.spike,
                backend="keras",
            )
            self._functional[mode] = fn
        return fn

    @staticmethod
    def _functional_state(device: KerasFunctional, values: dict[int, Any]) -> dict[str, Any]:
        """The functional state: the values these variables hold in the step."""
        state = {"scaler": {key: values[id(v)] for key, v in device.scale_variables().items()}}
        ring = device.ring_variables()
        if ring is not None:
            state["ring"] = {key: values[id(v)] for key, v in ring.items()}
        window = device.window_variables()
        if window is not None:
            state["window"] = {key: values[id(v)] for key, v in window.items()}
        return state

    def _own_values(
        self,
        device: KerasFunctional,
        state: dict[str, Any],
        values: dict[int, Any],
        skipped: Any,
        grads: list[Any],
        found_inf: Any = None,
        scale: Any = None,
    ) -> list[Any]:
        """This optimizer's own variables' new values: the functional state's, the last step's outcome, and a
        skipped step's non-finite counts (of ``grads`` divided by ``scale`` when it is given). The counts are
        computed in a branch that runs only on a skip; on JAX, of the gradients the check read (no ``scale``),
        on every step from the check's own pass, and kept on a skip."""
        new = dict(values)
        for part, variables in (
            ("scaler", device.scale_variables()),
            ("ring", device.ring_variables()),
            ("window", device.window_variables()),
        ):
            if variables is not None:
                for key, variable in variables.items():
                    new[id(variable)] = state[part][key]
        record = self._device.record_variable
        new[id(record)] = ops.convert_to_tensor(False) if skipped is None else ops.greater(skipped, 0)
        counts = self._device.provenance_variable()
        if found_inf is not None and counts is not None and len(grads) == len(self._trainable_variables):
            old = values[id(counts)]
            ring = device.ring_variables()
            index = values[id(ring["count"])] if ring is not None else old[-1, 0]
            overflow = ops.greater(found_inf, 0)

            def named() -> list[Any]:
                return grads if scale is None else unscale(grads, scale)

            if scale is None and keras.backend.backend() == "jax":
                # The gradients the check counted (`non_finite_counts`): XLA computes the counts once for both.
                new[id(counts)] = ops.where(overflow, provenance_rows(gradient_counts(grads), index), old)
            else:
                new[id(counts)] = ops.cond(
                    overflow, lambda: provenance_rows(gradient_counts(named()), index), lambda: old
                )
        return [new[id(variable)] for variable in self._variables]

    # -- serialisation -----------------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        config = self._scaler.config
        options = self._scaler.options
        keras_spellings = {keras_name: getattr(config, name) for keras_name, name in KERAS_NAMES.items()}
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **config.settings(),
            **keras_spellings,
            "enabled": options["enabled"],
            "guard": options["guard"],
            "on_min_scale": options["on_min_scale"],
            "history": options["history"],
            "spike": None if options["spike"] is None else dataclasses.asdict(options["spike"]),
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


def _several_replicas() -> bool:
    """Inside a tf.distribute replica context with more than one replica (the guard's own ``cond`` would
    contain the optimizer's cross-replica reduction there; the apply is then plain)."""
    tf = sys.modules.get("tensorflow")
    if tf is None or keras.backend.backend() != "tensorflow":
        return False
    context = tf.distribute.get_replica_context()
    return context is not None and context.num_replicas_in_sync > 1
