"""polyamp_nptape: a polyamp backend of the *tape* loop style for ``nptape``, written only against
``polyamp`` and ``polyamp.backend_api`` (and ``polyamp.conformance`` for its harness).

Its device form implements `polyamp.backend_api.TapeDevice` and the optional protocols that give a loop the
guard (`GuardingDevice`), step records (`RecordingDevice`), the non-finite gradients of skipped steps
(`ProvenanceDevice`), the spike rule (`SpikeDevice`) and the step with the rule's advance
(``apply_and_advance``). It computes on the host, so its "device" flags are
NumPy scalars; every semantic (stages, misuse, skips, records, the spike decision's place in the iteration)
is the core's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import nptape
import numpy as np

from polyamp import LossScaleConfig, LossScaler, LossScaleState, Policy, PolyampTypeError, SpikeRule
from polyamp.backend_api import BackendSpec, StepOutcome, rules
from polyamp.backend_api.arguments import wrong_object_error
from polyamp.backend_api.records import ring_codes, ring_values
from polyamp.backend_api.rules import ArrayOps
from polyamp.conformance import HarnessBase, LoopBase, TrainerBase, TrainerSettings

SPEC = BackendSpec(
    name="nptape",
    target="polyamp_nptape:TapeBackend",
    frameworks=("nptape",),
    install_hint="pip install nptape",
    harness="polyamp_nptape:TapeHarness",
)


def _inverse(scale: float) -> np.float32:
    return np.float32(1.0 / scale)


#: polyamp's device rules compute over NumPy here.
OPS = ArrayOps(np)


def _counts(grad: np.ndarray) -> tuple[int, int, int, int]:
    positive, negative, nan = rules.non_finite_counts(OPS, grad).tolist()
    return positive, negative, nan, int(grad.size)


class _Window:
    """The spike rule and its window (`polyamp.backend_api.rules.SpikeWindowArrays`)."""

    def __init__(self, rule: SpikeRule) -> None:
        self.rule = rule
        self.arrays = rules.SpikeWindowArrays(np.zeros(rule.window), np.int64(0), np.int64(0))


class TapeDevice:
    """The tape device form: the state as NumPy scalars; gradients are values handed to ``apply``."""

    def __init__(self, config: LossScaleConfig, state: LossScaleState) -> None:
        self._config = config
        self._arrays = _arrays(state)
        self._skipped = np.int64(0)
        self._codes: list[int] = []
        self._count = 0
        self._provenance: list[tuple[int, list[tuple[str, int, int, int, int]]]] = []

    # -- ScalerDevice ------------------------------------------------------------------------------------

    def check_optimizer(self, method: str, optimizer: object) -> None:
        if not isinstance(optimizer, nptape.Optimizer):
            raise wrong_object_error("nptape", method, optimizer, "an nptape.Optimizer")

    def read_state(self) -> LossScaleState:
        scale, tracker, hysteresis_left = self._arrays
        return LossScaleState(float(scale), int(tracker), int(hysteresis_left))

    def write_state(self, config: LossScaleConfig, state: LossScaleState | None) -> None:
        self._config = config
        if state is not None:
            self._arrays = _arrays(state)

    def scale(self, loss: Any) -> Any:
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(item) for item in loss)
        if not isinstance(loss, nptape.Tensor):
            raise wrong_object_error("nptape", "scale", loss, "an nptape.Tensor")
        return loss * float(self._arrays.scale)

    def combine(self, flags: Sequence[Any]) -> np.float32:
        return np.float32(max(flags))

    def read_new_scale(self, new_scale: Any) -> float | None:
        raise PolyampTypeError(f"nptape's update(new_scale) takes a float, not {type(new_scale).__name__}")

    def update(self, found_inf: Any, new_scale: Any) -> None:
        if new_scale is not None:
            self._arrays = self._arrays._replace(scale=np.float32(new_scale))
        else:
            with np.errstate(over="ignore"):  # a product beyond float32 is inf, which the rule does not keep
                self._arrays = rules.advance(OPS, self._config, self._arrays, np.asarray(found_inf) > 0)
        self.count_skip(found_inf)

    def skipped(self, found_inf: Any) -> np.bool_:
        return np.bool_(found_inf > 0)

    def read_flag(self, found_inf: Any) -> bool:
        return bool(found_inf > 0)

    def finite_flag(self) -> np.float32:
        return np.float32(0.0)

    def new_record(self) -> list[Any]:
        return [np.float32(0.0)]

    def write_record(self, record: list[Any], found_inf: Any) -> None:
        record[0] = found_inf

    def read_record(self, record: list[Any]) -> Any:
        return record[0]

    def skipped_steps(self) -> np.int64:
        return self._skipped

    # -- TapeDevice --------------------------------------------------------------------------------------

    def check_gradients(self, method: str, grads: Sequence[Any]) -> None:
        for grad in grads:
            if grad is not None and not isinstance(grad, np.ndarray):
                raise wrong_object_error("nptape", method, grad, "NumPy arrays (None for no gradient)")

    def unscale(self, grads: Sequence[Any]) -> list[Any]:
        inverse = _inverse(float(self._arrays.scale))
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
        applied = finite and not (veto is not None and veto > 0)
        if applied:
            result = optimizer.apply(values, list(variables))
        else:
            result = None
            if not finite:  # counted in the branch that skips, for this iteration's record
                self._provenance.append(
                    (
                        self._count,
                        [(v.name, *_counts(g)) for g, v in zip(values, variables, strict=True) if g is not None],
                    )
                )
        return StepOutcome(result, np.float32(not finite), None)

    # The step and the update as `apply_and_advance` calls them (not through the class's names, which a test
    # may wrap to count the core's calls).
    _apply = apply
    _update = update

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

    # -- GuardingDevice ----------------------------------------------------------------------------------

    def count_skip(self, flag: Any) -> None:
        if flag is not None and flag > 0:
            self._skipped += 1

    # -- RecordingDevice ---------------------------------------------------------------------------------

    def new_history(self, capacity: int) -> list[int]:
        self._codes = [0] * capacity
        self._count = 0
        return self._codes

    def write_history(self, history: list[int], base: int, flag: Any, spike: Any = None) -> None:
        overflow = None if flag is None else np.asarray(flag) > 0
        history[self._count % len(history)] = int(rules.record_code(OPS, base, overflow, spike))
        self._count += 1

    def read_history(self, history: list[int]) -> tuple[int, list[int]]:
        return self._count, ring_codes(self._count, list(history))

    # -- ProvenanceDevice --------------------------------------------------------------------------------

    def read_provenance(self) -> list[tuple[int, list[tuple[str, int, int, int, int]]]]:
        found, self._provenance = self._provenance, []
        return found

    # -- SpikeDevice -------------------------------------------------------------------------------------

    def new_spike_state(self, rule: SpikeRule) -> _Window:
        return _Window(rule)

    def spike_statistic(self, loss: Any) -> np.float64:
        losses = loss if isinstance(loss, (list, tuple)) else [loss]
        return np.float64(rules.loss_statistic(OPS, [np.float64(item.value) for item in losses]))

    def spike_grad_norm(self, grads: Sequence[Any], *, unscaled: bool) -> np.float64:
        with np.errstate(over="ignore"):
            norm = rules.grad_norm(OPS, grads)
        return np.float64(norm if unscaled else norm / float(self._arrays.scale))

    def spike_check(self, state: _Window, x: Any) -> np.float32:
        with np.errstate(over="ignore", invalid="ignore"):  # an inf window's mean and spread, as on a device
            return np.float32(rules.is_spike(OPS, state.rule, state.arrays, np.float64(x)))

    def spike_finish(self, state: _Window, x: Any, spike: Any, overflow: Any) -> np.float32:
        overflowed = None if overflow is None else np.asarray(overflow) > 0
        state.arrays, only, rebase = rules.finish(
            OPS, state.rule, state.arrays, np.float64(x), np.asarray(spike) > 0, overflowed
        )
        return np.float32(rules.spike_flag(OPS, only, rebase))

    def read_spike_window(self, state: _Window) -> list[float]:
        values, count, _ = state.arrays
        return [float(v) for v in ring_values(int(count), values.tolist())]

    def read_spike_run(self, state: _Window) -> int:
        return int(state.arrays.run)

    def write_spike_window(self, state: _Window, values: list[float], run: int = 0) -> None:
        kept = list(values)[-state.rule.window :]
        ring = np.zeros(state.rule.window)
        ring[: len(kept)] = kept
        state.arrays = rules.SpikeWindowArrays(ring, np.int64(len(kept)), np.int64(run))


def _arrays(state: LossScaleState) -> rules.ScaleArrays:
    return rules.ScaleArrays(np.float32(state.scale), np.int32(state.growth_tracker), np.int32(state.hysteresis_left))


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
