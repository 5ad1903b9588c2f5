"""Shared fixtures: isolation of polyamp's process-wide state; frameworks and backends written on the fly, and the
NumPy backends; small training data; subprocesses (bounded, or on another Keras backend)."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# One process imports both frameworks here; PyTorch must come first (the other order can crash some builds).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# JAX programs compiled again and again (each conformance test builds its harness's jitted step anew) are
# compiled once: JAX's persistent compilation cache, in a directory of this run that its subprocesses share.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="polyamp-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
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


def _register(name: str, **fields: Any) -> polyamp.backend_api.BackendSpec:
    """Register a backend for the framework module ``name``, its module ``polyamp_<name>`` (class ``Backend``);
    ``fields`` are the spec's optional fields."""
    spec = polyamp.backend_api.BackendSpec(name, f"polyamp_{name}:Backend", (name,), f"pip install {name}", **fields)
    polyamp.backend_api.register_backend(spec)
    return spec


#: ``install_framework(name, framework_source, backend_source)``, the fixture of that name.
InstallFramework = Callable[[str, str, str], polyamp.backend_api.BackendSpec]


@pytest.fixture
def install_framework(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InstallFramework]:
    """``install_framework(name, framework_source, backend_source)``: the modules ``name`` and ``polyamp_<name>``
    written where they can be imported (not imported yet) and a backend registered for them, its policy hook
    ``polyamp_<name>:apply_policy``; returns its spec. Both modules leave ``sys.modules`` after the test."""
    names: list[str] = []

    def install(name: str, framework_source: str, backend_source: str) -> polyamp.backend_api.BackendSpec:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(framework_source))
        (tmp_path / f"polyamp_{name}.py").write_text(textwrap.dedent(backend_source))
        monkeypatch.syspath_prepend(str(tmp_path))
        names.append(name)
        return _register(name, policy_hook=f"polyamp_{name}:apply_policy")

    yield install
    for name in names:
        for module in (name, f"polyamp_{name}"):
            sys.modules.pop(module, None)


@pytest.fixture
def fake_framework(install_framework: InstallFramework) -> FakeFramework:
    """A not-yet-imported framework module and its registered polyamp backend (with a policy hook)."""
    name = f"fakefw_{uuid.uuid4().hex[:8]}"
    spec = install_framework(name, _FRAMEWORK_SOURCE, _BACKEND_SOURCE.format(fw=name))
    return FakeFramework(name=name, backend_module=f"polyamp_{name}", spec=spec)


#: A tensor reader: (name, dtype, largest absolute value or None) for each tensor of a model or checkpoint.
TensorReader = Callable[[object], list[tuple[str, str, "float | None"]]]
#: ``reader_backend(name, read, suffixes)``, the fixture of that name.
ReaderBackend = Callable[[str, TensorReader, tuple[str, ...]], None]


@pytest.fixture
def reader_backend(monkeypatch: pytest.MonkeyPatch) -> ReaderBackend:
    """``reader_backend(name, read, suffixes)``: a backend for the framework ``name`` (never imported) whose
    tensor reader is ``read``, for models of that framework and checkpoints ending in ``suffixes``."""

    def register(name: str, read: TensorReader, suffixes: tuple[str, ...]) -> None:
        module = types.ModuleType(f"polyamp_{name}")
        module.read = read  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
        _register(name, tensor_reader=f"{module.__name__}:read", checkpoint_suffixes=suffixes)

    return register


TESTS = Path(__file__).resolve().parent
#: The NumPy stand-in frameworks (npfw, and nptape built on it) and their backends, written against the public API.
NUMPY_BACKENDS = TESTS / "numpy_backend"


@contextlib.contextmanager
def _numpy_backend(name: str) -> Iterator[types.ModuleType]:
    """The backend module ``polyamp_<name>`` of tests/numpy_backend (``name``: "npfw" or "nptape"), imported
    and registered; the framework itself is ``sys.modules[name]``. Afterwards neither is importable or imported."""
    sys.path.insert(0, str(NUMPY_BACKENDS))
    try:
        backend = importlib.import_module(f"polyamp_{name}")
        polyamp.backend_api.register_backend(backend.SPEC)
        yield backend
    finally:
        sys.path.remove(str(NUMPY_BACKENDS))
        for module in ("npfw", name, f"polyamp_{name}"):
            sys.modules.pop(module, None)


