"""A scaler and threads: reading its records from another thread while the training thread trains, and one
scaler driven by two threads.

A monitoring thread polls ``records()``, ``last_record()``, ``get_scale()``, ``skipped_steps()`` and
``step_skipped()`` as fast as it can while the main thread trains a tiny model with overflows injected at
known iterations. Between what the monitor saw and the trainer's final ``records()`` every iteration must
have exactly one record (the same one whoever read it), with the right skip flag, and nothing may crash: with
a fused optimizer the non-finite gradients of a skipped step are counted from ``param.grad``, which the
training thread is about to zero and recompute, so that counting must stay in the training thread.

The history is small because the scaler reads its records by itself every ``history // 2`` iterations: the
trainer's own reads then meet the monitor's often, and the thread switch interval is short for the same
reason. Each monitoring run is a subprocess, so a crash of the interpreter fails the test instead of ending the session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from polyamp import ScalerUsageError

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

ITERATIONS = 1000
HISTORY = 16  # the scaler's own reads every 8 iterations
#: Every OVERFLOW_EVERY-th iteration multiplies its loss by inf, so its gradients are non-finite.
OVERFLOW_EVERY = 23

WORKER = textwrap.dedent(
    """
    import json
    import logging
    import sys
    import threading

    import torch

    import polyamp
    import polyamp_torch

    optimizer_kind, iterations, history, overflow_every = sys.argv[1], *map(int, sys.argv[2:5])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    sys.setswitchinterval(1e-5)  # switch threads often: the races below need no luck
    model = torch.nn.Linear(8, 1)
    if optimizer_kind == "fused_adam":
        optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-3, fused=True)
    else:
        optimizer = torch.optim.SGD(model.named_parameters(), lr=1e-3)
    # Scales stay in [2**8, 2**16]: only the injected overflows skip.
    scaler = polyamp_torch.TorchLossScaler(
        init_scale=2.0**12, growth_interval=5, max_scale=2.0**16, min_scale=2.0**8, enabled=True, history=history
    )
    lost_warnings = []


    class Lost(logging.Handler):
        def emit(self, record):
            if "without being recorded" in record.getMessage():
                lost_warnings.append(record.getMessage())


    logging.getLogger("polyamp").addHandler(Lost())
    seen = {}  # iteration -> [skipped, reason], from every read
    conflicts = []
    gaps = []
    monitor_errors = []
    polls = [0]
    stop = threading.Event()
    polled = threading.Event()  # set after each poll: the trainer waits for one now and then (below)


    def note(records, who):
        previous = None
        for record in records:
            if previous is not None and record.iteration != previous + 1:
                gaps.append([who, previous, record.iteration])
            previous = record.iteration
            value = [record.skipped, record.reason]
            known = seen.setdefault(record.iteration, value)
            if known != value:
                conflicts.append([who, record.iteration, known, value])


    def monitor():
        try:
            while not stop.is_set():
                note(scaler.records(), "monitor")
                last = scaler.last_record()
                if last is not None:
                    note([last], "monitor")
                scaler.get_scale()
                int(scaler.skipped_steps())
                try:
                    bool(scaler.step_skipped())
                except polyamp.ScalerUsageError:
                    pass  # before the first iteration ended
                polls[0] += 1
                polled.set()
        except BaseException as exc:  # reported to the test
            monitor_errors.append(repr(exc))


    x = torch.randn(16, 8)
    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    unnamed = []  # overflow iterations whose record, read by the trainer right after update, names no gradient
    for i in range(iterations):
        if i % (history // 4) == 0:
            # records() keeps the last `history` records: a monitor that polled less often than that would miss
            # some that were recorded. The trainer waits for a poll every history // 4 iterations, so the
            # monitor's reads cover every iteration; they still interleave freely with the trainer's steps.
            polled.clear()
            polled.wait(10)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        if i % overflow_every == overflow_every - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if i % overflow_every == overflow_every - 1:
            last = scaler.last_record()
            if last is None or last.iteration != i or not last.skipped or not last.gradients:
                unnamed.append(i)
    stop.set()
    watcher.join()
    monitor_seen = len(seen)
    note(scaler.records(), "trainer")
    print(
        json.dumps(
            {
                "seen": {str(k): v for k, v in seen.items()},
                "monitor_seen": monitor_seen,
                "conflicts": conflicts,
                "gaps": gaps,
                "monitor_errors": monitor_errors,
                "polls": polls[0],
                "lost_warnings": lost_warnings,
                "skipped_steps": int(scaler.skipped_steps()),
                "unnamed": unnamed,
            }
        )
    )
    """
)


def _run(tmp_path: Path, optimizer_kind: str) -> dict[str, Any]:
    """Train and monitor in a subprocess that runs this checkout's polyamp; its report, or the test fails."""
    import polyamp
    import polyamp_torch

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    roots = [str(Path(str(module.__file__)).parent.parent) for module in (polyamp, polyamp_torch)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(script), optimizer_kind, str(ITERATIONS), str(HISTORY), str(OVERFLOW_EVERY)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"the training process died (exit code {done.returncode}): {done.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("optimizer_kind", ["fused_adam", pytest.param("sgd", marks=pytest.mark.slow)])
def test_a_monitoring_thread_sees_every_record_once(tmp_path: Path, optimizer_kind: str) -> None:
    report = _run(tmp_path, optimizer_kind)
    assert report["monitor_errors"] == []
    assert report["polls"] > 0 and report["monitor_seen"] > 0  # the reads did interleave with training
    assert report["lost_warnings"] == []
    assert report["conflicts"] == []
    assert report["gaps"] == []
    seen = {int(k): v for k, v in report["seen"].items()}
    assert sorted(seen) == list(range(ITERATIONS))
    overflows = {i for i in range(ITERATIONS) if i % OVERFLOW_EVERY == OVERFLOW_EVERY - 1}
    assert {i for i, (skipped, _) in seen.items() if skipped} == overflows
    assert {reason for skipped, reason in seen.values() if skipped} == {"overflow"}
    assert report["skipped_steps"] == len(overflows)
    # The training thread's own read right after update still names the non-finite gradients, also when the
    # monitor read the record first (the fused optimizer skipped on the device; the trainer counts them).
    assert report["unnamed"] == []


def _fused_overflow_iteration(scaler: Any, model: Any, optimizer: Any) -> None:
    """One iteration whose gradients are non-finite: the fused optimizer skips on the device."""
    optimizer.zero_grad()
    loss = model(torch.ones(2, 3)).pow(2).mean() * float("inf")
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _in_thread(fn: Any) -> Any:
    """``fn()`` run in another thread; its result (or its exception, re-raised)."""
    import threading

    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]
    return result[0]


def test_only_the_training_thread_counts_the_gradients_of_a_skip() -> None:
    import threading

    import polyamp_torch

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-3, fused=True)
    scaler = polyamp_torch.TorchLossScaler(enabled=True, history=HISTORY)
    counted_in: list[threading.Thread] = []
    device: Any = scaler.device_form
    count = device.non_finite_gradients

    def counting(opt: Any) -> Any:
        counted_in.append(threading.current_thread())
        return count(opt)

    device.non_finite_gradients = counting
    _fused_overflow_iteration(scaler, model, optimizer)
    # Another thread reads the skip first: recorded, without the names it may not count.
    seen = _in_thread(scaler.records)
    assert [(r.iteration, r.skipped, r.reason, r.gradients) for r in seen] == [(0, True, "overflow", ())]
    assert counted_in == []
    # The training thread's read, before its next iteration opens, names them in the record kept.
    record = scaler.last_record()
    assert record is not None and record.iteration == 0 and record.skipped
    assert [g.name for g in record.gradients] == ["weight", "bias"]
    assert counted_in == [threading.current_thread()]
    assert seen[0].gradients == ()  # a record already handed out stays as it was
    # When the next iteration opens before the training thread reads, the gradients are no longer the skip's:
    # the record stays without names.
    _fused_overflow_iteration(scaler, model, optimizer)
    assert [r.iteration for r in _in_thread(scaler.records)] == [0, 1]
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 3)).pow(2).mean()).backward()
    last = scaler.records()[-1]
    assert last.iteration == 1 and last.skipped and last.gradients == ()
    assert len(counted_in) == 1


def test_one_scaler_shared_by_two_threads_says_so() -> None:
    import threading

    import polyamp_torch

    scaler = polyamp_torch.TorchLossScaler("cpu")
    param = torch.nn.Parameter(torch.ones(2))
    scaler.scale(param.sum()).backward()  # this thread's iteration is open
    errors: list[BaseException] = []

    def other() -> None:
        try:
            scaler.scale(param.sum())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], ScalerUsageError)
    assert "started by another thread" in str(errors[0]) and "own LossScaler" in str(errors[0])
