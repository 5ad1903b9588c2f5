"""The accelerators JAX sees, for ``polyamp doctor`` (`polyamp.backend_api.BackendSpec.device_probe`)."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["probe_devices"]


def _capability(value: Any) -> tuple[int, int] | None:
    """``"9.0"`` (how JAX spells a CUDA compute capability) as ``(9, 0)``."""
    if isinstance(value, str):
        major, _, minor = value.partition(".")
        if major.isdigit() and minor.isdigit():
            return int(major), int(minor)
    return None


def probe_devices() -> tuple[list[tuple[str, int, str, tuple[int, int] | None]], list[str]]:
    devices: list[tuple[str, int, str, tuple[int, int] | None]] = []
    platforms = set()
    for d in jax.devices():
        platforms.add(d.platform)
        if d.platform == "gpu":
            cc = _capability(getattr(d, "compute_capability", None))
            kind = "cuda" if cc is not None or "nvidia" in str(d.device_kind).lower() else "gpu"
            devices.append((kind, int(d.id), str(d.device_kind), cc))
        elif d.platform == "tpu":
            devices.append(("tpu", int(d.id), str(d.device_kind), None))
    notes = [] if "gpu" in platforms else [f"jax {jax.__version__} runs on {', '.join(sorted(platforms))}"]
    return devices, notes
