"""LossScaler: construction, enabling by policy, binding, state dicts, and every error."""

from __future__ import annotations

import copy
import json
import math
import pickle
from typing import TYPE_CHECKING, Any

import pytest

import polyamp
import polyamp.backend_api
from polyamp import (
    BackendMismatchError,
    InvalidConfigError,
    LossScaler,
    PolyampTypeError,
    ScalerUsageError,
    StateDictError,
)

if TYPE_CHECKING:
    from conftest import FakeFramework


def test_defaults_match_torch() -> None:
    scaler = LossScaler(enabled=True)
    assert scaler.get_scale() == 65536.0
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (2.0, 0.5, 2000)
    assert scaler.config.hysteresis == 1
    assert scaler.config.min_scale is None and scaler.config.max_scale is None
    assert scaler.dynamic and scaler.backend is None


@pytest.mark.parametrize(
    ("policy", "enabled"),
    [("float32", False), ("mixed_float16", True), ("mixed_bfloat16", False), ("bfloat16", False)],
)
def test_enabled_follows_the_policy_in_effect_when_used(policy: str, enabled: bool) -> None:
    polyamp.set_policy(policy)
    scaler = LossScaler()
    assert scaler.enabled is enabled and scaler.is_enabled() is enabled and scaler.enabled_setting is None
    polyamp.set_policy("mixed_float16" if not enabled else "float32")
    assert scaler.enabled is not enabled  # read again when used, not frozen at construction


def test_a_scaler_built_before_set_policy_scales_afterwards(fake_framework: FakeFramework) -> None:
    fw = fake_framework.load()
    scaler = LossScaler()  # e.g. in a setup function, before the policy is chosen
    polyamp.set_policy("mixed_float16")
    assert scaler.scale(fw.Tensor(1e-7)).value == pytest.approx(1e-7 * 65536)
    opt = fw.Optimizer()
    opt.grad = 65536.0
    scaler.step(opt)
    scaler.update()
    assert opt.grad == 1.0 and scaler.get_scale() == 65536.0


def test_the_enabled_decision_holds_for_a_whole_iteration(fake_framework: FakeFramework) -> None:
    fw = fake_framework.load()
    polyamp.set_policy("mixed_float16")
    scaler = LossScaler()
    opt = fw.Optimizer()
    scaler.scale(fw.Tensor(1.0))
    polyamp.set_policy("mixed_bfloat16")  # mid-iteration: the scaled gradients must still be unscaled
    opt.grad = 2.0 * 65536
    scaler.step(opt)
    assert opt.grad == 2.0
    scaler.update()
    assert not scaler.enabled  # the next iteration follows the new policy
    loss = fw.Tensor(1.0)
    assert scaler.scale(loss) is loss


def test_float16_parameter_policies_leave_scaling_off_with_a_warning() -> None:
    polyamp.set_policy("float16")
    with pytest.warns(UserWarning, match="keeps float16 parameters.*Use 'mixed_float16'"):
        assert not LossScaler().enabled


def test_explicit_enabled_wins_over_the_policy() -> None:
    polyamp.set_policy("mixed_bfloat16")
    assert LossScaler(enabled=True).enabled
    polyamp.set_policy("mixed_float16")
    assert not LossScaler(enabled=False).enabled


def test_disabled_scaler_reports_scale_one_and_returns_the_loss_itself(fake_framework: FakeFramework) -> None:
    fw = fake_framework.load()
    scaler = LossScaler(enabled=False)
    loss = fw.Tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0
    opt = fw.Optimizer()
    assert scaler.step(opt) == "stepped"
    scaler.update()
    assert scaler.backend == fake_framework.name


def test_disabled_unbound_scaler_passes_unknown_objects_through() -> None:
    scaler = LossScaler(enabled=False)
    loss = object()
    assert scaler.scale(loss) is loss
    scaler.update()  # no-op, as torch's disabled GradScaler


def test_binds_on_first_use_and_follows_the_reference(fake_framework: FakeFramework) -> None:
    fw = fake_framework.load()
    scaler = LossScaler(growth_interval=3, enabled=True)
    assert scaler.scale(fw.Tensor(2.0)).value == 2.0 * 65536
    assert scaler.backend == fake_framework.name
    opt = fw.Optimizer()
    scales = []
    for overflow in "FFFOFFOOFFFFFF":
        scaler.scale(fw.Tensor(1.0))  # every iteration that scales starts from a scaled loss
        opt.grad = math.inf if overflow == "O" else 1.0
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == scaler.config.trajectory("FFFOFFOOFFFFFF")
    assert opt.steps == "FFFOFFOOFFFFFF".count("F")


def test_bind_at_construction(fake_framework: FakeFramework) -> None:
    scaler = LossScaler(backend=fake_framework.name, enabled=True)
    assert scaler.backend == fake_framework.name


