"""`polyamp.FunctionalLossScaler` with the guard, the step records and the spike rule, on the NumPy backend npfw.

For random sequences of losses, gradient sizes and planted inf/NaN gradients, scaling (``enabled=True``) and
guarding (``enabled=False, guard=True``), with and without a `polyamp.SpikeRule` (on the loss and on the
gradient norm, ``max_consecutive`` included), the functional form (state in, state out) and the stateful
`polyamp.LossScaler` give the same scales, skip decisions, records, skip counts, state dicts and parameters,
and a skipped step leaves the parameters as they were. ``FunctionalLossScaler.init`` starts only from a state
the rule can reach.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import polyamp  # noqa: E402
from polyamp import (  # noqa: E402
    FunctionalLossScaler,
    InvalidConfigError,
    LossScaleConfig,
    LossScaleState,
    PolyampTypeError,
    SpikeRule,
)
from polyamp.backend_api import FunctionalGuardingDevice  # noqa: E402

if TYPE_CHECKING:
    from conftest import NumpyBackend

PROPERTY = settings(
    max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
#: The shapes of npfw.mlp's parameters.
SHAPES = ((8, 16), (16,), (16, 4), (4,))
#: Losses exact in float32: plateaus, dips and spikes.
VALUES = (0.5, 0.75, 1.0, 1.0, 1.25, 2.0, 4.0, 16.0)
#: Gradient entries (before scaling); 64.0 makes gradient-norm spikes.
MAGNITUDES = (0.01, 0.01, 0.02, 0.05, 64.0)

#: One iteration: (loss, gradient entry, planted value: None, "inf" or "nan").
Step = tuple[float, float, str | None]


@pytest.fixture(scope="module")
def npfw(numpy_backend: NumpyBackend) -> Iterator[Any]:
    with numpy_backend("npfw"):
        yield sys.modules["npfw"]


@st.composite
def rules(draw: Any, on: str | None) -> SpikeRule | None:
    if on is None:
        return None
    window = draw(st.integers(2, 5))
    return SpikeRule(
        on,
        window=window,
        threshold=draw(st.sampled_from((0.5, 1.0, 2.0, 3.0))),
        warmup=draw(st.integers(2, window)),
        two_sided=draw(st.booleans()),
        max_consecutive=draw(st.sampled_from(("auto", None, 1, 2))),
    )


@st.composite
def sequences(draw: Any) -> list[Step]:
    length = draw(st.integers(1, 16))
    return [
        (
            draw(st.sampled_from(VALUES)),
            draw(st.sampled_from(MAGNITUDES)),
            draw(st.sampled_from((None, None, None, None, "inf", "nan"))),
        )
        for _ in range(length)
    ]


configs = st.fixed_dictionaries(
    {
        "init_scale": st.sampled_from((1.0, 4.0, 2.0**16)),
        "growth_interval": st.integers(1, 3),
        "hysteresis": st.integers(1, 2),
    }
)


def _grads(magnitude: float, planted: str | None, upstream: float) -> list[np.ndarray]:
    grads = [np.full(shape, magnitude * upstream, np.float32) for shape in SHAPES]
    if planted is not None:
        grads[0].reshape(-1)[0] = np.inf if planted == "inf" else np.nan
    return grads


def _options(mode: str, rule: SpikeRule | None, config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    guarding = mode == "guarding"
    return {"enabled": not guarding, "guard": True if guarding else None, "spike": rule, **config, **extra}


def _record_tuple(record: polyamp.StepRecord) -> tuple[Any, ...]:
    return (
        record.iteration,
        record.skipped,
        record.reason,
        record.mode,
        record.scale,
        record.next_scale,
        record.rebased,
    )


class Stateful:
    """The stateful LossScaler's loop on npfw, one iteration per `step`."""

    def __init__(self, npfw: Any, options: dict[str, Any]) -> None:
        self.npfw = npfw
        self.scaler = polyamp.LossScaler(**options, backend="npfw")
        self.params = npfw.mlp(0)
        self.opt = npfw.SGD(self.params, lr=0.1, momentum=0.9)

    def step(self, value: float, magnitude: float, planted: str | None) -> bool:
        self.opt.zero_grad()

        def backward(upstream: float) -> None:
            for param, grad in zip(self.params, _grads(magnitude, planted, upstream)):
                param.grad = grad

        self.scaler.scale(self.npfw.Tensor(value, backward)).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return bool(self.scaler.step_skipped(self.opt))

    def arrays(self) -> list[np.ndarray]:
        return [p.data.copy() for p in self.params]


