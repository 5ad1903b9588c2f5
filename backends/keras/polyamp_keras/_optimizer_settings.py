"""The settings a `polyamp_keras.LossScaleOptimizer` takes: polyamp's and Keras's spellings of them, and the
base-optimizer arguments it refuses."""

from __future__ import annotations

from typing import Any

from polyamp import LossScaleConfig, PolyampTypeError, PolyampValueError, SpikeRule
from polyamp.backend_api.arguments import NOT_GIVEN, check_spike, describe
from polyamp_keras._keras import keras

__all__ = ["KERAS_NAMES"]

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


def _check_spike(spike: Any) -> SpikeRule | None:
    rule = check_spike(spike)
    if rule is not None and rule.on == "loss" and keras.backend.backend() == "jax":
        raise PolyampValueError(
            "LossScaleOptimizer(spike=SpikeRule('loss')) cannot run on Keras's JAX backend: there the loss is "
            "scaled inside the gradient's trace (model.fit, jax.value_and_grad), so the optimizer never holds its "
            "value. Use SpikeRule('grad_norm', ...), which decides on the gradients the optimizer receives."
        )
    return rule
