"""Host reads per steady-state training step, counted at torch's dispatcher, polyamp beside native torch.

A read of a tensor's value to the host (``.item()``, ``bool(t)``, ``float(t)``) is ``aten._local_scalar_dense``
at the dispatcher; on CUDA each one waits for the device (a host-device sync). Counting them on CPU checks the
step's code paths: what CUDA's ``torch.cuda.set_sync_debug_mode`` would flag there, minus device-to-host
copies, which polyamp's step does not make (its batched record read every ``history // 2`` iterations falls
outside the counted steps).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

import polyamp

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import polyamp_torch  # noqa: E402


class _ScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _optimizer(name: str, params: Any) -> Any:
    """``sgd``, ``sgdplain`` (no momentum), ``adam``, ``adamw``, optionally ``_foreach`` or ``_fused`` (torch's CPU default is the for-loop)."""
    kind, _, form = name.partition("_")
    forms = {"foreach": {"foreach": True}, "fused": {"fused": True}, "": {}}[form]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, **forms)
    if kind == "sgdplain":  # no momentum
        return torch.optim.SGD(params, lr=0.01, **forms)
    return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](params, lr=1e-3, **forms)


def _reads_per_step(
    variant: str,
    optimizer: str,
    policy: str,
    *,
    inf_at: int | None = None,
    clip: bool = False,
    **scaler_options: Any,
) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = _optimizer(optimizer, model.parameters())
    dtype = torch.float16 if policy == "mixed_float16" else torch.bfloat16
    scaler: Any = None
    if variant == "polyamp":
        scaler = polyamp.LossScaler(**scaler_options)
    elif policy == "mixed_float16":
        scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    counter = _ScalarReads()

    def step(index: int) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
            return
        scaler.scale(loss).backward()
        if index == inf_at:
            model[0].bias.grad[0] = math.inf
        if clip:
            polyamp_torch.clip_grad_norm_(scaler, opt, 1.0)
        scaler.step(opt)
        scaler.update()

    with polyamp.policy_scope(policy):
        for index in range(5):  # warm-up: lazy state, first-iteration probes
            step(index)
        with counter:
            for index in range(5, 25):
                step(index)
    return counter.count / 20


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adam_fused"])
def test_scaling_reads_what_grad_scaler_reads(optimizer: str) -> None:
    """float16 with loss scaling: GradScaler reads the found-inf flag once per step unless the optimizer is
    fused (single-tensor Adam on CPU also reads its step counts, in both runs); polyamp reads the same."""
    native = _reads_per_step("native", optimizer, "mixed_float16")
    assert _reads_per_step("polyamp", optimizer, "mixed_float16") == native
    assert native == (0.0 if optimizer == "adam_fused" else _reads_per_step("native", optimizer, "mixed_bfloat16") + 1)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adam_fused"])
def test_the_guard_reads_once_per_step_and_never_with_a_fused_optimizer(optimizer: str) -> None:
    """bfloat16 with the guard, against plain torch: one more read to decide a non-fused step (as GradScaler
    makes under float16), none with a fused optimizer, which skips on the device."""
    plain = _reads_per_step("native", optimizer, "mixed_bfloat16")
    extra = 0.0 if optimizer == "adam_fused" else 1.0
    assert _reads_per_step("polyamp", optimizer, "mixed_bfloat16") == plain + extra


def test_a_skipped_fused_step_adds_no_read_either() -> None:
    """An overflow decided on the device: the skip itself costs no read (the records are read in batches)."""
    assert _reads_per_step("polyamp", "adam_fused", "mixed_float16", inf_at=12) == 0.0


MASKABLE = ["sgd", "sgd_foreach", "sgdplain", "sgdplain_foreach", "adam", "adam_foreach", "adamw", "adamw_foreach"]


@pytest.mark.parametrize("optimizer", [*MASKABLE, "adam_fused", "adamw_fused"])
@pytest.mark.parametrize("inf_at", [None, 12])
def test_skipping_on_the_device_reads_nothing_beyond_the_optimizer(optimizer: str, inf_at: int | None) -> None:
    """``skip_on_device=True``: SGD, Adam and AdamW in every form make no read beyond the optimizer's own (the
    for-loop Adam and AdamW read their step counts on the CPU, with or without a scaler), skipped step or not."""
    plain = _reads_per_step("native", optimizer, "mixed_bfloat16")
    assert _reads_per_step("polyamp", optimizer, "mixed_float16", inf_at=inf_at, skip_on_device=True) == plain


@pytest.mark.parametrize("optimizer", ["sgd_foreach", "adam", "adamw_foreach", "adamw_fused"])
def test_skipping_on_the_device_with_guard_spikes_and_clipping_reads_nothing_more(optimizer: str) -> None:
    """The guard (bfloat16), the spike rule, records and folded clipping on: still no read of polyamp's own."""
    plain = _reads_per_step("native", optimizer, "mixed_bfloat16")
    spike = polyamp.SpikeRule("grad_norm", window=4)
    for policy in ("mixed_bfloat16", "mixed_float16"):
        reads = _reads_per_step("polyamp", optimizer, policy, clip=True, spike=spike, skip_on_device=True)
        assert reads == plain, policy
