"""Reading a checkpoint's or model's tensors for `polyamp.check_hazards`: which reader opens what.

A path is opened by its suffix (a backend's ``checkpoint_suffixes``), as a NumPy ``.npz`` archive, or, for a
directory, by the files that mark it as a backend's checkpoint (``checkpoint_markers``: orbax's). An object goes
to the reader of the backend owning it (or the first tensor found in it); a container of arrays that no backend
owns goes to the reader of an imported framework that reads such trees (``reads_trees``: JAX's pytrees), else to
NumPy's. Each reader returns `TensorSummary` triples; the hazard rules (`polyamp._src.hazards`) never see a tensor.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple

from polyamp._src.array_readers import array_leaves, read_array_tree, read_npz
from polyamp._src.checkpoints import DEFAULT_MAX_BYTES, check_max_bytes
from polyamp._src.errors import CheckpointError, PolyampError, PolyampTypeError, PolyampValueError, describe

__all__ = ["TensorSummary", "read_tensors", "summary_of"]

#: The suffix of NumPy's archives of arrays, which the core reads itself (no framework needed).
_NPZ: Final = ".npz"


class TensorSummary(NamedTuple):
    """What the hazard rules need to know about one tensor, as a backend's ``tensor_reader`` reports it.

    Attributes:
        name: The tensor's full name: a state-dict key (``"encoder.0.weight"``) or a Keras variable path
            (``"dense/kernel"``).
        dtype: The framework's dtype name without prefix: ``"float32"``, ``"bfloat16"``, ``"int64"``, ``"bool"``.
        max_abs: max |w| over the tensor as a Python float (NaN if it holds a NaN, 0.0 if empty), or None for
            tensors that are not floating.
    """

    name: str
    dtype: str
    max_abs: float | None


def summary_of(item: object) -> tuple[str, str, float | None]:
    """A ``(name, dtype, max_abs)`` triple validated (``max_abs`` as a float or None)."""
    if isinstance(item, tuple) and len(item) == 3:
        name, dtype, max_abs = item
        if (
            isinstance(name, str)
            and isinstance(dtype, str)
            and (max_abs is None or (isinstance(max_abs, (int, float)) and not isinstance(max_abs, bool)))
        ):
            return name, dtype, None if max_abs is None else float(max_abs)
    raise PolyampTypeError(
        "find_hazards() takes (name, dtype, max_abs) triples: a str, a dtype name such as 'float32', and a float "
        f"or None. Received: {describe(item)}."
    )


def _suffixes() -> dict[str, str]:
    """Every checkpoint suffix a registered tensor reader opens, mapped to its backend's name."""
    from polyamp._src.registry import backend_specs

    return {
        suffix.lower(): spec.name
        for spec in backend_specs().values()
        if spec.tensor_reader is not None
        for suffix in spec.checkpoint_suffixes
    }


def _backend_for_object(obj: object) -> str | None:
    """The backend owning ``obj``, or the first object found in it (mappings, lists and tuples, depth first,
    each visited once)."""
    from polyamp._src.registry import owner_of_module

    stack, seen = [obj], set()
    while stack:
        node = stack.pop()
        if isinstance(node, (Mapping, list, tuple)):
            if id(node) not in seen:
                seen.add(id(node))
                stack.extend(reversed(list(node.values() if isinstance(node, Mapping) else node)))
            continue
        for klass in type(node).__mro__:
            owner = owner_of_module(klass.__module__)
            if owner is not None:
                return owner
    return None


