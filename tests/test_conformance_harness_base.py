"""`polyamp.conformance.HarnessBase` and the trainer and loop bases: what a harness built on them gets.

A harness over the conftest's throwaway framework (a float loss, an optimizer holding one float gradient)
inherits the bases and writes only its step; the tests check what the bases add: the device check,
``trainer()`` with the case's settings, each step under the trainer's policy, parameters and optimizer state
as NumPy, ``step_skipped()``, a loop's batches and calls, and a functional trainer's view of its state. The
conformance cases run on the harnesses that use the bases (tests/test_conformance.py, tests/test_numpy_backend.py,
tests/test_tape_backend.py).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import polyamp
import polyamp.backend_api
from polyamp import Policy
from polyamp.conformance import (
    FunctionalTrainerBase,
    HarnessBase,
    HarnessUnavailable,
    LoopBase,
    Trainer,
    TrainerBase,
    TrainerSettings,
    capabilities_of,
    harness_class,
)

if TYPE_CHECKING:
    from conftest import FakeFramework

NUMPY_BACKEND = Path(__file__).resolve().parent / "numpy_backend"


def _harness(fw: Any) -> type[HarnessBase]:
    """A harness for the fake framework ``fw``: one float16 weight, the optimizer's step count as its state."""

    class ScalarTrainer(TrainerBase):
        def __init__(self, harness: HarnessBase, policy: Policy, settings: TrainerSettings) -> None:
            super().__init__(harness, policy, settings)
            self.weight = np.array([1.5, -2.25], np.float16)
            self.opt = settings.make_optimizer({"sgd": fw.Optimizer})
            self.scaler = self.make_scaler()
            self.policies: list[str] = []

        def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
            self.policies.append(polyamp.get_policy().name)
            loss = fw.Tensor(float(x.sum()))
            scaled = self.scaler.scale(loss) if self.scaler is not None else loss
            self.opt.grad = math.inf if overflow else scaled.value  # the gradient of the scaled loss
            self.optimizer_step()
            return loss.value

        def weights(self) -> list[np.ndarray]:
            return [self.weight]

        def slots(self) -> list[Any]:
            return [np.int64(self.opt.steps)]

    class ScalarHarness(HarnessBase):
        backend = fw.__name__
        devices = ("cpu", "tpu")
        trainer_class = ScalarTrainer

        def check_device(self, device: str) -> None:
            if device == "tpu":
                raise HarnessUnavailable("this process sees no TPU")

    return ScalarHarness


@pytest.fixture
def harness(fake_framework: FakeFramework) -> HarnessBase:
    return _harness(fake_framework.load())("cpu")


def test_the_device_check_and_the_defaults(fake_framework: FakeFramework) -> None:
    cls = _harness(fake_framework.load())
    with pytest.raises(
        HarnessUnavailable, match=rf"the {fake_framework.name} harness runs on 'cpu' and 'tpu', not 'cuda'"
    ):
        cls("cuda")
    with pytest.raises(HarnessUnavailable, match="this process sees no TPU"):
        cls("tpu")
    harness = cls("cpu")
    assert harness.device == "cpu" and dict(harness.divergences) == {} and dict(harness.extra_scaler_options) == {}
    # The base adds trainer() only: the optional protocol methods stay the harness's to offer.
    assert capabilities_of(harness) == {"trainer"}


def test_trainer_gets_the_cases_settings_with_the_extra_scaler_options(harness: HarnessBase) -> None:
    harness.extra_scaler_options = {"growth_interval": 3}
    policy = Policy("mixed_float16")
    options = {"enabled": True, "init_scale": 8.0, "growth_interval": 5}
    trainer = harness.trainer(policy, scaler=options, clip=0.5, seed=4)
    assert isinstance(trainer, harness.trainer_class) and isinstance(trainer, Trainer)
    assert trainer.harness is harness and trainer.policy is policy
    assert trainer.settings == TrainerSettings({**options, "growth_interval": 3}, "sgd", 0.5, 4)
    assert options["growth_interval"] == 5  # the case's options are not changed
    assert trainer.scaler.get_scale() == 8.0 and trainer.scaler.config.growth_interval == 3
    assert harness.trainer(policy).scaler is None
    with pytest.raises(ValueError, match=r"unknown optimizer 'adam'; the harness knows 'sgd'"):
        harness.trainer(policy, optimizer="adam")


def test_a_trainer_steps_under_its_policy_and_reads_as_numpy(harness: HarnessBase) -> None:
    trainer = harness.trainer(Policy("mixed_float16"), scaler={"enabled": True, "init_scale": 4.0})
    x, y = np.ones((2, 3), np.float32), np.zeros(2, np.int64)
    assert trainer.step(x, y) == 6.0
    assert trainer.policies == ["mixed_float16"] and polyamp.get_policy().name == "float32"
    assert not trainer.step_skipped() and trainer.opt.steps == 1 and trainer.opt.grad == 6.0  # 6 * 4, unscaled
    trainer.step(x, y, overflow=True)
    assert trainer.step_skipped() and trainer.opt.steps == 1 and trainer.scaler.get_scale() == 2.0
    (params,) = trainer.params()
    assert params.dtype == np.float32 and params.tolist() == [1.5, -2.25]
    assert params is not trainer.weight
    (steps,) = trainer.optimizer_state()
    assert steps.dtype == np.int64 and int(steps) == 1
    plain = harness.trainer(Policy("float32"))
    plain.step(x, y, overflow=True)
    assert not plain.step_skipped() and plain.opt.steps == 1


