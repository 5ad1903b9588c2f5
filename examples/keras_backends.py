"""One Keras model, one loss-scaling optimizer, on whichever Keras backend runs: TensorFlow, JAX or PyTorch.

`model.fit` first, then the custom training step written the way that backend writes it:
TensorFlow's GradientTape, PyTorch's backward(), JAX's stateless jax.grad + stateless_apply under jax.jit.
Every loop injects one overflowing batch, which the optimizer skips (and counts).

Run: KERAS_BACKEND=jax python examples/keras_backends.py [--steps 20]
"""

from __future__ import annotations

import argparse
import math

import keras
import numpy as np

import polyamp
import polyamp_keras


def build_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(4),
            keras.layers.Softmax(),
        ]
    )


def tensorflow_loop(model, optimizer, loss_fn, batches):  # type: ignore[no-untyped-def]
    import tensorflow as tf

    @tf.function
    def train_step(x, y):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)  # unscale, check, apply or skip, update the scale
        return loss

    return [float(train_step(x, y)) for x, y in batches]


def torch_loop(model, optimizer, loss_fn, batches):  # type: ignore[no-untyped-def]
    import torch

    losses = []
    for x, y in batches:
        loss = loss_fn(y, model(x, training=True))
        optimizer.scale_loss(loss).backward()
        variables = model.trainable_variables
        with torch.no_grad():
            optimizer.apply([v.value.grad for v in variables], variables)
        for v in variables:
            v.value.grad = None
        losses.append(float(loss.detach()))
    return losses


def jax_loop(model, optimizer, loss_fn, batches):  # type: ignore[no-untyped-def]
    import jax

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    opt_values = [v.value for v in optimizer.variables]

    @jax.jit
    def train_step(trainable, non_trainable, opt_values, x, y):  # type: ignore[no-untyped-def]
        def scaled_loss(trainable):  # type: ignore[no-untyped-def]
            predictions, non_trainable_out = model.stateless_call(trainable, non_trainable, x, training=True)
            loss = loss_fn(y, predictions)
            # scale_loss reads the scale: give it the optimizer's values of this step
            with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, opt_values, strict=True))):
                return optimizer.scale_loss(loss), (loss, non_trainable_out)

        (_, (loss, non_trainable)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(trainable)
        trainable, opt_values = optimizer.stateless_apply(opt_values, grads, trainable)
        return loss, trainable, non_trainable, opt_values

    losses = []
    for x, y in batches:
        loss, trainable, non_trainable, opt_values = train_step(trainable, non_trainable, opt_values, x, y)
        losses.append(float(loss))
    for variable, value in zip(model.trainable_variables, trainable, strict=True):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, non_trainable, strict=True):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, opt_values, strict=True):
        variable.assign(value)
    return losses


LOOPS = {"tensorflow": tensorflow_loop, "torch": torch_loop, "jax": jax_loop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", default="mixed_float16")
    args = parser.parse_args()
    backend = keras.backend.backend()
    print(f"Keras {keras.__version__} on {backend}, policy {args.policy}")

    polyamp.set_policy(args.policy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * args.steps, 16)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    # model.fit: softmax and layer norm in float32 (apply_policy), float32 outputs, loss scaling, the callback.
    model = polyamp_keras.apply_policy(build_model())
    model.compile(optimizer=polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), loss=loss_fn)
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[polyamp_keras.LossScaleCallback()]).history
    print(
        f"fit: loss {history['loss'][0]:.4f} -> {history['loss'][-1]:.4f}, loss_scale {history['loss_scale'][-1]:.0f}"
    )

    # The custom step of this backend; batch 3 carries an inf, so its step is skipped.
    model = polyamp_keras.apply_policy(build_model())
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    optimizer.build(model.trainable_variables)
    batches = []
    for step in range(args.steps):
        xb = x[32 * step : 32 * (step + 1)].copy()
        if step == 3:
            xb[0, 0] = math.inf
        batches.append((keras.ops.convert_to_tensor(xb), keras.ops.convert_to_tensor(y[32 * step : 32 * (step + 1)])))
    losses = LOOPS[backend](model, optimizer, loss_fn, batches)
    finite = [v for v in losses if math.isfinite(v)]
    print(f"custom loop: loss {finite[0]:.4f} -> {finite[-1]:.4f}")
    print(
        f"loss scale {float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)):.0f}, "
        f"skipped steps {int(keras.ops.convert_to_numpy(optimizer.skipped_steps))}, "
        f"applied steps {int(keras.ops.convert_to_numpy(optimizer.iterations))}"
    )
    print(f"prediction dtype: {keras.ops.convert_to_numpy(model(x[:2])).dtype}")


if __name__ == "__main__":
    main()
