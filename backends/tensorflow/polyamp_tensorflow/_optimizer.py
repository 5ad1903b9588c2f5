"""`LossScaleOptimizer`: Keras 3's loss-scale optimizer with polyamp's rule, defaults and safeguards."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from polyamp import LossScaleConfig, LossScaleState, PolyampTypeError, ScalerUsageError
from polyamp.backend_api import (
    NOT_GIVEN,
    UnscaleStages,
    check_enabled,
    describe,
    parse_state_dict,
    resolve_enabled,
    to_state_dict,
)
from polyamp_tensorflow._framework import keras, tf
from polyamp_tensorflow._gradients import all_finite, refuse_loss_scale_factor, unscale
from polyamp_tensorflow._rule import ScaleState, advance, read_scalar

try:  # what Keras's own LossScaleOptimizer.build uses: variables are tracked through add_variable only
    from keras.src.utils.tracking import no_automatic_dependency_tracking
except ImportError:  # pragma: no cover - a Keras without it tracks attributes harmlessly twice

    def no_automatic_dependency_tracking(function: Any) -> Any:
        return function


__all__ = ["LossScaleOptimizer"]

ops = keras.ops

_TRACED_SETTINGS = (
    "{method} would change the loss-scaling settings ({old} -> {new}), but a tf.function (or model.fit) has "
    "already traced a step with them: the settings are constants in those graphs, which would go on using the old "
    "ones. Load the state before the first traced step, or build a new scaler/optimizer with the new settings "
    "(the scale and counters can be loaded at any time)."
)

#: Keras's names for two of polyamp's settings, accepted (and written by get_config) for porting.
KERAS_NAMES = {"initial_scale": "init_scale", "dynamic_growth_steps": "growth_interval"}


def _settings(settings: dict[str, Any], keras_names: dict[str, Any]) -> dict[str, Any]:
    """polyamp's settings from polyamp's and Keras's spellings; both may be given only if they agree."""
    for keras_name, name in KERAS_NAMES.items():
        value = keras_names[keras_name]
        if value is NOT_GIVEN:
            continue
        given = settings.get(name, NOT_GIVEN)
        if given is not NOT_GIVEN and given != value:
            raise PolyampTypeError(
                f"Give {name} or Keras's {keras_name}, not both (received {name}={given!r}, {keras_name}={value!r})."
            )
        settings[name] = value
    return settings


