"""jmp's and Flax's own tests of what polyamp_jax stands in for, run as their authors wrote them and with polyamp
substituted.

* jmp: ``jmp/_src/policy_test.py`` and ``jmp/_src/loss_scale_test.py``, which jmp's wheel ships beside its code
  (read from the installed jmp). The tests import the module under test as
  ``from jmp._src import policy as jmp`` (``loss_scale`` likewise). ``[jmp]`` runs them as written; ``[polyamp]``
  runs them with that name bound to a module holding jmp's public names as `polyamp_jax.jmp_compat` implements
  them (its ``__all__``), nothing of jmp's code. One private name of jmp is handed over as it is:
  ``dtype_to_names``, the table of jmp's dtype names that ``test_str`` reads the expected text from (data the test
  checks against, not code under test).
* Flax: ``tests/dynamic_scale_test.py`` of a Flax source tree, which imports ``from flax.training import
  dynamic_scale`` and builds ``dynamic_scale.DynamicScale``. ``[flax]`` runs it as written, against Flax's
  ``DynamicScale``, and must pass: that shows the file is read and run correctly and matches the installed Flax.
  ``[polyamp]`` runs it with ``dynamic_scale.DynamicScale`` resolved, when a test reads it, to
  ``polyamp_jax.DynamicScale`` (its other names stay Flax's). Flax's wheels ship no tests, so the file is read
  from the Flax source tree that the environment variable ``POLYAMP_FLAX_SOURCE`` names, at the installed Flax's
  version (its ``flax/version.py`` is checked); without one, or without the file there (Flax's repository at
  0.12.8 has none), these tests are skipped::

      POLYAMP_FLAX_SOURCE=/path/to/flax python -m pytest tests/test_upstream_jax.py

The upstream source is compiled unchanged. The substitution is made when it is imported, through the
``__import__`` of its own module namespace (its parametrizations capture the classes under test then, so each
run loads the file once); no ``sys.modules`` entry is touched, and in a polyamp run any other import of the
replaced packages fails instead of reaching the original.

A polyamp run that fails is a strict xfail whose reason says why (`POLYAMP_EXPECTED`): a difference polyamp
documents (docs/guide/jax.md, "Coming from jmp"). A strict xfail that passes fails the suite, and ``raises``
makes one that fails for another reason fail it too.
"""

from __future__ import annotations

import builtins
import os
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pytest

jax = pytest.importorskip("jax")
jmp = pytest.importorskip("jmp")
pytest.importorskip("absl.testing.parameterized")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/upstream_support.py
import polyamp_jax  # noqa: E402
from polyamp_jax import jmp_compat  # noqa: E402
from upstream_support import Upstream, UpstreamUnavailable, load_test_class, source_tree  # noqa: E402

from polyamp import InvalidConfigError, PolyampTypeError  # noqa: E402

FLAX_SOURCE_VARIABLE = "POLYAMP_FLAX_SOURCE"

# -- what replaces what ---------------------------------------------------------------------------------------


def _jmp_private_data() -> dict[str, Any]:
    """The private data of jmp's that its tests read for their expected values (not code under test)."""
    import importlib

    policy = importlib.import_module("jmp._src.policy")
    return {"dtype_to_names": policy.dtype_to_names}


def _jmp_shim() -> types.ModuleType:
    """jmp's public names, as polyamp_jax.jmp_compat implements them (and jmp's private dtype-name table)."""
    shim = types.ModuleType("jmp", f"jmp's public names from {jmp_compat.__name__}.")
    shim.__dict__.update({name: getattr(jmp_compat, name) for name in jmp_compat.__all__})
    shim.__dict__.update(_jmp_private_data())
    return shim


class _LazyModule(types.ModuleType):
    """``real`` with some names resolved from elsewhere when they are read (so a missing one fails in the test
    that reads it, not when the tests are collected)."""

    def __init__(self, real: types.ModuleType, replaced: Mapping[str, Callable[[], Any]]) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real
        self._replaced = dict(replaced)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._replaced:
            return self._replaced[name]()
        return getattr(self._real, name)


def _polyamp_dynamic_scale_module() -> types.ModuleType:
    """``flax.training.dynamic_scale`` with ``DynamicScale`` read from polyamp_jax."""
    from flax.training import dynamic_scale

    return _LazyModule(dynamic_scale, {"DynamicScale": lambda: polyamp_jax.DynamicScale})


class Suite(NamedTuple):
    """One upstream test file and what its polyamp run imports in place of the original."""

    upstream: str  # the name of the run as written: "jmp" or "flax"
    path: str  # relative to the root the files are read from
    upstream_class: str
    #: ``{package: {name: object}}``: ``from package import name`` gives ``object`` in the polyamp run.
    substitute: Callable[[], dict[str, dict[str, Any]]]
    #: Packages the polyamp run must not import otherwise.
    forbidden: tuple[str, ...]


