"""Import torch once, turning its absence into advice on what to install."""

from __future__ import annotations

from typing import Any

from polyamp import BackendNotInstalledError
from polyamp.backend_api import warn_if_untested

try:
    import torch
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess test
    if (exc.name or "").partition(".")[0] != "torch":
        raise
    raise BackendNotInstalledError(
        "polyamp_torch needs PyTorch, which is not installed. Install it with: pip install 'polyamp[torch]'"
    ) from exc

warn_if_untested("polyamp_torch", {"torch": str(torch.__version__)})

#: polyamp dtype names to torch dtypes.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


#: ``run_uncompiled(fn, *args)``: ``fn(*args)`` outside torch.compile's trace and its frame handling, at run
#: time (a ``torch.compiler.disable``d call, about 0.2 us eagerly).
run_uncompiled = torch.compiler.disable(_call)  # type: ignore[no-untyped-call]

__all__ = ["TORCH_DTYPES", "run_uncompiled", "torch"]
