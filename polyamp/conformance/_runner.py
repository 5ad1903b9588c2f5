"""polyamp's own runner for the conformance cases: no pytest needed, a per-case table, an exit status."""

from __future__ import annotations

import inspect
import itertools
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from polyamp._src import registry
from polyamp.conformance import cases as case_module
from polyamp.conformance._context import CaseSkipped, Reporter, missing_capabilities, reporting, stop_reporting
from polyamp.conformance._protocol import CAPABILITIES, Harness, HarnessUnavailable

__all__ = [
    "CaseResult",
    "case_functions",
    "device_type",
    "expand",
    "harness_class",
    "make_harness",
    "run",
    "skip_reason",
    "targets",
]

OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed")


@dataclass
class CaseResult:
    """One case on one harness (or pair)."""

    case: str
    target: str
    outcome: str
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome in ("passed", "skipped", "xfailed")


def case_functions() -> list[Callable[..., None]]:
    """Every case in `polyamp.conformance.cases`, in the order its modules and their files list them."""
    return [f for name, f in vars(case_module).items() if name.startswith("test_") and callable(f)]


def expand(case: Callable[..., None]) -> list[tuple[str, dict[str, Any]]]:
    """The (id, arguments) pairs of a case's parametrisation."""
    # Decorators apply bottom-up, so the one nearest the function comes first, as in pytest's ids.
    params: list[tuple[str, list[Any]]] = list(getattr(case, "polyamp_params", []))
    if not params:
        return [("", {})]
    names = [name for name, _ in params]
    combos = itertools.product(*(values for _, values in params))
    return [("-".join(str(v) for v in combo), dict(zip(names, combo, strict=True))) for combo in combos]


def harness_class(backend: str) -> Any:
    """The harness class (or factory) ``backend``'s spec names.

    Raises:
        HarnessUnavailable: no such backend, no harness, or it cannot be imported here.
    """
    spec = registry.backend_specs().get(backend)
    if spec is None:
        raise HarnessUnavailable(f"no backend named {backend!r} is registered")
    if spec.harness is None:
        raise HarnessUnavailable(f"backend {backend!r} ships no conformance harness")
    try:
        return registry.load_target(
            spec.harness, backend=backend, install_hint=spec.install_hint, frameworks=spec.frameworks
        )
    except ImportError as exc:
        raise HarnessUnavailable(str(exc)) from exc


def make_harness(backend: str, device: str) -> Harness:
    """Create ``backend``'s harness on ``device``.

    Raises:
        HarnessUnavailable: the backend's framework, its harness or the device is not available.
    """
    harness: Harness = harness_class(backend)(device)
    return harness


