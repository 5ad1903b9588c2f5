"""The hazard check on checkpoint files it cannot trust: a file that cannot be read (empty, truncated, corrupt
headers, overlapping or impossible tensors, a reader that fails) is a CheckpointError naming the file and the
reason, and the command line exits 2 on it; deep or self-referencing structures are read without recursion;
what a file declares is bounded by ``max_bytes``, and compressed members are read in bounded blocks.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import polyamp
import polyamp.backend_api
from polyamp import CheckpointError, PolyampError, PolyampTypeError, PolyampValueError
from polyamp.__main__ import main
from polyamp._src.checkpoints import MAX_CONFIG_BYTES, chunk_indices

if TYPE_CHECKING:
    from conftest import ReaderBackend

ROOT = Path(__file__).resolve().parents[1]


def _safetensors(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _f32(shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def _valid_safetensors() -> bytes:
    return _safetensors({"w": _f32([2, 2], 0, 16)}, struct.pack("<4f", 1.0, -2.0, 3.0, 70000.0))


# -- a checkpoint that cannot be read is a CheckpointError naming the file and the reason ---------------------

CORRUPT_SAFETENSORS: list[tuple[str, Callable[[], bytes], str]] = [
    ("empty", lambda: b"", r"it is 0 bytes long, shorter than the 8-byte header length"),
    ("seven_bytes", lambda: b"1234567", r"it is 7 bytes long"),
    ("truncated", lambda: _valid_safetensors()[:-3], r"tensor 'w' ends at byte 16 of the data, but the file holds 13"),
    (
        "header_2_62",
        lambda: struct.pack("<Q", 2**62) + b"{}",
        r"it declares a JSON header of 4611686018427387904 bytes .*, above the limit of 104857600 bytes \(100 MiB\)",
    ),
    (
        "header_past_end",
        lambda: struct.pack("<Q", 100) + b"{}",
        r"it declares a JSON header of 100 bytes, but only 2 bytes follow",
    ),
    (
        "declares_40_gb",
        lambda: _safetensors({"w": _f32([10**10], 0, 4 * 10**10)}),
        r"tensor 'w' ends at byte 40000000000 of the data, but the file holds 0 bytes",
    ),
    (
        "shape_overflow",
        lambda: _safetensors({"w": _f32([2**40, 2**40], 0, 16)}, bytes(16)),
        r"tensor 'w' declares shape \[1099511627776, 1099511627776\] of F32, which takes 4835703278458516698824704 "
        r"bytes .*, but its data_offsets \[0, 16\] span 16 bytes",
    ),
    ("bad_json", lambda: struct.pack("<Q", 5) + b"{nope", r"its header is not valid UTF-8 JSON"),
    ("not_an_object", lambda: _safetensors([1, 2]), r"its header must be a JSON object of tensors; it is a list"),
    (
        "overlap",
        lambda: _safetensors({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, bytes(12)),
        r"tensors 'a' and 'b' overlap \(bytes 4 to 8",
    ),
    (
        "unknown_dtype",
        lambda: _safetensors({"a": {"dtype": "F17", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
        r"tensor 'a' has dtype 'F17', not a safetensors dtype \(BOOL, U8",
    ),
    (
        "negative_shape",
        lambda: _safetensors({"a": _f32([-2], 0, 8)}, bytes(8)),
        r"tensor 'a' has shape \[-2\], with a negative dimension",
    ),
    (
        "bad_offsets",
        lambda: _safetensors({"a": _f32([2], 8, 0)}, bytes(8)),
        r"tensor 'a' has data_offsets \[8, 0\]; they must be \[begin, end\]",
    ),
]


@pytest.mark.parametrize(("case", "content", "reason"), CORRUPT_SAFETENSORS, ids=[c[0] for c in CORRUPT_SAFETENSORS])
def test_corrupt_safetensors_is_a_checkpoint_error(
    tmp_path: Path, case: str, content: Callable[[], bytes], reason: str
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(content())
    with pytest.raises(CheckpointError, match=rf"Cannot read the checkpoint '.*{case}\.safetensors': {reason}") as info:
        polyamp.check_hazards(path, "mixed_float16")
    assert isinstance(info.value, PolyampError) and isinstance(info.value, ValueError)
    assert str(info.value).endswith("The file is corrupt or truncated: re-download or re-save it.") or case == (
        "unknown_dtype"
    )


def test_a_valid_safetensors_file_passes_the_header_checks(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_valid_safetensors())
    (hazard,) = polyamp.check_hazards(path, "mixed_float16")
    assert (hazard.kind, hazard.name, hazard.dtype, hazard.value) == ("float16_overflow", "w", "float32", 70000.0)


def test_deeply_nested_checkpoints_are_read_without_recursion(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "deep.pt"
    state: dict[str, Any] = {}
    inner = state
    for _ in range(3000):
        inner["x"] = {}
        inner = inner["x"]
    inner["w"] = torch.tensor([1e5])
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # pickling 3000 nested dicts needs it; reading them must not
    try:
        torch.save(state, path)
    finally:
        sys.setrecursionlimit(limit)
    (hazard,) = polyamp.check_hazards(path, "mixed_float16")
    assert hazard.kind == "float16_overflow" and hazard.name == "x." * 3000 + "w"


def test_a_state_dict_holding_itself_is_read_once() -> None:
    torch = pytest.importorskip("torch")
    state: dict[str, Any] = {"w": torch.tensor([1e5])}
    state["again"] = state
    assert [(h.kind, h.name) for h in polyamp.check_hazards(state, "mixed_float16")] == [("float16_overflow", "w")]


def test_a_corrupt_weights_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    pytest.importorskip("h5py")
    pytest.importorskip("keras")
    path = tmp_path / "bad.weights.h5"
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    with pytest.raises(CheckpointError, match=r"'.*bad\.weights\.h5': h5py cannot open it as an HDF5 file \("):
        polyamp.check_hazards(path, "mixed_float16")


def test_any_error_of_a_reader_on_a_file_becomes_a_checkpoint_error(
    reader_backend: ReaderBackend, tmp_path: Path
) -> None:
    def read(source: object) -> list[tuple[str, str, float | None]]:
        raise RecursionError("maximum recursion depth exceeded")

    reader_backend("brokenfw", read, (".broken",))
    path = tmp_path / "m.broken"
    path.write_text("")
    with pytest.raises(
        CheckpointError, match=r"'.*m\.broken': the brokenfw reader failed with RecursionError: maximum recursion"
    ):
        polyamp.check_hazards(path, "mixed_float16")
    model = type("Model", (), {"__module__": "brokenfw.models"})()
    with pytest.raises(RecursionError):  # objects in memory: the reader's own error, not a file's
        polyamp.check_hazards(model, "mixed_float16")


def test_the_command_line_exits_2_on_an_unreadable_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"1234567")
    result = subprocess.run(
        [sys.executable, "-m", "polyamp", "doctor", "--framework", "torch", "--check", str(path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        cwd=ROOT,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr
    assert f"Cannot read the checkpoint {str(path)!r}: it is 7 bytes long" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_command_line_exits_2_for_each_unreadable_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    overlap = tmp_path / "overlap.safetensors"
    overlap.write_bytes(_safetensors({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, bytes(12)))
    pickle = tmp_path / "garbage.pt"
    pickle.write_bytes(b"not a checkpoint")
    big = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(1024)}, big)
    for path, reason in [
        (overlap, "tensors 'a' and 'b' overlap"),
        (pickle, "it is not a checkpoint torch.load can read"),
        (big, "above the limit of 1024 bytes (1 KiB) (max_bytes)"),
    ]:
        assert main(["doctor", "--framework", "torch", "--check", str(path), "--max-bytes", "1K"]) == 2
        err = capsys.readouterr().err
        assert f"python -m polyamp doctor: Cannot read the checkpoint {str(path)!r}" in err and reason in err
    assert main(["doctor", "--framework", "torch", "--check", str(big), "--max-bytes", "1M"]) == 0
    assert main(["doctor", "--check", str(big), "--max-bytes", "12X"]) == 2
    assert "argument --max-bytes: expected a positive number of bytes" in capsys.readouterr().err
    assert main(["doctor", "--max-bytes", "1G"]) == 2
    assert "--max-bytes needs --check PATH" in capsys.readouterr().err


def test_max_bytes_must_be_a_positive_int(tmp_path: Path) -> None:
    with pytest.raises(PolyampTypeError, match=r"`max_bytes` must be an int.*Received: '1G' \(of type str\)"):
        polyamp.check_hazards(tmp_path / "m.pt", "float32", max_bytes="1G")  # type: ignore[arg-type]
    with pytest.raises(PolyampValueError, match=r"`max_bytes` must be a positive number of bytes.*Received: 0"):
        polyamp.check_hazards(tmp_path / "m.pt", "float32", max_bytes=0)


# -- bounded reading of declared sizes and compressed checkpoints ---------------------------------------------


def _gzip_zeros_weights(path: Path, rows: int = 16384) -> None:
    """A .weights.h5 declaring rows x 1024 float32 (64 MiB by default) of gzip'd zeros in a few KB."""
    h5py = pytest.importorskip("h5py")
    with h5py.File(path, "w") as weights:
        dataset = weights.create_dataset(
            "layers/dense/vars/0", shape=(rows, 1024), dtype="float32", chunks=(256, 1024), compression="gzip"
        )
        dataset[rows - 1, 1023] = 70000.0  # one written chunk; every other one is the fill value


