"""What ``polyamp.check_hazards`` needs from Keras: name, dtype and max |w| of every variable of a model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import keras

from polyamp import CheckpointError, PolyampTypeError
from polyamp.backend_api import (
    DEFAULT_MAX_BYTES,
    TensorSummary,
    check_declared_bytes,
    check_zip_archive,
    chunk_indices,
    describe,
)

__all__ = ["read_tensors"]


def _is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _max_abs(value: object) -> float:
    if not keras.ops.size(value):
        return 0.0
    return float(keras.ops.convert_to_numpy(keras.ops.max(keras.ops.abs(value))))  # max propagates NaN


def _summary(name: str, dtype: str, value: object) -> TensorSummary:
    return TensorSummary(name, dtype, _max_abs(value) if _is_floating(dtype) else None)


def _dataset_max_abs(dataset: Any) -> float:
    """max |w| of an HDF5 dataset, read in blocks of at most 4 MiB (never the whole dataset at once)."""
    import numpy as np

    best = 0.0
    for index in chunk_indices(tuple(dataset.shape), dataset.dtype.itemsize):
        block = np.asarray(dataset[index])
        if block.size == 0:
            continue
        value = float(np.max(np.abs(block)))  # max propagates NaN
        if math.isnan(value):
            return value
        best = max(best, value)
    return best


def _read_weights_file(path: Path, max_bytes: int) -> list[TensorSummary]:
    import h5py  # type: ignore[import-untyped]  # Keras's own dependency for weight files

    datasets: list[tuple[str, Any]] = []

    def visit(name: str, item: object) -> None:
        if isinstance(item, h5py.Dataset) and not name.startswith("optimizer/"):
            datasets.append((name, item))

    try:
        weights = h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(
            f"Cannot read the checkpoint {str(path)!r}: h5py cannot open it as an HDF5 file ({exc}). The file is "
            "corrupt or truncated: re-download or re-save it."
        ) from exc
    with weights:
        weights.visititems(visit)
        check_declared_bytes(path, sum(int(d.size) * d.dtype.itemsize for _, d in datasets), max_bytes)
        found = []
        for name, dataset in datasets:
            dtype = str(dataset.dtype)
            found.append(TensorSummary(name, dtype, _dataset_max_abs(dataset) if _is_floating(dtype) else None))
        return found


def read_tensors(source: object, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[TensorSummary]:
    """Summaries of the variables of a Keras model or layer, or of a ``.keras`` / ``.weights.h5`` file.

    A model or layer gives each variable under its path (``"sequential/dense/kernel"``). A ``.keras`` file is
    loaded with ``keras.saving.load_model(path, compile=False)`` (custom layers must be registered, as for any
    load). A ``.weights.h5`` file holds no variable names: its datasets are read under Keras's storage paths
    (``"layers/dense/vars/0"``, named after the layer's class), and its ``optimizer/`` group (optimizer slots,
    not model weights) is not read; use the ``.keras`` file or the model for the name-based checks.

    Files are checked before they are read: a ``.weights.h5`` file's datasets may declare at most
    ``max_bytes`` in all, and are read in blocks of at most 4 MiB (a small file of compressed zeros does not
    inflate at once); a ``.keras`` archive's members may declare at most ``max_bytes`` uncompressed, and its
    ``config.json`` at most 64 MiB (`polyamp.backend_api.check_zip_archive`).

    Args:
        source: A `pathlib.Path`, or a Keras model or layer.
        max_bytes: For a path, the most bytes its tensors may declare.

    Returns:
        One summary per variable or dataset.

    Raises:
        CheckpointError: The file cannot be read, or declares more than its limits.
        PolyampTypeError: ``source`` is none of the above.
    """
    if isinstance(source, Path):
        if source.name.lower().endswith(".weights.h5"):
            return _read_weights_file(source, max_bytes)
        check_zip_archive(source, max_bytes=max_bytes)
        try:
            source = keras.saving.load_model(source, compile=False)
        except Exception as exc:
            raise CheckpointError(
                f"Cannot read the checkpoint {str(source)!r}: keras.saving.load_model(path, compile=False) failed: "
                f"{type(exc).__name__}: {exc}. "
                "Load the model yourself (with its custom_objects) and pass it."
            ) from exc
    if not isinstance(source, keras.layers.Layer):
        raise PolyampTypeError(
            f"polyamp_keras reads a Keras model or layer, or a .keras / .weights.h5 path. Received: {describe(source)}."
        )
    return [_summary(v.path, str(v.dtype), v.value) for v in source.weights]
