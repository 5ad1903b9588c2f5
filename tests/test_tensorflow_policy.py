"""polyamp policies drive Keras 3: the global dtype policy in either import order, overrides, outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_tensorflow  # noqa: E402
from polyamp import Policy, PolyampTypeError  # noqa: E402

LAYERS = keras.layers
# A clean environment for subprocesses, but the same packages: the tree under test, not another install.
SEARCH_PATH = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}


@pytest.fixture(autouse=True)
def reset_policy() -> Iterator[None]:
    yield
    polyamp.set_policy("float32")


def dense_dtypes() -> tuple[str, str]:
    layer = LAYERS.Dense(2)
    layer.build((None, 3))
    return layer.compute_dtype, layer.kernel.dtype


@pytest.mark.parametrize(
    "order",
    [
        "policy_then_keras",
        pytest.param("keras_then_policy", marks=pytest.mark.slow),
        pytest.param("backend_then_policy", marks=pytest.mark.slow),
    ],
)
def test_keras_follows_the_policy_in_either_import_order(order: str) -> None:
    steps = {
        "policy_then_keras": "import polyamp\npolyamp.set_policy('mixed_float16')\nimport keras\n",
        "keras_then_policy": "import keras\nimport polyamp\npolyamp.set_policy('mixed_float16')\n",
        "backend_then_policy": "import polyamp, polyamp_tensorflow, keras\npolyamp.set_policy('mixed_float16')\n",
    }[order]
    code = steps + textwrap.dedent(
        """
        import json, sys
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        print(json.dumps([keras.config.dtype_policy().name, layer.compute_dtype, layer.kernel.dtype,
                          "polyamp_tensorflow" in sys.modules]))
        """
    )
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin", **SEARCH_PATH}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    policy, compute, variable, _ = json.loads(out.stdout.strip().splitlines()[-1])
    assert (policy, compute, variable) == ("mixed_float16", "float16", "float32")


@pytest.mark.slow  # Keras on another backend, in a subprocess
def test_keras_on_torch_without_tensorflow_follows_the_policy(run_without: Any) -> None:
    """Keras 3 runs without TensorFlow; polyamp's policy hook needs only Keras."""
    pytest.importorskip("torch")

    code = """
    import json, polyamp
    polyamp.set_policy("mixed_bfloat16", overrides={"head": "float32"})
    import keras
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, name="head")(keras.layers.Dense(3, name="body")(inputs))
    model = keras.Model(inputs, outputs)
    import polyamp_tensorflow
    print(json.dumps([keras.backend.backend(), [layer.compute_dtype for layer in model.layers[1:]],
                      polyamp_tensorflow.to_keras_policy(polyamp.Policy("float16")).name]))
    """
    env = {"KERAS_BACKEND": "torch", "PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "3", **SEARCH_PATH}
    out = run_without("tensorflow", code, env=env)
    assert json.loads(out.strip().splitlines()[-1]) == ["torch", ["bfloat16", "float32"], "float16"]


def test_set_policy_and_scope_drive_the_keras_global_policy() -> None:
    polyamp.set_policy("mixed_bfloat16")
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert dense_dtypes() == ("bfloat16", "float32")
    with polyamp.policy_scope("float16"):
        assert dense_dtypes() == ("float16", "float16")
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    polyamp.set_policy("float32")
    assert dense_dtypes() == ("float32", "float32")


@pytest.mark.parametrize(
    ("spec", "variable", "compute"),
    [
        ("float32", "float32", "float32"),
        ("mixed_float16", "float32", "float16"),
        ("mixed_bfloat16", "float32", "bfloat16"),
        ("float16", "float16", "float16"),
        ("bfloat16", "bfloat16", "bfloat16"),
        ("c=f16,o=f16", "float32", "float16"),
        ("p=bf16,c=bf16,o=f32", "bfloat16", "bfloat16"),
        ("p=bf16,c=f16", "bfloat16", "float16"),
    ],
)
def test_every_policy_maps_to_a_keras_policy(spec: str, variable: str, compute: str) -> None:
    keras_policy = polyamp_tensorflow.to_keras_policy(Policy(spec))
    assert (keras_policy.variable_dtype, keras_policy.compute_dtype) == (variable, compute)
    polyamp.set_policy(spec)
    assert dense_dtypes() == (compute, variable)


def test_overrides_by_name_pattern_and_ancestor() -> None:
    polyamp.set_policy("mixed_float16", overrides={"head": "float32", "*norm*": "float32", "mymodel/block": "bfloat16"})

    inputs = keras.Input((4,))
    body = LAYERS.Dense(8, name="body")(inputs)
    outputs = LAYERS.Dense(2, name="head")(LAYERS.LayerNormalization(name="post_norm")(body))
    functional = keras.Model(inputs, outputs)
    assert {layer.name: layer.compute_dtype for layer in functional.layers[1:]} == {
        "body": "float16",
        "post_norm": "float32",
        "head": "float32",
    }
    assert functional.get_layer("head").kernel.dtype == "float32"

    class MyModel(keras.Model):
        def __init__(self) -> None:
            super().__init__(name="mymodel")
            self.block = keras.Sequential([LAYERS.Dense(3, name="deep")], name="block")
            self.out_layer = LAYERS.Dense(1, name="out")

        def call(self, x: Any) -> Any:
            return self.out_layer(self.block(x))

    model = MyModel()
    model(np.ones((1, 4), "float32"))
    assert model.block.layers[0].path == "mymodel/block/deep"
    assert model.block.layers[0].compute_dtype == "bfloat16"  # inherited from "mymodel/block"
    assert model.out_layer.compute_dtype == "float16"


def test_layers_without_a_path_take_the_default_policy() -> None:
    """Keras assigns paths in build(); weightless layers with the default build never get one."""
    polyamp.set_policy("mixed_float16", overrides={"*softmax*": "float32"})
    model = keras.Sequential([keras.Input((4,)), LAYERS.Dense(3), LAYERS.Softmax(name="softmax")])
    assert model.layers[-1].path is None
    assert model.layers[-1].compute_dtype == "float16"
    assert LAYERS.Softmax(dtype="float32").compute_dtype == "float32"  # the documented remedy


def test_model_with_overrides_saves_and_loads(tmp_path: Path) -> None:
    polyamp.set_policy("mixed_float16", overrides={"head": "float32"})
    inputs = keras.Input((4,))
    outputs = LAYERS.Dense(2, name="head")(LAYERS.Dense(8, name="body")(inputs))
    model = keras.Model(inputs, outputs)
    path = tmp_path / "overrides.keras"
    model.save(path)
    polyamp.set_policy("float32")
    loaded = keras.models.load_model(path)
    assert loaded.get_layer("head").compute_dtype == "float32"
    assert loaded.get_layer("body").compute_dtype == "float16"


def test_cast_outputs_functional_and_original_unchanged(tmp_path: Path) -> None:
    polyamp.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    outputs = {"logits": LAYERS.Dense(3)(inputs), "ids": keras.ops.argmax(LAYERS.Dense(3)(inputs), axis=-1)}
    model = keras.Model(inputs, outputs)
    x = np.ones((2, 4), "float32")
    assert model(x)["logits"].dtype == "float16"
    cast = polyamp_tensorflow.cast_outputs(model)
    result = cast(x)
    assert result["logits"].dtype == "float32" and "int" in str(result["ids"].dtype)
    assert model(x)["logits"].dtype == "float16"
    assert cast.layers[1] is model.layers[1]  # layers are shared, not copied
    path = tmp_path / "cast.keras"
    cast.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x)["logits"]), keras.ops.convert_to_numpy(result["logits"])
    )