def test_compressed_weights_are_read_in_bounded_blocks(tmp_path: Path) -> None:
    pytest.importorskip("keras")
    path = tmp_path / "zeros.weights.h5"
    _gzip_zeros_weights(path)
    assert path.stat().st_size < 64 * 1024  # 64 MiB declared
    polyamp.check_hazards(path, "float32")  # the reader's imports, outside the measurement
    tracemalloc.start()
    try:
        found = polyamp.check_hazards(path, "mixed_float16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(h.kind, h.name, h.value) for h in found] == [("float16_overflow", "layers/dense/vars/0", 70000.0)]
    assert peak < 24 * 2**20, f"peak {peak / 2**20:.1f} MiB reading 64 MiB declared"


def test_weights_declaring_more_than_max_bytes_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("keras")
    path = tmp_path / "zeros.weights.h5"
    _gzip_zeros_weights(path)
    with pytest.raises(
        CheckpointError,
        match=r"zeros\.weights\.h5': its tensors declare 67108864 bytes \(64 MiB\), above the limit of 1048576 "
        r"bytes \(1 MiB\) \(max_bytes\)\. If the checkpoint is genuine, raise the limit: "
        r"check_hazards\(\.\.\., max_bytes=N\) or python -m polyamp doctor --check PATH --max-bytes N\.",
    ):
        polyamp.check_hazards(path, "mixed_float16", max_bytes=2**20)
    assert main(["doctor", "--framework", "torch", "--check", str(path), "--max-bytes", "64M"]) == 1


def test_safetensors_declaring_more_than_max_bytes_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    path = tmp_path / "m.safetensors"
    path.write_bytes(_valid_safetensors())
    with pytest.raises(CheckpointError, match=r"its tensors declare 16 bytes, above the limit of 15 bytes"):
        polyamp.check_hazards(path, "mixed_float16", max_bytes=15)
    assert len(polyamp.check_hazards(path, "mixed_float16", max_bytes=16)) == 1


def _keras_archive(path: Path, members: dict[str, int]) -> None:
    """A zip archive whose members hold that many spaces, deflated (a few KB per 64 MiB)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, size in members.items():
            with archive.open(name, "w", force_zip64=True) as member:
                block = b" " * 2**20
                for start in range(0, size, len(block)):
                    member.write(block[: size - start])


def test_a_keras_config_that_inflates_past_its_limit_is_refused_unread(tmp_path: Path) -> None:
    pytest.importorskip("keras")
    path = tmp_path / "bomb.keras"
    _keras_archive(path, {"metadata.json": 2, "config.json": MAX_CONFIG_BYTES + 1})
    assert path.stat().st_size < 2**20
    tracemalloc.start()
    try:
        with pytest.raises(
            CheckpointError,
            match=r"bomb\.keras': its 'config\.json' inflates to 67108865 bytes \(64 MiB\), above the limit of "
            r"67108864 bytes \(64 MiB\) for a model configuration\..*load it yourself and pass the model",
        ):
            polyamp.check_hazards(path, "mixed_float16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20


def test_keras_archives_declaring_more_than_max_bytes_or_not_zips_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("keras")
    path = tmp_path / "big.keras"
    _keras_archive(path, {"config.json": 2, "model.weights.h5": 2 * 2**20})
    with pytest.raises(CheckpointError, match=r"big\.keras': its tensors declare 2097154 bytes \(2 MiB\), above"):
        polyamp.check_hazards(path, "mixed_float16", max_bytes=2**20)
    fake = tmp_path / "fake.keras"
    fake.write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(CheckpointError, match=r"fake\.keras': it is not a zip archive, as a \.keras file is"):
        polyamp.check_hazards(fake, "mixed_float16")
    empty = tmp_path / "empty.keras"
    _keras_archive(empty, {"metadata.json": 2})
    with pytest.raises(CheckpointError, match=r"empty\.keras': the archive holds no 'config\.json'"):
        polyamp.check_hazards(empty, "mixed_float16")


def test_chunk_indices_cover_the_array_in_bounded_blocks() -> None:
    numpy = pytest.importorskip("numpy")
    array = numpy.arange(5 * 7 * 3, dtype="float32").reshape(5, 7, 3)
    for limit in (4, 12, 40, 84, 200, 10_000):
        seen = numpy.zeros(array.shape, dtype=int)
        for index in chunk_indices(array.shape, 4, limit):
            block = array[index]
            assert block.nbytes <= max(limit, 4)
            seen[index] += 1
        assert (seen == 1).all(), limit
