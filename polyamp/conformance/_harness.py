"""Bases for a backend's conformance harness: the parts every harness restates, written once.

A harness may inherit `HarnessBase`, and its trainers and loops `TrainerBase`, `FunctionalTrainerBase` and
`LoopBase`; it then keeps only what is its framework's (the model, one step, the conversion of a value to
NumPy). The cases still talk to the `Harness` protocol: nothing requires these classes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import polyamp
from polyamp.conformance._protocol import HarnessUnavailable

if TYPE_CHECKING:
    import numpy as np

    from polyamp import FunctionalLossScaler, LossScaler, Policy, StepRecord

__all__ = ["FunctionalScalerView", "FunctionalTrainerBase", "HarnessBase", "LoopBase", "TrainerBase", "TrainerSettings"]

T = TypeVar("T")


def _listed(names: Collection[str]) -> str:
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


@dataclass(frozen=True)
class TrainerSettings:
    """What a case asked a harness for (see `Harness.trainer`), as its trainer or loop receives it.

    Attributes:
        scaler: Keyword arguments for the backend's `polyamp.LossScaler` (the harness's
            ``extra_scaler_options`` included); None: a plain loop without a scaler.
        optimizer: "sgd" (momentum 0.9, lr 0.1) or "adam" (lr 0.01).
        clip: Unscale, then clip the global gradient norm to this value (None: no clipping).
        seed: Same seed, same initial weights.
    """

    scaler: Mapping[str, Any] | None = None
    optimizer: str = "sgd"
    clip: float | None = None
    seed: int = 0

    def make_optimizer(self, choices: Mapping[str, Callable[[], T]]) -> T:
        """The optimizer ``optimizer`` names, made by its entry of ``choices`` (e.g. ``{"sgd": ..., "adam": ...}``).

        Raises:
            ValueError: ``choices`` has no such optimizer.
        """
        if self.optimizer not in choices:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; the harness knows {_listed(list(choices))}")
        return choices[self.optimizer]()


class HarnessBase:
    """The part of a `Harness` every backend shares: its attributes, its device check and ``trainer()``.

    A subclass sets ``backend``, ``devices``, ``trainer_class`` (a `TrainerBase`) and, where they apply,
    ``capabilities`` and ``divergences``; it checks what its framework sees in `check_device` and adds the
    protocol methods its backend offers (``op_dtype``, ``loop``, ``functional_trainer``, ...), building loops
    and functional trainers from `settings`.

    Attributes:
        device: The device type this harness runs on (one of ``devices``).
        extra_scaler_options: Keyword arguments added to every case's scaler options (e.g.
            ``{"skip_on_device": True}`` for a run that checks that form against the same expectations).
    """

    backend: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    capabilities: ClassVar[frozenset[str]] = frozenset()
    divergences: Mapping[str, str] = MappingProxyType({})
    trainer_class: ClassVar[type[TrainerBase]]

    def __init__(self, device: str) -> None:
        """Make the harness for ``device``.

        Raises:
            HarnessUnavailable: ``device`` is not one of ``devices``, or `check_device` finds it unavailable.
        """
        self.check_device(device)
        if device not in self.devices:
            raise HarnessUnavailable(f"the {self.backend} harness runs on {_listed(self.devices)}, not {device!r}")
        self.device = device
        self.extra_scaler_options: Mapping[str, Any] = MappingProxyType({})

    def check_device(self, device: str) -> None:
        """Raise `HarnessUnavailable` with the reason where ``device`` cannot run here (no GPU, the framework
        set up otherwise). Called before the check against ``devices``; by default every device can."""

    def settings(
        self,
        scaler: Mapping[str, Any] | None = None,
        optimizer: str = "sgd",
        clip: float | None = None,
        seed: int = 0,
    ) -> TrainerSettings:
        """A case's request as `TrainerSettings`, with ``extra_scaler_options`` added to a scaler's options."""
        if scaler is not None and self.extra_scaler_options:
            scaler = {**scaler, **self.extra_scaler_options}
        return TrainerSettings(scaler, optimizer, clip, seed)

    def trainer(
        self,
        policy: Policy,
        *,
        scaler: Mapping[str, Any] | None = None,
        optimizer: str = "sgd",
        clip: float | None = None,
        seed: int = 0,
    ) -> TrainerBase:
        """A ``trainer_class`` under ``policy`` (see `Harness.trainer`)."""
        return self.trainer_class(self, policy, self.settings(scaler, optimizer, clip, seed))


class _Driver:
    """What trainers and loops share: the harness, the policy the program they stand for set, the settings."""

    #: The scaler the cases read: a `polyamp.LossScaler`, a view of a functional state, or None.
    scaler: Any

    def __init__(self, harness: HarnessBase, policy: Policy, settings: TrainerSettings) -> None:
        self.harness = harness
        self.policy = policy
        self.settings = settings

    def make_scaler(self) -> LossScaler | None:
        """A `polyamp.LossScaler` for the harness's backend from ``settings.scaler`` (None without), made under
        the policy, so that ``enabled=None`` follows it."""
        if self.settings.scaler is None:
            return None
        with polyamp.policy_scope(self.policy):
            return polyamp.LossScaler(**self.settings.scaler, backend=self.harness.backend)

    def to_numpy(self, value: Any) -> np.ndarray:
        """One of the framework's values (a parameter, an optimizer slot, a flag) as a NumPy array."""
        import numpy as np

        return np.asarray(value)


