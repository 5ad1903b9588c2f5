"""Third-party backends written only against polyamp's public API pass the conformance cases they can run.

``tests/numpy_backend`` holds ``npfw``, a NumPy stand-in for a framework polyamp has never heard of, and
``polyamp_npfw``, its backend: an imperative device form, a functional one and a conformance harness; and
``nptape`` with ``polyamp_nptape``, a backend of the tape loop style (its other semantics: test_tape_backend.py).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import polyamp
import polyamp.backend_api
from polyamp.conformance import run

if TYPE_CHECKING:
    from conftest import NumpyBackend

HERE = Path(__file__).resolve().parent / "numpy_backend"
#: The conftest fixture run_bounded: a subprocess bounded by POLYAMP_TEST_TIMEOUT.
RunBounded = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def npfw_backend(numpy_backend: NumpyBackend) -> Iterator[object]:
    with numpy_backend("npfw") as backend:
        yield backend


@pytest.mark.parametrize("modules", ["*.py", "polyamp_nptape.py"], ids=["all", "polyamp_nptape"])
def test_the_backends_import_only_the_public_api(modules: str) -> None:
    """The modules of tests/numpy_backend together, and the tape backend alone, import polyamp's public API."""
    imported = set()
    for path in HERE.glob(modules):
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


#: Per backend of tests/numpy_backend: the conformance cases it passes, and what it says for the cases it skips.
CONFORMANCE: dict[str, tuple[set[str], dict[str, str]]] = {
    "npfw": (
        {
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
        },
        {
            "test_op_dtype": "lacks the 'op_dtype' capability",
            "test_converges_like_float32": "lacks the 'low_precision' capability",
            "test_underflow_rescue": "lacks the 'tiny_gradient' capability",
        },
    ),
    "nptape": (
        {
            "test_trajectory_matches_the_reference",
            "test_random_settings_follow_the_reference",
            "test_two_optimizers_skip_separately_and_update_once",
            "test_misuse_is_the_same_error_everywhere_and_leaves_no_trace",
            "test_skipped_step_changes_nothing",
            "test_unscale_then_clip_equals_the_float32_update",
            "test_disabled_scaler_passes_the_loss_through_and_changes_nothing",
            "test_guard_skips_non_finite_steps_without_scaling",
            "test_records_replay_the_scale_of_every_step",
            "test_skipped_step_names_the_parameter_that_overflowed",
            "test_one_sequence_every_loop_style",
        },
        {},
    ),
}


@pytest.mark.parametrize("name", list(CONFORMANCE))
def test_it_passes_every_case_it_has_the_capabilities_for(numpy_backend: NumpyBackend, name: str) -> None:
    expected_passed, expected_skips = CONFORMANCE[name]
    with numpy_backend(name):
        results = run([name])
        failures = [(r.case, r.detail) for r in results if not r.ok]
        assert failures == []
        passed = {r.case.partition("[")[0] for r in results if r.outcome == "passed"}
        assert passed == expected_passed
        skipped = {r.case.partition("[")[0]: r.detail for r in results if r.outcome == "skipped"}
        for case, reason in expected_skips.items():
            assert reason in skipped[case]


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
