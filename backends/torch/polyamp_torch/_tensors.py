"""What ``polyamp.check_hazards`` needs from PyTorch: name, dtype and max |w| of every tensor of a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from polyamp import BackendNotInstalledError, PolyampTypeError, PolyampValueError
from polyamp.backend_api import TensorSummary, describe
from polyamp_torch._framework import torch

__all__ = ["read_tensors", "summarize"]

_WRAPPERS = ("state_dict", "model")


def summarize(name: str, tensor: torch.Tensor) -> TensorSummary:
    """One tensor's summary: max |w| as a float for floating tensors (NaN if any is NaN, 0.0 if empty)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if not tensor.is_floating_point() or tensor.is_meta:
        return TensorSummary(name, dtype, None)
    if tensor.numel() == 0:
        return TensorSummary(name, dtype, 0.0)
    return TensorSummary(name, dtype, float(tensor.detach().abs().max()))  # max propagates NaN


def _load(path: Path) -> object:
    if path.name.lower().endswith(".safetensors"):
        try:
            from safetensors.torch import load_file  # type: ignore[import-not-found, unused-ignore]
        except ImportError as exc:
            raise BackendNotInstalledError(
                f"Reading {path.name!r} needs the safetensors package, which is not installed; this check is "
                "skipped. Install it with: pip install safetensors"
            ) from exc
        return load_file(str(path), device="cpu")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise PolyampValueError(
            f"torch.load({str(path)!r}, weights_only=True) failed: {type(exc).__name__}: {exc}. polyamp reads "
            "checkpoints of tensors and plain containers only (never arbitrary pickles); load it yourself and pass "
            "the module or state dict."
        ) from exc


def _walk(state: Mapping[object, object], prefix: str) -> Iterator[TensorSummary]:
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            yield summarize(name, value)
        elif isinstance(value, Mapping):
            yield from _walk(value, f"{name}.")


def read_tensors(source: object) -> list[TensorSummary]:
    """Summaries of the tensors of a checkpoint path, a ``torch.nn.Module`` or a state dict.

    A path is read with ``torch.load(path, map_location="cpu", weights_only=True)``, or with
    ``safetensors.torch.load_file`` for ``.safetensors``. A dict holding ``"state_dict"`` or ``"model"`` is read
    from that entry; nested dicts give dotted names; entries that are neither tensors nor dicts (an epoch
    counter) hold no weights and are passed over. A module gives its parameters and all its buffers,
    non-persistent ones included (rotary ``inv_freq`` buffers are often non-persistent).
    """
    if isinstance(source, Path):
        source = _load(source)
    if isinstance(source, torch.nn.Module):
        return [summarize(n, t) for n, t in source.named_parameters()] + [
            summarize(n, t) for n, t in source.named_buffers()
        ]
    if not isinstance(source, Mapping):
        raise PolyampTypeError(
            "polyamp_torch reads a torch.nn.Module, a state dict (a dict of tensors), or a dict holding one under "
            f"'state_dict' or 'model'. Received: {describe(source)}."
        )
    for key in _WRAPPERS:
        inner = source.get(key)
        if isinstance(inner, torch.nn.Module):
            return read_tensors(inner)
        if isinstance(inner, Mapping):
            return list(_walk(inner, ""))
    return list(_walk(source, ""))
