"""The distributions: ``python -m build`` makes an sdist and, from it, a wheel; ``twine check`` passes both; the
wheel holds the five packages (each with its ``py.typed``) and nothing from tests/ or docs/; installed alone
(``--no-deps``) in a fresh virtual environment it imports each package from there, declares every extra as
pyproject.toml does and registers the conformance plugin.

The fresh environment sees the frameworks of the environment running the tests after its own site-packages (a
``.pth`` line), so its own copy of polyamp comes first and nothing is downloaded; the core is imported with those
directories taken off ``sys.path``, as in an environment that holds polyamp alone.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import site
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

#: Each package the wheel installs, and the folder of its sources.
PACKAGES = {
    "polyamp": ROOT / "polyamp",
    "polyamp_torch": ROOT / "backends/torch/polyamp_torch",
    "polyamp_tensorflow": ROOT / "backends/tensorflow/polyamp_tensorflow",
    "polyamp_keras": ROOT / "backends/keras/polyamp_keras",
    "polyamp_jax": ROOT / "backends/jax/polyamp_jax",
}
#: Each backend: its package and the frameworks its extra brings.
BACKENDS = {
    "torch": ("polyamp_torch", ("torch", "numpy")),
    "tensorflow": ("polyamp_tensorflow", ("tensorflow",)),
    "keras": ("polyamp_keras", ("keras",)),
    "jax": ("polyamp_jax", ("jax", "optax")),
}
#: The conftest fixture run_bounded: a subprocess bounded by POLYAMP_TEST_TIMEOUT.
RunBounded = Callable[..., "subprocess.CompletedProcess[str]"]

#: Which framework modules a bare ``import polyamp`` must leave unimported.
FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "numpy")


def _run(run_bounded: RunBounded, *args: str | Path, cwd: Path | None = None) -> str:
    """The command's output; it must succeed. Run without PYTHONPATH, so a source checkout never stands in for
    what was built and installed."""
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    environment |= {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONNOUSERSITE": "1"}
    result = run_bounded([str(arg) for arg in args], cwd=cwd, env=environment)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def dists(run_bounded: RunBounded, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel built from it (without build isolation: the test extra holds hatchling)."""
    for module in ("build", "twine", "hatchling"):
        pytest.importorskip(module, reason=f"{module} is not installed: pip install '.[test]' brings it")
    out = tmp_path_factory.mktemp("dist")
    _run(run_bounded, sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT)
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(out.iterdir())
    return {"sdist": sdists[0], "wheel": wheels[0]}


