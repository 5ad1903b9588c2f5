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
    "OptionalMethods",
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


class OptionalMethods(Protocol):
    """The methods a device form may add to its loop form, each for one capability; where one is missing, the
    core does without it (the default named in each). `DeviceCapabilities` reads which ones a device has,
    once, when a scaler binds. A device need not inherit from this class: it documents the names and types."""

    # -- Steps the core may hand to the device whole ---------------------------------------------

    # Imperative: clipping folded into the unscale (one multiply by clip coefficient / scale). Default: two passes.
    def unscale_and_clip(self, optimizer: Any, max_norm: float, norm_type: float) -> tuple[Flag | None, Any] | None:
        """Unscale ``optimizer``'s gradients and clip them to ``max_norm`` in one multiply; return the flag (None
        without gradients) and the total norm of the unscaled gradients. The flag is set when the norm is not
        finite. Return None, changing nothing, where this cannot be folded (then the caller unscales and
        clips as two steps)."""
        ...

    # Tape: the same for gradients handed over as values (``tf.clip_by_global_norm``).
    def unscale_and_clip_values(self, grads: Sequence[Any], clip_norm: float, *, scaled: bool) -> tuple[list[Any], Any]:
        """``grads`` (None entries stay None) divided by the scale when ``scaled``, and clipped to a global norm of
        ``clip_norm``, in one multiply; and their global norm after the unscale. As ``tf.clip_by_global_norm``,
        a non-finite norm makes every value NaN (the step then skips)."""
        ...

    # Tape: the rule advanced in the branch that applies or skips (one branch per compiled step).
    def apply_and_advance(
        self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], *, unscaled: bool
    ) -> StepOutcome | None:
        """`TapeDevice.apply` (no veto), then the rule's advance on the outcome's ``found_inf``, inside the same
        device branch. Return None, changing nothing, where that cannot be done (the core then calls
        ``apply`` and ``update``)."""
        ...

    # Imperative: ``LossScaler(skip_on_device=True)``, the skip decided without a host read.
    def step_on_device(
        self, optimizer: Any, found_inf: Flag, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> StepOutcome | None:
        """Run ``optimizer.step(*args, **kwargs)`` and keep the parameters and optimizer state it had wherever
        ``found_inf`` is set, bitwise, on the device; return the outcome with ``skipped`` None (the host does
        not know). Return None, changing nothing, where that cannot be done (the caller then uses `step`)."""
        ...

    # Imperative: optimizers that scale by themselves (torch's ``step(grad_scaler=...)``).
    def step_own_scaling(self, optimizer: Any, scaler: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Step ``optimizer`` with ``scaler`` handed to it and return the step's result, or ``NotImplemented``
        for every other optimizer (the core then unscales and checks as usual)."""
        ...

    # Imperative: the guard (with `GuardingDevice.count_skip`); the gradients are not unscaled.
    def check_gradients_finite(self, optimizer: Any) -> Flag | None:
        """The flag of ``optimizer``'s gradients, left unchanged; None without gradients."""
        ...

    # -- What a skipped step leaves: gradients and parameters named ------------------------------

    # Imperative: which gradients were inf/NaN, counted on request after a skip the host knows of.
    def non_finite_gradients(self, optimizer: Any) -> list[GradientCounts]:
        """Counts per gradient of ``optimizer``."""
        ...

    # Which parameters hold inf/NaN, asked once per run of skips (such parameters skip every step).
    def non_finite_parameters(self, optimizers: Sequence[Any]) -> list[GradientCounts]:
        """Counts per parameter stepped through ``optimizers`` (the optimizers this scaler stepped; a device that
        keeps the variables it applied may use those instead), read in one host transfer."""
        ...

    # -- Compilers, replicas and process groups --------------------------------------------------

    # A compiler that traces the step (torch.compile, tf.function).
    def compiling(self) -> bool:
        """Whether a compiler is tracing the call now; the core then skips host-only bookkeeping (reading
        records, counting probes) it cannot trace."""
        ...

    # A way out of the compiler's trace, for the iteration's end.
    def run_uncompiled(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` outside the compiler's trace, at run time (torch: a ``torch.compiler.disable``d call).
        The core ends a traced iteration (``update``) through it, so its records and counters are exact and the
        compiled code is never specialised on them."""
        ...

    # One copy of the step per replica, in threads (``tf.distribute.MirroredStrategy``).
    def replica(self) -> Any:
        """A hashable name of the replica making the call, or None outside a multi-replica step. The core
        keeps one iteration per replica, each checked as a loop of its own; the device must reduce its
        found-inf flags across the replicas so that they all take the same decision."""
        ...

    # Flags reduced over a process group (``LossScaler(process_group=...)``): these three together.
    def set_process_group(self, group: Any) -> None:
        """Reduce every found-inf flag over ``group`` from now on (a max all-reduce on the device). Raise a
        `polyamp.PolyampTypeError` when ``group`` is not one of the framework's process groups."""
        ...

    def set_group_iteration(self, index: int) -> None:
        """This rank's iteration count (iterations ended or discarded) for the reductions that follow: each
        reduction carries it, so that a reduction pairing different iterations of two ranks (one rank
        discarded an iteration alone) is detected on the device; the device then treats the flag as set (every
        rank skips) and remembers the mismatch for `read_group_mismatch`."""
        ...

    def read_group_mismatch(self) -> bool:
        """Whether a reduction since the last call paired different iterations of the group's ranks (one
        host read; False without a group)."""
        ...

    # -- Float16 the framework computes outside the policy ---------------------------------------

    # float16 the framework computes outside polyamp's policy, for the enabled rule.
    def float16_in_use(self, *, since_last_iteration: bool, loss: Any = None) -> bool:
        """Whether the current iteration computes in float16; with ``since_last_iteration=True`` the core is
        starting an iteration, and the device may start counting anew. The answer must follow this iteration's
        own computation, never the process's history: ``loss`` is the loss the iteration starts from when it
        starts in ``scale`` (None otherwise), for a device that cannot count what ran before it existed (its
        first iteration) and can tell from the loss instead."""
        ...

    # Whether a loss came from float16, for the warning of a policy-following scaler that does not scale it.
    def float16_computed(self, loss: Any) -> bool:
        """Whether ``loss`` (or a list of losses) was computed in float16. Asked in the first eager iterations
        of such a scaler only; may walk the framework's graph, within a bound."""
        ...

    # The framework's own loops hand gradients of losses never scaled: the iteration rule warns instead of raising.
    def unscaled_loss_warning(self, method: str) -> str:
        """The warning's text for ``method`` (e.g. ``"apply_gradients()"``), in the adapter's names."""
        ...

    # -- Functional forms ------------------------------------------------------------------------

    # Functional: the run id in the ring (these two together), so each state's records are its run's own.
    def ring_tag(self, ring: Any, run: int) -> Any:
        """``ring`` carrying the run id ``run`` (an int in [0, 2**31)), which `ring_write` keeps."""
        ...

    def ring_run(self, ring: Any) -> int | None:
        """The run id ``ring`` carries (one host read), or None where it carries none."""
        ...

    # Functional: a ceiling on the scale (`polyamp.LossScaleConfig.with_ceiling`) the records replay.
    @property
    def rule(self) -> LossScaleConfig:
        """The config whose rule `FunctionalDevice.update` follows: the device's config with its ceiling."""
        ...

    # Functional: whether a compiler traced ``update``; loaded settings are refused after that.
    def traced(self) -> bool:
        """Whether `FunctionalDevice.update` ran on traced values (under a compiler) since the device was made."""
        ...

    # Functional: the inner step run only when applied (`polyamp.FunctionalLossScaler.step(lazy=True)`).
    def cond(self, found_inf: Flag, if_skipped: Any, if_applied: Any) -> Any:
        """``if_skipped()`` when ``found_inf`` is set, else ``if_applied()`` (functions): only one of them runs."""
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
