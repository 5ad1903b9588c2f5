"""Model outputs in the policy's output dtype: `cast_outputs` and its `OutputCast` layer.

Keras policies have no output dtype: under "mixed_float16" a model's last layer computes, and returns,
float16. Keras's advice is a final ``Activation("linear", dtype="float32")``. Doing that automatically for
every model would mean changing how Keras calls models, so polyamp offers one call instead.
"""

from __future__ import annotations

from typing import Any

# Keras exports no name for Functional models; this is where its own code imports it from.
from keras.src.models import Functional

from polyamp import Policy, PolyampTypeError, get_policy
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.policies import PolicyLike
from polyamp_keras._keras import keras

__all__ = ["OutputCast", "cast_outputs"]


@keras.saving.register_keras_serializable(package="polyamp", name="OutputCast")
class OutputCast(keras.layers.Layer):  # type: ignore[misc]
    """Casts every floating tensor of its (possibly nested) input to ``dtype``; other tensors pass through."""

    def __init__(self, dtype: str = "float32", **kwargs: Any) -> None:
        kwargs.pop("autocast", None)
        super().__init__(dtype=dtype, autocast=False, **kwargs)
        self.target_dtype = Policy(param=dtype, compute=dtype, output=dtype).output_dtype

    def call(self, inputs: Any) -> Any:
        def cast(value: Any) -> Any:
            if keras.backend.is_float_dtype(keras.backend.standardize_dtype(value.dtype)):
                return keras.ops.cast(value, self.target_dtype)
            return value

        return keras.tree.map_structure(cast, inputs)

    def compute_output_spec(self, inputs: Any) -> Any:
        def spec(value: Any) -> Any:
            dtype = value.dtype
            if keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype)):
                dtype = self.target_dtype
            return keras.KerasTensor(value.shape, dtype=dtype)

        return keras.tree.map_structure(spec, inputs)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config["dtype"] = self.target_dtype
        return config


def cast_outputs(model: Any, policy: PolicyLike | None = None) -> Any:
    """Return a model that computes like ``model`` and casts its floating outputs to the output dtype.

    Args:
        model: A Keras model (Sequential, Functional or subclassed).
        policy: Whose ``output_dtype`` to use; None uses ``polyamp.get_policy()`` (float32 for the mixed
            policies).

    Returns:
        A Functional model over ``model``'s inputs when ``model`` is Functional (its layers are shared), else
        ``keras.Sequential([model, OutputCast(...)])``. ``model`` itself is not modified.

    Example:
        ```python
        polyamp.set_policy("mixed_float16")
        model = polyamp_keras.cast_outputs(build_model())   # float16 compute, float32 predictions
        ```
    """
    if not isinstance(model, keras.Model):
        raise PolyampTypeError(f"cast_outputs() takes a Keras model. Received: {describe(model)}.")
    dtype = (get_policy() if policy is None else Policy(policy)).output_dtype
    cast = OutputCast(dtype, name=f"{model.name}_output_cast")
    if isinstance(model, keras.Sequential) or not isinstance(model, Functional):
        return keras.Sequential([model, cast], name=f"{model.name}_{dtype}_outputs")
    # model.input / model.output keep the nesting (dicts, lists) that model.inputs / model.outputs flatten.
    return keras.Model(model.input, cast(model.output), name=f"{model.name}_{dtype}_outputs")