class TrainerBase(_Driver):
    """The shared part of a `Trainer`: ``step`` under the trainer's policy, and ``params()``,
    ``optimizer_state()`` and ``step_skipped()`` read through `to_numpy`.

    A subclass builds its model, optimizer (`TrainerSettings.make_optimizer`) and scaler (``make_scaler()``)
    in ``__init__`` and defines `run_step`, `weights` and `slots`.

    Attributes:
        harness: The harness that made the trainer.
        policy: The policy the program this trainer stands for set.
        settings: What the case asked for.
        opt: The optimizer (``step_skipped()`` asks the scaler about it).
    """

    opt: Any

    def __init__(self, harness: HarnessBase, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.scaler = None

    def step(self, x: np.ndarray, y: np.ndarray, *, overflow: bool = False) -> float:
        """One iteration (`run_step`) under the trainer's policy. Returns the loss."""
        with polyamp.policy_scope(self.policy):
            return self.run_step(x, y, overflow)

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        """One iteration; ``overflow`` plants an inf in one (scaled) gradient after backward. Returns the loss."""
        raise NotImplementedError

    def weights(self) -> Iterable[Any]:
        """The parameters, as the framework holds them."""
        raise NotImplementedError

    def slots(self) -> Iterable[Any]:
        """The optimizer's slots and step counters, as the framework holds them."""
        raise NotImplementedError

    def params(self) -> list[np.ndarray]:
        """The parameters as float32 NumPy arrays."""
        import numpy as np

        return [np.array(self.to_numpy(weight), dtype=np.float32) for weight in self.weights()]

    def optimizer_state(self) -> list[np.ndarray]:
        """The optimizer's slots and step counters as NumPy arrays, each as stored."""
        import numpy as np

        return [np.array(self.to_numpy(slot)) for slot in self.slots()]

    def optimizer_step(self) -> None:
        """An imperative loop's step of ``opt``: ``scaler.step`` and ``scaler.update``, or ``opt.step()``
        without a scaler."""
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()

    def step_skipped(self) -> bool:
        """Whether the scaler skipped the last step of ``opt`` (False without a scaler)."""
        return self.scaler is not None and bool(self.to_numpy(self.scaler.step_skipped(self.opt)))


class FunctionalScalerView:
    """What the cases read from a functional trainer's ``scaler``: the state dict, the records and the skip count
    of the current functional state, and a state dict loaded into it."""

    def __init__(self, read: Callable[[], tuple[FunctionalLossScaler, Any]], write: Callable[[Any], None]) -> None:
        """``read()`` gives the functional scaler and its current state; ``write(state)`` replaces the state."""
        self._read = read
        self._write = write

    def state_dict(self) -> dict[str, Any]:
        fn, state = self._read()
        return fn.state_dict(state)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        fn, state = self._read()
        self._write(fn.load_state_dict(saved, like=state))

    def records(self) -> list[StepRecord]:
        fn, state = self._read()
        return fn.records(state)

    def skipped_steps(self) -> Any:
        fn, state = self._read()
        return fn.skipped_steps(state)


class FunctionalTrainerBase(TrainerBase):
    """A trainer driven through ``LossScaler(**settings.scaler).functional()`` (state in, state out), as
    ``Harness.functional_trainer`` returns: ``fn`` and its ``state``, a `FunctionalScalerView` as ``scaler``,
    and ``step_skipped()`` read from ``skipped``, the flag ``fn.skipped(...)`` gave for the last step."""

    def __init__(self, harness: HarnessBase, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        with polyamp.policy_scope(policy):
            self.fn = polyamp.LossScaler(**(settings.scaler or {})).functional(backend=harness.backend)
        self.state = self.fn.init()
        self.scaler = FunctionalScalerView(lambda: (self.fn, self.state), self._set_state)
        self.skipped: Any = None

    def _set_state(self, state: Any) -> None:
        self.state = state

    def step_skipped(self) -> bool:
        return self.skipped is not None and bool(self.to_numpy(self.skipped) > 0)


class LoopBase(_Driver):
    """The shared part of a `Loop`: ``backward`` under the loop's policy, ``unscale`` / ``step`` / ``update`` in
    PyTorch's style (``unscale_(opt)``, ``step(opt)``), and ``params(index)`` / ``optimizer_state(index)`` read
    through `to_numpy`.

    A subclass builds its two-layer model, ``optimizers`` and ``scaler`` (``make_scaler()``) in ``__init__``
    and defines `run_backward`, `weights` and `slots`; a tape-style loop also ``unscale`` and ``step`` on the
    gradients it holds.
    """

    optimizers: list[Any]

    def __init__(self, harness: HarnessBase, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self._batch = 0

    def backward(self, overflow: Collection[int] = ()) -> None:
        """`run_backward` under the loop's policy."""
        with polyamp.policy_scope(self.policy):
            self.run_backward(overflow)

    def run_backward(self, overflow: Collection[int]) -> None:
        """Forward a batch, scale the loss, backpropagate; plant an inf in a (scaled) gradient of each listed
        optimizer."""
        raise NotImplementedError

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next batch: 16 float32 rows of 8 inputs and their 4-class labels, the same for every backend."""
        import numpy as np

        rng = np.random.default_rng(self._batch)
        self._batch += 1
        return rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 4, size=(16,))

    def unscale(self, index: int) -> None:
        self.scaler.unscale_(self.optimizers[index])

    def step(self, index: int) -> None:
        self.scaler.step(self.optimizers[index])

    def update(self) -> None:
        self.scaler.update()

    def weights(self, index: int) -> Iterable[Any]:
        """Optimizer ``index``'s parameters, as the framework holds them."""
        raise NotImplementedError

    def slots(self, index: int) -> Iterable[Any]:
        """Optimizer ``index``'s slots and counters, as the framework holds them."""
        raise NotImplementedError

    def params(self, index: int) -> list[np.ndarray]:
        import numpy as np

        return [np.array(self.to_numpy(weight), dtype=np.float32) for weight in self.weights(index)]

    def optimizer_state(self, index: int) -> list[np.ndarray]:
        import numpy as np

        return [np.array(self.to_numpy(slot)) for slot in self.slots(index)]
