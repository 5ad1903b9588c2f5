"""polyamp_keras.apply_policy: torch's op classes on Keras models, on every Keras backend.

In-process tests use this process's Keras backend; ``test_on_other_keras_backends`` runs the same checks
with Keras on JAX and on PyTorch in subprocesses (Keras picks its backend once per process).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402
from polyamp import PolyampTypeError, PolyampValueError  # noqa: E402

if TYPE_CHECKING:
    from conftest import KerasJson

LAYERS = keras.layers
LOW = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
X = np.random.default_rng(0).normal(size=(3, 6)).astype("float32")


def dtype_of(value: Any) -> str:
    return str(keras.backend.standardize_dtype(value.dtype))


def numpy(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


def net(name: str = "net") -> tuple[Any, dict[str, Any]]:
    """Dense -> LayerNormalization -> Dense -> Softmax, built; returns the model and its layers by name."""
    layers = {
        "d1": LAYERS.Dense(8, name="d1"),
        "ln": LAYERS.LayerNormalization(name="ln"),
        "d2": LAYERS.Dense(4, name="d2"),
        "sm": LAYERS.Softmax(name="sm"),
    }
    return keras.Sequential([keras.Input((6,)), *layers.values()], name=name), layers


def layer_by_layer(layers: dict[str, Any], x: Any) -> dict[str, Any]:
    """Each layer's output, calling the layers one after the other."""
    outputs = {}
    for name, layer in layers.items():
        x = outputs[name] = layer(x)
    return outputs


# -- the op classes: norms and softmax in float32, Dense in the compute dtype ----------------------------


@pytest.mark.parametrize("policy", list(LOW))
def test_dense_norm_dense_softmax(policy: str) -> None:
    polyamp.set_policy(policy)
    model, layers = net()
    before = {name: dtype_of(out) for name, out in layer_by_layer(layers, X).items()}
    assert before == dict.fromkeys(layers, LOW[policy])  # Keras alone: every layer returns the compute dtype

    applied = polyamp_keras.apply_policy(model)

    assert dtype_of(applied(X)) == "float32"
    outputs = layer_by_layer(layers, X)
    assert {name: dtype_of(out) for name, out in outputs.items()} == {
        "d1": LOW[policy],
        "ln": "float32",
        "d2": LOW[policy],
        "sm": "float32",
    }
    assert {name: layer.compute_dtype for name, layer in layers.items()} == {
        "d1": LOW[policy],
        "ln": "float32",
        "d2": LOW[policy],
        "sm": "float32",
    }
    assert {dtype_of(v) for v in model.weights} == {"float32"}
    # A sub-model over the layers' recorded outputs runs the same layers: the same dtypes.
    sub = keras.Model(model.inputs[0], [layer.output for layer in layers.values()])
    assert [dtype_of(out) for out in sub(X)] == [LOW[policy], "float32", LOW[policy], "float32"]
    np.testing.assert_array_equal(numpy(applied(X)), numpy(outputs["sm"]))


@pytest.mark.parametrize("policy", list(LOW))
def test_same_bits_as_keras_with_float32_layers_by_hand(policy: str) -> None:
    """apply_policy computes exactly what Keras computes with dtype='float32' given to those layers."""
    polyamp.set_policy(policy)
    model, _ = net()
    by_hand = keras.Sequential(
        [
            keras.Input((6,)),
            LAYERS.Dense(8),
            LAYERS.LayerNormalization(dtype="float32"),
            LAYERS.Dense(4),
            LAYERS.Softmax(dtype="float32"),
            LAYERS.Activation("linear", dtype="float32"),  # Keras's advice for float32 outputs
        ]
    )
    by_hand.set_weights(model.get_weights())
    applied = polyamp_keras.apply_policy(model)
    np.testing.assert_array_equal(numpy(applied(X)), numpy(by_hand(X)))
    assert dtype_of(applied(X)) == dtype_of(by_hand(X)) == "float32"


