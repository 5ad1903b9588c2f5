"""The float32-op setting of polyamp's CPU regions: per thread, and per tracing context while torch.compile
traces, read by `_applies` for each listed op dispatched."""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from polyamp_torch._framework import torch

_FLOAT32 = torch.float32
_FLOAT64 = torch.float64
_Key = torch._C.DispatchKey
# Everything below AutocastCPU: what a fallthrough at AutocastCPU dispatches to.
_BELOW_AUTOCAST_CPU = torch._C._dispatch_keyset_full_after(_Key.AutocastCPU)


class _RegionState(threading.local):
    # A class attribute, so every thread starts outside polyamp regions without initialising anything.
    active: bool = False

    def __init__(self) -> None:
        self.compiled: list[bool] = []  # settings to restore, pushed by the compiled-region op at run time


_STATE = _RegionState()
#: This thread's setting (``.active``), read where a region that would set it off finds it off already: that
#: entry changes nothing, so it makes no call and leaves nothing to restore.
REGION_STATE = _STATE

# While torch.compile traces, the setting is kept per tracing context (dynamo makes a new one for each
# attempt at a frame, and AOTAutograd traces in dynamo's): a stack of region settings per context.
_TRACED: weakref.WeakKeyDictionary[Any, list[bool]] = weakref.WeakKeyDictionary()
_tracing_context: Callable[[], Any] = getattr(
    getattr(getattr(torch, "_guards", None), "TracingContext", None), "try_get", lambda: None
)


_fake_mode = torch._C._get_dispatch_mode
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def _applies() -> bool:
    """Whether CUDA's rules apply to the op being dispatched: a polyamp CPU region is active here."""
    # torch.compile traces with fake tensors; the fake-mode lookup is what keeps the eager path cheap.
    if _fake_mode(_FAKE) is not None:
        context = _tracing_context()
        if context is not None:
            # Tracing for torch.compile: regions inside the traced code count, not eager ones around it (the
            # compiled graph is reused wherever its guards pass, and they do not see polyamp's region flag).
            stack = _TRACED.get(context)
            if stack:
                return stack[-1]
            if _STATE.active:
                _warn_region_around_compiled_code()
            return False
    return _STATE.active


#: Whether `_warn_region_around_compiled_code` has warned in this process.
_warned_around = [False]


def _warn_region_around_compiled_code() -> None:
    """Once per process: a listed op traced for torch.compile inside an eager polyamp CPU region around the
    compiled code, which compiles it with torch's CPU list, not CUDA's float32 one."""
    if _warned_around[0]:
        return
    _warned_around[0] = True
    warnings.warn(
        "torch.compile is compiling code called inside a polyamp CPU autocast region entered outside it (a "
        "`with polyamp_torch.autocast():` around the compiled call, a function decorated with one, or a region "
        "object made outside the compiled function and entered in it, which dynamo cannot trace). The "
        "compiled graph follows torch's CPU autocast lists: ops CUDA autocast runs in float32 (softmax, "
        "layer_norm, sum, exp, ...) compute in the low dtype there, unlike in the eager region. Enter the "
        "region inside the compiled function (`with polyamp_torch.autocast():` in its body) for CUDA's float32 "
        "list in the graph too; on CUDA devices both are the same.",
        UserWarning,
        stacklevel=2,
    )
