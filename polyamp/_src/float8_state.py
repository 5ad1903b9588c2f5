"""Delayed scaling's state in a form every framework reads: per layer, per operand, the amax history and the
scale, as plain Python floats.

Each backend keeps the state its own way (torch buffers, Keras variables, a Flax collection); a run moves
between frameworks through this dict, as the loss scaler's state does through its state dict::

    {"format": "polyamp.float8/1",
     "recipe": {...Float8Recipe.to_dict()...},
     "layers": {"<layer>": {"input": {"amax_history": [...], "scale": 0.0123},
                            "weight": {...}, "grad_output": {...}}}}

The history is newest first (`polyamp.backend_api.rules.fp8.push_amax`), the scale the dequantizing one
(``amax / max``). Layer names are the framework's own; a model rebuilt in another framework under other
names takes the dict after its ``"layers"`` keys are renamed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from polyamp._src.errors import PolyampValueError, StateDictError, describe
from polyamp._src.float8 import CAST_ROLES, Float8Recipe

__all__ = ["FLOAT8_STATE_FORMAT", "LayerState", "delayed_recipe", "pack_float8_state", "parse_float8_state"]

#: The ``"format"`` of a delayed-scaling state dict.
FLOAT8_STATE_FORMAT: Final = "polyamp.float8/1"

#: One layer's state: per operand (`CAST_ROLES`), its amax history (newest first) and its scale.
LayerState = dict[str, tuple[list[float], float]]


def delayed_recipe(recipes: Mapping[str, Float8Recipe], caller: str, apply_hint: str) -> Float8Recipe:
    """The one recipe of a model's delayed-scaling FP8 layers (``recipes``: each layer's, by name), for
    ``caller`` (``"float8_state_dict()"``, ...); ``apply_hint`` says how the backend converts a model.

    Raises:
        PolyampValueError: no layer runs delayed scaling, or they run different recipes (a state dict holds one).
    """
    delayed = {r for r in recipes.values() if r.scaling == "delayed"}
    if not delayed:
        raise PolyampValueError(
            f"{caller} needs a model with delayed-scaling FP8 layers ({apply_hint} under 'float8_delayed'); "
            "dynamic recipes keep no state."
        )
    if len(delayed) > 1:
        raise PolyampValueError(
            "The model's delayed-scaling FP8 layers run different recipes "
            f"({', '.join(sorted(r.spec for r in delayed))}); an FP8 state dict holds one. Give them one recipe."
        )
    return next(iter(delayed))


def pack_float8_state(recipe: Float8Recipe, layers: Mapping[str, LayerState]) -> dict[str, Any]:
    """The state dict of these layers (each operand's history and scale as Python floats)."""
    return {
        "format": FLOAT8_STATE_FORMAT,
        "recipe": recipe.to_dict(),
        "layers": {
            name: {
                role: {"amax_history": [float(v) for v in history], "scale": float(scale)}
                for role, (history, scale) in state.items()
            }
            for name, state in layers.items()
        },
    }


def parse_float8_state(state: object, recipe: Float8Recipe, names: Sequence[str]) -> dict[str, LayerState]:
    """The layers' state from a dict `pack_float8_state` made (in any framework), checked against the loading
    model: its delayed ``recipe`` and its FP8 layers ``names``.

    Raises:
        StateDictError: not such a dict, another format, layers missing or unknown, an operand missing, a
            history whose length is not the recipe's ``amax_history_length``, or a value that is not a
            finite number (a scale must be positive). Nothing is loaded then.
    """
    if not isinstance(state, Mapping) or state.get("format") != FLOAT8_STATE_FORMAT:
        raise StateDictError(
            f"An FP8 state dict is the dict float8_state_dict() returns, with format {FLOAT8_STATE_FORMAT!r}. "
            f"Received: {describe(state)}."
        )
    if recipe.scaling != "delayed":
        raise StateDictError(
            f"Only delayed scaling keeps FP8 state; the model's recipe is {recipe.spec!r}. Apply a 'float8_delayed' "
            "policy before loading the state."
        )
    layers = state.get("layers")
    if not isinstance(layers, Mapping):
        raise StateDictError(f"The FP8 state dict's 'layers' must be a dict. Received: {describe(layers)}.")
    missing, unknown = sorted(set(names) - set(layers)), sorted(set(layers) - set(names))
    if missing or unknown:
        raise StateDictError(
            f"The FP8 state dict's layers do not match the model's FP8 layers: missing {missing}, unknown "
            f"{unknown}. A model built in another framework names its layers its own way: rename the keys of "
            "state['layers'] to the model's names (the model's are "
            f"{list(names)[:6]}{' ...' if len(names) > 6 else ''})."
        )
    parsed: dict[str, LayerState] = {}
    for name in names:
        parsed[name] = {role: _operand(name, role, layers[name], recipe) for role in CAST_ROLES}
    return parsed


def _operand(layer: str, role: str, state: object, recipe: Float8Recipe) -> tuple[list[float], float]:
    where = f"FP8 state of layer {layer!r}, operand {role!r}"
    entry = state.get(role) if isinstance(state, Mapping) else None
    if not isinstance(entry, Mapping) or set(entry) != {"amax_history", "scale"}:
        raise StateDictError(
            f"The {where} must be a dict with 'amax_history' and 'scale'. Received: {describe(entry)}."
        )
    history, scale = entry["amax_history"], entry["scale"]
    if not isinstance(history, (list, tuple)) or len(history) != recipe.amax_history_length:
        raise StateDictError(
            f"The {where} holds an amax history of {len(history) if isinstance(history, (list, tuple)) else '?'} "
            f"values; the model's recipe keeps {recipe.amax_history_length}. Load it under a recipe with "
            f"amax_history_length={len(history) if isinstance(history, (list, tuple)) else '...'}."
        )
    values = [*history, scale]
    if not all(_finite(v) for v in values) or any(v < 0 for v in history) or not scale > 0:
        raise StateDictError(
            f"The {where} must hold finite amaxes >= 0 and a finite scale > 0. Received: history {history!r}, "
            f"scale {scale!r}."
        )
    return [float(v) for v in history], float(scale)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
