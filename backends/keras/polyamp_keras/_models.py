"""Per-layer precision for Keras models: `apply_policy`, Keras's counterpart of ``polyamp_torch.apply_policy``.

A Keras dtype policy gives every layer one compute dtype, so under ``"mixed_float16"`` a ``Softmax`` or
``LayerNormalization`` returns float16, and so does the model. torch's CUDA autocast (and polyamp's torch
regions, on every device) classify ops instead: matmuls and convolutions run in the low dtype; softmax,
log-softmax and layer/group/RMS norms in float32. `apply_policy` gives a Keras model the same op classes,
layer by layer, with the same arguments as the torch function:

* every floating layer computes in the policy's compute dtype;
* the layers standing for torch's float32 ops (`FLOAT32_LAYERS`, and ``Activation`` layers applying
  softmax or log-softmax) compute in float32, so they return float32 as torch's ops do; ``BatchNormalization``
  keeps the compute dtype, as torch's ``batch_norm`` does (it is on neither of CUDA's lists);
* chosen layers (``keep_float32``) run in float32 and others under their own policy (``overrides``);
* the model's floating outputs are cast to the policy's output dtype (Keras's own containers, see below).

Layers get their policy through Keras's own per-layer ``dtype_policy``. Keras's own containers (a
``keras.Sequential`` or plain Functional model) are rebuilt with the output cast as a layer added after the
model, so the result saves and loads like any Keras model; models of their own class (subclassed models,
keras_hub tasks) are modified in place and returned, keeping their API, without the output cast.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from keras.dtype_policies import DTypePolicy, DTypePolicyMap

# Keras exports no name for Functional models; this is where its own code imports it from.
from keras.src.models import Functional

import polyamp
import polyamp.backend_api
from polyamp import OpClass, Policy, PolyampTypeError, PolyampValueError, op_class
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.policies import OverridesLike, PolicyLike, PolicyOverrides
from polyamp_keras import _float8
from polyamp_keras._keras import keras
from polyamp_keras._outputs import OutputCast
from polyamp_keras._policies import to_keras_policy

__all__ = ["FLOAT32_LAYERS", "LAYER_OPS", "apply_policy", "op_output_dtype"]

LAYER_OPS: Mapping[str, str] = MappingProxyType(
    {
        "Softmax": "softmax",
        "LayerNormalization": "layer_norm",
        "GroupNormalization": "group_norm",
        "RMSNormalization": "rms_norm",
        "UnitNormalization": "norm",
        "Dense": "dense",
        "EinsumDense": "matmul",
        "Conv1D": "conv",
        "Conv2D": "conv",
        "Conv3D": "conv",
        "Conv1DTranspose": "conv_transpose",
        "Conv2DTranspose": "conv_transpose",
        "Conv3DTranspose": "conv_transpose",
        "MultiHeadAttention": "attention",
    }
)
"""Keras layers and activations that stand for an op of polyamp's op-class table
(`polyamp.backend_api.policies.OP_CLASSES`), by the table's name. ``UnitNormalization`` divides by the norm, as
``F.normalize`` does."""
_ACTIVATION_OPS = {"softmax": "softmax", "log_softmax": "log_softmax"}

FLOAT32_LAYERS: tuple[type, ...] = tuple(
    getattr(keras.layers, name)
    for name, op in LAYER_OPS.items()
    if op_class(op, strict=True) is OpClass.FLOAT32 and hasattr(keras.layers, name)
)
"""Keras layers that compute in float32 under every policy once `apply_policy` has run: those standing for the table's
float32 ops (``RMSNormalization`` where this Keras has it)."""
_FLOAT32_ACTIVATIONS = tuple(
    getattr(keras.activations, name)
    for name, op in _ACTIVATION_OPS.items()
    if op_class(op, strict=True) is OpClass.FLOAT32
)
_FLOAT32 = Policy("float32")


def computes_in_float32(layer: Any) -> bool:
    """Whether `apply_policy` runs ``layer`` in float32 whatever the policy (its op class is float32 in torch)."""
    if isinstance(layer, FLOAT32_LAYERS):
        return True
    return isinstance(layer, keras.layers.Activation) and any(
        getattr(layer, "activation", None) is fn for fn in _FLOAT32_ACTIVATIONS
    )


def _is_output_cast(layer: Any) -> bool:
    return isinstance(layer, OutputCast)


def _children(layer: Any) -> list[Any]:
    """The layers ``layer`` tracks directly (Keras has no public accessor below ``Model.layers``)."""
    return [
        child
        for child in layer._flatten_layers(include_self=False, recursive=False)
        if not isinstance(child, keras.layers.InputLayer)
    ]


def _unwrap(model: Any) -> Any:
    """The model inside an `apply_policy` (or ``cast_outputs``) result, else ``model`` itself."""
    if not _rebuilds(model):
        return model  # results are plain Sequential or Functional models
    if isinstance(model, keras.Sequential):
        layers = model.layers
        if len(layers) == 2 and isinstance(layers[0], keras.Model) and _is_output_cast(layers[1]):
            return layers[0]
        return model
    if isinstance(model, Functional):
        # The output cast was called once, on the whole output structure: its one call's argument is the
        # model's own output (KerasTensor._keras_history and Node.arguments are how Keras records this).
        operations = {id(op): op for op in _producers(model.output)}
        if len(operations) == 1:
            (cast,) = operations.values()
            if _is_output_cast(cast) and len(cast._inbound_nodes) == 1:
                inner_outputs = cast._inbound_nodes[0].arguments.args[0]
                return keras.Model(model.input, inner_outputs, name=model.name.removesuffix("_outputs"))
    return model


def _producers(outputs: Any) -> list[Any]:
    histories = [getattr(tensor, "_keras_history", None) for tensor in keras.tree.flatten(outputs)]
    return [getattr(history, "operation", None) for history in histories]


def _policy_in_effect() -> Policy:
    """The policy a layer built now gets: polyamp's, or Keras's own where that is the one Keras follows."""
    setting = polyamp.get_policy_setting()
    keras_default = keras.config.dtype_policy()
    if isinstance(keras_default, DTypePolicyMap):
        keras_default = keras_default.default_policy
    ours = setting.policy
    if (keras_default.variable_dtype, keras_default.compute_dtype) == (ours.param_dtype, ours.compute_dtype):
        return ours  # polyamp's setting (Keras's policies carry no output dtype; polyamp's does)
    return Policy(keras_default)  # keras.config.set_dtype_policy(...) without polyamp, or the later setting


def _own_variables(layer: Any, children: list[Any]) -> list[Any]:
    inner = {id(v) for child in children for v in child.weights}
    return [v for v in layer.weights if id(v) not in inner]


def _set_policy(layer: Any, policy: DTypePolicy) -> None:
    if isinstance(layer.dtype_policy, DTypePolicyMap):
        # Built under polyamp overrides (or Keras's own map): the setter would write this layer's path into
        # the map, which every layer built under that setting shares. Give the layer its own policy instead.
        layer._dtype_policy = policy
    else:
        layer.dtype_policy = policy


def _reset_compiled_functions(model: Any) -> None:
    # Keras caches its traced train/test/predict functions (keras_hub's CausalLM its generate function);
    # they would keep the dtypes they were traced with.
    for name in ("train_function", "test_function", "predict_function", "generate_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


def _rebuilds(model: Any) -> bool:
    """Whether `apply_policy` returns a new model around ``model`` (True) or ``model`` itself (False).

    Keras's own containers are rebuilt with an output cast: a model whose class is ``keras.Sequential``
    or Keras's Functional class (``keras.Model(inputs, outputs)``), or an earlier `apply_policy` /
    `cast_outputs` result. A model of any other class (a subclass of ``keras.Model``, ``keras.Sequential``
    or a Functional model, such as every keras_hub task and backbone) has its own methods, ``compile``,
    ``train_step`` or ``get_config``, which a wrapper would drop: it is modified in place and returned.
    """
    return type(model) in (keras.Sequential, Functional)


def apply_policy(
    model: Any,
    policy: PolicyLike | None = None,
    *,
    keep_float32: Iterable[str | Any] | str | Any = (),
    overrides: OverridesLike | None = None,
) -> Any:
    """Compute ``model`` under a policy, layer by layer as torch's autocast classifies ops; cast its outputs.

    Each layer of ``model`` (nested layers and models included) gets a Keras dtype policy:

    * layers matched by ``keep_float32``: float32 (variables and compute);
    * layers matched by ``overrides``: their own policy; layers inside a matched layer inherit it unless
      matched themselves;
    * other floating layers: ``policy``;
    * whatever the above, layers in `FLOAT32_LAYERS` (``Softmax``, ``LayerNormalization``,
      ``GroupNormalization``, ``RMSNormalization``, ``UnitNormalization``) and ``Activation`` layers applying
      softmax or log-softmax compute in float32 (their variables keep the policy's parameter dtype), so
      they return float32 as torch's softmax, log_softmax and norms do under autocast.

    Under a policy with an FP8 recipe (``"mixed_bfloat16+float8_delayed"``), the built ``Dense`` and
    ``EinsumDense`` layers the recipe takes become `Float8Dense` / `Float8EinsumDense` (their matmuls in FP8;
    the recipe's patterns match the path within the model); see the FP8 guide.

    Input layers, layers computing in a non-floating dtype (lookups, hashing) and quantized layers keep
    their policy. The policies are set on ``model``'s own layers (``model`` computes that way from now on
    too), and ``model``'s own dtype policy becomes ``policy`` (so ``compile`` adds Keras's loss scaling
    under ``"mixed_float16"`` unless given a loss-scale optimizer such as `LossScaleOptimizer`). What is
    returned depends on ``model``'s class:

    * Keras's own containers, a model whose class is ``keras.Sequential`` or Keras's Functional class
      (``keras.Model(inputs, outputs)``), are rebuilt: the returned model shares their layers and weights
      and adds a cast of the floating outputs to the policy's output dtype (float32 for the mixed
      policies). Keep using the returned model; applying again, to ``model`` or to the result, replaces
      the earlier application.
    * A model of any other class (subclassed models, subclasses of ``keras.Sequential`` or of Functional
      models, e.g. keras_hub's ``CausalLM``, ``TextClassifier`` and their backbones) is modified in place
      and returned itself, so its own API stays: ``generate``, ``compile(loss="auto")``, a custom
      ``train_step``. No output cast is added: its outputs come in the dtype its last layers compute in
      (Keras losses cast them to their own dtype, float32 unless given); name the output layer in ``keep_float32``,
      or call `cast_outputs` (a wrapper without that API), for float32 outputs.

    Either result saves and loads with ``model.save`` / ``keras.models.load_model`` and trains with
    ``compile`` / ``fit``. A model that creates its layers from its own config when loaded (keras_hub's
    backbones do) comes back with the policy of that config for every layer: apply again after loading.

    Keras fixes a layer's policy until it is set again, so the policy is fixed when this runs: a later
    ``polyamp.set_policy`` reaches layers built afterwards, not this model. Call ``apply_policy`` again to
    follow it. Variables already created keep their dtype (Keras variables cannot change dtype): a built
    layer whose variables differ from the parameter dtype it should get keeps them and computes in the
    compute dtype, reading them cast (a warning lists such layers); apply before building (or build under
    the policy, e.g. in ``polyamp.policy_scope``) to get the policy's parameter dtype. Layers a model
    creates later (in ``build`` or ``call``) are not reached: apply after building such models.

    Args:
        model: A Keras model (Sequential, Functional or subclassed, keras_hub tasks included), built or not.
        policy: The policy; None means the policy in effect now, i.e. what a layer built now gets:
            ``polyamp.get_policy()``, or Keras's own ``keras.config.set_dtype_policy(...)`` where that is
            the setting Keras follows (see `follow_polyamp_policy`).
        keep_float32: Layer names, paths within the model (``"block/dense"``), glob patterns over either
            (``"*norm*"``, ``"encoder/*"``), or layer instances to keep in float32.
        overrides: Per-layer policies (`polyamp.backend_api.policies.PolicyOverrides` or a mapping), matched
            with polyamp's rule against each layer's path within the model and its Keras path (``layer.path``, which
            ``set_policy(..., overrides=...)`` matches when a layer is built); None uses the overrides of
            ``polyamp.get_policy_setting()``. ``keep_float32`` wins where both match.

    Returns:
        For a ``keras.Sequential`` or plain Functional ``model``: a model computing like ``model`` (sharing
        its layers and weights) whose floating outputs are in the policy's output dtype, a Functional model
        over ``model``'s inputs when ``model`` is Functional, else ``keras.Sequential([model,
        OutputCast(...)])``. For a model of any other class: ``model`` itself, modified in place.

    Raises:
        PolyampTypeError: ``model`` is not a Keras model, or ``keep_float32`` holds something else than
            names, patterns and layers.
        PolyampValueError: a ``keep_float32`` layer is not in ``model``, or a name or pattern matches no
            layer (a typo would otherwise silently keep nothing in float32).

    Example:
        ```python
        polyamp.set_policy("mixed_float16")
        model = polyamp_keras.apply_policy(build_model(), keep_float32=["head"])
        model(x)   # float32 outputs; Dense/Conv in float16; softmax, norms and the head in float32
        ```
    """
    if not isinstance(model, keras.Model):
        raise PolyampTypeError(
            f"apply_policy() takes a Keras model (Sequential, Functional or subclassed). Received: {describe(model)}. "
            "Wrap a single layer in keras.Sequential([layer]) first."
        )
    root_policy = _policy_in_effect() if policy is None else Policy(policy)
    override_map = polyamp.get_policy_setting().overrides if overrides is None else PolicyOverrides(overrides)
    inner = _unwrap(model)

    nodes, children_of = _walk(inner)

    keep_ids, keep_patterns = _parse_keep_float32(keep_float32, nodes)
    effective: dict[int, Policy] = {id(inner): root_policy}
    mismatched: list[str] = []
    for path, layer, parent in nodes:
        if id(layer) in keep_ids or any(
            fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(layer.name, p) for p in keep_patterns
        ):
            own: Policy | None = _FLOAT32
        else:
            own = override_map.match(path)
            if own is None and isinstance(layer.path, str) and layer.path:
                own = override_map.match(layer.path)
        effective[id(layer)] = own or effective[id(parent)]
    # The FP8 plan refuses what it cannot convert before any layer changes.
    float8_plan = _float8.plan_layers([(path, layer, effective[id(layer)].float8) for path, layer, _ in nodes])
    _give_policy(inner, root_policy, children_of[id(inner)], type(inner).__name__, mismatched)
    for path, layer, _ in nodes:
        _give_policy(layer, effective[id(layer)], children_of[id(layer)], path, mismatched)
    _float8.convert_layers(float8_plan)
    if mismatched:
        warnings.warn(
            "Keras variables cannot change dtype, so these built layers keep theirs and compute in the policy's "
            f"compute dtype, reading them cast: {', '.join(mismatched)}. Apply the policy before building the "
            "model (or build it under the policy, e.g. in polyamp.policy_scope) to create them in the policy's "
            "parameter dtype.",
            UserWarning,
            stacklevel=2,
        )
    for layer in (inner, *(layer for _, layer, _ in nodes)):
        if isinstance(layer, keras.Model):
            _reset_compiled_functions(layer)
    if not _rebuilds(inner):
        return inner  # its own class: modified in place, its API (methods, compile, train_step) kept
    return _with_output_cast(inner, root_policy)


def _walk(inner: Any) -> tuple[list[tuple[str, Any, Any]], dict[int, list[Any]]]:
    """Each layer below ``inner`` once, breadth first, as ``(path within the model, layer, parent)``; and the
    children of each layer by its id."""
    nodes: list[tuple[str, Any, Any]] = []
    seen = {id(inner)}
    children_of: dict[int, list[Any]] = {}
    pending: list[tuple[Any, str]] = [(inner, "")]
    while pending:
        parent, prefix = pending.pop(0)
        children_of[id(parent)] = _children(parent)
        for child in children_of[id(parent)]:
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}/{child.name}" if prefix else child.name
            nodes.append((path, child, parent))
            pending.append((child, path))
    return nodes, children_of


def layer_paths(model: Any) -> list[tuple[str, Any]]:
    """Each layer of ``model`` (inside an `apply_policy` result) by its path within the model, the names
    `apply_policy`'s patterns and the FP8 recipe's skip patterns match."""
    return [(path, layer) for path, layer, _ in _walk(_unwrap(model))[0]]


def _parse_keep_float32(keep_float32: Any, nodes: list[tuple[str, Any, Any]]) -> tuple[set[int], list[str]]:
    if isinstance(keep_float32, (str, keras.layers.Layer)):
        keep_float32 = [keep_float32]
    elif not isinstance(keep_float32, Iterable):
        raise PolyampTypeError(
            "keep_float32 takes layer names, glob patterns or layer instances (one, or an iterable of them). "
            f"Received: {describe(keep_float32)}."
        )
    ids = {id(layer) for _, layer, _ in nodes}
    keep_ids: set[int] = set()
    patterns: list[str] = []
    for item in keep_float32:
        if isinstance(item, keras.layers.Layer):
            if id(item) not in ids:
                raise PolyampValueError(
                    f"keep_float32 holds the layer {item.name!r} ({type(item).__name__}), which is not in the model "
                    "passed to apply_policy(). Pass layers of that model (or their names)."
                )
            keep_ids.add(id(item))
        elif isinstance(item, str) and item:
            if not any(
                fnmatch.fnmatchcase(path, item) or fnmatch.fnmatchcase(layer.name, item) for path, layer, _ in nodes
            ):
                raise PolyampValueError(
                    f"keep_float32 entry {item!r} matches no layer name or path in the model. Paths look like "
                    f"{[path for path, _, _ in nodes][:6]}; patterns may use * and ?."
                )
            patterns.append(item)
        else:
            raise PolyampTypeError(
                f"keep_float32 takes layer names, glob patterns or layer instances. Received: {describe(item)}."
            )
    return keep_ids, patterns


def _give_policy(layer: Any, policy: Policy, children: list[Any], where: str, mismatched: list[str]) -> None:
    """Set ``layer``'s Keras dtype policy for ``policy`` (float32 compute for the float32 op classes)."""
    if _is_output_cast(layer) or layer.quantization_mode is not None:
        return
    if not keras.backend.is_float_dtype(layer.compute_dtype):
        return
    param, compute = policy.param_dtype, policy.compute_dtype
    if computes_in_float32(layer):
        compute = "float32"
    if layer.built and layer.variable_dtype != param:
        own = [v for v in _own_variables(layer, children) if keras.backend.is_float_dtype(v.dtype)]
        if own:
            mismatched.append(f"{where!r} ({keras.backend.standardize_dtype(own[0].dtype)}, not {param})")
            param = layer.variable_dtype
    _set_policy(layer, to_keras_policy(Policy(param=param, compute=compute, output=compute)))


