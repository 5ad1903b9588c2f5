"""A third-party backend of the *tape* loop style, written only against polyamp's public API, gets every
semantic the core owns: the conformance cases its capabilities allow (the guard and records included; run in
test_numpy_backend.py), the spike rule decided as the reference decides, the iteration rule for scaling, and
the rule's advance made with the step where the device offers it (``apply_and_advance``).

``tests/numpy_backend`` holds ``nptape`` (a NumPy stand-in for a framework whose gradients are values, as
TensorFlow's are) and ``polyamp_nptape``, its backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import polyamp
import polyamp.backend_api
from polyamp import LossScaler, ScalerUsageError, SpikeRule

if TYPE_CHECKING:
    from conftest import NumpyBackend


@pytest.fixture
def nptape_backend(numpy_backend: NumpyBackend) -> Iterator[Any]:
    with numpy_backend("nptape") as backend:
        yield backend


def test_the_tape_device_implements_the_protocols_it_claims(nptape_backend: Any) -> None:
    from polyamp import backend_api as api

    scaler = LossScaler(backend="nptape", enabled=True)
    capabilities = scaler.capabilities
    assert capabilities is not None
    assert (capabilities.style, capabilities.guarding, capabilities.recording, capabilities.spike) == (
        "tape",
        True,
        True,
        True,
    )
    assert capabilities.device_provenance and not capabilities.host_provenance
    assert capabilities.apply_and_advance is not None
    device = scaler.device_form
    for protocol in (
        api.TapeDevice,
        api.GuardingDevice,
        api.RecordingDevice,
        api.ProvenanceDevice,
        api.SpikeDevice,
    ):
        assert isinstance(device, protocol), protocol.__name__
    assert callable(device.apply_and_advance)
    assert not isinstance(device, api.ImperativeDevice)


def _loss(nptape: Any, value: float, *, overflow: bool) -> Any:
    """A loss of the given value whose gradients are 0.01 everywhere (inf in the first entry when overflowing)."""

    def grads(upstream: float) -> list[np.ndarray]:
        out = [np.full(shape, 0.01 * upstream, np.float32) for shape in ((8, 16), (16,), (16, 4), (4,))]
        if overflow:
            out[0][0, 0] = np.inf
        return out

    return nptape.Tensor(value, grads)


LOSSES = [1.0, 1.1, 0.9, 1.0, 5.0, 1.05, 1.0, 7.0, 1.0, 0.95, 9.0, 1.0]
OVERFLOWS = {6, 10}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_spike_rule_on_the_tape_device_decides_as_the_reference(nptape_backend: Any, policy: str) -> None:
    """Scaling (float16) and guarding (bfloat16): the same skips, reasons and window as `SpikeRule.decide`."""
    import nptape

    rule = SpikeRule("loss", window=4, threshold=3.0)
    polyamp.set_policy(policy)
    scaler = LossScaler(spike=rule, backend="nptape")
    variables = nptape.mlp(0)
    optimizer = nptape.SGD(lr=0.1)
    for index, value in enumerate(LOSSES):
        loss = scaler.scale(_loss(nptape, value, overflow=index in OVERFLOWS))
        grads = nptape.gradient(loss, variables)
        scaler.apply_gradients(optimizer, zip(grads, variables, strict=True))
    spikes = rule.decide(LOSSES, [i in OVERFLOWS for i in range(len(LOSSES))])
    overflow_reason = "overflow" if policy == "mixed_float16" else "non_finite"
    want = [overflow_reason if i in OVERFLOWS else "loss_spike" if spikes[i] else None for i in range(len(LOSSES))]
    assert [r.reason for r in scaler.records()] == want
    assert spikes.count(True) >= 2  # the trace exercises the rule
    assert int(scaler.skipped_steps()) == len(OVERFLOWS) + spikes.count(True)
    assert optimizer.iterations == len(LOSSES) - len(OVERFLOWS) - spikes.count(True)
    applied = [x for i, x in enumerate(LOSSES) if i not in OVERFLOWS and not spikes[i]]
    assert scaler.state_dict()["spike_window"] == applied[-rule.window :]


def test_every_iteration_that_scales_needs_its_loss_scaled(nptape_backend: Any) -> None:
    """The iteration rule, checked every iteration: the second iteration's gradients come from an unscaled loss,
    so unscale() and apply_gradients() refuse them, with the same words as every other loop style."""
    import nptape

    scaler = LossScaler(backend="nptape", enabled=True)
    variables = nptape.mlp(0)
    optimizer = nptape.SGD(lr=0.1)
    grads = nptape.gradient(scaler.scale(_loss(nptape, 1.0, overflow=False)), variables)
    scaler.apply_gradients(optimizer, zip(grads, variables, strict=True))
    unscaled_grads = nptape.gradient(_loss(nptape, 1.0, overflow=False), variables)
    before = [v.data.copy() for v in variables]
    for call in (
        lambda: scaler.unscale(unscaled_grads),
        lambda: scaler.apply_gradients(optimizer, zip(unscaled_grads, variables, strict=True)),
    ):
        with pytest.raises(ScalerUsageError, match=r"before scale\(\) in this iteration") as raised:
            call()
        assert polyamp.backend_api.arguments.NOT_SCALED_RULE in str(raised.value)
    assert all(np.array_equal(a, v.data) for a, v in zip(before, variables, strict=True))
    assert optimizer.iterations == 1


class _Calls:
    """Counts the tape device's calls of the step and the update, by name (on its class: the scaler holds the
    methods it bound)."""

    def __init__(self, backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: dict[str, int] = {}
        for name in ("apply", "apply_and_advance", "update"):
            monkeypatch.setattr(backend.TapeDevice, name, self._counted(name, getattr(backend.TapeDevice, name)))

    def _counted(self, name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] = self.counts.get(name, 0) + 1
            return method(*args, **kwargs)

        return call

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, {}
        return counts


ADVANCE_OVERFLOWS = {2, 3, 9}


@pytest.mark.parametrize("advances", [True, False], ids=["device_advances", "device_declines"])
def test_an_apply_gradients_iteration_advances_the_rule_once_with_the_step(
    nptape_backend: Any, monkeypatch: pytest.MonkeyPatch, advances: bool
) -> None:
    """An iteration that is one ``apply_gradients`` asks the device for the step and the rule's advance in one
    call (``apply_and_advance``) and does not advance the rule again; a device that declines
    gets ``apply`` then ``update``. Either way the state follows the reference rule step by step, with the
    same records."""
    import nptape

    calls = _Calls(nptape_backend, monkeypatch)
    scaler = LossScaler(backend="nptape", enabled=True, init_scale=2.0**10, growth_interval=3, hysteresis=2)
    variables = nptape.mlp(0)
    optimizer = nptape.SGD(lr=0.1)
    grads = nptape.gradient(scaler.scale(_loss(nptape, 1.0, overflow=False)), variables)  # binds the device
    scaler.apply_gradients(optimizer, zip(grads, variables, strict=True))
    device = scaler.device_form
    device.advances = advances
    calls.take()
    config, state = scaler.config, scaler.get_state()
    for index in range(12):
        overflow = index in ADVANCE_OVERFLOWS
        grads = nptape.gradient(scaler.scale(_loss(nptape, 1.0, overflow=overflow)), variables)
        scaler.apply_gradients(optimizer, zip(grads, variables, strict=True))
        state = config.next_state(state, overflow)
        assert scaler.get_state() == state, index
        want = {"apply_and_advance": 1} if advances else {"apply_and_advance": 1, "apply": 1, "update": 1}
        assert calls.take() == want, index
    assert [r.skipped for r in scaler.records()][-12:] == [i in ADVANCE_OVERFLOWS for i in range(12)]
    assert int(scaler.skipped_steps()) == len(ADVANCE_OVERFLOWS)


@pytest.mark.parametrize("kind", ["two_optimizers", "spike_rule"])
def test_an_iteration_of_several_steps_or_with_a_spike_rule_advances_the_rule_at_its_end(
    nptape_backend: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Where the iteration is more than one ``apply_gradients`` (two optimizers stepped, then ``update``) or a
    spike rule decides with the overflow, the rule advances once, at the iteration's end, on every flag."""
    import nptape

    calls = _Calls(nptape_backend, monkeypatch)
    spike = SpikeRule("loss", window=2) if kind == "spike_rule" else None
    scaler = LossScaler(backend="nptape", enabled=True, growth_interval=2, spike=spike)
    variables = nptape.mlp(0)
    first, second = nptape.SGD(lr=0.1), nptape.SGD(lr=0.1)

    def iteration(overflow: bool) -> None:
        grads = nptape.gradient(scaler.scale(_loss(nptape, 1.0, overflow=overflow)), variables)
        if kind == "spike_rule":
            scaler.apply_gradients(first, zip(grads, variables, strict=True))
            return
        scaler.step(first, zip(grads[:2], variables[:2], strict=True))
        scaler.step(second, zip(grads[2:], variables[2:], strict=True))
        scaler.update()

    iteration(False)  # binds the device
    calls.take()
    config, state = scaler.config, scaler.get_state()
    for overflow in (False, True, False):
        iteration(overflow)
        state = config.next_state(state, overflow)
        assert scaler.get_state() == state
        assert calls.take() == {"apply": 1 if kind == "spike_rule" else 2, "update": 1}


def test_a_new_array_backend_device_fits_in_two_hundred_lines() -> None:
    """nptape's spec, device form and backend, on `ArrayDevice`: what a new array framework's backend writes."""
    source = (Path(__file__).parent / "numpy_backend" / "polyamp_nptape.py").read_text().splitlines()
    start = next(i for i, line in enumerate(source) if line.startswith("SPEC = "))
    end = next(i for i, line in enumerate(source) if line.startswith("# -- the conformance harness"))
    assert "class TapeDevice(ArrayDevice):" in source[start:end]
    assert end - start <= 200
