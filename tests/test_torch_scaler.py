"""The torch scaler's own behaviour: the device state machine vs the reference, skip records, errors, and long
runs of overflows that must never leave a non-finite weight."""

from __future__ import annotations

import copy
import json
import math
import pickle
import warnings
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import polyamp  # noqa: E402
import polyamp.backend_api  # noqa: E402
import polyamp_torch  # noqa: E402
from polyamp import (  # noqa: E402
    InvalidConfigError,
    LossScaleConfig,
    PolyampTypeError,
    ScalerUsageError,
    StateDictError,
)


def _step(scaler: Any, param: Any, opt: Any, bad: tuple[int, float] | None) -> None:
    """One scaled step of ``opt`` on ``param.sum()``; ``bad`` = (index, value) is planted in the gradient first."""
    opt.zero_grad()
    scaler.scale(param.sum()).backward()
    if bad is not None:
        param.grad[bad[0]] = bad[1]
    scaler.step(opt)
    scaler.update()


def drive(scaler: Any, pattern: str, *, fused: bool = False) -> tuple[list[tuple[float, int, int]], Any]:
    """Run one step per pattern character (O = overflow), returning (scale, tracker, hysteresis) after each."""
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([param], lr=1e-3, fused=True) if fused else torch.optim.SGD([param], lr=0.1)
    states = []
    for char in pattern:
        _step(scaler, param, opt, (2, math.nan) if char == "O" else None)
        state = scaler.get_state()
        states.append((state.scale, state.growth_tracker, state.hysteresis_left))
    return states, opt


CONFIGS = {
    "hysteresis": dict(growth_interval=3, hysteresis=2),
    "min_scale": dict(init_scale=16.0, growth_interval=4, min_scale=2.0),
    "max_scale": dict(init_scale=1024.0, growth_interval=1, max_scale=3000.0),
    "static": dict(init_scale=256.0, growth_interval=1, dynamic=False),
    "growth_guard": dict(init_scale=2.0**126, growth_interval=1),
    "odd_factors": dict(init_scale=1000.0, growth_factor=1.37, backoff_factor=0.61, growth_interval=2, hysteresis=3),
    "all_bounds": dict(init_scale=64.0, growth_interval=2, hysteresis=2, min_scale=8.0, max_scale=128.0),
}
PATTERN = "FFOFFFOOOFFFFFOOOOOOFFFFFFF"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adam"])
def test_device_state_machine_follows_the_reference(name: str, fused: bool) -> None:
    scaler = polyamp.LossScaler(**CONFIGS[name], enabled=True)
    states, _ = drive(scaler, PATTERN, fused=fused)
    reference = scaler.config.states(PATTERN)
    assert states == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in reference]


@settings(max_examples=40, deadline=None)
@given(
    growth_interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    growth_factor=st.floats(1.01, 4.0),
    backoff_factor=st.floats(0.05, 0.95),
    bounds=st.sampled_from([(None, None), (0.5, None), (None, 5000.0), (1.0, 3000.0)]),
    pattern=st.text(alphabet="FO", min_size=1, max_size=25),
)
def test_device_state_machine_matches_the_reference_on_random_configs(
    growth_interval: int,
    hysteresis: int,
    growth_factor: float,
    backoff_factor: float,
    bounds: tuple[float | None, float | None],
    pattern: str,
) -> None:
    config = dict(
        init_scale=1000.0,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        min_scale=bounds[0],
        max_scale=bounds[1],
    )
    scaler = polyamp.LossScaler(**config, enabled=True)
    states, _ = drive(scaler, pattern)
    assert states == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in scaler.config.states(pattern)]


def test_update_never_reads_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    scaler = polyamp.LossScaler(growth_interval=2, hysteresis=2, min_scale=1.0, enabled=True)
    drive(scaler, "FO")
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([param], fused=True)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("host sync")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    monkeypatch.setattr(torch.Tensor, "__bool__", forbidden)
    scaler.update()
    scaler.step_skipped(opt)
    scaler.skipped_steps()


