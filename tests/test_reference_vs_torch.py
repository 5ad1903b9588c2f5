"""Property tests: the reference state machine against torch.amp.GradScaler's own update, run side by side."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from polyamp import LossScaleConfig
from polyamp._src.scaling import to_float32

torch = pytest.importorskip("torch")


def run_grad_scaler(config: LossScaleConfig, overflows: list[bool]) -> list[tuple[float, int]]:
    """Drive a real GradScaler on CPU through the pattern: a planted inf gradient marks an overflow."""
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=config.init_scale,
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        growth_interval=config.growth_interval,
    )
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=0.0)
    trace = []
    for overflow in overflows:
        scaler.scale(param.sum()).backward()
        if overflow:
            param.grad[1] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        trace.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return trace


float32_scales = st.floats(min_value=2.0**-20, max_value=2.0**40, allow_nan=False, allow_infinity=False).map(to_float32)
configs = st.builds(
    LossScaleConfig,
    init_scale=float32_scales,
    growth_factor=st.one_of(st.just(2.0), st.floats(min_value=1.0001, max_value=16.0)),
    backoff_factor=st.one_of(st.just(0.5), st.floats(min_value=0.01, max_value=0.9999)),
    growth_interval=st.integers(min_value=1, max_value=6),
)


@settings(max_examples=150, deadline=None)
@given(config=configs, overflows=st.lists(st.booleans(), min_size=1, max_size=40))
def test_reference_matches_grad_scaler_bit_for_bit(config: LossScaleConfig, overflows: list[bool]) -> None:
    """Bit for bit while GradScaler stays at or above polyamp's floor; there polyamp stops and GradScaler goes on."""
    expected = run_grad_scaler(config, overflows)
    states = config.states(overflows)
    floor = config.floor_f32
    for step, ((scale, tracker), state) in enumerate(zip(expected, states, strict=True)):
        if scale < floor:
            assert state.scale == floor, f"step {step}: GradScaler went below the floor, polyamp stops at it"
            break
        assert (state.scale, state.growth_tracker) == (scale, tracker), f"step {step}"


@settings(max_examples=60, deadline=None)
@given(config=configs, overflows=st.lists(st.booleans(), min_size=1, max_size=40))
def test_with_a_floor_below_grad_scalers_range_the_trajectories_are_identical(
    config: LossScaleConfig, overflows: list[bool]
) -> None:
    config = config.replace(min_scale=2.0**-126)  # float32's smallest normal: GradScaler stays above it here
    expected = run_grad_scaler(config, overflows)
    assume(all(scale >= 2.0**-126 for scale, _ in expected))  # below, GradScaler is subnormal, then 0
    assert [(s.scale, s.growth_tracker) for s in config.states(overflows)] == expected


@settings(max_examples=25, deadline=None)
@given(interval=st.integers(min_value=1, max_value=3), steps=st.integers(min_value=1, max_value=12))
def test_reference_matches_grad_scaler_growth_guard_near_float32_max(interval: int, steps: int) -> None:
    config = LossScaleConfig(init_scale=2.0**125, growth_factor=3.0, growth_interval=interval)
    overflows = [False] * steps
    assert [(s.scale, s.growth_tracker) for s in config.states(overflows)] == run_grad_scaler(config, overflows)