class Functional:
    """The same loop through the functional form: SGD with momentum as a pure function, stepped by
    `FunctionalLossScaler.step` (or, ``by_parts``, by its parts in the same order)."""

    def __init__(self, npfw: Any, options: dict[str, Any], *, by_parts: bool = False) -> None:
        self.fn = polyamp.LossScaler(**options).functional(backend="npfw")
        self.state = self.fn.init()
        self.params = [p.data.copy() for p in npfw.mlp(0)]
        self.momentum = [np.zeros_like(a) for a in self.params]
        self.by_parts = by_parts

    def _sgd(self, grads: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        momentum = [(np.float32(0.9) * m + g).astype(np.float32) for m, g in zip(self.momentum, grads)]
        params = [(a - np.float32(0.1) * m).astype(np.float32) for a, m in zip(self.params, momentum)]
        return params, momentum

    def step(self, value: float, magnitude: float, planted: str | None) -> bool:
        fn, state = self.fn, self.state
        upstream = float(fn.scale(state, 1.0))  # d(scaled loss)/d(loss)
        scaled = _grads(magnitude, planted, upstream)
        if self.by_parts:
            grads, found_inf = fn.unscale(state, scaled)
            spike = fn.spike(state, loss=value, grads=grads)
            self.params, self.momentum = fn.apply_if_finite(
                found_inf, self._sgd(grads), (self.params, self.momentum), spike=spike
            )
            self.state = fn.update(state, found_inf, spike=spike)
            skipped = fn.skipped(found_inf, spike)
        else:
            old = (self.params, self.momentum)
            out = fn.step(state, scaled, self._sgd, lambda applied: old, loss=value)
            (self.params, self.momentum), self.state, skipped = out.result, out.state, out.skipped
        return skipped is not None and bool(skipped > 0)

    def arrays(self) -> list[np.ndarray]:
        return [a.copy() for a in self.params]


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]


def _run_both(npfw: Any, options: dict[str, Any], steps: list[Step]) -> tuple[Stateful, Functional, list[bool]]:
    """The stateful loop and the functional one (`FunctionalLossScaler.step`, and its parts composed by hand)
    over ``steps``, checked equal at every step."""
    stateful, functional = Stateful(npfw, options), Functional(npfw, options)
    parts = Functional(npfw, options, by_parts=True)
    skips = []
    for value, magnitude, planted in steps:
        before = functional.arrays()
        skipped = stateful.step(value, magnitude, planted)
        assert functional.step(value, magnitude, planted) == skipped
        assert parts.step(value, magnitude, planted) == skipped
        skips.append(skipped)
        saved = stateful.scaler.state_dict()
        assert functional.fn.state_dict(functional.state) == saved
        assert parts.fn.state_dict(parts.state) == saved
        assert int(functional.fn.skipped_steps(functional.state)) == saved["skipped_steps"]
        after = functional.arrays()
        for mine, by_hand, theirs in zip(after, parts.arrays(), stateful.arrays()):
            np.testing.assert_array_equal(mine, theirs)
            np.testing.assert_array_equal(by_hand, theirs)
        if skipped:
            for mine, old in zip(after, before):
                np.testing.assert_array_equal(mine, old)
        # only arrays travel in the state: a jitted step can take and return it
        assert all(isinstance(leaf, (np.ndarray, np.generic)) for leaf in _leaves(functional.state))
    return stateful, functional, skips


