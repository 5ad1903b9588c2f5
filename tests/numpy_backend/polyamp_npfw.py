"""polyamp_npfw: a complete polyamp backend for the NumPy framework ``npfw``, written only against
``polyamp`` and ``polyamp.backend_api`` (and ``polyamp.conformance`` for its harness).

It is the worked example of the README's "Backends" section: a spec that imports nothing, a backend
object, an imperative device form (PyTorch-style loop), a functional device form (state in, state out)
and a conformance harness (on `polyamp.conformance.HarnessBase`) declaring what it can do. Both device
forms keep step records, guard and decide a `polyamp.SpikeRule` (the stateful `RecordingDevice` /
`GuardingDevice` / `SpikeDevice` and the functional `FunctionalRecordingDevice` / `FunctionalGuardingDevice`
/ `FunctionalSpikeDevice`), with the same array arithmetic: the pure functions below, which the stateful form
applies to trees it keeps.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import npfw
import numpy as np

from polyamp import LossScaleConfig, LossScaler, LossScaleState, Policy, PolyampTypeError, SpikeRule
from polyamp.backend_api import BackendSpec, StepOutcome, rules
from polyamp.backend_api.arguments import wrong_object_error
from polyamp.backend_api.records import ring_codes, ring_values
from polyamp.backend_api.rules import ArrayOps
from polyamp.conformance import FunctionalTrainerBase, HarnessBase, LoopBase, TrainerBase, TrainerSettings

#: What a package would publish through the ``polyamp.backends`` entry-point group.
SPEC = BackendSpec(
    name="npfw",
    target="polyamp_npfw:NumpyBackend",
    frameworks=("npfw",),
    install_hint="pip install npfw",
    harness="polyamp_npfw:NumpyHarness",
)


def _inverse(scale: float) -> np.float32:
    return np.float32(1.0 / scale)  # formed in double, rounded to float32, as the torch backend does


def _is_set(flag: Any) -> bool:
    return flag is not None and bool(flag > 0)


def _non_finite(grads: Sequence[Any]) -> np.float32:
    return np.float32(not all(bool(np.isfinite(g).all()) for g in grads if g is not None))


# -- the array work of the rule, records and spike rule: polyamp's device rules over NumPy ------------------

OPS = ArrayOps(np)


def _tree(state: LossScaleState) -> dict[str, Any]:
    return {
        "scale": np.float32(state.scale),
        "growth_tracker": np.int32(state.growth_tracker),
        "hysteresis_left": np.int32(state.hysteresis_left),
        "skipped": np.int64(0),
    }


def _read(tree: Mapping[str, Any]) -> LossScaleState:
    return LossScaleState(float(tree["scale"]), int(tree["growth_tracker"]), int(tree["hysteresis_left"]))


def _counted(tree: Mapping[str, Any], flag: Any) -> dict[str, Any]:
    return {**tree, "skipped": tree["skipped"] + np.int64(_is_set(flag))}


def _arrays(tree: Mapping[str, Any]) -> rules.ScaleArrays:
    return rules.ScaleArrays(tree["scale"], tree["growth_tracker"], tree["hysteresis_left"])


def _advance(config: LossScaleConfig, tree: Mapping[str, Any], found_inf: Any) -> dict[str, Any]:
    overflow = np.asarray(found_inf) > 0
    with np.errstate(over="ignore"):  # a product beyond float32 is inf, which the rule does not keep
        arrays = rules.advance(OPS, config, _arrays(tree), overflow)
    return {**tree, **arrays._asdict(), "skipped": tree["skipped"] + overflow.astype(np.int64)}


def _ring_init(capacity: int) -> dict[str, Any]:
    return {"codes": np.zeros(capacity, np.int32), "count": np.int64(0)}


def _ring_write(ring: Mapping[str, Any], base: int, flag: Any, spike: Any = None) -> dict[str, Any]:
    overflow = None if flag is None else np.asarray(flag) > 0
    codes = np.array(ring["codes"])
    codes[int(ring["count"]) % len(codes)] = rules.record_code(OPS, base, overflow, spike)
    return {"codes": codes, "count": ring["count"] + np.int64(1)}


def _ring_read(ring: Mapping[str, Any]) -> tuple[int, list[int]]:
    count = int(ring["count"])
    return count, ring_codes(count, list(ring["codes"]))


def _window_init(rule: SpikeRule) -> dict[str, Any]:
    return {"values": np.zeros(rule.window, np.float64), "count": np.int64(0), "run": np.int64(0)}


def _window(window: Mapping[str, Any]) -> rules.SpikeWindowArrays:
    return rules.SpikeWindowArrays(window["values"], window["count"], window["run"])


def _window_values(window: Mapping[str, Any]) -> list[float]:
    return [float(v) for v in ring_values(int(window["count"]), list(window["values"]))]


def _spike_check(rule: SpikeRule, window: Mapping[str, Any], x: Any) -> np.float32:
    with np.errstate(over="ignore", invalid="ignore"):  # an inf window's mean and spread, as on a device
        return np.float32(rules.is_spike(OPS, rule, _window(window), np.float64(x)))


def _spike_finish(
    rule: SpikeRule, window: Mapping[str, Any], x: Any, spike: Any, overflow: Any
) -> tuple[dict[str, Any], np.float32]:
    overflowed = None if overflow is None else np.asarray(overflow) > 0
    new, only, rebase = rules.finish(OPS, rule, _window(window), np.float64(x), np.asarray(spike) > 0, overflowed)
    return new._asdict(), np.float32(rules.spike_flag(OPS, only, rebase))


def _write_window(window: Mapping[str, Any], values: Sequence[float], run: int) -> dict[str, Any]:
    array = np.zeros(len(window["values"]), np.float64)
    kept = list(values)[-len(array) :]
    array[: len(kept)] = kept
    return {"values": array, "count": np.int64(len(kept)), "run": np.int64(run)}


def _grad_norm(grads: Sequence[Any]) -> np.float64:
    with np.errstate(over="ignore"):
        return np.float64(rules.grad_norm(OPS, grads))


def _loss_statistic(losses: Sequence[Any]) -> np.float64:
    return np.float64(rules.loss_statistic(OPS, [np.float64(loss) for loss in losses]))


class NumpyDevice:
    """The imperative device form: the state as NumPy scalars, gradients on the parameters."""

    def __init__(self, config: LossScaleConfig, state: LossScaleState) -> None:
        self._config = config
        self._tree = _tree(state)

    def check_optimizer(self, method: str, optimizer: object) -> None:
        if not isinstance(optimizer, npfw.Optimizer):
            raise wrong_object_error("npfw", method, optimizer, "an npfw.Optimizer")

    def read_state(self) -> LossScaleState:
        return _read(self._tree)

    def write_state(self, config: LossScaleConfig, state: LossScaleState | None) -> None:
        self._config = config
        if state is not None:
            self._tree = {**_tree(state), "skipped": self._tree["skipped"]}

    def scale(self, loss: Any) -> Any:
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(item) for item in loss)
        if not isinstance(loss, npfw.Tensor):
            raise wrong_object_error("npfw", "scale", loss, "an npfw.Tensor")
        return loss * float(self._tree["scale"])

    def unscale_gradients(self, optimizer: npfw.Optimizer) -> np.float32 | None:
        grads = [p for p in optimizer.params if p.grad is not None]
        if not grads:
            return None
        inverse = _inverse(float(self._tree["scale"]))
        found = False
        for param in grads:
            assert param.grad is not None
            param.grad = (param.grad * inverse).astype(np.float32)
            found |= not bool(np.isfinite(param.grad).all())
        return np.float32(found)

    def unscales_in_step(self, optimizer: npfw.Optimizer) -> bool:
        return False

    def step(
        self, optimizer: npfw.Optimizer, found_inf: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> StepOutcome:
        skipped = bool(found_inf > 0)
        return StepOutcome(None if skipped else optimizer.step(*args, **kwargs), found_inf, skipped)

    def plain_step(self, optimizer: npfw.Optimizer, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        return optimizer.step(*args, **kwargs)

    def combine(self, flags: Sequence[Any]) -> np.float32:
        return np.float32(max(flags))

    def read_new_scale(self, new_scale: Any) -> float | None:
        raise PolyampTypeError(f"npfw's update(new_scale) takes a float, not {type(new_scale).__name__}")

    def update(self, found_inf: Any, new_scale: Any) -> None:
        if new_scale is None:
            self._tree = _advance(self._config, self._tree, found_inf)
            return
        if not isinstance(new_scale, float):
            raise PolyampTypeError(f"npfw's update(new_scale) takes a float, not {type(new_scale).__name__}")
        self._tree = {**self._tree, "scale": np.float32(new_scale)}
        self.count_skip(found_inf)

    def skipped(self, found_inf: Any) -> np.bool_:
        return np.bool_(found_inf > 0)

    def read_flag(self, found_inf: Any) -> bool:
        return bool(found_inf > 0)

    def finite_flag(self) -> np.float32:
        return np.float32(0.0)

    def new_record(self) -> list[Any]:
        return [None]

    def write_record(self, record: list[Any], found_inf: Any) -> None:
        record[0] = found_inf

    def read_record(self, record: list[Any]) -> Any:
        return record[0]

    def skipped_steps(self) -> np.int64:
        return np.int64(self._tree["skipped"])

    # -- GuardingDevice, with check_gradients_finite ---------------------------------------------------------

    def check_gradients_finite(self, optimizer: npfw.Optimizer) -> np.float32 | None:
        grads = [p.grad for p in optimizer.params if p.grad is not None]
        return _non_finite(grads) if grads else None

    def count_skip(self, flag: Any) -> None:
        self._tree = _counted(self._tree, flag)

    # -- RecordingDevice ---------------------------------------------------------------------------------

    def new_history(self, capacity: int) -> dict[str, Any]:
        return _ring_init(capacity)

    def write_history(self, history: dict[str, Any], base: int, flag: Any, spike: Any = None) -> None:
        history.update(_ring_write(history, base, flag, spike))

    def read_history(self, history: dict[str, Any]) -> tuple[int, list[int]]:
        return _ring_read(history)

    # -- SpikeDevice: the window is the functional form's tree, with its rule ------------------------------

    def new_spike_state(self, rule: SpikeRule) -> dict[str, Any]:
        return {"rule": rule, "window": _window_init(rule)}

    def spike_statistic(self, loss: Any) -> np.float64:
        losses = loss if isinstance(loss, (list, tuple)) else [loss]
        return _loss_statistic([item.value for item in losses])

    def spike_grad_norm(self, optimizer: npfw.Optimizer) -> np.float64:
        return _grad_norm([p.grad for p in optimizer.params])

    def spike_check(self, state: dict[str, Any], x: Any) -> np.float32:
        return _spike_check(state["rule"], state["window"], x)

    def spike_finish(self, state: dict[str, Any], x: Any, spike: Any, overflow: Any) -> np.float32:
        state["window"], only = _spike_finish(state["rule"], state["window"], x, spike, overflow)
        return only

    def read_spike_window(self, state: dict[str, Any]) -> list[float]:
        return _window_values(state["window"])

    def read_spike_run(self, state: dict[str, Any]) -> int:
        return int(state["window"]["run"])

    def write_spike_window(self, state: dict[str, Any], values: list[float], run: int = 0) -> None:
        state["window"] = _write_window(state["window"], values, run)


class NumpyFunctional:
    """The functional device form: a state dict of NumPy scalars in, a new one out."""

    def __init__(self, config: LossScaleConfig) -> None:
        self._config = config

    def init(self, state: LossScaleState, skipped: int = 0) -> dict[str, Any]:
        return {**_tree(state), "skipped": np.int64(skipped)}

    def read(self, tree: Mapping[str, Any]) -> LossScaleState:
        return _read(tree)

    def skipped_count(self, tree: Mapping[str, Any]) -> Any:
        return tree["skipped"]

    def scale(self, tree: Mapping[str, Any], loss: Any) -> Any:
        return loss * float(tree["scale"])

    def unscale(self, tree: Mapping[str, Any], grads: list[np.ndarray]) -> tuple[list[np.ndarray], np.float32]:
        inverse = _inverse(float(tree["scale"]))
        unscaled = [(g * inverse).astype(np.float32) for g in grads]
        return unscaled, _non_finite(unscaled)

    def update(self, tree: Mapping[str, Any], found_inf: Any) -> dict[str, Any]:
        return _advance(self._config, tree, found_inf)

    def select(self, found_inf: Any, if_skipped: Any, if_applied: Any) -> Any:
        return if_skipped if found_inf > 0 else if_applied

    # -- FunctionalGuardingDevice ------------------------------------------------------------------------

    def check(self, tree: Mapping[str, Any], grads: list[np.ndarray]) -> np.float32:
        return _non_finite(grads)

    def count_skip(self, tree: Mapping[str, Any], flag: Any) -> dict[str, Any]:
        return _counted(tree, flag)

    # -- FunctionalRecordingDevice -----------------------------------------------------------------------

    def ring_init(self, capacity: int) -> dict[str, Any]:
        return _ring_init(capacity)

    def ring_write(self, ring: Mapping[str, Any], base: int, flag: Any, spike: Any = None) -> dict[str, Any]:
        return _ring_write(ring, base, flag, spike)

    def ring_read(self, ring: Mapping[str, Any]) -> tuple[int, list[int]]:
        return _ring_read(ring)

    # -- FunctionalSpikeDevice ---------------------------------------------------------------------------

    def window_init(self, rule: SpikeRule) -> dict[str, Any]:
        return _window_init(rule)

    def spike_statistic(self, loss: Any) -> np.float64:
        return _loss_statistic(loss if isinstance(loss, (list, tuple)) else [loss])

    def spike_grad_norm(self, grads: list[np.ndarray]) -> np.float64:
        return _grad_norm(grads)

    def spike_check(self, rule: SpikeRule, window: Mapping[str, Any], x: Any) -> np.float32:
        return _spike_check(rule, window, x)

    def spike_finish(
        self, rule: SpikeRule, window: Mapping[str, Any], x: Any, spike: Any, overflow: Any
    ) -> tuple[dict[str, Any], np.float32]:
        return _spike_finish(rule, window, x, spike, overflow)

    def combine(self, first: Any, second: Any) -> np.float32:
        return np.float32(max(first, second))

    def read_window(self, window: Mapping[str, Any]) -> tuple[list[float], int]:
        return _window_values(window), int(window["run"])

    def write_window(self, window: Mapping[str, Any], values: list[float], run: int) -> dict[str, Any]:
        return _write_window(window, values, run)


class NumpyBackend:
    name = "npfw"

    def make_device(self, config: LossScaleConfig, state: LossScaleState) -> NumpyDevice:
        return NumpyDevice(config, state)

    def make_functional(self, config: LossScaleConfig) -> NumpyFunctional:
        return NumpyFunctional(config)


# -- the conformance harness ----------------------------------------------------------------------------


def _clip(params: Sequence[npfw.Parameter], max_norm: float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
    factor = np.float32(min(1.0, max_norm / (norm + 1e-6)))
    for param in params:
        if param.grad is not None:
            param.grad = (param.grad * factor).astype(np.float32)


def _slots(optimizer: npfw.Optimizer) -> list[Any]:
    return [value for state in optimizer.state for _, value in sorted(state.items())]


class NumpyTrainer(TrainerBase):
    def __init__(self, harness: NumpyHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.params_ = params = npfw.mlp(settings.seed)
        self.opt = settings.make_optimizer(
            {"sgd": lambda: npfw.SGD(params, lr=0.1, momentum=0.9), "adam": lambda: npfw.Adam(params, lr=0.01)}
        )
        self.scaler = self.make_scaler()

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        self.opt.zero_grad()
        loss = npfw.loss(self.params_, x, y)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if overflow:
            grad = self.params_[0].grad
            assert grad is not None
            grad.reshape(-1)[0] = np.inf
        if self.settings.clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)
            _clip(self.params_, self.settings.clip)
        self.optimizer_step()
        return loss.value

    def weights(self) -> list[np.ndarray]:
        return [p.data for p in self.params_]

    def slots(self) -> list[Any]:
        return _slots(self.opt)


class NumpyLoop(LoopBase):
    def __init__(self, harness: NumpyHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.params_ = npfw.mlp(settings.seed)
        self.optimizers = [npfw.SGD(group, lr=0.1, momentum=0.9) for group in (self.params_[:2], self.params_[2:])]
        self.scaler = self.make_scaler()

    def run_backward(self, overflow: Collection[int]) -> None:
        x, y = self.next_batch()
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        self.scaler.scale(npfw.loss(self.params_, x, y)).backward()
        for index in overflow:
            grad = self.optimizers[index].params[0].grad
            assert grad is not None
            grad.reshape(-1)[0] = np.inf

    def weights(self, index: int) -> list[np.ndarray]:
        return [p.data for p in self.optimizers[index].params]

    def slots(self, index: int) -> list[Any]:
        return _slots(self.optimizers[index])


class NumpyFunctionalTrainer(FunctionalTrainerBase):
    """SGD with momentum written as a pure function, driven through `polyamp.FunctionalLossScaler` (the guard,
    records and spike rule included, as the scaler's options ask)."""

    def __init__(self, harness: NumpyHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.arrays = [p.data for p in npfw.mlp(settings.seed)]
        self.momentum = [np.zeros_like(a) for a in self.arrays]

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        value, grads = npfw.loss_and_grads(self.arrays, x, y)
        scale = np.float32(self.fn.scale(self.state, 1.0))  # d(scaled loss)/d(loss)
        grads = [(g * scale).astype(np.float32) for g in grads]
        if overflow:
            grads[0].reshape(-1)[0] = np.inf
        grads, found_inf = self.fn.unscale(self.state, grads)
        spike = self.fn.spike(self.state, loss=value, grads=grads)
        momentum = [(np.float32(0.9) * m + g).astype(np.float32) for m, g in zip(self.momentum, grads, strict=True)]
        arrays = [(a - np.float32(0.1) * m).astype(np.float32) for a, m in zip(self.arrays, momentum, strict=True)]
        self.arrays, self.momentum = self.fn.apply_if_finite(
            found_inf, (arrays, momentum), (self.arrays, self.momentum), spike=spike
        )
        self.state = self.fn.update(self.state, found_inf, spike=spike)
        self.skipped = self.fn.skipped(found_inf, spike)
        return value

    def weights(self) -> list[np.ndarray]:
        return self.arrays

    def slots(self) -> list[np.ndarray]:
        return self.momentum


class NumpyHarness(HarnessBase):
    """npfw on the CPU. It computes in float32 whatever the policy (no "low_precision" capability), and has
    no op classes or model dtypes to report."""

    backend = "npfw"
    devices = ("cpu",)
    trainer_class = NumpyTrainer

    def loop(self, policy: Policy, *, scaler: Mapping[str, Any], seed: int = 0) -> NumpyLoop:
        return NumpyLoop(self, policy, self.settings(scaler, seed=seed))

    def functional_trainer(self, policy: Policy, *, scaler: Mapping[str, Any], seed: int = 0) -> NumpyFunctionalTrainer:
        return NumpyFunctionalTrainer(self, policy, self.settings(scaler, seed=seed))

    def passes_loss_through(self, scaler: LossScaler) -> bool:
        loss = npfw.Tensor(1.5)
        return scaler.scale(loss) is loss


__all__ = ["SPEC", "NumpyBackend", "NumpyDevice", "NumpyFunctional", "NumpyHarness"]
