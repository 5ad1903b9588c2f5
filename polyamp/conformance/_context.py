"""How a case reports a skip or an expected divergence, under pytest or under polyamp's own runner."""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "CaseSkipped",
    "Reporter",
    "assert_close",
    "assert_dtype",
    "assert_equal_arrays",
    "expect_divergence",
    "parametrize",
    "reporting",
    "requires",
    "skip",
    "stop_reporting",
]

F = TypeVar("F", bound=Callable[..., Any])


class CaseSkipped(Exception):
    """A case that cannot run here (a missing framework, device or capability)."""


@dataclass
class Reporter:
    """Installed by whoever runs the cases (polyamp's runner, or a pytest fixture) for the current case."""

    on_divergence: Callable[[str], None]
    on_skip: Callable[[str], None]


_reporter: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar(
    "polyamp_conformance_reporter", default=None
)


def reporting(reporter: Reporter) -> contextvars.Token[Reporter | None]:
    """Make ``reporter`` receive the current case's skips and divergences; returns a token for `stop_reporting`."""
    return _reporter.set(reporter)


def stop_reporting(token: contextvars.Token[Reporter | None]) -> None:
    _reporter.reset(token)


def skip(reason: str) -> None:
    """Skip the current case with ``reason``."""
    reporter = _reporter.get()
    if reporter is not None:
        reporter.on_skip(reason)
    raise CaseSkipped(reason)


def expect_divergence(harness: Any, key: str) -> None:
    """Declare that this case is expected to fail on ``harness`` if it lists ``key`` as a divergence.

    Under pytest this applies ``xfail(strict=True)``; polyamp's runner reports "expected divergence", and a
    case that then passes is reported as a failure, so divergence tables never go stale.
    """
    reason = getattr(harness, "divergences", {}).get(key)
    if reason is None:
        return
    reporter = _reporter.get()
    if reporter is None:
        raise RuntimeError("expect_divergence() called outside a conformance run")
    reporter.on_divergence(f"{harness.backend}: {reason}")


def parametrize(name: str, values: Iterable[Any]) -> Callable[[F], F]:
    """Run a case once per value of argument ``name`` (read by polyamp's runner and its pytest hook)."""

    def mark(case: F) -> F:
        params: list[tuple[str, list[Any]]] = getattr(case, "polyamp_params", [])
        case.polyamp_params = [*params, (name, list(values))]  # type: ignore[attr-defined]
        return case

    return mark


def requires(*capabilities: str) -> Callable[[F], F]:
    """Declare the harness capabilities a case needs (see `polyamp.conformance.CAPABILITIES`); a harness
    lacking one skips the case with the reason."""

    def mark(case: F) -> F:
        case.polyamp_requires = (*getattr(case, "polyamp_requires", ()), *capabilities)  # type: ignore[attr-defined]
        return case

    return mark


def missing_capabilities(case: Callable[..., Any], harness: object) -> list[str]:
    """The capabilities ``case`` needs that ``harness`` lacks, in the case's order."""
    from polyamp.conformance._protocol import capabilities_of

    offered = capabilities_of(harness)
    return [name for name in getattr(case, "polyamp_requires", ()) if name not in offered]


def assert_dtype(actual: str, expected: str, what: str) -> None:
    """Fail with ``what``'s name and both dtypes, e.g. "dtype=float16, but should be float32 [softmax(...)]"."""
    __tracebackhide__ = True
    if actual != expected:
        raise AssertionError(f"dtype={actual}, but should be {expected} [{what}]")


def assert_equal_arrays(actual: list[Any], expected: list[Any], what: str) -> None:
    """Fail unless the two lists of arrays are bitwise equal, naming the first difference."""
    __tracebackhide__ = True
    import numpy as np

    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} arrays, but should be {len(expected)} [{what}]")
    for index, (a, b) in enumerate(zip(actual, expected, strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or not np.array_equal(a, b, equal_nan=True):
            diff = "shapes differ" if a.shape != b.shape else f"max |diff| {float(np.nanmax(np.abs(a - b))):.3g}"
            raise AssertionError(f"array {index} differs ({diff}) [{what}]")


def assert_close(actual: float, expected: float, *, rel: float, abs_: float, what: str) -> None:
    __tracebackhide__ = True
    if not math.isclose(actual, expected, rel_tol=rel, abs_tol=abs_):
        raise AssertionError(f"{actual!r} is not within rel {rel} / abs {abs_} of {expected!r} [{what}]")