def test_the_float32_classes_match_torch() -> None:
    """Softmax, log-softmax and layer/group/RMS/unit norms return float32; BatchNormalization stays in the
    compute dtype, as torch's batch_norm does (it is on neither of CUDA autocast's lists)."""
    polyamp.set_policy("mixed_float16")
    x = np.random.default_rng(1).normal(size=(2, 4, 8)).astype("float32")
    float32 = {
        "softmax": LAYERS.Softmax(),
        "log_softmax": LAYERS.Activation("log_softmax"),
        "softmax_activation": LAYERS.Activation("softmax"),
        "layer_norm": LAYERS.LayerNormalization(),
        "group_norm": LAYERS.GroupNormalization(groups=2),
        "unit_norm": LAYERS.UnitNormalization(),
    }
    if hasattr(LAYERS, "RMSNormalization"):
        float32["rms_norm"] = LAYERS.RMSNormalization()
    low = {"batch_norm": LAYERS.BatchNormalization(), "relu": LAYERS.Activation("relu"), "dense": LAYERS.Dense(8)}
    got = {name: polyamp_keras.op_output_dtype(layer, x) for name, layer in {**float32, **low}.items()}
    assert got == {**dict.fromkeys(float32, "float32"), **dict.fromkeys(low, "float16")}


def test_float32_classes_agree_with_polyamp_torch_regions() -> None:
    """The same classification as torch under polyamp_torch.autocast (CUDA's lists, on every device)."""
    torch = pytest.importorskip("torch")
    import polyamp_torch

    pairs = {
        "softmax": (LAYERS.Softmax(), torch.nn.Softmax(-1)),
        "log_softmax": (LAYERS.Activation("log_softmax"), torch.nn.LogSoftmax(-1)),
        "layer_norm": (LAYERS.LayerNormalization(), torch.nn.LayerNorm(8)),
        "group_norm": (LAYERS.GroupNormalization(groups=2, axis=1), torch.nn.GroupNorm(2, 4)),
        "batch_norm": (LAYERS.BatchNormalization(axis=1), torch.nn.BatchNorm1d(4)),
        "unit_norm": (LAYERS.UnitNormalization(), lambda t: torch.nn.functional.normalize(t, dim=-1)),
    }
    if hasattr(LAYERS, "RMSNormalization") and hasattr(torch.nn, "RMSNorm"):
        pairs["rms_norm"] = (LAYERS.RMSNormalization(), torch.nn.RMSNorm(8))
    x = np.random.default_rng(2).normal(size=(2, 4, 8)).astype("float32")
    for policy in LOW:
        polyamp.set_policy(policy)
        for name, (keras_layer, torch_op) in pairs.items():
            with polyamp_torch.autocast(policy, device_type="cpu"):
                hidden = torch.nn.Linear(8, 8)(torch.from_numpy(x))
                expected = str(torch_op(hidden).dtype).removeprefix("torch.")
            assert polyamp_keras.op_output_dtype(keras_layer, x, policy) == expected, (policy, name)


def test_multi_head_attention_runs_its_softmax_in_float32() -> None:
    polyamp.set_policy("mixed_bfloat16")
    inputs = keras.Input((5, 8))
    attention = LAYERS.MultiHeadAttention(2, 4, name="attention")
    model = keras.Model(inputs, attention(inputs, inputs))
    applied = polyamp_keras.apply_policy(model)
    inner = attention._flatten_layers(include_self=False)
    assert {type(layer).__name__: layer.compute_dtype for layer in inner} == {
        "EinsumDense": "bfloat16",  # query, key, value and output projections
        "Softmax": "float32",
        "Dropout": "bfloat16",
    }
    x = np.random.default_rng(3).normal(size=(2, 5, 8)).astype("float32")
    assert dtype_of(attention(x, x)) == "bfloat16"  # projections and output in the compute dtype
    assert dtype_of(applied(x)) == "float32"


