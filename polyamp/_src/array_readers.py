"""The tensor readers of `polyamp.check_hazards` for arrays no framework backend owns: NumPy arrays, nested in
dicts, lists and tuples (a params tree saved by a JAX program), and ``.npz`` files.

NumPy is imported when one of these is read, never at ``import polyamp``; a tree of NumPy arrays means NumPy is
imported already. Other array types that NumPy reads (``__array__``) are read the same way; JAX's own pytrees
(Flax NNX states and modules, optax states) are ``polyamp_jax``'s reader's, which names them by their pytree paths.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from polyamp._src.checkpoints import CORRUPT_FILE, check_declared_bytes, chunk_indices
from polyamp._src.errors import BackendNotInstalledError, CheckpointError

__all__ = ["array_leaves", "is_array", "read_array_tree", "read_npz", "summarize_array"]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:  # pragma: no cover - NumPy comes with every framework polyamp supports
        raise BackendNotInstalledError(
            "Reading arrays or .npz files needs NumPy, which is not installed. Install it with: pip install numpy"
        ) from exc
    return numpy


def is_array(value: object) -> bool:
    """Whether ``value`` is an array NumPy can read: it has a dtype, a shape and ``__array__``."""
    return hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "shape")


def summarize_array(name: str, array: Any) -> tuple[str, str, float | None]:
    """``(name, dtype, max |w|)`` of an array NumPy can read: max |w| for floating dtypes (``float*``,
    ``bfloat16`` and the float8 types of ``ml_dtypes``), computed in float32 blocks of at most 4 MiB (NaN if any
    element is NaN, 0.0 if empty), None for others."""
    np = _numpy()
    values = np.asarray(array)
    dtype = str(values.dtype)
    if not dtype.startswith(("float", "bfloat")):
        return name, dtype, None
    best = 0.0
    for index in chunk_indices(values.shape, values.dtype.itemsize):
        block = values[index].astype(np.float32)
        if block.size == 0:
            continue
        value = float(np.max(np.abs(block)))  # max propagates NaN
        if math.isnan(value):
            return name, dtype, value
        best = max(best, value)
    return name, dtype, best


def array_leaves(tree: object, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(name, array)`` for each array in nested mappings, lists and tuples, depth first, names joined with
    ``/`` (``"params/Dense_0/kernel"``; a list's items by index, a named tuple's by field). Other leaves (numbers,
    strings, None) hold no weights and are passed over; each container is visited once."""
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [(prefix, tree)]
    while stack:
        name, node = stack.pop()
        if is_array(node):
            yield name, node
            continue
        if id(node) in seen:
            continue
        if isinstance(node, Mapping):
            items = [(str(key), value) for key, value in node.items()]
        elif isinstance(node, (list, tuple)):
            fields = getattr(node, "_fields", None)
            items = [(str(fields[i]) if fields else str(i), value) for i, value in enumerate(node)]
        else:
            continue
        seen.add(id(node))
        stack.extend((f"{name}/{key}" if name else key, value) for key, value in reversed(items))


def read_array_tree(tree: object) -> list[tuple[str, str, float | None]]:
    """The summaries of the arrays of a tree of NumPy arrays (see `array_leaves`)."""
    return [summarize_array(name, array) for name, array in array_leaves(tree)]


def read_npz(path: Path, max_bytes: int) -> list[tuple[str, str, float | None]]:
    """The summaries of the arrays of a ``.npz`` file (``numpy.savez``, ``savez_compressed``), one array at a time.

    Every member's ``.npy`` header is read first, and the arrays, which may be compressed, must declare at most
    ``max_bytes`` in all. Arrays of Python objects are refused (NumPy would unpickle them).

    Raises:
        CheckpointError: not a zip archive of ``.npy`` members, an array of objects, or more than ``max_bytes``.
    """
    np = _numpy()
    where = f"Cannot read the checkpoint {str(path)!r}"
    try:
        with zipfile.ZipFile(path) as archive:
            headers = [(member.filename, _npy_header(np, archive, member)) for member in archive.infolist()]
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(f"{where}: it is not a .npz archive of arrays ({exc}). {CORRUPT_FILE}") from exc
    total = 0
    for member, (shape, dtype) in headers:
        if dtype.hasobject:
            raise CheckpointError(
                f"{where}: its array {member.removesuffix('.npy')!r} holds Python objects, which polyamp never "
                "unpickles. Save the weights as numeric arrays."
            )
        total += math.prod(shape) * dtype.itemsize
        check_declared_bytes(path, total, max_bytes)
    with np.load(path, allow_pickle=False) as arrays:
        return [summarize_array(name, arrays[name]) for name in arrays.files]


def _npy_header(np: Any, archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype a ``.npz`` member declares, from its ``.npy`` header alone (nothing else inflated).

    Raises:
        ValueError: the member is not a ``.npy`` array.
    """
    if not member.filename.endswith(".npy"):
        raise ValueError(f"its member {member.filename!r} is not a .npy array")
    with archive.open(member) as handle:
        version = np.lib.format.read_magic(handle)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(handle)
    return tuple(shape), dtype
