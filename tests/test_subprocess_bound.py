"""The bound on the long subprocesses the tests start (``run_bounded``, ``POLYAMP_TEST_TIMEOUT``)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

RunBounded = Callable[..., "subprocess.CompletedProcess[str]"]


def test_a_finished_subprocess_is_returned_as_subprocess_run_returns_it(
    run_bounded: RunBounded, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POLYAMP_TEST_TIMEOUT", raising=False)
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    result = run_bounded([sys.executable, "-c", code])
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_past_the_bound_the_run_stops_with_its_elapsed_time_and_output(
    run_bounded: RunBounded, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POLYAMP_TEST_TIMEOUT", "2")
    # A child of its own holds the pipes open, as a test suite's subprocesses do: it is stopped too.
    code = (
        "import subprocess, sys, time\n"
        "print('started', flush=True)\n"
        "print('working', file=sys.stderr, flush=True)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "time.sleep(120)\n"
    )
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_bounded([sys.executable, "-c", code])
    assert time.monotonic() - start < 60
    message = str(failed.value)
    assert re.search(r" was stopped after (\d+) s, past the 2 s bound \(POLYAMP_TEST_TIMEOUT=2; ", message), message
    assert int(re.search(r"after (\d+) s", message).group(1)) >= 2  # type: ignore[union-attr]
    assert "--- stdout so far ---\nstarted\n" in message and "--- stderr so far ---\nworking\n" in message


@pytest.mark.parametrize("value", ["0", "-5", "ten"])
def test_a_bound_that_is_not_a_positive_number_is_refused(
    value: str, run_bounded: RunBounded, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POLYAMP_TEST_TIMEOUT", value)
    with pytest.raises(pytest.UsageError, match=rf"POLYAMP_TEST_TIMEOUT='{value}': expected a positive number"):
        run_bounded([sys.executable, "-c", "pass"])
