"""What a backend provides: the device operations behind polyamp's loss-scaling semantics.

The core (`polyamp.LossScaler`) decides everything around a step once, for every framework: which stage
each optimizer is in, when a step is skipped, what ``step_skipped`` answers, which calls are misuse, when
scaling is enabled, and what a state dict holds. A backend translates: it creates a *device form* of the
scaler (`Backend.make_device`) that keeps the scale and counters on its framework's device and performs the
device operations below. Flags are the backend's own scalar tensors (``> 0`` means a non-finite gradient
was found); the core passes them around without reading them, so no host sync is added.

A device form offers one or more loop styles:

* `ImperativeDevice` - PyTorch-style: gradients live on the parameters, ``unscale_`` / ``step`` / ``update``;
* `TapeDevice` - TensorFlow-style: gradients are values, ``unscale(grads)`` / ``apply_gradients(opt, ...)``;
* `FunctionalDevice` - state in, state out, for jitted steps (JAX-style), made by
  ``Backend.make_functional``; the core wraps it in `polyamp.FunctionalLossScaler`.

Four capability groups add to a loop form: records (`RecordingDevice`), the guard (`GuardingDevice`), the
names of non-finite gradients (`ProvenanceDevice`) and the spike rule (`SpikeDevice`), each with its
functional twin over trees of arrays. Single capabilities are methods a device may have (`OptionalMethods`).
The arithmetic of every rule is the core's (`polyamp._src.rules`); a device calls it with its framework's
`ArrayOps`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias, runtime_checkable

from polyamp._src.scaling import LossScaleConfig, LossScaleState

__all__ = [
    "Backend",
    "Flag",
    "FunctionalBackend",
    "FunctionalDevice",
    "FunctionalGuardingDevice",
    "FunctionalProvenanceDevice",
    "FunctionalRecordingDevice",
    "FunctionalSpikeDevice",
    "GradientCounts",
    "GuardingDevice",
    "ImperativeDevice",
    "ProvenanceDevice",
    "RecordingDevice",
    "ScalerDevice",
    "SpikeDevice",
    "StepOutcome",
    "TapeDevice",
]

#: A backend's found-inf flag: a scalar tensor on its device, ``> 0`` when a gradient was inf or NaN.
Flag: TypeAlias = Any


class StepOutcome(NamedTuple):
    """What a device step reports back to the core.

    Attributes:
        result: What the optimizer's step returned (None when it was skipped).
        found_inf: The flag that decided the step, for the optimizer's record and the update.
        skipped: The host answer when the device already read it (a non-fused step must), else None.
    """

    result: Any
    found_inf: Flag
    skipped: bool | None


@runtime_checkable
class ScalerDevice(Protocol):
    """Operations every device form provides, whatever its loop style.

    Everything else a device may offer is a capability group (`RecordingDevice`, `GuardingDevice`,
    `ProvenanceDevice`, `SpikeDevice`) or one of the `OptionalMethods`: the core reads which, once, when a
    scaler binds to it.
    """

    def check_optimizer(self, method: str, optimizer: object) -> None:
        """Raise unless ``optimizer`` is one this device can step through ``method``: a `polyamp.PolyampTypeError`
        for something else (`polyamp.backend_api.arguments.wrong_object_error` words it), a `polyamp.ScalerUsageError`
        for an optimizer that would unscale a second time. Called before anything else happens."""
        ...

    def read_state(self) -> LossScaleState:
        """The scale and counters, read to the host (may synchronise with the device)."""
        ...

    def write_state(self, config: LossScaleConfig, state: LossScaleState) -> None:
        """Replace config and state. The core validated both and checked that no iteration is open."""
        ...

    def scale(self, loss: Any) -> Any:
        """``loss`` (a tensor, or a list/tuple/iterable of them) multiplied by the scale.

        Raise `polyamp.backend_api.arguments.wrong_object_error` for anything else.
        """
        ...

    def combine(self, flags: Sequence[Flag]) -> Flag:
        """One flag that is set when any of ``flags`` is (at least one flag is given)."""
        ...

    def read_new_scale(self, new_scale: Any) -> float | None:
        """For ``update(new_scale=<tensor>)``: raise `polyamp.PolyampTypeError` unless it is a one-element
        floating tensor of this framework; return its value (None when it cannot be read, e.g. symbolic)."""
        ...

    def update(self, found_inf: Flag, new_scale: Any) -> None:
        """End an iteration on the device: advance the loss-scale rule with ``found_inf`` (or, when
        ``new_scale`` is not None, set the scale to it: a float the core validated, or the framework's
        one-element tensor), and count the iteration as skipped if ``found_inf`` is set."""
        ...

    def skipped(self, found_inf: Flag) -> Any:
        """The framework's boolean scalar tensor ``found_inf > 0`` (no host sync)."""
        ...

    def read_flag(self, found_inf: Flag) -> bool:
        """``found_inf > 0`` read to the host."""
        ...

    def finite_flag(self) -> Flag:
        """A flag that says "nothing was non-finite": for steps taken while scaling is disabled, and for an
        iteration whose steps all read their flags as finite on the host (the core passes it to `update`; a
        device may recognise it and leave out what only an overflow needs)."""
        ...

    def new_record(self) -> Any:
        """Storage for one flag that outlives the current trace or graph (a box, a variable, ...)."""
        ...

    def write_record(self, record: Any, found_inf: Flag) -> None:
        """Store ``found_inf`` in ``record``."""
        ...

    def read_record(self, record: Any) -> Flag:
        """The flag last stored in ``record``."""
        ...

    def skipped_steps(self) -> Any:
        """How many iterations were skipped, as the framework's integer scalar tensor: the count when called
        (the core calls it holding the records' lock, which it also holds while it ends an iteration)."""
        ...


