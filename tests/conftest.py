"""Shared fixtures: isolation of polyamp's process-wide state, and a throwaway framework for core tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# One process imports both frameworks here; PyTorch must come first (the other order can crash some builds).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
with contextlib.suppress(ImportError):
    import torch  # noqa: F401

import polyamp
import polyamp.backend_api
from polyamp._src import global_policy, import_hooks, registry


def pytest_configure(config: pytest.Config) -> None:
    """The conformance plugin comes with an installed polyamp (its ``pytest11`` entry point); a source tree
    on ``PYTHONPATH`` has no entry point, so it is registered here."""
    from polyamp.conformance import pytest_plugin

    manager = config.pluginmanager
    if not manager.is_registered(pytest_plugin) and not manager.has_plugin("polyamp"):
        manager.register(pytest_plugin, "polyamp")


@pytest.fixture(autouse=True)
def isolated_polyamp_state() -> Iterator[None]:
    """Every test starts from the float32 policy and the first-party registry, and leaves them so."""
    saved_registry = (
        dict(registry._specs),
        dict(registry._framework_owner),
        dict(registry._loaded),
        registry._entry_points_read,
    )
    saved_policy = (
        global_policy._process,
        list(global_policy._listeners),
        dict(global_policy._hooks),
        set(global_policy._watching),
    )
    saved_pending = {name: list(cbs) for name, cbs in import_hooks._pending.items()}
    yield
    # The very object: frameworks read the setting when they need it (Keras included), and "default"
    # (nothing set) must stay distinguishable from an explicit float32.
    global_policy._process = saved_policy[0]
    registry._specs.clear()
    registry._specs.update(saved_registry[0])
    registry._framework_owner.clear()
    registry._framework_owner.update(saved_registry[1])
    registry._loaded.clear()
    registry._loaded.update(saved_registry[2])
    registry._entry_points_read = saved_registry[3]
    registry._type_cache.clear()
    global_policy._listeners[:] = saved_policy[1]
    global_policy._hooks.clear()
    global_policy._hooks.update(saved_policy[2])
    global_policy._watching.clear()
    global_policy._watching.update(saved_policy[3])
    import_hooks._pending.clear()
    import_hooks._pending.update(saved_pending)
    if not saved_pending and import_hooks._FINDER in sys.meta_path:
        sys.meta_path.remove(import_hooks._FINDER)


#: Makes a module fail to import as if it were not installed (its spec is found, its loading fails, so code
#: that only probes with importlib.util.find_spec, as torch._dynamo does, keeps working).
HIDE_MODULE = """
import importlib.abc, importlib.machinery, sys
class _Missing(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)
    def exec_module(self, module):
        pass
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] == HIDDEN:
            return importlib.machinery.ModuleSpec(name, _Missing())
sys.meta_path.insert(0, _Hide())
"""


def _run_without(module: str, code: str, env: dict[str, str] | None = None) -> str:
    """Run ``code`` in a subprocess where ``module`` cannot be imported; return its stdout."""
    source = f"HIDDEN = {module!r}\n" + HIDE_MODULE + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture
def run_without() -> object:
    """``run_without(module, code, env=None)``: run code in a subprocess where ``module`` is not installed."""
    return _run_without


@dataclass
class FakeFramework:
    """A framework written on the fly: ``<module>.Tensor``/``Optimizer`` and a polyamp backend for it."""

    name: str  # the framework's module name
    backend_module: str
    spec: polyamp.backend_api.BackendSpec

    def load(self):  # type: ignore[no-untyped-def]
        __import__(self.name)
        return sys.modules[self.name]


_FRAMEWORK_SOURCE = """
class Tensor:
    def __init__(self, value):
        self.value = float(value)
    def __mul__(self, other):
        return Tensor(self.value * float(other))

class Optimizer:
    def __init__(self):
        self.steps = 0
        self.grad = None  # the one gradient this optimizer applies (a float), set by the test
    def step(self):
        self.steps += 1
        return "stepped"
"""

# A device form in pure Python, written against polyamp.backend_api only (ImperativeDevice).
_BACKEND_SOURCE = """
import math
from polyamp.backend_api import StepOutcome
from polyamp.backend_api.arguments import wrong_object_error
import {fw} as fw

POLICIES = []
OVERRIDES = []

def apply_policy(policy, overrides):
    POLICIES.append(policy)
    OVERRIDES.append(overrides)

