"""The accelerators torch sees, for ``polyamp doctor`` (`polyamp.backend_api.BackendSpec.device_probe`)."""

from __future__ import annotations

import torch

__all__ = ["probe_devices"]

Device = tuple[str, int, str, "tuple[int, int] | None"]


def probe_devices() -> tuple[list[Device], list[str]]:
    devices: list[Device] = []
    notes: list[str] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            devices.append(("cuda", i, str(torch.cuda.get_device_name(i)), (int(major), int(minor))))
    elif torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        notes.append(f"torch {torch.__version__} is built without CUDA")
    else:
        notes.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}): torch.cuda.is_available() is False")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append(("mps", 0, "Apple MPS", None))
    return devices, notes