# -- the conformance op classes through apply_policy ----------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "float16", "bfloat16"])
def test_conformance_op_classes_through_apply_policy(policy: str) -> None:
    """softmax and layer_norm (conformance op classes of test_op_dtype) come out float32 through
    apply_policy; matmul-like ones stay in the compute dtype. Plain keras.ops calls inside a user's own
    layer (log_softmax, sum in a Lambda) are not layers apply_policy can classify: they run in the layer's
    compute dtype, which remains a documented divergence from torch."""
    low = polyamp.Policy(policy).compute_dtype
    x = np.random.default_rng(4).normal(size=(4, 8)).astype("float32")
    got = {
        "dense": polyamp_keras.op_output_dtype(LAYERS.Dense(8), x, policy),
        "softmax": polyamp_keras.op_output_dtype(LAYERS.Softmax(), x, policy),
        "layer_norm": polyamp_keras.op_output_dtype(LAYERS.LayerNormalization(), x, policy),
        "log_softmax (Lambda)": polyamp_keras.op_output_dtype(
            LAYERS.Lambda(lambda t: keras.ops.log_softmax(t, axis=-1)), x, policy
        ),
        "sum (Lambda)": polyamp_keras.op_output_dtype(LAYERS.Lambda(lambda t: keras.ops.sum(t)), x, policy),
    }
    assert got == {
        "dense": low,
        "softmax": "float32",
        "layer_norm": "float32",
        "log_softmax (Lambda)": low,
        "sum (Lambda)": low,
    }


def test_op_output_dtype_under_the_float32_policy() -> None:
    x = np.ones((2, 8), "float32")
    assert polyamp_keras.op_output_dtype(LAYERS.Softmax(), x, "float32") == "float32"
    assert polyamp_keras.op_output_dtype(LAYERS.Dense(8), x, "float32") == "float32"


# -- keep_float32 and overrides ------------------------------------------------------------------------


def nested() -> tuple[Any, Any]:
    """A Functional model with a nested Sequential block: paths 'stem', 'block', 'block/inner', 'head'."""
    block = keras.Sequential([LAYERS.Dense(8, name="inner"), LAYERS.Dense(8, name="inner_2")], name="block")
    inputs = keras.Input((6,))
    outputs = LAYERS.Dense(3, name="head")(block(LAYERS.Dense(8, name="stem")(inputs)))
    return keras.Model(inputs, outputs, name="nested"), block


@pytest.mark.parametrize(
    ("keep", "expected_float32"),
    [
        (["head"], {"head"}),  # a name
        ("head", {"head"}),  # one name alone
        (["block/inner"], {"inner"}),  # a path within the model
        (["inner"], {"inner"}),  # a nested layer's name
        (["block"], {"block", "inner", "inner_2"}),  # layers inside a kept layer inherit
        (["inner*"], {"inner", "inner_2"}),  # a pattern over names
        (["block/*"], {"inner", "inner_2"}),  # a pattern over paths
    ],
)
def test_keep_float32_by_name_path_and_pattern(keep: Any, expected_float32: set[str]) -> None:
    polyamp.set_policy("mixed_float16")
    model, block = nested()
    applied = polyamp_keras.apply_policy(model, keep_float32=keep)
    layers = [model.get_layer("stem"), block, block.get_layer("inner"), block.get_layer("inner_2")]
    layers.append(model.get_layer("head"))
    assert {layer.name for layer in layers if layer.compute_dtype == "float32"} == expected_float32
    assert dtype_of(applied(X)) == "float32"


def test_keep_float32_by_instance_and_the_head_computes_in_float32() -> None:
    polyamp.set_policy("mixed_bfloat16")
    model, layers = net()
    applied = polyamp_keras.apply_policy(model, keep_float32=[layers["d2"]])
    outputs = layer_by_layer(layers, X)
    assert {name: dtype_of(out) for name, out in outputs.items()} == dict.fromkeys(layers, "float32") | {
        "d1": "bfloat16"
    }
    assert dtype_of(applied(X)) == "float32"


