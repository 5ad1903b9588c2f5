"""Keras training-step time: polyamp's LossScaleOptimizer against keras.mixed_precision.LossScaleOptimizer.

Both wrap the same inner optimizer and run the same compiled train step (tf.function, optionally XLA) on
the same model; variants are timed in interleaved rounds, median reported with the ratio to Keras's.

Run: python benchmarks/keras_step.py [--width 512] [--iters 50] [--rounds 7] [--jit]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import polyamp

polyamp.set_policy("mixed_float16")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import polyamp_tensorflow  # noqa: E402


def build(width: int, depth: int) -> Any:
    keras.utils.set_random_seed(0)
    layers: list[Any] = [keras.Input((width,))]
    for _ in range(depth):
        layers += [keras.layers.Dense(width, activation="gelu"), keras.layers.LayerNormalization()]
    return keras.Sequential(layers)


def make_step(variant: str, width: int, depth: int, jit: bool) -> Any:
    model = build(width, depth)
    inner = keras.optimizers.Adam(1e-4)
    if variant == "keras":
        optimizer = keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=2.0**16)
    else:
        optimizer = polyamp_tensorflow.LossScaleOptimizer(inner)
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=jit)
    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32)))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--jit", action="store_true")
    args = parser.parse_args()
    device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    print(
        f"device {device} ({platform.machine()}), TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"python {platform.python_version()}, jit_compile={args.jit}"
    )
    print(f"model {args.depth} x (Dense {args.width} gelu + LayerNorm), batch {args.batch}, mixed_float16, Adam")
    x = tf.random.normal((args.batch, args.width))
    steps = {name: make_step(name, args.width, args.depth, args.jit) for name in ("keras", "polyamp")}
    for step in steps.values():
        for _ in range(5):
            step(x).numpy()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.iters):
                loss = step(x)
            loss.numpy()
            times[name].append((time.perf_counter() - start) / args.iters * 1e3)
    native = statistics.median(times["keras"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:>8}: {median:.3f} ms/iteration ({median / native:.3f}x)")


if __name__ == "__main__":
    main()
