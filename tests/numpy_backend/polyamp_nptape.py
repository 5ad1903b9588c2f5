"""polyamp_nptape: a polyamp backend of the *tape* loop style for ``nptape``, written only against
``polyamp`` and ``polyamp.backend_api`` (and ``polyamp.conformance`` for its harness).

It shows what a new array framework's backend takes: its device form is the core's
`polyamp.backend_api.ArrayDevice` over NumPy (the scale, the guard, step records and the spike rule) plus what
is nptape's own, the `polyamp.backend_api.TapeDevice` methods that check its objects, scale a loss, unscale and
apply gradients, with the non-finite gradients of skipped steps (`ProvenanceDevice`) and the step with the
rule's advance (``apply_and_advance``). Every semantic (stages, misuse, skips, records, the spike decision's
place in the iteration) is the core's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import nptape
import numpy as np

from polyamp import LossScaleConfig, LossScaler, LossScaleState, Policy
from polyamp.backend_api import ArrayDevice, BackendSpec, StepOutcome, rules
from polyamp.backend_api.arguments import wrong_object_error
from polyamp.backend_api.rules import ArrayOps
from polyamp.conformance import HarnessBase, LoopBase, TrainerBase, TrainerSettings

SPEC = BackendSpec(
    name="nptape",
    target="polyamp_nptape:TapeBackend",
    frameworks=("nptape",),
    install_hint="pip install nptape",
    harness="polyamp_nptape:TapeHarness",
)


class TapeDevice(ArrayDevice):
    """The tape device form: the core's `ArrayDevice` over NumPy; gradients are values handed to ``apply``."""

    ops = ArrayOps(np)
    framework = "nptape"

    def __init__(self, config: LossScaleConfig, state: LossScaleState) -> None:
        super().__init__(config, state)
        self._provenance: list[tuple[int, list[tuple[str, int, int, int, int]]]] = []

    def check_optimizer(self, method: str, optimizer: object) -> None:
        if not isinstance(optimizer, nptape.Optimizer):
            raise wrong_object_error("nptape", method, optimizer, "an nptape.Optimizer")

    def check_gradients(self, method: str, grads: Sequence[Any]) -> None:
        for grad in grads:
            if grad is not None and not isinstance(grad, np.ndarray):
                raise wrong_object_error("nptape", method, grad, "NumPy arrays (None for no gradient)")

    def scale(self, loss: Any) -> Any:
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(item) for item in loss)
        if not isinstance(loss, nptape.Tensor):
            raise wrong_object_error("nptape", "scale", loss, "an nptape.Tensor")
        return loss * float(self._scale.scale)

    def loss_values(self, loss: Any) -> list[Any]:
        return [item.value for item in (loss if isinstance(loss, (list, tuple)) else [loss])]

    def unscale(self, grads: Sequence[Any]) -> list[Any]:
        inverse = self.inverse_scale()
        return [None if g is None else (g * inverse).astype(np.float32) for g in grads]

    def apply(
        self,
        optimizer: nptape.Optimizer,
        grads: Sequence[Any],
        variables: Sequence[nptape.Variable],
        *,
        unscaled: bool,
        veto: Any = None,
    ) -> StepOutcome:
        values = list(grads) if unscaled else self.unscale(grads)
        finite = all(g is None or bool(np.isfinite(g).all()) for g in values)
        if finite and not (veto is not None and veto > 0):
            return StepOutcome(optimizer.apply(values, list(variables)), np.float32(0.0), None)
        if not finite:  # counted in the branch that skips, for this iteration's record
            named = [(v.name, g) for g, v in zip(values, variables, strict=True) if g is not None]
            counts = [(name, *rules.non_finite_counts(self.ops, g).tolist(), int(g.size)) for name, g in named]
            self._provenance.append((self._count, counts))
        return StepOutcome(None, np.float32(not finite), None)

    # The step and the update as `apply_and_advance` calls them (not through the class's names, which a test
    # may wrap to count the core's calls).
    _apply = apply
    _update = ArrayDevice.update

    #: Whether `apply_and_advance` takes the step (False: it declines, and the core calls apply and update).
    advances = True

    def apply_and_advance(
        self, optimizer: nptape.Optimizer, grads: Sequence[Any], variables: Sequence[nptape.Variable], *, unscaled: bool
    ) -> StepOutcome | None:
        if not self.advances:
            return None
        outcome = self._apply(optimizer, grads, variables, unscaled=unscaled)
        self._update(outcome.found_inf, None)
        return outcome

    def plain_apply(self, optimizer: nptape.Optimizer, grads: Sequence[Any], variables: Sequence[Any]) -> Any:
        return optimizer.apply(list(grads), list(variables))

    def read_provenance(self) -> list[tuple[int, list[tuple[str, int, int, int, int]]]]:
        found, self._provenance = self._provenance, []
        return found

    def spike_grad_norm(self, grads: Sequence[Any], *, unscaled: bool) -> Any:
        return self.gradient_norm(grads, unscaled=unscaled)


