"""The device rules of `polyamp._src.rules`, over NumPy, against the host references they implement:
`LossScaleConfig.next_state`, `SpikeRule.decide` and the records' decoding of step codes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polyamp import LossScaleConfig, SpikeRule
from polyamp._src import rules
from polyamp._src.records import MODE_CODES, REBASE_BIT, SPIKE_BIT, Recorder

OPS = rules.ArrayOps(np)

# NumPy warns where the devices silently give inf (a product or square beyond the range), as the rules expect
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


class _Float32Only(rules.ArrayOps):
    """A namespace that computes no 64-bit types (as JAX by default)."""

    @property
    def has_float64(self) -> bool:
        return False

    @property
    def has_int64(self) -> bool:
        return False

    def float64(self) -> None:
        return None


def _arrays(state: object, tracker_dtype: type = np.int32) -> rules.ScaleArrays:
    return rules.ScaleArrays(
        np.asarray(state.scale, np.float32),  # type: ignore[attr-defined]
        np.asarray(state.growth_tracker, tracker_dtype),  # type: ignore[attr-defined]
        np.asarray(state.hysteresis_left, np.int32),  # type: ignore[attr-defined]
    )


def _host(arrays: rules.ScaleArrays) -> tuple[float, int, int]:
    return float(arrays.scale), int(arrays.growth_tracker), int(arrays.hysteresis_left)


configs = st.builds(
    LossScaleConfig,
    init_scale=st.sampled_from([1.0, 3.0, 2.0**10, 2.0**16, 1e38]),
    growth_factor=st.sampled_from([2.0, 3.0, 1.1, 1.0001]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.3, 0.999]),
    growth_interval=st.integers(1, 5),
    hysteresis=st.integers(1, 3),
    max_scale=st.sampled_from([None, 1e38, 3.4e38]),
    dynamic=st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(config=configs, pattern=st.lists(st.booleans(), min_size=1, max_size=60))
def test_advance_follows_the_reference_step_by_step(config: LossScaleConfig, pattern: list[bool]) -> None:
    state = config.initial_state()
    arrays = _arrays(state)
    for overflow in pattern:
        state = config.next_state(state, overflow)
        arrays = rules.advance(OPS, config, arrays, np.asarray(overflow))
        assert _host(arrays) == (state.scale, state.growth_tracker, state.hysteresis_left)
        assert arrays.scale.dtype == np.float32
        assert arrays.growth_tracker.dtype == np.int32
        assert arrays.hysteresis_left.dtype == np.int32


@settings(max_examples=60, deadline=None)
@given(config=configs, pattern=st.lists(st.booleans(), min_size=1, max_size=40))
def test_the_halves_a_branching_backend_calls_compose_to_advance(config: LossScaleConfig, pattern: list[bool]) -> None:
    """A backend that branches (on the flag, then on `at_interval`) reaches `advance`'s state, and keeps an
    int64 tracker int64 (Keras's step counter)."""
    selected = branched = _arrays(config.initial_state(), np.int64)
    for overflow in pattern:
        selected = rules.advance(OPS, config, selected, np.asarray(overflow))
        if not config.dynamic:
            continue
        if overflow:
            branched = rules.after_overflow(OPS, config, branched)
        elif bool(rules.at_interval(OPS, config, branched)):
            branched = rules.after_growth(OPS, config, branched)
        else:
            branched = rules.after_count(OPS, config, branched)
        assert _host(branched) == _host(selected)
        assert branched.growth_tracker.dtype == np.int64


def test_a_factor_float32_cannot_hold_is_multiplied_in_float64_then_rounded() -> None:
    scale = np.asarray(3.0, np.float32)
    exact = np.float32(np.float64(3.0) * 1.1)  # the reference's rounding
    float32_product = np.float32(3.0) * np.float32(1.1)
    assert exact != float32_product  # the case the float64 product exists for
    assert rules.times(OPS, scale, 1.1) == exact
    assert rules.times(_Float32Only(np), scale, 1.1) == float32_product
    assert rules.times(OPS, scale, 1.1).dtype == np.float32


def test_growth_is_capped_and_never_reaches_inf() -> None:
    capped = LossScaleConfig(init_scale=2.0**20, max_scale=3.0 * 2**19)
    assert float(rules.grown(OPS, capped, np.float32(2.0**20))) == 3.0 * 2**19
    uncapped = LossScaleConfig()
    top = np.float32(2.0**127)
    assert float(rules.grown(OPS, uncapped, top)) == 2.0**127  # 2**128 is inf in float32: kept


def test_back_off_stops_at_the_floor() -> None:
    assert float(rules.backed_off(OPS, LossScaleConfig(init_scale=8.0, min_scale=3.0), np.float32(4.0))) == 3.0
    assert float(rules.backed_off(OPS, LossScaleConfig(), np.float32(1.0))) == 1.0  # the default floor


def _window(rule: SpikeRule) -> rules.SpikeWindowArrays:
    return rules.SpikeWindowArrays(np.zeros(rule.window, np.float64), np.asarray(0, np.int64), np.asarray(0, np.int64))


spike_rules = st.builds(
    SpikeRule,
    on=st.sampled_from(["loss", "grad_norm"]),
    window=st.integers(2, 6),
    threshold=st.sampled_from([0.5, 1.0, 3.0]),
    warmup=st.sampled_from([None, 2]),
    two_sided=st.booleans(),
    max_consecutive=st.sampled_from(["auto", None, 1, 3]),
)
statistics = st.one_of(
    st.floats(-4.0, 4.0), st.sampled_from([0.0, 100.0, -100.0, math.inf, -math.inf, math.nan, 1e200])
)


@settings(max_examples=150, deadline=None)
@given(
    rule=spike_rules,
    trace=st.lists(st.tuples(statistics, st.booleans()), max_size=40),
)
def test_the_spike_rule_decides_and_rebases_as_the_reference(rule: SpikeRule, trace: list[tuple[float, bool]]) -> None:
    values = [x for x, _ in trace]
    overflows = [o for _, o in trace]
    expected = list(zip(rule.decide(values, overflows), rule.rebased(values, overflows), strict=True))
    window = _window(rule)
    for (x, overflow), (spike, rebase) in zip(trace, expected, strict=True):
        statistic = np.asarray(x, np.float64)
        decided = rules.is_spike(OPS, rule, window, statistic) & ~np.asarray(overflow)
        assert bool(decided) == spike
        window, only, rebased = rules.finish(OPS, rule, window, statistic, decided, np.asarray(overflow))
        assert bool(only) == (spike and not overflow)
        assert bool(rebased) == rebase


def test_spike_statistics_in_float64_or_float32_without_it() -> None:
    loss = [np.asarray([1.5, 2.5], np.float32), np.asarray(3.0, np.float16)]
    assert rules.loss_statistic(OPS, loss) == 7.0
    assert rules.loss_statistic(OPS, loss).dtype == np.float64
    assert rules.loss_statistic(_Float32Only(np), loss).dtype == np.float32
    grads = [np.asarray([3.0], np.float16), None, np.asarray([[4.0]], np.float32)]
    assert rules.grad_norm(OPS, grads) == 5.0
    assert rules.grad_norm(OPS, [None]) == 0.0


@pytest.mark.parametrize(
    ("mode", "overflow", "spike", "skipped", "reason"),
    [
        ("scaling", None, None, False, None),
        ("scaling", False, None, False, None),
        ("scaling", True, None, True, "overflow"),
        ("guarding", True, None, True, "non_finite"),
        ("off", None, None, False, None),
        ("scaling", False, 1.0, True, "loss_spike"),
        ("scaling", True, 0.0, True, "overflow"),
        ("scaling", False, -1.0, False, None),
        ("guarding", False, 1.0, True, "loss_spike"),
    ],
)
def test_record_codes_read_back_as_the_records_they_encode(
    mode: str, overflow: bool | None, spike: float | None, skipped: bool, reason: str | None
) -> None:
    code = rules.record_code(
        OPS,
        MODE_CODES[mode],
        None if overflow is None else np.asarray(overflow),
        None if spike is None else np.asarray(spike, np.float32),
    )
    assert code.dtype == np.int32
    expected = MODE_CODES[mode] + int(skipped) + (SPIKE_BIT if reason == "loss_spike" else 0)
    assert int(code) == expected + (REBASE_BIT if spike == -1.0 else 0)
    recorder = Recorder(8, "warn", "loss_spike")
    config = LossScaleConfig()
    recorder.reanchor(config.initial_state())
    recorder.consume(1, [int(code)], config, config.initial_state)
    (record,) = recorder.records
    assert (record.skipped, record.reason, record.mode) == (skipped, reason, mode)


def test_record_codes_of_a_batch_in_one_call() -> None:
    """A backend that reads its flags to the host in a batch encodes them there with NumPy at once."""
    codes = rules.record_code(
        OPS,
        np.asarray([0, 0, 2, 0]),
        np.asarray([False, True, True, False]),
        np.asarray([0.0, 0.0, 0.0, 1.0], np.float32),
    )
    assert codes.tolist() == [0, 1, 3, 1 + SPIKE_BIT]


def test_non_finite_counts() -> None:
    values = np.asarray([[np.inf, 1.0, np.nan], [-np.inf, np.inf, 0.0]], np.float16)
    counts = rules.non_finite_counts(OPS, values)
    assert counts.tolist() == [2, 1, 1]
    assert counts.dtype == np.int64
    assert rules.non_finite_counts(_Float32Only(np), values).dtype == np.int32
