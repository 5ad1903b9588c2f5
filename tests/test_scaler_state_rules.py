"""Two rules of a scaler's state: a disabled scaler keeps (and round-trips) its state dicts, as GradScaler's
checkpoint recipe needs; and ``enabled=None`` follows each iteration's own computation, never what ran in the
process before the scaler existed."""

from __future__ import annotations

import json
from typing import Any

import pytest

import polyamp
from polyamp import SpikeRule, StateDictError

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import polyamp_torch  # noqa: E402


def _guarded_losses(scaler: Any, losses: list[float]) -> torch.nn.Linear:
    """Train a linear layer through ``scaler`` with losses of the given values (a constant target shift)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    x = torch.ones(2, 3)
    for value in losses:
        optimizer.zero_grad(set_to_none=True)
        out = layer(x).sum() * 0.0 + value  # the loss's value is exactly `value`; the gradients are finite
        scaler.scale(out).backward()
        scaler.step(optimizer)
        scaler.update()
    return layer


# -- a disabled scaler's state dicts ------------------------------------------------------------------------


@pytest.mark.parametrize("make", [polyamp.LossScaler, polyamp_torch.TorchLossScaler], ids=["LossScaler", "Torch"])
def test_a_disabled_scaler_loads_its_own_state_dict(make: Any) -> None:
    scaler = make(enabled=False, init_scale=1024.0, growth_interval=7, hysteresis=3)
    saved = json.loads(json.dumps(scaler.state_dict()))
    assert saved["enabled"] is False and saved["scale"] == 1024.0
    resumed = make(enabled=False)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved
    assert resumed.config == scaler.config


def test_a_guarded_disabled_scaler_keeps_its_spike_window_across_a_checkpoint() -> None:
    rule = SpikeRule("loss", window=4, warmup=2)
    scaler = polyamp.LossScaler(enabled=False, guard=True, spike=rule, backend="torch")
    _guarded_losses(scaler, [1.0, 1.5, 2.0, 2.5, 3.0])
    saved = scaler.state_dict()
    assert saved["spike_window"] == [1.5, 2.0, 2.5, 3.0]
    resumed = polyamp.LossScaler(enabled=False, guard=True, spike=rule, backend="torch")
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["spike_window"] == [1.5, 2.0, 2.5, 3.0]


def test_the_amp_recipe_with_use_amp_false_round_trips_like_gradscaler() -> None:
    """``GradScaler(enabled=use_amp)`` + checkpointing, with use_amp=False: torch's disabled scaler saves ``{}``
    and loads anything as nothing; polyamp's loads its own dict and takes torch's ``{}`` as nothing to restore."""
    use_amp = False
    native = torch.amp.GradScaler("cpu", enabled=use_amp)
    ours = polyamp_torch.TorchLossScaler("cpu", enabled=use_amp, growth_interval=9)
    before = ours.state_dict()
    ours.load_state_dict(native.state_dict())  # {}: nothing to restore
    assert native.state_dict() == {} and ours.state_dict() == before
    ours.load_state_dict(ours.state_dict())
    native.load_state_dict(ours.state_dict())  # torch's disabled scaler ignores what it loads
    assert ours.state_dict() == before


def test_an_enabled_scaler_still_refuses_a_disabled_scalers_dict_and_is_unchanged() -> None:
    saved = polyamp.LossScaler(enabled=False, init_scale=8.0).state_dict()
    scaler = polyamp.LossScaler(enabled=True, growth_interval=3)
    before = scaler.state_dict()
    with pytest.raises(StateDictError, match=r"saved from a disabled LossScaler.*enabled=False"):
        scaler.load_state_dict(saved)
    with pytest.raises(StateDictError, match="it is empty"):
        scaler.load_state_dict({})
    assert scaler.state_dict() == before


def test_a_disabled_keras_optimizer_loads_its_own_state_dict() -> None:
    keras = pytest.importorskip("keras")
    import polyamp_keras

    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), enabled=False, growth_interval=5)
    saved = optimizer.state_dict()
    resumed = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), enabled=False)
    resumed.load_state_dict(saved)
    resumed.load_state_dict({})
    assert resumed.state_dict() == saved


# -- enabled=None follows the iteration's own computation ---------------------------------------------------


def _factor(scaler: Any, layer: torch.nn.Module, optimizer: Any, *, float16: bool) -> float:
    """One iteration; the factor its loss was multiplied by."""
    optimizer.zero_grad(set_to_none=True)
    x = torch.randn(2, 4)
    if float16:
        with polyamp_torch.autocast("float16"):
            out = layer(x)
        loss = out.float().pow(2).mean()
    else:
        loss = F.mse_loss(layer(x), torch.zeros(2, 4))
    scaled = scaler.scale(loss)
    factor = float(scaled.detach() / loss.detach())
    scaled.backward()
    scaler.step(optimizer)
    scaler.update()
    return factor


def test_a_fresh_scaler_does_not_scale_float32_losses_after_float16_regions_ran_elsewhere() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    earlier = polyamp.LossScaler()
    assert _factor(earlier, layer, optimizer, float16=True) == 65536.0  # a float16 loop scales
    with torch.no_grad(), polyamp_torch.autocast("float16"):
        layer(torch.ones(1, 4))  # and an evaluation pass in float16, outside any iteration
    for _ in range(2):  # fresh scalers, float32 losses computed outside any region
        scaler = polyamp.LossScaler()
        assert [_factor(scaler, layer, optimizer, float16=False) for _ in range(3)] == [1.0, 1.0, 1.0]
        assert [r.mode for r in scaler.records()] == ["guarding"] * 3  # not scaling: the guard checks instead


@pytest.mark.parametrize("bound", [False, True], ids=["bound-at-first-scale", "bound-at-construction"])
def test_a_float16_loop_scales_from_its_first_iteration(bound: bool) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    scaler = polyamp.LossScaler(backend="torch" if bound else None)
    assert [_factor(scaler, layer, optimizer, float16=True) for _ in range(3)] == [65536.0] * 3
    assert _factor(scaler, layer, optimizer, float16=False) == 1.0  # the next iteration computes in float32
