"""Delayed scaling's state of a Flax model in the form every polyamp backend reads (`polyamp.backend_api.state_dicts`).

`polyamp_jax.Float8DotGeneral` (and Flax's own ``nn.Fp8DirectDotGeneralOp``) keep, per FP8 product, an amax
history and a scale per operand in the ``_overwrite_with_gradient`` collection under Flax's names
(``input_*``, ``kernel_*``, ``output_grad_*``). Flax's history is newest first (``roll(-1)`` then ``[0] = amax``)
and its scale is the dequantizing one (``amax / max``), as the neutral form's: the values move unchanged,
the scale's shape (1,) becoming one number. A layer is named by the path of the module holding the FP8 product,
joined by ``/`` (``"Dense_0"``, ``"encoder/head"``); a module holding several is named with each product's own
path (``"Block_0/Float8DotGeneral_1"``).

Importing this module does not import Flax.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np

from polyamp import Float8Recipe, PolyampValueError, get_policy
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.state_dicts import LayerState, pack_float8_state, parse_float8_state
from polyamp_jax._float8 import resolve_recipe

__all__ = [
    "FLAX_NAMES",
    "OVERWRITE_WITH_GRADIENT",
    "float8_state_dict",
    "layer_names",
    "load_float8_state_dict",
    "node_at",
]

#: Flax's collection of FP8 state (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``).
OVERWRITE_WITH_GRADIENT: Final = "_overwrite_with_gradient"
#: The operands' names in the collection, as Flax's ``Fp8DotGeneralBase`` calls them, by polyamp's roles.
FLAX_NAMES: Final = {"input": "input", "weight": "kernel", "grad_output": "output_grad"}
_KEYS: Final = frozenset(f"{name}_{what}" for name in FLAX_NAMES.values() for what in ("amax_history", "scale"))
_ROOT: Final = "Float8DotGeneral"

Path = tuple[str, ...]


def _scopes(node: Any, keys: frozenset[str], path: Path = ()) -> Iterator[Path]:
    """The paths of the collection's FP8 products: the dicts holding ``keys``."""
    if not isinstance(node, Mapping):
        return
    if keys <= set(node):
        yield path
    for key, child in node.items():
        yield from _scopes(child, keys, (*path, str(key)))


def layer_names(variables: Any, keys: frozenset[str] = _KEYS) -> dict[str, Path]:
    """The FP8 products of ``variables`` holding ``keys`` (delayed scaling's six variables) by layer name
    (see the module's docstring), with their paths in the collection; empty without any."""
    collection = variables.get(OVERWRITE_WITH_GRADIENT) if isinstance(variables, Mapping) else None
    paths = list(_scopes(collection, keys))
    parents = Counter(path[:-1] for path in paths)
    names: dict[str, Path] = {}
    for path in paths:
        short = path[:-1] if path[:-1] and parents[path[:-1]] == 1 else path
        names["/".join(short) or _ROOT] = path
    return names


def _layers(variables: Any, where: str) -> dict[str, Path]:
    """The delayed-scaling FP8 products of ``variables`` by layer name; refuses variables without any."""
    names = layer_names(variables)
    if not names:
        raise PolyampValueError(
            f"{where} takes a Flax model's variables holding delayed-scaling FP8 state (the "
            f"{OVERWRITE_WITH_GRADIENT!r} collection of nn.Dense(..., dot_general_cls=polyamp_jax.Float8DotGeneral) "
            f"under 'float8_delayed'). Received: {describe(variables)} without it; pass the whole variables dict "
            "(model.init's, or TrainState.params when it holds them)."
        )
    return names


def node_at(variables: Any, path: Path) -> Any:
    node = variables[OVERWRITE_WITH_GRADIENT]
    for key in path:
        node = node[key]
    return node