#: ``(name, +inf count, -inf count, NaN count, size)`` of one gradient (`polyamp.NonFiniteGradient`'s fields).
GradientCounts = tuple[str, int, int, int, int]


@runtime_checkable
class RecordingDevice(Protocol):
    """Optional: step records (`polyamp.StepRecord`) kept on the device, read in batches. The core uses these
    methods when a device has them; without them it records on the host (which reads each flag)."""

    def new_history(self, capacity: int) -> Any:
        """Storage for a ring of ``capacity`` step codes (and the count of codes written), on the device."""
        ...

    def write_history(self, history: Any, base: int, flag: Flag | None, spike: Flag | None = None) -> None:
        """Append one iteration's code without a host read: ``base`` (from `polyamp.backend_api.records.MODE_CODES`),
        plus 1 when ``flag`` is set (``flag`` may be None: not skipped), plus ``SPIKE_BIT`` + 1 when ``spike`` (a
        skip by the spike rule alone) is set (> 0) and ``flag`` is not, plus ``REBASE_BIT`` when ``spike`` is
        negative (the iteration re-based the rule's window: `SpikeDevice.spike_finish`)."""
        ...

    def read_history(self, history: Any) -> tuple[int, list[int]]:
        """(codes written in all, the most recent ones oldest first): one host read
        (`polyamp.backend_api.records.ring_codes` orders a ring)."""
        ...


@runtime_checkable
class GuardingDevice(Protocol):
    """Optional: the guard (steps without scaling skipped when a gradient is non-finite). A tape device
    needs this only (its ``apply`` checks); an imperative one also has ``check_gradients_finite``
    (`OptionalMethods`)."""

    def count_skip(self, flag: Flag) -> None:
        """Count an iteration as skipped when ``flag`` is set, without running the loss-scale rule."""
        ...


@runtime_checkable
class ProvenanceDevice(Protocol):
    """Optional: which gradients were non-finite in a skipped step (`polyamp.NonFiniteGradient`), counted on
    the device in the branch that skipped (no cost to steps that are applied)."""

    def read_provenance(self) -> list[tuple[int, list[GradientCounts]]]:
        """``[(iteration, counts), ...]`` since the last call (one host read)."""
        ...


