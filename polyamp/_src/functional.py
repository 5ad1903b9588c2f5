"""`FunctionalLossScaler`: polyamp's loss scaling as pure functions over a state, for jitted steps.

A jitted training step (JAX, Keras's stateless API) cannot call back into Python every step, so the
scaler's state travels with the step as a value: ``state`` in, ``state`` out. The semantics are the same
as `polyamp.LossScaler`'s: gradients are unscaled and checked, a step with a non-finite gradient is skipped
(``apply_if_finite`` keeps the old parameters and optimizer state), and the scale follows the reference
rule of `polyamp.LossScaleConfig`; the backend's `polyamp.backend_api.FunctionalDevice` does the device work.

The state is a dict of the device's trees of arrays (nothing else, so a jitted function can take and return
it, and ``jax.lax.cond`` can carry it): ``"scaler"`` (scale, counters, the skip count), and, where the
device offers them, ``"ring"`` (the step records' codes, `polyamp.backend_api.FunctionalRecordingDevice`)
``"window"`` (the `polyamp.SpikeRule`'s window, `polyamp.backend_api.FunctionalSpikeDevice`) and, when `init`
was given the gradients' shape, ``"provenance"`` (which gradients held inf/NaN in the last skipped step,
`polyamp.backend_api.FunctionalProvenanceDevice`). Everything
that is decided rather than computed (the iteration's mode: scaling, guarding or off; a record's code; a
spike skip counted as a skip) is decided here, once, when `polyamp.LossScaler.functional` is called.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, NamedTuple, cast

from polyamp._src.backend import (
    Flag,
    FunctionalDevice,
    FunctionalGuardingDevice,
    FunctionalProvenanceDevice,
    FunctionalRecordingDevice,
    FunctionalSpikeDevice,
)
from polyamp._src.errors import InvalidConfigError, PolyampTypeError, ScalerUsageError, StateDictError, describe
from polyamp._src.provenance import non_finite_gradients
from polyamp._src.records import DEFAULT_HISTORY, MODE_CODES, Recorder, StepRecord
from polyamp._src.run_records import RunBooks
from polyamp._src.run_summary import RunSummary
from polyamp._src.scaling import LossScaleConfig, LossScaleState, to_float32
from polyamp._src.skip_streak import ParameterCheck
from polyamp._src.spikes import SpikeRule
from polyamp._src.state_dict import (
    is_disabled_torch_state,
    parse_skipped_steps,
    parse_spike_run,
    parse_spike_window,
    parse_state_dict,
    to_state_dict,
)

__all__ = ["FunctionalLossScaler", "FunctionalStep"]

#: What an iteration of a functional scaler does: scale, check without scaling, or neither.
FunctionalMode = Literal["scaling", "guarding", "off"]
_STATE_KEYS: Final = ("scaler", "ring", "window", "provenance")


class FunctionalStep(NamedTuple):
    """What `FunctionalLossScaler.step` returns: the inner step's ``result`` (or what ``keep`` gave on a
    skipped step), the new ``state``, the iteration's flags, ``found_inf`` (a gradient was inf or NaN) and
    ``skipped`` (that or the spike rule), None when nothing was checked, and the unscaled ``grads`` the inner
    step was given."""

    result: Any
    state: Any
    found_inf: Flag | None = None
    skipped: Flag | None = None
    grads: Any = None


def _check_flag(flag: Any, method: str) -> None:
    """Raise unless ``flag`` is one flag: a scalar (0-d) array or a Python bool or number. An array of several
    flags would be broadcast into the parameters and the scale, mixing two trees element by element."""
    if flag is None or isinstance(flag, (bool, int, float)):
        return
    ndim = getattr(flag, "ndim", None)
    if isinstance(flag, (list, tuple, Mapping)) or (isinstance(ndim, int) and ndim != 0):
        shape = getattr(flag, "shape", None)
        held = "" if shape is None else f" of shape {tuple(shape)}"
        raise PolyampTypeError(
            f"FunctionalLossScaler.{method} takes one flag: a scalar, such as the found_inf unscale() returned "
            f"(> 0: the step is skipped). Received: {describe(flag)}{held}. Reduce several flags to one first, "
            "e.g. jnp.max(flags), or pass unscale()'s flag."
        )


class FunctionalLossScaler:
    """Loss scaling as pure functions of a state, from `polyamp.LossScaler.functional`.

    Example:
        ```python
        # shape of a jitted step; grad_fn and apply are the framework's
        fn = scaler.functional()
        state = fn.init()

        def train_step(params, opt_state, state, batch):
            grads = grad_fn(lambda p: fn.scale(state, loss_fn(p, batch)))(params)
            grads, found_inf = fn.unscale(state, grads)
            new_params, new_opt_state = apply(grads, params, opt_state)
            params, opt_state = fn.apply_if_finite(found_inf, (new_params, new_opt_state), (params, opt_state))
            return params, opt_state, fn.update(state, found_inf)
        ```

    With scaling disabled (``enabled`` decided when `functional` was called) and no guard, every function
    passes its input through and the flag is None.

    The guard, the records and the spike rule follow the options of the `polyamp.LossScaler` that made this
    object (``guard=``, ``history=``, ``spike=``, ``on_min_scale=``). With a `polyamp.SpikeRule`, the step asks
    `spike` for the iteration's decision and hands it to `apply_if_finite` and `update`:

        scaler = polyamp.LossScaler(spike=polyamp.SpikeRule("loss", window=64))
        fn = scaler.functional(backend="...")
        state = fn.init()

        def train_step(params, opt_state, state, batch):
            def scaled(p):
                loss = loss_fn(p, batch)
                return fn.scale(state, loss), loss          # the unscaled loss is the rule's statistic

            (_, loss), grads = value_and_grad(scaled, has_aux=True)(params)
            grads, found_inf = fn.unscale(state, grads)      # guarding (enabled=False, guard=True): checked only
            spike = fn.spike(state, loss=loss, grads=grads)  # None without a rule
            new_params, new_opt_state = apply(grads, params, opt_state)
            params, opt_state = fn.apply_if_finite(
                found_inf, (new_params, new_opt_state), (params, opt_state), spike=spike
            )
            return params, opt_state, fn.update(state, found_inf, spike=spike)

        for batch in batches:
            params, opt_state, state = train_step(params, opt_state, state, batch)
        fn.records(state)      # [StepRecord(iteration=0, skipped=False, reason=None, mode='scaling', ...), ...]
        fn.state_dict(state)   # interchangeable with LossScaler.state_dict(), spike window included

    A skip by the spike rule leaves parameters and optimizer state as they were and counts in
    `skipped_steps`, but the loss-scale rule sees a finite iteration, exactly as with `polyamp.LossScaler`.
    """

    def __init__(
        self,
        make_device: Callable[[LossScaleConfig], FunctionalDevice],
        config: LossScaleConfig,
        enabled: bool,
        *,
        setting: bool | None = True,
        guard: bool | None = None,
        history: int = DEFAULT_HISTORY,
        spike: SpikeRule | None = None,
        on_min_scale: str = "warn",
        backend: str = "this",
    ) -> None:
        """Wrap a backend's functional device (`polyamp.LossScaler.functional` calls this).

        Args:
            make_device: The backend's ``make_functional``.
            config: The settings the state follows.
            enabled: Whether the functions scale.
            setting: The scaler's ``enabled`` argument (True, False or None), written to state dicts.
            guard: The scaler's ``guard`` argument: whether functions that do not scale still check the
                gradients (None: when ``setting`` is None, i.e. the policy turned scaling off).
            history: How many step codes the state's ring holds, and how many records `records` keeps.
            spike: The scaler's `polyamp.SpikeRule`, or None.
            on_min_scale: What `records` does when a record shows the scale reaching its floor.
            backend: The backend's name, for error messages.

        Raises:
            PolyampTypeError: ``guard=True`` or ``spike`` is asked of a device that cannot do it.
        """
        self._make_device = make_device
        self._device = make_device(config)
        self._config = config
        self._enabled = enabled
        self._setting = setting
        self._guard = guard
        self._rule = spike
        self._history = history
        self._on_min_scale = on_min_scale
        self._backend = backend
        self._mode: FunctionalMode = "off"
        self._recording = False
        self._read_capabilities()
        self._books = RunBooks(self._new_recorder, history)  # the records, per run (per init)
        self._books.start(None, config.initial_state())

    def _read_capabilities(self) -> None:
        """Read which optional protocols the device implements, once (and again when it is remade)."""
        device = self._device
        self._recording = isinstance(device, FunctionalRecordingDevice)
        # optional methods (`polyamp.backend_api.OptionalMethods`): the rule with the device's ceiling, a run id in
        # the ring, whether update was traced, a branch that runs one side
        rule = getattr(device, "rule", None)
        self._scale_rule = rule if isinstance(rule, LossScaleConfig) else self._config
        self._runs = self._recording and hasattr(device, "ring_tag") and hasattr(device, "ring_run")
        self._traced: Callable[[], bool] | None = getattr(device, "traced", None)
        self._cond: Callable[..., Any] | None = getattr(device, "cond", None)
        if self._rule is not None and not isinstance(device, FunctionalSpikeDevice):
            raise PolyampTypeError(
                f"The {self._backend!r} backend's functional form cannot apply a SpikeRule (it does not implement "
                "polyamp.backend_api.FunctionalSpikeDevice). Received spike="
                f"{self._rule!r}; construct the LossScaler without spike= to make its functional form."
            )
        if self._enabled:
            self._mode = "scaling"
            return
        guard = self._setting is None if self._guard is None else self._guard
        supported = isinstance(device, FunctionalGuardingDevice)
        if guard and not supported and self._guard:
            raise PolyampTypeError(
                f"guard=True, but the {self._backend!r} backend's functional form cannot check gradients without "
                "scaling (it does not implement polyamp.backend_api.FunctionalGuardingDevice). Pass guard=None or "
                "False."
            )
        self._mode = "guarding" if guard and supported else "off"

    def _new_recorder(self) -> Recorder:
        return Recorder(self._history, self._on_min_scale, self._rule.reason if self._rule else "loss_spike")

    @property
    def config(self) -> LossScaleConfig:
        """The settings the state follows."""
        return self._config

    @property
    def enabled(self) -> bool:
        """Whether these functions scale at all."""
        return self._enabled

    @property
    def mode(self) -> FunctionalMode:
        """What every iteration does: ``"scaling"``, ``"guarding"`` (checks gradients without scaling and skips
        non-finite steps) or ``"off"`` (passes everything through); the records' mode."""
        return self._mode

    @property
    def spike_rule(self) -> SpikeRule | None:
        """The `polyamp.SpikeRule` the state's window follows, or None."""
        return self._rule

    @property
    def device(self) -> FunctionalDevice:
        """The backend's device operations."""
        return self._device

    # -- the state ---------------------------------------------------------------------------------------

    def init(self, state: LossScaleState | None = None, *, grads: Any = None) -> dict[str, Any]:
        """A fresh state: the config's initial state (or ``state``, validated as `load_state_dict` validates a
        state dict's), a zero skip count, an empty record ring (where the device keeps records) and an empty
        spike window (with a `polyamp.SpikeRule`).

        The records `records` gives start anew from here: iteration 0 is the first `update` of this state.

        Args:
            state: None, or a `polyamp.LossScaleState` this config can be in (e.g. ``fn.read(old_state)``).
            grads: None, or a tree shaped like the gradients (the parameters): the state then also counts which
                gradients held inf/NaN in a skipped step (on the device, only when it skips), and the record of
                the most recent such step names them (`polyamp.StepRecord.gradients`); `update` then takes
                the unscaled gradients as ``grads=``.

        Returns:
            The state: a dict of the backend's arrays, to pass to the other functions.

        Raises:
            PolyampTypeError: (a ``TypeError``) ``state`` is not a `polyamp.LossScaleState` of numbers, or
                ``grads`` was given to a backend whose functional form cannot count non-finite gradients.
            InvalidConfigError: (a ``ValueError``) ``state`` is impossible under this config: a scale that is
                NaN, infinite, zero, negative, subnormal or outside ``[min_scale, max_scale]`` (without
                ``min_scale``, the floor is 1.0), or a counter outside its range.
        """
        if state is None:
            initial = self._config.initial_state()
        else:
            try:
                self._scale_rule.check_state(state)
            except (InvalidConfigError, PolyampTypeError) as exc:
                raise type(exc)(
                    f"FunctionalLossScaler.init() cannot start from this state: {exc} Pass no state for the "
                    "config's initial one, or a state this config reaches (fn.read(state), scaler.get_state())."
                ) from exc
            initial = LossScaleState(
                to_float32(float(state.scale)), int(state.growth_tracker), int(state.hysteresis_left)
            )
        tree: dict[str, Any] = {"scaler": self._device.init(initial)}
        run = None
        if self._recording:
            device = cast(FunctionalRecordingDevice, self._device)
            tree["ring"] = device.ring_init(self._history)
            if self._runs:  # this state's records are its run's, not the scaler's
                run = secrets.randbelow(2**31)
                while self._books.known(run):
                    run = secrets.randbelow(2**31)
                tree["ring"] = device.ring_tag(tree["ring"], run)  # type: ignore[attr-defined]
        self._books.start(run, initial)
        if self._rule is not None:
            spikes = cast(FunctionalSpikeDevice, self._device)
            tree["window"] = spikes.window_init(self._rule)
        if grads is not None:
            tree["provenance"] = self._provenance_device("init(grads=...)").provenance_init(grads)
        return tree

    def _provenance_device(self, method: str) -> FunctionalProvenanceDevice:
        if not isinstance(self._device, FunctionalProvenanceDevice):
            raise PolyampTypeError(
                f"FunctionalLossScaler.{method}: the {self._backend!r} backend's functional form cannot count "
                "non-finite gradients (it does not implement polyamp.backend_api.FunctionalProvenanceDevice). "
                "Call it without grads=."
            )
        return self._device

    def _scaler(self, state: Any, method: str) -> Any:
        """The device's scale-and-counters tree of ``state``.

        Raises:
            PolyampTypeError: ``state`` is not a state `init` made.
        """
        if not isinstance(state, Mapping) or "scaler" not in state or set(state) - set(_STATE_KEYS):
            raise PolyampTypeError(
                f"FunctionalLossScaler.{method} takes the state init() (or update(), load_state_dict()) returned: a "
                f"dict with the keys 'scaler', and 'ring' / 'window' / 'provenance' where kept. Received: "
                f"{describe(state)}."
            )
        return state["scaler"]

    # -- one iteration -----------------------------------------------------------------------------------

    def scale(self, state: Any, loss: Any) -> Any:
        """``loss`` times the current scale (``loss`` itself when not scaling)."""
        tree = self._scaler(state, "scale()")
        return self._device.scale(tree, loss) if self._enabled else loss

    def unscale(self, state: Any, grads: Any) -> tuple[Any, Flag | None]:
        """The gradients divided by the scale, and the flag saying whether one is inf or NaN.

        Guarding (``enabled=False`` with the guard), the gradients are returned as they are and only checked;
        with neither, the flag is None.
        """
        tree = self._scaler(state, "unscale()")
        if self._mode == "scaling":
            return self._device.unscale(tree, grads)
        if self._mode == "guarding":
            device = cast(FunctionalGuardingDevice, self._device)
            return grads, device.check(tree, grads)
        return grads, None

    def spike(self, state: Any, *, loss: Any = None, grads: Any = None) -> dict[str, Any] | None:
        """The spike rule's decision for this iteration: ``{"statistic": x, "flag": spike}`` (arrays, so a
        jitted step can return it), for `apply_if_finite` and `update`; None without a rule, or when the
        functions neither scale nor guard.

        Args:
            state: The iteration's state.
            loss: The iteration's loss, *unscaled* (a rule on ``"loss"``; a list of losses: their sum).
            grads: The iteration's unscaled gradients, as `unscale` returned them (a rule on ``"grad_norm"``:
                their global L2 norm).

        Raises:
            ScalerUsageError: the statistic the rule watches was not given.
        """
        self._scaler(state, "spike()")
        rule = self._rule
        if rule is None or self._mode == "off":
            return None
        device = cast(FunctionalSpikeDevice, self._device)
        if rule.on == "loss":
            if loss is None:
                raise ScalerUsageError(
                    "FunctionalLossScaler.spike() needs loss=: the SpikeRule watches the loss (on='loss'). Pass the "
                    "iteration's unscaled loss, e.g. fn.spike(state, loss=loss, grads=grads)."
                )
            statistic = device.spike_statistic(loss)
        else:
            if grads is None:
                raise ScalerUsageError(
                    "FunctionalLossScaler.spike() needs grads=: the SpikeRule watches the gradient norm "
                    "(on='grad_norm'). Pass the gradients unscale() returned, e.g. fn.spike(state, grads=grads)."
                )
            statistic = device.spike_grad_norm(grads)
        return {"statistic": statistic, "flag": device.spike_check(rule, state["window"], statistic)}

    def skipped(self, found_inf: Flag | None, spike: Mapping[str, Any] | None = None) -> Flag | None:
        """The flag of whether this iteration's step is skipped: ``found_inf`` (a non-finite gradient) or the
        spike rule's flag (``spike``, what `spike` returned); None when nothing was checked.

        Raises:
            PolyampTypeError: ``found_inf`` is not one flag (a scalar), e.g. an array of per-leaf flags.
        """
        _check_flag(found_inf, "skipped()/apply_if_finite()")
        if spike is None:
            return found_inf
        if found_inf is None:
            return spike["flag"]
        device = cast(FunctionalSpikeDevice, self._device)
        return device.combine(found_inf, spike["flag"])

    def apply_if_finite(
        self, found_inf: Flag | None, applied: Any, current: Any, spike: Mapping[str, Any] | None = None
    ) -> Any:
        """``applied`` (the values after the optimizer step) unless ``found_inf`` or the spike rule's flag
        (``spike``, what `spike` returned) is set, then ``current``: a skipped step leaves parameters and
        optimizer state exactly as they were.

        Raises:
            PolyampTypeError: ``found_inf`` is not one flag (a scalar), e.g. an array of per-leaf flags.
        """
        flag = self.skipped(found_inf, spike)
        if flag is None:
            return applied
        return self._device.select(flag, current, applied)

    def update(
        self, state: Any, found_inf: Flag | None, spike: Mapping[str, Any] | None = None, *, grads: Any = None
    ) -> Any:
        """The state after the iteration, as `polyamp.LossScaler.update` leaves its own.

        Scaling, the loss-scale rule advances with ``found_inf`` (and counts a skip when it is set); guarding,
        a skip is counted without running the rule; with a `polyamp.SpikeRule`, a skip by the rule alone is
        counted (the loss-scale rule sees a finite iteration) and the statistic enters the window when the step
        was applied (re-basing it after ``max_consecutive`` spikes). The iteration's record code is written to
        the ring.

        Args:
            state: The iteration's state.
            found_inf: The flag `unscale` returned (None when the functions neither scale nor guard).
            spike: What `spike` returned for this iteration (None without a rule).
            grads: The gradients `unscale` returned, for a state made with ``init(grads=...)`` (which counts
                the non-finite ones of a skipped step); None otherwise.

        Raises:
            ScalerUsageError: scaling or guarding without a flag, or a rule's iteration without its decision,
                or a state that counts non-finite gradients updated without ``grads``.
            PolyampTypeError: a decision for a scaler without a rule, or a ``found_inf`` that is not one flag.
        """
        tree = self._scaler(state, "update()")
        _check_flag(found_inf, "update()")
        new = dict(state)
        mode = self._mode
        if "provenance" in state:
            if grads is None and mode != "off":
                raise ScalerUsageError(
                    "FunctionalLossScaler.update() needs grads=: this state counts which gradients held inf/NaN "
                    "(init(grads=...)). Pass the gradients unscale() returned, e.g. fn.update(state, found_inf, "
                    "grads=grads)."
                )
            counting = self._provenance_device("update()")
            new["provenance"] = counting.provenance_write(
                state["provenance"], grads, None if mode == "off" else found_inf
            )
        if mode == "off":
            if self._recording:
                recording = cast(FunctionalRecordingDevice, self._device)
                new["ring"] = recording.ring_write(state["ring"], MODE_CODES["off"], None)
            return new
        if found_inf is None:
            raise ScalerUsageError(
                f"FunctionalLossScaler.update() received found_inf=None, but these functions are {mode}: pass the "
                "flag unscale() returned for this iteration."
            )
        rule = self._rule
        if rule is not None and spike is None:
            raise ScalerUsageError(
                "FunctionalLossScaler.update() needs spike=: this scaler has a SpikeRule. Pass what "
                "fn.spike(state, loss=..., grads=...) returned for this iteration."
            )
        if rule is None and spike is not None:
            raise PolyampTypeError(
                f"FunctionalLossScaler.update(spike=...) takes None for a scaler without a SpikeRule (spike() "
                f"returns None then). Received: {describe(spike)}."
            )
        if mode == "scaling":
            tree = self._device.update(tree, found_inf)
        else:
            guarding = cast(FunctionalGuardingDevice, self._device)
            tree = guarding.count_skip(tree, found_inf)
        only = None
        if rule is not None and spike is not None:
            device = cast(FunctionalSpikeDevice, self._device)
            new["window"], only = device.spike_finish(
                rule, state["window"], spike["statistic"], spike["flag"], found_inf
            )
            tree = device.count_skip(tree, only)
        new["scaler"] = tree
        if self._recording:
            recording = cast(FunctionalRecordingDevice, self._device)
            if only is None:
                new["ring"] = recording.ring_write(state["ring"], MODE_CODES[mode], found_inf)
            else:
                new["ring"] = recording.ring_write(state["ring"], MODE_CODES[mode], found_inf, only)
        return new

    def step(
        self,
        state: Any,
        grads: Any,
        inner: Callable[[Any], Any],
        keep: Callable[[Any], Any],
        *,
        loss: Any = None,
        unscale: Callable[[Any, Any], tuple[Any, Flag]] | None = None,
        lazy: bool = False,
    ) -> FunctionalStep:
        """One iteration after the backward pass, in polyamp's order: unscale (or check) the gradients, ask
        the spike rule, take the inner step, keep the old values on a skip, advance the state.

        Example:
            ```python
            # a jitted step; loss_fn and apply are the framework's
            def train_step(params, opt_state, state, batch):
                grads = grad(lambda p: fn.scale(state, loss_fn(p, batch)))(params)
                out = fn.step(
                    state,
                    grads,
                    lambda g: apply(g, params, opt_state),  # the inner step, on the unscaled gradients
                    lambda applied: (params, opt_state),  # what a skipped step gives instead
                )
                (params, opt_state), state = out.result, out.state
                return params, opt_state, state
            ```

        Args:
            state: The iteration's state.
            grads: The gradients of the scaled loss (`scale`), or of the loss when the functions do not scale.
            inner: The inner step: a function of the unscaled gradients returning its result (new parameters
                and optimizer state, or an optax transformation's updates and state).
            keep: A function of ``inner``'s result returning what a skipped step gives instead, of the same
                structure (the old values; optax: zero updates and the old state). With ``lazy`` it is called
                with None.
            loss: The iteration's unscaled loss, for a `polyamp.SpikeRule` on ``"loss"``.
            unscale: None, or a function ``(scaler tree, grads) -> (unscaled grads, flag)`` that stands for the
                device's `unscale` (a backend's unscale with clipping folded in).
            lazy: Run ``inner`` only when the step is applied (the device's ``cond``), instead of computing it
                and selecting; for a device whose functional form has ``cond``.

        Returns:
            A `FunctionalStep`: the result, the new state, and the iteration's flags.
        """
        tree = self._scaler(state, "step()")
        counting = "provenance" in state
        if self._mode == "off":
            new = self.update(state, None, grads=grads if counting else None)
            return FunctionalStep(inner(grads), new, grads=grads)
        if unscale is not None and self._mode == "scaling":
            grads, found_inf = unscale(tree, grads)
        else:
            grads, found_inf = self.unscale(state, grads)
        decision = self.spike(state, loss=loss, grads=grads)
        skipped = self.skipped(found_inf, decision)
        cond = self._cond if lazy else None
        if cond is not None:
            result = cond(skipped, lambda: keep(None), lambda: inner(grads))
        else:
            applied = inner(grads)
            result = self._device.select(skipped, keep(applied), applied)
        new = self.update(state, found_inf, decision, grads=grads if counting else None)
        return FunctionalStep(result, new, found_inf, skipped, grads)

    # -- reading on the host -----------------------------------------------------------------------------

    def read(self, state: Any) -> LossScaleState:
        """The host view of a state's scale and counters (synchronises)."""
        return self._device.read(self._scaler(state, "read()"))

    def skipped_steps(self, state: Any) -> Any:
        """How many steps were skipped (non-finite gradients and spikes), as the framework's integer scalar."""
        return self._device.skipped_count(self._scaler(state, "skipped_steps()"))

    def records(self, state: Any, *, check_parameters: ParameterCheck | None = None) -> list[StepRecord]:
        """The most recent iterations' records (at most ``history``), oldest first, as `polyamp.StepRecord`:
        skipped or not, why, the mode, and the scale replayed from the config, as `polyamp.LossScaler.records`
        gives them (empty when the device keeps no records).

        The records are ``state``'s own: those of the run it belongs to (the `init` or `load_state_dict` it was
        stepped from), up to its own last iteration, so another run's states, later states of its run and
        states stepped again from an older one never show in them. They are kept here, on the host, per run
        (the 16 most recently read or started runs; the device keeps the run's id in the ring,
        ``ring_tag``, `polyamp.backend_api.OptionalMethods`): each read takes the codes ``state``'s ring gained since
        its run was last read (one host read). Read them at least every ``history`` iterations: older codes are
        overwritten in the ring (a warning says how many were lost). A device that keeps no run id keeps one
        run, which each `init` starts anew. Safe from any thread: threads reading at once (a monitoring thread
        beside the training loop) take each code into the records once, so each skip is logged and a collapse
        warned once.

        ``check_parameters``: counts of the parameters' non-finite values, ``(name, +inf, -inf, NaN, size)`` each,
        asked once per run of skipped iterations; when some hold inf or NaN, a warning says that they, not the
        data, skip every step (`polyamp.LossScaler.records` asks its device the same).

        Raises:
            ScaleCollapseError: with ``on_min_scale="raise"``, a record shows the scale reaching its floor.
        """
        self._scaler(state, "records()")
        if not self._recording:
            return []
        provenance = None
        if "provenance" in state:  # the last skip's counts, attached once to its record
            at, entries = self._provenance_device("records()").provenance_read(state["provenance"])
            if at >= 0:
                provenance = (at, lambda: non_finite_gradients(entries))
        device = cast(FunctionalRecordingDevice, self._device)
        run = device.ring_run(state["ring"]) if self._runs else None  # type: ignore[attr-defined]
        count, codes = device.ring_read(state["ring"])
        return self._books.read(
            run, count, codes, self._scale_rule, lambda: self.read(state), provenance, check_parameters
        )

    def state_dict(self, state: Any) -> dict[str, Any]:
        """A state dict interchangeable with `polyamp.LossScaler.state_dict`'s (the spike window and its run
        included, with a rule)."""
        host = self.read(state)
        window: list[float] | None = None
        run = 0
        if self._rule is not None:
            device = cast(FunctionalSpikeDevice, self._device)
            window, run = device.read_window(state["window"])
        skipped = int(self._device.skipped_count(state["scaler"]))
        return to_state_dict(self._config, host, self._setting, window, run, skipped)

    def load_state_dict(self, state_dict: Mapping[str, Any], *, like: Any = None) -> Any:
        """A state from a `polyamp.LossScaler` (or torch GradScaler) state dict, its spike window and run
        included. The records start anew, as after `init`. A scaler made with ``enabled=False`` takes ``{}`` (a
        disabled GradScaler's dict) as nothing to restore: a fresh state.

        The dict's settings are adopted only while no compiled step has traced this scaler's `update` (a
        jitted or scanned step holds the settings as constants, and would go on using the old ones): after
        that, a dict with other settings raises, and `restore` gives a new functional scaler for them.

        Args:
            state_dict: The state dict.
            like: None, or a state of this scaler whose form the new one keeps: one that counts non-finite
                gradients (``init(grads=...)``) gives a new state that counts them for the same gradients.

        Raises:
            StateDictError: the dict is malformed, or holds a state this backend cannot be in (nothing changes).
            ScalerUsageError: the dict's settings differ from this scaler's, and a compiled step traced them
                (nothing changes; use `restore`).
        """
        disabled = self._setting is False
        counting = isinstance(like, Mapping) and "provenance" in like
        if disabled and is_disabled_torch_state(state_dict):
            fresh = self.init()
            if counting:
                fresh["provenance"] = self._provenance_device("load_state_dict()").provenance_reset(like["provenance"])
            return fresh
        config, host = parse_state_dict(state_dict, self._config, loader_disabled=disabled)
        rule = self._rule
        window = parse_spike_window(state_dict, None if rule is None else rule.window)
        run = parse_spike_run(state_dict)
        skipped = parse_skipped_steps(state_dict)
        if config != self._config and self._traced is not None and self._traced():
            changed = ", ".join(
                f"{name}: {old!r} -> {new!r}"
                for name, old, new in zip(
                    config.setting_names(), self._config.settings().values(), config.settings().values(), strict=True
                )
                if old != new
            )
            raise ScalerUsageError(
                f"FunctionalLossScaler.load_state_dict() would change the loss-scaling settings ({changed}), but a "
                "compiled step (jax.jit, lax.scan, ...) has already traced this scaler's update(): the settings are "
                "constants there, and it would go on using the old ones. Take a functional scaler that follows the "
                "dict instead, `fn, state = fn.restore(state_dict)`, and step with it (its functions trace anew), "
                "or load the dict before the first compiled step."
            )
        try:
            made = self._device if config == self._config else self._make_device(config)
            ceiling_rule = getattr(made, "rule", None)  # (a device with a ceiling on the scale)
            (ceiling_rule if isinstance(ceiling_rule, LossScaleConfig) else config).check_state(host)
        except (InvalidConfigError, PolyampTypeError) as exc:
            raise StateDictError(f"FunctionalLossScaler.load_state_dict() cannot load this state here: {exc}") from exc
        if made is not self._device:  # the rule's constants live in the device functions: new ones
            self._device = made
            self._config = config
            self._read_capabilities()
        state = self.init(host)
        state["scaler"] = self._device.init(host, skipped)
        if window is not None and rule is not None:
            device = cast(FunctionalSpikeDevice, self._device)
            state["window"] = device.write_window(state["window"], window, run)
        if counting:
            state["provenance"] = self._provenance_device("load_state_dict()").provenance_reset(like["provenance"])
        return state

    def restore(self, state_dict: Mapping[str, Any], *, like: Any = None) -> tuple[FunctionalLossScaler, Any]:
        """The functional scaler that follows ``state_dict``'s settings, and the state loaded from it, leaving
        this scaler as it is: this scaler when the settings are its own, else a new one with them and this
        one's options (mode, guard, history, spike rule, ``on_min_scale``, device), whose functions a jitted
        step traces anew. Use it to resume a dict with other settings once a compiled step traced this one.

        Args:
            state_dict: The state dict.
            like: As for `load_state_dict`.

        Returns:
            ``(fn, state)``: the functional scaler to step with, and its state.

        Raises:
            StateDictError: the dict is malformed, or holds a state this backend cannot be in.
        """
        disabled = self._setting is False
        if not (disabled and is_disabled_torch_state(state_dict)):
            config, _ = parse_state_dict(state_dict, self._config, loader_disabled=disabled)
            if config != self._config:
                try:
                    sibling = FunctionalLossScaler(
                        self._make_device,
                        config,
                        self._enabled,
                        setting=self._setting,
                        guard=self._guard,
                        history=self._history,
                        spike=self._rule,
                        on_min_scale=self._on_min_scale,
                        backend=self._backend,
                    )
                except InvalidConfigError as exc:
                    raise StateDictError(
                        f"FunctionalLossScaler.restore() cannot follow this state dict here: {exc}"
                    ) from exc
                return sibling, sibling.load_state_dict(state_dict, like=like)
        return self, self.load_state_dict(state_dict, like=like)

    def summary(self, state: Any, *, check_parameters: ParameterCheck | None = None) -> RunSummary:
        """The run of ``state`` in one line (``str()`` of the result): its steps, the skipped ones by reason
        and iteration, the loss scale's path and the layers of non-finite gradients, as
        `polyamp.LossScaler.summary` gives them. It reads the records as `records` does (one host read) and
        covers ``state``'s run up to ``state``'s own last iteration, every record read so far included (not only
        the ``history`` kept): read it, or the records, at least every ``history`` iterations.
        """
        return self._books.summary(lambda: self.records(state, check_parameters=check_parameters))
