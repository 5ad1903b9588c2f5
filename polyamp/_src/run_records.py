"""The step records of a functional scaler's states: one book per run, read from each state's own ring.

A functional state is a value: a step returns a new one and the old one stays valid, two `init`s of one
scaler are two runs, and a run may be stepped again from one of its older states (a rollback). Each `init`
writes a run id into the state's ring (where the device keeps one: ``ring_tag``, `polyamp.backend_api.OptionalMethods`),
and `RunBooks` keeps per run the records read so far and the ring codes they came from, so that the records
of a state are those of its own iterations:

* a state of a run read after a later state of it gets the records of its own iterations only;
* a state whose ring disagrees with the codes read before (its run was stepped again from an older state)
  drops the records from the first iteration where they differ, and its own are read from there;
* a run this process has not seen (a state restored from a checkpoint in another process, or whose book was
  dropped: at most `KEPT_RUNS` are kept) is read from its ring's oldest code, its scales unknown until then.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

from polyamp._src.provenance import NonFiniteGradient
from polyamp._src.records import Recorder, StepRecord, advance
from polyamp._src.run_summary import RunSummary, RunTally
from polyamp._src.scaling import LossScaleConfig, LossScaleState
from polyamp._src.skip_streak import ParameterCheck

__all__ = ["KEPT_RUNS", "RunBooks"]

#: How many runs' records a functional scaler keeps (the most recently read or started).
KEPT_RUNS: Final = 16


class _Book:
    """One run's records and the ring codes read so far: ``codes`` are iterations ``first`` on (up to the
    recorder's ``read_count``), and ``origin`` the rule's state before ``first`` (None: unknown)."""

    __slots__ = ("attached", "codes", "first", "origin", "recorder")

    def __init__(self, recorder: Recorder, first: int, origin: LossScaleState | None) -> None:
        self.recorder = recorder
        self.first = first
        self.origin = origin
        self.codes: list[int] = []
        self.attached = -1  # the iteration whose non-finite gradients the records hold

    def state_at(self, iteration: int, rule: LossScaleConfig) -> LossScaleState | None:
        """The rule's state before ``iteration`` (at least ``first``), replayed from ``origin``."""
        state = self.origin
        for code in self.codes[: iteration - self.first]:
            if state is None:
                break
            state = advance(rule, state, code)
        return state

    def trim(self, keep: int, rule: LossScaleConfig) -> None:
        """Keep at most ``2 * keep`` codes (the last ``keep`` once past that), ``origin`` following."""
        if len(self.codes) <= 2 * keep:
            return
        drop = len(self.codes) - keep
        self.origin = self.state_at(self.first + drop, rule)
        self.codes = self.codes[drop:]
        self.first += drop


class RunBooks:
    """The records of a functional scaler's runs, by run id (None for a device that keeps no run id: one run,
    which each `start` replaces).

    Args:
        make_recorder: A fresh `Recorder` (the scaler's history, ``on_min_scale`` and spike reason).
        history: How many records a run keeps, and the ring's capacity.
    """

    def __init__(self, make_recorder: Callable[[], Recorder], history: int) -> None:
        self._make_recorder = make_recorder
        self._history = history
        self._books: OrderedDict[int | None, _Book] = OrderedDict()
        self._last: tuple[_Book, int] | None = None  # the book of the last read and the state's count
        # Held around each read and start: threads reading at once (a monitoring thread beside the training
        # loop) take each ring code into the books once, so each skip is logged and a collapse warned once.
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, object]:
        saved = dict(self.__dict__)
        del saved["_lock"]  # (a lock belongs to its process; a copy gets its own)
        return saved

    def __setstate__(self, saved: dict[str, object]) -> None:
        self.__dict__.update(saved)
        self._lock = threading.RLock()

    def start(self, run: int | None, state: LossScaleState) -> None:
        """A new run ``run``, at ``state``, with no iterations yet."""
        recorder = self._make_recorder()
        recorder.reanchor(state)
        with self._lock:
            self._keep(run, _Book(recorder, 0, state))

    def known(self, run: int | None) -> bool:
        """Whether ``run`` has a book here."""
        return run in self._books

    def _keep(self, run: int | None, book: _Book) -> None:
        self._books[run] = book
        self._books.move_to_end(run)
        while len(self._books) > KEPT_RUNS:
            self._books.popitem(last=False)

    def read(
        self,
        run: int | None,
        count: int,
        codes: Sequence[int],
        rule: LossScaleConfig,
        read_state: Callable[[], LossScaleState | None],
        provenance: tuple[int, Callable[[], tuple[NonFiniteGradient, ...]]] | None = None,
        check_parameters: ParameterCheck | None = None,
    ) -> list[StepRecord]:
        """The records of a state of ``run`` whose ring holds ``count`` codes in all, ``codes`` the most recent
        (oldest first), the oldest first.

        Args:
            run: The run id the state's ring carries.
            count: How many codes the ring was written in all (the state's iterations).
            codes: The ring's most recent codes.
            rule: The config whose rule replays the scales.
            read_state: Reads the state's scale and counters (a host sync), where the replay cannot tell them.
            provenance: The iteration of the state's most recent skip for non-finite gradients and a function
                giving them, or None.
            check_parameters: Counts the parameters' non-finite values, asked once per run of skips, or None.
        """
        with self._lock:
            start = count - len(codes)  # the iteration of codes[0]
            book = self._books.get(run)
            if book is None:  # a run not seen here: read from the ring's oldest code, at an unknown state
                recorder = self._make_recorder()
                recorder.restart(start, None)
                book = _Book(recorder, start, None)
            self._keep(run, book)
            self._last = (book, count)
            recorder = book.recorder
            read = book.first + len(book.codes)  # == recorder.read_count
            for iteration in range(max(start, book.first), min(count, read)):
                if codes[iteration - start] != book.codes[iteration - book.first]:  # stepped again from an older state
                    recorder.rewind(iteration, book.state_at(iteration, rule))
                    del book.codes[iteration - book.first :]
                    book.attached = min(book.attached, iteration - 1)
                    read = iteration
                    break
            if provenance is not None and provenance[0] > book.attached:
                at, gradients = provenance
                book.attached = at
                if recorder.find(at) is None:
                    recorder.attach(at, gradients())
                else:
                    recorder.amend(at, gradients())
            if count > read:
                recorder.consume(count, codes, rule, read_state, check_parameters)
                if start > read:  # the ring lost codes between two reads: the book restarts at its oldest
                    book.first, book.origin, book.codes = start, None, list(codes)
                else:
                    book.codes.extend(codes[read - start :])
                book.trim(self._history, rule)
            return [record for record in recorder.records if record.iteration < count]

    def summary(self, read: Callable[[], object]) -> RunSummary:
        """The summary of the iterations of the state that ``read`` reads the records of (through `read`),
        up to its own last iteration; an empty one when ``read`` reads no book (a device without records)."""
        with self._lock:
            self._last = None
            read()
            if self._last is None:
                return RunTally().summary()
            book, count = self._last
            return book.recorder.summary(upto=count)
