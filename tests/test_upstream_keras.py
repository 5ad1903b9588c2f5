"""Keras's own LossScaleOptimizer and DTypePolicyMap tests, run with Keras's classes and with polyamp's in their place.

``polyamp_tensorflow.LossScaleOptimizer`` is a subclass of Keras's ``LossScaleOptimizer`` and
``polyamp_keras.PolicyOverridesMap`` one of Keras's ``DTypePolicyMap``. This module runs Keras's tests of those
two classes (``keras/src/optimizers/loss_scale_optimizer_test.py`` and
``keras/src/dtype_policies/dtype_policy_map_test.py``) against them, on the Keras backend of the process:

* ``[native]``: as Keras wrote them. They must pass (or skip where Keras skips them on this backend); this shows
  the tests are read and run correctly here.
* ``[polyamp]``: with polyamp's class in place of Keras's, nothing else changed. The tests import the class from
  its defining module (``from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer``), so that
  name, in the tests' own module, is the one replaced; Keras's public spellings are left alone, since polyamp's
  own code checks against Keras's class through them.
* ``[polyamp-float16]`` (loss-scale tests only): as ``[polyamp]``, inside ``polyamp.policy_scope("mixed_float16")``,
  the policy polyamp's optimizer is meant to be used under; Keras's tests run under float32.

The loss-scale optimizer is ``polyamp_keras.LossScaleOptimizer`` where that package has one, else
``polyamp_tensorflow.LossScaleOptimizer`` (which imports TensorFlow, whatever the Keras backend).

A polyamp run that reads the private attributes of the class under test is skipped, naming them; one that fails
for another reason is a strict xfail whose reason says what polyamp does differently (see ``POLYAMP_EXPECTED``),
a documented difference or a gap.

Every Keras backend: the tests run in this process on its backend (``KERAS_BACKEND``), and
``test_on_keras_backend`` runs this module again, in a subprocess, for each other installed backend
(tensorflow, jax, torch).

The tests are not copied into this repository. They are read, when the module is collected, from the Keras
source tree that the environment variable ``POLYAMP_KERAS_SOURCE`` names (a checkout of Keras at the tag of the
installed version; the two files above and ``keras/src/version.py`` are all it needs); without it the module is
skipped. Their source is compiled unchanged; Keras's test helpers come from the installed ``keras.src.testing``::

    POLYAMP_KERAS_SOURCE=/path/to/keras python -m pytest tests/test_upstream_keras.py
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import unittest
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402

SOURCE_VARIABLE = "POLYAMP_KERAS_SOURCE"
#: Set to 0 in the subprocesses of test_on_keras_backend, which cover one backend each.
OTHER_BACKENDS_VARIABLE = "POLYAMP_KERAS_OTHER_BACKENDS"
KERAS_BACKENDS = ("tensorflow", "jax", "torch")
BACKEND = keras.backend.backend()


def _loss_scale_optimizer() -> type:
    """polyamp's LossScaleOptimizer: the Keras-only one if there is one, else TensorFlow's."""
    found = getattr(polyamp_keras, "LossScaleOptimizer", None)
    if found is None:
        import polyamp_tensorflow  # TensorFlow, also under the JAX and torch Keras backends

        found = polyamp_tensorflow.LossScaleOptimizer
    return found  # type: ignore[no-any-return]


class Suite(NamedTuple):
    """One upstream test file, its test class, and the name polyamp's class replaces there."""

    path: str  # inside the Keras source tree
    upstream_class: str
    replaced: str  # the name the tests use for the class under test
    polyamp_class: Callable[[], type]
    implementations: tuple[str, ...]
    marks: tuple[pytest.MarkDecorator, ...] = ()  # on the polyamp runs


SUITES = {
    "TestLossScaleOptimizer": Suite(
        "keras/src/optimizers/loss_scale_optimizer_test.py",
        "LossScaleOptimizerTest",
        "LossScaleOptimizer",
        _loss_scale_optimizer,
        ("native", "polyamp", "polyamp-float16"),
        () if hasattr(polyamp_keras, "LossScaleOptimizer") else (pytest.mark.tensorflow,),
    ),
    "TestDTypePolicyMap": Suite(
        "keras/src/dtype_policies/dtype_policy_map_test.py",
        "DTypePolicyMapTest",
        "DTypePolicyMap",
        lambda: polyamp_keras.PolicyOverridesMap,
        ("native", "polyamp"),
    ),
}
POLYAMP_RUNS = ("polyamp", "polyamp-float16")