class Device:
    def __init__(self, config, state):
        self.config, self.state, self.skips = config, state, 0
    def check_optimizer(self, method, optimizer):
        if not isinstance(optimizer, fw.Optimizer):
            raise wrong_object_error("{fw}", method, optimizer, "a {fw}.Optimizer")
    def read_state(self):
        return self.state
    def write_state(self, config, state):
        self.config = config
        if state is not None:
            self.state = state
    def scale(self, loss):
        if isinstance(loss, list):
            return [self.scale(item) for item in loss]
        if not isinstance(loss, fw.Tensor):
            raise wrong_object_error("{fw}", "scale", loss, "a {fw}.Tensor")
        return loss * self.state.scale
    def unscale_gradients(self, optimizer):
        if optimizer.grad is None:
            return None
        optimizer.grad /= self.state.scale
        return 0.0 if math.isfinite(optimizer.grad) else 1.0
    def unscales_in_step(self, optimizer):
        return False
    def step(self, optimizer, found_inf, args, kwargs):
        skipped = found_inf > 0
        return StepOutcome(None if skipped else optimizer.step(*args, **kwargs), found_inf, skipped)
    def plain_step(self, optimizer, args, kwargs):
        return optimizer.step(*args, **kwargs)
    def combine(self, flags):
        return max(flags)
    def read_new_scale(self, new_scale):
        raise TypeError("floats only")
    def update(self, found_inf, new_scale):
        if new_scale is not None:
            self.state = type(self.state)(float(new_scale), self.state.growth_tracker, self.state.hysteresis_left)
        elif found_inf is not None:
            self.state = self.config.next_state(self.state, found_inf > 0)
        self.skips += found_inf is not None and found_inf > 0
    def skipped(self, found_inf):
        return found_inf > 0
    def read_flag(self, found_inf):
        return found_inf > 0
    def finite_flag(self):
        return 0.0
    def new_record(self):
        return [None]
    def write_record(self, record, found_inf):
        record[0] = found_inf
    def read_record(self, record):
        return record[0]
    def skipped_steps(self):
        return self.skips

class Backend:
    name = "{fw}"
    def make_device(self, config, state):
        return Device(config, state)
"""


@pytest.fixture
def fake_framework(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeFramework:
    """A not-yet-imported framework module and its registered polyamp backend (with a policy hook)."""
    name = f"fakefw_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_FRAMEWORK_SOURCE))
    (tmp_path / f"polyamp_{name}.py").write_text(_BACKEND_SOURCE.format(fw=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = polyamp.backend_api.BackendSpec(
        name=name,
        target=f"polyamp_{name}:Backend",
        frameworks=(name,),
        install_hint=f"pip install {name}",
        policy_hook=f"polyamp_{name}:apply_policy",
    )
    polyamp.backend_api.register_backend(spec)
    yield FakeFramework(name=name, backend_module=f"polyamp_{name}", spec=spec)
    for module in (name, f"polyamp_{name}"):
        sys.modules.pop(module, None)


#: Seconds a test may wait for one of the long subprocesses it starts (a test suite or a benchmark run on
#: another backend); a loaded machine needs more than an idle one.
TIMEOUT_VARIABLE = "POLYAMP_TEST_TIMEOUT"
DEFAULT_TIMEOUT = 3600.0


def subprocess_timeout() -> float:
    """The bound in ``POLYAMP_TEST_TIMEOUT`` (seconds), else `DEFAULT_TIMEOUT`."""
    value = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise pytest.UsageError(f"{TIMEOUT_VARIABLE}={value!r}: expected a positive number of seconds")
    return seconds


def _decoded(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def _run_bounded(command: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)`` bounded by `subprocess_timeout`.

    Past the bound, the command and every process it started are killed, and the test fails with the elapsed
    time and the output the command had written so far.
    """
    limit = subprocess_timeout()
    start = time.monotonic()
    # Its own session: a test suite run in the subprocess starts subprocesses of its own, which hold the pipes.
    with subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - start
            killpg = getattr(os, "killpg", None)
            if killpg is not None:
                with contextlib.suppress(ProcessLookupError):
                    killpg(process.pid, signal.SIGKILL)
            process.kill()
            stdout, stderr = process.communicate()
            pytest.fail(
                f"{' '.join(map(str, command))} was stopped after {elapsed:.0f} s, past the {limit:.0f} s bound "
                f"({TIMEOUT_VARIABLE}={os.environ.get(TIMEOUT_VARIABLE) or 'unset, the default'}; set it higher on "
                f"a loaded machine).\n--- stdout so far ---\n{_decoded(stdout)[-6000:]}\n"
                f"--- stderr so far ---\n{_decoded(stderr)[-3000:]}",
                pytrace=False,
            )
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def run_bounded() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_bounded(command, **popen_kwargs)``: run a long subprocess (a suite, a benchmark) to completion,
    bounded by ``POLYAMP_TEST_TIMEOUT`` seconds (default 3600); its output is captured as text."""
    return _run_bounded
