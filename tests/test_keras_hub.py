"""keras_hub task models with polyamp: apply_policy in place, LossScaleOptimizer through fit, save and load.

``scenario`` runs the whole story on one Keras backend and returns what it saw; the in-process tests run it
on this process's Keras backend (TensorFlow by default), ``test_on_other_keras_backends`` on JAX and PyTorch
in subprocesses (Keras picks its backend once per process). Models are built from configs: nothing is
downloaded.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402

if TYPE_CHECKING:
    from conftest import KerasJson

HERE = Path(__file__).resolve()
VOCABULARY, LENGTH, BATCH = 32, 8, 2
SETTINGS = {"growth_interval": 2, "backoff_factor": 0.25, "hysteresis": 1}
#: The backbones' size: one block, two heads, width 16.
BACKBONE = {
    "vocabulary_size": VOCABULARY,
    "num_layers": 1,
    "num_heads": 2,
    "hidden_dim": 16,
    "intermediate_dim": 32,
    "max_sequence_length": LENGTH,
}


def gpt2() -> Any:
    keras.utils.set_random_seed(0)
    return keras_hub.models.GPT2CausalLM(backbone=keras_hub.models.GPT2Backbone(**BACKBONE), preprocessor=None)


def bert_classifier() -> Any:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(**BACKBONE)
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The optimizer's variables (its own and the inner optimizer's slots) in order, as lists (a loaded
    optimizer's names may carry other numbers)."""
    return [np.asarray(keras.ops.convert_to_numpy(v)).tolist() for v in optimizer.variables]


def round_trip(model: Any, folder: Path) -> Any:
    model.save(folder / f"{model.name}.keras")
    return keras.saving.load_model(folder / f"{model.name}.keras")


def saved_and_loaded(model: Any, loaded: Any) -> dict[str, Any]:
    before, after = model.optimizer, loaded.optimizer
    return {
        "type": f"{type(after).__module__.split('.')[0]}.{type(after).__name__}",
        "inner": type(after.inner_optimizer).__name__,
        "config equal": after.get_config() == before.get_config(),
        "state equal": after.state_dict() == before.state_dict(),
        "variables equal": optimizer_variables(after) == optimizer_variables(before),
        "skipped": int(keras.ops.convert_to_numpy(after.skipped_steps)),
        "iterations": int(keras.ops.convert_to_numpy(after.iterations)),
        "scale": after.get_scale(),
    }


