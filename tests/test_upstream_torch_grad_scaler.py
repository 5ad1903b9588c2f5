"""PyTorch's own GradScaler tests, run with torch.amp.GradScaler and with polyamp_torch.TorchLossScaler in its place.

``polyamp_torch.TorchLossScaler`` is meant as a drop-in for ``torch.amp.GradScaler``. This module checks that
claim with PyTorch's GradScaler tests (class ``TestTorchDeviceType`` of PyTorch's ``test/test_torch.py``): each
test runs twice, on CPU,

* ``[native]``: as PyTorch wrote it. It must pass; this shows the tests are read and run correctly here.
* ``[polyamp]``: with ``TorchLossScaler`` in place of every public spelling of the class (``torch.GradScaler``,
  ``torch.amp.GradScaler``, ``torch.cpu.amp.GradScaler``, ``torch.cuda.amp.GradScaler``), nothing else changed.

A polyamp run that reads GradScaler's private attributes is a strict xfail (AttributeError) naming them; one
that fails for another reason is a strict xfail whose reason says what polyamp does differently (see
``POLYAMP_EXPECTED``). Either flips to a failure once it passes.

The tests are not copied into this repository. They are read when the module is collected from PyTorch's
``test/test_torch.py``, at the path that the environment variable ``POLYAMP_PYTORCH_TEST_TORCH`` names (take it
from a PyTorch checkout at the tag of the installed torch); without it the module is skipped. PyTorch's test
helpers need its test dependency ``expecttest``::

    POLYAMP_PYTORCH_TEST_TORCH=/path/to/pytorch/test/test_torch.py python -m pytest tests/test_upstream_torch_grad_scaler.py

Which tests: the ``test_grad_scaling_*`` and ``test_grad_scaler_*`` methods, the other test methods that build a
GradScaler directly or through a helper, and the helpers they call (``_run_scaling_case``, ...). Their source
is compiled unchanged, with the module's own imports; PyTorch's shared helpers (``_create_scaling_case``,
``optim_db``, ``instantiate_device_type_tests``, ...) come from the installed ``torch.testing._internal``.
"""

from __future__ import annotations

import ast
import copy
import importlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

torch = pytest.importorskip("torch")

import polyamp_torch  # noqa: E402

SOURCE_VARIABLE = "POLYAMP_PYTORCH_TEST_TORCH"
UPSTREAM_CLASS = "TestTorchDeviceType"
#: Upstream test methods selected by name; others are selected when they build a GradScaler.
NAME_PATTERN = re.compile(r"test_grad_scal(ing|er)_")
#: Where the upstream tests find the class: every public spelling of torch.amp.GradScaler.
SPELLINGS = ("torch", "torch.amp", "torch.cpu.amp", "torch.cuda.amp")
IMPLEMENTATIONS = ("native", "polyamp")

# -- what polyamp does differently, per upstream test ---------------------------------------------------------
#
# Set against test/test_torch.py at PyTorch commit 7753b50b15aaf6a61affc862dab240b2b629963f, whose GradScaler
# tests all pass natively with torch 2.13.0.
#
# Keys are upstream method names, or "name[variant]" for one instantiation (variant as in the test id); the
# marks apply to the [polyamp] run only. Remove an entry once polyamp closes the gap: a strict xfail that
# passes fails the suite, and `raises` makes one that fails for another reason fail it too.


def private(attributes: str) -> pytest.MarkDecorator:
    """The test reads GradScaler's private state, which a drop-in need not have: it fails with AttributeError."""
    return pytest.mark.xfail(
        strict=True, raises=AttributeError, reason=f"reads GradScaler's private {attributes}, which polyamp lacks"
    )


def differs(reason: str, raises: type[BaseException]) -> pytest.MarkDecorator:
    """polyamp behaves differently from GradScaler here, as ``reason`` says; the test fails with ``raises``."""
    return pytest.mark.xfail(strict=True, raises=raises, reason=reason)