# -- what polyamp does differently, per upstream test ---------------------------------------------------------
#
# Set against Keras v3.15.1 (commit 250b42181ce9f37df68319d8f4753ec89a349a43), whose tests of both classes pass
# natively with keras 3.15.1 on the tensorflow, jax and torch backends.
#
# Keys are "<upstream class>.<upstream method>", or "...[variant]" for one of its named parameters (as in the
# test id). An entry applies to the backends and polyamp runs it names. Remove an entry once polyamp closes the
# gap: a strict xfail that passes fails the suite, and `raises` makes one that fails for another reason fail it
# too. None of these tests reads private attributes of the class under test (the private names they use are
# their own helpers, Layer._flatten_layers and QuantizedDTypePolicy._source_name), so `private` has no entry.


class Expected(NamedTuple):
    mark: pytest.MarkDecorator
    backends: tuple[str, ...] = KERAS_BACKENDS
    runs: tuple[str, ...] = POLYAMP_RUNS


def private(attributes: str, **where: Any) -> Expected:
    """The test reads private attributes of the class under test, which polyamp's need not have."""
    return Expected(pytest.mark.skip(reason=f"reads the private {attributes}"), **where)


def documented(reason: str, raises: type[BaseException], **where: Any) -> Expected:
    """A difference polyamp documents; the test fails with ``raises``."""
    return Expected(pytest.mark.xfail(strict=True, raises=raises, reason=f"documented difference: {reason}"), **where)


def gap(reason: str, raises: type[BaseException], **where: Any) -> Expected:
    """polyamp is not (yet) compatible with Keras here; the test fails with ``raises``."""
    return Expected(pytest.mark.xfail(strict=True, raises=raises, reason=f"gap: {reason}"), **where)


POLYAMP_EXPECTED: dict[str, Expected] = {
    "LossScaleOptimizerTest.test_serialization": documented(
        "get_config() writes polyamp's settings, Keras's two spellings of init_scale/growth_interval and "
        "`enabled`, `guard`, `on_min_scale`, `history` (16 keys), where Keras writes 4 (name, inner_optimizer, "
        "initial_scale, dynamic_growth_steps): assertLen(config, 4) fails with 16 != 4",
        AssertionError,
    ),
    "LossScaleOptimizerTest.test_init_dynamic_arg": documented(
        "dynamic=False is a fixed scale that still skips non-finite steps, where Keras raises ValueError "
        '("set `loss_scale_factor`"): "ValueError not raised"',
        AssertionError,
    ),
}


# -- reading the upstream tests -------------------------------------------------------------------------------


class UpstreamUnavailable(Exception):
    """Why the upstream tests cannot be run here."""


def _source_root() -> Path:
    value = os.environ.get(SOURCE_VARIABLE)
    if not value:
        raise UpstreamUnavailable(
            f"{SOURCE_VARIABLE} is not set: point it at a Keras source tree at tag v{keras.__version__} to run "
            "Keras's LossScaleOptimizer and DTypePolicyMap tests"
        )
    root = Path(value)
    version_file = root / "keras" / "src" / "version.py"
    if not version_file.is_file():
        raise UpstreamUnavailable(f"{SOURCE_VARIABLE}={value} is not a Keras source tree (no {version_file})")
    found = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", version_file.read_text(encoding="utf-8"))
    if found is None or found.group(1) != keras.__version__:
        raise UpstreamUnavailable(
            f"{SOURCE_VARIABLE}={value} is Keras {found.group(1) if found else '?'}, the installed Keras is "
            f"{keras.__version__}: check out tag v{keras.__version__}"
        )
    return root


class Upstream(NamedTuple):
    test_class: type  # the unittest class as Keras wrote it, with absl's named parameters expanded
    namespace: dict[str, Any]  # its module's globals, where the tests find the class under test
    path: Path
    tests: dict[str, dict[str, str]]  # upstream method -> {variant ("" if none): instantiated method}


def _load(root: Path, suite: Suite) -> Upstream:
    path = root / suite.path
    if not path.is_file():
        raise UpstreamUnavailable(f"{path} is missing from the Keras source tree")
    text = path.read_text(encoding="utf-8")
    module = ast.parse(text, filename=str(path))
    classes = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == suite.upstream_class]
    if not classes:
        raise UpstreamUnavailable(f"{path} has no class {suite.upstream_class}")
    written = [n.name for n in classes[0].body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]

    # Kept out of this module's globals: pytest would collect the unittest class on its own.
    namespace: dict[str, Any] = {"__name__": f"keras_upstream.{path.stem}", "__file__": str(path)}
    exec(compile(module, str(path), "exec"), namespace)
    test_class = namespace[suite.upstream_class]
    tests: dict[str, dict[str, str]] = {name: {} for name in written}
    for method in unittest.TestLoader().getTestCaseNames(test_class):
        # The longest written name it starts with (test_finite_step vs test_finite_step_with_overwrite).
        owner = max((n for n in written if method == n or method.startswith(n + "_")), key=len, default=None)
        if owner is not None:
            tests[owner][method[len(owner) + 1 :]] = method
    return Upstream(test_class, namespace, path, tests)