#: ``numpy_backend(name)``, the fixture of that name.
NumpyBackend = Callable[[str], contextlib.AbstractContextManager[types.ModuleType]]


@pytest.fixture(scope="session")
def numpy_backend() -> NumpyBackend:
    """``with numpy_backend(name) as backend``: the NumPy backend ``polyamp_<name>`` (npfw or nptape), registered,
    inside the block (`_numpy_backend`); a fixture of any scope can use it."""
    return _numpy_backend


#: ``import_without(package, module)``, the fixture of that name.
ImportWithout = Callable[[str, str], types.ModuleType]


@pytest.fixture
def import_without(monkeypatch: pytest.MonkeyPatch) -> ImportWithout:
    """``import_without(package, module)``: import ``module`` afresh while ``package`` and its submodules cannot be
    imported (as if not installed); ``sys.modules`` is as it was after the test."""

    def load(package: str, module: str) -> types.ModuleType:
        for name in [n for n in sys.modules if n == package or n.startswith(f"{package}.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, package, None)
        monkeypatch.delitem(sys.modules, module)
        return importlib.import_module(module)

    return load


# -- data ----------------------------------------------------------------------------------------------------


#: ``regression_loader(batches, leave_out=())``, the fixture of that name.
RegressionLoader = Callable[..., Any]


@pytest.fixture
def regression_loader() -> RegressionLoader:
    """``regression_loader(batches, leave_out=())``: a torch DataLoader of ``batches`` batches of 4 samples (8
    inputs, 1 target, drawn from seed 0), without the batches whose indices are in ``leave_out``."""
    import torch

    def loader(batches: int, leave_out: Collection[int] = ()) -> Any:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batches * 4, 8, generator=generator)
        y = torch.randn(batches * 4, 1, generator=generator)
        keep = [i for i in range(batches * 4) if i // 4 not in leave_out]
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[keep], y[keep]), batch_size=4)

    return loader


# -- subprocesses --------------------------------------------------------------------------------------------


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


#: Set in a subprocess that runs a Keras test module on another Keras backend: there the module covers its own.
KERAS_SUBPROCESS = "POLYAMP_KERAS_SUBPROCESS"
#: ``run_on_keras_backend(backend, target, *args)``, the fixture of that name.
RunOnKerasBackend = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_on_keras_backend() -> RunOnKerasBackend:
    """``run_on_keras_backend(backend, target, *args)``: run ``target`` with Keras on ``backend`` in a subprocess
    bounded as `run_bounded`, and fail with its output unless it exits 0; returns the finished process.

    ``target`` is a test file (a `Path`: pytest runs every test in it, the slow ones too, ``args`` added) or a
    module run as ``python -m target *args`` (a `str`). A test using this is skipped inside such a subprocess
    (``POLYAMP_KERAS_SUBPROCESS=1``), and when ``backend`` is not installed.
    """
    if os.environ.get(KERAS_SUBPROCESS) == "1":
        pytest.skip("a subprocess covers its own backend only")

    def run(backend: str, target: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
        if importlib.util.find_spec(backend) is None:
            pytest.skip(f"{backend} is not installed")
        if isinstance(target, Path):
            args = ("pytest", str(target), "-q", "-p", "no:cacheprovider", "-m", "", *args)
        else:
            args = (target, *args)
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", **{KERAS_SUBPROCESS: "1"})
        result = _run_bounded([sys.executable, "-m", *args], env=env, cwd=TESTS.parent)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        return result

    return run


#: ``keras_json(code, *args, backend=...)``, the fixture of that name.
KerasJson = Callable[..., Any]


def _keras_json(code: str, *args: str, backend: str) -> Any:
    """Run ``code`` (``args`` its ``sys.argv[1:]``) in a fresh interpreter from tests/ with KERAS_BACKEND=backend;
    return the JSON it prints last."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=TESTS,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def keras_json() -> KerasJson:
    """``keras_json(code, *args, backend=...)``: the JSON that ``code`` prints last, run with Keras on ``backend``
    in a fresh interpreter (Keras picks its backend once per process)."""
    return _keras_json