POLYAMP_EXPECTED: dict[str, pytest.MarkDecorator] = {
    "test_pickle_gradscaler": private("_scale, _init_growth_tracker, _per_optimizer_states"),
    "test_grad_scaling_unscale": private("_unscale_grads_"),
    "test_grad_scaling_unscale_sparse": private("_unscale_grads_"),
    "test_grad_scaling_state_dict": private("_init_growth_tracker, _scale"),
    "test_grad_scale_will_not_overflow": private("_scale"),
    "test_grad_scaler_deprecated_warning": differs(
        "checks the FutureWarning of torch's deprecated alias torch.cpu.amp.GradScaler, which polyamp, a drop-in for "
        'torch.amp.GradScaler, does not emit: "FutureWarning not triggered"',
        AssertionError,
    ),
}


# -- reading the upstream tests -------------------------------------------------------------------------------


class UpstreamUnavailable(Exception):
    """Why the upstream tests cannot be run here."""


def _source_path() -> Path:
    value = os.environ.get(SOURCE_VARIABLE)
    if not value:
        raise UpstreamUnavailable(
            f"{SOURCE_VARIABLE} is not set: point it at PyTorch's test/test_torch.py (torch {torch.__version__}, "
            f"commit {torch.version.git_version}) to run PyTorch's GradScaler tests"
        )
    path = Path(value)
    if not path.is_file():
        raise UpstreamUnavailable(f"{SOURCE_VARIABLE}={value} is not a file")
    return path


def _is_import_block(node: ast.stmt) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    # `if TEST_WITH_TORCHINDUCTOR: from ... import TestCase / else: ...`
    return isinstance(node, ast.If) and all(_is_import_block(n) for n in [*node.body, *node.orelse])


def _self_calls(function: ast.FunctionDef) -> set[str]:
    return {
        node.func.attr
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    }


def _select(methods: dict[str, ast.FunctionDef]) -> list[str]:
    """The GradScaler tests and the helpers they call, in source order."""
    builds_scaler: dict[str, bool] = {}

    def uses_scaler(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name not in builds_scaler:
            function = methods[name]
            direct = "GradScaler" in ast.unparse(function)
            helpers = (h for h in _self_calls(function) & methods.keys() if h not in seen)
            builds_scaler[name] = direct or any(uses_scaler(h, seen | {name}) for h in helpers)
        return builds_scaler[name]

    chosen = {name for name in methods if NAME_PATTERN.match(name) or (name.startswith("test_") and uses_scaler(name))}
    pending = list(chosen)
    while pending:
        for helper in _self_calls(methods[pending.pop()]) & methods.keys():
            if helper not in chosen and not helper.startswith("test"):
                chosen.add(helper)
                pending.append(helper)
    return [name for name in methods if name in chosen]


class Upstream(NamedTuple):
    cpu_class: type  # the unittest class, instantiated for CPU by PyTorch's instantiate_device_type_tests
    path: Path  # PyTorch's test/test_torch.py
    tests: dict[str, list[str]]  # upstream test method -> its instantiated methods on cpu_class


def _load_upstream() -> Upstream:
    path = _source_path()
    try:
        import expecttest  # noqa: F401  (torch.testing._internal.common_utils needs it)
    except ImportError as exc:
        raise UpstreamUnavailable(f"PyTorch's test helpers need `expecttest` ({exc})") from exc
    text = path.read_text(encoding="utf-8")
    module = ast.parse(text, filename=str(path))
    classes = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == UPSTREAM_CLASS]
    if not classes:
        raise UpstreamUnavailable(f"{path} has no class {UPSTREAM_CLASS}")
    original = classes[0]
    methods = {n.name: n for n in original.body if isinstance(n, ast.FunctionDef)}
    selected = _select(methods)
    if not any(name.startswith("test") for name in selected):
        raise UpstreamUnavailable(f"{path}: {UPSTREAM_CLASS} has no GradScaler tests")

    frozen = torch.backends.flags_frozen()
    namespace: dict[str, Any] = {"__name__": "pytorch_test_torch", "__file__": str(path)}
    for node in module.body:
        if _is_import_block(node):
            block = ast.Module(body=[node], type_ignores=[])
            try:
                exec(compile(block, str(path), "exec"), namespace)
            except ImportError:
                pass  # a name the GradScaler tests need and this torch lacks fails those tests, by name
    if not frozen:  # importing torch.testing._internal.common_utils freezes torch.backends flags process-wide
        torch.backends.__allow_nonbracketed_mutation_flag = True

    # The class as written, with only the selected methods; the nodes keep their line numbers, so tracebacks
    # point into PyTorch's file.
    cls_node = copy.copy(original)
    cls_node.body = [n for n in original.body if not isinstance(n, ast.FunctionDef)] + [methods[n] for n in selected]
    exec(compile(ast.Module(body=[cls_node], type_ignores=[]), str(path), "exec"), namespace)

    # It replaces the generic class in the namespace by one class per device type.
    namespace["instantiate_device_type_tests"](namespace[UPSTREAM_CLASS], namespace, only_for="cpu")
    cpu_class = namespace[f"{UPSTREAM_CLASS}CPU"]
    tests = [name for name in selected if name.startswith("test")]
    instantiated: dict[str, list[str]] = {name: [] for name in tests}
    for attribute in sorted(vars(cpu_class)):
        if not attribute.startswith("test"):
            continue
        # The longest upstream name that prefixes it (test_grad_scaling_unscale vs ..._unscale_sparse).
        owner = max((name for name in tests if attribute.startswith(name + "_")), key=len, default=None)
        if owner is not None:
            instantiated[owner].append(attribute)
    return Upstream(cpu_class, path, instantiated)