def test_step_skipped_and_skipped_steps() -> None:
    scaler = polyamp.LossScaler(growth_interval=100, enabled=True)
    _, opt = drive(scaler, "FOFOOF", fused=True)
    assert scaler.step_skipped(opt).dtype == torch.bool
    assert not bool(scaler.step_skipped(opt)) and not bool(scaler.step_skipped())
    assert int(scaler.skipped_steps()) == 3
    drive(scaler, "O")
    assert bool(scaler.step_skipped())


def test_step_skipped_errors_before_anything_happened() -> None:
    scaler = polyamp.LossScaler(enabled=True)
    with pytest.raises(ScalerUsageError, match="before this LossScaler stepped"):
        scaler.step_skipped()
    assert scaler.skipped_steps() == 0
    drive(scaler, "F")
    with pytest.raises(ScalerUsageError, match="has not been stepped by this scaler"):
        scaler.step_skipped(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))


def test_step_returns_the_optimizer_result_or_none_when_skipped() -> None:
    param = torch.nn.Parameter(torch.ones(2))

    class Counting(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            super().step()
            return "applied"

    opt = Counting([param], lr=0.1)
    scaler = polyamp.LossScaler(enabled=True)
    scaler.scale(param.sum()).backward()
    assert scaler.step(opt) == "applied"
    scaler.update()
    opt.zero_grad()
    scaler.scale(param.sum()).backward()
    param.grad[0] = math.inf
    assert scaler.step(opt) is None
    scaler.update()


def test_update_with_new_scale() -> None:
    scaler = polyamp.LossScaler(growth_interval=2, max_scale=2.0**20, enabled=True)
    drive(scaler, "F")
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    scaler.update(new_scale=512.0)
    assert scaler.get_scale() == 512.0
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    scaler.update(torch.tensor(64.0))
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize(
    ("new_scale", "error", "fragment"),
    [
        (-1.0, InvalidConfigError, "finite positive"),
        (math.inf, InvalidConfigError, "finite positive"),
        (2.0**30, InvalidConfigError, "outside [min_scale, max_scale]"),
        ("8", PolyampTypeError, "takes a float or a one-element tensor"),
        (torch.ones(2), PolyampTypeError, "one-element floating tensor"),
        (torch.tensor(3), PolyampTypeError, "one-element floating tensor"),
        (torch.tensor(3.0, requires_grad=True), PolyampTypeError, "requires_grad=False"),
    ],
)
def test_update_rejects_bad_new_scales_and_keeps_the_scale(new_scale: Any, error: type, fragment: str) -> None:
    scaler = polyamp.LossScaler(max_scale=2.0**20, enabled=True)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    with pytest.raises(error) as info:
        scaler.update(new_scale)
    assert fragment in str(info.value)
    assert scaler.get_scale() == 65536.0


@pytest.mark.parametrize(
    "new_scale",
    [torch.tensor(math.nan), torch.tensor(math.inf), torch.tensor(0.0), torch.tensor(-5.0), torch.tensor(2.0**30)],
    ids=["nan", "inf", "zero", "negative", "above_max"],
)
def test_update_with_a_bad_tensor_scale_is_refused(new_scale: Any) -> None:
    scaler = polyamp_torch.TorchLossScaler("cpu", max_scale=2.0**20)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    with pytest.raises(InvalidConfigError):
        scaler.update(new_scale)
    scaler.update(torch.tensor(512.0))
    assert scaler.get_scale() == 512.0
    scaler.load_state_dict(scaler.state_dict())  # its own state dict still loads


# -- misuse -------------------------------------------------------------------------------------------


@pytest.fixture
def setup() -> tuple[Any, Any, Any]:
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    return polyamp.LossScaler(enabled=True), param, opt


def test_unscale_twice_raises(setup: tuple[Any, Any, Any]) -> None:
    scaler, param, opt = setup
    scaler.scale(param.sum()).backward()
    scaler.unscale_(opt)
    grads = param.grad.clone()
    with pytest.raises(ScalerUsageError, match="already called for this optimizer") as info:
        scaler.unscale_(opt)
    assert isinstance(info.value, RuntimeError)
    assert torch.equal(param.grad, grads)  # not divided twice


@pytest.mark.parametrize(
    ("call", "message"),
    [("unscale_", "after step"), ("step", "already called for this optimizer since the last update")],
    ids=["unscale_after_step", "step_twice"],
)
def test_unscale_or_step_after_step_raises(setup: tuple[Any, Any, Any], call: str, message: str) -> None:
    scaler, param, opt = setup
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    with pytest.raises(ScalerUsageError, match=message):
        getattr(scaler, call)(opt)


def test_step_before_scale_raises(setup: tuple[Any, Any, Any]) -> None:
    scaler, _, opt = setup
    with pytest.raises(ScalerUsageError, match="before scale"):
        scaler.step(opt)


def test_update_without_step_raises(setup: tuple[Any, Any, Any]) -> None:
    scaler, param, _ = setup
    scaler.scale(param.sum())
    with pytest.raises(ScalerUsageError, match="no step"):
        scaler.update()


def test_step_without_gradients_raises(setup: tuple[Any, Any, Any]) -> None:
    scaler, param, opt = setup
    scaler.scale(param.sum())
    with pytest.raises(ScalerUsageError, match="none of the optimizer's parameters has a gradient"):
        scaler.step(opt)


def test_fused_step_without_gradients_and_step_skipped_of_a_non_optimizer() -> None:
    scaler = polyamp_torch.TorchLossScaler("cpu")
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([param], fused=True)
    scaler.scale(param.sum())
    with pytest.raises(ScalerUsageError, match="none of the optimizer's parameters has a gradient"):
        scaler.step(opt)
    with pytest.raises(PolyampTypeError, match=r"step_skipped\(\) takes a torch.optim.Optimizer"):
        scaler.step_skipped(0.0)


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_closures_are_refused_while_scaling(setup: tuple[Any, Any, Any], how: str) -> None:
    scaler, param, opt = setup
    scaler.scale(param.sum()).backward()
    with pytest.raises(ScalerUsageError, match="closure"):
        if how == "keyword":
            scaler.step(opt, closure=lambda: param.sum())
        else:
            scaler.step(opt, lambda: param.sum())


@pytest.mark.filterwarnings("ignore::polyamp.TrainingStateWarning")  # (a plain optimizer over float16 weights)
def test_float16_gradients_get_a_clear_error() -> None:
    model = torch.nn.Linear(4, 2).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = polyamp.LossScaler(enabled=True)
    scaler.scale(model(torch.ones(1, 4, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ScalerUsageError, match=r"Cannot unscale float16 gradients.*float32 master parameters"):
        scaler.step(opt)


def test_forcing_scaling_onto_bfloat16_gradients_warns_once() -> None:
    polyamp.set_policy("bfloat16")
    assert not polyamp.LossScaler().enabled
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = polyamp.LossScaler(enabled=True)
    for expect_warning in (True, False):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum()).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.step(opt)
        scaler.update()
        messages = [str(w.message) for w in caught]
        assert any("gradients are bfloat16" in m for m in messages) is expect_warning


def test_non_tensor_losses_and_optimizers_are_type_errors(setup: tuple[Any, Any, Any]) -> None:
    scaler, param, _ = setup
    scaler.scale(param.sum())
    with pytest.raises(PolyampTypeError, match=r"scale\(\) takes a torch.Tensor or an iterable"):
        scaler.scale([param.sum(), 3.0])
    with pytest.raises(PolyampTypeError, match=r"step\(\) takes a torch.optim.Optimizer"):
        scaler.step(object())


def test_scale_keeps_container_types() -> None:
    scaler = polyamp_torch.TorchLossScaler(init_scale=4.0, enabled=True)
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    assert [t.item() for t in scaler.scale([a, b])] == [4.0, 8.0]
    scaled = scaler.scale((a, [b]))
    assert isinstance(scaled, tuple) and isinstance(scaled[1], list) and scaled[1][0].item() == 8.0
    assert [t.item() for t in scaler.scale(iter([a]))] == [4.0]


def test_load_state_dict_mid_iteration_is_refused_and_changes_nothing(setup: tuple[Any, Any, Any]) -> None:
    scaler, param, opt = setup
    saved = scaler.state_dict()
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    changed = dict(saved, scale=8.0)
    with pytest.raises(ScalerUsageError, match="middle of an iteration"):
        scaler.load_state_dict(changed)
    assert scaler.get_scale() == 65536.0
    assert scaler.state_dict() == saved


def test_bad_state_dict_leaves_the_device_state_unchanged() -> None:
    scaler = polyamp.LossScaler(growth_interval=5, enabled=True)
    drive(scaler, "FFO")
    before = scaler.state_dict()
    with pytest.raises(StateDictError):
        scaler.load_state_dict(dict(before, _growth_tracker=99))
    assert scaler.state_dict() == before


def test_state_dict_after_device_use_is_json() -> None:
    scaler = polyamp.LossScaler(growth_interval=2, hysteresis=2, enabled=True)
    drive(scaler, "FFFO")
    state = scaler.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert (state["scale"], state["_growth_tracker"], state["hysteresis_left"]) == (131072.0, 0, 1)


@pytest.mark.parametrize("fused", [False, True])
def test_the_skip_count_goes_on_after_a_resume_and_torchs_scaler_reads_the_same_dict(fused: bool) -> None:
    # GradScaler's dict has no skip count and GradScaler reads its five keys only: polyamp's dict carries the count
    # so that a resumed scaler's skipped_steps goes on, and the two still load each other's dicts.
    scaler = polyamp_torch.TorchLossScaler("cpu", growth_interval=2)
    drive(scaler, "FOFOF", fused=fused)
    saved = scaler.state_dict()
    assert saved["skipped_steps"] == int(scaler.skipped_steps()) == 2
    resumed = polyamp_torch.TorchLossScaler("cpu", growth_interval=2)
    resumed.load_state_dict(saved)
    assert int(resumed.skipped_steps()) == 2 and resumed.state_dict() == saved
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.state_dict() == saved
    drive(resumed, "OF", fused=fused)
    assert int(resumed.skipped_steps()) == 3 and resumed.state_dict()["skipped_steps"] == 3
    resumed.load_state_dict(saved)  # loading again: the dict's count, not the one the scaler had
    assert int(resumed.skipped_steps()) == 2
    # torch.amp.GradScaler takes polyamp's dict (the same scale and tracker), and polyamp takes GradScaler's,
    # which counts no skips: the count starts at 0, and both go on with the same scales.
    native = torch.amp.GradScaler("cpu")
    native.load_state_dict(saved)
    assert native.state_dict() == {key: saved[key] for key in native.state_dict()}
    from_native = polyamp_torch.TorchLossScaler("cpu")
    from_native.load_state_dict(native.state_dict())
    assert int(from_native.skipped_steps()) == 0 and from_native.state_dict()["skipped_steps"] == 0
    scales = [drive(s, "FOF")[0] for s in (from_native, resumed)]
    assert [state[0] for state in scales[0]] == [state[0] for state in scales[1]]
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(StateDictError, match="'skipped_steps' must be an int >= 0"):
            resumed.load_state_dict({**saved, "skipped_steps": bad})
    assert int(resumed.skipped_steps()) == 3
    # Variables restored by a framework itself (restored_on_device, as Keras's weights loading says) hold the run's
    # count: what a state dict loaded before added is dropped.
    polyamp.backend_api.ScalerAdapter(resumed).restored_on_device()
    assert int(resumed.skipped_steps()) == int(resumed.device_form.skipped_steps()) == 2


def test_pickle_and_deepcopy_of_a_bound_scaler_continue_its_trajectory() -> None:
    scaler = polyamp.LossScaler(growth_interval=2, hysteresis=2, enabled=True)
    drive(scaler, "FFO")
    for clone in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert clone.backend == "torch" and clone.state_dict() == scaler.state_dict()
        states, _ = drive(clone, "OFF")
        assert states == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in scaler.config.states("FFOOFF")][3:]


def test_pickling_mid_iteration_is_refused(setup: tuple[Any, Any, Any]) -> None:
    scaler, param, opt = setup
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    with pytest.raises(ScalerUsageError, match="only between iterations"):
        pickle.dumps(scaler)
    scaler.update()
    assert pickle.loads(pickle.dumps(scaler)).get_scale() == scaler.get_scale()


def test_disabled_scaler_just_steps() -> None:
    scaler = polyamp_torch.TorchLossScaler(enabled=False)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.5)
    loss = param.sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(param.detach(), torch.full((2,), 0.5))
    assert scaler.get_scale() == 1.0 and not bool(scaler.step_skipped(opt)) and not bool(scaler.step_skipped())


