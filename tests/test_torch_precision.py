"""polyamp_torch.PrecisionOptimizer: the training-state plan's rules on torch, against the core's reference."""

from __future__ import annotations

import copy
import io
import logging
import math
import pickle
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import polyamp  # noqa: E402
from polyamp.backend_api.training_state import KAHAN_KEY, MASTER_KEY, round_to, write_update  # noqa: E402
from polyamp_torch import PrecisionOptimizer, measure_state_bytes  # noqa: E402

pytestmark = pytest.mark.torch

PRESETS = ("bfloat16_float32_master", "bfloat16_kahan", "bfloat16_stochastic")
FLOAT16_KAHAN = "params=float16,compute=float16,output=float32,state=float32,rounding=kahan"


def _params(dtype: torch.dtype, shapes=((6, 5), (7,)), seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(*s, generator=generator) * 2).to(dtype)) for s in shapes]


def _set_grads(params, seed: int, scale: float = 1e-2) -> None:
    generator = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=generator) * scale).to(p.dtype)


def _step_side_by_side(opt: Any, params: list[Any], ref_opt: Any, reference: list[Any], step: int) -> None:
    """Step ``step``'s gradients in ``params`` and the same in float32 in ``reference``; one step of each optimizer."""
    _set_grads(params, step)
    for r, p in zip(reference, params):
        r.grad = p.grad.float()
    opt.step()
    ref_opt.step()


def _floats(tensor: torch.Tensor) -> list[float]:
    return tensor.detach().float().reshape(-1).tolist()


