"""polyamp's torch scaler against torch.amp.GradScaler, side by side on the same model, data and overflows.

Every test trains two copies of one model, one with the native GradScaler + torch.autocast and one with
polyamp, and requires the same scale after every step and bitwise-equal parameters and optimizer state.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import polyamp  # noqa: E402
import polyamp_torch  # noqa: E402

INTERVAL = 3
STEPS = 14
# A pseudo-random set of steps at which an inf is planted in one gradient (fixed seed: reproducible).
OVERFLOW_STEPS = frozenset(int(i) for i in torch.randperm(STEPS, generator=torch.Generator().manual_seed(7))[:5])


@pytest.fixture(autouse=True)
def mixed_float16() -> None:
    """polyamp's side runs under the policy users would set; tests may change it."""
    polyamp.set_policy("mixed_float16")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )


def make_data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)) for _ in range(steps)
    ]


def plant_inf(model: torch.nn.Module, step: int) -> None:
    params = [p for p in model.parameters() if p.grad is not None]
    grad = params[step % len(params)].grad
    grad.view(-1)[step % grad.numel()] = math.inf


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert pa.dtype == pb.dtype and torch.equal(pa, pb), f"parameter {name} differs"


def assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        for field, value in state.items():
            other = sb["state"][key][field]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(value, other), f"state[{key}][{field}] differs"
            else:
                assert value == other, f"state[{key}][{field}] differs"


class Run:
    """One training run: model, optimizer, scaler and the loop both sides share."""

    def __init__(self, native: bool, make_opt: Callable[[Any], torch.optim.Optimizer], **scaler_kwargs: Any) -> None:
        self.native = native
        self.model = make_model()
        self.opt = make_opt(self.model.parameters())
        if native:
            self.scaler = torch.amp.GradScaler("cpu", growth_interval=INTERVAL, **scaler_kwargs)
        else:
            self.scaler = polyamp.LossScaler(growth_interval=INTERVAL, **scaler_kwargs)
        self.scales: list[float] = []

    def region(self) -> Any:
        if self.native:
            return torch.autocast("cpu", dtype=torch.float16)
        return polyamp_torch.autocast(device_type="cpu")

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.region():
            return torch.nn.functional.cross_entropy(self.model(x), y)

    def train(self, data: list[Any], *, clip: float | None = None, accumulate: int = 1, start: int = 0) -> None:
        for index, (x, y) in enumerate(data, start=start):
            self.opt.zero_grad(set_to_none=True)
            for chunk_x, chunk_y in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
                self.scaler.scale(self.loss(chunk_x, chunk_y) / accumulate).backward()
            if index in OVERFLOW_STEPS:
                plant_inf(self.model, index)
            if clip is not None:
                self.scaler.unscale_(self.opt)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.scales.append(self.scaler.get_scale())


def _fused(cls: type, **kwargs: Any) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        return cls(params, fused=True, **kwargs)

    return make


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam_fused": _fused(torch.optim.Adam, lr=1e-2),
    "adamw_fused": _fused(torch.optim.AdamW, lr=1e-2),
    "sgd_fused": _fused(torch.optim.SGD, lr=0.05, momentum=0.9),
}