@pytest.mark.parametrize(
    ("keep", "error", "message"),
    [
        (["haed"], PolyampValueError, r"keep_float32 entry 'haed' matches no layer name or path.*'stem'"),
        (["*norm*"], PolyampValueError, r"'\*norm\*' matches no layer"),
        ([LAYERS.Dense(2, name="elsewhere")], PolyampValueError, r"'elsewhere' \(Dense\), which is not in the model"),
        ([3], PolyampTypeError, r"layer names, glob patterns or layer instances. Received: .*int"),
        ([""], PolyampTypeError, r"Received: ''"),
        (3, PolyampTypeError, r"one, or an iterable of them"),
    ],
)
def test_keep_float32_mistakes_are_errors(keep: Any, error: type[Exception], message: str) -> None:
    model, _ = nested()
    before = [layer.dtype_policy for layer in model._flatten_layers()]
    with pytest.raises(error, match=message):
        polyamp_keras.apply_policy(model, "mixed_float16", keep_float32=keep)
    assert [layer.dtype_policy for layer in model._flatten_layers()] == before  # nothing changed


def test_apply_policy_takes_a_model() -> None:
    with pytest.raises(PolyampTypeError, match=r"takes a Keras model .* Received: .*Dense"):
        polyamp_keras.apply_policy(LAYERS.Dense(2))
    model, _ = net()
    with pytest.raises(polyamp.InvalidPolicyError):
        polyamp_keras.apply_policy(model, "fp16")


def test_overrides_argument_with_inheritance_and_keep_float32_winning() -> None:
    polyamp.set_policy("mixed_float16")
    model, block = nested()
    polyamp_keras.apply_policy(
        model,
        overrides=polyamp.backend_api.policies.PolicyOverrides({"block": "mixed_bfloat16", "head": "mixed_bfloat16"}),
        keep_float32=["head"],
    )
    assert {layer.name: layer.compute_dtype for layer in (model.get_layer("stem"), model.get_layer("head"))} == {
        "stem": "float16",
        "head": "float32",
    }
    assert block.compute_dtype == "bfloat16"
    assert {layer.name: layer.compute_dtype for layer in block.layers} == {
        "inner": "bfloat16",
        "inner_2": "bfloat16",
    }


def test_overrides_none_uses_the_global_ones_and_keras_paths() -> None:
    """set_policy's overrides match Keras paths ('net/d2' in a Sequential named 'net'); apply_policy keeps them."""
    polyamp.set_policy("mixed_float16", overrides={"net/d2": "float32", "ln": "mixed_bfloat16"})
    model, layers = net()
    assert layers["d2"].compute_dtype == "float32"  # from the setting, when d2 was built
    shared_map = layers["d1"].dtype_policy
    assert isinstance(shared_map, polyamp_keras.PolicyOverridesMap)
    before = dict(shared_map._policy_map)
    polyamp_keras.apply_policy(model)
    assert {name: layer.compute_dtype for name, layer in layers.items()} == {
        "d1": "float16",
        "ln": "float32",  # a float32 class, whatever its policy
        "d2": "float32",  # the global override, found by its Keras path
        "sm": "float32",
    }
    assert dict(shared_map._policy_map) == before  # the map other layers share is left as it was
    assert polyamp_keras.apply_policy(model, overrides={}).layers[0].get_layer("d2").compute_dtype == "float16"


# -- the model: shared layers, outputs, nesting, re-applying ----------------------------------------------


