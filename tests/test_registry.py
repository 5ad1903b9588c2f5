"""The backend registry: lookup by name and by object type, lazy loading, install hints, entry points."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import polyamp
import polyamp.backend_api
from polyamp import BackendNotInstalledError, PolyampTypeError
from polyamp._src import registry
from polyamp.backend_api import BackendSpec
from polyamp.backend_api.arguments import BackendConflictError, UnknownBackendError

if TYPE_CHECKING:
    from conftest import FakeFramework


def test_first_party_backends_are_known_without_importing_them() -> None:
    probe = (
        "import json, sys, polyamp\n"
        "specs = polyamp.backend_api.backend_specs()\n"
        "print(json.dumps({'specs': {n: [s.frameworks, s.install_hint, s.policy_modules] for n, s in specs.items()},\n"
        "    'imported': sorted(m for m in sys.modules if m.partition('.')[0] in\n"
        "        ('torch', 'tensorflow', 'keras', 'jax', 'polyamp_torch', 'polyamp_tensorflow', 'polyamp_keras'))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["imported"] == []  # known by spec, nothing imported
    specs = seen["specs"]
    assert specs["torch"][:2] == [["torch"], "pip install 'polyamp[torch]'"]
    assert specs["tensorflow"][1] == "pip install 'polyamp[tensorflow]'"
    assert specs["keras"][:2] == [["keras"], "pip install 'polyamp[keras]'"] and specs["keras"][2] == ["keras"]


def test_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(UnknownBackendError, match=r"Unknown backend 'jaxx'\. Known backends: .*tensorflow, torch"):
        polyamp.backend_api.get_backend("jaxx")
    with pytest.raises(ValueError):
        polyamp.LossScaler(backend="jaxx")


def test_backend_name_must_be_a_string() -> None:
    with pytest.raises(PolyampTypeError, match="backend name must be a string"):
        polyamp.backend_api.get_backend(3)  # type: ignore[arg-type]


def test_get_backend_with_an_array_is_a_type_error_naming_it() -> None:
    with pytest.raises(PolyampTypeError, match=r"must be a string such as 'torch'\. Received: array\(\[1\., 2\.\]\)"):
        polyamp.backend_api.get_backend(np.array([1.0, 2.0]))  # type: ignore[arg-type]


def test_backend_loads_lazily_and_is_cached(fake_framework: FakeFramework) -> None:
    assert fake_framework.backend_module not in sys.modules
    backend = polyamp.backend_api.get_backend(fake_framework.name)
    assert fake_framework.backend_module in sys.modules
    assert polyamp.backend_api.get_backend(fake_framework.name) is backend


def test_objects_are_matched_by_their_types_module(fake_framework: FakeFramework) -> None:
    module = fake_framework.load()

    class UserTensor(module.Tensor):  # defined in a test module; matched through its base class
        pass

    assert registry.backend_name_for(module.Tensor(1.0)) == fake_framework.name
    assert registry.backend_name_for(UserTensor(1.0)) == fake_framework.name
    assert registry.backend_name_for(1.0) is None
    assert registry.backend_name_for("text") is None


def _write_missing_framework_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BackendSpec:
    (tmp_path / "polyamp_ghost.py").write_text("import ghostframework_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = BackendSpec(
        name="ghost",
        target="polyamp_ghost:Backend",
        frameworks=("ghostframework_not_installed",),
        install_hint="pip install 'polyamp[ghost]'",
    )
    polyamp.backend_api.register_backend(spec)
    return spec


def test_missing_framework_gives_an_import_error_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_missing_framework_backend(tmp_path, monkeypatch)
    with pytest.raises(BackendNotInstalledError) as info:
        polyamp.LossScaler(backend="ghost")
    assert isinstance(info.value, ImportError)
    assert "pip install 'polyamp[ghost]'" in str(info.value)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def _import_error_without(run_without: Any, module: str, statement: str) -> str:
    code = f"try:\n    {statement}\nexcept ImportError as exc:\n    print(type(exc).__name__, '|', exc)\n"
    return run_without(module, code)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("backend", "module"), [("torch", "torch"), ("tensorflow", "tensorflow")])
def test_first_party_backend_without_its_framework_says_what_to_install(
    backend: str, module: str, run_without: Any
) -> None:
    out = _import_error_without(run_without, module, f"import polyamp; polyamp.LossScaler(backend={backend!r})")
    assert out.startswith("BackendNotInstalledError |"), out
    assert f"pip install 'polyamp[{backend}]'" in out


@pytest.mark.parametrize(
    ("statement", "module", "extra"),
    [
        ("import polyamp_torch", "torch", "torch"),
        ("import polyamp_tensorflow; polyamp_tensorflow.LossScaleOptimizer", "tensorflow", "tensorflow"),
        ("from polyamp_tensorflow import TensorFlowLossScaler", "tensorflow", "tensorflow"),
    ],
)
def test_a_backend_without_its_framework_says_what_to_install(
    statement: str, module: str, extra: str, run_without: Any
) -> None:
    out = _import_error_without(run_without, module, statement)
    assert out.startswith("BackendNotInstalledError |"), out
    assert f"pip install 'polyamp[{extra}]'" in out


def test_register_backend_refuses_to_silently_replace(fake_framework: FakeFramework) -> None:
    other = BackendSpec(name=fake_framework.name, target="elsewhere:Backend", frameworks=("x",), install_hint="y")
    with pytest.raises(BackendConflictError, match="already registered") as info:
        polyamp.backend_api.register_backend(other)
    assert isinstance(info.value, ValueError) and not isinstance(info.value, UnknownBackendError)
    polyamp.backend_api.register_backend(other, replace=True)
    assert polyamp.backend_api.backend_specs()[fake_framework.name] == other


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"name": "", "target": "a:b", "frameworks": ("a",), "install_hint": "x"}, "BackendSpec.name"),
        ({"name": "a", "target": "no_colon", "frameworks": ("a",), "install_hint": "x"}, "package.module:attribute"),
        ({"name": "a", "target": "a:b", "frameworks": "mylib", "install_hint": "x"}, "tuple of top-level module names"),
        ({"name": "a", "target": "a:b", "frameworks": 5, "install_hint": "x"}, "tuple of top-level module names"),
        ({"name": "a", "target": "a:b", "frameworks": (), "install_hint": "x"}, "non-empty top-level module names"),
        ({"name": "a", "target": "a:b", "frameworks": ("a.b",), "install_hint": "x"}, "no dots"),
        ({"name": "a", "target": "a:b", "frameworks": ("a",), "install_hint": "x", "harness": "nocolon"}, "harness"),
    ],
)
def test_backend_spec_validates(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(PolyampTypeError, match=fragment):
        BackendSpec(**kwargs)  # type: ignore[arg-type]


def test_register_backend_takes_a_spec() -> None:
    with pytest.raises(PolyampTypeError, match=r"takes a polyamp\.backend_api\.BackendSpec"):
        polyamp.backend_api.register_backend("torch")  # type: ignore[arg-type]


def test_third_party_backend_from_an_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real installed-distribution layout: a dist-info folder with an entry_points.txt on sys.path.
    dist = tmp_path / "polyamp_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: polyamp-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[polyamp.backends]\nplugin = polyamp_plugin_spec:SPEC\n")
    (tmp_path / "polyamp_plugin_spec.py").write_text(
        "import polyamp\n"
        "SPEC = polyamp.backend_api.BackendSpec(name='plugin', target='polyamp_plugin_impl:Backend',\n"
        "                           frameworks=('pluginfw',), install_hint='pip install polyamp-plugin')\n"
    )
    (tmp_path / "polyamp_plugin_impl.py").write_text(
        "class Backend:\n    name = 'plugin'\n"
        "    def make_device(self, config, state):\n        return ('device', config, state)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_read", False)
    assert "polyamp_plugin_impl" not in sys.modules
    backend = polyamp.backend_api.get_backend("plugin")
    assert backend.name == "plugin"
    assert "plugin" in polyamp.backend_api.backend_specs()


def test_entry_point_must_name_a_backend_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "bad_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[polyamp.backends]\nbad = bad_plugin_spec:SPEC\n")
    (tmp_path / "bad_plugin_spec.py").write_text("SPEC = {'name': 'bad'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_read", False)
    with pytest.raises(PolyampTypeError, match=r"must name a polyamp\.backend_api\.BackendSpec"):
        polyamp.backend_api.get_backend("bad")
