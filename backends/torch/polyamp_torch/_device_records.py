"""The torch device's step records: each optimizer's last flag and the ring of iterations since the records were
last read, kept as the flag tensors themselves (no kernel, no host read per step) and read in one batch.

A part of `polyamp_torch._device.TorchDevice` (the `polyamp.backend_api.RecordingDevice` methods).
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

from polyamp.backend_api import rules
from polyamp_torch._framework import torch
from polyamp_torch._rule import OPS

__all__ = ["RecordMethods"]


class _History:
    """The iterations since the records were last read: (mode code, device flag, spike-only flag) each, at
    most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.entries: deque[tuple[int, torch.Tensor | None, torch.Tensor | None]] = deque(maxlen=capacity)
        self.count = 0


def _kept(flag: torch.Tensor | None) -> torch.Tensor | None:
    """``flag`` as a record may hold it past its iteration. A CUDA tensor that a graph of
    ``torch.compile(mode="reduce-overhead")`` made lives in that graph's memory and is overwritten by a later
    replay, so while CUDA-graph trees are in use on its device a CUDA flag is copied outside the trace (one
    small kernel, no host read); otherwise the flag itself is kept."""
    if flag is None or not flag.is_cuda or torch.compiler.is_compiling():
        return flag
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return flag
    container = getattr(trees, "get_container", None)
    index = flag.device.index if flag.device.index is not None else torch.cuda.current_device()
    if container is not None and getattr(container(index), "tree_manager", True) is None:
        return flag
    return flag.clone()


def _read_flags(flags: list[torch.Tensor]) -> list[Any]:
    """The values of 0-d flags, in one host read: stacked where they are (the usual case: one device, one
    shape), else each brought to the CPU first (flags of several devices, or of another shape)."""
    try:
        stacked = torch.stack(flags)
    except RuntimeError:
        stacked = torch.stack([flag.reshape(()).float().cpu() for flag in flags])
    return stacked.reshape(-1).tolist()


class RecordMethods:
    """The records' device side: stateless, every value lives in the record or ring it is given."""

    def skipped(self, found_inf: torch.Tensor) -> torch.Tensor:
        return found_inf > 0

    def read_flag(self, found_inf: torch.Tensor) -> bool:
        return bool(found_inf.item() > 0)

    def new_record(self) -> list[torch.Tensor | None]:
        return [None]

    def write_record(self, record: list[torch.Tensor | None], found_inf: torch.Tensor) -> None:
        record[0] = _kept(found_inf) if found_inf.is_cuda else found_inf

    def read_record(self, record: list[torch.Tensor | None]) -> torch.Tensor:
        flag = record[0]
        assert flag is not None, "a record is written when it is created"
        return flag

    def new_history(self, capacity: int) -> _History:
        return _History(capacity)

    def write_history(
        self, history: _History, base: int, found_inf: torch.Tensor | None, spike: torch.Tensor | None = None
    ) -> None:
        # The flag tensors themselves (no kernel, no host read), unless a CUDA graph owns them (`_kept`).
        if (found_inf is not None and found_inf.is_cuda) or (spike is not None and spike.is_cuda):
            found_inf, spike = _kept(found_inf), _kept(spike)
        history.entries.append((base, found_inf, spike))
        history.count += 1

    def read_history(self, history: _History) -> tuple[int, list[int]]:
        entries = list(history.entries)
        flags = [flag for _, found, spike in entries for flag in (found, spike) if flag is not None]
        if not flags:  # every iteration known finite on the host: the codes are the modes
            history.entries.clear()
            return history.count, [base for base, _, _ in entries]
        values = iter(_read_flags(flags))
        bases, overflows, spikes = [], [], []
        for base, found, spike in entries:
            bases.append(base)
            overflows.append(found is not None and next(values) > 0)
            spikes.append(next(values) if spike is not None else 0.0)
        history.entries.clear()
        codes = rules.record_code(OPS, torch.tensor(bases), torch.tensor(overflows), torch.tensor(spikes))
        return history.count, codes.tolist()