class TapeBackend:
    name = "nptape"

    def make_device(self, config: LossScaleConfig, state: LossScaleState) -> TapeDevice:
        return TapeDevice(config, state)


# -- the conformance harness ----------------------------------------------------------------------------


def _clip(grads: Sequence[np.ndarray], max_norm: float) -> list[np.ndarray]:
    norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
    factor = np.float32(min(1.0, max_norm / (norm + 1e-6)))
    return [(g * factor).astype(np.float32) for g in grads]


def _slots(optimizer: nptape.Optimizer) -> list[Any]:
    return [*(value for state in optimizer.state.values() for _, value in sorted(state.items())), optimizer.iterations]


class TapeTrainer(TrainerBase):
    """A GradientTape-style loop: scale, gradient, (unscale, clip,) apply_gradients."""

    #: The variable whose gradient ``step(overflow=True)`` plants an inf into.
    planted = "dense_1/kernel"

    def __init__(self, harness: TapeHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.variables = nptape.mlp(settings.seed)
        self.opt = settings.make_optimizer(
            {"sgd": lambda: nptape.SGD(lr=0.1, momentum=0.9), "adam": lambda: nptape.Adam(lr=0.01)}
        )
        self.scaler = self.make_scaler()

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        loss = nptape.loss(self.variables, x, y)
        grads = nptape.gradient(self.scaler.scale(loss) if self.scaler is not None else loss, self.variables)
        if overflow:
            grads[0].reshape(-1)[0] = np.inf
        if self.settings.clip is not None:
            if self.scaler is not None:
                grads = self.scaler.unscale(grads)
            grads = _clip(grads, self.settings.clip)
        if self.scaler is not None:
            self.scaler.apply_gradients(self.opt, zip(grads, self.variables, strict=True))
        else:
            self.opt.apply(grads, self.variables)
        return loss.value

    def weights(self) -> list[np.ndarray]:
        return [v.data for v in self.variables]

    def slots(self) -> list[Any]:
        return _slots(self.opt)


class TapeLoop(LoopBase):
    """One iteration call by call, with two optimizers (one per layer), gradients held as values."""

    def __init__(self, harness: TapeHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.variables = nptape.mlp(settings.seed)
        self.groups = [self.variables[:2], self.variables[2:]]
        self.optimizers = [nptape.SGD(lr=0.1, momentum=0.9), nptape.SGD(lr=0.1, momentum=0.9)]
        self.scaler = self.make_scaler()
        self.grads: list[list[np.ndarray]] = [[], []]

    def run_backward(self, overflow: Collection[int]) -> None:
        x, y = self.next_batch()
        grads = nptape.gradient(self.scaler.scale(nptape.loss(self.variables, x, y)), self.variables)
        self.grads = [grads[:2], grads[2:]]
        for index in overflow:
            self.grads[index][0].reshape(-1)[0] = np.inf

    def unscale(self, index: int) -> None:
        self.grads[index] = self.scaler.unscale(self.grads[index])

    def step(self, index: int) -> None:
        self.scaler.step(self.optimizers[index], zip(self.grads[index], self.groups[index], strict=True))

    def weights(self, index: int) -> list[np.ndarray]:
        return [v.data for v in self.groups[index]]

    def slots(self, index: int) -> list[Any]:
        return _slots(self.optimizers[index])


class TapeHarness(HarnessBase):
    """nptape on the CPU: it computes in float32 whatever the policy (no "low_precision"), and guards."""

    backend = "nptape"
    devices = ("cpu",)
    capabilities = frozenset({"guard"})
    trainer_class = TapeTrainer

    def loop(self, policy: Policy, *, scaler: Mapping[str, Any], seed: int = 0) -> TapeLoop:
        return TapeLoop(self, policy, self.settings(scaler, seed=seed))

    def passes_loss_through(self, scaler: LossScaler) -> bool:
        loss = nptape.Tensor(1.5)
        return scaler.scale(loss) is loss


__all__ = ["SPEC", "TapeBackend", "TapeDevice", "TapeHarness"]
