"""Import torch once, turning its absence into advice on what to install."""

from __future__ import annotations

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

__all__ = ["TORCH_DTYPES", "torch"]