def _snapshot(optimizer: PrecisionOptimizer, params) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the training state, cloned: weights, master copies, slots, compensation, generators."""
    out = [(f"w{i}", p.detach().clone()) for i, p in enumerate(params)]
    for i, p in enumerate(params):
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                out.append((f"{i}.{key}", value.detach().clone()))
    out += [(str(d), g.get_state()) for d, g in sorted(optimizer._generators.items(), key=str)]
    return out


def _bitwise_equal(a, b) -> bool:
    return len(a) == len(b) and all(
        ka == kb
        and x.dtype == y.dtype
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for (ka, x), (kb, y) in zip(a, b)
    )


def _float32_targets(params, lr: float) -> list[torch.Tensor]:
    """What SGD computes from the float32 working copies (the weights as they are, their gradients)."""
    targets = []
    for p in params:
        w32 = p.detach().float().clone()
        w32.grad = p.grad.float()
        torch.optim.SGD([w32], lr=lr).step()
        targets.append(w32.detach())
    return targets


# -- every write against the reference ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_kahan_writes_equal_the_reference_bit_for_bit(dtype) -> None:
    name = "bfloat16_kahan" if dtype is torch.bfloat16 else FLOAT16_KAHAN
    params = _params(dtype)
    opt = PrecisionOptimizer(torch.optim.SGD(params, lr=0.3), name)
    compensation = [[0.0] * p.numel() for p in params]
    for step in range(4):
        _set_grads(params, step)
        targets = _float32_targets(params, 0.3)
        expected = []
        for i, (p, target) in enumerate(zip(params, targets)):
            pairs = [
                write_update(w, t, dtype=str(dtype)[6:], rounding="kahan", compensation=c)
                for w, t, c in zip(_floats(p), _floats(target), compensation[i])
            ]
            expected.append([w for w, _ in pairs])
            compensation[i] = [c for _, c in pairs]
        opt.step()
        for i, p in enumerate(params):
            assert _floats(p) == expected[i]
            assert _floats(opt.state[p][KAHAN_KEY]) == compensation[i]
            assert opt.state[p][KAHAN_KEY].dtype is dtype
    assert any(c != 0.0 for row in compensation for c in row)  # the buffers carried something


def test_nearest_writes_equal_the_reference() -> None:
    params = _params(torch.bfloat16)
    with pytest.warns(polyamp.TrainingStateWarning):
        opt = PrecisionOptimizer(torch.optim.SGD(params, lr=0.3), "bfloat16")
    for step in range(3):
        _set_grads(params, step)
        targets = _float32_targets(params, 0.3)
        opt.step()
        for p, target in zip(params, targets):
            assert _floats(p) == [round_to(t, "bfloat16") for t in _floats(target)]


def test_master_copy_is_the_float32_result_and_the_weight_its_rounding() -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.SGD(params, lr=0.3, momentum=0.9), "bfloat16_float32_master")
    reference = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.SGD(reference, lr=0.3, momentum=0.9)
    for step in range(4):
        _step_side_by_side(opt, params, ref_opt, reference, step)
        for p, r in zip(params, reference):
            master = opt.state[p][MASTER_KEY]
            assert master.dtype is torch.float32 and torch.equal(master, r.detach())
            assert _floats(p) == [round_to(v, "bfloat16") for v in _floats(r)]
            assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[r]["momentum_buffer"])


def test_stochastic_writes_use_the_seeded_stream_in_parameter_order() -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.SGD(params, lr=0.3), "bfloat16_stochastic", seed=7)
    stream = torch.Generator().manual_seed(7)
    for step in range(3):
        _set_grads(params, step)
        targets = _float32_targets(params, 0.3)
        bits = [torch.randint(0, 65536, p.shape, generator=stream, dtype=torch.int32) for p in params]
        opt.step()
        for p, target, random16 in zip(params, targets, bits):
            expected = [
                write_update(0.0, t, dtype="bfloat16", rounding="stochastic", random16=r)[0]
                for t, r in zip(_floats(target), random16.reshape(-1).tolist())
            ]
            assert _floats(p) == expected


def test_stochastic_rounding_is_unbiased_and_reproducible() -> None:
    def run(seed: int) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.ones(200_000, dtype=torch.bfloat16))
        opt = PrecisionOptimizer(torch.optim.SGD([weight], lr=1.0), "bfloat16_stochastic", seed=seed)
        weight.grad = torch.full_like(weight, -(2.0**-10))  # target 1 + 2**-10: an eighth of bfloat16's ulp at 1
        opt.step()
        return weight.detach().float()

    first = run(3)
    assert set(first.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    # Each write is 1 + ulp with probability 1/8: the mean's standard deviation is ulp * sqrt(7/64) / sqrt(n).
    sigma = 2.0**-7 * math.sqrt(7 / 64) / math.sqrt(first.numel())
    assert abs(first.double().mean().item() - (1.0 + 2.0**-10)) < 5 * sigma
    assert torch.equal(run(3), first)
    assert not torch.equal(run(4), first)


# -- pass-through, chunks and implementations ------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    ],
    ids=["adamw-for-loop", "adamw-foreach", "adamw-fused", "sgd-nesterov", "adagrad"],
)
def test_float32_default_plan_is_a_pass_through(make) -> None:
    plain_params = _params(torch.float32, shapes=((6, 5), (7,), (3, 3)))
    wrapped_params = [torch.nn.Parameter(p.detach().clone()) for p in plain_params]
    plain = make(plain_params)
    wrapped = PrecisionOptimizer(make(wrapped_params), "float32", chunk_bytes=1)
    for step in range(4):
        _set_grads(plain_params, step)
        _set_grads(wrapped_params, step)
        plain.step()
        wrapped.step()
    for a, b in zip(plain_params, wrapped_params):
        assert torch.equal(a, b)
        assert plain.state[a].keys() == wrapped.state[b].keys()
        for key, value in plain.state[a].items():
            assert torch.equal(value, wrapped.state[b][key]) and value.dtype == wrapped.state[b][key].dtype
    assert not wrapped.optimizer.state  # all the state lives in the PrecisionOptimizer between steps


@pytest.mark.parametrize("name", PRESETS)
def test_chunk_size_does_not_change_results(name) -> None:
    results = []
    for chunk_bytes in (1, 1 << 30):
        params = _params(torch.bfloat16, shapes=((6, 5), (7,), (4, 4), (9,)))
        opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2, foreach=True), name, chunk_bytes=chunk_bytes)
        for step in range(3):
            _set_grads(params, step)
            opt.step()
        results.append(_snapshot(opt, params))
    assert _bitwise_equal(*results)


def test_for_loop_foreach_and_fused_adamw_agree_inside() -> None:
    masters = []
    for options in ({"foreach": False}, {"foreach": True}, {"fused": True}):
        params = _params(torch.bfloat16)
        opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2, **options), "bfloat16_float32_master")
        for step in range(5):
            _set_grads(params, step)
            opt.step()
        masters.append([opt.state[p][MASTER_KEY] for p in params])
    for other in masters[1:]:
        for a, b in zip(masters[0], other):
            torch.testing.assert_close(a, b)  # torch's own float32 tolerance between its implementations


# -- the state per plan, and its bytes --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "moments", "master", "kahan"),
    [
        ("bfloat16_float32_master", torch.float32, True, False),
        ("bfloat16_kahan", torch.bfloat16, False, True),
        ("bfloat16_stochastic", torch.bfloat16, False, False),
        ("params=bfloat16,compute=bfloat16,state=bfloat16,master=float32", torch.bfloat16, True, False),
    ],
)
def test_state_dtypes_follow_the_plan(name, moments, master, kahan) -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-3), name)
    _set_grads(params, 0)
    opt.step()
    for p in params:
        state = opt.state[p]
        assert state["exp_avg"].dtype is moments and state["exp_avg_sq"].dtype is moments
        assert state["step"].dtype is torch.float32 and float(state["step"]) == 1.0  # counters as AdamW keeps them
        assert (MASTER_KEY in state, KAHAN_KEY in state) == (master, kahan)
        if master:
            assert state[MASTER_KEY].dtype is torch.float32
        if kahan:
            assert state[KAHAN_KEY].dtype is torch.bfloat16


@pytest.mark.parametrize(("name", "expected"), [*zip(PRESETS, (16, 10, 8)), ("float32", 16)])
def test_adamw_training_state_bytes_measured_from_the_tensors(name, expected) -> None:
    dtype = torch.float32 if name == "float32" else torch.bfloat16
    params = _params(dtype, shapes=((64, 32), (32,)))
    opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-3), name)
    _set_grads(params, 0)
    opt.step()
    measured = measure_state_bytes(opt)
    assert measured.parameters == 64 * 32 + 32
    assert measured.per_parameter == expected == polyamp.state_bytes(name).total
    assert measured.total == expected * measured.parameters
    assert measured.breakdown() == polyamp.state_bytes(name)._asdict()
    plain = torch.optim.AdamW(params, lr=1e-3)
    plain.step()
    assert measure_state_bytes(plain).per_parameter == 4 * dtype.itemsize  # weight, gradient, two moments


# -- skipped steps ------------------------------------------------------------------------------------


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(dtype)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=generator).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


def _train_with_a_bad_step(
    model: torch.nn.Module,
    opt: PrecisionOptimizer,
    scaler: polyamp.LossScaler,
    steps: int,
    bad: tuple[int, int, int, float],
) -> bool:
    """``steps`` steps on `_loss`; at step ``bad[0]`` element ``bad[2]`` of parameter ``bad[1]``'s gradient is set
    to ``bad[3]``, and that step must leave every tensor of the training state bit for bit as it was. Returns
    ``scaler.step_skipped(opt)`` read right after that step."""
    params = list(model.parameters())
    bad_step, index, element, value = bad
    skipped = False
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        if step == bad_step:
            before = _snapshot(opt, params)
            params[index].grad.view(-1)[element] = value
        scaler.step(opt)
        scaler.update()
        if step == bad_step:
            skipped = scaler.step_skipped(opt)
            assert _bitwise_equal(_snapshot(opt, params), before)
    return skipped


def test_loss_scaler_skips_an_overflowing_step_of_float16_kahan_leaving_all_state_intact() -> None:
    model = _model(torch.float16)
    params = list(model.parameters())
    with polyamp.policy_scope(FLOAT16_KAHAN):
        opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2))
        # (enabled=True: under float16 parameters the scaler leaves scaling off unless told the update is
        # formed in float32, which PrecisionOptimizer does)
        scaler = polyamp.LossScaler(init_scale=256.0, enabled=True)
        _train_with_a_bad_step(model, opt, scaler, 4, (2, 0, 3, float("inf")))
    records = scaler.records()
    assert [(r.skipped, r.reason) for r in records] == [(False, None), (False, None), (True, "overflow"), (False, None)]
    assert float(opt.state[params[0]]["step"]) == 3.0
    assert all(torch.isfinite(p).all() for p in params)
    assert opt.state[params[0]][KAHAN_KEY].dtype is torch.float16


TINY = (2.0**-27, 3e-6, -(2.0**-30), 1e-3)  # true gradients: below float16's range, subnormal there, normal


def _tiny_gradient_step(scaler) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Parameter, PrecisionOptimizer]:
    """One scaled step of Adam over a float16 weight whose true gradient is `TINY`; the moments (float32) and
    the gradient as the scaler left it."""
    weight = torch.nn.Parameter(torch.ones(len(TINY), dtype=torch.float16))
    opt = PrecisionOptimizer(torch.optim.Adam([weight], lr=1e-3), FLOAT16_KAHAN)
    loss = (weight.float() * torch.tensor(TINY)).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return opt.state[weight]["exp_avg"], opt.state[weight]["exp_avg_sq"], weight, opt


@pytest.mark.parametrize("make", [polyamp.LossScaler, torch.amp.GradScaler], ids=["polyamp", "torch"])
def test_float16_gradients_are_unscaled_in_float32_inside_the_step(make) -> None:
    # At scale 2**16 each gradient is a float16 value (2**-27 becomes 2**-11 exactly); unscaled in float16 the
    # first and third flush to zero and 3e-6 lands on float16's subnormal grid (0.7% off). The step unscales in
    # float32 as it makes the working copy: Adam's float32 moments get the scaled float16 values times 1/scale,
    # computed in float32, as torch's fused optimizers do with grad_scale.
    scaler = make("cpu", init_scale=2.0**16) if make is torch.amp.GradScaler else make(init_scale=2.0**16, enabled=True)
    exp_avg, exp_avg_sq, weight, _ = _tiny_gradient_step(scaler)
    scaled = (torch.tensor(TINY) * 2.0**16).to(torch.float16)
    assert torch.equal(weight.grad, scaled)  # the gradients stay as backward left them: nothing in float16
    true = scaled.float() * torch.tensor(2.0**-16)
    assert true[0].item() == 2.0**-27 and true[2].item() == -(2.0**-30)
    assert abs(true[1].item() / 3e-6 - 1) < 2**-11
    assert torch.equal(exp_avg, (1 - 0.9) * true)
    assert torch.equal(exp_avg_sq, (1 - 0.999) * true * true)


def test_a_float16_gradient_unscaled_by_hand_keeps_its_float16_value() -> None:
    # scaler.unscale_ (to clip) unscales in place, in the gradients' dtype, as it does for any optimizer: the
    # step then takes them as they are.
    scaler = polyamp.LossScaler(init_scale=2.0**16, enabled=True)
    weight = torch.nn.Parameter(torch.ones(len(TINY), dtype=torch.float16))
    opt = PrecisionOptimizer(torch.optim.Adam([weight], lr=1e-3), FLOAT16_KAHAN)
    scaler.scale((weight.float() * torch.tensor(TINY)).sum()).backward()
    scaler.unscale_(opt)
    unscaled = weight.grad.clone()
    scaler.step(opt)
    scaler.update()
    assert unscaled[0].item() == 0.0 and unscaled[3].item() != 0.0
    assert torch.equal(opt.state[weight]["exp_avg"], (1 - 0.9) * unscaled.float())


def test_float32_gradients_unscaled_in_the_step_equal_the_unscaled_ones_bit_for_bit() -> None:
    # float32 parameters under the plan: the step's float32 unscale is the scaler's kernel's multiply, and the
    # model's gradients keep their scaled values.
    runs = []
    for by_hand in (False, True):
        model = _model(torch.float32)
        opt = PrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "float32")
        scaler = polyamp.LossScaler(init_scale=2.0**10, enabled=True)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(_loss(model, step)).backward()
            if by_hand:
                scaler.unscale_(opt)
            scaled = [p.grad.clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            if not by_hand:
                assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), scaled))
        runs.append(_snapshot(opt, list(model.parameters())))
    assert _bitwise_equal(runs[0], runs[1])


def test_guard_skips_a_non_finite_bfloat16_step_leaving_all_state_and_the_stream_intact() -> None:
    model = _model(torch.bfloat16)
    params = list(model.parameters())
    with polyamp.policy_scope("bfloat16_stochastic"):
        opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2))
        scaler = polyamp.LossScaler()  # no scaling under bfloat16: it guards
        assert _train_with_a_bad_step(model, opt, scaler, 3, (1, 2, 0, float("nan")))
    assert [(r.skipped, r.reason) for r in scaler.records()] == [(False, None), (True, "non_finite"), (False, None)]


# -- schedulers, groups, zero_grad -----------------------------------------------------------------------


def test_lr_scheduler_drives_the_wrapped_optimizer_and_the_master_matches_float32_adamw() -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16_float32_master")
    reference = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(reference, lr=1e-2)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5) for o in (opt, ref_opt)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for step in range(5):
            _step_side_by_side(opt, params, ref_opt, reference, step)
            for scheduler in schedulers:
                scheduler.step()
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != 1e-2
    for p, r in zip(params, reference):
        assert torch.equal(opt.state[p][MASTER_KEY], r.detach())
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])


def test_add_param_group_and_zero_grad() -> None:
    first, second = _params(torch.bfloat16, shapes=((3,), (4,)))
    opt = PrecisionOptimizer(torch.optim.SGD([first], lr=0.1), "bfloat16_kahan")
    opt.add_param_group({"params": [second], "lr": 0.5})
    assert len(opt.optimizer.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.5
    assert opt.state[second][KAHAN_KEY].dtype is torch.bfloat16
    _set_grads([first, second], 0)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(second.grad, torch.zeros_like(second))
    opt.zero_grad()
    assert first.grad is None and second.grad is None
    with pytest.raises(polyamp.InvalidConfigError, match=r"float16.*'bfloat16_kahan'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.float16))]})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("inner", [torch.optim.AdamW, torch.optim.Adagrad], ids=["adamw", "adagrad"])
def test_a_group_added_through_the_inner_optimizer_steps_as_one_added_through_the_wrapper(name, inner) -> None:
    # Either optimizer's add_param_group works: the inner one's group gets its master copies, compensation
    # buffers and moved state (Adagrad makes its sums when the group is added) at the next step.
    runs = []
    for through in ("wrapper", "inner"):
        first, second = _params(torch.bfloat16, shapes=((3, 2), (4,)))
        opt = PrecisionOptimizer(inner([first], lr=1e-2), name, seed=3)
        target = opt if through == "wrapper" else opt.optimizer
        target.add_param_group({"params": [second], "lr": 0.5})
        _train(opt, [first, second], range(3))
        assert not opt.optimizer.state  # everything lives in the wrapper's state between steps
        runs.append(_snapshot(opt, [first, second]))
    assert _bitwise_equal(runs[1], runs[0])


def test_a_parameter_of_another_dtype_added_through_the_inner_optimizer_is_refused_at_the_step() -> None:
    first = _params(torch.bfloat16, shapes=((3,),))[0]
    opt = PrecisionOptimizer(torch.optim.AdamW([first], lr=1e-2), "bfloat16_kahan")
    _train(opt, [first], range(1))
    stray = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt.optimizer.add_param_group({"params": [stray]})
    first.grad, stray.grad = torch.ones_like(first), torch.ones_like(stray)
    before = _snapshot(opt, [first, stray])
    with pytest.raises(polyamp.InvalidConfigError, match=r"param_groups\[1\]\['params'\]\[0\].*float16"):
        opt.step()
    assert _bitwise_equal(_snapshot(opt, [first, stray]), before)


def test_closure_is_called_once_before_the_update() -> None:
    model = _model(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "bfloat16_kahan")
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        opt.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        return loss

    before = model[0].weight.detach().clone()
    loss = opt.step(closure)
    assert len(calls) == 1 and loss is not None and not torch.equal(before, model[0].weight)


# -- bad input ---------------------------------------------------------------------------------------


def test_bad_construction_is_refused_with_what_was_received() -> None:
    params = _params(torch.bfloat16)
    named = [("encoder.weight", params[0]), ("encoder.bias", params[1])]
    with pytest.raises(polyamp.InvalidConfigError, match=r"'encoder.weight' \(shape \(6, 5\)\) is bfloat16.*float16"):
        PrecisionOptimizer(torch.optim.SGD(named, lr=0.1), FLOAT16_KAHAN)
    with pytest.raises(polyamp.InvalidConfigError, match=r"param_groups\[0\]\['params'\]\[0\].*'float32'"):
        PrecisionOptimizer(torch.optim.SGD(params, lr=0.1), "float32")
    with pytest.raises(polyamp.PolyampTypeError, match=r"(?s)Received: .*of type list"):
        PrecisionOptimizer(params, "bfloat16_kahan")  # type: ignore[arg-type]
    with pytest.raises(polyamp.PolyampTypeError, match="LBFGS"):
        PrecisionOptimizer(torch.optim.LBFGS(params), "bfloat16_kahan")
    with pytest.raises(polyamp.InvalidConfigError, match="chunk_bytes"):
        PrecisionOptimizer(torch.optim.SGD(params, lr=0.1), "bfloat16_kahan", chunk_bytes=0)
    with pytest.raises(polyamp.InvalidPolicyError):
        PrecisionOptimizer(torch.optim.SGD(params, lr=0.1), "bfloat16_sloppy")


def test_policy_none_takes_the_policy_in_effect_at_construction() -> None:
    params = _params(torch.bfloat16)
    with polyamp.policy_scope("bfloat16_stochastic"):
        opt = PrecisionOptimizer(torch.optim.SGD(params, lr=0.1))
    assert opt.policy == polyamp.Policy("bfloat16_stochastic")


# -- checkpoints -------------------------------------------------------------------------------------


def _train(opt, params, steps: range) -> None:
    for step in steps:
        _set_grads(params, step)
        opt.step()


@pytest.mark.parametrize("name", PRESETS)
def test_state_dict_round_trip_is_exact(name) -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), name, seed=5)
    _train(opt, params, range(3))
    checkpoint = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    _train(opt, params, range(3, 6))

    resumed = [torch.nn.Parameter(w.clone()) for w in weights]
    again = PrecisionOptimizer(torch.optim.AdamW(resumed, lr=1.0), name, seed=99)
    again.load_state_dict(checkpoint)
    assert again.param_groups[0]["lr"] == 1e-2
    if name == "bfloat16_float32_master":
        assert again.state[resumed[0]][MASTER_KEY].dtype is torch.float32
    _train(again, resumed, range(3, 6))
    assert _bitwise_equal(_snapshot(again, resumed), _snapshot(opt, params))


def _copied(how: str, obj):
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    if how == "deepcopy":
        return copy.deepcopy(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
@pytest.mark.parametrize("name", PRESETS)
def test_a_pickled_or_copied_optimizer_goes_on_as_the_original(name, how) -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), name, seed=7, chunk_bytes=64)
    _train(opt, params, range(2))
    copied_params, copied = _copied(how, (params, opt))
    assert copied.param_groups is copied.optimizer.param_groups  # still one list: groups added to either show
    assert (copied.policy, copied.seed, copied.chunk_bytes) == (opt.policy, 7, 64)
    _train(opt, params, range(2, 4))
    _train(copied, copied_params, range(2, 4))
    assert _bitwise_equal(_snapshot(copied, copied_params), _snapshot(opt, params))
    assert copied.state_dict()["polyamp"]["generators"].keys() == opt.state_dict()["polyamp"]["generators"].keys()


def test_plain_adamw_checkpoint_loads_into_a_bfloat16_state_plan_with_one_note(caplog) -> None:
    float32_params = _params(torch.float32)
    plain = torch.optim.AdamW(float32_params, lr=1e-2)
    _train(plain, float32_params, range(2))
    checkpoint = plain.state_dict()
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in float32_params]
    opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16_kahan")
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        opt.load_state_dict(checkpoint)
    notes = [r for r in caplog.records if r.name == "polyamp"]
    assert len(notes) == 1
    assert "slots were saved in float32 and are loaded as bfloat16" in notes[0].getMessage()
    assert "(rounded to nearest)" in notes[0].getMessage()
    assert "no Kahan compensation" in notes[0].getMessage()
    for p, source in zip(params, float32_params):
        assert opt.state[p]["exp_avg"].dtype is torch.bfloat16
        assert torch.equal(opt.state[p]["exp_avg"], plain.state[source]["exp_avg"].to(torch.bfloat16))
        assert torch.equal(opt.state[p]["step"], plain.state[source]["step"])
        assert torch.equal(opt.state[p][KAHAN_KEY], torch.zeros_like(p))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        opt.load_state_dict(opt.state_dict())  # its own plan: nothing to say
    assert not [r for r in caplog.records if r.name == "polyamp"]


def test_master_checkpoint_into_a_kahan_plan_and_back_converts_with_a_note(caplog) -> None:
    params = _params(torch.bfloat16)
    master = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16_float32_master")
    _train(master, params, range(2))
    kahan = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16_kahan")
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        kahan.load_state_dict(master.state_dict())
    (note,) = [r.getMessage() for r in caplog.records if r.name == "polyamp"]
    assert "float32 master copies are dropped" in note and "no Kahan compensation buffers" in note
    assert "slots were saved in float32 and are loaded as bfloat16" in note
    assert MASTER_KEY not in kahan.state[params[0]]
    assert kahan.state[params[0]]["exp_avg"].dtype is torch.bfloat16
    caplog.clear()
    back = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16_float32_master")
    with caplog.at_level(logging.WARNING, logger="polyamp"):
        back.load_state_dict(kahan.state_dict())
    (note,) = [r.getMessage() for r in caplog.records if r.name == "polyamp"]
    assert "no master copies (it was saved under another plan): they are made from the bfloat16 weights" in note
    assert "Kahan compensation buffers are dropped" in note
    assert "(exactly)" in note and "(rounded" not in note
    assert torch.equal(back.state[params[0]][MASTER_KEY], params[0].detach().float())
    assert back.state[params[0]]["exp_avg"].dtype is torch.float32


@pytest.mark.parametrize(
    ("break_it", "match"),
    [
        (lambda sd: [1, 2], "must be a dict with 'state' and 'param_groups'"),
        (lambda sd: {"state": sd["state"]}, r"with keys \['state'\]"),
        (lambda sd: {**sd, "param_groups": sd["param_groups"] * 2}, "2 parameter groups; this optimizer has 1"),
        (
            lambda sd: {**sd, "param_groups": [{**sd["param_groups"][0], "params": [0]}]},
            "group 0 has 1 parameters; this optimizer's has 2",
        ),
        (lambda sd: {**sd, "state": {**sd["state"], 7: {}}}, "parameter index 7"),
        (lambda sd: {**sd, "state": {0: {**sd["state"][0], "exp_avg": torch.zeros(2)}}}, r"shape \(2,\)"),
        (lambda sd: {**sd, "state": {0: "oops"}}, "must be a dict with str keys"),
        (lambda sd: {**sd, "polyamp": {"generators": {"cpu": torch.zeros(3)}}}, "get_state"),
        # Entries the next step could not use, each against what AdamW keeps: the same shape (broadcasting is
        # not enough), a one-element step counter, a floating moment, a tensor, every key.
        (
            lambda sd: _with(sd, "exp_avg", torch.zeros(1)),
            r"'exp_avg' .*\(shape \(6, 5\)\) must be a floating tensor of shape \(6, 5\), as AdamW keeps it\. "
            r"Received: a float32 tensor of shape \(1,\)",
        ),
        (
            lambda sd: _with(sd, "exp_avg", torch.zeros(6, 1)),
            r"'exp_avg' .*Received: a float32 tensor of shape \(6, 1\)",
        ),
        (
            lambda sd: _with(sd, "step", torch.zeros(6, 5)),
            r"'step' .*must be a floating tensor of shape \(\).*Received: a float32 tensor of shape \(6, 5\)",
        ),
        (
            lambda sd: _with(sd, "exp_avg_sq", torch.zeros(6, 5, dtype=torch.int64)),
            r"'exp_avg_sq' .*must be a floating tensor.*Received: an int64 tensor of shape \(6, 5\)",
        ),
        (lambda sd: _with(sd, "exp_avg", [0.0] * 30), r"'exp_avg' .*must be a floating tensor.*Received: .*list"),
        (lambda sd: _with(sd, "exp_avg_sq", None), r"'exp_avg_sq' .*must be a floating tensor.*Received: nothing"),
    ],
    ids=[
        "not-a-dict",
        "missing-key",
        "groups",
        "group-size",
        "unknown-index",
        "shape",
        "entry",
        "generator",
        "moment-of-one-element",
        "moment-that-broadcasts",
        "counter-of-the-weights-shape",
        "integer-moment",
        "moment-as-a-list",
        "moment-missing",
    ],
)
def test_malformed_state_dict_raises_and_leaves_the_optimizer_unchanged(break_it, match) -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16_stochastic")
    _train(opt, params, range(2))
    before = _snapshot(opt, params)
    lr = opt.param_groups[0]["lr"]
    with pytest.raises(polyamp.StateDictError, match=match):
        opt.load_state_dict(break_it(opt.state_dict()))
    assert _bitwise_equal(_snapshot(opt, params), before) and opt.param_groups[0]["lr"] == lr
    _train(opt, params, range(2, 3))  # and it steps on


def _with(state_dict, key: str, value):
    """``state_dict`` with the first parameter's ``key`` set to ``value`` (None: removed)."""
    entry = {k: v for k, v in state_dict["state"][0].items() if k != key}
    if value is not None:
        entry[key] = value
    return {**state_dict, "state": {**state_dict["state"], 0: entry}}