def _loop(fw: Any, harness: HarnessBase, policy: Policy, seed: int = 0) -> LoopBase:
    """Two fake optimizers, one gradient each: the scaled loss, or inf where the iteration plants it."""

    class ScalarLoop(LoopBase):
        def __init__(self) -> None:
            super().__init__(harness, policy, harness.settings({"enabled": True, "init_scale": 2.0}, seed=seed))
            self.optimizers = [fw.Optimizer(), fw.Optimizer()]
            self.scaler = self.make_scaler()
            self.batches: list[tuple[np.ndarray, np.ndarray, str]] = []

        def run_backward(self, overflow: Collection[int]) -> None:
            x, y = self.next_batch()
            self.batches.append((x, y, polyamp.get_policy().name))
            scaled = self.scaler.scale(fw.Tensor(1.0))
            for index, optimizer in enumerate(self.optimizers):
                optimizer.grad = math.inf if index in overflow else scaled.value

        def weights(self, index: int) -> list[float]:
            return [self.optimizers[index].grad]

        def slots(self, index: int) -> list[int]:
            return [self.optimizers[index].steps]

    return ScalarLoop()


def test_a_loop_drives_the_scaler_call_by_call_on_the_same_batches(
    fake_framework: FakeFramework, harness: HarnessBase
) -> None:
    fw = fake_framework.load()
    loop = _loop(fw, harness, Policy("mixed_bfloat16"))
    loop.backward(overflow=[1])
    loop.unscale(0)
    loop.step(0)
    loop.step(1)
    loop.update()
    assert [bool(loop.scaler.step_skipped(opt)) for opt in loop.optimizers] == [False, True]
    assert [opt.steps for opt in loop.optimizers] == [1, 0] and loop.scaler.get_scale() == 1.0
    assert [a.tolist() for a in loop.params(0)] == [1.0] and loop.params(0)[0].dtype == np.float32
    assert [a.tolist() for a in loop.optimizer_state(1)] == [0]
    loop.backward()
    x, y, policy = loop.batches[0]
    assert policy == "mixed_bfloat16" and x.shape == (16, 8) and x.dtype == np.float32
    assert y.shape == (16,) and set(y.tolist()) <= {0, 1, 2, 3}
    assert not np.array_equal(loop.batches[1][0], x)  # each backward takes the next batch
    other = _loop(fw, harness, Policy("float32"))
    other.backward()
    other.backward()
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(loop.batches, other.batches, strict=True))


@pytest.fixture
def npfw_harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[HarnessBase]:
    monkeypatch.syspath_prepend(str(NUMPY_BACKEND))
    import polyamp_npfw

    polyamp.backend_api.register_backend(polyamp_npfw.SPEC)
    yield polyamp_npfw.NumpyHarness("cpu")
    for name in ("npfw", "polyamp_npfw"):
        sys.modules.pop(name, None)


class _FlagTrainer(FunctionalTrainerBase):
    """One gradient through the functional scaler per step; nothing to train."""

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        _, found_inf = self.fn.unscale(self.state, [np.full(2, math.inf if overflow else 1.0, np.float32)])
        self.state = self.fn.update(self.state, found_inf)
        self.skipped = self.fn.skipped(found_inf)
        return 0.0

    def weights(self) -> list[np.ndarray]:
        return []

    def slots(self) -> list[np.ndarray]:
        return []


def test_a_functional_trainer_shows_its_state_through_the_scaler_view(npfw_harness: HarnessBase) -> None:
    trainer = _FlagTrainer(npfw_harness, Policy("mixed_float16"), npfw_harness.settings({"enabled": True}))
    x, y = np.ones((2, 8), np.float32), np.zeros(2, np.int64)
    assert not trainer.step_skipped()
    trainer.step(x, y)
    saved = trainer.scaler.state_dict()
    assert saved == trainer.fn.state_dict(trainer.state) and saved["scale"] == 65536.0
    trainer.step(x, y, overflow=True)
    assert trainer.step_skipped() and int(trainer.scaler.skipped_steps()) == 1
    assert [(r.iteration, r.skipped) for r in trainer.scaler.records()] == [(0, False), (1, True)]
    assert trainer.scaler.state_dict()["scale"] == 32768.0
    trainer.scaler.load_state_dict(saved)
    assert trainer.scaler.state_dict()["scale"] == 65536.0 and trainer.fn.state_dict(trainer.state) == saved


#: What each first-party harness offers, as before it built on the base (and the FP8 layers since).
FIRST_PARTY = {
    "torch": {
        "op_dtype",
        "model_dtypes",
        "trainer",
        "loop",
        "tiny_gradient",
        "passes_loss_through",
        "precision",
        "float8_linear",
        "float8_delayed",
    },
    "tensorflow": {
        "op_dtype",
        "model_dtypes",
        "trainer",
        "loop",
        "tiny_gradient",
        "passes_loss_through",
        "float8_linear",
        "float8_delayed",
    },
    "keras": {
        "op_dtype",
        "model_dtypes",
        "trainer",
        "tiny_gradient",
        "passes_loss_through",
        "precision",
        "float8_linear",
        "float8_delayed",
    },
    "jax": {"op_dtype", "model_dtypes", "trainer", "functional", "precision", "float8_linear", "float8_delayed"},
}


@pytest.mark.parametrize("backend", list(FIRST_PARTY))
def test_the_first_party_harnesses_build_on_the_base_and_offer_what_they_did(backend: str) -> None:
    try:
        cls = harness_class(backend)
    except HarnessUnavailable as exc:
        pytest.skip(str(exc))
    assert issubclass(cls, HarnessBase) and issubclass(cls.trainer_class, TrainerBase)
    assert capabilities_of(cls) == FIRST_PARTY[backend] | {"low_precision", "guard"}
