"""Reading checkpoint files safely for `polyamp.check_hazards`: a backend's tensor reader checks a file before it reads
it and summarises its arrays in blocks."""

from polyamp._src.array_readers import is_array, summarize_array
from polyamp._src.checkpoints import (
    CHUNK_BYTES,
    CORRUPT_FILE,
    DEFAULT_MAX_BYTES,
    MAX_CONFIG_BYTES,
    SafetensorsEntry,
    check_declared_bytes,
    check_zip_archive,
    chunk_indices,
    read_safetensors_header,
)
from polyamp._src.tensor_reading import TensorSummary

__all__ = [
    "CHUNK_BYTES",
    "CORRUPT_FILE",
    "DEFAULT_MAX_BYTES",
    "MAX_CONFIG_BYTES",
    "SafetensorsEntry",
    "TensorSummary",
    "check_declared_bytes",
    "check_zip_archive",
    "chunk_indices",
    "is_array",
    "read_safetensors_header",
    "summarize_array",
]