def over_modes_and_rules(test: Callable[..., None]) -> Callable[..., None]:
    """A property over drawn runs (``steps``) and settings (``config``), for each mode and each quantity a spike
    rule watches (``on``; None: no rule), the rule drawn with ``data`` (`_drawn_options`)."""
    drawn = PROPERTY(given(data=st.data(), steps=sequences(), config=configs)(test))
    by_mode = pytest.mark.parametrize("mode", ["scaling", "guarding"])(drawn)
    return pytest.mark.parametrize("on", [None, "loss", "grad_norm"])(by_mode)


def _drawn_options(data: Any, mode: str, on: str | None, config: dict[str, Any]) -> tuple[SpikeRule | None, Any]:
    """A rule watching ``on`` drawn with ``data``, and the scaler options of ``mode`` with it and ``config``."""
    rule = data.draw(rules(on))
    return rule, _options(mode, rule, config)


@over_modes_and_rules
def test_functional_form_equals_the_loss_scaler(
    npfw: Any, mode: str, on: str | None, data: Any, steps: list[Step], config: dict[str, Any]
) -> None:
    rule, options = _drawn_options(data, mode, on, config)
    stateful, functional, skips = _run_both(npfw, options, steps)
    fn, state = functional.fn, functional.state
    assert fn.mode == mode
    got = [_record_tuple(r) for r in fn.records(state)]
    assert got == [_record_tuple(r) for r in stateful.scaler.records()]
    assert int(fn.skipped_steps(state)) == int(stateful.scaler.skipped_steps()) == sum(skips)
    overflows = [planted is not None for _, _, planted in steps]
    assert [r[1] for r in got] == skips
    assert [r[0] for r in got] == list(range(len(steps)))
    assert {r[3] for r in got} <= {mode}
    if mode == "scaling":  # the loss-scale rule sees overflows only, never spikes
        reference = LossScaleConfig(**config)
        states = [reference.initial_state(), *reference.states("".join("O" if o else "F" for o in overflows))]
        assert [(r[4], r[5]) for r in got] == [(a.scale, b.scale) for a, b in itertools.pairwise(states)]
    else:
        assert all(r[4] is None and r[5] is None for r in got)
    if rule is not None and rule.on == "loss":  # the rule's reference over the same trace
        spikes = rule.decide([value for value, _, _ in steps], overflows)
        rebased = rule.rebased([value for value, _, _ in steps], overflows)
        overflow = "overflow" if mode == "scaling" else "non_finite"
        assert [r[2] for r in got] == [
            overflow if o else "loss_spike" if s else None for s, o in zip(spikes, overflows)
        ]
        assert [r[6] for r in got] == rebased
    if rule is None:
        assert "spike_window" not in fn.state_dict(state)


@over_modes_and_rules
def test_a_state_dict_resumes_across_the_two_forms(
    npfw: Any, mode: str, on: str | None, data: Any, steps: list[Step], config: dict[str, Any]
) -> None:
    """Half a run on one form, saved, resumed on the other: the same state dicts as one uninterrupted run."""
    _, options = _drawn_options(data, mode, on, config)
    half = len(steps) // 2
    whole = Stateful(npfw, options)
    for step in steps:
        whole.step(*step)
    stateful = Stateful(npfw, options)
    for step in steps[:half]:
        stateful.step(*step)
    functional = Functional(npfw, options)
    functional.state = functional.fn.load_state_dict(stateful.scaler.state_dict())
    assert functional.fn.state_dict(functional.state) == stateful.scaler.state_dict()
    functional.params = stateful.arrays()
    for step in steps[half:]:
        functional.step(*step)
    assert functional.fn.state_dict(functional.state) == whole.scaler.state_dict()
    back = Stateful(npfw, options)
    back.scaler.load_state_dict(functional.fn.state_dict(functional.state))
    assert back.scaler.state_dict() == whole.scaler.state_dict()


