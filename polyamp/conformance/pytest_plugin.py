"""pytest wiring for polyamp's conformance cases, registered as the ``polyamp`` pytest plugin.

Installing polyamp registers this plugin (entry point ``pytest11``). It acts only on the cases of
`polyamp.conformance.cases`: wherever they are collected (``pytest --pyargs polyamp.conformance.suite``, or
a test module of your own doing ``from polyamp.conformance.cases import *``), it parametrizes their
``harness`` / ``harness_pair`` arguments over the targets of every registered backend that ships a harness
(`polyamp.backend_api.BackendSpec(harness=...)`, first-party or from the ``polyamp.backends`` entry points) on the
devices that harness declares, with ids like ``[torch-cpu]`` or ``[torch-cpu+tensorflow-cpu]``. A
third-party backend therefore runs the suite with no edit to polyamp:

    pytest --pyargs polyamp.conformance.suite --polyamp-backend mybackend --polyamp-device cuda

Unavailable frameworks and devices, and capabilities a harness lacks, are skips with the reason; a
backend's listed divergences become ``xfail(strict=True)``. Other tests are untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from polyamp.conformance._context import Reporter, reporting, stop_reporting
from polyamp.conformance._protocol import HarnessUnavailable
from polyamp.conformance._runner import device_type, make_harness, skip_reason, targets

CASES_MODULE = "polyamp.conformance.cases"

_harnesses: dict[tuple[str, str], Any] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("polyamp", "polyamp conformance suite")
    group.addoption(
        "--polyamp-backend",
        action="append",
        default=None,
        help="run the conformance cases on this backend only (repeatable; default: every backend with a harness)",
    )
    group.addoption(
        "--polyamp-device",
        action="append",
        default=None,
        help="run the conformance cases on this device type only (repeatable; default: every device a harness declares)",
    )


def _is_case(function: Any) -> bool:
    module = getattr(function, "__module__", None) or ""
    return module == CASES_MODULE or module.startswith(CASES_MODULE + ".")


def _targets(config: pytest.Config) -> list[tuple[str, str]]:
    return targets(config.getoption("polyamp_backend"), config.getoption("polyamp_device"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not _is_case(metafunc.function):
        return
    found = _targets(metafunc.config)
    if "harness" in metafunc.fixturenames:
        metafunc.parametrize("harness", found, ids=[f"{b}-{d}" for b, d in found], indirect=True)
    if "harness_pair" in metafunc.fixturenames:
        pairs = [
            (first, second)
            for index, first in enumerate(found)
            for second in found[index + 1 :]
            if first[0] != second[0] and device_type(first[1]) == device_type(second[1])
        ]
        ids = [f"{a[0]}-{a[1]}+{b[0]}-{b[1]}" for a, b in pairs]
        metafunc.parametrize("harness_pair", pairs, ids=ids, indirect=True)
    for name, values in getattr(metafunc.function, "polyamp_params", []):
        metafunc.parametrize(name, values, ids=[str(v) for v in values])


def _make_harness(target: tuple[str, str]) -> Any:
    if target not in _harnesses:
        try:
            _harnesses[target] = make_harness(*target)
        except HarnessUnavailable as exc:
            _harnesses[target] = exc
    harness = _harnesses[target]
    if isinstance(harness, Exception):
        pytest.skip(f"{target[0]}-{target[1]}: {harness}")
    return harness


def _running(request: pytest.FixtureRequest, *harnesses: Any) -> Iterator[None]:
    reason = skip_reason(request.function, *harnesses)
    if reason is not None:
        pytest.skip(reason)

    def diverge(why: str) -> None:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=why))

    token = reporting(Reporter(on_divergence=diverge, on_skip=lambda why: pytest.skip(why)))
    try:
        yield
    finally:
        stop_reporting(token)


@pytest.fixture
def harness(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One backend's conformance harness on one device; a skip with the reason where unavailable."""
    instance = _make_harness(request.param)
    for _ in _running(request, instance):
        yield instance


@pytest.fixture
def harness_pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """Two backends' harnesses on one device, for cross-backend cases."""
    first, second = (_make_harness(target) for target in request.param)
    for _ in _running(request, first, second):
        yield first, second