SUITES = {
    "TestJmpPolicy": Suite(
        "jmp",
        "jmp/_src/policy_test.py",
        "PolicyTest",
        lambda: {"jmp._src": {"policy": _jmp_shim()}},
        ("jmp",),
    ),
    "TestJmpLossScale": Suite(
        "jmp",
        "jmp/_src/loss_scale_test.py",
        "LossScaleTest",
        lambda: {"jmp._src": {"loss_scale": _jmp_shim()}},
        ("jmp",),
    ),
    "TestFlaxDynamicScale": Suite(
        "flax",
        "tests/dynamic_scale_test.py",
        "DynamicScaleTest",
        lambda: {"flax.training": {"dynamic_scale": _polyamp_dynamic_scale_module()}},
        ("flax.training.dynamic_scale",),
    ),
}

# -- what polyamp does differently, per upstream test ---------------------------------------------------------
#
# Set against jmp 0.0.4, whose two test files pass as written here (jax 0.10.2, CPU). Keys are
# "<upstream class>.<upstream method>", or "...[variant]" for one of its parameters (as in the test id: absl's
# named parameter, or the index of a positional one).


def documented(reason: str, raises: type[BaseException]) -> pytest.MarkDecorator:
    """A difference polyamp documents; the polyamp run fails with ``raises``."""
    return pytest.mark.xfail(strict=True, raises=raises, reason=f"documented difference: {reason}")


POLYAMP_EXPECTED: dict[str, pytest.MarkDecorator] = {
    "LossScaleTest.test_static_empty_trees[StaticLossScale]": documented(
        "StaticLossScale(0) is refused with InvalidConfigError (polyamp's scale is a positive float32 normal "
        "number, 2**-126 to 3.4e38; 1/0 would unscale to inf), where jmp builds it",
        InvalidConfigError,
    ),
    "LossScaleTest.test_dynamic_loss_scale_explicit_min_loss_scale[2]": documented(
        "DynamicLossScale(period=5.0, factor=2.0, min_loss_scale=0.0) is refused with PolyampTypeError: period is "
        "polyamp's growth_interval, an int (and a min_loss_scale of 0, polyamp's min_scale, is refused too: the "
        "floor is at least 2**-126), where jmp accepts both",
        PolyampTypeError,
    ),
    "LossScaleTest.test_dynamic_loss_scale_raises_type_error_on_int_loss_scale": documented(
        "an integer-typed loss_scale array is refused with PolyampTypeError (polyamp holds the scale in float32), "
        "where jmp warns 'Expected floating type for loss_scale' and keeps it",
        PolyampTypeError,
    ),
    "LossScaleTest.test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale": documented(
        "an integer-typed min_loss_scale array is refused with PolyampTypeError, where jmp warns 'Expected floating "
        "type for min_loss_scale' and keeps it",
        PolyampTypeError,
    ),
    "LossScaleTest.test_select_tree_rejects_non_scalar": documented(
        "a predicate that is not a boolean scalar is refused with PolyampTypeError (what was received, what is "
        "allowed), where jmp raises AssertionError('expected boolean scalar')",
        PolyampTypeError,
    ),
}

# -- reading the upstream tests -------------------------------------------------------------------------------


def _jmp_root() -> Path:
    return Path(jmp.__file__).resolve().parent.parent


def _flax_root() -> Path:
    try:
        import flax
    except ImportError:
        raise UpstreamUnavailable("flax is not installed") from None
    value = os.environ.get(FLAX_SOURCE_VARIABLE)
    if not value:
        raise UpstreamUnavailable(
            f"{FLAX_SOURCE_VARIABLE} is not set (Flax's wheels ship no tests): point it at a Flax source tree at "
            f"the installed version, {flax.__version__}, to run Flax's DynamicScale tests"
        )
    return source_tree(FLAX_SOURCE_VARIABLE, value, "Flax", "flax/version.py", flax.__version__)


def _importer(replaced: Mapping[str, Mapping[str, Any]], forbidden: tuple[str, ...]) -> Callable[..., Any]:
    """``__import__`` for an upstream module's namespace: ``from package import name`` of a replaced package gives
    the replacement, any other import of it or of a ``forbidden`` package fails."""

    def hooked(
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: tuple[str, ...] | None = (),
        level: int = 0,
    ) -> Any:
        if level == 0 and name in replaced:
            package = replaced[name]
            missing = [item for item in fromlist or () if item not in package]
            if fromlist and not missing:
                return types.SimpleNamespace(**package)
            raise ImportError(f"the polyamp run gives {name}'s {sorted(package)} only; asked for {missing or name}")
        if level == 0 and any(name == top or name.startswith(top + ".") for top in forbidden):
            raise ImportError(f"the polyamp run does not import {name}: it runs without {', '.join(forbidden)}")
        return builtins.__import__(name, globals, locals, fromlist or (), level)

    return hooked