def _accepts_max_bytes(reader: Any) -> bool:
    try:
        parameters = inspect.signature(reader).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function without a signature
        return False
    return any(p.name == "max_bytes" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def read_tensors(state_or_path: object, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[TensorSummary]:
    """The `TensorSummary` of every tensor in a checkpoint file, model or state dict, read by its backend.

    ``state_or_path`` is a path (``str`` or ``os.PathLike``) whose suffix a backend's reader opens (PyTorch:
    ``.pt``, ``.pth``, ``.bin``, ``.ckpt``, ``.safetensors``; Keras: ``.keras``, ``.weights.h5``), a NumPy ``.npz``
    file, or a checkpoint directory a backend's reader opens (JAX: an orbax checkpoint); or an object of a
    framework with a reader (a ``torch.nn.Module`` or state dict, a Keras model or layer, a JAX pytree such as a
    Flax params dict or NNX module), or nested dicts and lists of NumPy arrays. Reading imports only that
    backend's framework (NumPy for ``.npz`` files and NumPy arrays).

    Args:
        state_or_path: The checkpoint path, model or state dict.
        max_bytes: For a file, the most bytes its tensors may declare in all (a ``.keras`` archive: its members
            uncompressed); a file declaring more is refused before anything is read. Readers compute max |w|
            over blocks of a few MiB, so a compressed file is never inflated whole (what ``torch.load`` or
            ``keras.saving.load_model`` materializes is theirs). Ignored for objects in memory.

    Returns:
        One summary per tensor, in the reader's order.

    Raises:
        PolyampValueError: no file at the path, no reader for its suffix, or a directory that is no checkpoint
            a reader opens (the message lists what is read).
        CheckpointError: the file cannot be read (corrupt, truncated, holding what the reader does not
            handle), or it declares more than ``max_bytes``; the message names the file and the reason.
        PolyampTypeError: no reader handles the object's framework, or ``max_bytes`` is not an int.
        BackendNotInstalledError: the reader's framework (or ``safetensors``, ``orbax-checkpoint``) is not
            installed.
    """
    max_bytes = check_max_bytes(max_bytes)
    if not isinstance(state_or_path, (str, os.PathLike)):
        name, reader = _object_reader(state_or_path)
        return [TensorSummary(*summary_of(tuple(item))) for item in reader(state_or_path)]
    path = Path(state_or_path)
    name, reader = _path_reader(path)
    try:
        items = reader(path, max_bytes=max_bytes) if _accepts_max_bytes(reader) else reader(path)
        return [TensorSummary(*summary_of(tuple(item))) for item in items]
    except PolyampError:
        raise
    except Exception as exc:  # whatever a framework raises on a file it cannot read
        raise CheckpointError(
            f"Cannot read the checkpoint {str(path)!r}: the {name} reader failed with "
            f"{type(exc).__name__}: {exc}. The file is corrupt, truncated or holds what polyamp does not read: "
            "re-save it, or load it yourself and pass the model or state dict."
        ) from exc


def _load_reader(backend: str) -> tuple[str, Any]:
    from polyamp._src.registry import backend_specs, load_target

    spec = backend_specs()[backend]
    assert spec.tensor_reader is not None
    return spec.name, load_target(
        spec.tensor_reader, backend=spec.name, install_hint=spec.install_hint, frameworks=spec.frameworks
    )


def _supported() -> str:
    """The formats `read_tensors` opens, for messages."""
    from polyamp._src.registry import backend_specs

    markers = sorted({m for spec in backend_specs().values() if spec.tensor_reader for m in spec.checkpoint_markers})
    files = ", ".join(sorted({*_suffixes(), _NPZ}))
    return f"files ending {files}" + (f", and checkpoint directories holding {' or '.join(markers)}" if markers else "")


def _path_reader(path: Path) -> tuple[str, Any]:
    """The reader of a checkpoint path: by its suffix, a ``.npz`` file's (NumPy's), or a checkpoint directory's
    (by the files that mark it)."""
    from polyamp._src.registry import backend_specs

    if path.is_dir():
        specs = [spec for spec in backend_specs().values() if spec.tensor_reader and spec.checkpoint_markers]
        for spec in specs:
            if any((path / marker).is_file() for marker in spec.checkpoint_markers):
                return _load_reader(spec.name)
        inside = sorted(
            child.name
            for child in path.iterdir()
            if child.is_dir() and any((child / m).is_file() for spec in specs for m in spec.checkpoint_markers)
        )
        hint = (
            f" It holds checkpoints in its subdirectories {inside[:8]} (a checkpoint manager's steps): pass one of "
            "them."
            if inside
            else ""
        )
        raise PolyampValueError(
            f"No tensor reader opens the directory {str(path)!r}: polyamp reads {_supported()}.{hint}"
        )
    if path.name.lower().endswith(_NPZ):
        if not path.is_file():
            raise PolyampValueError(f"No file at {str(path)!r}. Pass the path of a checkpoint file.")
        return "numpy", read_npz
    suffixes = _suffixes()
    matches = [s for s in suffixes if path.name.lower().endswith(s)]
    if not matches:
        raise PolyampValueError(
            f"No tensor reader opens {str(path)!r}: polyamp reads {_supported()}. Rename the file to its format's "
            "suffix, or load it yourself and pass the model or state dict."
        )
    if not path.is_file():
        raise PolyampValueError(f"No file at {str(path)!r}. Pass the path of a checkpoint file.")
    return _load_reader(suffixes[max(matches, key=len)])


def _object_reader(obj: object) -> tuple[str, Any]:
    """The reader of a model, state dict or tree of arrays: its framework's backend's; for containers of arrays
    no backend owns, the reader of an imported framework that reads trees (JAX's pytrees), else NumPy's."""
    from polyamp._src.registry import backend_specs

    specs = backend_specs()
    found = _backend_for_object(obj)
    if found is not None and specs[found].tensor_reader is not None:
        return _load_reader(found)
    if found is None and not isinstance(obj, (str, bytes, int, float, complex)):  # a number holds no arrays
        for spec in specs.values():
            if spec.reads_trees and spec.tensor_reader and any(f in sys.modules for f in spec.frameworks):
                return _load_reader(spec.name)
        if any(True for _ in array_leaves(obj)):
            return "numpy", read_array_tree
    readers = sorted(name for name, spec in specs.items() if spec.tensor_reader is not None)
    raise PolyampTypeError(
        "check_hazards() takes a checkpoint path, a model or state dict of a framework with a tensor reader "
        f"({', '.join(readers)}), or nested dicts and lists of arrays (NumPy's, JAX's). Received: "
        f"{describe(obj)}."
    )