@runtime_checkable
class SpikeDevice(Protocol):
    """Optional: `polyamp.SpikeRule` decided on the device. A tape device's ``apply`` receives the rule's
    flag as ``veto=`` (see `TapeDevice.apply`) and returns the overflow flag alone in its outcome."""

    def new_spike_state(self, rule: Any) -> Any:
        """The rule's window (the last ``rule.window`` accepted statistics and their count, and ``run``: the
        spikes since a statistic last entered it) on the device."""
        ...

    def spike_statistic(self, loss: Any) -> Any:
        """The loss (a list of losses: their sum) as a float64 scalar on the device, detached."""
        ...

    def spike_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
        """The global L2 norm of the unscaled gradients, float64: ``(optimizer)`` on an imperative device,
        ``(grads, unscaled=bool)`` on a tape device."""
        ...

    def spike_check(self, state: Any, x: Any) -> Flag:
        """The rule's decision for statistic ``x`` as a flag, without a host read (never set once ``run``
        reached ``rule.consecutive_limit``)."""
        ...

    def spike_finish(self, state: Any, x: Any, spike: Flag, overflow: Flag | None) -> Flag:
        """End the iteration as `polyamp.SpikeRule.decide` does: a skip by the rule alone adds 1 to ``run``; ``x``
        enters the window if the step was applied and ``x`` is finite (emptying it first when ``run`` reached
        ``rule.consecutive_limit``: a re-base), setting ``run`` to 0. Returns the flag of a skip by the rule
        alone (1), or -1 for an iteration that re-based (a flag that is not set: the step was applied), else 0."""
        ...

    def read_spike_window(self, state: Any) -> list[float]:
        """The window's values, oldest first (one host read), for state dicts and pickles."""
        ...

    def read_spike_run(self, state: Any) -> int:
        """The window's ``run`` (spikes since a statistic last entered it; one host read)."""
        ...

    def write_spike_window(self, state: Any, values: list[float], run: int = 0) -> None:
        """Make the window hold ``values`` (oldest first, at most the rule's window), the next one after them,
        and its ``run``."""
        ...


