"""`OptionalMethods`: the single capabilities a device form may have, each a method the core calls where the
device has it (read once, when a scaler binds: `polyamp._src.binding.DeviceCapabilities`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from polyamp._src.backend import Flag, GradientCounts, StepOutcome
from polyamp._src.scaling import LossScaleConfig

__all__ = ["OptionalMethods"]


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