def test_records_of_a_worked_sequence(npfw: Any) -> None:
    """Exact records of a scaling run with a loss rule: an overflow, a spike, then a level shift that re-bases."""
    rule = SpikeRule("loss", window=3, warmup=3, threshold=2.0, max_consecutive=2)
    options = _options("scaling", rule, {"init_scale": 4.0, "growth_interval": 2, "hysteresis": 1})
    losses = [1.0, 1.25, 0.75, 1.0, 16.0, 1.0, 8.0, 8.0, 8.0, 1.0]
    planted = [None, None, None, "inf", None, None, None, None, None, None]
    stateful, functional, _ = _run_both(npfw, options, [(v, 0.01, p) for v, p in zip(losses, planted)])
    got = [_record_tuple(r) for r in functional.fn.records(functional.state)]
    assert got == [
        (0, False, None, "scaling", 4.0, 4.0, False),
        (1, False, None, "scaling", 4.0, 8.0, False),
        (2, False, None, "scaling", 8.0, 8.0, False),
        (3, True, "overflow", "scaling", 8.0, 4.0, False),
        (4, True, "loss_spike", "scaling", 4.0, 4.0, False),
        (5, False, None, "scaling", 4.0, 8.0, False),
        (6, True, "loss_spike", "scaling", 8.0, 8.0, False),
        (7, True, "loss_spike", "scaling", 8.0, 16.0, False),
        (8, False, None, "scaling", 16.0, 16.0, True),
        (9, False, None, "scaling", 16.0, 32.0, False),
    ]
    saved = functional.fn.state_dict(functional.state)
    assert (saved["spike_window"], saved["spike_run"]) == ([8.0, 1.0], 0)
    assert int(functional.fn.skipped_steps(functional.state)) == 4
    assert got == [_record_tuple(r) for r in stateful.scaler.records()]


def test_the_ring_keeps_history_codes_and_says_how_many_were_lost(npfw: Any, caplog: pytest.LogCaptureFixture) -> None:
    options = _options("guarding", None, {}, history=4)
    read_often = Functional(npfw, options)
    read_late = Functional(npfw, options)
    steps = [(1.0, 0.01, "nan" if i in (2, 7) else None) for i in range(10)]
    kept = []
    for step in steps:
        read_often.step(*step)
        read_late.step(*step)
        kept = read_often.fn.records(read_often.state)
    assert [(r.iteration, r.skipped, r.reason) for r in kept] == [
        (6, False, None),
        (7, True, "non_finite"),
        (8, False, None),
        (9, False, None),
    ]
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        late = read_late.fn.records(read_late.state)
    assert [(r.iteration, r.skipped) for r in late] == [(6, False), (7, True), (8, False), (9, False)]
    assert "6 iterations ended without being recorded" in caplog.text
    assert int(read_late.fn.skipped_steps(read_late.state)) == 2