@runtime_checkable
class ImperativeDevice(ScalerDevice, Protocol):
    """PyTorch-style device form: optimizers own their gradients (``param.grad``)."""

    def unscale_gradients(self, optimizer: Any) -> Flag | None:
        """Divide ``optimizer``'s gradients by the scale in place and check them; return the flag, or None
        when none of its parameters has a gradient. Raise before changing anything when the gradients cannot
        be unscaled (e.g. float16 gradients)."""
        ...

    def unscales_in_step(self, optimizer: Any) -> bool:
        """True when ``optimizer``'s own step unscales and checks (fused optimizers); then `step` is called
        with ``found_inf=None`` on still-scaled gradients."""
        ...

    def step(
        self, optimizer: Any, found_inf: Flag | None, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> StepOutcome:
        """Step ``optimizer`` unless a gradient is non-finite, with ``*args, **kwargs``.

        ``found_inf`` is the flag of the gradients `unscale_gradients` already unscaled, or None when
        `unscales_in_step` said the step does it. Return None in ``result`` when skipped.
        """
        ...

    def plain_step(self, optimizer: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``optimizer``'s ordinary step, for iterations where scaling is disabled."""
        ...


@runtime_checkable
class TapeDevice(ScalerDevice, Protocol):
    """TensorFlow-style device form: gradients are values handed to the optimizer with their variables."""

    def check_gradients(self, method: str, grads: Sequence[Any]) -> None:
        """Raise a `polyamp.PolyampTypeError` naming ``method`` if an entry is neither a gradient nor None."""
        ...

    def unscale(self, grads: Sequence[Any]) -> list[Any]:
        """The gradients divided by the scale (None entries stay None)."""
        ...

    def apply(
        self,
        optimizer: Any,
        grads: Sequence[Any],
        variables: Sequence[Any],
        *,
        unscaled: bool,
        veto: Flag | None = None,
    ) -> StepOutcome:
        """Unscale ``grads`` (unless ``unscaled``), check them and apply them unless one is non-finite or
        ``veto`` is set, with the decision taken on the device (no host branch, so it runs inside compiled
        graphs).

        ``veto`` is the spike rule's flag for this iteration (`SpikeDevice`), None without a rule; the core
        always passes it by keyword. The returned outcome's ``found_inf`` is the overflow flag alone (what the
        loss-scale rule sees), whether or not a veto skipped the step."""
        ...

    def plain_apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> Any:
        """``optimizer``'s ordinary apply, for iterations where scaling is disabled."""
        ...


@runtime_checkable
class FunctionalDevice(Protocol):
    """Device operations as pure functions over a state tree, for jitted steps (see
    `polyamp.FunctionalLossScaler`, which gives them polyamp's semantics)."""

    def init(self, state: LossScaleState, skipped: int = 0) -> Any:
        """The device state tree holding ``state`` and the skip count ``skipped``."""
        ...

    def read(self, tree: Any) -> LossScaleState:
        """The host state a device state tree holds (synchronises)."""
        ...

    def skipped_count(self, tree: Any) -> Any:
        """The skip count held in ``tree``, as the framework's integer scalar."""
        ...

    def scale(self, tree: Any, loss: Any) -> Any:
        """``loss`` multiplied by the tree's scale."""
        ...

    def unscale(self, tree: Any, grads: Any) -> tuple[Any, Flag]:
        """The gradients (any nesting) divided by the scale, and the flag of whether one is non-finite."""
        ...

    def update(self, tree: Any, found_inf: Flag) -> Any:
        """The tree after one step of ``config``'s rule, with the skip count advanced if ``found_inf``."""
        ...

    def select(self, found_inf: Flag, if_skipped: Any, if_applied: Any) -> Any:
        """``if_skipped`` where ``found_inf`` is set, else ``if_applied`` (trees of equal structure)."""
        ...


@runtime_checkable
class FunctionalRecordingDevice(Protocol):
    """Optional, functional devices: the step records' ring as a tree of arrays carried in the state (the
    functional form of `RecordingDevice`). Every function returns a new tree; none reads the host but
    `ring_read`."""

    def ring_init(self, capacity: int) -> Any:
        """A tree holding a ring of ``capacity`` step codes, all zero, and a count of codes written (0)."""
        ...

    def ring_write(self, ring: Any, base: int, flag: Flag | None, spike: Flag | None = None) -> Any:
        """``ring`` with one more iteration's code, as `RecordingDevice.write_history` computes it: ``base``
        (from `polyamp.backend_api.records.MODE_CODES`), plus 1 when ``flag`` is set (None: not set), plus ``SPIKE_BIT``
        + 1 when ``spike`` is set (> 0) and ``flag`` is not, plus ``REBASE_BIT`` when ``spike`` is negative; at
        position ``count % capacity``, with the count advanced."""
        ...

    def ring_read(self, ring: Any) -> tuple[int, list[int]]:
        """(codes written in all, the most recent ones oldest first): one host read
        (`polyamp.backend_api.records.ring_codes` orders a ring)."""
        ...


@runtime_checkable
class FunctionalGuardingDevice(Protocol):
    """Optional, functional devices: the guard (steps without scaling skipped when a gradient is non-finite),
    the functional form of `GuardingDevice`."""

    def check(self, tree: Any, grads: Any) -> Flag:
        """The flag of whether one of ``grads`` (any nesting) is inf or NaN, the gradients left as they are
        (nothing is divided)."""
        ...

    def count_skip(self, tree: Any, flag: Flag) -> Any:
        """``tree`` with its skip count advanced when ``flag`` is set (> 0), the loss-scale rule not run."""
        ...


@runtime_checkable
class FunctionalProvenanceDevice(Protocol):
    """Optional, functional devices: which gradients held inf/NaN in the most recent step skipped for them, as
    a tree of arrays carried in the state (the functional form of `ProvenanceDevice`). The counts are computed
    only in the branch that skips; a step that is applied pays one counter increment."""

    def provenance_init(self, grads: Any) -> Any:
        """A tree for gradients shaped like ``grads`` (any nesting; the parameters do): per gradient, zero
        counts of (+inf, -inf, NaN, size), the gradient's name (from its place in ``grads``), the iteration of
        the last counted skip (-1: none) and a count of iterations (0)."""
        ...

    def provenance_write(self, provenance: Any, grads: Any, flag: Flag | None) -> Any:
        """``provenance`` after one iteration: when ``flag`` is set (> 0), ``grads``' counts and this
        iteration's index (the count of iterations before it); the count of iterations advanced."""
        ...

    def provenance_read(self, provenance: Any) -> tuple[int, list[GradientCounts]]:
        """(the iteration of the last counted skip, -1 for none; per gradient (name, +inf, -inf, NaN, size)):
        one host read."""
        ...

    def provenance_reset(self, provenance: Any) -> Any:
        """A fresh tree for the same gradients as ``provenance`` (counts zero, no skip, no iteration)."""
        ...


@runtime_checkable
class FunctionalSpikeDevice(Protocol):
    """Optional, functional devices: `polyamp.SpikeRule` decided on the device, its window a tree of arrays
    carried in the state (the functional form of `SpikeDevice`). The rule (a frozen, hashable value) is passed
    to the functions that need its constants."""

    def window_init(self, rule: Any) -> Any:
        """An empty window for ``rule``: room for ``rule.window`` float64 statistics, their count and ``run``
        (the spikes since a statistic last entered it), all zero."""
        ...

    def spike_statistic(self, loss: Any) -> Any:
        """The loss (a list of losses: their sum) as a float64 scalar, detached."""
        ...

    def spike_grad_norm(self, grads: Any) -> Any:
        """The global L2 norm of ``grads`` (any nesting; unscaled), float64."""
        ...

    def spike_check(self, rule: Any, window: Any, x: Any) -> Flag:
        """``rule``'s decision for statistic ``x`` against ``window`` as a flag, as `SpikeDevice.spike_check`
        (never set once ``run`` reached ``rule.consecutive_limit``)."""
        ...

    def spike_finish(self, rule: Any, window: Any, x: Any, spike: Flag, overflow: Flag | None) -> tuple[Any, Flag]:
        """The window after the iteration, as `SpikeDevice.spike_finish` leaves it, and the flag it returns: 1
        for a skip by the rule alone (``run`` + 1), -1 for an iteration that re-based (``x`` entered an emptied
        window), else 0."""
        ...

    def combine(self, first: Flag, second: Flag) -> Flag:
        """One flag that is set when either is."""
        ...

    def count_skip(self, tree: Any, flag: Flag) -> Any:
        """``tree`` with its skip count advanced when ``flag`` is set (> 0), as
        `FunctionalGuardingDevice.count_skip` (a skip by the spike rule is counted without running the
        loss-scale rule)."""
        ...

    def read_window(self, window: Any) -> tuple[list[float], int]:
        """The window's values, oldest first, and its ``run`` (one host read), for state dicts."""
        ...

    def write_window(self, window: Any, values: list[float], run: int) -> Any:
        """``window`` holding ``values`` (oldest first, at most its capacity; the core trims them) and
        ``run``."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A framework translation of polyamp's semantics, registered by a `polyamp.backend_api.BackendSpec`.

    A backend with jitted, stateless training steps is also a `FunctionalBackend`.
    """

    name: str

    def make_device(self, config: LossScaleConfig, state: LossScaleState) -> ScalerDevice:
        """Create the device form of a loss scaler starting from ``state`` (an `ImperativeDevice` and/or a
        `TapeDevice`)."""
        ...


@runtime_checkable
class FunctionalBackend(Protocol):
    """Optional: a backend with a functional form, for jitted, stateless steps (`polyamp.FunctionalLossScaler`)."""

    def make_functional(self, config: LossScaleConfig) -> FunctionalDevice:
        """The device functions following ``config``'s rule."""
        ...
