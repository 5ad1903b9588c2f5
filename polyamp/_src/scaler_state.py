"""The scaler's state as data: the scale and counters, state dicts, the functional form, pickles.

A part of `polyamp.LossScaler` (`polyamp._src.loss_scaler` joins them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from polyamp._src import registry
from polyamp._src.backend import FunctionalBackend
from polyamp._src.errors import (
    PolyampTypeError,
    ScalerUsageError,
)
from polyamp._src.functional import FunctionalLossScaler
from polyamp._src.scaler_base import ScalerBase
from polyamp._src.scaling import LossScaleConfig, LossScaleState
from polyamp._src.state_dict import is_disabled_torch_state, parse_scaler_state, to_state_dict

__all__ = ["StatePart"]


class StatePart(ScalerBase):
    """The scaler's state as data."""

    def get_state(self) -> LossScaleState:
        """The scale and counters (reading a device state synchronises). Safe from another thread: the
        state is read between two updates, never halfway through one."""
        if self._device is None:
            return self._host_state
        return self._between_updates(self._device.read_state)  # type: ignore[no-any-return]

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Reading a device scale synchronises."""
        if not self.enabled:
            return 1.0
        return float(self.get_state().scale)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's settings and state as a JSON-serialisable dict.

        Its keys include those of ``torch.amp.GradScaler.state_dict()``, so either can load the other's;
        a dict saved from one backend resumes on another with the same trajectory. It also holds the count of
        skipped iterations (``skipped_steps``), so that a resumed run's `skipped_steps` counts on (GradScaler
        reads its own keys only). Save it at the start of an iteration or after `update`.
        """
        spikes = self._spikes
        return to_state_dict(
            self._config,
            self.get_state(),
            self._enabled_setting,
            spikes.read_window(),
            spikes.read_run(),
            skipped_steps=int(self.skipped_steps()),
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore settings and state from `state_dict` output (polyamp's or torch's GradScaler's).

        Everything is validated first; on any error the scaler is unchanged. `skipped_steps` goes on from the
        dict's count (from 0 for a GradScaler dict, which has none). A disabled scaler (``enabled=False``) loads
        its own state dicts (settings, scale and spike window kept for when it is enabled again) and takes
        ``{}``, what ``torch.amp.GradScaler(enabled=False).state_dict()`` gives, as nothing to restore, as
        GradScaler does.

        Raises:
            StateDictError: (a ``ValueError``) the dict is malformed, inconsistent, or from a disabled scaler
                while this one is not disabled.
            ScalerUsageError: an iteration is in progress (after a step or unscale, before update).
        """
        disabled = self._enabled_setting is False
        if disabled and is_disabled_torch_state(state_dict):
            self._refuse_mid_iteration("load_state_dict() was called")
            return
        rule = self._spikes.rule
        config, state, window, run, skipped = parse_scaler_state(
            state_dict, self._config, loader_disabled=disabled, window=None if rule is None else rule.window
        )
        self._refuse_mid_iteration("load_state_dict() was called")
        with self._history.lock:  # a reader in another thread sees the old state and records, or the new
            self.records()  # the records so far belong to the state being replaced
            counted = 0 if self._device is None else int(self._device.skipped_steps())
            self._skipped_before = skipped - counted
            if self._device is not None:
                self._device.write_state(config, state)
            self._config = config
            self._host_state = state
            self._history.follow(config)
            self._history.recorder.reanchor(state)
        self._spikes.write_window(window, run)

    def _refuse_mid_iteration(self, what: str) -> None:
        if any(iteration.is_open for iteration in self._iterations.values()):
            raise ScalerUsageError(
                f"{what} in the middle of an iteration (after step() or unscale, before update()): the "
                "overflow checks already made would be lost. Do it between iterations: before the first step() "
                "or after update()."
            )

    def _change_setting(self, name: str, value: Any) -> None:
        config = self._config.replace(**{name: value})
        with self._history.lock:  # the records so far are replayed under the rule they ran with
            self.records()
            if self._device is not None:
                self._device.write_state(config, None)
            self._config = config
            self._history.follow(config)

    def functional(
        self, backend: str | None = None, *, make_device: Callable[[LossScaleConfig], Any] | None = None
    ) -> FunctionalLossScaler:
        """This scaler's settings as pure functions of a state, for jitted steps (see `FunctionalLossScaler`).

        Whether the functions scale is decided now (``enabled``, or the policy in effect); the guard, the
        record history and the spike rule follow this scaler's ``guard``, ``history``, ``spike`` and
        ``on_min_scale``. The functional state starts from the settings' initial state (`FunctionalLossScaler.init`;
        ``load_state_dict(scaler.state_dict())`` resumes from this scaler's).

        Args:
            backend: The backend whose ``make_functional`` to use; None uses the bound backend.
            make_device: ``make(config)`` giving the functional device form to use instead of the backend's
                (an adapter's, e.g. one that reduces the found-inf flag over a named axis); ``backend`` then
                only names it in messages.

        Raises:
            PolyampTypeError: no backend given and none bound, the backend has no functional form, or its
                functional form cannot guard (``guard=True`` on a scaler that does not scale) or apply ``spike``.
        """
        name = backend or self._backend_name
        if name is None:
            raise PolyampTypeError("functional() needs a backend: bind the scaler first or pass backend='...'.")
        if make_device is None:
            backend_object = registry.get_backend(name)
            if not isinstance(backend_object, FunctionalBackend):
                raise PolyampTypeError(f"The {name!r} backend offers no functional (stateless) form.")
            make_device = backend_object.make_functional
        recorder = self._history.recorder
        return FunctionalLossScaler(
            make_device,
            self._config,
            self.enabled,
            setting=self._enabled_setting,
            guard=self._guard_setting,
            history=recorder.capacity,
            spike=self._spikes.rule,
            on_min_scale=recorder.on_min_scale,
            backend=name,
        )

    def _options(self) -> dict[str, Any]:
        """The constructor options this scaler keeps (`polyamp._src.persistence.PICKLED_OPTIONS`)."""
        recorder = self._history.recorder
        return {
            "enabled": self._enabled_setting,
            "guard": self._guard_setting,
            "spike": self._spikes.rule,
            "on_min_scale": recorder.on_min_scale,
            "history": recorder.capacity,
            "skip_on_device": self._skip_on_device,
        }

    def _saved_state(self) -> dict[str, Any]:
        """What a pickle holds besides the options: settings, state, backend and spike window."""
        if self._process_group is not None:
            raise ScalerUsageError(
                "A LossScaler with a process_group cannot be pickled or copied: the group belongs to this process. "
                "Save scaler.state_dict() and load it into a scaler constructed with the group."
            )
        return {
            "config": self._config,
            "state": self.get_state(),
            "backend": self._backend_name,
            "spike_window": self._spikes.read_window(),
            "spike_run": self._spikes.read_run(),
            "skipped_steps": int(self.skipped_steps()),
        }

    def _restore(self, saved: dict[str, Any], options: dict[str, Any]) -> None:
        """Become the scaler a pickle describes (`_saved_state` and `_options`), bound again if it was."""
        self._setup(
            saved["config"],
            saved["state"],
            process_group=None,
            spike_window=saved.get("spike_window"),
            spike_run=saved.get("spike_run", 0),
            skipped_steps=saved.get("skipped_steps", 0),
            **options,
        )
        if saved["backend"] is not None:
            self.bind(saved["backend"])
