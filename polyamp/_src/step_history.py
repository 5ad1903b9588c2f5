"""What happened in a scaler's steps: each optimizer's last outcome, and the record history of iterations.

`StepOutcomes` keeps, per optimizer, the flag of its most recent step in the device's storage (what
``step_skipped(optimizer)`` answers without a host sync) and the host answer when a step already read it.

`RecordHistory` keeps the iterations' records: a ring of step codes on the device (`RecordingDevice`),
read in batches into `polyamp.StepRecord` by the core's `Recorder`, and what the host learned about the
current iteration on the way (skips already read, the non-finite gradients of those skips, optimizers whose
skip the device decided and whose gradients can be counted once the records are read).

Threads: the training loop is one thread, but the records, scale and counters may be read from others (a
monitoring thread). `RecordHistory.lock` makes each read of the ring and each write (with the read it may
trigger) one step, so no record is read twice or lost; gradients are only ever counted by the thread that
ended the iteration, the only one that knows they are not being zeroed or recomputed at that moment.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from threading import get_ident
from typing import Any, cast

from polyamp._src.backend import Flag, ProvenanceDevice, RecordingDevice, ScalerDevice
from polyamp._src.binding import DeviceCapabilities
from polyamp._src.errors import ScalerUsageError
from polyamp._src.provenance import NonFiniteGradient, non_finite_gradients
from polyamp._src.records import MODE_CODES, SPIKE_BIT, Recorder, StepRecord
from polyamp._src.run_summary import RunSummary
from polyamp._src.scaling import LossScaleConfig, LossScaleState

__all__ = ["GROUP_MISMATCH", "OutcomeRecord", "RecordHistory", "StepOutcomes"]

#: The error for ranks of a process group whose flag reductions paired different iterations.
GROUP_MISMATCH = (
    "The ranks of this LossScaler's process_group are out of step: a found-inf reduction paired this rank's "
    "iteration with a different iteration of another rank. This happens when discard_iteration() is called on "
    "some ranks but not on the others before their reductions (unscale_/step), or when one rank ends an extra "
    "iteration (update()). The affected steps were skipped on every rank. Call discard_iteration() on every "
    "rank for the same iteration (e.g. after the ranks agree to drop a batch), or only after the iteration's "
    "unscale_/step calls."
)


class OutcomeRecord:
    """The outcome of an optimizer's most recent step (or of the last iteration): the device flag, kept in
    backend storage, and the host answer when something already read it."""

    __slots__ = ("host", "storage")

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.host: bool | None = None


class StepOutcomes:
    """Each optimizer's most recent outcome, held without keeping the optimizer alive where it can be weakly
    referenced, and the outcome of the last iteration."""

    __slots__ = ("_asked", "_records", "_unweakable", "_written", "last")

    def __init__(self) -> None:
        self._records: weakref.WeakKeyDictionary[Any, OutcomeRecord] = weakref.WeakKeyDictionary()
        self._unweakable: dict[int, tuple[Any, OutcomeRecord]] = {}
        #: The last iteration's outcome (None before the first iteration ended).
        self.last: OutcomeRecord | None = None
        # This iteration's last step write: (storage, flag). A device may keep one outcome variable for every
        # record (Keras): the iteration's outcome, the same flag into the same storage, is then written once.
        self._written: tuple[Any, Flag] | None = None
        # The optimizer whose record was asked for last (a weak reference) and that record: most loops step one.
        self._asked: tuple[weakref.ref[Any], OutcomeRecord] | None = None

    def iteration_opened(self) -> None:
        """A new iteration: what the last one wrote says nothing about the storage now."""
        self._written = None

    def optimizers(self) -> list[Any]:
        """The optimizers stepped so far that are still alive."""
        return [*self._records.keys(), *(optimizer for optimizer, _ in self._unweakable.values())]

    def of(self, optimizer: Any) -> OutcomeRecord | None:
        """``optimizer``'s record, or None if it was never stepped."""
        asked = self._asked
        if asked is not None and asked[0]() is optimizer:
            return asked[1]
        try:
            record = self._records.get(optimizer)
        except TypeError:
            entry = self._unweakable.get(id(optimizer))
            return None if entry is None else entry[1]
        if record is not None:
            self._asked = (weakref.ref(optimizer), record)
        return record

    def write(self, device: ScalerDevice, optimizer: Any, found_inf: Flag, skipped: bool | None) -> None:
        """Store ``optimizer``'s step flag (and the host answer, when known)."""
        asked = self._asked  # (`of`'s first answer, without the call)
        record = asked[1] if asked is not None and asked[0]() is optimizer else self.of(optimizer)
        if record is None:
            record = OutcomeRecord(device.new_record())
            try:
                self._records[optimizer] = record
                self._asked = (weakref.ref(optimizer), record)
            except TypeError:  # an optimizer that cannot be weakly referenced is held for its record
                self._unweakable[id(optimizer)] = (optimizer, record)
        device.write_record(record.storage, found_inf)
        record.host = skipped
        self._written = (record.storage, found_inf)

    def write_last(self, device: ScalerDevice, flag: Flag, host: bool | None) -> None:
        """Store the last iteration's flag (and the host answer, when known)."""
        if self.last is None:
            self.last = OutcomeRecord(device.new_record())
        written, self._written = self._written, None
        if written is None or written[0] is not self.last.storage or written[1] is not flag:
            device.write_record(self.last.storage, flag)
        self.last.host = host


