"""`LossScaleOptimizer`: Keras 3's loss-scale optimizer with polyamp's rule, defaults and safeguards."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from polyamp import (
    LossScaleConfig,
    LossScaleState,
    PolyampTypeError,
)
from polyamp._src.errors import describe
from polyamp._src.loss_scaler import resolve_enabled
from polyamp._src.state_dict import parse_state_dict, to_state_dict
from polyamp_tensorflow._framework import keras

try:  # what Keras's own LossScaleOptimizer.build uses: variables are tracked through add_variable only
    from keras.src.utils.tracking import no_automatic_dependency_tracking
except ImportError:  # pragma: no cover - a Keras without it tracks attributes harmlessly twice

    def no_automatic_dependency_tracking(function: Any) -> Any:
        return function


from polyamp_tensorflow._update import (
    UnscaleTracker,
    advance,
    all_finite,
    refuse_loss_scale_factor,
    to_python,
    unscale,
)

__all__ = ["LossScaleOptimizer"]

ops = keras.ops


def _config_kwargs(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
    dynamic: bool,
    initial_scale: float | None,
    dynamic_growth_steps: int | None,
) -> dict[str, Any]:
    if initial_scale is not None:  # Keras's spelling, accepted so existing code and configs keep working
        if init_scale != 2.0**16:
            raise PolyampTypeError("Give init_scale or Keras's initial_scale, not both.")
        init_scale = initial_scale
    if dynamic_growth_steps is not None:
        if growth_interval != 2000:
            raise PolyampTypeError("Give growth_interval or Keras's dynamic_growth_steps, not both.")
        growth_interval = dynamic_growth_steps
    return dict(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
        dynamic=dynamic,
    )


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
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
            dynamic, enabled: As for `polyamp.LossScaler`.
        initial_scale, dynamic_growth_steps: Keras's names for ``init_scale`` and ``growth_interval``.
        name: The optimizer's name.

    Raises:
        InvalidConfigError / PolyampTypeError: a setting is invalid.
    """

    def __init__(
        self,
        inner_optimizer: Any,
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
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        config = LossScaleConfig(
            **_config_kwargs(
                init_scale,
                growth_factor,
                backoff_factor,
                growth_interval,
                hysteresis,
                min_scale,
                max_scale,
                dynamic,
                initial_scale,
                dynamic_growth_steps,
            )
        )
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
        enabled = resolve_enabled(enabled)
        super().__init__(
            inner_optimizer,
            initial_scale=config.initial_state().scale,
            dynamic_growth_steps=config.growth_interval,
            name=name,
            **kwargs,
        )
        self._polyamp_config = config
        self._polyamp_enabled = enabled
        self._polyamp_initial_state = config.initial_state()
        self._unscaled = UnscaleTracker()
        self._grads_are_unscaled = False

    # -- state -------------------------------------------------------------------------------------------

    @property
    def config_(self) -> LossScaleConfig:
        """The validated polyamp settings."""
        return self._polyamp_config

    @property
    def enabled(self) -> bool:
        """Whether the loss is scaled at all."""
        return self._polyamp_enabled

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

    # Names the shared update expects.
    @property
    def scale(self) -> Any:
        return self.dynamic_scale

    @property
    def growth_tracker(self) -> Any:
        return self.step_counter

    @property
    def loss_scale(self) -> Any:
        """The current loss scale (a float32 tensor; tf.keras 2's name). 1.0 when disabled."""
        if not self._polyamp_enabled:
            return ops.convert_to_tensor(1.0)
        return ops.convert_to_tensor(self.dynamic_scale if self.built else self.initial_scale)

    def get_scale(self) -> float:
        """The current loss scale as a Python float (reads the variable)."""
        return float(to_python(self.loss_scale))

    def _get_state(self) -> LossScaleState:
        if not self.built:
            return self._polyamp_initial_state
        return LossScaleState(
            float(to_python(self.dynamic_scale)),
            int(to_python(self.step_counter)),
            int(to_python(self.hysteresis_left)),
        )

    def state_dict(self) -> dict[str, Any]:
        """The loss-scaler state as `polyamp.LossScaler.state_dict` gives it (portable across backends)."""
        return to_state_dict(self._polyamp_config, self._get_state(), self._polyamp_enabled)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a polyamp (or torch GradScaler) loss-scaler state dict; validated first, all or nothing."""
        config, state = parse_state_dict(state_dict, self._polyamp_config)
        self._polyamp_config = config
        self._polyamp_initial_state = state
        self.dynamic_growth_steps = config.growth_interval
        if self.built:
            self.dynamic_scale.assign(state.scale)
            self.step_counter.assign(state.growth_tracker)
            self.hysteresis_left.assign(state.hysteresis_left)
        else:
            self.initial_scale = state.scale

    # -- scaling -----------------------------------------------------------------------------------------

    def scale_loss(self, loss: Any) -> Any:
        """Multiply the loss by the current scale (Keras 3's name). A disabled optimizer returns it as is."""
        if not self._polyamp_enabled:
            return loss
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
        if not self._polyamp_enabled:
            return grads
        result = unscale(grads, self.dynamic_scale if self.built else self.initial_scale)
        self._unscaled.record(grads, result)
        return result

    # -- applying ----------------------------------------------------------------------------------------

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        grads = list(grads)
        if not self._polyamp_enabled:
            self.inner_optimizer.apply(grads, trainable_variables)
            return
        refuse_loss_scale_factor(self.inner_optimizer, "a LossScaleOptimizer wraps it")
        # Decided in Python, once per trace, before Keras's distribution machinery touches the tensors.
        self._grads_are_unscaled = self._unscaled.consume(grads, "apply_gradients()")
        super().apply(grads, trainable_variables)

    def check_finite(self, grads: Any) -> Any:
        return all_finite(list(grads))

    def _stateful_handle_finite_grads(self, grads: Any, trainable_variables: Any) -> None:
        variables = trainable_variables or self._trainable_variables
        if not self._grads_are_unscaled:
            skip = [self._overwrite_variable_with_gradient(v) for v in variables]
            grads = unscale(list(grads), self.dynamic_scale, skip)
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        advance(self, False, self._polyamp_config)

    def _stateful_handle_non_finite_grads(self) -> None:
        advance(self, True, self._polyamp_config)

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        raise NotImplementedError(
            "polyamp's LossScaleOptimizer keeps its state in variables (TensorFlow and PyTorch Keras backends); "
            "the JAX backend's stateless training step is not supported."
        )

    # -- serialisation -----------------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        config = self._polyamp_config
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "init_scale": config.init_scale,
            "growth_factor": config.growth_factor,
            "backoff_factor": config.backoff_factor,
            "growth_interval": config.growth_interval,
            "hysteresis": config.hysteresis,
            "min_scale": config.min_scale,
            "max_scale": config.max_scale,
            "dynamic": config.dynamic,
            "enabled": self._polyamp_enabled,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> LossScaleOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
