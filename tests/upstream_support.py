"""What the runs of peers' own test files share (tests/test_upstream_keras.py, tests/test_upstream_jax.py):
finding a peer's source tree at the installed version, and loading one unittest class of an upstream file
with its written test methods mapped to the methods absl's parameterization makes of them."""

from __future__ import annotations

import ast
import re
import unittest
from pathlib import Path
from typing import Any, NamedTuple

#: What absl's parameterized appends to a test method's name: nothing, "_<testcase_name>" or "<index>".
_ABSL_SUFFIX = re.compile(r"(_.+|[0-9]+)?")
_VERSION = re.compile(r"""__version__\s*=\s*["']([^"']+)["']""")


class UpstreamUnavailable(Exception):
    """Why an upstream test file cannot be run here."""


class Upstream(NamedTuple):
    test_class: type  # the unittest class as written, with absl's parameters expanded
    namespace: dict[str, Any]  # its module's globals, where the tests find the class under test
    path: Path
    tests: dict[str, dict[str, str]]  # upstream method -> {variant ("" if none): instantiated method}


def source_tree(variable: str, value: str, project: str, version_file: str, installed: str, hint: str = "") -> Path:
    """``value`` (the environment variable ``variable``'s) as a source tree of ``project`` whose ``version_file``
    declares the installed version ``installed``; ``hint`` ends the message of a version mismatch."""
    root = Path(value)
    path = root / version_file
    if not path.is_file():
        raise UpstreamUnavailable(f"{variable}={value} is not a {project} source tree (no {path})")
    found = _VERSION.search(path.read_text(encoding="utf-8"))
    if found is None or found.group(1) != installed:
        raise UpstreamUnavailable(
            f"{variable}={value} is {project} {found.group(1) if found else '?'}, the installed {project} is "
            f"{installed}{hint}"
        )
    return root


def load_test_class(
    path: Path, class_name: str, module_name: str, missing: str, builtins: dict[str, Any] | None = None
) -> Upstream:
    """The unittest class ``class_name`` of the file ``path``, run as module ``module_name`` (with ``builtins``
    as its ``__builtins__`` when given); ``missing`` ends the message when the file does not exist."""
    if not path.is_file():
        raise UpstreamUnavailable(f"{path} is missing{missing}")
    module = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    classes = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    if not classes:
        raise UpstreamUnavailable(f"{path} has no class {class_name}")
    written = [n.name for n in classes[0].body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    # Kept out of the test module's globals: pytest would collect the unittest class on its own.
    namespace: dict[str, Any] = {"__name__": module_name, "__file__": str(path)}
    if builtins is not None:
        namespace["__builtins__"] = builtins
    exec(compile(module, str(path), "exec"), namespace)
    test_class = namespace[class_name]
    tests: dict[str, dict[str, str]] = {name: {} for name in written}
    for method in unittest.TestLoader().getTestCaseNames(test_class):
        # The longest written name it starts with (test_finite_step vs test_finite_step_with_overwrite), followed
        # by absl's suffix: "_<testcase_name>" (named_parameters) or "<index>" (parameters).
        owner: str | None = max(
            (n for n in written if method.startswith(n) and _ABSL_SUFFIX.fullmatch(method[len(n) :])),
            key=len,
            default=None,
        )
        if owner is not None:
            tests[owner][method[len(owner) :].lstrip("_")] = method
    return Upstream(test_class, namespace, path, tests)


__all__ = ["Upstream", "UpstreamUnavailable", "load_test_class", "source_tree"]