@pytest.fixture(scope="module")
def venv(run_bounded: RunBounded, dists: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel alone installed, which sees this environment's frameworks
    after its own site-packages."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run(run_bounded, sys.executable, "-m", "venv", root)
    python = _python(root)
    _run(
        run_bounded,
        python,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--disable-pip-version-check",
        dists["wheel"],
    )
    own = Path(_run(run_bounded, python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    (own / "zz_frameworks.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return root


def _python(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / "python"


def _public_names() -> list[str]:
    for node in ast.parse((ROOT / "polyamp/__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("polyamp/__init__.py has no __all__")


def _in_venv(run_bounded: RunBounded, venv: Path, script: str) -> Any:
    """What ``script`` prints as JSON, run isolated (no PYTHONPATH, no working folder) by the venv's Python."""
    return json.loads(_run(run_bounded, _python(venv), "-I", "-c", script, cwd=venv).strip().splitlines()[-1])


def test_twine_check_passes_on_the_sdist_and_the_wheel(run_bounded: RunBounded, dists: dict[str, Path]) -> None:
    out = _run(run_bounded, sys.executable, "-m", "twine", "check", "--strict", dists["sdist"], dists["wheel"])
    assert out.count("PASSED") == 2, out


def test_the_wheel_holds_the_five_packages_with_py_typed_and_no_tests_or_docs(dists: dict[str, Path]) -> None:
    names = [PurePosixPath(name) for name in zipfile.ZipFile(dists["wheel"]).namelist()]
    metadata = {name.parts[0] for name in names if name.parts[0].endswith(".dist-info")}
    assert len(metadata) == 1
    assert {name.parts[0] for name in names} - metadata == set(PACKAGES)
    assert [name for name in names if {"tests", "docs"} & set(name.parts)] == []
    for package, source in PACKAGES.items():
        assert PurePosixPath(package, "py.typed") in names, package
        shipped = {name.relative_to(package) for name in names if name.parts[0] == package and name.suffix == ".py"}
        sources = {PurePosixPath(path.relative_to(source).as_posix()) for path in source.rglob("*.py")}
        assert shipped == sources, package


def test_the_sdist_holds_what_builds_the_wheel_and_the_readme(dists: dict[str, Path]) -> None:
    with tarfile.open(dists["sdist"]) as sdist:
        names = {PurePosixPath(name).relative_to(PurePosixPath(name).parts[0]) for name in sdist.getnames()}
    for path in (
        "pyproject.toml",
        "README.md",
        "polyamp/py.typed",
        *(f"{source.relative_to(ROOT)}/__init__.py" for source in PACKAGES.values()),
    ):
        assert PurePosixPath(path) in names, path


def test_the_core_imports_from_the_fresh_environment_without_any_framework(run_bounded: RunBounded, venv: Path) -> None:
    found = _in_venv(
        run_bounded,
        venv,
        "import json, site, sys\n"
        f"sys.path = [p for p in sys.path if p not in {site.getsitepackages()!r}]\n"
        "import importlib.util, polyamp\n"
        "assert polyamp.LossScaler(growth_interval=3).config.trajectory('FFFO')[-1] == 65536.0\n"
        f"findable = [m for m in {FRAMEWORKS!r} if importlib.util.find_spec(m) is not None]\n"
        f"imported = [m for m in {FRAMEWORKS!r} if m in sys.modules]\n"
        "print(json.dumps([polyamp.__file__, findable, imported, sorted(polyamp.__all__)]))",
    )
    path, findable, imported, public = found
    assert Path(path).is_relative_to(venv), path
    assert findable == [] and imported == []
    assert public == sorted(_public_names())


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_each_backend_imports_from_the_fresh_environment_with_its_extra(
    backend: str, run_bounded: RunBounded, venv: Path
) -> None:
    package, frameworks = BACKENDS[backend]
    missing = [name for name in frameworks if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install 'polyamp[{backend}]'")
    paths = _in_venv(
        run_bounded,
        venv,
        "import json, sys\n"
        f"import polyamp, {package}\n"
        f"registered = polyamp.backend_api.get_backend({backend!r})\n"
        f"print(json.dumps([polyamp.__file__, {package}.__file__, sys.modules[type(registered).__module__].__file__]))",
    )
    assert [path for path in paths if not Path(path).is_relative_to(venv)] == []
    assert Path(paths[2]).parent == Path(paths[1]).parent  # the registry's target is the installed package's


@pytest.fixture(scope="module")
def installed(run_bounded: RunBounded, venv: Path) -> dict[str, Any]:
    """The installed distribution's requirements, extras, location and pytest plugins, read in the venv."""
    return _in_venv(
        run_bounded,
        venv,
        "import json\n"
        "from importlib import metadata\n"
        "dist = metadata.distribution('polyamp')\n"
        "plugins = [[e.name, e.value] for e in dist.entry_points.select(group='pytest11')]\n"
        "print(json.dumps({'requires': metadata.requires('polyamp'), 'extras': dist.metadata.get_all('Provides-Extra'),"
        " 'location': str(dist.locate_file('')), 'plugins': plugins}))",
    )


def _extra(name: str) -> set[str]:
    """The requirements of pyproject.toml's extra ``name``, with polyamp's own extras expanded."""
    found: set[str] = set()
    for line in PYPROJECT["project"]["optional-dependencies"][name]:
        requirement = Requirement(line)
        if requirement.name == "polyamp":
            for extra in requirement.extras:
                found |= _extra(extra)
        else:
            requirement.marker = None
            found.add(str(requirement))
    return found


def test_the_installed_wheel_is_the_fresh_environments_own(installed: dict[str, Any], venv: Path) -> None:
    assert Path(installed["location"]).is_relative_to(venv)
    assert sorted(installed["extras"]) == sorted(PYPROJECT["project"]["optional-dependencies"])
    assert installed["plugins"] == [["polyamp", "polyamp.conformance.pytest_plugin"]]


@pytest.mark.parametrize("extra", sorted(PYPROJECT["project"]["optional-dependencies"]))
def test_the_installed_metadata_declares_each_extra_as_pyproject_does(extra: str, installed: dict[str, Any]) -> None:
    declared: set[str] = set()
    for line in installed["requires"]:
        requirement = Requirement(line)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}):
            requirement.marker = None
            declared.add(str(requirement))
    assert declared == _extra(extra) != set()
