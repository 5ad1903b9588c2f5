"""Hostile arguments and failed calls: a bad setting, state dict or call is a PolyampError of the right built-in
that changes nothing, and a scaler whose call was refused carries on (or is brought back) as if it had not run.
"""

from __future__ import annotations

import copy
import decimal
import json
import math
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polyamp import (
    InvalidConfigError,
    LossScaleConfig,
    LossScaler,
    PolyampError,
    PolyampTypeError,
    PolyampValueError,
    ScalerUsageError,
    StateDictError,
)
from polyamp.backend_api import BackendSpec
from polyamp.backend_api.policies import PolicyOverrides


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: LossScaler(init_scale=10**400), InvalidConfigError),
        (lambda: LossScaler(growth_factor=10**400), InvalidConfigError),
        (lambda: LossScaleConfig(max_scale=-(10**400)), InvalidConfigError),
        (lambda: LossScaleConfig().trajectory(5), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: LossScaleConfig().trajectory((2.0,)), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: PolicyOverrides().resolve(3), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: PolicyOverrides({"head": None}), PolyampValueError),  # type: ignore[dict-item]
        (lambda: PolicyOverrides(["ab"]), PolyampTypeError),  # type: ignore[list-item]
        (lambda: BackendSpec(name="a", target="a:b", frameworks="mylib", install_hint="x"), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: BackendSpec(name="a", target="a:b", frameworks=5, install_hint="x"), PolyampTypeError),  # type: ignore[arg-type]
        (lambda: LossScaler(growth_intervall=3), PolyampTypeError),  # type: ignore[call-arg]
    ],
)
def test_hostile_arguments_are_polyamp_errors(call: Any, error: type) -> None:
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, PolyampError)


@pytest.mark.parametrize(
    "change",
    [
        {"scale": 10**400},
        {"growth_interval": 10**400},
        {"polyamp_format": np.array([1, 1])},
        {"polyamp_format": np.True_},
        {"polyamp_format": 1 + 0j},
        {"polyamp_format": decimal.Decimal(1)},
        {"enabled": 1},
        {"min_scale": 1e-40},
    ],
    ids=repr,
)
def test_hostile_state_dicts_are_refused_and_change_nothing(change: dict[str, Any]) -> None:
    scaler = LossScaler(growth_interval=7, enabled=True)
    before = scaler.state_dict()
    with pytest.raises(StateDictError) as info:
        scaler.load_state_dict({**before, **change})
    assert scaler.state_dict() == before
    if "polyamp_format" in change:  # a malformed value, not a newer format: no advice to upgrade
        assert "must be an int" in str(info.value) and "Upgrade" not in str(info.value)


hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.just(np.float32(2.0)),
    st.just(decimal.Decimal("0.5")),
    st.just([1.0]),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*LossScaleConfig.setting_names(), "enabled", "nonsense"]), hostile_values))
def test_fuzzed_settings_give_a_scaler_or_a_polyamp_error(kwargs: dict[str, Any]) -> None:
    try:
        scaler = LossScaler(**kwargs)
    except PolyampError as exc:
        assert isinstance(exc, (ValueError, TypeError))
        return
    config = scaler.config
    assert math.isfinite(config.floor_f32) and config.floor_f32 >= 2.0**-126
    config.trajectory("FOFO")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*LossScaler(enabled=True).state_dict(), "extra"]), hostile_values))
def test_fuzzed_state_dicts_load_or_change_nothing(change: dict[str, Any]) -> None:
    scaler = LossScaler(growth_interval=9, hysteresis=2, enabled=True)
    before = scaler.state_dict()
    try:
        scaler.load_state_dict({**before, **change})
    except PolyampError as exc:
        assert isinstance(exc, (ValueError, TypeError, RuntimeError))
        assert scaler.state_dict() == before
        return
    state = scaler.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state["scale"] >= scaler.config.floor_f32


# -- a failed call leaves no trace, and there is a public way back -------------------------------------------------


def test_step_without_gradients_leaves_no_trace() -> None:
    torch = pytest.importorskip("torch")
    import polyamp_torch

    scaler = polyamp_torch.TorchLossScaler("cpu")
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.5)
    scaler.scale(param.sum())  # forgot backward
    with pytest.raises(ScalerUsageError):
        scaler.step(opt)
    pickle.dumps(scaler)  # between iterations still
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(param.detach(), torch.full((2,), 0.5))


def test_a_refused_unscale_leaves_no_trace() -> None:
    torch = pytest.importorskip("torch")
    import polyamp_torch

    scaler = polyamp_torch.TorchLossScaler("cpu")
    model = torch.nn.Linear(2, 1).half()  # float16 parameters: unscaling their gradients is refused
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler.scale(model(torch.ones(1, 2, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ScalerUsageError, match="float16 gradients"):
        scaler.unscale_(opt)
    pickle.dumps(scaler)  # between iterations still: the refused call left no record behind
    scaler.load_state_dict(scaler.state_dict())
    model.float()  # the fix the message suggests; the parameters (and the optimizer) stay the same objects
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)  # not "already called": the refused call recorded nothing
    scaler.step(opt)
    scaler.update()
    assert not bool(scaler.step_skipped(opt))


def test_discard_iteration_and_update_with_a_new_scale_recover_at_any_point() -> None:
    torch = pytest.importorskip("torch")
    import polyamp_torch

    scaler = polyamp_torch.TorchLossScaler("cpu")
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.5)
    scaler.scale(param.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(ScalerUsageError):
        scaler.load_state_dict(scaler.state_dict())
    scaler.discard_iteration()  # e.g. after an exception inside the training step
    scaler.load_state_dict(scaler.state_dict())
    copy.deepcopy(scaler)
    scaler.update(new_scale=1024.0)  # between iterations, as torch.amp.GradScaler allows
    assert scaler.get_scale() == 1024.0
