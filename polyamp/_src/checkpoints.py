"""Reading limits and format checks for checkpoint files, before a framework touches them (no framework import).

A checkpoint's header declares its tensors' shapes; a reader that trusts them allocates what they declare. A
small file can declare gigabytes (a corrupt header, a compressed HDF5 dataset of zeros, a zip member that
inflates a thousandfold), so the readers behind `polyamp.check_hazards` check what a file declares against
limits before reading it, and read tensors in bounded chunks:

* `DEFAULT_MAX_BYTES` (64 GiB): the most tensor bytes a checkpoint may declare (all its tensors together, or a
  ``.keras`` archive's members uncompressed); ``max_bytes=`` of `polyamp.check_hazards` (``--max-bytes`` of
  ``python -m polyamp doctor``) overrides it.
* `MAX_CONFIG_BYTES` (64 MiB): the most a ``.keras`` archive's ``config.json`` may inflate to.
* `MAX_SAFETENSORS_HEADER_BYTES` (100 MiB): the most a ``.safetensors`` JSON header may hold (the safetensors
  format's own limit).
* `CHUNK_BYTES` (4 MiB): the size of the blocks a reader computes max |w| over.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Final, NamedTuple

from polyamp._src.errors import CheckpointError, PolyampTypeError, PolyampValueError, describe

__all__ = [
    "CHUNK_BYTES",
    "CORRUPT_FILE",
    "DEFAULT_MAX_BYTES",
    "MAX_CONFIG_BYTES",
    "MAX_SAFETENSORS_HEADER_BYTES",
    "SafetensorsEntry",
    "check_declared_bytes",
    "check_max_bytes",
    "check_zip_archive",
    "chunk_indices",
    "format_bytes",
    "read_safetensors_header",
]

#: The most tensor bytes a checkpoint file may declare unless ``max_bytes`` says otherwise: 64 GiB.
DEFAULT_MAX_BYTES: Final = 64 * 2**30
#: The most a ``.keras`` archive's ``config.json`` may inflate to: 64 MiB.
MAX_CONFIG_BYTES: Final = 64 * 2**20
#: The most a ``.safetensors`` JSON header may hold: 100 MiB, as in the safetensors format.
MAX_SAFETENSORS_HEADER_BYTES: Final = 100 * 2**20
#: The size of the blocks max |w| is computed over (a bound on the memory one read takes): 4 MiB.
CHUNK_BYTES: Final = 4 * 2**20

#: Bits per element of each safetensors dtype code.
SAFETENSORS_BITS: Final = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

#: What every reader says of a file it cannot read as its format: the same advice for every format.
CORRUPT_FILE: Final = "The file is corrupt or truncated: re-download or re-save it."
_RETRY = CORRUPT_FILE


def format_bytes(count: int) -> str:
    """``count`` bytes for a message: ``"68719476736 bytes (64 GiB)"``.

    >>> format_bytes(3 * 2**20)
    '3145728 bytes (3 MiB)'
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count} bytes ({count / size:.3g} {unit})"
    return f"{count} bytes"


def check_max_bytes(max_bytes: object) -> int:
    """Validate a ``max_bytes`` argument: a positive int.

    Raises:
        PolyampTypeError: ``max_bytes`` is not an int (a bool is not).
        PolyampValueError: ``max_bytes`` is zero or negative.
    """
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool):
        raise PolyampTypeError(
            f"`max_bytes` must be an int, a number of bytes such as 2**36. Received: {describe(max_bytes)}."
        )
    if max_bytes <= 0:
        raise PolyampValueError(
            f"`max_bytes` must be a positive number of bytes (default {format_bytes(DEFAULT_MAX_BYTES)}). "
            f"Received: {max_bytes}."
        )
    return max_bytes


def _too_large(count: int, limit: int, note: str) -> str:
    return f"{format_bytes(count)}, above the limit of {format_bytes(limit)}{note}"


