"""What happened: the step records, whether a step was skipped, the skip count.

A part of `polyamp.LossScaler` (`polyamp._src.loss_scaler` joins them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyamp._src.errors import (
    ScalerUsageError,
    describe,
)
from polyamp._src.iteration import Stage
from polyamp._src.records import (
    StepRecord,
)
from polyamp._src.run_summary import RunSummary
from polyamp._src.scaler_base import ScalerBase
from polyamp._src.step_history import OutcomeRecord

__all__ = ["OutcomesPart"]


class OutcomesPart(ScalerBase):
    """What happened."""

    def records(self) -> list[StepRecord]:
        """The most recent iterations' records (at most ``history``), oldest first: skipped or not, why, and
        the scale, as `polyamp.StepRecord`.

        Reads the iterations recorded on the device since the last call in one host read, logs the skipped
        ones through ``logging.getLogger("polyamp")`` (``"non_finite"`` at WARNING, ``"overflow"``, which is
        dynamic scaling at work, at INFO) and applies ``on_min_scale``. The scaler also reads them by itself
        every ``history // 2`` iterations and right after a step it already knows was skipped, so nothing is
        lost between calls. Inside a compiled function (``tf.function``, ``torch.compile``) nothing is read.

        Raises:
            ScaleCollapseError: with ``on_min_scale="raise"``, a record shows the scale reaching its floor.
        """
        return self._history.read()

    def last_record(self) -> StepRecord | None:
        """The record of the last iteration this scaler ended (see `records`), or None before the first."""
        records = self.records()
        return records[-1] if records else None

    def summary(self) -> RunSummary:
        """The run so far in one line (``str()`` of the result), e.g. ``200 steps, 5 skipped (overflow at 50, 51,
        120-122), scale 2^16 -> 2^13``: how many iterations ended, the skipped ones by reason and iteration, the
        loss scale's path and the layers named by non-finite gradients, as a `RunSummary` (its fields hold the
        numbers).

        It covers every iteration recorded since the scaler was created (or its variables were restored by the
        framework), not only the ``history`` records `records` keeps, and reads the device as `records` does:
        one host read, nothing inside a compiled function. ``polyamp_torch.log_summary`` prints it every N steps.
        """
        return self._history.summary()

    def _remember(self, optimizer: Any, found_inf: Any, skipped: bool | None) -> None:
        self._outcomes.write(self._device, optimizer, found_inf, skipped)
        self._history.note_step(optimizer, skipped)

    def _record_of(self, optimizer: Any) -> OutcomeRecord | None:
        return self._outcomes.of(optimizer) if self._device is not None else None

    def is_unscaled(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s gradients hold their true (unscaled) values now: True after `unscale_` in
        this iteration, and whenever the scaler does not scale this iteration; False while they are still
        scaled. Clipping, or reading gradient norms, belongs after the point where this is True."""
        if not self.enabled:
            return True
        return self._iteration.stage(optimizer) is Stage.UNSCALED

    def step_skipped(self, optimizer: Any = None) -> Any:
        """Whether a step was skipped for non-finite gradients, without a host sync.

        Returns the framework's boolean scalar tensor (``bool(...)`` reads it to the host when you want):
        with ``optimizer``, whether that optimizer's most recent step through this scaler was skipped; with
        no optimizer, whether the last completed iteration skipped a step. Steps taken while scaling was
        disabled count as not skipped.

        Raises:
            ScalerUsageError: the scaler has not stepped ``optimizer`` (or finished an iteration) yet.
        """
        if optimizer is None:
            last = self._outcomes.last
            if last is None:
                raise ScalerUsageError(
                    "step_skipped() was called before this LossScaler stepped any optimizer: it answers for the "
                    "last iteration, once update() (or apply_gradients()) has ended one."
                )
            return self._device.skipped(self._device.read_record(last.storage))
        if self._device is not None:
            self._device.check_optimizer("step_skipped", optimizer)
        record = self._record_of(optimizer)
        if record is None:
            raise ScalerUsageError(
                f"step_skipped(optimizer): {describe(optimizer)} has not been stepped by this scaler."
            )
        return self._device.skipped(self._device.read_record(record.storage))

    def was_skipped(self, optimizer: Any) -> bool | None:
        """The host answer to ``step_skipped(optimizer)``, or None if this scaler never stepped it.

        Reads the device only when the step did not already (fused optimizers skip on the device).
        """
        record = self._record_of(optimizer)
        if record is None:
            return None
        if record.host is None:
            record.host = self._device.read_flag(self._device.read_record(record.storage))
        return record.host

    def skipped_steps(self) -> Any:
        """How many iterations had a skipped step since this scaler was created, as a device integer tensor: the
        count as of this call (no host read; a tensor returned earlier does not follow later iterations). Safe
        from any thread: read between two updates.

        The count goes on from a loaded state dict's (`load_state_dict`) or a pickle's. Before the scaler is bound
        this is a Python int (0 for a new scaler).
        """
        if self._device is None:
            return self._skipped_before
        count = self._between_updates(self._device.skipped_steps)
        return count + self._skipped_before if self._skipped_before else count

    def _between_updates(self, read: Callable[[], Any]) -> Any:
        """``read()`` under the records' lock, which `update` holds while it ends an iteration: a reader in
        another thread never sees the device state halfway through one. (A compiler cannot trace the lock; a
        traced function runs in one thread, so it reads without it.)"""
        if self._compiling():
            return read()
        with self._history.lock:
            return read()
