"""The conformance runner and its command line: outcomes, skips, divergences, exit status."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest

import polyamp
import polyamp.backend_api
from polyamp.conformance import HarnessUnavailable, case_functions, expand, format_table, run


class FakeHarness:
    """Answers op_dtype only; wrong about softmax on purpose, and honest or not about it."""

    backend = "fake"

    def __init__(self, device: str) -> None:
        if device != "cpu":
            raise HarnessUnavailable("the fake harness has no cuda")
        self.device = device
        self.divergences: Mapping[str, str] = {}

    def op_dtype(self, op: str, policy: Any) -> str:
        if op == "softmax" or op in ("matmul", "dense", "conv"):
            return policy.compute_dtype
        return "float32"


class HonestFakeHarness(FakeHarness):
    backend = "honest"

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.divergences = {"op:softmax": "the fake runs softmax in the compute dtype", "op:sum": "listed but not true"}


@pytest.fixture
def fake_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    module = type(sys)("polyamp_fake_harness")
    module.FakeHarness = FakeHarness  # type: ignore[attr-defined]
    module.HonestFakeHarness = HonestFakeHarness  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "polyamp_fake_harness", module)
    for name, target in (("fake", "FakeHarness"), ("honest", "HonestFakeHarness")):
        polyamp.backend_api.register_backend(
            polyamp.backend_api.BackendSpec(
                name=name,
                target="polyamp_fake_harness:FakeHarness",
                frameworks=(f"{name}fw",),
                install_hint="none",
                harness=f"polyamp_fake_harness:{target}",
            )
        )


def test_every_case_is_found_and_parametrised() -> None:
    names = [case.__name__ for case in case_functions()]
    assert names[0] == "test_op_dtype" and "test_cross_backend_same_trajectory_and_resume" in names
    ids = [case_id for case_id, _ in expand(case_functions()[0])]
    assert len(ids) == 5 * 8 and "mixed_float16-softmax" in ids


def test_wrong_dtypes_fail_and_unavailable_devices_skip(fake_backends: None) -> None:
    results = run(["fake"], ["cpu", "cuda"], keyword="test_op_dtype[")
    by_id = {(r.case, r.target): r for r in results}
    assert by_id[("(all cases)", "fake-cuda")].outcome == "skipped"
    assert "no cuda" in by_id[("(all cases)", "fake-cuda")].detail
    failed = by_id[("test_op_dtype[mixed_float16-softmax]", "fake-cpu")]
    assert (
        failed.outcome == "failed"
        and "dtype=float16, but should be float32 [softmax(policy=mixed_float16)" in failed.detail
    )
    assert by_id[("test_op_dtype[float32-softmax]", "fake-cpu")].outcome == "passed"
    assert not all(r.ok for r in results)


def test_listed_divergences_are_xfailed_and_stale_ones_reported(fake_backends: None) -> None:
    results = run(["honest"], ["cpu"], keyword="test_op_dtype[")
    outcomes = {r.case: r.outcome for r in results if r.target == "honest-cpu"}
    assert outcomes["test_op_dtype[mixed_float16-softmax]"] == "xfailed"
    assert outcomes["test_op_dtype[mixed_float16-sum]"] == "xpassed"  # listed, but the fake is right: stale
    assert outcomes["test_op_dtype[float32-softmax]"] == "passed"  # not a low-precision policy: no divergence
    table = format_table(results)
    assert "xpassed" in table and "listed as a divergence but passed" in table


def test_unknown_backend_is_a_skip_with_the_reason() -> None:
    results = run(["nonesuch"], ["cpu"], keyword="test_op_dtype[float32-matmul]")
    assert [(r.outcome, r.detail) for r in results] == [("skipped", "no backend named 'nonesuch' is registered")]


@pytest.mark.slow
def test_command_line_runs_a_backend_and_sets_the_exit_status() -> None:
    pytest.importorskip("torch")
    ok = subprocess.run(
        [sys.executable, "-m", "polyamp.conformance", "--backend", "torch", "--device", "cpu", "-k", "trajectory"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "test_trajectory_matches_the_reference[hysteresis]" in ok.stdout and "6 passed" in ok.stdout
    cuda = subprocess.run(
        [sys.executable, "-m", "polyamp.conformance", "--backend", "torch", "--device", "cuda", "-k", "trajectory"],
        capture_output=True,
        text=True,
    )
    if "sees no CUDA device" in cuda.stdout:  # a skip with the reason, never a pass
        assert cuda.returncode == 0 and " passed" not in cuda.stdout.splitlines()[-1]
