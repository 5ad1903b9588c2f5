"""The functional form's state as data: a fresh state, the host's view of one, its records, and state dicts
written and read as every polyamp scaler's.

A part of `polyamp.FunctionalLossScaler` (`polyamp._src.functional` joins it to the iteration's functions).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

from polyamp._src.backend import (
    FunctionalDevice,
    FunctionalProvenanceDevice,
    FunctionalRecordingDevice,
    FunctionalSpikeDevice,
)
from polyamp._src.errors import InvalidConfigError, PolyampTypeError, ScalerUsageError, StateDictError
from polyamp._src.provenance import non_finite_gradients
from polyamp._src.records import StepRecord
from polyamp._src.run_records import RunBooks
from polyamp._src.run_summary import RunSummary
from polyamp._src.scaling import LossScaleConfig, LossScaleState, to_float32
from polyamp._src.skip_streak import ParameterCheck
from polyamp._src.spikes import SpikeRule
from polyamp._src.state_dict import is_disabled_torch_state, parse_scaler_state, to_state_dict

__all__ = ["FunctionalMode", "FunctionalStatePart"]

#: What an iteration of a functional scaler does: scale, check without scaling, or neither.
FunctionalMode = Literal["scaling", "guarding", "off"]


class FunctionalStatePart:
    """The state functions of `polyamp.FunctionalLossScaler`."""

    _make_device: Callable[[LossScaleConfig], FunctionalDevice]
    _device: FunctionalDevice
    _config: LossScaleConfig
    _scale_rule: LossScaleConfig
    _setting: bool | None
    _rule: SpikeRule | None
    _history: int
    _mode: FunctionalMode
    _recording: bool
    _runs: bool
    _traced: Callable[[], bool] | None
    _books: RunBooks

    if TYPE_CHECKING:  # the iteration's functions, joined in FunctionalLossScaler

        def __getattr__(self, name: str) -> Any: ...

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

    def summary(self, state: Any, *, check_parameters: ParameterCheck | None = None) -> RunSummary:
        """The run of ``state`` in one line (``str()`` of the result): its steps, the skipped ones by reason
        and iteration, the loss scale's path and the layers of non-finite gradients, as
        `polyamp.LossScaler.summary` gives them. It reads the records as `records` does (one host read) and
        covers ``state``'s run up to ``state``'s own last iteration, every record read so far included (not only
        the ``history`` kept): read it, or the records, at least every ``history`` iterations.
        """
        return self._books.summary(lambda: self.records(state, check_parameters=check_parameters))

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
        rule = self._rule
        config, host, window, run, skipped = parse_scaler_state(
            state_dict, self._config, loader_disabled=disabled, window=None if rule is None else rule.window
        )
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
