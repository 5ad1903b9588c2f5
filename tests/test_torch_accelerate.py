"""`polyamp_torch.accelerate.prepare_accelerator`: polyamp's scaler in an Accelerate ``Accelerator``, on CPU.

A small model trains with infinite gradients planted at chosen backward passes (a gradient hook) and is compared
with Accelerate's own runs: under bf16 (which Accelerate runs on CPU, without a scaler) and with a scaler
installed by hand (Accelerate runs fp16 only on accelerators, so on CPU only the scaler is compared there).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import polyamp  # noqa: E402
import polyamp_torch  # noqa: E402
from polyamp_torch.accelerate import prepare_accelerator  # noqa: E402

if TYPE_CHECKING:
    from conftest import ImportWithout, RegressionLoader

BATCHES = 8


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    # Accelerate keeps its state in process-wide singletons; each Accelerator here starts from a clean one.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def model_with_plants(bad: set[int]) -> torch.nn.Module:
    """A LayerNorm MLP whose first weight gradient is inf at the backward passes in ``bad``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    count = [0]

    def plant(grad: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return torch.full_like(grad, float("inf")) if count[0] - 1 in bad else grad

    model[0].weight.register_hook(plant)
    return model


def train(
    accelerator: Any, model: torch.nn.Module, data: Any, *, region: Any = None, clip: bool = False
) -> tuple[list[bool], list[float]]:
    """Accelerate's loop; returns ``optimizer_step_was_skipped`` and the scaler's scale after each step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    skipped: list[bool] = []
    scales: list[float] = []
    for x, y in data:
        with accelerator.accumulate(model):
            with region if region is not None else accelerator.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                skipped.append(accelerator.optimizer_step_was_skipped)
                if accelerator.scaler is not None:
                    scales.append(float(accelerator.scaler.get_scale()))
    return skipped, scales


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_bf16_guard_skips_what_accelerate_would_apply(regression_loader: RegressionLoader) -> None:
    bad = {2, 5}
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    scaler = prepare_accelerator(accelerator)
    assert accelerator.scaler is scaler and not scaler.enabled and scaler.guarding
    guarded = model_with_plants(bad)
    skipped, _ = train(accelerator, guarded, regression_loader(BATCHES), clip=True)
    assert skipped == [i in bad for i in range(BATCHES)]
    assert int(scaler.skipped_steps()) == 2
    assert [(r.iteration, r.reason) for r in scaler.records() if r.skipped] == [(2, "non_finite"), (5, "non_finite")]
    # Accelerate's own bf16 on the data without the planted batches: bit for bit the same parameters.
    AcceleratorState._reset_state(reset_partial_state=True)
    native = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    assert native.scaler is None
    reference = model_with_plants(set())
    native_skipped, _ = train(native, reference, regression_loader(BATCHES, leave_out=bad), clip=True)
    assert native_skipped == [False] * (BATCHES - len(bad))
    assert same_parameters(guarded, reference)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_fp16_scaler_is_gradscaler_bit_for_bit(
    tmp_path: Path, accumulation: int, regression_loader: RegressionLoader
) -> None:
    bad = {2, 5}  # backward passes: with accumulation 2, the first micro-batch of step 1, the second of step 2

    def run(scaler: Any) -> tuple[torch.nn.Module, list[bool], list[float], Any]:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=accumulation)
        if isinstance(scaler, polyamp.LossScaler):
            assert prepare_accelerator(accelerator, scaler) is scaler
        else:
            accelerator.scaler = scaler  # the same installation, by hand, for torch's GradScaler
        model = model_with_plants(bad)
        region = torch.autocast("cpu", dtype=torch.float16)
        skipped, scales = train(accelerator, model, regression_loader(BATCHES * accumulation), region=region)
        return model, skipped, scales, accelerator

    native_model, native_skipped, native_scales, _ = run(torch.amp.GradScaler("cpu", growth_interval=2))
    scaler = polyamp_torch.TorchLossScaler("cpu", growth_interval=2)
    model, skipped, scales, accelerator = run(scaler)
    assert same_parameters(native_model, model)
    assert skipped == native_skipped
    assert scales == native_scales
    steps_with_plants = {b // accumulation for b in bad}
    assert [r.skipped for r in scaler.records()] == skipped
    assert all(skipped[step] for step in steps_with_plants)
    # save_state / load_state carry polyamp's scaler as they carry a GradScaler.
    accelerator.save_state(str(tmp_path / "state"))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    restored = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    fresh = prepare_accelerator(restored, polyamp_torch.TorchLossScaler("cpu", growth_interval=2))
    restored.prepare(model_with_plants(set()), torch.optim.Adam(model.parameters(), lr=1e-2))
    restored.load_state(str(tmp_path / "state"))
    assert fresh.state_dict() == scaler.state_dict()
    assert int(fresh.skipped_steps()) == int(scaler.skipped_steps()) == sum(skipped)  # the count goes on from there


def test_fp16_on_cpu_needs_an_explicit_scaler() -> None:
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator.scaler is None  # Accelerate leaves fp16 off on the CPU
    with pytest.raises(polyamp.PolyampValueError, match=r"fp16 only on accelerators.*mixed_precision='bf16'"):
        prepare_accelerator(accelerator)


def test_arguments() -> None:
    with pytest.raises(polyamp.PolyampTypeError, match=r"takes an accelerate.Accelerator. Received: .*GradScaler"):
        prepare_accelerator(torch.amp.GradScaler("cpu"))
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no")
    with pytest.raises(polyamp.PolyampTypeError, match="Set them on your scaler"):
        prepare_accelerator(accelerator, polyamp_torch.TorchLossScaler(), spike=polyamp.SpikeRule())
    with pytest.raises(polyamp.PolyampTypeError, match=r"`scaler` takes None or a polyamp.LossScaler"):
        prepare_accelerator(accelerator, torch.amp.GradScaler("cpu"))
    with pytest.raises(polyamp.PolyampTypeError, match=r"`guard` takes None, True or False"):
        prepare_accelerator(accelerator, guard=1)  # type: ignore[arg-type]
    scaler = prepare_accelerator(accelerator, guard=False, spike=polyamp.SpikeRule())
    assert scaler.spike == polyamp.SpikeRule() and not scaler.guarding and not scaler.enabled
    model = torch.nn.Linear(2, 2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(polyamp.ScalerUsageError, match=r"after accelerator.prepare\(\) prepared an optimizer"):
        prepare_accelerator(accelerator)


def test_without_accelerate_the_import_says_what_to_install(import_without: ImportWithout) -> None:
    with pytest.raises(polyamp.BackendNotInstalledError, match=r"pip install accelerate"):
        import_without("accelerate", "polyamp_torch.accelerate")
