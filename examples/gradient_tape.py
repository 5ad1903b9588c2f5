"""The mixed-precision custom training loop of the TensorFlow AMP guide (tf.keras 2 style), on Keras 3
with polyamp: only the optimizer class changes.

Keras 3's own LossScaleOptimizer would divide the gradients by the loss scale a second time in this loop;
polyamp's recognises gradients that get_unscaled_gradients already unscaled.

Run: python examples/gradient_tape.py [--steps 30] [--policy mixed_float16] [--scaler]
(--scaler uses polyamp.LossScaler's scale / apply_gradients instead of the optimizer's methods)
"""

from __future__ import annotations

import argparse

import polyamp

polyamp.set_policy("mixed_float16")  # before building layers; keras may be imported before or after

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import polyamp_tensorflow  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--scaler", action="store_true")
    args = parser.parse_args()
    polyamp.set_policy(args.policy)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 20)).astype("float32")
    y = (x[:, :5].argmax(axis=1)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=0).batch(64).repeat()

    model = polyamp_tensorflow.cast_outputs(
        keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(5)])
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    if args.scaler:
        optimizer = keras.optimizers.Adam(1e-3)
        scaler = polyamp.LossScaler()  # binds to TensorFlow on first use

        @tf.function
        def train_step(inputs: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(inputs, training=True))
                scaled = scaler.scale(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            scaler.apply_gradients(optimizer, zip(grads, model.trainable_variables))
            return loss

        def scale() -> float:
            return scaler.get_scale()
    else:
        optimizer = polyamp_tensorflow.LossScaleOptimizer(keras.optimizers.Adam(1e-3))

        @tf.function
        def train_step(inputs: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                predictions = model(inputs, training=True)
                loss = loss_fn(labels, predictions)
                scaled_loss = optimizer.get_scaled_loss(loss)
            scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
            gradients = optimizer.get_unscaled_gradients(scaled_gradients)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        def scale() -> float:
            return optimizer.get_scale()

    print(f"policy {polyamp.get_policy().name}, {'LossScaler' if args.scaler else 'LossScaleOptimizer'}")
    for step, (inputs, labels) in enumerate(dataset.take(args.steps), start=1):
        loss = train_step(inputs, labels)
        if step % 10 == 0 or step == args.steps:
            print(f"step {step}: loss={float(loss):.4f} scale={scale():.0f}")
    print(f"output dtype: {model(x[:2]).dtype}")


if __name__ == "__main__":
    main()