def test_records_read_by_many_threads_at_once_report_each_event_once(
    npfw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An overflow at scale 2 takes the scale to its floor, 1.0 (the collapse warning); the next steps grow it
    # back (which re-arms the warning). Eight threads, released together, read the records. Each is held at the
    # first record it reports until every thread has got there or to the run books' lock, then they go on one at
    # a time, in the order they got there: readers that took the ring's codes into the books without holding the
    # lock would each report the same entries, and warn each time.
    readers = 8
    functional = Functional(npfw, _options("scaling", None, {"init_scale": 2.0, "growth_interval": 1}))
    for step in [(1.0, 0.01, "inf"), (1.0, 0.01, None), (1.0, 0.01, None)]:
        functional.step(*step)
    fn, state = functional.fn, functional.state
    books = fn._books
    (recorder,) = [book.recorder for book in books._books.values() if book.recorder.read_count == 0]
    report = recorder._report
    condition = threading.Condition()
    arrived: set[int] = set()  # the threads at the window or at the lock
    order: list[int] = []  # the threads at the window, in the order they got there
    finished = [0]
    stuck: list[int] = []

    def arrive() -> None:
        with condition:
            arrived.add(threading.get_ident())
            condition.notify_all()

    def held_report(record: Any, config: Any) -> None:
        me = threading.get_ident()
        if me not in order:
            with condition:
                order.append(me)
                arrived.add(me)
                condition.notify_all()
                if not condition.wait_for(lambda: len(arrived) == readers and finished[0] == order.index(me), 30):
                    stuck.append(me)
        report(record, config)

    class CountingLock:
        """The recorder's lock, noting each thread that comes to it."""

        def __init__(self, lock: Any) -> None:
            self.lock = lock

        def __enter__(self) -> Any:
            arrive()
            return self.lock.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return self.lock.__exit__(*exc)

    monkeypatch.setattr(recorder, "_report", held_report)
    monkeypatch.setattr(books, "_lock", CountingLock(getattr(books, "_lock", threading.RLock())), raising=False)
    warnings: list[str] = []

    class Collapses(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "loss scale collapsed" in record.getMessage():
                warnings.append(record.getMessage())

    handler = Collapses()
    logging.getLogger("polyamp").addHandler(handler)
    barrier = threading.Barrier(readers)
    seen: list[list[tuple[int, bool]]] = []

    def read() -> None:
        barrier.wait()
        records = fn.records(state)
        with condition:
            seen.append([(r.iteration, r.skipped) for r in records])
            finished[0] += 1
            condition.notify_all()

    threads = [threading.Thread(target=read) for _ in range(readers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        logging.getLogger("polyamp").removeHandler(handler)
    assert stuck == [] and len(seen) == readers
    assert len(warnings) == 1, warnings
    assert all(records == [(0, True), (1, False), (2, False)] for records in seen)
    assert [r.next_scale for r in fn.records(state)] == [1.0, 2.0, 4.0]


def test_without_scaling_or_guard_everything_passes_through_and_is_recorded_off(npfw: Any) -> None:
    rule = SpikeRule("loss", window=2)
    functional = Functional(npfw, {"enabled": False, "guard": False, "spike": rule})
    fn = functional.fn
    assert fn.mode == "off"
    grads = _grads(0.01, "inf", 1.0)
    assert fn.unscale(functional.state, grads) == (grads, None)
    assert fn.spike(functional.state, loss=1.0) is None
    for value in (1.0, 16.0):
        assert functional.step(value, 0.01, "inf") is False
    assert [(r.skipped, r.mode, r.scale) for r in fn.records(functional.state)] == [(False, "off", None)] * 2
    assert fn.state_dict(functional.state)["spike_window"] == []


def test_misuse_says_what_was_received_and_what_to_pass(npfw: Any) -> None:
    fn = polyamp.LossScaler(enabled=True, spike=SpikeRule("loss", window=2)).functional(backend="npfw")
    state = fn.init()
    grads, found_inf = fn.unscale(state, _grads(0.01, None, 65536.0))
    with pytest.raises(polyamp.ScalerUsageError, match="needs spike=: this scaler has a SpikeRule"):
        fn.update(state, found_inf)
    with pytest.raises(polyamp.ScalerUsageError, match="needs loss=: the SpikeRule watches the loss"):
        fn.spike(state, grads=grads)
    with pytest.raises(polyamp.PolyampTypeError, match="takes the state init\\(\\)"):
        fn.scale(state["scaler"], 1.0)
    plain = polyamp.LossScaler(enabled=True).functional(backend="npfw")
    with pytest.raises(polyamp.ScalerUsageError, match="received found_inf=None, but these functions are scaling"):
        plain.update(plain.init(), None)
    with pytest.raises(polyamp.PolyampTypeError, match="takes None for a scaler without a SpikeRule"):
        plain.update(plain.init(), found_inf, spike=fn.spike(state, loss=1.0))


class _Unguarded:
    """A functional device offering only `FunctionalDevice` (npfw's, without its optional protocols)."""

    METHODS = ("init", "read", "skipped_count", "scale", "unscale", "update", "select")

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name in self.METHODS:
            return getattr(self._inner, name)
        raise AttributeError(name)


def test_a_device_without_the_protocols_refuses_what_it_cannot_do(npfw: Any) -> None:
    import polyamp_npfw

    def make(config: LossScaleConfig) -> _Unguarded:
        return _Unguarded(polyamp_npfw.NumpyFunctional(config))

    config = LossScaleConfig()
    assert not isinstance(make(config), FunctionalGuardingDevice)
    with pytest.raises(polyamp.PolyampTypeError, match="guard=True, but the 'mine' backend's functional form"):
        FunctionalLossScaler(make, config, False, setting=False, guard=True, backend="mine")
    with pytest.raises(polyamp.PolyampTypeError, match="cannot apply a SpikeRule"):
        FunctionalLossScaler(make, config, True, spike=SpikeRule("loss"), backend="mine")
    policy_off = FunctionalLossScaler(make, config, False, setting=None, backend="mine")  # guard=None: off
    assert policy_off.mode == "off"
    fn = FunctionalLossScaler(make, config, True)
    state = fn.init()
    assert set(state) == {"scaler"} and fn.records(state) == []
    _, found_inf = fn.unscale(state, _grads(0.01, "inf", 65536.0))
    state = fn.update(state, found_inf)
    assert fn.read(state) == config.next_state(config.initial_state(), True)
    assert int(fn.skipped_steps(state)) == 1


# -- FunctionalLossScaler.init: the state a run starts from ------------------------------------------------------


class _StubDevice:
    """A functional device that hands back the host state it is initialised with."""

    def init(self, state: LossScaleState) -> LossScaleState:
        return state


def _functional(**settings: Any) -> FunctionalLossScaler:
    stub: Any = lambda config: _StubDevice()  # noqa: E731 - a FunctionalDevice factory for init() alone
    return FunctionalLossScaler(stub, LossScaleConfig(**settings), True)


@pytest.mark.parametrize(
    ("state", "fragment"),
    [
        (LossScaleState(math.nan), "finite positive number representable in float32. Received: scale=nan"),
        (LossScaleState(0.0), "Received: scale=0.0"),
        (LossScaleState(math.inf), "Received: scale=inf"),
        (LossScaleState(-2.0), "Received: scale=-2.0"),
        (LossScaleState(1e39), "Received: scale=1e+39"),  # finite in float64, inf in float32
        (LossScaleState(1e-40), "scale=1e-40 is below min_scale"),  # a float32 subnormal
        (LossScaleState(1024.0, growth_tracker=2000), "growth tracker must be in [0, growth_interval=2000)"),
        (LossScaleState(1024.0, hysteresis_left=0), "hysteresis_left must be in [1, hysteresis=1]"),
    ],
)
def test_functional_init_refuses_impossible_states(state: LossScaleState, fragment: str) -> None:
    with pytest.raises(InvalidConfigError) as caught:
        _functional().init(state)
    assert "FunctionalLossScaler.init() cannot start from this state" in str(caught.value)
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    "state",
    [LossScaleState("1024"), LossScaleState(1024.0, growth_tracker=1.5), 1024.0],  # type: ignore[arg-type]
    ids=["str_scale", "float_tracker", "not_a_state"],
)
def test_functional_init_refuses_wrong_types(state: Any) -> None:
    with pytest.raises(PolyampTypeError, match=r"FunctionalLossScaler\.init"):
        _functional().init(state)


def test_functional_init_takes_a_valid_state_rounded_to_float32() -> None:
    functional = _functional(hysteresis=2, min_scale=0.5)
    # the state's "scaler" entry is what the device made from the (validated, rounded) host state
    assert functional.init(LossScaleState(np.float64(3.0000001), 5, 2))["scaler"] == LossScaleState(3.0, 5, 2)
    assert functional.init()["scaler"] == LossScaleState(65536.0, 0, 2)