def _optimizer(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    make = OPTIMIZERS[name]
    try:
        make([torch.nn.Parameter(torch.zeros(2))])
    except (RuntimeError, TypeError, ValueError) as exc:
        pytest.skip(f"{name} is not available in torch {torch.__version__} on CPU: {exc}")
    return make


def run_pair(opt_name: str, **train_kwargs: Any) -> tuple[Run, Run]:
    make = _optimizer(opt_name)
    native, ours = Run(True, make), Run(False, make)
    data = make_data()
    native.train(data, **train_kwargs)
    ours.train(data, **train_kwargs)
    return native, ours


def assert_same_run(native: Run, ours: Run) -> None:
    assert ours.scales == native.scales
    assert_same_params(native.model, ours.model)
    assert_same_optimizer_state(native.opt, ours.opt)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_same_trajectory_params_and_state_as_grad_scaler(opt_name: str) -> None:
    native, ours = run_pair(opt_name)
    assert_same_run(native, ours)
    assert ours.scaler.backend == "torch"
    assert native.scales != [native.scales[0]] * STEPS  # the pattern really moved the scale
    expected = polyamp.LossScaleConfig(growth_interval=INTERVAL).trajectory([i in OVERFLOW_STEPS for i in range(STEPS)])
    assert ours.scales == expected


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
def test_clipping_after_unscale_matches(opt_name: str) -> None:
    assert_same_run(*run_pair(opt_name, clip=0.5))


@pytest.mark.parametrize("opt_name", ["adamw", "adamw_fused"])
def test_gradient_accumulation_matches(opt_name: str) -> None:
    assert_same_run(*run_pair(opt_name, accumulate=4))


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adam_fused"])
def test_skipped_step_leaves_params_and_optimizer_state_unchanged(opt_name: str) -> None:
    make = _optimizer(opt_name)
    run = Run(False, make)
    data = make_data(3)
    run.train(data[:2])
    params = [p.detach().clone() for p in run.model.parameters()]
    state = copy.deepcopy(run.opt.state_dict())
    x, y = data[2]
    run.opt.zero_grad()
    run.scaler.scale(run.loss(x, y)).backward()
    plant_inf(run.model, 5)
    # A plain optimizer is skipped on the host: its step() is not called and scaler.step returns None. A fused
    # one is stepped, as GradScaler steps it: its step() gets the scale and found_inf (as attributes) and skips
    # in its kernel; scaler.step returns what the optimizer's step() returned.
    calls: list[tuple[float | None, float | None]] = []
    returned = object()
    optimizer_step = run.opt.step

    def recording_step(*args: Any, **kwargs: Any) -> object:
        handed = (getattr(run.opt, "grad_scale", None), getattr(run.opt, "found_inf", None))
        calls.append(tuple(None if t is None else float(t) for t in handed))  # type: ignore[arg-type]
        optimizer_step(*args, **kwargs)
        return returned

    run.opt.step = recording_step  # type: ignore[method-assign]
    scale = run.scaler.get_scale()
    result = run.scaler.step(run.opt)
    del run.opt.step
    if opt_name.endswith("_fused"):
        assert result is returned
        assert calls == [(scale, 1.0)]
    else:
        assert result is None
        assert calls == []
    run.scaler.update()
    assert bool(run.scaler.step_skipped(run.opt)) and bool(run.scaler.step_skipped())
    for before, after in zip(params, run.model.parameters(), strict=True):
        assert torch.equal(before, after)
    after_state = run.opt.state_dict()
    for key, fields in state["state"].items():
        for field, value in fields.items():
            other = after_state["state"][key][field]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def test_two_optimizers_one_scaler_match() -> None:
    def build(native: bool) -> tuple[Any, ...]:
        model = make_model()
        first = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9)
        second = torch.optim.Adam([p for m in list(model)[1:] for p in m.parameters()], lr=1e-2)
        scaler = (
            torch.amp.GradScaler("cpu", growth_interval=INTERVAL)
            if native
            else polyamp.LossScaler(growth_interval=INTERVAL, backend="torch")
        )
        return model, first, second, scaler

    runs = []
    for native in (True, False):
        model, first, second, scaler = build(native)
        scales = []
        for index, (x, y) in enumerate(make_data()):
            first.zero_grad()
            second.zero_grad()
            region = torch.autocast("cpu", dtype=torch.float16) if native else polyamp_torch.autocast(device_type="cpu")
            with region:
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if index in OVERFLOW_STEPS:  # only the second optimizer's gradients overflow
                model[4].weight.grad[0, 0] = math.inf
            scaler.unscale_(first)
            scaler.step(first)
            scaler.step(second)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((model, first, second, scales))
    (m1, a1, b1, s1), (m2, a2, b2, s2) = runs
    assert s1 == s2
    assert_same_params(m1, m2)
    assert_same_optimizer_state(a1, a2)
    assert_same_optimizer_state(b1, b2)