def scenario(folder: str) -> dict[str, Any]:
    """The story on this process's Keras backend; returns what it saw (JSON-serialisable)."""
    polyamp.set_policy("mixed_float16")
    result: dict[str, Any] = {"backend": keras.backend.backend()}

    # apply_policy keeps the task: same object, its API, per-layer policies in place.
    lm = gpt2()
    applied = polyamp_keras.apply_policy(lm)
    block = lm.backbone.get_layer("transformer_layer_0")
    result["applied"] = {
        "same object": applied is lm,
        "class": type(applied).__name__,
        "layer_norm": lm.backbone.get_layer("layer_norm").compute_dtype,
        "block": block.compute_dtype,
        "softmax": sorted(
            {layer.compute_dtype for layer in lm._flatten_layers() if isinstance(layer, keras.layers.Softmax)}
        ),
    }

    # fit with polyamp's optimizer, loss="auto"; batch 1 carries an infinite sample weight: its step overflows.
    lm.compile(optimizer=polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-3), **SETTINGS), loss="auto")
    result["loss"] = type(lm.loss).__name__
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, size=(4 * BATCH, LENGTH + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((len(tokens), LENGTH), dtype=bool)}
    weights = np.ones((len(tokens), LENGTH), dtype="float32")
    weights[BATCH : 2 * BATCH] = np.inf
    lm.fit(x, tokens[:, 1:], sample_weight=weights, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    result["records"] = [[r.iteration, r.skipped, r.reason, r.scale] for r in lm.optimizer.records()]

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "compile() was not called", no unloaded variables
        loaded = round_trip(lm, Path(folder))
    result["gpt2 loaded"] = saved_and_loaded(lm, loaded)
    result["loaded layer_norm"] = loaded.backbone.get_layer("layer_norm").compute_dtype
    result["reapplied"] = polyamp_keras.apply_policy(loaded) is loaded
    result["reapplied layer_norm"] = loaded.backbone.get_layer("layer_norm").compute_dtype

    prompt = np.zeros((1, LENGTH), dtype="int32")
    prompt[0, :3] = tokens[0, :3]
    generated = loaded.generate(
        {"token_ids": prompt, "padding_mask": np.arange(LENGTH)[None, :] < 3}, stop_token_ids=None
    )
    ids = np.asarray(keras.ops.convert_to_numpy(generated["token_ids"]))
    result["generate"] = {
        "shape": list(ids.shape),
        "prompt kept": ids[0, :3].tolist() == tokens[0, :3].tolist(),
        "in vocabulary": bool(((ids >= 0) & (ids < VOCABULARY)).all()),
        "mask": np.asarray(keras.ops.convert_to_numpy(generated["padding_mask"])).all().item(),
    }

    # A BertTextClassifier: the round trip (its compile defaults to loss="auto" too), state set by hand.
    classifier = bert_classifier()
    classifier.compile(optimizer=polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-3), **SETTINGS))
    classifier.optimizer.build(classifier.trainable_variables)
    classifier.optimizer.load_state_dict({**classifier.optimizer.state_dict(), "scale": 512.0, "_growth_tracker": 1})
    for slot in classifier.optimizer.inner_optimizer.variables[1:]:
        slot.assign(keras.ops.full(slot.shape, 0.5, dtype=slot.dtype))
    result["classifier loaded"] = saved_and_loaded(classifier, round_trip(classifier, Path(folder)))
    if keras.backend.backend() != "tensorflow":  # on TensorFlow: test_post_norm_model_on_tensorflow
        result["classifier applied"] = fit_bert_applied()
    return result


def bert_batch() -> tuple[dict[str, Any], Any]:
    tokens = np.random.default_rng(1).integers(1, VOCABULARY, size=(4, LENGTH)).astype("int32")
    inputs = {
        "token_ids": tokens,
        "segment_ids": np.zeros((4, LENGTH), dtype="int32"),
        "padding_mask": np.ones((4, LENGTH), dtype=bool),
    }
    return inputs, np.array([0, 1, 0, 1])


def fit_bert_applied() -> list[Any]:
    """apply_policy on a BertTextClassifier (post-norm blocks: a layer norm's output is a residual), one
    fit step; returns [same object, skipped steps]."""
    classifier = bert_classifier()
    same = polyamp_keras.apply_policy(classifier) is classifier
    classifier.compile(
        optimizer=polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss="auto",
        # JAX and PyTorch eagerly: the dtypes are checked here (the GPT2 fit runs the compiled step).
        run_eagerly=keras.backend.backend() != "tensorflow",
    )
    classifier.fit(*bert_batch(), batch_size=4, epochs=1, verbose=0)
    return [same, int(keras.ops.convert_to_numpy(classifier.optimizer.skipped_steps))]


def check(result: dict[str, Any]) -> None:
    """The exact outcome of `scenario`, the same on every backend."""
    assert result["applied"] == {
        "same object": True,
        "class": "GPT2CausalLM",
        "layer_norm": "float32",
        "block": "float16",
        "softmax": ["float32"],
    }
    assert result["loss"] == "SparseCategoricalCrossentropy"
    # growth_interval=2: step 0 finite; step 1 overflows (2**16 * 0.25); steps 2 and 3 grow it once.
    assert result["records"] == [
        [0, False, None, 65536.0],
        [1, True, "overflow", 65536.0],
        [2, False, None, 16384.0],
        [3, False, None, 16384.0],
    ]
    assert result["gpt2 loaded"] == {
        "type": "polyamp_keras.LossScaleOptimizer",
        "inner": "Adam",
        "config equal": True,
        "state equal": True,
        "variables equal": True,
        "skipped": 1,
        "iterations": 3,
        "scale": 32768.0,
    }
    # keras_hub rebuilds the backbone's layers from its config; apply_policy again restores the float32 norms.
    assert (result["loaded layer_norm"], result["reapplied"], result["reapplied layer_norm"]) == (
        "float16",
        True,
        "float32",
    )
    assert result["generate"] == {"shape": [1, LENGTH], "prompt kept": True, "in vocabulary": True, "mask": True}
    if result["backend"] != "tensorflow":
        assert result["classifier applied"] == [True, 0]
    assert result["classifier loaded"] == {
        "type": "polyamp_keras.LossScaleOptimizer",
        "inner": "Adam",
        "config equal": True,
        "state equal": True,
        "variables equal": True,
        "skipped": 0,
        "iterations": 0,
        "scale": 512.0,
    }


