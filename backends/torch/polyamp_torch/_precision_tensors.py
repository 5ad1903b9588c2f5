"""The foreach tensor work of `polyamp_torch.PrecisionOptimizer` over a chunk of parameters: float32 working
copies made, unscaled and written back with one kernel per kind of tensor (and device), not one per parameter."""

from __future__ import annotations

from polyamp_torch._framework import torch

__all__ = ["copy_all", "float32_copies", "float32_like", "unscale"]


def float32_like(tensor: torch.Tensor, sources: list[torch.Tensor], into: list[torch.Tensor]) -> torch.Tensor:
    """An empty float32 tensor laid out as ``tensor``, queued to receive its values by `copy_all`."""
    copy = torch.empty_like(tensor, dtype=torch.float32)
    sources.append(tensor)
    into.append(copy)
    return copy


def float32_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 copies of ``tensors``, made by one foreach copy."""
    sources: list[torch.Tensor] = []
    copies: list[torch.Tensor] = []
    for tensor in tensors:
        float32_like(tensor, sources, copies)
    copy_all(copies, sources)
    return copies


def unscale(
    copies: list[torch.Tensor], float32_grads: list[tuple[torch.Tensor, torch.Tensor]], inverse: torch.Tensor
) -> None:
    """Multiply the float32 gradient ``copies`` by ``inverse`` in place, and give each working tensor of
    ``float32_grads`` its gradient times ``inverse`` as a new tensor: one foreach multiply per device each."""
    on_device: dict[torch.device, torch.Tensor] = {}

    def near(device: torch.device) -> torch.Tensor:
        if device not in on_device:
            on_device[device] = inverse.to(device)
        return on_device[device]

    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for copy in copies:
        by_device.setdefault(copy.device, []).append(copy)
    for device, tensors in by_device.items():
        torch._foreach_mul_(tensors, near(device))
    pairs_by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for w32, grad in float32_grads:
        pairs_by_device.setdefault(grad.device, []).append((w32, grad))
    for device, pairs in pairs_by_device.items():
        unscaled = torch._foreach_mul([grad for _, grad in pairs], near(device))
        for (w32, _), grad in zip(pairs, unscaled, strict=True):
            w32.grad = grad


def copy_all(
    into: list[torch.Tensor] | tuple[torch.Tensor, ...], sources: list[torch.Tensor] | tuple[torch.Tensor, ...]
) -> None:
    """``into[i].copy_(sources[i])`` for every i (converting the dtype), as one foreach copy where torch can."""
    if into:
        torch._foreach_copy_(into, sources)