def _variant(upstream: str, method: str) -> str:
    """The instantiation's part of the id: ``cpu_float32`` -> ``float32``; plain ``cpu`` -> ``""``."""
    tokens = method[len(upstream) + 1 :].split("_")
    tokens.remove("cpu")
    return "_".join(tokens)


try:
    # Kept out of the module's globals: pytest would collect the unittest class on its own.
    _UPSTREAM = _load_upstream()
except UpstreamUnavailable as _reason:
    pytest.skip(str(_reason), allow_module_level=True)


# -- running them ---------------------------------------------------------------------------------------------


@pytest.fixture
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The class under test: "native" GradScaler, or "polyamp" in place of its every public spelling."""
    if request.param == "polyamp":
        for module in SPELLINGS:
            monkeypatch.setattr(importlib.import_module(module), "GradScaler", polyamp_torch.TorchLossScaler)
    yield request.param


def _marks(upstream: str, variant: str, impl: str) -> list[pytest.MarkDecorator]:
    if impl != "polyamp":
        return []
    mark = POLYAMP_EXPECTED.get(f"{upstream}[{variant}]") or POLYAMP_EXPECTED.get(upstream)
    return [mark] if mark is not None else []


def _make_test(upstream: str, methods: list[str]) -> Callable[..., None]:
    params = []
    for method in methods:
        variant = _variant(upstream, method)
        for impl in IMPLEMENTATIONS:
            params.append(
                pytest.param(
                    method,
                    impl,
                    id=f"{variant}-{impl}" if variant else impl,
                    marks=_marks(upstream, variant, impl),
                )
            )

    @pytest.mark.torch
    @pytest.mark.parametrize(("method", "implementation"), params, indirect=["implementation"])
    def test(method: str, implementation: str) -> None:
        # debug() runs setUp, the test and tearDown, letting failures and skips propagate to pytest.
        _UPSTREAM.cpu_class(method).debug()

    test.__name__ = test.__qualname__ = upstream
    test.__doc__ = f"PyTorch's {UPSTREAM_CLASS}.{upstream} ({_UPSTREAM.path}), on CPU."
    return test


for _upstream, _methods in _UPSTREAM.tests.items():
    globals()[_upstream] = _make_test(_upstream, _methods)


def test_expectations_name_upstream_tests() -> None:
    """Every entry of POLYAMP_EXPECTED names an upstream test that was read (and variants that exist)."""
    known = {upstream: {_variant(upstream, m) for m in methods} for upstream, methods in _UPSTREAM.tests.items()}
    for key in POLYAMP_EXPECTED:
        upstream, _, variant = key.partition("[")
        assert upstream in known, f"POLYAMP_EXPECTED names {upstream}, which {_UPSTREAM.path} does not have"
        if variant:
            assert variant.rstrip("]") in known[upstream], f"POLYAMP_EXPECTED: {key} is not an instantiation"
