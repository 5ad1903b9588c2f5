"""What ``polyamp.check_hazards`` needs from PyTorch: name, dtype and max |w| of every tensor of a checkpoint."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from polyamp import BackendNotInstalledError, CheckpointError, PolyampTypeError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.checkpoints import (
    CHUNK_BYTES,
    CORRUPT_FILE,
    DEFAULT_MAX_BYTES,
    SafetensorsEntry,
    TensorSummary,
    check_declared_bytes,
    chunk_indices,
    read_safetensors_header,
)
from polyamp_torch._framework import torch

__all__ = ["max_abs", "read_tensors", "summarize"]

#: Keys under which a checkpoint dict holds the model's state dict: Lightning's, a plain ``{"model": ...}``,
#: and the PyTorch tutorials' ``{"model_state_dict": ..., "optimizer_state_dict": ...}`` (the optimizer's part,
#: moments and step counts, holds no weights of the model and is not read).
_WRAPPERS = ("state_dict", "model", "model_state_dict")
#: Elements per block: CHUNK_BYTES of float32, the widest a float8 block is upcast to.
_BLOCK = CHUNK_BYTES // 4
#: |value| of each float4 e2m1 code without its sign bit.
_FLOAT4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: torch dtype names of the safetensors dtype codes that are not floating (their tensors are not read).
_NOT_FLOATING = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
}


def _block_max_abs(block: torch.Tensor) -> float:
    name = str(block.dtype)
    if name == "torch.float4_e2m1fn_x2":  # two e2m1 codes per byte: sign bit 3, magnitude bits 0-2
        codes = block.view(torch.uint8)
        return _FLOAT4_E2M1[int(torch.maximum(codes & 7, (codes >> 4) & 7).max())]
    if name.startswith("torch.float8"):  # no abs/max kernels for float8: upcast (exact) block by block
        block = block.float()
    return float(block.abs().max())  # max propagates NaN


def max_abs(tensor: torch.Tensor) -> float:
    """max |w| of a floating tensor as a float (NaN if any is NaN, 0.0 if empty), in blocks of 4 MiB.

    float8 types (``float8_e4m3fn``, ``float8_e5m2``, the ``fnuz`` ones, ``float8_e8m0fnu``) are upcast to
    float32 one block at a time; sparse tensors are read through their stored values.
    """
    tensor = tensor.detach()
    if tensor.layout == torch.sparse_coo:
        tensor = tensor.coalesce().values()  # duplicate indices sum when coalesced
    elif tensor.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        tensor = tensor.values()
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return 0.0
    best = 0.0
    for block in torch.split(flat, _BLOCK):
        value = _block_max_abs(block)
        if math.isnan(value):
            return value
        best = max(best, value)
    return best


def summarize(name: str, tensor: torch.Tensor) -> TensorSummary:
    """One tensor's summary: max |w| as a float for floating tensors (NaN if any is NaN, 0.0 if empty)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if not tensor.is_floating_point() or tensor.is_meta:
        return TensorSummary(name, dtype, None)
    return TensorSummary(name, dtype, max_abs(tensor))


def _read_safetensors(path: Path, max_bytes: int) -> list[TensorSummary]:
    try:
        from safetensors import safe_open  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise BackendNotInstalledError(
            f"Reading {path.name!r} needs the safetensors package, which is not installed; this check is "
            "skipped. Install it with: pip install safetensors"
        ) from exc
    entries = {entry.name: entry for entry in read_safetensors_header(path, max_bytes)}
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return [_safetensors_summary(handle, entries[name]) for name in handle.keys()]


def _safetensors_summary(handle: Any, entry: SafetensorsEntry) -> TensorSummary:
    if entry.dtype in _NOT_FLOATING:
        return TensorSummary(entry.name, _NOT_FLOATING[entry.dtype], None)
    if entry.nbytes <= CHUNK_BYTES or entry.dtype in ("F4", "F6_E2M3", "F6_E3M2"):  # sub-byte: read whole
        return summarize(entry.name, handle.get_tensor(entry.name))
    itemsize = entry.nbytes // math.prod(entry.shape)
    view = handle.get_slice(entry.name)
    best, dtype = 0.0, ""
    for index in chunk_indices(entry.shape, itemsize):
        summary = summarize(entry.name, view[index])
        dtype = summary.dtype
        assert summary.max_abs is not None
        if math.isnan(summary.max_abs):
            return summary
        best = max(best, summary.max_abs)
    return TensorSummary(entry.name, dtype, best)


