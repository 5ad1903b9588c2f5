"""The examples run end to end at tiny sizes and print what they promise."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=600, cwd=EXAMPLES
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_torch_loop() -> None:
    pytest.importorskip("torch")
    out = run("torch_loop.py", "--epochs", "2", "--batches", "3")
    assert "policy mixed_float16, loss scaling on" in out
    losses = [float(v) for v in re.findall(r"loss=([0-9.]+)", out)]
    assert len(losses) == 2 and all(v == v and v < 10 for v in losses)  # finite


def test_torch_recipe() -> None:
    pytest.importorskip("torch")
    out = run("torch_recipe.py", "--epochs", "1", "--num-batches", "2", "--size", "32", "--batch-size", "8")
    for name in ("default precision", "torch.amp", "polyamp"):
        assert re.search(rf"{name}: [0-9.]+ s", out), out
    assert "polyamp / torch.amp time:" in out