@pytest.mark.parametrize(
    ("make", "own_step"),
    [
        (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), True),
        (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), False),
        (lambda p: torch.optim.NAdam(p, lr=1e-2), True),
        (lambda p: torch.optim.Adafactor(p, lr=1e-2), True),
    ],
    ids=["adamw-fused", "sgd-momentum", "nadam", "adafactor"],
)
def test_checkpoints_of_other_optimizers_load_and_mismatched_counters_are_refused(make, own_step) -> None:
    # What the inner optimizer keeps is found by running its own step on meta tensors (fused kernels off); an
    # optimizer that cannot run there (Adafactor reads a value to the host) is held to the looser rules, which
    # still refuse a step counter of the weight's shape.
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(make(params), "bfloat16_kahan")
    _train(opt, params, range(2))
    checkpoint = opt.state_dict()
    again = PrecisionOptimizer(make(params), "bfloat16_kahan")
    again.load_state_dict(checkpoint)
    assert _bitwise_equal(_snapshot(again, params), _snapshot(opt, params))
    if own_step:
        before = _snapshot(again, params)
        with pytest.raises(polyamp.StateDictError, match=r"'step' .*Received: .*tensor of shape \(6, 5\)"):
            again.load_state_dict(_with(checkpoint, "step", torch.ones(6, 5)))
        assert _bitwise_equal(_snapshot(again, params), before)


