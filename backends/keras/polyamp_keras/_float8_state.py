"""Delayed FP8 scaling's state of a Keras model as the framework-neutral dict every polyamp backend reads
(`polyamp.backend_api.state_dicts.pack_float8_state`): the way a run moves between Keras and PyTorch or JAX.

Keras's float8 variables hold what the dict holds: ``<prefix>_amax_history`` (newest first) and
``<prefix>_scale`` (the dequantizing scale), for the prefixes ``inputs``, ``kernel`` and ``outputs_grad`` of
the operands input, weight and grad_output. Layers are named by their path within the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyamp import Float8Recipe
from polyamp.backend_api.state_dicts import LayerState, delayed_recipe, pack_float8_state, parse_float8_state
from polyamp_keras._float8 import _Float8Layer
from polyamp_keras._keras import keras
from polyamp_keras._models import layer_paths

__all__ = ["float8_state_dict", "load_float8_state_dict"]

#: Keras's variable prefix of each operand.
PREFIXES = {"input": "inputs", "weight": "kernel", "grad_output": "outputs_grad"}


def _delayed_layers(model: Any, caller: str) -> tuple[Float8Recipe, dict[str, Any]]:
    """The model's delayed-scaling FP8 layers by path, and their one recipe."""
    layers = {
        path: layer
        for path, layer in layer_paths(model)
        if isinstance(layer, _Float8Layer) and layer.float8_recipe.scaling == "delayed"
    }
    recipes = {path: layer.float8_recipe for path, layer in layers.items()}
    return delayed_recipe(recipes, caller, "polyamp_keras.apply_policy(model, ...)"), layers


def _value(variable: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable.value), np.float32)


def float8_state_dict(model: Any) -> dict[str, Any]:
    """Delayed scaling's state of ``model``'s FP8 layers (each operand's amax history and scale) as plain
    Python values that `load_float8_state_dict` of any polyamp backend (``polyamp_torch``, ``polyamp_jax``)
    loads. Keras's own checkpoints keep the same state in the layers' float8 variables.

    Args:
        model: A model `apply_policy` gave a ``float8_delayed`` recipe (or the model inside it).

    Returns:
        ``{"format": "polyamp.float8/1", "recipe": ..., "layers": {path: {operand: {"amax_history": [...],
        "scale": ...}}}}``, layers by their path within the model.

    Raises:
        PolyampValueError: the model has no delayed-scaling FP8 layer, or layers with different recipes.

    Example:
        ```python
        state = polyamp_keras.float8_state_dict(model)   # JSON-able
        polyamp_torch.load_float8_state_dict(torch_model, {**state, "layers": renamed(state["layers"])})
        ```
    """
    recipe, layers = _delayed_layers(model, "float8_state_dict()")
    state: dict[str, LayerState] = {
        name: {
            role: (
                _value(getattr(layer, f"{prefix}_amax_history")).tolist(),
                float(_value(getattr(layer, f"{prefix}_scale"))),
            )
            for role, prefix in PREFIXES.items()
        }
        for name, layer in layers.items()
    }
    return pack_float8_state(recipe, state)


def load_float8_state_dict(model: Any, state: dict[str, Any]) -> None:
    """Load a state dict `float8_state_dict` made (here or in another framework) into ``model``'s
    delayed-scaling FP8 layers, matched by their path within the model.

    Raises:
        StateDictError: a malformed dict, layers that do not match, or histories of another length (nothing
            is loaded then).
        PolyampValueError: the model has no delayed-scaling FP8 layer.
    """
    recipe, layers = _delayed_layers(model, "load_float8_state_dict()")
    parsed = parse_float8_state(state, recipe, list(layers))
    for name, layer in layers.items():
        for role, (history, scale) in parsed[name].items():
            prefix = PREFIXES[role]
            getattr(layer, f"{prefix}_amax_history").assign(np.asarray(history, np.float32))
            getattr(layer, f"{prefix}_scale").assign(np.float32(scale))