def test_torch_loss_scaler_is_bound_from_construction() -> None:
    scaler = polyamp_torch.TorchLossScaler(growth_interval=5)
    assert isinstance(scaler, polyamp.LossScaler)
    assert scaler.backend == "torch" and scaler.get_growth_interval() == 5
    assert polyamp_torch.TorchLossScaler(backend="torch").backend == "torch"
    with pytest.raises(
        PolyampTypeError, match="TorchLossScaler is bound to torch; it cannot take backend='tensorflow'"
    ):
        polyamp_torch.TorchLossScaler(backend="tensorflow")


def test_device_config_validation_is_the_cores() -> None:
    with pytest.raises(InvalidConfigError):
        polyamp_torch.TorchLossScaler(growth_factor=0.5)
    assert LossScaleConfig().is_standard_rule


# -- LR schedulers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adam"])
def test_scheduler_guard_does_not_advance_on_skipped_steps(fused: bool) -> None:
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([param], lr=1.0, fused=True) if fused else torch.optim.SGD([param], lr=1.0)
    scaler = polyamp.LossScaler(enabled=True)
    scheduler = polyamp_torch.SchedulerGuard(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), scaler)
    pattern = "OOFOFF"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        for char in pattern:
            _step(scaler, param, opt, (0, math.inf) if char == "O" else None)
            scheduler.step()
    applied = pattern.count("F")
    assert scheduler.get_last_lr() == [0.5**applied]
    assert scheduler.last_epoch == applied and scheduler.held_back == pattern.count("O")
    assert scheduler.state_dict()["last_epoch"] == applied