def test_the_probe_runs_no_hooks_and_leaves_the_inner_optimizer_as_it_was() -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16_kahan")
    _train(opt, params, range(1))
    calls = []
    opt.optimizer.register_step_pre_hook(lambda *args: calls.append("pre"))
    opt.optimizer.register_step_post_hook(lambda *args: calls.append("post"))
    groups = opt.optimizer.param_groups
    opt.load_state_dict(opt.state_dict())
    assert calls == [] and opt.optimizer.param_groups is groups and not opt.optimizer.state


# -- the hazard ----------------------------------------------------------------------------------------


def test_scaler_stepping_a_plain_optimizer_over_bfloat16_weights_warns_once() -> None:
    model = _model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with polyamp.policy_scope("bfloat16"):
        scaler = polyamp.LossScaler()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                opt.zero_grad()
                scaler.scale(_loss(model, step)).backward()
                scaler.step(opt)
                scaler.update()
    hazards = [w for w in caught if issubclass(w.category, polyamp.TrainingStateWarning)]
    assert len(hazards) == 1
    assert str(hazards[0].message).startswith("SGD updates bfloat16 weights directly")
    assert hazards[0].filename == __file__


def test_planned_precision_optimizers_and_float32_weights_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in PRESETS:
            model = _model(torch.bfloat16)
            opt = PrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), name)
            with polyamp.policy_scope(name):
                scaler = polyamp.LossScaler()
                for step in range(2):
                    scaler.scale(_loss(model, step)).backward()
                    scaler.step(opt)
                    scaler.update()
        model = _model(torch.float32)
        scaler = polyamp.LossScaler()
        plain = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler.scale(_loss(model, 0)).backward()
        scaler.step(plain)
        scaler.update()


