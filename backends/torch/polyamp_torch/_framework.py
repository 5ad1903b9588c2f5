"""Import torch once, turning its absence into advice on what to install."""

from __future__ import annotations

from typing import Any

from polyamp import BackendNotInstalledError
from polyamp.backend_api.versions import warn_if_untested

try:
    import torch
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess test
    if (exc.name or "").partition(".")[0] != "torch":
        raise
    raise BackendNotInstalledError(
        "polyamp_torch needs PyTorch, which is not installed. Install it with: pip install 'polyamp[torch]'"
    ) from exc

warn_if_untested("polyamp_torch", {"torch": str(torch.__version__)})

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""polyamp dtype names to torch dtypes."""


def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


_disabled_call = torch.compiler.disable(_call)  # type: ignore[no-untyped-call]
#: torch's own question "is a compiler's frame callback set?" (None outside torch.compile); None if absent.
_frame_callback = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback", None
)


_is_compiling = torch.compiler.is_compiling


def run_uncompiled(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` outside torch.compile's trace and its frame handling, at run time: through a
    ``torch.compiler.disable``d call while torch.compile traces or watches frames (it can run a frame untraced
    yet compile each function that frame calls), directly otherwise (the disabled call is dearer)."""
    if _is_compiling() or _frame_callback is None or _frame_callback() is not None:
        return _disabled_call(fn, *args)
    return fn(*args)


__all__ = ["TORCH_DTYPES", "run_uncompiled", "torch"]
