"""A keras_hub task model with polyamp: a tiny GPT2CausalLM under "mixed_float16", trained, saved, reloaded.

The model is built from a config (no preset, nothing downloaded) and trained on random tokens.
`polyamp_keras.apply_policy` modifies the task in place (its layer norms and attention softmax in float32),
so `compile(loss="auto")`, `generate` and `save` stay; `keras.saving.load_model` gives back polyamp's
`LossScaleOptimizer` with its settings, scale and counters.

Run: python examples/keras_hub_task.py [--steps 3]   (any Keras backend: KERAS_BACKEND=jax ...)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import keras
import keras_hub
import numpy as np

import polyamp
import polyamp_keras

VOCABULARY = 64
LENGTH = 16


def build_task() -> keras_hub.models.GPT2CausalLM:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=LENGTH,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    print(f"Keras {keras.__version__} on {keras.backend.backend()}, keras_hub {keras_hub.__version__}")

    polyamp.set_policy("mixed_float16")
    lm = build_task()
    assert polyamp_keras.apply_policy(lm) is lm  # in place: the task keeps generate and compile(loss="auto")
    norm = lm.backbone.get_layer("layer_norm")
    block = lm.backbone.get_layer("transformer_layer_0")
    print(f"layer_norm computes in {norm.compute_dtype}, transformer_layer_0 in {block.compute_dtype}")
    lm.compile(optimizer=polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-3)), loss="auto")

    # Next-token prediction on random tokens: the labels are the inputs shifted by one.
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, size=(args.steps * args.batch_size, LENGTH + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((len(tokens), LENGTH), dtype=bool)}
    history = lm.fit(
        x,
        tokens[:, 1:],
        batch_size=args.batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[polyamp_keras.LossScaleCallback()],
    ).history
    print(f"fit: {args.steps} steps, loss {history['loss'][-1]:.4f}, loss_scale {history['loss_scale'][-1]:.0f}")

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gpt2_causal_lm.keras"
        lm.save(path)
        loaded = keras.saving.load_model(path)
    optimizer = loaded.optimizer
    print(
        f"loaded: {type(optimizer).__module__.split('.')[0]}.{type(optimizer).__name__}"
        f"({type(optimizer.inner_optimizer).__name__}), scale {optimizer.get_scale():.0f}, "
        f"iterations {int(keras.ops.convert_to_numpy(optimizer.iterations))}"
    )
    # keras_hub rebuilds the backbone's layers from its config: apply the per-layer policy again.
    polyamp_keras.apply_policy(loaded)

    prompt = np.zeros((1, LENGTH), dtype="int32")
    prompt[0, :4] = tokens[0, :4]
    mask = np.arange(LENGTH)[None, :] < 4
    generated = loaded.generate({"token_ids": prompt, "padding_mask": mask}, stop_token_ids=None)
    print(f"prompt {prompt[0, :4].tolist()} -> generated {np.asarray(generated['token_ids'])[0, 4:].tolist()}")


if __name__ == "__main__":
    main()
