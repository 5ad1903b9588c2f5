"""The package layout rules: framework-named folders never become importable, the core imports no framework."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import polyamp
from polyamp._src.deprecation import MOVED

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "tf_keras")


@pytest.mark.parametrize(
    "folder", ["backends", "backends/torch", "backends/tensorflow", "backends/keras", "backends/jax", "tests"]
)
def test_folder_has_no_init_py(folder: str) -> None:
    # backends/torch/__init__.py would make `import torch` find polyamp's folder instead of PyTorch.
    assert not (ROOT / folder / "__init__.py").exists(), f"{folder}/__init__.py must not exist"


@pytest.mark.parametrize(
    "package",
    [
        "polyamp",
        "backends/torch/polyamp_torch",
        "backends/tensorflow/polyamp_tensorflow",
        "backends/keras/polyamp_keras",
        "backends/jax/polyamp_jax",
    ],
)
def test_packages_exist_with_py_typed(package: str) -> None:
    assert (ROOT / package / "__init__.py").is_file()
    assert (ROOT / package / "py.typed").is_file()


def _imported_frameworks(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, cwd=ROOT / "tests")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_import_polyamp_imports_no_framework() -> None:
    assert _imported_frameworks("import polyamp") == []


def test_core_use_without_tensors_imports_no_framework() -> None:
    code = (
        "import polyamp\n"
        "polyamp.set_policy('mixed_float16')\n"
        "with polyamp.policy_scope('mixed_bfloat16'):\n"
        "    pass\n"
        "s = polyamp.LossScaler(growth_interval=3)\n"
        "s.load_state_dict(s.state_dict())\n"
        "polyamp.backend_api.backend_specs()\n"
        "assert s.config.trajectory('FFFO')[-1] == 65536.0\n"
    )
    assert _imported_frameworks(code) == []


def _imports(folder: str) -> list[tuple[str, str]]:
    """Every absolute import under ``folder``: (where, dotted name), ``from a import b`` giving a and a.b."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            found += [(f"{path.relative_to(ROOT)}:{node.lineno}", name) for name in names]
    return found


