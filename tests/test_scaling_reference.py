"""The pure-Python reference state machine: the worked traces, each rule, each bound, each config error."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from polyamp import InvalidConfigError, LossScaleConfig, LossScaleState, PolyampTypeError
from polyamp._src.scaling import to_float32

FLT_MAX = to_float32(3.4028234663852886e38)


def test_documented_trace_at_interval_3() -> None:
    assert LossScaleConfig(growth_interval=3).trajectory("FFFOFFOOFFFFFF") == [
        65536,
        65536,
        131072,
        65536,
        65536,
        65536,
        32768,
        16384,
        16384,
        16384,
        32768,
        32768,
        32768,
        65536,
    ]


def test_states_carry_counter_and_hysteresis() -> None:
    states = LossScaleConfig(growth_interval=3, hysteresis=2).states("FFOFFFO")
    assert [(s.growth_tracker, s.hysteresis_left) for s in states] == [
        (1, 2),
        (2, 2),
        (0, 1),
        (1, 1),
        (2, 1),
        (0, 2),
        (0, 1),
    ]
    assert [s.scale for s in states] == [65536, 65536, 65536, 65536, 65536, 131072, 131072]


def test_hysteresis_backs_off_on_the_nth_overflow_and_refills() -> None:
    config = LossScaleConfig(init_scale=1024.0, growth_interval=100, hysteresis=3)
    assert config.trajectory("OOOOOOO") == [1024, 1024, 512, 512, 512, 256, 256]


def test_pattern_accepts_booleans() -> None:
    config = LossScaleConfig(growth_interval=2)
    assert config.trajectory([False, False, True]) == config.trajectory("FFO") == [65536, 131072, 65536]


@pytest.mark.parametrize(
    "pattern",
    [[np.array([True, False])], [np.array([True])], [np.array([[False]])], np.array(False)],
    ids=["two_flags_in_one_item", "one_element_array", "nested_array", "zero_d_array"],
)
def test_an_overflow_pattern_takes_only_scalar_flags(pattern: Any) -> None:
    with pytest.raises(PolyampTypeError, match=r"overflow pattern") as caught:
        LossScaleConfig().trajectory(pattern)
    assert "array(" in str(caught.value)


def test_an_overflow_pattern_takes_numpy_bools() -> None:
    config = LossScaleConfig(growth_interval=2)
    assert config.trajectory([np.False_, np.True_]) == config.trajectory("FO") == [65536.0, 32768.0]
    assert config.trajectory(np.array([False, True])) == [65536.0, 32768.0]


def test_min_scale_floors_backoff() -> None:
    config = LossScaleConfig(init_scale=8.0, min_scale=3.0)
    assert config.trajectory("OOOO") == [4.0, 3.0, 3.0, 3.0]


def test_the_default_floor_is_one_or_a_lower_initial_scale() -> None:
    """Without min_scale a backoff stops at 1.0, or at init_scale when that starts below 1: a backoff never
    raises the scale (jmp's floor of 1 would take 0.5 up to 1.0 on an overflow)."""
    assert LossScaleConfig(init_scale=4.0).trajectory("OOOO") == [2.0, 1.0, 1.0, 1.0]
    assert LossScaleConfig(init_scale=0.5).trajectory("OOFO") == [0.5, 0.5, 0.5, 0.5]
    assert LossScaleConfig(init_scale=0.5).floor_f32 == 0.5 and LossScaleConfig().floor_f32 == 1.0
    assert LossScaleConfig(init_scale=0.5, growth_interval=1).trajectory("FO") == [1.0, 0.5]


def test_the_floor_is_1_without_min_scale_and_settings_below_float32s_normals_are_refused() -> None:
    assert LossScaleConfig().floor_f32 == 1.0 and not LossScaleConfig().checks_unscaled
    assert LossScaleConfig(init_scale=0.25).floor_f32 == 0.25
    assert LossScaleConfig(min_scale=2.0**-126).checks_unscaled
    assert LossScaleConfig(backoff_factor=1e-300).trajectory("OO") == [1.0, 1.0]
    for bad in ({"min_scale": 1e-40, "init_scale": 1e-40}, {"init_scale": 1e-45}, {"min_scale": 0.0}):
        with pytest.raises(InvalidConfigError, match="2\\*\\*-126"):
            LossScaleConfig(**bad)


def test_max_scale_caps_growth() -> None:
    config = LossScaleConfig(init_scale=2.0**15, growth_interval=1, max_scale=100_000.0)
    assert config.trajectory("FFF") == [65536.0, 100_000.0, 100_000.0]


def test_growth_never_reaches_inf() -> None:
    config = LossScaleConfig(init_scale=2.0**126, growth_interval=1)
    assert config.trajectory("FFF") == [2.0**127, 2.0**127, 2.0**127]
    states = config.states("FF")
    assert states[-1].growth_tracker == 0  # the counter still resets, as in torch


def test_growth_cap_applies_before_the_finite_guard() -> None:
    config = LossScaleConfig(init_scale=2.0**127, growth_interval=1, max_scale=FLT_MAX)
    assert config.trajectory("F") == [FLT_MAX]


def test_a_devices_ceiling_stops_growth_and_leaves_the_settings_as_they_are() -> None:
    """with_ceiling: growth stops at the lower of max_scale and the ceiling (the rule's other halves unchanged),
    a state above it is refused, and the settings, state dicts and equality stay the config's own; without a
    ceiling growth goes on to 2**127, as torch's GradScaler grows."""
    from polyamp.backend_api.rules import RECIPROCAL_CEILING

    plain = LossScaleConfig(init_scale=2.0**124, growth_interval=1)
    capped = plain.with_ceiling(RECIPROCAL_CEILING)
    assert RECIPROCAL_CEILING == 2.0**126 and 1 / to_float32(RECIPROCAL_CEILING) == 2.0**-126
    assert capped.trajectory("FFFOFF") == [2.0**125, 2.0**126, 2.0**126, 2.0**125, 2.0**126, 2.0**126]
    assert plain.trajectory("FFFOFF") == [2.0**125, 2.0**126, 2.0**127, 2.0**126, 2.0**127, 2.0**127]
    assert capped.after_finite(plain.initial_state(), 5).scale == 2.0**126
    assert capped.finite_run(plain.initial_state(), 3)[0] == [2.0**124, 2.0**125, 2.0**126]
    assert (capped.ceiling_f32, plain.ceiling_f32) == (2.0**126, None)
    assert capped == plain and capped.settings() == plain.settings() and capped.settings()["max_scale"] is None
    assert plain.is_standard_rule and not capped.is_standard_rule
    # Below the ceiling the rule is the config's: a product that would be inf keeps the scale, max_scale caps.
    guard = LossScaleConfig(init_scale=2.0**100, growth_factor=2.0**10, growth_interval=1)
    assert (
        guard.with_ceiling(RECIPROCAL_CEILING).trajectory("FFF")
        == guard.trajectory("FFF")
        == [2.0**110, 2.0**120, 2.0**120]
    )
    bounded = LossScaleConfig(init_scale=2.0**125, growth_interval=1, max_scale=FLT_MAX)
    assert bounded.with_ceiling(RECIPROCAL_CEILING).trajectory("FF") == [2.0**126, 2.0**126]
    with pytest.raises(InvalidConfigError, match=r"scale=1\.7014118346046923e\+38 is above 8\.50705917302346"):
        capped.check_state(LossScaleState(2.0**127))
    plain.check_state(LossScaleState(2.0**127))
    with pytest.raises(InvalidConfigError, match=r"`init_scale` must be at most 8\.507059173023462e\+37 on this"):
        LossScaleConfig(init_scale=2.0**127).with_ceiling(RECIPROCAL_CEILING)


def test_static_scale_never_changes() -> None:
    config = LossScaleConfig(init_scale=128.0, growth_interval=1, dynamic=False)
    states = config.states("FOFOOF")
    assert {s.scale for s in states} == {128.0}
    assert {(s.growth_tracker, s.hysteresis_left) for s in states} == {(0, 1)}


def test_products_round_through_float32_like_torchs_kernel() -> None:
    config = LossScaleConfig(init_scale=1.0, growth_factor=1.1, backoff_factor=0.3, growth_interval=1, min_scale=0.01)
    scales = config.trajectory("FFFOO")
    expected, value = [], 1.0
    for overflow in "FFFOO":
        value = to_float32(value * (0.3 if overflow == "O" else 1.1))
        expected.append(value)
    assert scales == expected
    assert all(to_float32(s) == s for s in scales)
    assert scales[0] != 1.1  # 1.1 is not a float32


def test_init_scale_is_held_in_float32() -> None:
    assert LossScaleConfig(init_scale=0.1).initial_state() == LossScaleState(to_float32(0.1), 0, 1)


def test_to_float32() -> None:
    assert to_float32(1.0) == 1.0
    assert to_float32(0.1) == 0.10000000149011612
    assert to_float32(1e39) == math.inf
    assert to_float32(-1e39) == -math.inf
    assert math.isnan(to_float32(math.nan))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"init_scale": 0.0}, "`init_scale` must be a positive number"),
        ({"init_scale": -1.0}, "`init_scale` must be a positive number"),
        ({"init_scale": math.inf}, "`init_scale` must be a positive number"),
        ({"init_scale": math.nan}, "`init_scale` must be a positive number"),
        ({"init_scale": 1e39}, "representable in float32"),
        ({"init_scale": 1e-50}, "representable in float32"),
        ({"growth_factor": 1.0}, "`growth_factor` must be a finite number > 1"),
        ({"growth_factor": 0.5}, "`growth_factor` must be a finite number > 1"),
        ({"growth_factor": math.inf}, "`growth_factor` must be a finite number > 1"),
        ({"backoff_factor": 1.0}, "`backoff_factor` must be in the open interval (0, 1)"),
        ({"backoff_factor": 0.0}, "`backoff_factor` must be in the open interval (0, 1)"),
        ({"backoff_factor": math.nan}, "`backoff_factor` must be in the open interval (0, 1)"),
        ({"growth_interval": 0}, "`growth_interval` must be an int in [1, 2147483647]"),
        ({"growth_interval": 2**31}, "`growth_interval` must be an int in [1, 2147483647]"),
        ({"hysteresis": 0}, "`hysteresis` must be an int in [1, 2147483647]"),
        ({"min_scale": 0.0}, "`min_scale` must be None or a positive number"),
        ({"max_scale": math.inf}, "`max_scale` must be None or a positive number"),
        ({"min_scale": 10.0, "max_scale": 5.0, "init_scale": 7.0}, "`min_scale` must not exceed `max_scale`"),
        ({"min_scale": 2.0**17}, "`init_scale` must be at least `min_scale`"),
        ({"max_scale": 2.0**15}, "`init_scale` must be at most `max_scale`"),
    ],
)
def test_invalid_values_raise_value_errors_naming_the_value(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidConfigError) as info:
        LossScaleConfig(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert "Received" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"init_scale": "65536"}, "`init_scale` must be a real number"),
        ({"init_scale": True}, "`init_scale` must be a real number"),
        ({"growth_factor": None}, "`growth_factor` must be a real number"),
        ({"growth_interval": 2000.0}, "`growth_interval` must be an int"),
        ({"growth_interval": True}, "`growth_interval` must be an int"),
        ({"hysteresis": "2"}, "`hysteresis` must be an int"),
        ({"min_scale": "1"}, "`min_scale` must be a real number"),
        ({"dynamic": 1}, "`dynamic` must be a bool"),
    ],
)
def test_wrong_types_raise_type_errors(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(PolyampTypeError) as info:
        LossScaleConfig(**kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert isinstance(info.value, TypeError)


def test_numeric_settings_are_normalised_to_plain_python() -> None:
    config = LossScaleConfig(init_scale=1024, growth_interval=True.__int__() + 9, min_scale=1)
    assert type(config.init_scale) is float and type(config.min_scale) is float
    assert type(config.growth_interval) is int


@pytest.mark.parametrize(
    ("state", "fragment"),
    [
        (LossScaleState(0.0, 0, 1), "finite positive"),
        (LossScaleState(math.inf, 0, 1), "finite positive"),
        (LossScaleState(1.0, 10, 1), "growth tracker must be in [0, growth_interval=10)"),
        (LossScaleState(1.0, -1, 1), "growth tracker"),
        (LossScaleState(1.0, 0, 3), "hysteresis_left must be in [1, hysteresis=2]"),
        (LossScaleState(1.0, 0, 0), "hysteresis_left"),
        (LossScaleState(0.25, 0, 1), "below min_scale"),
        (LossScaleState(2.0**20, 0, 1), "above max_scale"),
    ],
)
def test_check_state_rejects_impossible_states(state: LossScaleState, fragment: str) -> None:
    config = LossScaleConfig(init_scale=1.0, growth_interval=10, hysteresis=2, min_scale=0.5, max_scale=2.0**19)
    with pytest.raises(InvalidConfigError) as info:
        config.check_state(state)
    assert fragment in str(info.value)


def test_is_standard_rule() -> None:
    assert LossScaleConfig().is_standard_rule
    assert not LossScaleConfig(hysteresis=2).is_standard_rule
    assert not LossScaleConfig(min_scale=1.0).is_standard_rule
    assert not LossScaleConfig(dynamic=False).is_standard_rule


def test_bad_pattern_characters() -> None:
    with pytest.raises(InvalidConfigError, match=r"only 'F' .* and 'O'"):
        LossScaleConfig().trajectory("FFX")