def test_precision_optimizer_under_a_nearest_plan_warns_once() -> None:
    params = _params(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16")
        _train(opt, params, range(2))
    hazards = [w for w in caught if issubclass(w.category, polyamp.TrainingStateWarning)]
    assert len(hazards) == 1 and "PrecisionOptimizer(AdamW) updates bfloat16 weights" in str(hazards[0].message)
    assert hazards[0].filename == __file__


# -- what it is for --------------------------------------------------------------------------------------


def test_kahan_and_stochastic_track_the_float32_master_while_nearest_stalls() -> None:
    """Least squares with bfloat16 weights near 1.5 and updates below half a bfloat16 ulp there (0.004)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    solution = 1.5 + 0.1 * torch.randn(16, generator=generator)
    y = x @ solution

    def final_loss(name: str) -> float:
        weight = torch.nn.Parameter(torch.full((16,), 1.5, dtype=torch.bfloat16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", polyamp.TrainingStateWarning)
            opt = PrecisionOptimizer(torch.optim.SGD([weight], lr=1e-2), name)
        for _ in range(300):
            residual = x @ weight.detach().float() - y
            weight.grad = (x.T @ residual / len(x)).to(torch.bfloat16)
            opt.step()
        return float((x @ weight.detach().float() - y).pow(2).mean())

    start = float((x @ torch.full((16,), 1.5) - y).pow(2).mean())
    losses = {name: final_loss(name) for name in ("bfloat16_float32_master", *PRESETS[1:], "bfloat16")}
    master = losses["bfloat16_float32_master"]
    assert master < start / 100
    # Both reach the float32 master's loss up to bfloat16's own resolution of the solution; nearest never moves.
    assert losses["bfloat16_kahan"] < start / 50 and losses["bfloat16_stochastic"] < start / 50
    assert losses["bfloat16"] > start / 2
    assert losses["bfloat16"] > 10 * max(losses["bfloat16_kahan"], losses["bfloat16_stochastic"])


# -- the conformance harness -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "own_keys"), [("bfloat16_float32_master", 1), ("bfloat16_kahan", 1), ("mixed_bfloat16", 0)]
)
def test_harness_trainer_follows_the_plan_and_reports_its_state(name, own_keys) -> None:
    np = pytest.importorskip("numpy")
    from polyamp_torch.testing import TorchHarness

    harness = TorchHarness("cpu")
    assert "precision" in harness.capabilities
    trainer = harness.trainer(polyamp.Policy(name), optimizer="adam")
    assert isinstance(trainer.opt, PrecisionOptimizer) is (own_keys == 1)
    rng = np.random.default_rng(0)
    trainer.step(rng.standard_normal((8, 8)).astype(np.float32), rng.integers(0, 4, 8))
    parameters = list(trainer.model.parameters())
    assert {str(p.dtype) for p in parameters} == {"torch." + polyamp.Policy(name).param_dtype}
    # Per parameter: exp_avg, exp_avg_sq, step, and the plan's master copy or compensation buffer.
    assert len(trainer.optimizer_state()) == len(parameters) * (3 + own_keys)


@pytest.mark.parametrize("poison", [None, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("check_unscaled", [False, True])
def test_bfloat16_check_and_unscale_for_accelerators_equals_torchs_cpu_kernel(poison, check_unscaled) -> None:
    # torch's CUDA kernel has no bfloat16 form; polyamp's replacement must give the CPU kernel's flag and values.
    from polyamp_torch._gradients import _check_and_unscale_bfloat16

    generator = torch.Generator().manual_seed(3)
    grads = [torch.randn(shape, generator=generator).mul(1e4).bfloat16() for shape in [(7, 5), (33,), (2, 3, 4)]]
    if poison is not None:
        grads[1][17] = poison
    inv_scale = torch.tensor(1 / 3.0)
    expected = [g.clone() for g in grads]
    expected_flag = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_flag, inv_scale)
    if check_unscaled:
        torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_flag, torch.ones(()))
    flag = torch.zeros(())
    _check_and_unscale_bfloat16(grads, flag, inv_scale, check_unscaled)
    assert flag.item() == (0.0 if poison is None else 1.0)
    assert flag.item() == expected_flag.item()
    for got, want in zip(grads, expected, strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_adafactor_factored_statistics_are_slots_and_its_checkpoint_round_trips() -> None:
    # Adafactor's row_var/col_var do not have the parameter's shape: they are slots all the same (the core's
    # is_state_slot), kept in the state dtype, and a checkpoint of them loads back exactly.
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.Adafactor(params, lr=1e-2), "bfloat16_stochastic")
    _train(opt, params, range(2))
    state = opt.state[params[0]]
    factored = {key: value for key, value in state.items() if key in ("row_var", "col_var")}
    assert factored and all(v.dtype is torch.bfloat16 and v.shape != params[0].shape for v in factored.values())
    again = PrecisionOptimizer(torch.optim.Adafactor(params, lr=1e-2), "bfloat16_stochastic")
    again.load_state_dict(opt.state_dict())
    assert _bitwise_equal(_snapshot(again, params), _snapshot(opt, params))


def test_a_state_tensor_that_does_not_fit_its_parameter_is_refused() -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16_kahan")
    _train(opt, params, range(1))
    checkpoint = opt.state_dict()
    shape = tuple(params[0].shape)
    checkpoint["state"][0]["exp_avg"] = torch.zeros(shape[0] + 1, *shape[1:])
    fresh = PrecisionOptimizer(torch.optim.AdamW(params, lr=1e-2), "bfloat16_kahan")
    before = _snapshot(fresh, params)
    with pytest.raises(polyamp.StateDictError, match=r"'exp_avg' .*Received: a float32 tensor of shape \(7, 5\)"):
        fresh.load_state_dict(checkpoint)
    assert _bitwise_equal(_snapshot(fresh, params), before)


def test_sparse_gradients_step_by_the_plan() -> None:
    # SparseAdam over a bfloat16 embedding with sparse gradients: the rows looked up move, the others keep
    # their bits, and the moments are kept in the plan's state dtype.
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(torch.bfloat16)
    before = embedding.weight.detach().clone()
    opt = PrecisionOptimizer(torch.optim.SparseAdam(embedding.parameters(), lr=1e-1), "bfloat16_kahan")
    for _ in range(2):
        opt.zero_grad()
        embedding(torch.tensor([1, 2, 2])).float().sum().backward()
        assert embedding.weight.grad.is_sparse
        opt.step()
    moved = (embedding.weight.detach() != before).any(dim=1)
    assert moved.tolist() == [i in (1, 2) for i in range(10)]
    state = opt.state[embedding.weight]
    assert state["exp_avg"].dtype is torch.bfloat16 and state[KAHAN_KEY].dtype is torch.bfloat16


def test_a_scalar_parameters_moments_are_slots_too() -> None:
    # A 0-d parameter's moments are 0-d as well: they follow the state dtype like any other moment; its step
    # counter does not.
    scalar = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.bfloat16))
    opt = PrecisionOptimizer(torch.optim.AdamW([scalar], lr=1e-2), "bfloat16_kahan")
    scalar.grad = torch.tensor(0.25, dtype=torch.bfloat16)
    opt.step()
    state = opt.state[scalar]
    assert state["exp_avg"].dtype is torch.bfloat16 and state["exp_avg_sq"].dtype is torch.bfloat16
    assert state["step"].dtype is torch.float32
    assert measure_state_bytes(opt).per_parameter == 10