def _with_output_cast(inner: Any, policy: Policy) -> Any:
    dtype = policy.output_dtype
    cast = OutputCast(dtype, name=f"{inner.name}_output_cast")
    if isinstance(inner, keras.Sequential) or not isinstance(inner, Functional):
        result = keras.Sequential([inner, cast], name=f"{inner.name}_outputs")
    else:
        # model.input / model.output keep the nesting (dicts, lists) that model.inputs / model.outputs flatten.
        result = keras.Model(inner.input, cast(inner.output), name=f"{inner.name}_outputs")
    # compile() reads the model's own policy (Keras wraps the optimizer for loss scaling under mixed_float16).
    _set_policy(result, to_keras_policy(policy))
    return result


def op_output_dtype(layer: Any, inputs: Any, policy: PolicyLike | None = None) -> str:
    """The dtype ``layer`` returns in a model given ``policy`` by `apply_policy`, after a Dense layer.

    For conformance harnesses: ``op_output_dtype(keras.layers.Softmax(), x, "mixed_float16")`` is the dtype
    of the "softmax" op class through `apply_policy` (float32). The Dense layer in front puts the activations
    in the compute dtype, as inside a model. Both layers are built under ``policy``.

    Args:
        layer: The layer standing for the op (it must take the Dense layer's output, shaped like ``inputs``).
        inputs: A float32 array or tensor, at least 2-D; its last dimension is the Dense layer's width.
        policy: The policy; None means the policy in effect (as for `apply_policy`).

    Returns:
        The output dtype's name, e.g. ``"float32"``.
    """
    resolved = _policy_in_effect() if policy is None else Policy(policy)
    with polyamp.policy_scope(resolved):
        dense = keras.layers.Dense(int(keras.ops.shape(inputs)[-1]))
        # Unbuilt: the layers get their policies first, then create their variables in its parameter dtype.
        apply_policy(keras.Sequential([dense, layer]), resolved, overrides={})
        output = layer(dense(inputs))
    return str(keras.backend.standardize_dtype(output.dtype))