def check_declared_bytes(path: Path, declared: int, max_bytes: int) -> None:
    """Refuse a checkpoint whose tensors declare more than ``max_bytes`` bytes in all, before reading them.

    Raises:
        CheckpointError: ``declared > max_bytes``; the message names the file, both sizes and the override.
    """
    if declared > max_bytes:
        raise CheckpointError(
            f"Cannot read the checkpoint {str(path)!r}: its tensors declare "
            f"{_too_large(declared, max_bytes, ' (max_bytes)')}. If the checkpoint is genuine, raise the limit: check_hazards(..., max_bytes=N) or "
            "python -m polyamp doctor --check PATH --max-bytes N."
        )


class SafetensorsEntry(NamedTuple):
    """One tensor of a ``.safetensors`` header, checked against the file.

    Attributes:
        name: The tensor's key.
        dtype: The safetensors dtype code (``"F32"``, ``"BF16"``, ``"F8_E4M3"``, ...).
        shape: Its shape.
        nbytes: The bytes its data takes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> list[SafetensorsEntry]:
    """Read and check a ``.safetensors`` file's header without reading its tensors or trusting its sizes.

    Checks the 8-byte little-endian header length against the file size and `MAX_SAFETENSORS_HEADER_BYTES`,
    that the header is a JSON object of ``{"dtype", "shape", "data_offsets"}`` entries with a known dtype,
    non-negative integer dims and offsets matching the shape, that no two tensors overlap, that every tensor
    lies inside the file, and that the tensors declare at most ``max_bytes`` in all.

    Args:
        path: The file.
        max_bytes: The most bytes the tensors may declare, together.

    Returns:
        The tensors in header order (``"__metadata__"`` left out).

    Raises:
        CheckpointError: The file breaks one of the checks; the message names the file and what is wrong.
        OSError: The file cannot be opened.
    """
    where = f"Cannot read the checkpoint {str(path)!r}"
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(0)
        if size < 8:
            raise CheckpointError(
                f"{where}: it is {size} bytes long, shorter than the 8-byte header length a safetensors file "
                f"starts with. {_RETRY}"
            )
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > MAX_SAFETENSORS_HEADER_BYTES:
            raise CheckpointError(
                f"{where}: it declares a JSON header of "
                f"{_too_large(header_len, MAX_SAFETENSORS_HEADER_BYTES, ' that the safetensors format allows')}. "
                f"{_RETRY}"
            )
        if header_len > size - 8:
            raise CheckpointError(
                f"{where}: it declares a JSON header of {header_len} bytes, but only {size - 8} bytes follow the "
                f"header length. {_RETRY}"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: its header is not valid UTF-8 JSON ({exc}). {_RETRY}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{where}: its header must be a JSON object of tensors; it is a {type(header).__name__}. {_RETRY}"
        )
    data_size = size - 8 - header_len
    entries: list[SafetensorsEntry] = []
    spans: list[tuple[int, int, str]] = []
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry, begin, end = _safetensors_entry(where, name, info)
        total += entry.nbytes
        check_declared_bytes(path, total, max_bytes)
        if end > data_size:
            raise CheckpointError(
                f"{where}: tensor {name!r} ends at byte {end} of the data, but the file holds {data_size} bytes "
                f"of data after its header. {_RETRY}"
            )
        entries.append(entry)
        spans.append((begin, end, name))
    spans.sort()
    for (_, prev_end, prev), (begin, end, name) in itertools.pairwise(spans):
        if begin < prev_end and end > begin:
            raise CheckpointError(
                f"{where}: tensors {prev!r} and {name!r} overlap (bytes {begin} to {min(end, prev_end)} of the "
                f"data belong to both). {_RETRY}"
            )
    return entries


def _safetensors_entry(where: str, name: str, info: object) -> tuple[SafetensorsEntry, int, int]:
    prefix = f"{where}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(
            f"{prefix} must be a JSON object with 'dtype', 'shape' and 'data_offsets'. Received: "
            f"{describe(info)}. {_RETRY}"
        )
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_BITS:
        raise CheckpointError(
            f"{prefix} has dtype {dtype!r}, not a safetensors dtype ({', '.join(SAFETENSORS_BITS)}). The file is "
            "corrupt, or written by a newer safetensors: upgrade safetensors and polyamp."
        )
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise CheckpointError(f"{prefix} has shape {shape!r}; a shape is a list of integers. {_RETRY}")
    if any(d < 0 for d in shape):
        raise CheckpointError(f"{prefix} has shape {shape}, with a negative dimension. {_RETRY}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(
            f"{prefix} has data_offsets {offsets!r}; they must be [begin, end], integers with 0 <= begin <= end. "
            f"{_RETRY}"
        )
    bits = math.prod(shape) * SAFETENSORS_BITS[dtype]
    if bits % 8:
        raise CheckpointError(f"{prefix} has shape {shape} of {dtype}, which is not a whole number of bytes. {_RETRY}")
    nbytes = bits // 8
    begin, end = offsets
    if end - begin != nbytes:
        raise CheckpointError(
            f"{prefix} declares shape {shape} of {dtype}, which takes {format_bytes(nbytes)}, but its data_offsets "
            f"[{begin}, {end}] span {end - begin} bytes. {_RETRY}"
        )
    return SafetensorsEntry(name, dtype, tuple(shape), nbytes), begin, end


def check_zip_archive(
    path: Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    config_name: str = "config.json",
    max_config_bytes: int = MAX_CONFIG_BYTES,
) -> None:
    """Check a zip archive (a ``.keras`` file) before a framework inflates it: what its members declare.

    Python's ``zipfile`` never inflates a member past the size its entry declares, so these checks bound what
    reading the archive can allocate.

    Args:
        path: The archive.
        max_bytes: The most bytes its members may declare uncompressed, together.
        config_name: The member that must be present and at most ``max_config_bytes`` uncompressed.
        max_config_bytes: The limit for ``config_name``.

    Raises:
        CheckpointError: Not a zip archive, no ``config_name`` member, or a declared size above its limit.
    """
    where = f"Cannot read the checkpoint {str(path)!r}"
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(f"{where}: it is not a zip archive, as a .keras file is ({exc}). {_RETRY}") from exc
    config = next((m for m in members if m.filename == config_name), None)
    if config is None:
        raise CheckpointError(
            f"{where}: the archive holds no {config_name!r} (it holds {len(members)} members). {_RETRY}"
        )
    if config.file_size > max_config_bytes:
        raise CheckpointError(
            f"{where}: its {config_name!r} inflates to "
            f"{_too_large(config.file_size, max_config_bytes, ' for a model configuration')}. {_RETRY} To check the model anyway, load it yourself and pass "
            "the model to check_hazards."
        )
    check_declared_bytes(path, sum(m.file_size for m in members), max_bytes)


def chunk_indices(shape: tuple[int, ...], itemsize: int, limit: int = CHUNK_BYTES) -> Iterator[tuple[object, ...]]:
    """Index tuples that cut an array of ``shape`` into blocks of at most ``limit`` bytes (or one element).

    Whole rows along the first axis when a row fits, else the first axis one index at a time, cut further
    the same way. ``()`` (the whole array) when it fits. Use each as ``array[index]`` (h5py, safetensors
    slices and NumPy/torch arrays all accept integers and slices).

    Examples:
        >>> list(chunk_indices((4, 3), 4, limit=24))
        [(slice(0, 2, None),), (slice(2, 4, None),)]
        >>> list(chunk_indices((2, 3), 4, limit=8))[:2]
        [(0, slice(0, 2, None)), (0, slice(2, 3, None))]
    """
    if math.prod(shape) * itemsize <= limit or not shape:
        yield ()
        return
    row = math.prod(shape[1:]) * itemsize
    if row <= limit:
        step = max(1, limit // row)
        for start in range(0, shape[0], step):
            yield (slice(start, min(start + step, shape[0])),)
        return
    for i in range(shape[0]):
        for rest in chunk_indices(shape[1:], itemsize, limit):
            yield (i, *rest)
