"""Gradient clipping folded into the unscale (`polyamp_torch.clip_grad_norm_` / `LossScaler.unscale_and_clip_`):
one norm pass over the scaled gradients and one multiply, bit for bit what ``GradScaler.unscale_`` followed by
``torch.nn.utils.clip_grad_norm_`` gives, run side by side on the same data with injected overflows."""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import polyamp  # noqa: E402
import polyamp_torch  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam-for-loop": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


def _model(dtype: Any = torch.float32) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model.to(dtype)


def _batch(step: int, dtype: Any = torch.float32) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(16, 8, generator=generator).to(dtype), torch.randn(16, 4, generator=generator).to(dtype)


def _scaled_sgd(step: int) -> tuple[Any, Any, Any]:
    """A fresh model, its SGD optimizer and a scaling LossScaler, after the scaled backward of batch ``step``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = polyamp.LossScaler(enabled=True)
    x, y = _batch(step)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    return model, opt, scaler


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def _side_by_side(make: Any, max_norm: float, norm_type: float, steps: int = 12, inf_at: tuple[int, ...] = (3, 7)):
    """polyamp (folded) and torch.amp.GradScaler (unscale_ then clip_grad_norm_) on the same batches."""
    models = {name: _model() for name in ("polyamp", "native")}
    opts = {name: make(m.parameters()) for name, m in models.items()}
    ours = polyamp.LossScaler(enabled=True, init_scale=2.0**10, growth_interval=3)
    native = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    norms: dict[str, list[Any]] = {"polyamp": [], "native": []}
    for step in range(steps):
        x, y = _batch(step)
        if step in inf_at:
            x = x.clone()
            x[0, 0] = math.inf
        for name, scaler in (("polyamp", ours), ("native", native)):
            opts[name].zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(models[name](x), y)).backward()
            if name == "polyamp":
                norms[name].append(polyamp_torch.clip_grad_norm_(ours, opts[name], max_norm, norm_type))
            else:
                native.unscale_(opts[name])
                norms[name].append(torch.nn.utils.clip_grad_norm_(models[name].parameters(), max_norm, norm_type))
            scaler.step(opts[name])
            scaler.update()
    return models, opts, ours, native, norms


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipping every step, and never
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_folded_clipping_equals_gradscaler_unscale_then_clip(optimizer: str, max_norm: float, norm_type: float) -> None:
    models, opts, ours, native, norms = _side_by_side(OPTIMIZERS[optimizer], max_norm, norm_type)
    for a, b in zip(norms["polyamp"], norms["native"], strict=True):
        assert (a.dtype == b.dtype and torch.equal(a, b)) or (torch.isnan(a) and torch.isnan(b))
    for a, b in zip(models["polyamp"].parameters(), models["native"].parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opts["polyamp"].state.values(), opts["native"].state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert ours.get_scale() == native.get_scale()
    assert [r.skipped for r in ours.records()][:12] == [s in (3, 7) for s in range(12)]


def test_folded_clipping_reads_the_gradients_once_before_the_multiply() -> None:
    _, opt, scaler = _scaled_sgd(0)
    with _Ops() as ops:
        polyamp_torch.clip_grad_norm_(scaler, opt, 1.0)
    assert ops.counts["_amp_foreach_non_finite_check_and_unscale_"] == 0  # no separate unscale pass
    assert ops.counts["_foreach_norm"] == 1 and ops.counts["_foreach_mul_"] == 1
    # the two-step form, for comparison: a check-and-unscale pass, a norm pass and a multiply
    model2, opt2, scaler2 = _scaled_sgd(0)
    with _Ops() as ops2:
        scaler2.unscale_(opt2)
        torch.nn.utils.clip_grad_norm_(model2.parameters(), 1.0)
    assert ops2.counts["_amp_foreach_non_finite_check_and_unscale_"] == 1 and ops2.counts["_foreach_mul_"] == 1


def test_bfloat16_gradients_fold_bit_for_bit() -> None:
    # bfloat16 weights under loss scaling (warned once): the norm is computed in bfloat16, as torch's is.
    results = []
    for fold in (True, False):
        model = _model(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = polyamp.LossScaler(enabled=True, init_scale=2.0**8)
        x, y = _batch(0, torch.bfloat16)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y).float()).backward()
        with pytest.warns(UserWarning, match="gradients are bfloat16"):
            if fold:
                norm = polyamp_torch.clip_grad_norm_(scaler, opt, 0.01)
            else:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        results.append((norm, [p.grad.clone() for p in model.parameters()]))
    (norm_a, grads_a), (norm_b, grads_b) = results
    assert norm_a.dtype == norm_b.dtype == torch.bfloat16 and torch.equal(norm_a, norm_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_cases_that_cannot_fold_take_the_two_step_path_with_the_same_result() -> None:
    # A norm other than 2 or inf, and torch's own keyword arguments, unscale then clip as two steps.
    for kwargs, norm_type in (({}, 1.0), ({"foreach": False}, 2.0)):
        model, opt, scaler = _scaled_sgd(1)
        native_model = _model()
        x, y = _batch(1)
        norm = polyamp_torch.clip_grad_norm_(scaler, opt, 0.1, norm_type, **kwargs)
        assert scaler.is_unscaled(opt)
        native = torch.amp.GradScaler("cpu")
        native_opt = torch.optim.SGD(native_model.parameters(), lr=0.1)
        native.scale(torch.nn.functional.mse_loss(native_model(x), y)).backward()
        native.unscale_(native_opt)
        expected = torch.nn.utils.clip_grad_norm_(native_model.parameters(), 0.1, norm_type, **kwargs)
        assert torch.equal(norm, expected)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), native_model.parameters()))


@pytest.mark.parametrize(
    "max_norm",
    [np.float32(0.05), np.float64(0.05), np.int64(1), torch.tensor(0.05), torch.tensor([0.05])],
    ids=["numpy-float32", "numpy-float64", "numpy-int64", "tensor", "one-element-tensor"],
)
def test_max_norm_takes_what_torchs_clip_grad_norm_takes(max_norm: Any) -> None:
    # NumPy scalars fold; a tensor goes to torch's own function (two steps, no host read): either way the norms,
    # parameters and scales are GradScaler's with torch's clip_grad_norm_ given the same max_norm.
    models, _, ours, native, norms = _side_by_side(OPTIMIZERS["adam-foreach"], max_norm, 2.0, steps=6, inf_at=(3,))
    for a, b in zip(norms["polyamp"], norms["native"], strict=True):
        assert (a.dtype == b.dtype and torch.equal(a, b)) or (torch.isnan(a) and torch.isnan(b))
    for a, b in zip(models["polyamp"].parameters(), models["native"].parameters(), strict=True):
        assert torch.equal(a, b)
    assert ours.get_scale() == native.get_scale()


def test_a_max_norm_tensor_that_is_not_one_positive_number_is_refused_before_anything_changes() -> None:
    model, opt, scaler = _scaled_sgd(2)
    grads = [p.grad.clone() for p in model.parameters()]
    for bad, words in (
        (torch.tensor([1.0, 2.0]), r"a float32 tensor of shape \(2,\)\."),
        (torch.tensor(-1.0), r"a float32 tensor of shape \(\) holding -1\.0\."),
        (torch.tensor(True), r"a bool tensor of shape \(\)\."),
        (torch.tensor(1j), r"a complex64 tensor"),
    ):
        with pytest.raises(
            polyamp.InvalidConfigError, match=r"`max_norm` must be a number > 0 or a one-element.*" + words
        ):
            polyamp_torch.clip_grad_norm_(scaler, opt, bad)
    assert not scaler.is_unscaled(opt)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_misuse_of_unscale_and_clip_is_refused_before_anything_changes() -> None:
    model, opt, scaler = _scaled_sgd(2)
    grads = [p.grad.clone() for p in model.parameters()]
    for bad in (0.0, -1.0, math.nan, "1.0", True):
        with pytest.raises(polyamp.PolyampError, match="max_norm"):
            scaler.unscale_and_clip_(opt, bad)  # type: ignore[arg-type]
    assert not scaler.is_unscaled(opt)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    scaler.unscale_and_clip_(opt, 1.0)
    with pytest.raises(polyamp.ScalerUsageError, match="unscale_"):
        scaler.unscale_and_clip_(opt, 1.0)  # once per optimizer per iteration, as unscale_


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_on_cuda_folded_clipping_equals_gradscaler_and_float16_autocast(optimizer: str, norm_type: float) -> None:
    """The same comparison on CUDA, under float16 autocast, with overflows injected."""
    models = {}
    for name in ("polyamp", "native"):
        torch.manual_seed(0)
        models[name] = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)).cuda()
    opts = {name: OPTIMIZERS[optimizer](m.parameters()) for name, m in models.items()}
    ours = polyamp.LossScaler(enabled=True, init_scale=2.0**10, growth_interval=3)
    native = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    for step in range(12):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 64, generator=generator).cuda(), torch.randn(32, 8, generator=generator).cuda()
        if step in (3, 7):
            x[0, 0] = math.inf
        norms = []
        for name, scaler in (("polyamp", ours), ("native", native)):
            opts[name].zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(models[name](x).float(), y)
            scaler.scale(loss).backward()
            if name == "polyamp":
                norms.append(polyamp_torch.clip_grad_norm_(ours, opts[name], 0.05, norm_type))
            else:
                native.unscale_(opts[name])
                norms.append(torch.nn.utils.clip_grad_norm_(models[name].parameters(), 0.05, norm_type))
            scaler.step(opts[name])
            scaler.update()
        assert torch.equal(norms[0], norms[1]) or bool(torch.isnan(norms[0]) and torch.isnan(norms[1]))
    for a, b in zip(models["polyamp"].parameters(), models["native"].parameters(), strict=True):
        assert torch.equal(a, b)
    assert ours.get_scale() == native.get_scale()


@CUDA
def test_on_cuda_folded_clipping_with_a_fused_optimizer_never_syncs() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = polyamp.LossScaler(enabled=True)
    x = torch.randn(8, 64, device="cuda")

    def step() -> None:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        polyamp_torch.clip_grad_norm_(scaler, opt, 1.0)
        scaler.step(opt)
        scaler.update()

    for _ in range(5):  # warm-up: lazy state, first-iteration probes
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_float16_gradients_of_a_precision_optimizer_clip_as_two_steps() -> None:
    # float16 weights stepped by a PrecisionOptimizer under loss scaling: each scaled float16 gradient is finite,
    # but their norm (about 4e5 here) is beyond float16's range, so these unscale first and clip after (the same
    # values as doing so by hand), never reporting a false overflow.
    results = []
    for by_hand in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256).to(torch.float16)
        opt = polyamp_torch.PrecisionOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), "params=float16,compute=float16,state=float32,rounding=kahan"
        )
        scaler = polyamp.LossScaler(enabled=True, init_scale=2.0**16)
        generator = torch.Generator().manual_seed(3)
        x, y = torch.randn(16, 256, generator=generator).half(), torch.randn(16, 256, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x).float(), y) * 10
        scaler.scale(loss).backward()
        scaled = [p.grad.float() for p in model.parameters()]
        assert all(torch.isfinite(g).all() for g in scaled)
        assert torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in scaled])) > 65504
        if by_hand:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            norm = polyamp_torch.clip_grad_norm_(scaler, opt, 0.5)
        assert torch.isfinite(norm)
        scaler.step(opt)
        scaler.update()
        assert not scaler.records()[-1].skipped
        results.append((norm, [p.detach().clone() for p in model.parameters()]))
    (norm_a, params_a), (norm_b, params_b) = results
    assert torch.equal(norm_a, norm_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