def test_scale_binds_from_a_list_of_losses(fake_framework: FakeFramework) -> None:
    fw = fake_framework.load()
    scaler = LossScaler(enabled=True)
    scaled = scaler.scale([fw.Tensor(1.0), fw.Tensor(2.0)])
    assert scaler.backend == fake_framework.name
    assert [t.value for t in scaled] == [65536.0, 131072.0]


def test_unknown_objects_cannot_bind() -> None:
    scaler = LossScaler(enabled=True)
    with pytest.raises(PolyampTypeError, match=r"cannot tell which framework 3\.0 \(of type float\)") as caught:
        scaler.scale(3.0)
    assert f"({', '.join(repr(name) for name in polyamp.backend_api.backend_specs())})" in str(caught.value)
    assert scaler.backend is None


def test_another_frameworks_objects_are_rejected(
    fake_framework: FakeFramework, tmp_path: Any, monkeypatch: Any
) -> None:
    fw = fake_framework.load()
    (tmp_path / "otherfw.py").write_text("class Tensor:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    polyamp.backend_api.register_backend(
        polyamp.backend_api.BackendSpec(
            name="otherfw", target="otherfw:Tensor", frameworks=("otherfw",), install_hint="x"
        )
    )
    import otherfw  # type: ignore[import-not-found]

    scaler = LossScaler(enabled=True)
    scaler.scale(fw.Tensor(1.0))
    with pytest.raises(BackendMismatchError) as info:
        scaler.scale(otherfw.Tensor())
    message = str(info.value)
    assert f"bound to {fake_framework.name}" in message and "received a otherfw object" in message
    assert isinstance(info.value, TypeError)
    disabled = LossScaler(enabled=False)
    disabled.scale(fw.Tensor(1.0))
    with pytest.raises(BackendMismatchError):
        disabled.scale(otherfw.Tensor())


def test_methods_the_backend_lacks_say_what_it_offers(fake_framework: FakeFramework) -> None:
    fw = fake_framework.load()
    scaler = LossScaler(enabled=True)
    scaler.scale(fw.Tensor(1.0))
    with pytest.raises(
        PolyampTypeError,
        match=r"apply_gradients\(\) is not part of .* offers: scale\(\), unscale_\(\), step\(\), update\(\)",
    ):
        scaler.apply_gradients(fw.Optimizer(), [])


def test_update_before_any_step_is_a_usage_error() -> None:
    with pytest.raises(ScalerUsageError, match="before the scaler saw any tensor") as info:
        LossScaler(enabled=True).update()
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"enabled": 1}, PolyampTypeError),
        ({"backend": 3}, PolyampTypeError),
        ({"init_scale": -1.0}, InvalidConfigError),
        ({"growth_factor": 1.0}, InvalidConfigError),
        ({"backoff_factor": 1.5}, InvalidConfigError),
        ({"growth_interval": 0}, InvalidConfigError),
        ({"hysteresis": 0}, InvalidConfigError),
        ({"min_scale": 10.0, "max_scale": 1.0, "init_scale": 5.0}, InvalidConfigError),
        ({"growth_interval": 1.5}, PolyampTypeError),
    ],
)
def test_invalid_construction(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        LossScaler(**kwargs)


# -- state dicts -----------------------------------------------------------------------------------------


def test_state_dict_is_json_and_has_torchs_keys() -> None:
    scaler = LossScaler(growth_interval=7, hysteresis=2, min_scale=1.0, enabled=True)
    state = scaler.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= set(state)
    assert state["scale"] == 65536.0 and state["growth_interval"] == 7 and state["_growth_tracker"] == 0
    assert state["hysteresis"] == 2 and state["hysteresis_left"] == 2 and state["min_scale"] == 1.0
    assert state["max_scale"] is None and state["dynamic"] is True and state["polyamp_format"] == 1


def test_state_dict_round_trip_continues_the_same_trajectory(fake_framework: FakeFramework) -> None:
    fw = fake_framework.load()
    pattern = "FFOFFFFOOFFFFF"
    first = LossScaler(growth_interval=2, hysteresis=2, enabled=True)
    opt = fw.Optimizer()
    for overflow in pattern[:6]:
        first.scale(fw.Tensor(1.0))
        opt.grad = math.inf if overflow == "O" else 1.0
        first.step(opt)
        first.update()
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = LossScaler(enabled=True)
    resumed.load_state_dict(saved)
    assert resumed.config == first.config
    scales = []
    for overflow in pattern[6:]:
        resumed.scale(fw.Tensor(1.0))
        opt.grad = math.inf if overflow == "O" else 1.0
        resumed.step(opt)
        resumed.update()
        scales.append(resumed.get_scale())
    assert scales == resumed.config.trajectory(pattern)[6:]


def test_loads_a_native_torch_state_dict_keeping_polyamp_only_settings() -> None:
    native = {
        "scale": 1024.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 10,
        "_growth_tracker": 3,
    }
    scaler = LossScaler(hysteresis=3, max_scale=2.0**20, enabled=True)
    scaler.load_state_dict(native)
    assert scaler.get_scale() == 1024.0
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.25, 10)
    state = scaler.state_dict()
    assert state["_growth_tracker"] == 3 and state["hysteresis"] == 3 and state["hysteresis_left"] == 3
    assert state["max_scale"] == 2.0**20