def test_plain_scheduler_drifts_where_the_guard_does_not() -> None:
    """The problem the guard solves, shown on torch itself: fused steps 'run' even when skipped."""
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([param], lr=1.0, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler.scale(param.sum()).backward()
    param.grad[0] = math.inf
    scaler.step(opt)
    scaler.update()
    scheduler.step()
    assert scheduler.last_epoch == 1  # advanced although nothing was applied


def test_scheduler_guard_validates_its_arguments() -> None:
    with pytest.raises(PolyampTypeError, match="wraps an LR scheduler"):
        polyamp_torch.SchedulerGuard(object(), polyamp.LossScaler())
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    with pytest.raises(PolyampTypeError, match=r"needs the polyamp\.LossScaler"):
        polyamp_torch.SchedulerGuard(torch.optim.lr_scheduler.StepLR(opt, 1), torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("enabled", [True, False], ids=["scaling", "guarding"])
def test_a_skipped_first_step_of_a_fused_sgd_leaves_no_uninitialised_momentum(
    enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's fused SGD makes a first step's momentum buffers with ``torch.empty_like`` and lets its kernel
    fill them; when the kernel skips that step, they keep whatever memory they got, and the next step adds it
    to the parameters. Here that memory is NaN (as ``empty_like`` may return): after a skipped first step the
    run equals a fused SGD that never saw the skipped batch, bit for bit, instead of turning NaN."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(math.nan))

    def run(skip_first: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        scaler = polyamp_torch.TorchLossScaler(enabled=enabled, guard=True)
        batches = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        for index, x in enumerate(batches if skip_first else batches[1:]):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            if skip_first and index == 0:
                model.weight.grad[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
        if skip_first:
            assert [r.skipped for r in scaler.records()] == [True, False, False, False]
        return [p.detach().clone() for p in model.parameters()]

    skipped, native = run(skip_first=True), run(skip_first=False)
    assert all(torch.isfinite(p).all() for p in skipped)
    assert all(torch.equal(a, b) for a, b in zip(skipped, native))


# -- long runs of overflows and scales below one -----------------------------------------------------------


def _linear_step(model: Any, opt: Any, scaler: Any, *, nan: bool) -> None:
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    if nan:
        model.weight.grad[0, 0] = math.nan
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adam"])
def test_150_overflows_then_a_finite_step_keeps_the_weights_finite(fused: bool) -> None:
    def run(scaler: Any) -> Any:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters(), fused=True) if fused else torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(150):
            _linear_step(model, opt, scaler, nan=True)
        _linear_step(model, opt, scaler, nan=False)
        return model

    if not fused:  # torch itself fails here: 1/scale overflows to inf and SGD applies it
        assert not torch.isfinite(run(torch.amp.GradScaler("cpu")).weight).all()
    scaler = polyamp_torch.TorchLossScaler("cpu")
    model = run(scaler)
    assert torch.isfinite(model.weight).all() and torch.isfinite(model.bias).all()
    assert scaler.get_scale() == 1.0 and not bool(scaler.step_skipped())


@pytest.mark.slow
def test_a_periodic_inf_for_10000_steps_never_corrupts_the_weights() -> None:
    """An inf every 50 steps (which no scale cures): the scale settles at the floor, training goes on."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = polyamp_torch.TorchLossScaler("cpu")
    for step in range(10_000):
        _linear_step(model, opt, scaler, nan=step % 50 == 49)
    assert torch.isfinite(model.weight).all()
    assert scaler.get_scale() == 1.0 and int(scaler.skipped_steps()) == 200
    # The reference agrees: 16 halvings from 2**16 reach the floor, which holds.
    assert LossScaleConfig().trajectory([i % 50 == 49 for i in range(10_000)])[-1] == 1.0


def test_below_one_with_min_scale_the_unscaled_gradients_are_checked() -> None:
    """With min_scale < 1, 1/scale > 1 can overflow a finite scaled gradient: that step is skipped."""
    param = torch.nn.Parameter(torch.zeros(2))
    for fused in (False, True):
        opt = torch.optim.Adam([param], fused=True) if fused else torch.optim.SGD([param], lr=1.0)
        scaler = polyamp_torch.TorchLossScaler("cpu", init_scale=2.0**-100, min_scale=2.0**-120)
        scaler.scale(param.sum()).backward()
        param.grad.fill_(2.0**40)  # finite; unscaled: 2**140, beyond float32
        scaler.step(opt)
        scaler.update()
        assert bool(scaler.step_skipped(opt)) and torch.equal(param.detach(), torch.zeros(2))
        param.grad = None


def test_a_native_checkpoint_below_the_floor_resumes_at_the_floor_with_a_warning() -> None:
    native = torch.amp.GradScaler("cpu", init_scale=2.0**-130 * 8)
    scaler = polyamp_torch.TorchLossScaler("cpu")
    state = dict(native.state_dict(), scale=0.0)
    with pytest.warns(UserWarning, match="below the lowest scale polyamp uses"):
        scaler.load_state_dict(state)
    assert scaler.get_scale() == 1.0
