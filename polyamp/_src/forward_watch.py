"""The forward watch's records and decision: which layer first produced a non-finite output in a forward pass.

A backend watches each layer call of a forward pass (``polyamp_torch.watch_forward``,
``polyamp_keras.watch_forward``) and hands the calls, in the order they returned, to `forward_report` as
`WatchedCall` records. The core decides, the same way for every framework:

* a call whose output holds inf or NaN **produced** it when all its inputs were finite and no call nested in
  it (a child layer) produced a non-finite output: the layer's own computation made the value;
* otherwise it **propagated** it: an input was already non-finite, or a child layer produced the value and
  the enclosing layer passed it on;
* the report names the first producer (in the order the calls returned), the later producers, if any, and
  every propagating call, with the inf / -inf / NaN counts of each output.

The records are plain frozen dataclasses of strings and integers, so a report can be logged, compared and
pickled without the framework.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from polyamp._src.errors import PolyampValueError

__all__ = [
    "LOGGER_NAME",
    "ForwardPass",
    "ForwardReport",
    "ForwardWatchBase",
    "NonFiniteOutput",
    "WatchedCall",
    "check_watch_every",
    "forward_report",
    "join_dtype_names",
    "log_forward_report",
]

#: The logger the forward watch warns through: ``logging.getLogger("polyamp")``.
LOGGER_NAME = "polyamp"

Kind = Literal["produced", "propagated"]
_SHOWN = 5  # propagating calls spelled out in a message
_KINDS = ("produced", "propagated")


@dataclass(frozen=True)
class NonFiniteOutput:
    """One layer call whose output held inf or NaN.

    Attributes:
        path: the layer's path in the model (torch: its ``named_modules()`` name, ``""`` for the model
            itself; Keras: ``layer.path``).
        kind: ``"produced"`` (all inputs finite, the layer's own computation made the value) or
            ``"propagated"`` (an input was already non-finite, or a layer called inside it produced it).
        inf: how many output values were +inf.
        neg_inf: how many were -inf.
        nan: how many were NaN.
        dtype: the output's dtype name (``"float16"``; several output tensors of different dtypes are
            joined with ``"/"``).
        call_index: the call's position among the forward's watched calls, in the order the calls began
            (0 is the model's own call); a layer called twice has two records.
        size: how many floating values the output held in all.
        exact: False when the output tensor was changed in place after the call returned (an in-place
            activation after it), so the counts are those of the changed tensor; the call was non-finite
            when it returned either way.

    >>> out = NonFiniteOutput("block.1", "produced", inf=3, neg_inf=1, nan=0, dtype="float16", call_index=4, size=8)
    >>> out.describe()
    "'block.1' (float16, call 4): 3 inf, 1 -inf, 0 NaN of 8 values"
    """

    path: str
    kind: Kind
    inf: int
    neg_inf: int
    nan: int
    dtype: str
    call_index: int
    size: int = 0
    exact: bool = True

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise PolyampValueError(
                f"NonFiniteOutput kind must be 'produced' or 'propagated'; received {self.kind!r}. "
                "Use 'produced' for a layer whose inputs were all finite, 'propagated' otherwise."
            )
        for name in ("inf", "neg_inf", "nan", "call_index", "size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PolyampValueError(
                    f"NonFiniteOutput {name} must be an int >= 0; received {value!r}. Pass a count or an index."
                )

    @property
    def name(self) -> str:
        """The path quoted for a message; the model's own call (path ``""``) reads ``the model``."""
        return repr(self.path) if self.path else "the model"

    @property
    def non_finite(self) -> int:
        """inf + neg_inf + nan."""
        return self.inf + self.neg_inf + self.nan

    def counts(self) -> str:
        """The counts as words: ``"3 inf, 1 -inf, 0 NaN of 8 values"``."""
        counts = f"{self.inf} inf, {self.neg_inf} -inf, {self.nan} NaN of {self.size} values"
        if not self.exact:
            counts += " (counted after an in-place change to the output)"
        return counts

    def describe(self) -> str:
        """One line: path, dtype, call index and the counts."""
        return f"{self.name} ({self.dtype}, call {self.call_index}): {self.counts()}"


@dataclass(frozen=True)
class ForwardReport:
    """What the forward watch saw in one forward pass that had a non-finite output.

    Attributes:
        step: the forward's index among the model's calls since the watch began (0-based), or None.
        producer: the first call (in the order calls returned) whose inputs were finite and whose output was
            not; None when every non-finite output came from a non-finite input (the model's own inputs, or a
            value computed outside the watched layers).
        propagated: the calls that passed a non-finite value on, in the order they returned.
        also_produced: later calls that produced a non-finite output from finite inputs too (another branch,
            or a value reaching them outside their inputs), in the order they returned.

    ``str(report)`` is `message`.
    """

    step: int | None
    producer: NonFiniteOutput | None
    propagated: tuple[NonFiniteOutput, ...] = ()
    also_produced: tuple[NonFiniteOutput, ...] = ()

    @property
    def outputs(self) -> tuple[NonFiniteOutput, ...]:
        """Every non-finite output (producer, later producers, propagating calls), in the order calls began."""
        found = [*self.propagated, *self.also_produced] + ([self.producer] if self.producer else [])
        return tuple(sorted(found, key=lambda o: o.call_index))

    def message(self) -> str:
        """The report as a few log lines, naming the producer first."""
        where = "Forward pass" if self.step is None else f"Forward pass {self.step}"
        lines = []
        if self.producer is not None:
            p = self.producer
            lines.append(
                f"{where}: {p.name} produced a non-finite {p.dtype} output from finite inputs "
                f"(call {p.call_index}): {p.counts()}."
            )
        else:
            first = self.propagated[0].name if self.propagated else "no layer"
            lines.append(
                f"{where}: no watched layer produced a non-finite output from finite inputs; the first non-finite "
                f"output, {first}'s, came from a non-finite input (the model's inputs, or a value computed outside "
                "the watched layers)."
            )
        if self.also_produced:
            lines.append("Also produced from finite inputs: " + "; ".join(o.describe() for o in self.also_produced))
        if self.propagated:
            shown = "; ".join(o.describe() for o in self.propagated[:_SHOWN])
            more = len(self.propagated) - _SHOWN
            rest = f"; and {more} more (all in the report's propagated)" if more > 0 else ""
            lines.append(f"Propagated by {len(self.propagated)}: {shown}{rest}.")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.message()


@dataclass(frozen=True)
class WatchedCall:
    """One layer call as a backend saw it, for `forward_report`.

    ``started`` is the call's position in the order the calls began (its ``call_index``); a call that began
    after this one and returned before it ran inside it. ``inputs_finite`` and ``output_finite`` are the
    checks taken when the call began and returned; the counts describe the output (all zero when finite).
    """

    path: str
    started: int
    inputs_finite: bool
    output_finite: bool
    inf: int = 0
    neg_inf: int = 0
    nan: int = 0
    dtype: str = ""
    size: int = 0
    exact: bool = True


def forward_report(calls: Iterable[WatchedCall], step: int | None = None) -> ForwardReport | None:
    """The report for one forward pass, from its calls in the order they returned; None if all were finite.

    A non-finite call produced its value when its inputs were finite and no call nested in it (began after
    it, returned before it) produced one; otherwise it propagated it.

    >>> calls = [
    ...     WatchedCall("embed", 1, True, True),
    ...     WatchedCall("block.0", 3, True, False, inf=2, dtype="float16", size=8),
    ...     WatchedCall("block.1", 4, False, False, inf=2, nan=1, dtype="float16", size=8),
    ...     WatchedCall("block", 2, True, False, inf=2, nan=1, dtype="float16", size=8),
    ...     WatchedCall("", 0, True, False, nan=3, dtype="float32", size=3),
    ... ]
    >>> report = forward_report(calls, step=7)
    >>> report.producer.path, [o.path for o in report.propagated]
    ('block.0', ['block.1', 'block', ''])
    >>> print(report)  # doctest: +NORMALIZE_WHITESPACE
    Forward pass 7: 'block.0' produced a non-finite float16 output from finite inputs (call 3):
    2 inf, 0 -inf, 0 NaN of 8 values.
    Propagated by 3: 'block.1' (float16, call 4): 2 inf, 0 -inf, 1 NaN of 8 values; 'block' (float16, call 2):
    2 inf, 0 -inf, 1 NaN of 8 values; the model (float32, call 0): 0 inf, 0 -inf, 3 NaN of 3 values.
    >>> forward_report([WatchedCall("embed", 0, True, True)]) is None
    True
    """
    calls = list(calls)
    producers: list[NonFiniteOutput] = []
    propagated: list[NonFiniteOutput] = []
    produced_starts: list[int] = []  # `started` of the producing calls that have returned so far
    for position, call in enumerate(calls):
        if not isinstance(call, WatchedCall):
            raise PolyampValueError(
                f"forward_report takes WatchedCall records; received {type(call).__name__} at position {position}."
            )
        if call.output_finite:
            continue
        # A producer that began after this call and has already returned ran inside it.
        nested_producer = any(start > call.started for start in produced_starts)
        kind: Kind = "produced" if call.inputs_finite and not nested_producer else "propagated"
        record = NonFiniteOutput(
            call.path, kind, call.inf, call.neg_inf, call.nan, call.dtype, call.started, call.size, call.exact
        )
        if kind == "produced":
            producers.append(record)
            produced_starts.append(call.started)
        else:
            propagated.append(record)
    if not producers and not propagated:
        return None
    return ForwardReport(
        step=step,
        producer=producers[0] if producers else None,
        propagated=tuple(propagated),
        also_produced=tuple(producers[1:]),
    )


def log_forward_report(report: ForwardReport | None, logger: logging.Logger | None = None) -> None:
    """Log ``report`` (if any) as one WARNING through ``logging.getLogger("polyamp")``."""
    if report is not None:
        (logger or logging.getLogger(LOGGER_NAME)).warning("%s", report.message())


def check_watch_every(every: object) -> int:
    """``every`` for ``watch_forward``: an int >= 1 (watch one forward in ``every``), else a clear error."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise PolyampValueError(
            f"watch_forward(every=...) must be an int >= 1; received {every!r}. "
            "Use every=1 to watch every forward pass, every=N to watch one in N."
        )
    return every


def join_dtype_names(names: Sequence[str]) -> str:
    """Distinct dtype names in first-seen order, joined with ``"/"``."""
    return "/".join(dict.fromkeys(names))


class ForwardPass:
    """One watched forward pass, as a backend sees it: the layer calls as they begin and return, each tensor
    checked once; `report` turns them into `WatchedCall` records for `forward_report`.

    The backend gives ``check(tensor)``, its device-side finiteness check (no host read), and optionally
    ``version(tensor)``, so that a tensor changed in place since its check is checked again (without it a
    tensor is checked once, by identity). It calls `begin` and `end` around each layer call, reads `checks`
    to the host once when the model's call returns, and passes the result to `report`.
    """

    def __init__(
        self, step: int, check: Callable[[Any], Any], version: Callable[[Any], Hashable] | None = None
    ) -> None:
        self.step = step
        #: The device checks, in the order they were made; `report` takes one bool per entry.
        self.checks: list[Any] = []
        self._check = check
        self._version = version
        self._started = 0
        self._seen: dict[int, tuple[Any, Hashable, int]] = {}  # id -> (tensor, version, check index)
        self._frames: list[tuple[Any, str, int, list[int]]] = []  # the calls begun and not yet returned
        # The returned calls: path, start index, input checks, output checks, (output, version at its check).
        self._calls: list[tuple[str, int, list[int], list[int], list[tuple[Any, Hashable]]]] = []

    def _checked(self, tensor: Any) -> int:
        version = None if self._version is None else self._version(tensor)
        entry = self._seen.get(id(tensor))
        if entry is not None and entry[0] is tensor and entry[1] == version:
            return entry[2]
        index = len(self.checks)
        self.checks.append(self._check(tensor))
        self._seen[id(tensor)] = (tensor, version, index)
        return index

    def begin(self, key: Any, path: str, inputs: Iterable[Any]) -> None:
        """A call of the layer ``key`` (its ``path``) begins, with these floating input tensors."""
        checks = [self._checked(tensor) for tensor in inputs]
        self._frames.append((key, path, self._started, checks))
        self._started += 1

    def end(self, key: Any, outputs: Iterable[Any]) -> None:
        """The call of ``key`` returns these floating output tensors (ignored unless it is the innermost open
        call: a hook of a call that began outside the pass)."""
        if not self._frames or self._frames[-1][0] is not key:
            return
        _, path, started, inputs = self._frames.pop()
        tensors = list(outputs)
        checks = [self._checked(tensor) for tensor in tensors]
        self._calls.append((path, started, inputs, checks, [(t, self._seen[id(t)][1]) for t in tensors]))

    def report(
        self,
        finite: Sequence[bool],
        *,
        size: Callable[[Any], int],
        dtype: Callable[[Any], str],
        counts: Callable[[Any], Sequence[int]],
    ) -> ForwardReport | None:
        """The pass's `ForwardReport` (None when every check was finite), from ``finite`` (one bool per entry of
        `checks`), each output's ``size`` and ``dtype`` name, and the ``counts`` (+inf, -inf, NaN) of the
        outputs that were not finite (counted only for those)."""
        if all(finite):
            return None
        calls = []
        for path, started, inputs, outputs, tensors in self._calls:
            output_finite = all(finite[i] for i in outputs)
            found = [0, 0, 0]
            total, dtypes, exact = 0, [], True
            for (tensor, version), index in zip(tensors, outputs, strict=True):
                total += size(tensor)
                if finite[index]:
                    continue
                found = [a + int(b) for a, b in zip(found, counts(tensor), strict=True)]
                dtypes.append(dtype(tensor))
                exact = exact and (self._version is None or self._version(tensor) == version)
            if output_finite:
                dtypes = [dtype(tensor) for tensor, _ in tensors]
            calls.append(
                WatchedCall(
                    path,
                    started,
                    inputs_finite=all(finite[i] for i in inputs),
                    output_finite=output_finite,
                    inf=found[0],
                    neg_inf=found[1],
                    nan=found[2],
                    dtype=join_dtype_names(dtypes),
                    size=total,
                    exact=exact,
                )
            )
        return forward_report(calls, step=self.step)


class ForwardWatchBase:
    """A forward watch's handle, the same on every backend: it counts the model's calls, opens a `ForwardPass`
    for one call in ``every``, and reports and logs each watched pass when the model's call returns.

    A backend installs its hooks in ``__init__``, calls `_enter_call` and `_exit_call` around every layer
    call, and gives `_check` (and, optionally, `_version`) for `ForwardPass`, `_read` (the pass's checks read
    to the host, then `ForwardPass.report`), `_installed` and `_uninstall`.
    """

    _version: Callable[[Any], Hashable] | None = None

    def __init__(self, model: Any, every: int) -> None:
        self.every = check_watch_every(every)
        self.model = model
        self._forwards = 0
        self._depth = 0
        self._forward: ForwardPass | None = None
        self._last: ForwardReport | None = None

    def _check(self, tensor: Any) -> Any:
        """A tensor's finiteness check on its device (no host read)."""
        raise NotImplementedError

    def _read(self, forward: ForwardPass) -> ForwardReport | None:
        """``forward``'s report: its checks read to the host, then `ForwardPass.report`."""
        raise NotImplementedError

    def _installed(self) -> bool:
        raise NotImplementedError

    def _uninstall(self) -> None:
        raise NotImplementedError

    def _counts(self, key: Any, inputs: Sequence[Any]) -> bool:
        """Whether a call of the model counts as a forward pass (a backend leaves out calls it cannot watch)."""
        return True

    def _enter_call(self, key: Any, path: str, root: bool, inputs: Iterable[Any]) -> ForwardPass | None:
        """A layer call begins (``root``: the model's own), with these floating inputs; returns the open pass."""
        if root:
            if self._depth == 0:
                inputs = list(inputs)
                if self._counts(key, inputs):
                    if self._forwards % self.every == 0:
                        self._forward = ForwardPass(self._forwards, self._check, self._version)
                    self._forwards += 1
            self._depth += 1
        forward = self._forward
        if forward is not None:
            forward.begin(key, path, inputs)
        return forward

    def _exit_call(self, key: Any, root: bool, forward: ForwardPass | None, outputs: Iterable[Any]) -> None:
        """The call `_enter_call` returned ``forward`` for returns these floating outputs."""
        if forward is not None and forward is self._forward:
            forward.end(key, outputs)
        if root:
            self._depth -= 1
            if self._depth == 0 and self._forward is not None:
                finished, self._forward = self._forward, None
                self._last = self._read(finished)
                log_forward_report(self._last)

    def report(self) -> ForwardReport | None:
        """The report of the last watched forward pass: None when all its outputs were finite (or none ran)."""
        return self._last

    @property
    def forwards(self) -> int:
        """How many times the model was called (eagerly) since the watch began, watched or not."""
        return self._forwards

    @property
    def active(self) -> bool:
        """Whether the watch is in place."""
        return self._installed()

    def remove(self) -> None:
        """Take the watch off; the model is as before. `report` keeps the last report."""
        self._uninstall()
        self._forward = None
        self._depth = 0

    def __enter__(self) -> ForwardWatchBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _model_label(self) -> str:
        return type(self.model).__name__

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"ForwardWatch({self._model_label()}, every={self.every}, {state}, forwards={self._forwards})"
