"""Keras model.fit under a polyamp policy: float16 compute, float32 variables and outputs, loss scaling.

Run: python examples/keras_fit.py [--epochs 3] [--policy mixed_float16]
"""

from __future__ import annotations

import argparse

import keras
import numpy as np

import polyamp
import polyamp_tensorflow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--policy", default="mixed_float16")
    args = parser.parse_args()

    # Keep normalisation in float32 (layer paths look like "sequential/layer_norm").
    polyamp.set_policy(args.policy, overrides={"*norm*": "float32"})
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 32)).astype("float32")
    y = (x[:, :10].argmax(axis=1)).astype("int32")

    body = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.LayerNormalization(name="layer_norm"),
            keras.layers.Dense(10),
            # A layer without weights gets no path from Keras, so overrides cannot reach it: set its dtype.
            keras.layers.Softmax(dtype="float32"),
        ]
    )
    model = polyamp_tensorflow.cast_outputs(body)  # float32 predictions without editing the last layer
    model.compile(
        optimizer=polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    print(
        f"policy {polyamp.get_policy().name}: "
        + ", ".join(f"{layer.name}={layer.compute_dtype}" for layer in body.layers)
    )
    history = model.fit(
        x, y, epochs=args.epochs, batch_size=64, verbose=0, callbacks=[polyamp_tensorflow.LossScaleCallback()]
    )
    for epoch in range(args.epochs):
        logs = {key: values[epoch] for key, values in history.history.items()}
        scale = f"loss_scale={logs['loss_scale']:.0f} " if "loss_scale" in logs else ""  # only while scaling
        print(
            f"epoch {epoch + 1}: loss={logs['loss']:.4f} accuracy={logs['accuracy']:.4f} "
            f"{scale}skipped_steps={logs['skipped_steps']}"
        )
    print(f"prediction dtype: {model.predict(x[:4], verbose=0).dtype}")
    print(f"run: {model.optimizer.summary()}")


if __name__ == "__main__":
    main()