@keras.saving.register_keras_serializable(package="polyamp", name="LossScaleOptimizer")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):  # type: ignore[misc]
    """A Keras 3 optimizer that scales the loss and skips non-finite steps, with polyamp's rule.

    Use it where ``keras.mixed_precision.LossScaleOptimizer`` goes: in ``model.compile`` (Keras sees a
    loss-scale optimizer and does not wrap it again), in custom ``tf.GradientTape`` loops with
    ``scale_loss`` + ``apply_gradients``, and in tf.keras-2 loops with ``get_scaled_loss`` /
    ``get_unscaled_gradients`` + ``apply_gradients``.

    Differences from Keras's own:

    * polyamp's state machine and defaults: starts at 2**16 (Keras: 2**15), any growth/backoff factor,
      hysteresis, ``min_scale``/``max_scale``, and growth never reaches inf (Keras's can); ``dynamic=False``
      keeps a fixed scale and still skips non-finite steps.
    * Never unscales twice: after ``get_unscaled_gradients``, the next ``apply_gradients`` takes its
      gradients as unscaled (as returned, or clipped), so the tf.keras-2 loop moves the weights by the true
      gradient (Keras 3's own divides by the scale a second time, keras#19479).
    * ``enabled=None`` follows the polyamp policy (no scaling under bfloat16 policies): a disabled optimizer
      passes the loss and gradients straight to the inner optimizer.

    A skipped step leaves the variables, the inner optimizer's slots and ``iterations`` unchanged, so
    learning-rate schedules do not advance. The decision is made in the graph (``ops.cond``), so it works
    eagerly, in ``tf.function`` and with ``jit_compile=True``.

    With the inner optimizer's ``gradient_accumulation_steps``, each micro-batch is checked on its own: an
    overflowing micro-batch is dropped (not accumulated, the accumulation window does not advance) and
    counts as an overflow for the scale; the update happens after that many finite micro-batches.

    Args:
        inner_optimizer: The Keras optimizer to wrap.
        *positional: The first settings by position, as for `polyamp.LossScaler`.
        enabled: None (default) follows the policy in effect when the optimizer is used: polyamp's, or
            Keras's own global policy (``keras.mixed_precision.set_global_policy``) when that computes in
            float16. True or False fixes it.
        initial_scale, dynamic_growth_steps: Keras's names for ``init_scale`` and ``growth_interval``.
        name: The optimizer's name.
        **settings: polyamp's loss-scaling settings, see `polyamp.LossScaleConfig`.

    Raises:
        InvalidConfigError / PolyampTypeError: a setting is invalid.
    """

    def __init__(
        self,
        inner_optimizer: Any,
        *positional: Any,
        enabled: bool | None = None,
        initial_scale: Any = NOT_GIVEN,
        dynamic_growth_steps: Any = NOT_GIVEN,
        name: str | None = None,
        **settings: Any,
    ) -> None:
        from polyamp.backend_api import bind_arguments

        arguments = bind_arguments("LossScaleOptimizer()", LossScaleConfig.setting_names()[:4], positional, settings)
        arguments = _settings(arguments, {"initial_scale": initial_scale, "dynamic_growth_steps": dynamic_growth_steps})
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
        self._polyamp_initial_state = config.initial_state()
        self._stages = UnscaleStages()
        self._grads_are_unscaled = False
        self._polyamp_traced = False
        self._step_enabled: bool | None = None

    # -- settings and state ------------------------------------------------------------------------------

    @property
    def loss_scale_config(self) -> LossScaleConfig:
        """The validated polyamp settings (see `polyamp.LossScaleConfig`)."""
        return self._polyamp_config

    def _decide_enabled(self) -> bool:
        keras_float16 = str(keras.config.dtype_policy().compute_dtype) == "float16"
        return resolve_enabled(self._polyamp_enabled, float16_in_use=keras_float16)

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
            shape=(), dtype="int64", initializer=keras.initializers.Zeros(), aggregation="none", name="skipped_steps"
        )
        self.last_skipped = self.add_variable(
            shape=(), dtype="bool", initializer=keras.initializers.Zeros(), aggregation="none", name="last_skipped"
        )
        self._scale_state = ScaleState(self.dynamic_scale, self.step_counter, self.hysteresis_left, self.skipped_steps)

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
        return to_state_dict(self._polyamp_config, self._get_state(), self._polyamp_enabled)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a polyamp (or torch GradScaler) loss-scaler state dict; validated first, all or nothing.

        Raises:
            StateDictError: the dict is malformed (nothing changes).
            ScalerUsageError: gradients unscaled by `get_unscaled_gradients` wait for their apply.
        """
        config, state = parse_state_dict(state_dict, self._polyamp_config)
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
            self._scale_state.write(state)
        else:
            self.initial_scale = state.scale

    # -- scaling -----------------------------------------------------------------------------------------

    def scale_loss(self, loss: Any) -> Any:
        """Multiply the loss by the current scale (Keras 3's name). A disabled optimizer returns it as is.

        New losses mean new, scaled gradients: a pending `get_unscaled_gradients` stage ends here.
        """
        if not self._begin():
            return loss
        self._stages.clear()
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

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        grads = list(grads)
        enabled = self._begin()
        self._step_enabled = None  # the step ends here; the next one decides anew
        if not enabled:
            self._stages.clear()
            self.inner_optimizer.apply(grads, trainable_variables)
            return
        refuse_loss_scale_factor(self.inner_optimizer, "a LossScaleOptimizer wraps it")
        # Decided in Python, once per trace, before Keras's distribution machinery touches the tensors.
        stage = self._stages.check(grads, "apply_gradients()")
        self._grads_are_unscaled = stage is not None
        if stage is not None:
            self._stages.consume(stage)
        self._stages.clear()
        super().apply(grads, trainable_variables)

    def check_finite(self, grads: Any) -> Any:
        grads = list(grads)
        if self._polyamp_config.checks_unscaled and not self._grads_are_unscaled:
            # Below scale 1 an unscaled gradient can overflow where its scaled value did not.
            grads = unscale(grads, self.dynamic_scale)
        self._note_tracing()
        return all_finite(grads)

    def _note_tracing(self) -> None:
        if not tf.executing_eagerly():
            self._polyamp_traced = True

    def _stateful_handle_finite_grads(self, grads: Any, trainable_variables: Any) -> None:
        variables = trainable_variables or self._trainable_variables
        if not self._grads_are_unscaled:
            skip = [self._overwrite_variable_with_gradient(v) for v in variables]
            grads = unscale(list(grads), self.dynamic_scale, skip)
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        self.last_skipped.assign(False)
        advance(self._scale_state, False, self._polyamp_config)

    def _stateful_handle_non_finite_grads(self) -> None:
        self.last_skipped.assign(True)
        advance(self._scale_state, True, self._polyamp_config)

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        raise NotImplementedError(
            "polyamp's LossScaleOptimizer keeps its state in variables (TensorFlow and PyTorch Keras backends); "
            "the JAX backend's stateless training step is not supported."
        )

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
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> LossScaleOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
