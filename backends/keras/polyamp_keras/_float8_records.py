"""What a Keras model's FP8 casts lose, counted on the device: `record_float8` and its `Float8Recorder`."""

from __future__ import annotations

from typing import Any

import numpy as np

from polyamp import PolyampValueError
from polyamp.backend_api.records import Float8CastRecord, cast_records
from polyamp.backend_api.rules import fp8
from polyamp_keras._float8 import _Float8Layer
from polyamp_keras._float8_counts import SHAPE
from polyamp_keras._keras import keras
from polyamp_keras._models import layer_paths

__all__ = ["Float8Recorder", "record_float8"]


class Float8Recorder:
    """Reads the FP8 cast counts of a model's `Float8Dense` and `Float8EinsumDense` layers (see
    `record_float8`)."""

    def __init__(self, layers: dict[str, Any]) -> None:
        self.layers = layers

    def read(self, *, reset: bool = True) -> dict[str, dict[str, Float8CastRecord]]:
        """Each layer's `polyamp.backend_api.records.Float8CastRecord` per operand (input, weight,
        grad_output) since the last read, in one host read for all layers; ``reset`` zeroes the counts."""
        if not self.layers:
            return {}
        variables = [layer.float8_counts for layer in self.layers.values()]
        digits = np.asarray(keras.ops.convert_to_numpy(keras.ops.stack([v.value for v in variables])))
        if reset:
            for variable in variables:
                variable.assign(keras.ops.zeros(SHAPE, "float32"))
        return cast_records(list(self.layers), fp8.counts_from_digits(digits.tolist()))


def record_float8(model: Any) -> Float8Recorder:
    """Count, on the device, what the FP8 layers' casts lose: for the input and weight casts of the forward
    and the grad-output cast of the backward (under MX, the grad-input matmul's), the values that saturated,
    the nonzero values flushed to zero and the nonzero values. Nothing is read to the host until
    `Float8Recorder.read`.

    The counts of a training step reach each layer's ``float8_counts`` variable as its "gradient" (Keras's
    ``overwrite_with_gradient``, the way delayed scaling's scales move), so they are counted by the optimizer
    step that takes the step's gradients, in ``fit`` and in custom loops on every Keras backend: pass the
    model's trainable variables, these included, to the optimizer, as delayed scaling requires. A forward pass
    without a backward and an optimizer step (``evaluate``, ``predict``) counts nothing, nor does a step the
    loss scaler skips. Each call of a layer delivers its previous totals with its counts, so a layer called more
    than once in a step (a shared layer) is not counted correctly.

    Args:
        model: A model `apply_policy` gave an FP8 recipe (or the model inside it), before its optimizer is
            built (the optimizer takes the variables it will update when it is built).

    Returns:
        The recorder whose ``read()`` gives ``{layer path: {operand: Float8CastRecord}}``.

    Raises:
        PolyampValueError: the model's optimizer is already built without the counts, or it accumulates
            gradients over steps (Keras keeps one step's "gradient" of such variables).

    Example:
        ```python
        records = polyamp_keras.record_float8(model)
        model.fit(x, y)
        for layer, roles in records.read().items():
            print(layer, roles["grad_output"].flushed_fraction, roles["input"].saturated)
        ```
    """
    layers: dict[str, Any] = {path: layer for path, layer in layer_paths(model) if isinstance(layer, _Float8Layer)}
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "gradient_accumulation_steps", None):
        raise PolyampValueError(
            f"record_float8 cannot count under gradient accumulation (the model's optimizer accumulates "
            f"{optimizer.gradient_accumulation_steps} steps; Keras keeps one step's counts of them). Compile the "
            "model with an optimizer without gradient_accumulation_steps to record its FP8 casts."
        )
    missing: list[Any] = [layer for layer in layers.values() if getattr(layer, "float8_counts", None) is None]
    if missing and optimizer is not None and getattr(optimizer, "built", False):
        raise PolyampValueError(
            f"The model's optimizer is already built, so it would not update the FP8 cast counts of "
            f"{len(missing)} layer(s) record_float8 adds. Call record_float8(model) before the first training "
            "step (after apply_policy), or compile the model again with a new optimizer first."
        )
    for layer in missing:
        layer._tracker.unlock()
        try:
            layer.float8_counts = layer.add_weight(
                name="float8_counts",
                shape=SHAPE,
                initializer="zeros",
                dtype="float32",
                trainable=True,
                autocast=False,
                overwrite_with_gradient=True,
            )
        finally:
            layer._tracker.lock()
    return Float8Recorder(layers)