try:
    _ROOT = _source_root()
    _UPSTREAM = {name: _load(_ROOT, suite) for name, suite in SUITES.items()}
except UpstreamUnavailable as _reason:
    pytest.skip(str(_reason), allow_module_level=True)


# -- running them ---------------------------------------------------------------------------------------------


def _upstream_marks(test_class: type, method: str) -> list[Any]:
    """Keras's own pytest marks on the class and method, as Keras's conftest reads them."""
    marks: list[Any] = []
    for mark in [*getattr(test_class, "pytestmark", []), *getattr(getattr(test_class, method), "pytestmark", [])]:
        if mark.name in ("skip", "skipif"):
            marks.append(mark)
        elif mark.name == "requires_trainable_backend" and BACKEND == "numpy":
            marks.append(pytest.mark.skip(reason="Trainer not implemented for NumPy backend."))
    return marks


def _expected(upstream_class: str, upstream: str, variant: str, run: str) -> list[pytest.MarkDecorator]:
    if run == "native":
        return []
    entry = POLYAMP_EXPECTED.get(f"{upstream_class}.{upstream}[{variant}]") or POLYAMP_EXPECTED.get(
        f"{upstream_class}.{upstream}"
    )
    if entry is None or BACKEND not in entry.backends or run not in entry.runs:
        return []
    return [entry.mark]


@pytest.fixture
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The class under test: Keras's ("native"), or polyamp's in its place, under float16 for "polyamp-float16"."""
    suite_name, run = request.param
    if run == "native":
        yield run
        return
    suite = SUITES[suite_name]
    try:
        replacement = suite.polyamp_class()
    except ImportError as exc:
        pytest.skip(f"polyamp's {suite.replaced} needs {exc.name}, which is not installed")
    monkeypatch.setitem(_UPSTREAM[suite_name].namespace, suite.replaced, replacement)
    if run == "polyamp-float16":
        with polyamp.policy_scope("mixed_float16"):
            yield run
    else:
        yield run


def _make_test(suite_name: str, upstream: str, variants: dict[str, str]) -> Callable[..., None]:
    suite, loaded = SUITES[suite_name], _UPSTREAM[suite_name]
    params = []
    for variant, method in variants.items():
        for run in suite.implementations:
            marks = _upstream_marks(loaded.test_class, method) + _expected(suite.upstream_class, upstream, variant, run)
            if run != "native":
                marks += suite.marks
            params.append(
                pytest.param(
                    method,
                    (suite_name, run),
                    id="-".join(part for part in (BACKEND, variant, run) if part),
                    marks=marks,
                )
            )

    @pytest.mark.parametrize(("method", "implementation"), params, indirect=["implementation"])
    def test(self: object, method: str, implementation: str) -> None:
        # debug() runs setUp, the test, tearDown and cleanups, letting failures and skips propagate to pytest.
        loaded.test_class(method).debug()

    test.__name__ = test.__qualname__ = upstream
    test.__doc__ = f"Keras's {suite.upstream_class}.{upstream} ({loaded.path}), on the {BACKEND} backend."
    return test


for _suite_name, _loaded in _UPSTREAM.items():
    globals()[_suite_name] = type(
        _suite_name,
        (),
        {
            "__doc__": f"Keras's {SUITES[_suite_name].upstream_class} ({_loaded.path}).",
            **{name: _make_test(_suite_name, name, variants) for name, variants in _loaded.tests.items()},
        },
    )


def test_expectations_name_upstream_tests() -> None:
    """Every entry of POLYAMP_EXPECTED names an upstream test that was read, variants, backends and runs that exist."""
    known = {
        f"{SUITES[name].upstream_class}.{upstream}": set(variants)
        for name, loaded in _UPSTREAM.items()
        for upstream, variants in loaded.tests.items()
    }
    for key, entry in POLYAMP_EXPECTED.items():
        upstream, _, variant = key.partition("[")
        assert upstream in known, f"POLYAMP_EXPECTED names {upstream}, which the Keras tests read do not have"
        if variant:
            assert variant.rstrip("]") in known[upstream], f"POLYAMP_EXPECTED: {key} is not one of its variants"
        assert set(entry.backends) <= set(KERAS_BACKENDS) and set(entry.runs) <= set(POLYAMP_RUNS), key


@pytest.mark.skipif(os.environ.get(OTHER_BACKENDS_VARIABLE) == "0", reason="this process covers one backend")
@pytest.mark.parametrize("backend", [b for b in KERAS_BACKENDS if b != BACKEND])
def test_on_keras_backend(backend: str) -> None:
    """This module on another Keras backend, in a subprocess (Keras picks its backend once per process)."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    env = dict(os.environ, KERAS_BACKEND=backend, **{OTHER_BACKENDS_VARIABLE: "0"})
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-p", "no:cacheprovider", "-q", "-rfE"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )
    assert result.returncode == 0, f"Keras backend {backend}:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