def test_gradient_penalty_pattern_matches() -> None:
    """The double-backward recipe from torch's AMP examples, with the scale read through get_scale()."""
    results = []
    for native in (True, False):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu") if native else polyamp.LossScaler(backend="torch", enabled=True)
        for x, y in make_data(4):
            opt.zero_grad()
            region = (
                torch.autocast("cpu", dtype=torch.float16)
                if native
                else polyamp_torch.autocast("mixed_float16", device_type="cpu")
            )
            with region:
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaled_grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in scaled_grads]
            with region:
                penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
                loss = loss + penalty
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        results.append(model)
    assert_same_params(*results)


def test_bfloat16_policy_disables_scaling_and_equals_plain_training() -> None:
    polyamp.set_policy("mixed_bfloat16")
    scaler = polyamp.LossScaler()
    assert not scaler.enabled
    plain, ours = make_model(), make_model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    our_opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for x, y in make_data(6):
        plain_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(plain(x), y)
        loss.backward()
        plain_opt.step()
        our_opt.zero_grad()
        with polyamp_torch.autocast(device_type="cpu"):
            loss = torch.nn.functional.cross_entropy(ours(x), y)
        scaled = scaler.scale(loss)
        assert scaled is loss
        scaled.backward()
        scaler.step(our_opt)
        scaler.update()
        assert scaler.get_scale() == 1.0
    assert_same_params(plain, ours)
    assert_same_optimizer_state(plain_opt, our_opt)
    assert not bool(scaler.step_skipped(our_opt))


@pytest.mark.parametrize("opt_name", ["adam", "adam_fused"])
def test_save_and_resume_mid_run_equals_an_uninterrupted_run(opt_name: str, tmp_path: Any) -> None:
    make = _optimizer(opt_name)
    data = make_data()
    whole = Run(False, make)
    whole.train(data)

    first = Run(False, make)
    first.train(data[:7])
    path = tmp_path / "checkpoint.pt"
    torch.save(
        {"model": first.model.state_dict(), "opt": first.opt.state_dict(), "scaler": first.scaler.state_dict()}, path
    )
    checkpoint = torch.load(path)
    resumed = Run(False, make)
    resumed.model.load_state_dict(checkpoint["model"])
    resumed.opt.load_state_dict(checkpoint["opt"])
    resumed.scaler.load_state_dict(checkpoint["scaler"])
    resumed.train(data[7:], start=7)
    assert first.scales + resumed.scales == whole.scales
    assert_same_params(whole.model, resumed.model)
    assert_same_optimizer_state(whole.opt, resumed.opt)


def test_resume_from_a_native_grad_scaler_checkpoint() -> None:
    make = _optimizer("sgd_momentum")
    data = make_data()
    native = Run(True, make)
    native.train(data[:7])
    ours = Run(False, make)
    # Deep copies, as a checkpoint file gives: optimizer state dicts share tensors with the live optimizer.
    ours.model.load_state_dict(copy.deepcopy(native.model.state_dict()))
    ours.opt.load_state_dict(copy.deepcopy(native.opt.state_dict()))
    ours.scaler.load_state_dict(native.scaler.state_dict())
    native.train(data[7:], start=7)
    ours.train(data[7:], start=7)
    assert ours.scales == native.scales[7:]
    assert_same_params(native.model, ours.model)


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
def test_non_power_of_two_scales_match_bit_for_bit(opt_name: str) -> None:
    """Odd factors make 1/scale inexact: the unscale must round exactly as GradScaler's does."""
    make = _optimizer(opt_name)
    kwargs = dict(init_scale=1000.0, growth_factor=1.37, backoff_factor=0.61)
    native, ours = Run(True, make, **kwargs), Run(False, make, **kwargs)
    data = make_data()
    native.train(data, clip=1.0)
    ours.train(data, clip=1.0)
    assert_same_run(native, ours)
    assert any(math.log2(s) != int(math.log2(s)) for s in ours.scales)
