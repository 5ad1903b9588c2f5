"""The tested framework versions: one table in the core, declared as is in pyproject.toml, warned about at import."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest

import polyamp
import polyamp.backend_api
from polyamp._src import versions
from polyamp.backend_api.versions import warn_if_untested

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _declared_minimums() -> dict[str, str]:
    """``name>=version`` of every framework extra (not the test tools), as pyproject.toml declares them."""
    found: dict[str, str] = {}
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra in ("torch", "tensorflow", "keras", "jax"):
        for requirement in extras[extra]:
            match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)(?:\s*,\s*<.*)?", requirement)
            assert match, f"{extra}: {requirement!r} declares no lower bound"
            name, version = match.groups()
            assert found.setdefault(name, version) == version, f"{name} is declared with two minimums"
    return found


def test_pyproject_declares_the_core_table() -> None:
    assert _declared_minimums() == versions.MINIMUM_VERSIONS
    assert polyamp.backend_api.versions.MINIMUM_VERSIONS is versions.MINIMUM_VERSIONS


def test_requires_python_is_the_tested_minimum() -> None:
    assert PYPROJECT["project"]["requires-python"] == f">={versions.MINIMUM_PYTHON}"
    classifiers = PYPROJECT["project"]["classifiers"]
    assert f"Programming Language :: Python :: {versions.MINIMUM_PYTHON}" in classifiers


def test_this_python_is_not_older_than_the_minimum() -> None:
    assert sys.version_info[:2] >= versions.parse_version(versions.MINIMUM_PYTHON)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.20.0rc1", (2, 20, 0)),
        ("0.4.38.dev20250101", (0, 4, 38)),
        ("3.10", (3, 10)),
        ("nightly", ()),
    ],
)
def test_parse_version(text: str, parsed: tuple[int, ...]) -> None:
    assert versions.parse_version(text) == parsed


def test_no_warning_within_the_tested_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(versions.MINIMUM_VERSIONS, "torch", "2.13")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for installed in ("2.13", "2.13.0", "2.13.0+cpu", "2.14.1", "3.0.0", "2.13.0.dev20250101", "not a version"):
            assert warn_if_untested("polyamp_torch", {"torch": installed}) is None
        assert warn_if_untested("polyamp_torch", {"somethingelse": "0.0.1"}) is None


def test_one_warning_below_the_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(versions.MINIMUM_VERSIONS, "jax", "0.6.2")
    monkeypatch.setitem(versions.MINIMUM_VERSIONS, "optax", "0.2.4")
    with pytest.warns(polyamp.UntestedVersionWarning) as caught:
        message = warn_if_untested("polyamp_jax", {"jax": "0.4.30", "optax": "0.2.3"})
    assert len(caught) == 1
    assert str(caught[0].message) == message
    assert message is not None
    assert "jax 0.4.30" in message and "optax 0.2.3" in message  # what is installed
    assert "jax >= 0.6.2" in message and "optax >= 0.2.4" in message  # what is tested
    assert "pip install -U 'polyamp[jax]'" in message  # how to fix it
    assert "docs/versions.md" in message
    assert issubclass(polyamp.UntestedVersionWarning, UserWarning)


def test_the_warning_names_each_extra_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(versions.MINIMUM_VERSIONS, "tensorflow", "2.20")
    monkeypatch.setitem(versions.MINIMUM_VERSIONS, "keras", "3.10")
    with pytest.warns(polyamp.UntestedVersionWarning, match=re.escape("'polyamp[tensorflow,keras]'")):
        warn_if_untested("polyamp_tensorflow", {"tensorflow": "2.19.1", "keras": "3.9.0"})


# Each backend package, imported in a fresh process with its frameworks' __version__ lowered below the table's
# minimum (to a release that still has the API polyamp checks for, Keras 3 for Keras), warns once naming it.
_IMPORT_WITH_OLD_VERSION = """
import importlib, json, sys, warnings
package, old = sys.argv[1], json.loads(sys.argv[2])
for name, version in old.items():  # before polyamp, whose import hooks may load the backend with the framework
    importlib.import_module(name).__version__ = version
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import polyamp
    importlib.import_module(package)
print(json.dumps([str(w.message) for w in caught if issubclass(w.category, polyamp.UntestedVersionWarning)]))
"""


@pytest.mark.parametrize(
    ("package", "old"),
    [
        ("polyamp_torch", {"torch": "2.1.0"}),
        pytest.param("polyamp_tensorflow", {"tensorflow": "2.16.1"}, marks=pytest.mark.slow),
        pytest.param("polyamp_keras", {"keras": "3.0.0"}, marks=pytest.mark.slow),
        ("polyamp_jax", {"jax": "0.4.30", "optax": "0.1.9"}),
    ],
)
def test_each_backend_warns_once_at_import(package: str, old: dict[str, str]) -> None:
    for module in old:
        pytest.importorskip(module)
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_WITH_OLD_VERSION, package, json.dumps(old)],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        cwd=ROOT / "tests",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    messages = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(messages) == 1, (messages, result.stderr[-3000:])
    assert messages[0].startswith(f"{package} is tested with")
    for module, version in old.items():
        assert f"{module} {version}" in messages[0]


@pytest.mark.slow
def test_backends_within_range_do_not_warn() -> None:
    installed = [
        package
        for package, module in (
            ("polyamp_torch", "torch"),
            ("polyamp_tensorflow", "tensorflow"),
            ("polyamp_keras", "keras"),
            ("polyamp_jax", "optax"),
        )
        if importlib.util.find_spec(module) is not None
    ]
    if not installed:
        pytest.skip("no framework installed")
    code = "import warnings, polyamp\nwarnings.simplefilter('error', polyamp.UntestedVersionWarning)\n"
    code += "".join(f"import {package}\n" for package in installed)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT / "tests", env=env, timeout=600)


def _matrix_script() -> Any:
    loader = importlib.machinery.SourceFileLoader("polyamp_ci_matrix", str(ROOT / ".ci" / "matrix"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_oldest_job_pins_the_core_table() -> None:
    matrix = _matrix_script()
    assert matrix.declared_minimums() == versions.MINIMUM_VERSIONS
    assert matrix.oldest_python() == versions.MINIMUM_PYTHON


def test_the_versions_page_shows_the_recorded_results() -> None:
    matrix = _matrix_script()
    page = (ROOT / "docs" / "versions.md").read_text(encoding="utf-8")
    assert matrix.render_report(ROOT / ".ci" / "results") in page, "run .ci/matrix --report"


def test_the_versions_page_states_each_declared_bound() -> None:
    page = (ROOT / "docs" / "versions.md").read_text(encoding="utf-8")
    for name, version in versions.MINIMUM_VERSIONS.items():
        assert f"| {name} (`[" in page and f"`>={version}`" in page, name
    assert f"`>={versions.MINIMUM_PYTHON}`" in page
