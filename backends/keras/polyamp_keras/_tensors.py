"""What ``polyamp.check_hazards`` needs from Keras: name, dtype and max |w| of every variable of a model."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import keras

from polyamp import CheckpointError, PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.checkpoints import (
    DEFAULT_MAX_BYTES,
    TensorSummary,
    check_declared_bytes,
    check_zip_archive,
    chunk_indices,
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
        names = _variable_names(weights, [name for name, _ in datasets])
        found = []
        for name, dataset in datasets:
            dtype = str(dataset.dtype)
            found.append(
                TensorSummary(names.get(name, name), dtype, _dataset_max_abs(dataset) if _is_floating(dtype) else None)
            )
        return found


#: The storage key Keras gives a BatchNormalization layer in a weights file (its class name, numbered).
_BATCH_NORMALIZATION = re.compile(r"(?:^|/)batch_normalization(?:_\d+)?$")
#: A BatchNormalization layer's variables in the order Keras stores them: the trainable ones (gamma and beta,
#: each only with scale=True / center=True), then its two statistics.
_STATISTICS = ("moving_mean", "moving_variance")


def _variable_names(weights: Any, paths: list[str]) -> dict[str, str]:
    """Names for the datasets of a weights file whose variable Keras's storage order tells: a BatchNormalization
    layer's, ``"<layer name>/moving_mean"`` as in the model (the file keeps the layer's name in an attribute of
    its ``vars`` group), so the name rules apply as to the ``.keras`` file; every other dataset keeps its path."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        group, _, index = path.rpartition("/")
        if group.endswith("/vars") and index.isdigit():
            groups.setdefault(group, []).append(path)
    names = {}
    for group, members in groups.items():
        key = group.removesuffix("/vars")
        if not _BATCH_NORMALIZATION.search(key) or not 2 <= len(members) <= 4:
            continue
        layer = str(weights[group].attrs.get("name", key.rpartition("/")[2]))
        ordered = sorted(members, key=lambda p: int(p.rpartition("/")[2]))
        # With one trainable variable the file does not say whether it is gamma or beta: it keeps its path.
        trainable = ("gamma", "beta") if len(ordered) == 4 else (None,) * (len(ordered) - 2)
        for path, variable in zip(ordered, (*trainable, *_STATISTICS), strict=True):
            if variable is not None:
                names[path] = f"{layer}/{variable}"
    return names


def read_tensors(source: object, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[TensorSummary]:
    """Summaries of the variables of a Keras model or layer, or of a ``.keras`` / ``.weights.h5`` file.

    A model or layer gives each variable under its path (``"sequential/dense/kernel"``). A ``.keras`` file is
    loaded with ``keras.saving.load_model(path, compile=False)`` (custom layers must be registered, as for any
    load). A ``.weights.h5`` file holds no variable names: its datasets are read under Keras's storage paths
    (``"layers/dense/vars/0"``, named after the layer's class), except a BatchNormalization layer's, whose storage
    order tells them (``"bn/moving_mean"``, under the layer's name, as in the model), so the name rules find its
    statistics as in the ``.keras`` file; its ``optimizer/`` group (optimizer slots, not model weights) is not
    read.

    Files are checked before they are read: a ``.weights.h5`` file's datasets may declare at most
    ``max_bytes`` in all, and are read in blocks of at most 4 MiB (a small file of compressed zeros does not
    inflate at once); a ``.keras`` archive's members may declare at most ``max_bytes`` uncompressed, and its
    ``config.json`` at most 64 MiB (`polyamp.backend_api.checkpoints.check_zip_archive`).

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