def test_scenario_on_this_backend(tmp_path: Path) -> None:
    result = scenario(str(tmp_path))
    assert result["backend"] == keras.backend.backend()
    check(result)


@pytest.mark.xfail(
    keras.backend.backend() == "tensorflow",
    raises=TypeError,
    strict=True,
    reason="post-norm blocks add a float32 layer norm output to a float16 tensor with a raw `+`, which "
    "TensorFlow refuses (JAX and PyTorch promote to float32); README: keras_hub task models",
)
def test_post_norm_model_on_tensorflow() -> None:
    polyamp.set_policy("mixed_float16")
    assert fit_bert_applied() == [True, 0]


def test_other_compiles_load_as_keras_loads_them(tmp_path: Path) -> None:
    """Without polyamp's optimizer in the saved compile, a task loads as with Keras alone (its default
    compile, Keras's warning that compile() was not called)."""
    polyamp.set_policy("mixed_float16")
    classifier = bert_classifier()
    classifier.compile(optimizer=keras.optimizers.SGD(0.5))
    with pytest.warns(UserWarning, match=r"`compile\(\)` was not called as part of model loading"):
        loaded = round_trip(classifier, tmp_path)
    assert not isinstance(loaded.optimizer, polyamp_keras.LossScaleOptimizer)
    assert not isinstance(loaded.optimizer, keras.optimizers.SGD)


def test_a_custom_compile_that_cannot_take_the_saved_arguments(tmp_path: Path) -> None:
    """A model whose compile takes other arguments than Keras's is left to Keras (a warning, no compile)."""
    polyamp.set_policy("float32")

    @keras.saving.register_keras_serializable(package="polyamp_tests")
    class Narrow(keras.Model):  # type: ignore[misc]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(2)

        def call(self, x: Any) -> Any:
            return self.dense(x)

        def compile(self, optimizer: Any) -> None:  # type: ignore[override]
            super().compile(optimizer=optimizer, loss="mse")

    @keras.saving.register_keras_serializable(package="polyamp_tests")
    class Wide(Narrow):
        def compile(self, optimizer: Any = "sgd", **kwargs: Any) -> None:  # type: ignore[override]
            keras.Model.compile(self, optimizer=optimizer, **kwargs)

    for cls, restored in ((Narrow, False), (Wide, True)):
        model = cls()
        model(np.ones((1, 3), dtype="float32"))
        model.compile(optimizer=polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), growth_interval=5))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = round_trip(model, tmp_path)
        assert isinstance(getattr(loaded, "optimizer", None), polyamp_keras.LossScaleOptimizer) is restored
        assert any("compile()` was not called" in str(w.message) for w in caught) is not restored
        if restored:
            assert loaded.optimizer.loss_scale_config.growth_interval == 5


OTHER_BACKEND = """
import json, sys, importlib.util
import torch  # before TensorFlow (keras_hub imports it) in one process
spec = importlib.util.spec_from_file_location("keras_hub_scenario", {path!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps(module.scenario(sys.argv[1])))
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_on_other_keras_backends(backend: str, tmp_path: Path, keras_json: KerasJson) -> None:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    result = keras_json(OTHER_BACKEND.format(path=str(HERE)), str(tmp_path), backend=backend)
    assert result["backend"] == backend
    check(result)