def _framework_imports(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{where} imports {n}" for where, n in _imports(folder) if n.partition(".")[0] in forbidden]


def test_core_source_never_imports_a_framework() -> None:
    assert _framework_imports("polyamp", FRAMEWORKS) == []


def test_keras_package_source_imports_keras_only() -> None:
    # Keras 3 runs on JAX or PyTorch without TensorFlow; polyamp_keras must too (and never load the
    # TensorFlow backend package, which imports TensorFlow).
    forbidden = (*(fw for fw in FRAMEWORKS if fw != "keras"), "polyamp_tensorflow", "polyamp_torch")
    assert _framework_imports("backends/keras/polyamp_keras", forbidden) == []


def test_jax_package_source_imports_jax_and_optax_only() -> None:
    # A JAX user installs jax and optax: polyamp_jax loads no other framework and no other backend package.
    forbidden = (*(fw for fw in FRAMEWORKS if fw != "jax"), "polyamp_tensorflow", "polyamp_torch", "polyamp_keras")
    assert _framework_imports("backends/jax/polyamp_jax", forbidden) == []


def test_backends_use_only_the_public_backend_api() -> None:
    """A backend is written against ``polyamp`` and ``polyamp.backend_api``; ``polyamp._src`` is the core's own."""
    offenders = [f"{where} imports {n}" for where, n in _imports("backends") if "polyamp._src" in n]
    assert offenders == []


BACKEND_PACKAGES = {
    "torch": "polyamp_torch",
    "tensorflow": "polyamp_tensorflow",
    "keras": "polyamp_keras",
    "jax": "polyamp_jax",
}


def test_no_backend_imports_another_backends_private_modules() -> None:
    """A backend builds on another only through its public modules (e.g. ``polyamp_keras.device``)."""
    offenders = []
    for folder, package in BACKEND_PACKAGES.items():
        for where, name in _imports(f"backends/{folder}"):
            top, _, rest = name.partition(".")
            if top in BACKEND_PACKAGES.values() and top != package and rest.startswith("_"):
                offenders.append(f"{where} imports {name}")
    assert offenders == []


def test_the_private_import_scan_sees_the_backends_cross_imports() -> None:
    # The scan above would pass vacuously if it found nothing: the TensorFlow device does build on Keras's.
    names = [name for _, name in _imports("backends/tensorflow")]
    assert any(name.startswith("polyamp_keras.device") for name in names)


def test_the_public_backend_api_holds_what_backends_import() -> None:
    import polyamp.backend_api as api

    public = {name for name in vars(api) if name.isidentifier() and not name.startswith("_")}
    assert sorted(api.__all__) == sorted(public - {"annotations"})


@pytest.mark.parametrize(
    ("backend", "protocols", "methods"),
    [
        (
            "torch",
            ("ImperativeDevice", "RecordingDevice", "GuardingDevice", "SpikeDevice"),
            (
                "check_gradients_finite",
                "unscale_and_clip",
                "step_on_device",
                "non_finite_gradients",
                "non_finite_parameters",
                "compiling",
                "run_uncompiled",
                "set_process_group",
                "float16_in_use",
                "float16_computed",
                "step_own_scaling",
            ),
        ),
        (
            "tensorflow",
            ("TapeDevice", "RecordingDevice", "GuardingDevice", "ProvenanceDevice", "SpikeDevice"),
            (
                "unscale_and_clip_values",
                "apply_and_advance",
                "non_finite_parameters",
                "compiling",
                "replica",
                "float16_in_use",
            ),
        ),
    ],
)
def test_first_party_device_forms_implement_what_fits_their_loop_style(
    backend: str, protocols: tuple[str, ...], methods: tuple[str, ...]
) -> None:
    """The first-party device forms implement every capability group and every optional method
    (`polyamp.backend_api.OptionalMethods`) that fits their loop style."""
    pytest.importorskip(backend)
    from polyamp import backend_api

    device = polyamp.LossScaler(enabled=True).bind(backend)
    missing = [name for name in protocols if not isinstance(device, getattr(backend_api, name))]
    missing += [name for name in methods if not callable(getattr(device, name, None))]
    assert missing == []
    assert set(methods) <= set(dir(backend_api.OptionalMethods))
    other_style = "TapeDevice" if backend == "torch" else "ImperativeDevice"
    assert not isinstance(device, getattr(backend_api, other_style))


def test_the_public_surface_is_small() -> None:
    """Training code needs at most 36 names from polyamp; a backend at most 45 from polyamp.backend_api (its
    helpers sit in submodules by subject)."""
    import polyamp.backend_api as api

    assert len(polyamp.__all__) <= 36
    assert len(api.__all__) <= 45
    assert all(callable(getattr(api.OptionalMethods, name)) for name in ("apply_and_advance", "compiling"))


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_name_that_left_polyamp_resolves_with_a_warning_that_says_where_it_went(name: str) -> None:
    home = importlib.import_module(MOVED[name])
    with pytest.warns(DeprecationWarning, match=rf"polyamp\.{name} moved to {re.escape(MOVED[name])}\.{name}"):
        value = getattr(polyamp, name)
    assert value is getattr(home, name)
    assert name not in polyamp.__all__


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        polyamp.nothing_here  # noqa: B018


def test_no_module_passes_600_lines_nor_a_class_500() -> None:
    """Files by idea: a module of the core or of a backend that grows past 600 lines, or a class past 500, holds
    more than one idea and is split (a class into parts, as LossScaler and KerasDevice are)."""
    long_modules, long_classes = [], []
    for path in sorted([*(ROOT / "polyamp").rglob("*.py"), *(ROOT / "backends").rglob("*.py")]):
        source = path.read_text()
        where = path.relative_to(ROOT)
        if source.count("\n") > 600:
            long_modules.append(f"{where}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 500:
                long_classes.append(f"{where}: {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert long_modules == [] and long_classes == []