def test_cast_outputs_sequential_and_subclassed() -> None:
    polyamp.set_policy("mixed_bfloat16")
    sequential = keras.Sequential([LAYERS.Dense(3), LAYERS.Dense(2)])

    class Sub(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = LAYERS.Dense(2)

        def call(self, x: Any) -> Any:
            return self.dense(x)

    x = np.ones((1, 4), "float32")
    for model in (sequential, Sub()):
        assert model(x).dtype == "bfloat16"
        assert polyamp_tensorflow.cast_outputs(model)(x).dtype == "float32"
    assert polyamp_tensorflow.cast_outputs(sequential, "bfloat16")(x).dtype == "bfloat16"


def test_cast_outputs_needs_a_model() -> None:
    with pytest.raises(PolyampTypeError, match="takes a Keras model"):
        polyamp_tensorflow.cast_outputs(LAYERS.Dense(2))


@pytest.mark.parametrize("name", ["float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16"])
def test_keras_dtype_policies_are_accepted_as_polyamp_policies(name: str) -> None:
    assert polyamp.Policy(keras.DTypePolicy(name)) == polyamp.Policy(name)
    polyamp.set_policy(keras.DTypePolicy(name))
    assert polyamp.get_policy().name == name


def test_a_keras_dtype_is_not_a_policy() -> None:
    with pytest.raises(polyamp.PolyampTypeError, match=r"A dtype is not a policy.*'mixed_float16'"):
        polyamp.set_policy(tf.float16)  # type: ignore[arg-type]
