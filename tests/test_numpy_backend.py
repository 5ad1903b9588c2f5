"""A third-party backend written only against polyamp's public API passes the conformance cases it can run.

``tests/numpy_backend`` holds ``npfw``, a NumPy stand-in for a framework polyamp has never heard of, and
``polyamp_npfw``, its backend: an imperative device form, a functional one and a conformance harness.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import polyamp
import polyamp.backend_api
from polyamp.conformance import run

HERE = Path(__file__).resolve().parent / "numpy_backend"
#: The conftest fixture run_bounded: a subprocess bounded by POLYAMP_TEST_TIMEOUT.
RunBounded = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def npfw_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    monkeypatch.syspath_prepend(str(HERE))
    import polyamp_npfw

    polyamp.backend_api.register_backend(polyamp_npfw.SPEC)
    yield polyamp_npfw
    for name in ("npfw", "polyamp_npfw"):
        sys.modules.pop(name, None)


def test_the_backend_imports_only_the_public_api() -> None:
    imported = set()
    for path in HERE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    polyamp_modules = {name for name in imported if name.partition(".")[0] == "polyamp"}
    assert {
        name.rpartition(".")[0] if name.startswith("polyamp.backend_api.") else name for name in polyamp_modules
    } == {
        "polyamp",
        "polyamp.backend_api",
        "polyamp.conformance",
    }


def test_it_passes_every_case_it_has_the_capabilities_for(npfw_backend: object) -> None:
    results = run(["npfw"])
    failures = [(r.case, r.detail) for r in results if not r.ok]
    assert failures == []
    passed = {r.case.partition("[")[0] for r in results if r.outcome == "passed"}
    assert passed == {
        "test_trajectory_matches_the_reference",
        "test_random_settings_follow_the_reference",
        "test_functional_form_follows_the_reference",
        "test_functional_form_guards_records_and_spikes",
        "test_one_sequence_every_loop_style",
        "test_two_optimizers_skip_separately_and_update_once",
        "test_misuse_is_the_same_error_everywhere_and_leaves_no_trace",
        "test_skipped_step_changes_nothing",
        "test_unscale_then_clip_equals_the_float32_update",
        "test_disabled_scaler_passes_the_loss_through_and_changes_nothing",
    }
    skipped = {r.case.partition("[")[0]: r.detail for r in results if r.outcome == "skipped"}
    assert "lacks the 'op_dtype' capability" in skipped["test_op_dtype"]
    assert "lacks the 'low_precision' capability" in skipped["test_converges_like_float32"]
    assert "lacks the 'tiny_gradient' capability" in skipped["test_underflow_rescue"]


def test_a_loss_scaler_binds_to_it_from_its_tensors(npfw_backend: object) -> None:
    import npfw

    polyamp.set_policy("mixed_float16")
    scaler = polyamp.LossScaler()
    params = npfw.mlp(0)
    opt = npfw.SGD(params, lr=0.1)
    import numpy as np

    x = np.ones((4, 8), np.float32)
    y = np.zeros(4, np.int64)
    scaler.scale(npfw.loss(params, x, y)).backward()
    assert scaler.backend == "npfw"
    scaler.step(opt)
    scaler.update()
    assert opt.steps == 1 and not bool(scaler.step_skipped(opt))


def test_pytest_runs_the_suite_on_it_from_an_entry_point(tmp_path: Path, run_bounded: RunBounded) -> None:
    """What a third party does: install a package with a polyamp.backends entry point, run the shipped suite."""
    dist = tmp_path / "polyamp_npfw-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: polyamp-npfw\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[polyamp.backends]\nnpfw = polyamp_npfw:SPEC\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(HERE), os.environ.get("PYTHONPATH", "")]))
    result = run_bounded(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "polyamp.conformance.suite",
            "--polyamp-backend",
            "npfw",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
        ],
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
    assert "[npfw-cpu-" in result.stdout or "npfw-cpu" in result.stdout