def test_native_grad_scaler_round_trip() -> None:
    torch = pytest.importorskip("torch")
    native = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=5)
    scaler = LossScaler(enabled=True)
    scaler.load_state_dict(native.state_dict())
    assert scaler.get_scale() == 512.0 and scaler.get_growth_interval() == 5
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(scaler.state_dict())  # polyamp's dict is a superset of torch's
    assert back.get_scale() == 512.0 and back.get_growth_interval() == 5


BAD_STATE_DICTS = [
    ({}, "it is empty"),
    ({"scale": 1.0}, "missing keys"),
    (
        {
            "scale": 1.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 5,
            "_growth_tracker": 0,
            "extra": 1,
        },
        "unknown keys ['extra']",
    ),
    (
        {"scale": "1", "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5, "_growth_tracker": 0},
        "'scale' must be a finite number",
    ),
    (
        {"scale": math.inf, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5, "_growth_tracker": 0},
        "'scale' must be a finite number",
    ),
    (
        {"scale": 1.0, "growth_factor": 0.5, "backoff_factor": 0.5, "growth_interval": 5, "_growth_tracker": 0},
        "`growth_factor` must be a finite number > 1",
    ),
    (
        {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5, "_growth_tracker": 5},
        "growth tracker must be in [0, growth_interval=5)",
    ),
    (
        {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5, "_growth_tracker": 1.0},
        "'_growth_tracker' must be an int",
    ),
    (
        {
            "scale": 1.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 5,
            "_growth_tracker": 0,
            "enabled": False,
        },
        "saved from a disabled LossScaler",
    ),
    (
        {
            "scale": 1.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 5,
            "_growth_tracker": 0,
            "polyamp_format": 2,
        },
        "polyamp_format=2",
    ),
    (
        {
            "scale": 1.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 5,
            "_growth_tracker": 0,
            "hysteresis": 2,
            "hysteresis_left": 3,
        },
        "hysteresis_left must be in [1, hysteresis=2]",
    ),
    (
        {
            "scale": 2.0**30,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 5,
            "_growth_tracker": 0,
            "max_scale": 2.0**20,
        },
        "above max_scale",
    ),
]


@pytest.mark.parametrize(("state_dict", "fragment"), BAD_STATE_DICTS)
def test_bad_state_dicts_are_rejected_and_leave_the_scaler_unchanged(state_dict: dict[str, Any], fragment: str) -> None:
    scaler = LossScaler(growth_interval=9, hysteresis=2, enabled=True)
    before = scaler.state_dict()
    with pytest.raises(StateDictError) as info:
        scaler.load_state_dict(state_dict)
    assert fragment in str(info.value)
    assert "left unchanged" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert scaler.state_dict() == before


def test_load_state_dict_takes_a_mapping() -> None:
    with pytest.raises(PolyampTypeError, match="takes the dict returned by state_dict"):
        LossScaler(enabled=True).load_state_dict([("scale", 1.0)])  # type: ignore[arg-type]


def test_scale_in_a_state_dict_is_held_in_float32() -> None:
    scaler = LossScaler(min_scale=0.01, enabled=True)
    state = scaler.state_dict()
    state["scale"] = 0.1
    scaler.load_state_dict(state)
    assert scaler.get_scale() == 0.10000000149011612


def test_pickle_and_deepcopy_keep_config_and_state() -> None:
    scaler = LossScaler(growth_interval=5, hysteresis=2, max_scale=2.0**20, enabled=True)
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.state_dict() == scaler.state_dict()
        assert clone.enabled and clone.backend is None


def test_repr_shows_settings() -> None:
    text = repr(LossScaler(growth_interval=5, min_scale=2.0, enabled=True))
    assert text.startswith("LossScaler(scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=5")
    assert "min_scale=2.0" in text and "max_scale" not in text and "backend=None" in text
    # every setting the config has is shown (from the config, so a new setting appears without an edit here)
    full = repr(LossScaler(min_scale=2.0, max_scale=2.0**20))
    shown = [part.split("=")[0] for part in full[len("LossScaler(") : -1].split(", ")]
    assert shown == ["scale", *polyamp.LossScaleConfig.setting_names()[1:], "enabled", "backend"]
