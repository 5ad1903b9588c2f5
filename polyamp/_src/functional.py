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

from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple, cast

from polyamp._src.backend import (
    Flag,
    FunctionalDevice,
    FunctionalGuardingDevice,
    FunctionalRecordingDevice,
    FunctionalSpikeDevice,
)
from polyamp._src.errors import InvalidConfigError, PolyampTypeError, ScalerUsageError, StateDictError, describe
from polyamp._src.functional_state import FunctionalMode, FunctionalStatePart
from polyamp._src.records import DEFAULT_HISTORY, MODE_CODES, Recorder
from polyamp._src.run_records import RunBooks
from polyamp._src.scaling import LossScaleConfig
from polyamp._src.spikes import SpikeRule
from polyamp._src.state_dict import is_disabled_torch_state, parse_state_dict

__all__ = ["FunctionalLossScaler", "FunctionalMode", "FunctionalStep"]

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


class FunctionalLossScaler(FunctionalStatePart):
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
