"""The examples run end to end at tiny sizes and print what they promise."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


#: A Python warning as printed: ``path:line: Category: message``.
WARNING_LINE = re.compile(r"^(?P<path>.+?):\d+: (?P<category>\w*Warning): (?P<message>.*)$", re.MULTILINE)


def own_warnings(stderr: str) -> list[str]:
    """The warnings a run printed that are not a framework's own: attributed to the example or to polyamp's code
    (anything outside an installed framework's files), and TensorFlow AutoGraph's "could not transform"."""
    found = [m.group(0) for m in WARNING_LINE.finditer(stderr) if "site-packages" not in m.group("path")]
    return found + [line for line in stderr.splitlines() if "could not transform" in line]


def run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run an example; it must succeed without a warning of its own or of polyamp's (frameworks' import logs
    and their own warnings aside)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=EXAMPLES,
        env={**os.environ, "PYTHONWARNINGS": "default", **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert own_warnings(result.stderr) == [], result.stderr[-3000:]
    return result.stdout + result.stderr


def test_own_warnings_tells_a_polyamp_warning_from_a_frameworks() -> None:
    stderr = (
        "/x/site-packages/keras/src/a.py:3: UserWarning: a framework's own\n"
        "/work/examples/torch_loop.py:40: TrainingStateWarning: bfloat16 weights stepped without a plan\n"
        "W0000 autograph.py:1] AutoGraph could not transform <function _gcd_import> and will run it as-is.\n"
    )
    assert own_warnings(stderr) == [
        "/work/examples/torch_loop.py:40: TrainingStateWarning: bfloat16 weights stepped without a plan",
        "W0000 autograph.py:1] AutoGraph could not transform <function _gcd_import> and will run it as-is.",
    ]


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


@pytest.mark.slow  # a fresh TensorFlow interpreter; the Keras guides' blocks run fit in the fast set
def test_keras_fit() -> None:
    pytest.importorskip("tensorflow")
    out = run("keras_fit.py", "--epochs", "2", "--samples", "256")
    assert "layer_norm=float32" in out and "dense=float16" in out
    losses = [float(v) for v in re.findall(r"loss=([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "loss_scale=" in out and "prediction dtype: float32" in out
    assert re.search(r"run: 8 steps, (none|\d+) skipped", out), out  # the optimizer's summary of the 8 batches


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_keras_backends(backend: str) -> None:
    pytest.importorskip("keras")
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    out = run("keras_backends.py", "--steps", "12", env={"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert f"on {backend}, policy mixed_float16" in out
    for loop in ("fit", "custom loop"):
        found = re.search(rf"{loop}: loss ([0-9.]+) -> ([0-9.]+)", out)
        assert found is not None and float(found.group(2)) < float(found.group(1)), out
    # the batch carrying an inf is skipped: the scale backs off once, the other 11 steps apply
    assert "loss scale 32768, skipped steps 1, applied steps 11" in out
    assert "prediction dtype: float32" in out


def test_keras_hub_task() -> None:
    pytest.importorskip("keras_hub")
    out = run("keras_hub_task.py", "--steps", "3", env={"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert "layer_norm computes in float32, transformer_layer_0 in float16" in out
    assert re.search(r"fit: 3 steps, loss [0-9.]+, loss_scale 65536", out), out
    assert "loaded: polyamp_keras.LossScaleOptimizer(Adam), scale 65536, iterations 3" in out
    found = re.search(r"generated \[([0-9, ]+)\]", out)
    assert found is not None and len(found.group(1).split(",")) == 12, out


@pytest.mark.parametrize(
    "flags", [(), pytest.param(("--scaler",), marks=pytest.mark.slow)], ids=["optimizer", "loss_scaler"]
)
def test_gradient_tape(flags: tuple[str, ...]) -> None:
    pytest.importorskip("tensorflow")
    out = run("gradient_tape.py", "--steps", "20", *flags)
    losses = [float(v) for v in re.findall(r"loss=([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "output dtype: <dtype: 'float32'>" in out
    assert "Unable to locate the source code" not in out  # autograph leaves polyamp alone


@pytest.mark.slow  # the README's demo command runs it too
def test_quickstart() -> None:
    out = run("quickstart.py", "--steps", "30")
    assert "policy mixed_float16: params float32, compute float16, output float32" in out
    assert "65536 65536 131072 65536 65536 65536 32768 16384 16384 16384 32768 32768 32768 65536" in out
    for name, module in (("PyTorch", "torch"), ("Keras", "tensorflow")):
        if importlib.util.find_spec(module) is not None:
            final = re.search(rf"{name}: loss ([0-9.]+).* -> ([0-9.]+)", out)
            assert final is not None and float(final.group(2)) < float(final.group(1)), out
    if all(importlib.util.find_spec(m) for m in ("torch", "tensorflow")):
        assert "same loss-scale state in both frameworks: True" in out


@pytest.mark.parametrize("policy", ["mixed_float16", pytest.param("mixed_bfloat16", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    ("example", "needs", "skips"),
    [
        ("jax_optax.py", ("jax", "optax"), "skipped steps [4, 11]"),
        ("jax_flax.py", ("optax", "flax"), "skipped steps [4, 11]; non-finite gradients in ['params/Dense_0/kernel']"),
    ],
    ids=["jax_optax", "jax_flax"],
)
def test_jax_examples(example: str, needs: tuple[str, ...], skips: str, policy: str) -> None:
    for module in needs:
        pytest.importorskip(module)
    out = run(example, "--policy", policy, "--steps", "30", "--overflow-at", "4,11")
    mode = "scaling" if policy == "mixed_float16" else "guarding"
    assert f"loss scaler {mode}" in out, out
    assert skips in out, out
    first, last = (float(v) for v in re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out).groups())  # type: ignore[union-attr]
    assert last < first
