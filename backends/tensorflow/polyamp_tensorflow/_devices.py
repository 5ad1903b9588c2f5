"""The accelerators TensorFlow sees, for ``polyamp doctor`` (`polyamp.backend_api.BackendSpec.device_probe`)."""

from __future__ import annotations

from typing import Any

from polyamp_tensorflow._framework import tf

__all__ = ["probe_devices"]


def _capability(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def probe_devices() -> tuple[list[tuple[str, int, str, tuple[int, int] | None]], list[str]]:
    devices: list[tuple[str, int, str, tuple[int, int] | None]] = []
    notes: list[str] = []
    gpus = tf.config.list_physical_devices("GPU")
    for i, gpu in enumerate(gpus):
        details = tf.config.experimental.get_device_details(gpu)
        devices.append(
            ("cuda", i, str(details.get("device_name", gpu.name)), _capability(details.get("compute_capability")))
        )
    for i, tpu in enumerate(tf.config.list_physical_devices("TPU")):
        devices.append(("tpu", i, str(tpu.name), None))
    if not gpus:
        built = "built with CUDA" if tf.test.is_built_with_cuda() else "built without CUDA"
        notes.append(f"tensorflow {tf.__version__} ({built}) lists no GPU")
    return devices, notes