def test_returns_a_model_sharing_the_layers() -> None:
    polyamp.set_policy("mixed_float16")
    model, layers = net()
    applied = polyamp_keras.apply_policy(model)
    assert applied.layers[0] is model and [layer.name for layer in applied.layers] == ["net", "net_output_cast"]
    assert applied.get_layer("net").get_layer("ln") is layers["ln"]
    assert dtype_of(model(X)) == "float32"  # the original's layers got the policies: its Softmax is float32
    assert applied.dtype_policy.name == "mixed_float16"


def test_functional_outputs_keep_their_structure() -> None:
    polyamp.set_policy("mixed_bfloat16")
    inputs = {"a": keras.Input((6,), name="a"), "b": keras.Input((6,), name="b")}
    hidden = LAYERS.Dense(4, name="mix")(LAYERS.Concatenate()([inputs["a"], inputs["b"]]))
    outputs = {"probs": LAYERS.Softmax(name="probs")(hidden), "ids": keras.ops.argmax(hidden, axis=-1)}
    model = keras.Model(inputs, outputs)
    applied = polyamp_keras.apply_policy(model)
    result = applied({"a": X, "b": X})
    assert dtype_of(result["probs"]) == "float32" and "int" in dtype_of(result["ids"])
    assert applied.get_layer("mix") is model.get_layer("mix")


