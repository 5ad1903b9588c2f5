"""Threads, tasks and imports in progress: `set_policy` is process-wide, `policy_scope` context-local.

No framework here: a framework whose import blocks until the test lets it go stands in for a slow one
(TensorFlow takes seconds), so every interleaving below is forced with events, not hoped for with sleeps.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import polyamp
import polyamp.backend_api
from polyamp import Policy
from polyamp._src import import_hooks
from polyamp.backend_api.policies import PolicyOverrides

if TYPE_CHECKING:
    from conftest import InstallFramework

TIMEOUT = 10.0  # seconds any wait below may take before the test fails instead of hanging


class Worker(threading.Thread):
    """A thread that keeps the exception its target raised, re-raised by `finish`."""

    def __init__(self, target: Callable[[], object], name: str = "worker") -> None:
        super().__init__(name=name, daemon=True)
        self._work = target
        self.error: BaseException | None = None
        self.result: object = None

    def run(self) -> None:
        try:
            self.result = self._work()
        except BaseException as exc:
            self.error = exc

    def finish(self, timeout: float = TIMEOUT) -> object:
        self.join(timeout)
        assert not self.is_alive(), f"{self.name} did not finish within {timeout} s"
        if self.error is not None:
            raise self.error
        return self.result


def start(target: Callable[[], object], name: str = "worker") -> Worker:
    worker = Worker(target, name)
    worker.start()
    return worker


def wait(event: threading.Event) -> None:
    assert event.wait(TIMEOUT), "an event the test waits for never came"


# -- process-wide set_policy, context-local policy_scope ------------------------------------------------


def test_overlapping_scopes_in_two_threads_do_not_leak() -> None:
    """D5: A enters, B enters, A exits, B exits; each saw its own scope and the process policy is intact."""
    a_entered, b_entered, a_exited = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str] = {}

    def thread_a() -> None:
        with polyamp.policy_scope("mixed_float16"):
            a_entered.set()
            wait(b_entered)
            seen["A, both inside"] = polyamp.get_policy().name
        seen["A, after its exit"] = polyamp.get_policy().name
        a_exited.set()

    def thread_b() -> None:
        wait(a_entered)
        with polyamp.policy_scope("mixed_bfloat16"):
            b_entered.set()
            wait(a_exited)
            seen["B, after A's exit"] = polyamp.get_policy().name
        seen["B, after its exit"] = polyamp.get_policy().name

    workers = [start(thread_a, "A"), start(thread_b, "B")]
    for worker in workers:
        worker.finish()
    assert seen == {
        "A, both inside": "mixed_float16",
        "A, after its exit": "float32",
        "B, after A's exit": "mixed_bfloat16",
        "B, after its exit": "float32",
    }
    assert polyamp.get_policy() == Policy("float32")
    assert polyamp.get_policy_setting().source == "default"


def test_a_scope_is_seen_only_by_the_thread_that_entered_it() -> None:
    polyamp.set_policy("mixed_bfloat16")
    inside, checked = threading.Event(), threading.Event()

    def scoped() -> str:
        with polyamp.policy_scope("float16"):
            inside.set()
            wait(checked)
            return polyamp.get_policy().name

    worker = start(scoped)
    wait(inside)
    assert polyamp.get_policy() == Policy("mixed_bfloat16")  # the worker's scope is not ours
    checked.set()
    assert worker.finish() == "float16"


def test_set_policy_reaches_threads_started_before_it() -> None:
    ready, changed = threading.Event(), threading.Event()

    def reader() -> tuple[str, str]:
        before = polyamp.get_policy().name
        ready.set()
        wait(changed)
        return before, polyamp.get_policy().name

    worker = start(reader)
    wait(ready)
    polyamp.set_policy("mixed_float16")
    changed.set()
    assert worker.finish() == ("float32", "mixed_float16")


def test_set_policy_from_a_worker_is_process_wide() -> None:
    start(lambda: polyamp.set_policy("mixed_bfloat16", overrides={"head": "float32"})).finish()
    assert polyamp.get_policy() == Policy("mixed_bfloat16")
    assert polyamp.backend_api.policies.get_policy_overrides() == PolicyOverrides({"head": "float32"})


def test_set_policy_inside_a_scope_takes_over_when_the_scope_ends() -> None:
    """The scope wins in its own context; the new process-wide policy is what remains after it."""
    with polyamp.policy_scope("float16"):
        polyamp.set_policy("mixed_bfloat16")
        assert polyamp.get_policy() == Policy("float16")
        assert start(lambda: polyamp.get_policy().name).finish() == "mixed_bfloat16"
    assert polyamp.get_policy() == Policy("mixed_bfloat16")


def test_scopes_are_local_to_asyncio_tasks() -> None:
    async def main() -> dict[str, str]:
        seen: dict[str, str] = {}
        entered = {"first": asyncio.Event(), "second": asyncio.Event()}
        done = {"first": asyncio.Event(), "second": asyncio.Event()}

        async def task(name: str, other: str, spec: str) -> None:
            with polyamp.policy_scope(spec):
                entered[name].set()
                await entered[other].wait()  # both scopes are open now, in two tasks on one thread
                seen[name] = polyamp.get_policy().name
                done[name].set()
                await done[other].wait()  # and stay open until both tasks have looked

        await asyncio.gather(task("first", "second", "mixed_float16"), task("second", "first", "bfloat16"))
        seen["after"] = polyamp.get_policy().name
        return seen

    assert asyncio.run(asyncio.wait_for(main(), TIMEOUT)) == {
        "first": "mixed_float16",
        "second": "bfloat16",
        "after": "float32",
    }


def test_a_task_started_in_a_scope_sees_it_while_the_scope_is_open() -> None:
    async def main() -> list[str]:
        seen: list[str] = []
        child_inside, scope_closed = asyncio.Event(), asyncio.Event()

        async def child() -> None:  # runs in a copy of the context it was created in
            seen.append(polyamp.get_policy().name)
            child_inside.set()
            await scope_closed.wait()
            seen.append(polyamp.get_policy().name)

        with polyamp.policy_scope("float16"):
            task = asyncio.create_task(child())
            await child_inside.wait()
            seen.append(await asyncio.to_thread(lambda: polyamp.get_policy().name))
        scope_closed.set()
        await task
        return seen

    assert asyncio.run(asyncio.wait_for(main(), TIMEOUT)) == ["float16", "float16", "float32"]


def test_scopes_exited_out_of_order_leave_the_open_one_in_effect() -> None:
    outer, inner = polyamp.policy_scope("float16"), polyamp.policy_scope("bfloat16")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert polyamp.get_policy() == Policy("bfloat16")
    inner.__exit__(None, None, None)
    assert polyamp.get_policy() == Policy("float32")


def test_policy_setting_reads_policy_and_overrides_in_one_step() -> None:
    """D5: a writer alternates two settings; every read sees a policy with its own overrides."""
    pairs = {
        "mixed_float16": PolicyOverrides({"head": "float32"}),
        "mixed_bfloat16": PolicyOverrides({"*norm*": "float32", "head": "bfloat16"}),
    }
    polyamp.set_policy("mixed_float16", overrides=pairs["mixed_float16"])
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            for name, overrides in pairs.items():
                polyamp.set_policy(name, overrides=overrides)

    worker = start(writer)
    reads = torn = 0
    deadline = time.monotonic() + 0.5
    try:
        while time.monotonic() < deadline:
            setting = polyamp.get_policy_setting()
            reads += 1
            torn += pairs[setting.policy.name] != setting.overrides
    finally:
        stop.set()
        worker.finish()
    assert reads > 1000 and torn == 0


def test_policy_setting_describes_where_the_policy_comes_from() -> None:
    default = polyamp.get_policy_setting()
    assert (default.policy, default.overrides, default.source) == (Policy("float32"), PolicyOverrides(), "default")
    polyamp.set_policy("mixed_float16", overrides={"head": "float32"})
    setting = polyamp.get_policy_setting()
    assert setting == polyamp.backend_api.policies.PolicySetting(
        Policy("mixed_float16"), PolicyOverrides({"head": "float32"}), "set_policy"
    )
    with polyamp.policy_scope("bfloat16") as policy:
        assert polyamp.get_policy_setting() == polyamp.backend_api.policies.PolicySetting(
            policy, PolicyOverrides(), "policy_scope"
        )
    assert polyamp.get_policy_setting() is setting


def test_listeners_hear_scopes_in_the_thread_that_entered_them() -> None:
    heard: list[tuple[str, str]] = []
    polyamp.backend_api.policies.add_policy_listener(lambda p: heard.append((threading.current_thread().name, p.name)))

    def scoped() -> None:
        with polyamp.policy_scope("float16"):
            pass

    start(scoped, "scoper").finish()
    assert heard == [("scoper", "float16"), ("scoper", "float32")]


def test_compiled_torch_regions_follow_scopes() -> None:
    """torch.compile traces the read while no scope is open; with one open it still computes right."""
    torch = pytest.importorskip("torch")
    polyamp_torch = pytest.importorskip("polyamp_torch")
    from torch import _dynamo as dynamo

    model = torch.nn.Linear(4, 4)

    def forward(x: Any) -> Any:
        with polyamp_torch.autocast(device_type="cpu"):
            return model(x)

    x = torch.randn(2, 4)
    polyamp.set_policy("mixed_bfloat16")
    dynamo.reset()
    compiled = torch.compile(forward, backend="eager")
    assert compiled(x).dtype == torch.bfloat16
    assert dynamo.explain(forward)(x).graph_break_count == 0
    with polyamp.policy_scope("mixed_float16"):
        assert compiled(x).dtype == torch.float16
        assert start(lambda: compiled(x).dtype).finish() == torch.bfloat16
    assert compiled(x).dtype == torch.bfloat16


# -- framework imports in progress in another thread ------------------------------------------------------


@dataclass
class SlowFramework:
    """A framework whose import blocks in its body until `release` is set; its hook logs every call."""

    name: str
    entered: threading.Event  # set once the import has started (the module is in sys.modules)
    release: threading.Event
    spec: polyamp.backend_api.BackendSpec

    def import_it(self) -> None:
        __import__(self.name)

    def calls(self) -> list[tuple[str, bool, str]]:
        """(policy name, whether the framework was fully imported, calling thread) for each hook call."""
        return list(sys.modules[f"polyamp_{self.name}"].CALLS)


@pytest.fixture
def slow_framework(install_framework: InstallFramework, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowFramework]:
    name = f"slowfw_{uuid.uuid4().hex[:8]}"
    gate = types.ModuleType(f"{name}_gate")
    gate.entered, gate.release = threading.Event(), threading.Event()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, gate.__name__, gate)
    framework_source = f"""
        import {gate.__name__} as gate
        gate.entered.set()
        if not gate.release.wait({TIMEOUT}):
            raise RuntimeError("the test never let this import finish")
        DONE = True
        """
    backend_source = f"""
        import threading
        import {name} as fw
        CALLS = []
        def apply_policy(policy, overrides):
            CALLS.append((policy.name, getattr(fw, "DONE", False), threading.current_thread().name))
        """
    spec = install_framework(name, framework_source, backend_source)
    framework = SlowFramework(name, gate.entered, gate.release, spec)  # type: ignore[attr-defined]
    yield framework
    framework.release.set()


def eventually(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, "the condition never became true"
        time.sleep(0.005)


def set_policy_during_the_import(framework: SlowFramework, name: str) -> None:
    """The framework's import starts in thread "importer"; while it is held, set_policy(name) runs in thread
    "setter" and must return before the import is let go."""
    importer = start(framework.import_it, "importer")
    wait(framework.entered)
    setter = start(lambda: polyamp.set_policy(name), "setter")
    setter.join(2.0)
    returned_during_import = not setter.is_alive()
    framework.release.set()
    importer.finish()
    setter.finish()
    assert returned_during_import, "set_policy waited for another thread's import"


def test_set_policy_does_not_wait_for_an_import_in_another_thread(slow_framework: SlowFramework) -> None:
    """D4: the framework is mid-import in another thread (not watched by polyamp) when set_policy runs."""
    set_policy_during_the_import(slow_framework, "mixed_float16")
    eventually(lambda: f"polyamp_{slow_framework.name}" in sys.modules and bool(slow_framework.calls()))
    assert [(name, done) for name, done, _ in slow_framework.calls()] == [("mixed_float16", True)]


def test_an_import_polyamp_watches_delivers_the_latest_policy(slow_framework: SlowFramework) -> None:
    """D4: set_policy (watching the framework), the import starts in B, set_policy again mid-import."""
    polyamp.set_policy("mixed_bfloat16")
    set_policy_during_the_import(slow_framework, "mixed_float16")
    # The hook ran inside the import, in the importing thread, before `import` returned there.
    assert slow_framework.calls() == [("mixed_float16", True, "importer")]
    polyamp.set_policy("float16")
    assert slow_framework.calls()[-1][:2] == ("float16", True)


def test_when_imported_waits_for_an_import_in_progress_elsewhere(slow_framework: SlowFramework) -> None:
    importer = start(slow_framework.import_it, "importer")
    wait(slow_framework.entered)
    called: list[tuple[bool, str]] = []
    import_hooks.when_imported(
        slow_framework.name,
        lambda module: called.append((getattr(module, "DONE", False), threading.current_thread().name)),
    )
    assert called == []  # not now: the module is only half imported
    slow_framework.release.set()
    importer.finish()
    eventually(lambda: bool(called))
    assert called[0][0] is True and called[0][1] != threading.current_thread().name


def test_when_imported_after_a_failed_import_waits_for_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"flaky_{uuid.uuid4().hex[:8]}"
    gate = types.ModuleType(f"{name}_gate")
    gate.entered, gate.release, gate.fail = threading.Event(), threading.Event(), True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, gate.__name__, gate)
    (tmp_path / f"{name}.py").write_text(
        f"import {gate.__name__} as gate\ngate.entered.set()\ngate.release.wait({TIMEOUT})\n"
        "if gate.fail:\n    raise RuntimeError('broken install')\nOK = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    called: list[Any] = []

    def failing_import() -> None:
        with pytest.raises(RuntimeError, match="broken install"):
            __import__(name)

    importer = start(failing_import, "importer")
    wait(gate.entered)  # type: ignore[attr-defined]
    import_hooks.when_imported(name, called.append)
    gate.release.set()  # type: ignore[attr-defined]
    importer.finish()
    eventually(lambda: name in import_hooks.pending_modules())  # waiting for the next import now
    assert called == []
    gate.fail = False  # type: ignore[attr-defined]
    try:
        module = __import__(name)
        eventually(lambda: bool(called))
        assert called == [module]
    finally:
        sys.modules.pop(name, None)
