"""What ``polyamp.check_hazards`` needs from Keras: name, dtype and max |w| of every variable of a model."""

from __future__ import annotations

from pathlib import Path

import keras

from polyamp import PolyampTypeError, PolyampValueError
from polyamp.backend_api import TensorSummary, describe

__all__ = ["read_tensors"]


def _is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _max_abs(value: object) -> float:
    if not keras.ops.size(value):
        return 0.0
    return float(keras.ops.convert_to_numpy(keras.ops.max(keras.ops.abs(value))))  # max propagates NaN


def _summary(name: str, dtype: str, value: object) -> TensorSummary:
    return TensorSummary(name, dtype, _max_abs(value) if _is_floating(dtype) else None)


def _read_weights_file(path: Path) -> list[TensorSummary]:
    import h5py  # type: ignore[import-untyped]  # Keras's own dependency for weight files

    found: list[TensorSummary] = []

    def visit(name: str, item: object) -> None:
        if isinstance(item, h5py.Dataset) and not name.startswith("optimizer/"):
            value = item[()]
            found.append(_summary(name, str(value.dtype), value))

    with h5py.File(path, "r") as weights:
        weights.visititems(visit)
    return found


def read_tensors(source: object) -> list[TensorSummary]:
    """Summaries of the variables of a Keras model or layer, or of a ``.keras`` / ``.weights.h5`` file.

    A model or layer gives each variable under its path (``"sequential/dense/kernel"``). A ``.keras`` file is
    loaded with ``keras.saving.load_model(path, compile=False)`` (custom layers must be registered, as for any
    load). A ``.weights.h5`` file holds no variable names: its datasets are read under Keras's storage paths
    (``"layers/dense/vars/0"``, named after the layer's class), and its ``optimizer/`` group (optimizer slots,
    not model weights) is not read; use the ``.keras`` file or the model for the name-based checks.
    """
    if isinstance(source, Path):
        if source.name.lower().endswith(".weights.h5"):
            return _read_weights_file(source)
        try:
            source = keras.saving.load_model(source, compile=False)
        except Exception as exc:
            raise PolyampValueError(
                f"keras.saving.load_model({str(source)!r}, compile=False) failed: {type(exc).__name__}: {exc}. "
                "Load the model yourself (with its custom_objects) and pass it."
            ) from exc
    if not isinstance(source, keras.layers.Layer):
        raise PolyampTypeError(
            f"polyamp_keras reads a Keras model or layer, or a .keras / .weights.h5 path. Received: {describe(source)}."
        )
    return [_summary(v.path, str(v.dtype), v.value) for v in source.weights]