def test_subclassed_and_unbuilt_models() -> None:
    polyamp.set_policy("mixed_float16")

    class Classifier(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(name="classifier")
            self.body = LAYERS.Dense(8, name="body")
            self.norm = LAYERS.LayerNormalization(name="norm")
            self.head = LAYERS.Dense(3, name="head")

        def call(self, x: Any) -> Any:
            return self.head(self.norm(self.body(x)))

    sequential = keras.Sequential([LAYERS.Dense(8, name="body"), LAYERS.LayerNormalization(name="norm")])
    for model in (Classifier(), sequential):
        assert not model.built
        applied = polyamp_keras.apply_policy(model, keep_float32=["*norm*"])
        assert (model.get_layer("body").compute_dtype, model.get_layer("norm").compute_dtype) == ("float16", "float32")
        assert dtype_of(model.get_layer("norm")(model.get_layer("body")(X))) == "float32"
        if isinstance(model, Classifier):
            # Its own class: modified in place and returned, no output cast (the head computes in float16).
            assert applied is model and model.dtype_policy.name == "mixed_float16"
            assert dtype_of(applied(X)) == "float16"
            assert polyamp_keras.apply_policy(model, keep_float32=["head"]) is model
            assert dtype_of(model(X)) == "float32"
        else:
            assert applied is not model and applied.layers[0] is model and dtype_of(applied(X)) == "float32"


def test_subclasses_of_keras_containers_are_modified_in_place() -> None:
    """Subclasses of Sequential and of Functional models keep their class and methods; plain ones are rebuilt."""
    polyamp.set_policy("mixed_float16")

    class Stack(keras.Sequential):  # type: ignore[misc]
        def describe(self) -> str:
            return "stack"

    class Graph(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            inputs = keras.Input((6,))
            super().__init__(inputs, LAYERS.Softmax(name="sm")(LAYERS.Dense(4, name="d")(inputs)), name="graph")

        def describe(self) -> str:
            return "graph"

    stack = Stack([keras.Input((6,)), LAYERS.Dense(4, name="d"), LAYERS.Softmax(name="sm")])
    for model in (stack, Graph()):
        applied = polyamp_keras.apply_policy(model)
        assert applied is model and applied.describe() in ("stack", "graph")
        assert (model.get_layer("d").compute_dtype, model.get_layer("sm").compute_dtype) == ("float16", "float32")
    functional = keras.Model(stack.inputs, stack.outputs)
    assert type(polyamp_keras.apply_policy(functional)) is type(functional)
    assert polyamp_keras.apply_policy(functional) is not functional


def test_applying_again_replaces_the_earlier_application() -> None:
    polyamp.set_policy("mixed_float16")
    model, layers = net()
    first = polyamp_keras.apply_policy(model, keep_float32=["d2"])
    second = polyamp_keras.apply_policy(first, "mixed_bfloat16")
    assert second.layers[0] is model and len(second.layers) == 2  # unwrapped, not cast twice
    assert {name: layer.compute_dtype for name, layer in layers.items()} == {
        "d1": "bfloat16",
        "ln": "float32",
        "d2": "bfloat16",
        "sm": "float32",
    }
    functional, _ = nested()
    again = polyamp_keras.apply_policy(polyamp_keras.apply_policy(functional), keep_float32=["head"])
    casts = [layer for layer in again.layers if isinstance(layer, polyamp_keras.OutputCast)]
    assert len(casts) == 1 and again.get_layer("head").compute_dtype == "float32"


def test_the_policy_is_fixed_when_applied() -> None:
    """Keras layers keep their policy until it is set again: a later set_policy reaches new layers only."""
    polyamp.set_policy("mixed_float16")
    model, layers = net()
    applied = polyamp_keras.apply_policy(model)
    polyamp.set_policy("mixed_bfloat16")
    assert layers["d1"].compute_dtype == "float16" and dtype_of(layers["d1"](X)) == "float16"
    polyamp_keras.apply_policy(applied)  # follows the policy in effect now
    assert layers["d1"].compute_dtype == "bfloat16"


def test_policy_none_uses_keras_own_setting_when_polyamp_has_none() -> None:
    assert polyamp.get_policy_setting().source == "default"
    from keras.src.backend.common import global_state

    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model, layers = net()
        applied = polyamp_keras.apply_policy(model)
    finally:
        global_state.set_global_attribute("dtype_policy", None)
    assert layers["d1"].compute_dtype == "bfloat16" and applied.dtype_policy.name == "mixed_bfloat16"
    assert dtype_of(applied(X)) == "float32"


def test_built_variables_keep_their_dtype_with_a_warning() -> None:
    """Under 'float16' variables are float16; a layer kept in float32 afterwards reads them cast."""
    polyamp.set_policy("float16")
    model, layers = net()
    with pytest.warns(UserWarning, match=r"cannot change dtype.*'d2' \(float16, not float32\)"):
        applied = polyamp_keras.apply_policy(model, keep_float32=["d2"])
    assert {dtype_of(v) for v in layers["d2"].weights} == {"float16"}
    assert (layers["d2"].compute_dtype, layers["ln"].compute_dtype) == ("float32", "float32")
    assert dtype_of(layer_by_layer(layers, X)["d2"]) == "float32"
    assert dtype_of(applied(X)) == "float16"  # the policy's output dtype
    unbuilt = keras.Sequential([LAYERS.Dense(4, name="d")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        polyamp_keras.apply_policy(unbuilt, keep_float32=["d"])
    unbuilt.build((None, 6))
    assert {dtype_of(v) for v in unbuilt.weights} == {"float32"}  # created for the policy they were given


# -- saving and training --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(LOW))
def test_save_and_load_round_trip(policy: str, tmp_path: Path) -> None:
    polyamp.set_policy(policy)
    model, _ = net()
    applied = polyamp_keras.apply_policy(model, keep_float32=["d2"])
    path = tmp_path / "applied.keras"
    applied.save(path)
    polyamp.set_policy("float32")  # the saved layers' policies are in the file, not taken from the setting
    loaded = keras.models.load_model(path)
    inner = loaded.get_layer("net")
    assert {layer.name: layer.compute_dtype for layer in inner.layers} == {
        "d1": LOW[policy],
        "ln": "float32",
        "d2": "float32",
        "sm": "float32",
    }
    np.testing.assert_array_equal(numpy(loaded(X)), numpy(applied(X)))
    assert dtype_of(loaded(X)) == "float32"
    functional, _ = nested()
    polyamp.set_policy(policy)
    applied = polyamp_keras.apply_policy(functional)
    applied.save(tmp_path / "functional.keras")
    loaded = keras.models.load_model(tmp_path / "functional.keras")
    np.testing.assert_array_equal(numpy(loaded(X)), numpy(applied(X)))


@pytest.mark.parametrize("policy", list(LOW))
def test_fit_runs_a_step(policy: str) -> None:
    polyamp.set_policy(policy)
    model, _ = net()
    applied = polyamp_keras.apply_policy(model)
    applied.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    before = [numpy(v).copy() for v in model.trainable_weights]
    history = applied.fit(X, np.array([0, 1, 2]), epochs=1, batch_size=3, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert all(not np.array_equal(b, numpy(v)) for b, v in zip(before, model.trainable_weights, strict=True))
    assert (type(applied.optimizer).__name__ == "LossScaleOptimizer") == (policy == "mixed_float16")
    assert dtype_of(applied.predict(X, verbose=0)) == "float32"


# -- other Keras backends -------------------------------------------------------------------------------

OTHER_BACKEND = """
import json, tempfile, warnings
import numpy as np
import keras, polyamp, polyamp_keras
keras.utils.set_random_seed(0)  # the initial weights (fit's first step at a scale of 2**15 must not overflow)
L = keras.layers
x = np.random.default_rng(0).normal(size=(3, 6)).astype("float32")
dt = lambda v: str(keras.backend.standardize_dtype(v.dtype))
result = {"backend": keras.backend.backend()}
for policy in ("mixed_float16", "mixed_bfloat16"):
    polyamp.set_policy(policy)
    layers = [L.Dense(8, name="d1"), L.LayerNormalization(name="ln"), L.Dense(4, name="d2"), L.Softmax(name="sm")]
    model = keras.Sequential([keras.Input((6,)), *layers], name="net")
    applied = polyamp_keras.apply_policy(model)
    out, h = {}, x
    for layer in layers:
        h = layer(h)
        out[layer.name] = dt(h)
    sub = keras.Model(model.inputs[0], [layer.output for layer in layers])
    r = {"output": dt(applied(x)), "layers": out, "sub": [dt(o) for o in sub(x)],
         "computes": {layer.name: layer.compute_dtype for layer in layers}}
    polyamp_keras.apply_policy(model, keep_float32=["d2"])
    r["keep name"] = layers[2].compute_dtype
    polyamp_keras.apply_policy(model, keep_float32=["*1"])
    r["keep pattern"] = [layers[0].compute_dtype, layers[2].compute_dtype]
    polyamp_keras.apply_policy(model, keep_float32=[layers[2]])
    r["keep instance"] = [layers[0].compute_dtype, layers[2].compute_dtype]
    try:
        polyamp_keras.apply_policy(model, keep_float32=["dd2"])
        r["typo"] = "no error"
    except polyamp.PolyampValueError as exc:
        r["typo"] = str(exc)[:48]
    applied = polyamp_keras.apply_policy(model)
    with tempfile.TemporaryDirectory() as tmp:
        applied.save(tmp + "/m.keras")
        loaded = keras.models.load_model(tmp + "/m.keras")
    r["loaded equal"] = bool(np.array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(applied(x))))
    r["loaded computes"] = {l.name: l.compute_dtype for l in loaded.get_layer("net").layers}
    applied.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    before = [np.array(keras.ops.convert_to_numpy(v)) for v in model.trainable_weights]
    loss = applied.fit(x, np.array([0, 1, 2]), epochs=1, batch_size=3, verbose=0).history["loss"][0]
    r["fit"] = [bool(np.isfinite(loss)), all(not np.array_equal(b, keras.ops.convert_to_numpy(v))
                for b, v in zip(before, model.trainable_weights)), type(applied.optimizer).__name__]
    xs = np.random.default_rng(4).normal(size=(4, 8)).astype("float32")
    r["ops"] = {
        "softmax": polyamp_keras.op_output_dtype(L.Softmax(), xs, policy),
        "layer_norm": polyamp_keras.op_output_dtype(L.LayerNormalization(), xs, policy),
        "dense": polyamp_keras.op_output_dtype(L.Dense(8), xs, policy),
        "log_softmax (Lambda)": polyamp_keras.op_output_dtype(L.Lambda(lambda t: keras.ops.log_softmax(t)), xs, policy),
        "sum (Lambda)": polyamp_keras.op_output_dtype(L.Lambda(lambda t: keras.ops.sum(t)), xs, policy),
    }
    x3 = np.random.default_rng(1).normal(size=(2, 4, 8)).astype("float32")
    classes = {"log_softmax": L.Activation("log_softmax"), "group_norm": L.GroupNormalization(groups=2),
               "unit_norm": L.UnitNormalization(), "rms_norm": L.RMSNormalization(), "batch_norm": L.BatchNormalization()}
    r["classes"] = {name: polyamp_keras.op_output_dtype(layer, x3, policy) for name, layer in classes.items()}
    inputs = keras.Input((4, 8))
    attention = L.MultiHeadAttention(2, 4)
    applied = polyamp_keras.apply_policy(keras.Model(inputs, attention(inputs, inputs)))
    r["attention"] = [dt(attention(x3, x3)), dt(applied(x3)),
                      sorted({type(l).__name__ + ":" + l.compute_dtype for l in attention._flatten_layers()})]
    result[policy] = r
print(json.dumps(result))
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_on_other_keras_backends(backend: str, keras_json: KerasJson) -> None:
    pytest.importorskip(backend)
    result = keras_json(OTHER_BACKEND, backend=backend)
    assert result.pop("backend") == backend
    for policy, low in LOW.items():
        assert result[policy] == {
            "output": "float32",
            "layers": {"d1": low, "ln": "float32", "d2": low, "sm": "float32"},
            "sub": [low, "float32", low, "float32"],
            "computes": {"d1": low, "ln": "float32", "d2": low, "sm": "float32"},
            "keep name": "float32",
            "keep pattern": ["float32", low],
            "keep instance": [low, "float32"],
            "typo": "keep_float32 entry 'dd2' matches no layer name o",
            "loaded equal": True,
            "loaded computes": {"d1": low, "ln": "float32", "d2": low, "sm": "float32"},
            "fit": [True, True, "LossScaleOptimizer" if policy == "mixed_float16" else "SGD"],
            "ops": {
                "softmax": "float32",
                "layer_norm": "float32",
                "dense": low,
                "log_softmax (Lambda)": low,
                "sum (Lambda)": low,
            },
            "classes": {
                "log_softmax": "float32",
                "group_norm": "float32",
                "unit_norm": "float32",
                "rms_norm": "float32",
                "batch_norm": low,
            },
            "attention": [
                low,
                "float32",
                [f"Dropout:{low}", f"EinsumDense:{low}", f"MultiHeadAttention:{low}", "Softmax:float32"],
            ],
        }, policy


def test_input_integer_and_quantized_layers_keep_their_policies() -> None:
    polyamp.set_policy("mixed_bfloat16")
    inputs = keras.Input((6,), dtype="int32")
    hashing = LAYERS.Hashing(num_bins=5, name="hashing")
    quantized = LAYERS.Dense(4, name="quantized")
    outputs = quantized(LAYERS.Embedding(5, 3, name="embed")(hashing(inputs)))
    model = keras.Model(inputs, outputs)
    quantized.quantize("int8")
    policies = {layer.name: layer.dtype_policy.name for layer in (hashing, quantized, model.layers[0])}
    applied = polyamp_keras.apply_policy(model, "mixed_float16")
    assert {layer.name: layer.dtype_policy.name for layer in (hashing, quantized, model.layers[0])} == policies
    assert model.get_layer("embed").compute_dtype == "float16"
    assert dtype_of(applied(np.arange(12, dtype="int32").reshape(2, 6))) == "float32"