class RecordHistory:
    """The iterations' records of one scaler, and what the host learned about the current iteration.

    The current iteration's attributes belong to the training thread. `read` may be called from any thread:
    `lock` is held around every read of the ring and every `write`, and the scaler holds it while it ends an
    iteration, so a read sees the device state and the ring at the same iteration.
    """

    def __init__(self, recorder: Recorder, config: LossScaleConfig) -> None:
        self.recorder = recorder
        # The recorder's own (reentrant: ending an iteration holds it and then writes, and a write may read the
        # ring): one lock around each read of the ring and its consumption.
        self.lock = recorder.lock
        self._config = config  # the settings the records are replayed under (`follow` keeps it current)
        self._device: Any = None
        self._capabilities: DeviceCapabilities | None = None
        self._optimizers: Callable[[], list[Any]] | None = None
        self._ring: Any = None  # the device's storage (None: the device keeps no records)
        self._pending = 0  # iterations ended since the records were last read
        self._written = 0  # iterations written to the ring
        self._batch = max(1, recorder.capacity // 2)  # iterations read at once (half the ring)
        self.reset_iteration()

    def bind(
        self, device: ScalerDevice, capabilities: DeviceCapabilities, optimizers: Callable[[], list[Any]] | None = None
    ) -> None:
        """Keep the records on ``device`` (when it is a `RecordingDevice`); ``optimizers`` gives the optimizers
        the scaler stepped, whose parameters a device's ``non_finite_parameters`` checks during a run of skips."""
        self._device = device
        self._capabilities = capabilities
        self._optimizers = optimizers
        if capabilities.recording:
            assert isinstance(device, RecordingDevice)
            self._ring = device.new_history(self.recorder.capacity)

    # -- the current iteration ---------------------------------------------------------------------------

    def reset_iteration(self) -> None:
        """Forget what the host learned about the current iteration."""
        self.host_skip = False  # a step read its skip to the host
        self.host_clean = 0  # steps that read "not skipped" to the host
        self._gradients: list[NonFiniteGradient] = []  # the non-finite gradients of host-known skips
        self._unknown: list[Any] = []  # optimizers whose skip the device decided (weak references)
        # The last iteration's such optimizers: (its index, the optimizers, the thread that ended it).
        self._deferred: tuple[int, list[Any], int] | None = None

    def iteration_opened(self) -> None:
        """A new iteration: the last one's gradients are about to change, so they can no longer be counted."""
        self._deferred = None

    def note_step(self, optimizer: Any, skipped: bool | None) -> None:
        """What the host knows of ``optimizer``'s step: applied, skipped, or decided on the device (None)."""
        if skipped is False:
            self.host_clean += 1
            return
        capabilities = self._capabilities
        counts = capabilities is not None and capabilities.host_provenance
        if skipped:
            self.host_skip = True
            if counts:
                self._gradients += non_finite_gradients(self._device.non_finite_gradients(optimizer))
        elif skipped is None and counts:  # decided on the device: counted if read in time
            try:
                self._unknown.append(weakref.ref(optimizer))
            except TypeError:
                self._unknown.append(optimizer)

    # -- writing and reading -----------------------------------------------------------------------------

    def write(
        self,
        mode: str,
        flag: Flag | None,
        host_skipped: bool,
        spike: Flag | None = None,
        *,
        set_scale: float | None = None,
    ) -> None:
        """End the iteration's record: ``mode`` (a key of `MODE_CODES`), skipped when ``flag`` is set or
        ``spike`` (a skip by the spike rule alone) is; ``host_skipped`` when the host already knows it was;
        ``set_scale``: the scale ``update(new_scale=...)`` set, when the host knows it (the record's
        ``next_scale``). The caller holds `lock` (the scaler holds it while it ends an iteration): a read from
        another thread between the entry and its count would lose it."""
        gradients = self._gradients
        self.host_skip = False
        self.host_clean = 0
        if gradients:
            self._gradients = []
        if self._ring is None:
            self._unknown = []
            return
        if gradients:
            self.recorder.attach(self._written, tuple(gradients))
        if set_scale is not None:
            self.recorder.attach_set_scale(self._written, set_scale)
        unknown = self._unknown
        if unknown:
            self._unknown = []
            self._deferred = (self._written, unknown, get_ident())
        else:
            self._deferred = None
        self._written += 1
        if spike is None:
            self._device.write_history(self._ring, MODE_CODES[mode], flag)
        else:
            self._device.write_history(self._ring, MODE_CODES[mode], flag, spike)
        self._pending += 1
        # A skip the step already read to the host is reported at once; the rest in batches (one read).
        if (host_skipped or self._pending >= self._batch) and not self._compiling():
            self._read_ring()

    def restart(self, state: LossScaleState) -> None:
        """The device's variables, the ring among them, were restored by the framework (an optimizer's weights
        loaded from a file): the records go on from the ring's count there, replayed from ``state``."""
        with self.lock:
            count = 0 if self._ring is None else self._device.read_history(self._ring)[0]
            self.recorder.restart(count, state)
            self._pending = 0
            self._written = count
            self.reset_iteration()

    def written_elsewhere(self) -> None:
        """An iteration whose code the functional form wrote into the device's ring (not through `write`)."""
        self.reset_iteration()
        if self._ring is not None:
            self._written += 1
            self._pending += 1

    def _compiling(self) -> bool:
        return self._capabilities is not None and bool(self._capabilities.compiling())

    @property
    def pending(self) -> int:
        """Iterations ended since the records were last read from the device."""
        return self._pending

    def read(self) -> list[StepRecord]:
        """The records kept (at most the recorder's capacity), after reading the device's new ones (from any
        thread)."""
        with self.lock:
            if self._ring is not None and not self._compiling():
                self._read_ring()
            return list(self.recorder.records)

    def summary(self) -> RunSummary:
        """The summary of every iteration recorded, after reading the device's new ones (from any thread)."""
        with self.lock:
            self.read()
            return self.recorder.summary()

    def _read_ring(self) -> None:
        """Read the device's new entries into records (with `lock` held)."""
        device = self._device
        capabilities = self._capabilities
        if capabilities is not None and capabilities.device_provenance:  # counted on the device, when it skipped
            for iteration, entries in cast(ProvenanceDevice, device).read_provenance():
                self.recorder.attach(iteration, non_finite_gradients(entries))
        count, codes = device.read_history(self._ring)
        self._attach_deferred(count, codes)
        self._pending = 0
        self.recorder.consume(count, codes, self._config, self._state_or_none, self._non_finite_parameters)
        if self._capabilities is not None and self._capabilities.process_groups and device.read_group_mismatch():
            raise ScalerUsageError(GROUP_MISMATCH)

    def follow(self, config: LossScaleConfig) -> None:
        """Replay records under ``config`` from now on (the scaler's settings)."""
        self._config = config

    def _non_finite_parameters(self) -> list[Any] | None:
        """The device's counts of non-finite parameters, or None when it cannot tell."""
        check = None if self._capabilities is None else self._capabilities.non_finite_parameters
        if check is None or self._compiling():
            return None
        return check(self._optimizers() if self._optimizers is not None else [])

    def _state_or_none(self) -> LossScaleState | None:
        return None if self._compiling() or self._device is None else self._device.read_state()

    def _attach_deferred(self, count: int, codes: list[int]) -> None:
        """Name the non-finite gradients of the last recorded iteration when the device decided its skip (a
        fused optimizer) and no iteration has opened since: its gradients are still there, and counting them now
        costs the steps that were applied nothing (with `lock` held).

        Only the thread that ended that iteration counts them: any other would read ``param.grad`` while the
        training thread may be zeroing or recomputing it. Another thread's read leaves them to the training
        thread's next read before its next iteration opens; when that read finds the record already made (by
        the other thread, without names), it adds the names to the record kept. If the next iteration opens
        first, the record stays without them."""
        deferred = self._deferred
        if deferred is None:
            return
        index, optimizers, thread = deferred
        if thread != get_ident():
            return
        self._deferred = None
        if index < self.recorder.read_count:  # recorded by another thread's read
            record = self.recorder.find(index)
            if record is not None and record.skipped and record.reason in ("overflow", "non_finite"):
                self.recorder.amend(index, self._count(optimizers))
            return
        position = len(codes) - (count - index)
        if not 0 <= position < len(codes):
            return  # no longer in the ring
        code = codes[position]
        if not code & 1 or code & SPIKE_BIT:
            return  # applied, or skipped by the spike rule (whose gradients are finite)
        self.recorder.attach(index, self._count(optimizers))

    def _count(self, optimizers: list[Any]) -> tuple[NonFiniteGradient, ...]:
        """The non-finite gradients of ``optimizers`` (weak references or optimizers), as they are now."""
        entries = []
        for reference in optimizers:
            optimizer = reference() if isinstance(reference, weakref.ref) else reference
            if optimizer is not None:
                entries += self._device.non_finite_gradients(optimizer)
        return non_finite_gradients(entries)

    def reanchor_after_set(self, value: Any) -> None:
        """After ``update(new_scale=value)``: the records that follow replay from the new scale."""
        if self._compiling():
            self.recorder.reanchor(None)
            return
        with self.lock:  # read and re-anchored in one step: the anchor is the state after the last record
            self.read()
            anchor = self.recorder.anchor
            if isinstance(value, float) and anchor is not None:
                self.recorder.reanchor(LossScaleState(value, anchor.growth_tracker, anchor.hysteresis_left))
            else:
                self.recorder.reanchor(self._device.read_state())
