"""One iteration of a loss scaler: the stages optimizers go through and the misuse each stage forbids.

An iteration runs from the first call after an `update` to the next `update` (``apply_gradients`` is a
step and an update in one call). Within it, each optimizer moves through three stages:

* ``READY``: nothing happened to its gradients yet;
* ``UNSCALED``: its gradients were divided by the scale and checked (``unscale_``); a second unscale
  would divide them twice, so it is refused;
* ``STEPPED``: ``step`` applied or skipped it; a second step before `update` is refused.

`update` needs at least one optimizer unscaled or stepped (it would otherwise advance the scale on no
evidence), except with ``new_scale``, which just sets the scale. These rules are the same for every
framework; backends never see them.

TensorFlow-style loops unscale *gradients* rather than optimizers (``unscale(grads)``); `UnscaleStages`
keeps those pending stages, so the next ``apply_gradients`` takes its gradients as unscaled and nothing is
divided twice.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from polyamp._src.errors import ScalerUsageError

__all__ = ["NOT_SCALED_RULE", "Iteration", "Stage", "UnscaleStages", "no_gradients_error", "not_scaled_error"]

#: The iteration rule for scaling, in the words every loop style uses: an iteration that scales unscales only
#: gradients of a loss scaled in that iteration.
NOT_SCALED_RULE = (
    "In an iteration that scales, the gradients must come from a loss scaled in that iteration: dividing the "
    "gradients of an unscaled loss by the loss scale shrinks every update to almost nothing. Call scale(loss) "
    "(Keras: optimizer.scale_loss(loss)) and take the gradients of what it returns, in every iteration."
)


def no_gradients_error(method: str = "step()") -> ScalerUsageError:
    """The error for stepping an optimizer none of whose parameters has a gradient."""
    return ScalerUsageError(
        f"{method}: none of the optimizer's parameters has a gradient. Call scaler.scale(loss).backward() "
        f"before {method}."
    )


def not_scaled_error(method: str) -> ScalerUsageError:
    """The error for unscaling or stepping in an iteration that scales but whose loss was not scaled."""
    return ScalerUsageError(f"{method} was called before scale() in this iteration. {NOT_SCALED_RULE}")


class Stage(enum.Enum):
    """Where one optimizer is in the current iteration."""

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass
class _Entry:
    optimizer: Any  # held while the iteration is open, so its id() cannot be reused by another object
    stage: Stage = Stage.READY
    found_inf: Any = None


class UnscaleStages:
    """Gradients unscaled by a TensorFlow-style ``unscale(grads)``, waiting for their ``apply_gradients``.

    The next apply takes its gradients as unscaled when they are the ones ``unscale`` returned or new
    tensors made from them (clipping returns new tensors). Two mistakes are refused instead of silently
    mis-scaling: passing the scaled gradients that went into ``unscale``, and mixing its outputs with other
    gradients. A stage lasts until its apply, the next ``scale`` (new losses mean new, scaled gradients) or
    the end of the iteration, so a stage left behind never makes later gradients count as unscaled.
    Bookkeeping is in Python: inside a compiled function it happens once per trace, consistently.
    """

    def __init__(self) -> None:
        # (ids of scaled inputs, ids of unscaled outputs, strong references keeping those ids unique)
        self._pending: list[tuple[set[int], set[int], list[Any]]] = []

    @property
    def pending(self) -> bool:
        """True while some unscaled gradients wait for their apply."""
        return bool(self._pending)

    def record(self, inputs: Sequence[Any], outputs: Sequence[Any], *, method: str = "unscale()") -> None:
        """Note that ``outputs`` are ``inputs`` unscaled; refuse gradients that are already unscaled."""
        ids = {id(g) for g in inputs if g is not None}
        if any(ids & unscaled for _, unscaled, _ in self._pending):
            raise ScalerUsageError(
                f"{method} received gradients it already unscaled in this iteration; dividing them again "
                "would shrink them by the scale twice. Unscale each gradient once per iteration."
            )
        self._pending.append((ids, {id(g) for g in outputs if g is not None}, [*inputs, *outputs]))

    def check(self, grads: Sequence[Any], where: str) -> int | None:
        """Which pending stage ``grads`` consume (an index for `consume`), or None to unscale them as usual.

        Raises:
            ScalerUsageError: ``grads`` hold gradients passed to ``unscale`` (still scaled), or mix unscaled
                gradients with others. Nothing changes.
        """
        if not self._pending:
            return None
        ids = [id(g) for g in grads if g is not None]
        if any(i in scaled for scaled, _, _ in self._pending for i in ids):
            raise ScalerUsageError(
                f"{where} received the scaled gradients that were passed to unscale()/get_unscaled_gradients(). "
                "Pass the unscaled gradients it returned (clipped or transformed as you like)."
            )
        for index, (_, unscaled, _) in enumerate(self._pending):
            returned = [i in unscaled for i in ids]
            if any(returned):
                if not all(returned):
                    raise ScalerUsageError(
                        f"{where} received a mix of gradients returned by unscale()/get_unscaled_gradients() "
                        "and other gradients: some would be divided by the loss scale twice or not at all. "
                        "Unscale all of them together, or none and let the apply do it."
                    )
                return index
        return 0  # new tensors made from the oldest stage's gradients (e.g. clipped)

    def consume(self, index: int) -> None:
        """Close the stage `check` chose."""
        del self._pending[index]

    def clear(self) -> None:
        """Drop every pending stage."""
        self._pending.clear()


@dataclass
class Iteration:
    """The state of the current iteration of one `polyamp.LossScaler`.

    Attributes:
        enabled: Whether scaling is on in this iteration, decided at its first call (None before).
        stages: Pending TensorFlow-style unscale stages.
    """

    enabled: bool | None = None
    #: Whether this iteration, not scaling, checks the gradients (the guard), decided with ``enabled``.
    guarding: bool = False
    stages: UnscaleStages = field(default_factory=UnscaleStages)
    #: The thread that started the iteration (one scaler serves one training loop).
    thread: int | None = None
    #: Whether ``scale`` scaled a loss in this iteration (the iteration rule: see `not_scaled_error`).
    scaled: bool = False
    #: How many optimizers have a flag (an unscale or step produced one): the length of `found_infs`, kept.
    flagged: int = 0
    #: Whether a device advanced the loss-scale rule with the step (``apply_and_advance``,
    #: `polyamp.backend_api.OptionalMethods`): the iteration's end does not advance it again.
    advanced: bool = False
    _entries: dict[int, _Entry] = field(default_factory=dict)
    # The entry marked or looked up last, found again without `id` (most iterations step one optimizer).
    _last: _Entry | None = None

    @property
    def is_open(self) -> bool:
        """True between a first ``unscale``/``step`` and the ``update`` that ends the iteration."""
        return bool(self._entries) or self.stages.pending

    def _entry(self, optimizer: Any) -> _Entry | None:
        entry = self._last
        if entry is not None and entry.optimizer is optimizer:
            return entry
        entry = self._entries.get(id(optimizer))
        if entry is not None:
            self._last = entry
        return entry

    def stage(self, optimizer: Any) -> Stage:
        entry = self._entry(optimizer)
        return Stage.READY if entry is None else entry.stage

    def loss_scaled(self) -> None:
        """``scale`` scaled a loss: the iteration rule is met, and pending unscale stages end (new losses mean
        new, scaled gradients)."""
        self.scaled = True
        if self.stages._pending:  # (no call when nothing is pending)
            self.stages.clear()

    def check_unscale(self, optimizer: Any, method: str) -> None:
        """Raise `ScalerUsageError` if ``optimizer``'s gradients must not be unscaled now."""
        stage = self.stage(optimizer) if self._entries else Stage.READY
        if stage is Stage.UNSCALED:
            raise ScalerUsageError(
                f"{method} was already called for this optimizer since the last update(); a second call would "
                "divide the gradients by the scale twice. Call it at most once per optimizer per iteration."
            )
        if stage is Stage.STEPPED:
            raise ScalerUsageError(
                f"{method} was called after step() for this optimizer. Call it before step() (step() unscales "
                "by itself when you do not), or after update() for the next iteration."
            )

    def check_step(self, optimizer: Any, method: str) -> Stage:
        """Raise `ScalerUsageError` if ``optimizer`` must not be stepped now; else return its stage."""
        stage = self.stage(optimizer) if self._entries else Stage.READY
        if stage is Stage.STEPPED:
            raise ScalerUsageError(
                f"{method} was already called for this optimizer since the last update(). Call update() once "
                "at the end of each iteration, after every optimizer's step."
            )
        return stage

    def mark(self, optimizer: Any, stage: Stage, found_inf: Any) -> None:
        """Record that ``optimizer`` reached ``stage`` with ``found_inf`` (the device flag)."""
        entry = self._last
        if entry is None or entry.optimizer is not optimizer:
            entry = self._entry(optimizer) if self._entries else None
            if entry is None:
                entry = self._last = self._entries[id(optimizer)] = _Entry(optimizer)
        self.flagged += (found_inf is not None) - (entry.found_inf is not None)
        entry.stage = stage
        entry.found_inf = found_inf

    def found_inf_of(self, optimizer: Any) -> Any:
        """The flag ``optimizer``'s unscale or step produced in this iteration (None if none)."""
        entry = self._entry(optimizer)
        return None if entry is None else entry.found_inf

    def found_infs(self) -> list[Any]:
        """The flags of every optimizer unscaled or stepped in this iteration."""
        return [entry.found_inf for entry in self._entries.values() if entry.found_inf is not None]

    def check_update(self, method: str = "update()") -> None:
        """Raise `ScalerUsageError` if no optimizer was unscaled or stepped in this iteration."""
        if not self._entries:
            raise ScalerUsageError(
                f"{method} was called but no step() or unscale_() happened since the last update(). Call "
                "scaler.step(optimizer) for each optimizer, then update() once per iteration."
            )

    def close(self) -> None:
        """End the iteration: every optimizer is ready again and scaling is decided anew at the next call."""
        if self._entries:
            self._entries = {}
            self._last = None
        self.flagged = 0
        self.advanced = False
        if self.stages._pending:  # (ended every step: no call when nothing is pending)
            self.stages.clear()
        self.enabled = None
        self.guarding = False
        self.thread = None
        self.scaled = False