def targets(backends: Sequence[str] | None = None, devices: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """The (backend, device) pairs to run: every backend with a harness (or ``backends``), on the devices its
    harness declares (``devices`` attribute, default ``("cpu",)``) or on ``devices`` when given."""
    if backends is None:
        backends = [name for name, spec in registry.backend_specs().items() if spec.harness]
    result = []
    for backend in backends:
        if devices is not None:
            declared: tuple[str, ...] = tuple(devices)
        else:
            try:
                declared = tuple(getattr(harness_class(backend), "devices", ("cpu",)))
            except HarnessUnavailable:
                declared = ("cpu",)  # one target, which reports why the backend cannot run
        result += [(backend, device) for device in declared]
    return result


def skip_reason(case: Callable[..., Any], *harnesses: object) -> str | None:
    """Why ``case`` cannot run on these harnesses (a capability one of them lacks), or None."""
    for harness in harnesses:
        missing = missing_capabilities(case, harness)
        if missing:
            name = missing[0]
            return (
                f"{getattr(harness, 'backend', '?')}-{getattr(harness, 'device', '?')} lacks the {name!r} "
                f"capability ({CAPABILITIES.get(name, 'declared by the case')})"
            )
    return None


def _run_one(case: Callable[..., None], case_id: str, target: str, kwargs: dict[str, Any]) -> CaseResult:
    harnesses = kwargs.get("harness_pair") or (kwargs["harness"],)
    reason = skip_reason(case, *harnesses)
    if reason is not None:
        return CaseResult(case_id, target, "skipped", reason)
    expected: list[str] = []

    def on_skip(reason: str) -> None:
        raise CaseSkipped(reason)

    token = reporting(Reporter(on_divergence=expected.append, on_skip=on_skip))
    start = time.perf_counter()
    try:
        case(**kwargs)
    except CaseSkipped as exc:
        return CaseResult(case_id, target, "skipped", str(exc), time.perf_counter() - start)
    except AssertionError as exc:
        if expected:  # the documented divergence showed up, as it should
            return CaseResult(
                case_id, target, "xfailed", f"expected divergence: {expected[0]} ({exc})", time.perf_counter() - start
            )
        return CaseResult(case_id, target, "failed", f"AssertionError: {exc}", time.perf_counter() - start)
    except Exception:  # a crash is a failure even where a divergence is expected
        return CaseResult(
            case_id, target, "failed", traceback.format_exc(limit=-3).strip(), time.perf_counter() - start
        )
    finally:
        stop_reporting(token)
    if expected:
        return CaseResult(
            case_id, target, "xpassed", f"listed as a divergence but passed: {expected[0]}", time.perf_counter() - start
        )
    return CaseResult(case_id, target, "passed", "", time.perf_counter() - start)


def run(
    backends: Sequence[str] | None = None,
    devices: Sequence[str] | None = None,
    *,
    keyword: str | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Run every case on every target (see `targets`); unavailable ones give one "skipped" row with the reason."""
    results: list[CaseResult] = []

    def record(result: CaseResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    harnesses: list[Harness] = []
    for backend, device in targets(backends, devices):
        try:
            harnesses.append(make_harness(backend, device))
        except HarnessUnavailable as exc:
            record(CaseResult("(all cases)", f"{backend}-{device}", "skipped", str(exc)))
    for case in case_functions():
        parameters = inspect.signature(case).parameters
        for suffix, kwargs in expand(case):
            case_id = f"{case.__name__}[{suffix}]" if suffix else case.__name__
            if keyword and keyword not in case_id:
                continue
            if "harness_pair" in parameters:
                for first, second in _pairs(harnesses):
                    target = f"{first.backend}-{first.device}+{second.backend}-{second.device}"
                    record(_run_one(case, case_id, target, {**kwargs, "harness_pair": (first, second)}))
                if not list(_pairs(harnesses)):
                    record(CaseResult(case_id, "(pair)", "skipped", "needs two backends on one device"))
                continue
            for harness in harnesses:
                record(_run_one(case, case_id, f"{harness.backend}-{harness.device}", {**kwargs, "harness": harness}))
    return results


def device_type(device: str) -> str:
    """The device type of a target's device: its last part ("jax-cpu" is a cpu target of a variant)."""
    return device.rpartition("-")[2]


def _pairs(harnesses: Iterable[Harness]) -> Iterable[tuple[Harness, Harness]]:
    for first, second in itertools.combinations(list(harnesses), 2):
        if first.backend != second.backend and device_type(first.device) == device_type(second.device):
            yield first, second


def format_table(results: Sequence[CaseResult], *, width: int = 100) -> str:
    """A plain-text table of the results and a summary line."""
    rows = [("case", "target", "result", "detail")]
    for r in results:
        detail = r.detail.splitlines()[0] if r.detail else ""
        rows.append((r.case, r.target, r.outcome, detail[:width]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}".rstrip() for a, b, c, d in rows]
    lines.insert(1, "-" * min(sum(widths) + 6 + width, 200))
    counts = {outcome: sum(1 for r in results if r.outcome == outcome) for outcome in OUTCOMES}
    lines.append("")
    lines.append(", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n))
    return "\n".join(lines)