def _recipe(recipe: Float8Recipe | str | None, variables: Any, layers: dict[str, Path], where: str) -> Float8Recipe:
    """The delayed recipe the layers run (as `Float8DotGeneral` picks it), checked against their histories."""
    if recipe is None:
        chosen = get_policy().float8 or Float8Recipe.preset("float8_delayed")
    else:
        chosen = resolve_recipe(recipe, where=where)
    if chosen.scaling != "delayed":
        raise PolyampValueError(
            f"{where} reads delayed scaling's state; the recipe is {chosen.spec!r}, which keeps none. Pass "
            "recipe='float8_delayed' (with the model's amax_history_length)."
        )
    lengths = {
        int(np.shape(node_at(variables, path)[f"{name}_amax_history"])[0])
        for path in layers.values()
        for name in FLAX_NAMES.values()
    }
    if lengths != {chosen.amax_history_length}:
        raise PolyampValueError(
            f"{where}: the model's amax histories hold {sorted(lengths)} values, the recipe {chosen.spec!r} keeps "
            f"{chosen.amax_history_length}. Pass the model's recipe, e.g. "
            f"recipe='float8_delayed[amax_history_length={min(lengths)}]'."
        )
    return chosen


def float8_state_dict(variables: Mapping[str, Any], *, recipe: Float8Recipe | str | None = None) -> dict[str, Any]:
    """Delayed scaling's state of a Flax model (each FP8 product's amax histories and scales) as plain Python
    values that `load_float8_state_dict` of any polyamp backend loads (``polyamp_torch``, ``polyamp_keras``):
    the way a run moves between frameworks. All values are read from the device at once.

    Args:
        variables: The model's variables, with the ``_overwrite_with_gradient`` collection.
        recipe: The modules' delayed recipe (a `polyamp.Float8Recipe`, a policy text); None: as
            `Float8DotGeneral` picks it (the policy in effect's, else ``float8_delayed``).

    Raises:
        PolyampValueError: no FP8 state in ``variables``, a dynamic recipe, or histories of another length
            than the recipe's.
    """
    where = "polyamp_jax.float8_state_dict()"
    layers = _layers(variables, where)
    chosen = _recipe(recipe, variables, layers, where)
    values = jax.device_get(
        {
            name: {
                role: (node_at(variables, path)[f"{flax}_amax_history"], node_at(variables, path)[f"{flax}_scale"])
                for role, flax in FLAX_NAMES.items()
            }
            for name, path in layers.items()
        }
    )
    state: dict[str, LayerState] = {
        name: {
            role: (np.asarray(history, np.float32).tolist(), float(np.asarray(scale, np.float32).reshape(-1)[0]))
            for role, (history, scale) in roles.items()
        }
        for name, roles in values.items()
    }
    return pack_float8_state(chosen, state)


def load_float8_state_dict(
    variables: Mapping[str, Any], state: Mapping[str, Any], *, recipe: Float8Recipe | str | None = None
) -> Any:
    """New variables with a state dict `float8_state_dict` made (here or in another framework) written into
    the FP8 products' collection, matched by layer name; ``variables`` is left as it was.

    Args:
        variables: The model's variables, with the ``_overwrite_with_gradient`` collection.
        state: The state dict.
        recipe: The modules' delayed recipe, as for `float8_state_dict`.

    Returns:
        ``variables`` with the histories and scales replaced (each on its old leaf's devices, in its dtype).

    Raises:
        StateDictError: a malformed dict, layers that do not match, or histories of another length.
        PolyampValueError: no FP8 state in ``variables``, or a recipe that does not fit them.
    """
    where = "polyamp_jax.load_float8_state_dict()"
    layers = _layers(variables, where)
    parsed = parse_float8_state(state, _recipe(recipe, variables, layers, where), list(layers))
    new = variables
    for name, path in layers.items():
        for role, (history, scale) in parsed[name].items():
            flax = FLAX_NAMES[role]
            new = _replace(new, (OVERWRITE_WITH_GRADIENT, *path, f"{flax}_amax_history"), history)
            new = _replace(new, (OVERWRITE_WITH_GRADIENT, *path, f"{flax}_scale"), [scale])
    return new


def _replace(tree: Any, path: Path, values: list[float]) -> Any:
    """``tree`` with the leaf at ``path`` replaced by ``values`` (in the old leaf's dtype, shape and sharding);
    the dicts on the way are copied, in their own type (``dict`` or Flax's ``FrozenDict``)."""
    key, rest = path[0], path[1:]
    items = dict(tree)
    if rest:
        items[key] = _replace(tree[key], rest, values)
    else:
        old = tree[key]
        array = np.asarray(values, np.dtype(old.dtype)).reshape(np.shape(old))
        items[key] = jax.device_put(array, old.sharding) if isinstance(old, jax.Array) else jnp.asarray(array)
    return items if type(tree) is dict else type(tree)(items)
