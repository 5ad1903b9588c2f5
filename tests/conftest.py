"""Shared fixtures: isolation of polyamp's process-wide state, and a throwaway framework for core tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# One process imports both frameworks here; PyTorch must come first (the other order can crash some builds).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
with contextlib.suppress(ImportError):
    import torch  # noqa: F401

import polyamp
from polyamp._src import global_policy, import_hooks, registry


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
    spec: polyamp.BackendSpec

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
    def step(self):
        self.steps += 1
        return "stepped"
"""

_BACKEND_SOURCE = """
import math
import {fw} as fw

POLICIES = []
OVERRIDES = []

def apply_policy(policy, overrides):
    POLICIES.append(policy)
    OVERRIDES.append(overrides)

class Impl:
    def __init__(self, config, state, enabled):
        self.config, self.state, self.enabled = config, state, enabled
        self.found_inf = False
    def get_state(self):
        return self.state
    def set_state(self, config, state):
        self.config, self.state = config, state
    def get_scale(self):
        return self.state.scale
    def scale(self, loss):
        if isinstance(loss, list):
            return [item * self.state.scale for item in loss]
        return loss * self.state.scale
    def step(self, optimizer, grad=1.0):
        self.found_inf = not math.isfinite(grad)
        return None if self.found_inf else optimizer.step()
    def update(self, new_scale=None):
        self.state = self.config.next_state(self.state, self.found_inf)

class Backend:
    name = "{fw}"
    def owns(self, obj):
        return isinstance(obj, (fw.Tensor, fw.Optimizer))
    def make_scaler(self, config, state, enabled):
        return Impl(config, state, enabled)
"""


@pytest.fixture
def fake_framework(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeFramework:
    """A not-yet-imported framework module and its registered polyamp backend (with a policy hook)."""
    name = f"fakefw_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_FRAMEWORK_SOURCE))
    (tmp_path / f"polyamp_{name}.py").write_text(_BACKEND_SOURCE.format(fw=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = polyamp.BackendSpec(
        name=name,
        target=f"polyamp_{name}:Backend",
        frameworks=(name,),
        install_hint=f"pip install {name}",
        policy_hook=f"polyamp_{name}:apply_policy",
    )
    polyamp.register_backend(spec)
    yield FakeFramework(name=name, backend_module=f"polyamp_{name}", spec=spec)
    for module in (name, f"polyamp_{name}"):
        sys.modules.pop(module, None)


# -- the conformance suite: `harness` / `harness_pair` parametrised over backend x device ---------------

CONFORMANCE_TARGETS = [("torch", "cpu"), ("torch", "cuda"), ("tensorflow", "cpu"), ("tensorflow", "cuda")]
_harnesses: dict[tuple[str, str], object] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "harness" in metafunc.fixturenames:
        metafunc.parametrize(
            "harness", CONFORMANCE_TARGETS, ids=[f"{b}-{d}" for b, d in CONFORMANCE_TARGETS], indirect=True
        )
    if "harness_pair" in metafunc.fixturenames:
        pairs = [(("torch", d), ("tensorflow", d)) for d in ("cpu", "cuda")]
        metafunc.parametrize(
            "harness_pair", pairs, ids=[f"torch-{d}+tensorflow-{d}" for d in ("cpu", "cuda")], indirect=True
        )
    for name, values in getattr(metafunc.function, "polyamp_params", []):
        metafunc.parametrize(name, values, ids=[str(v) for v in values])


def _make_harness(target: tuple[str, str]) -> object:
    from polyamp.conformance import HarnessUnavailable, make_harness

    if target not in _harnesses:
        try:
            _harnesses[target] = make_harness(*target)
        except HarnessUnavailable as exc:
            _harnesses[target] = exc
    harness = _harnesses[target]
    if isinstance(harness, Exception):
        pytest.skip(f"{target[0]}-{target[1]}: {harness}")
    return harness


@contextlib.contextmanager
def _reporting(request: pytest.FixtureRequest) -> Iterator[None]:
    from polyamp.conformance import Reporter, reporting, stop_reporting

    def diverge(reason: str) -> None:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason))

    token = reporting(Reporter(on_divergence=diverge, on_skip=lambda reason: pytest.skip(reason)))
    try:
        yield
    finally:
        stop_reporting(token)


@pytest.fixture
def harness(request: pytest.FixtureRequest) -> Iterator[object]:
    """One backend's conformance harness on one device; a skip with the reason where unavailable."""
    instance = _make_harness(request.param)
    with _reporting(request):
        yield instance


@pytest.fixture
def harness_pair(request: pytest.FixtureRequest) -> Iterator[tuple[object, object]]:
    """Two backends' harnesses on one device, for cross-backend cases."""
    first, second = (_make_harness(target) for target in request.param)
    with _reporting(request):
        yield first, second