def _load(path: Path, suite: Suite, replaced: Mapping[str, Mapping[str, Any]] | None) -> Upstream:
    hooked = None if replaced is None else {**vars(builtins), "__import__": _importer(replaced, suite.forbidden)}
    return load_test_class(path, suite.upstream_class, f"upstream.{path.stem}", "", hooked)


def _load_runs(suite: Suite) -> dict[str, Upstream]:
    """The file loaded as written and with polyamp substituted: {run: loaded}."""
    root = _jmp_root() if suite.upstream == "jmp" else _flax_root()
    path = root / suite.path
    return {suite.upstream: _load(path, suite, None), "polyamp": _load(path, suite, suite.substitute())}


_LOADED: dict[str, dict[str, Upstream]] = {}
_UNAVAILABLE: dict[str, str] = {}
for _name, _suite in SUITES.items():
    try:
        _LOADED[_name] = _load_runs(_suite)
    except UpstreamUnavailable as _reason:
        _UNAVAILABLE[_name] = str(_reason)

# -- running them ---------------------------------------------------------------------------------------------


def _expected(upstream_class: str, upstream: str, variant: str, run: str) -> list[pytest.MarkDecorator]:
    if run != "polyamp":
        return []
    key = f"{upstream_class}.{upstream}"
    found = POLYAMP_EXPECTED.get(f"{key}[{variant}]") if variant else None
    if found is None:
        found = POLYAMP_EXPECTED.get(key)
    return [] if found is None else [found]


def _make_test(suite_name: str, upstream: str) -> Callable[..., None]:
    suite, runs = SUITES[suite_name], _LOADED[suite_name]
    params = []
    for run, loaded in runs.items():
        for variant, method in loaded.tests[upstream].items():
            params.append(
                pytest.param(
                    run,
                    method,
                    id="-".join(part for part in (variant, run) if part),
                    marks=_expected(suite.upstream_class, upstream, variant, run),
                )
            )

    @pytest.mark.parametrize(("run", "method"), params)
    def test(self: object, run: str, method: str) -> None:
        # debug() runs setUp, the test, tearDown and cleanups, letting failures and skips propagate to pytest.
        runs[run].test_class(method).debug()

    test.__name__ = test.__qualname__ = upstream
    test.__doc__ = f"{suite.upstream_class}.{upstream} ({runs[suite.upstream].path})."
    return test


def _unavailable(reason: str) -> Callable[..., None]:
    def test_upstream_tests_read(self: object) -> None:
        pytest.skip(reason)

    return test_upstream_tests_read


for _name, _suite in SUITES.items():
    if _name in _LOADED:
        _members = {name: _make_test(_name, name) for name in _LOADED[_name][_suite.upstream].tests}
    else:
        _members = {"test_upstream_tests_read": _unavailable(_UNAVAILABLE[_name])}
    globals()[_name] = type(_name, (), {"__doc__": f"{_suite.upstream_class} ({_suite.path}).", **_members})


def test_expectations_name_upstream_tests() -> None:
    """Every entry of POLYAMP_EXPECTED names an upstream test that was read, and a variant it has."""
    known = {
        f"{SUITES[name].upstream_class}.{upstream}": set(variants)
        for name, runs in _LOADED.items()
        for upstream, variants in runs["polyamp"].tests.items()
    }
    assert {name for name in SUITES if name.startswith("TestJmp")} <= set(_LOADED), _UNAVAILABLE
    for key in POLYAMP_EXPECTED:
        upstream, _, variant = key.partition("[")
        assert upstream in known, f"POLYAMP_EXPECTED names {upstream}, which the tests read do not have"
        if variant:
            assert variant.rstrip("]") in known[upstream], f"POLYAMP_EXPECTED: {key} is not one of its variants"


def test_the_runs_see_the_implementation_they_name() -> None:
    """As written, the tests hold jmp's modules; substituted, the shim of polyamp_jax.jmp_compat's names, with
    not one of jmp's functions or classes among them."""
    import importlib

    for name in ("TestJmpPolicy", "TestJmpLossScale"):
        runs = _LOADED[name]
        original, shim = runs["jmp"].namespace["jmp"], runs["polyamp"].namespace["jmp"]
        assert original.__name__.startswith("jmp._src.")
        assert original is importlib.import_module(original.__name__)
        assert shim.DynamicLossScale is jmp_compat.DynamicLossScale
        assert shim.get_policy is jmp_compat.get_policy
        code = [
            value
            for value in vars(shim).values()
            if callable(value) and getattr(value, "__module__", "").startswith("jmp")
        ]
        assert code == []