def _load(path: Path, max_bytes: int) -> object:
    check_declared_bytes(path, path.stat().st_size, max_bytes)  # torch.load materializes the whole file
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        where = f"Cannot read the checkpoint {str(path)!r}"
        found = _UNSUPPORTED_GLOBAL.search(text)
        if found is not None:  # a genuine pickle that holds Python objects besides tensors
            raise CheckpointError(
                f"{where}: it holds Python objects besides tensors and plain containers ({found.group(0)}), and "
                "polyamp never unpickles those. If you trust the file, load it yourself (torch.load(path, "
                "weights_only=False)) and pass the module or state dict."
            ) from exc
        cause = _cause(text)
        raise CheckpointError(
            f"{where}: it is not a checkpoint torch.load can read ({type(exc).__name__}{': ' if cause else ''}"
            f"{cause}). {CORRUPT_FILE}"
        ) from exc


#: torch's weights-only unpickler refusing a class or function the file names (a pickle beyond tensors).
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL [\w.<>]+")


def _cause(text: str) -> str:
    """What a torch.load error says was wrong, in a line: the weights-only unpickler's own words (after torch's
    advice about ``weights_only``, which does not apply to a file that is not a pickle), else its first sentence."""
    head, found, rest = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (rest if found else head).splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] if found else lines[0].split(". ")[0].rstrip(".")


def _walk(state: Mapping[object, object], prefix: str) -> Iterator[TensorSummary]:
    """Depth-first, without recursion (a checkpoint may nest thousands deep), each mapping visited once."""
    seen = {id(state)}
    stack: list[tuple[Iterator[tuple[object, object]], str]] = [(iter(state.items()), prefix)]
    while stack:
        items, head = stack[-1]
        for key, value in items:
            name = f"{head}{key}"
            if isinstance(value, torch.Tensor):
                yield summarize(name, value)
            elif isinstance(value, Mapping) and id(value) not in seen:
                seen.add(id(value))
                stack.append((iter(value.items()), f"{name}."))
                break
        else:
            stack.pop()


def read_tensors(source: object, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[TensorSummary]:
    """Summaries of the tensors of a checkpoint path, a ``torch.nn.Module`` or a state dict.

    A path is read with ``torch.load(path, map_location="cpu", weights_only=True)`` (refused when the file is
    larger than ``max_bytes``), or for ``.safetensors`` with ``safetensors.safe_open`` after checking its
    header (`polyamp.backend_api.checkpoints.read_safetensors_header`), tensor by tensor in blocks. A dict holding
    ``"state_dict"`` or ``"model"`` (or the PyTorch tutorials' ``"model_state_dict"``) is read from that entry, named
    as in the model; nested dicts give dotted names; entries that are neither tensors nor dicts (an epoch counter)
    hold no weights and are passed over. A module gives its parameters and all its buffers, non-persistent ones
    included (rotary ``inv_freq`` buffers are often non-persistent). float8 tensors are upcast to float32 block by
    block; sparse tensors are read through their stored values.

    Args:
        source: A `pathlib.Path`, a ``torch.nn.Module`` or a mapping.
        max_bytes: For a path, the most bytes its tensors may declare.

    Returns:
        One summary per tensor.

    Raises:
        CheckpointError: The file cannot be read, or declares more than ``max_bytes``.
        BackendNotInstalledError: A ``.safetensors`` file and no ``safetensors`` package.
        PolyampTypeError: ``source`` is none of the above.
    """
    if isinstance(source, Path):
        if source.name.lower().endswith(".safetensors"):
            return _read_safetensors(source, max_bytes)
        source = _load(source, max_bytes)
    if isinstance(source, torch.nn.Module):
        return [summarize(n, t) for n, t in source.named_parameters()] + [
            summarize(n, t) for n, t in source.named_buffers()
        ]
    if not isinstance(source, Mapping):
        raise PolyampTypeError(
            "polyamp_torch reads a torch.nn.Module, a state dict (a dict of tensors), or a dict holding one under "
            f"'state_dict', 'model' or 'model_state_dict'. Received: {describe(source)}."
        )
    for key in _WRAPPERS:
        inner = source.get(key)
        if isinstance(inner, torch.nn.Module):
            return read_tensors(inner)
        if isinstance(inner, Mapping):
            return list(_walk(inner, ""))
    return list(_walk(source, ""))
