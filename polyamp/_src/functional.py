"""`FunctionalLossScaler`: polyamp's loss scaling as pure functions over a state, for jitted steps.

A jitted training step (JAX, Keras's stateless API) cannot call back into Python every step, so the
scaler's state travels with the step as a value: ``state`` in, ``state`` out. The semantics are the same
as `polyamp.LossScaler`'s: gradients are unscaled and checked, a step with a non-finite gradient is skipped
(``apply_if_finite`` keeps the old parameters and optimizer state), and the scale follows the reference
rule of `polyamp.LossScaleConfig`; the backend's `polyamp.backend_api.FunctionalDevice` does the device work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from polyamp._src.backend import Flag, FunctionalDevice
from polyamp._src.errors import InvalidConfigError, PolyampTypeError
from polyamp._src.scaling import LossScaleConfig, LossScaleState, to_float32
from polyamp._src.state_dict import parse_state_dict, to_state_dict

__all__ = ["FunctionalLossScaler"]


class FunctionalLossScaler:
    """Loss scaling as pure functions of a state, from `polyamp.LossScaler.functional`.

    Example (shape of a jitted step; ``grad_fn`` and ``apply`` are the framework's)::

        fn = scaler.functional()
        state = fn.init()

        def train_step(params, opt_state, state, batch):
            grads = grad_fn(lambda p: fn.scale(state, loss_fn(p, batch)))(params)
            grads, found_inf = fn.unscale(state, grads)
            new_params, new_opt_state = apply(grads, params, opt_state)
            params, opt_state = fn.apply_if_finite(found_inf, (new_params, new_opt_state), (params, opt_state))
            return params, opt_state, fn.update(state, found_inf)

    With scaling disabled (``enabled`` decided when `functional` was called) every function passes its
    input through and the flag is None.
    """

    def __init__(
        self, make_device: Callable[[LossScaleConfig], FunctionalDevice], config: LossScaleConfig, enabled: bool
    ) -> None:
        self._make_device = make_device
        self._device = make_device(config)
        self._config = config
        self._enabled = enabled

    @property
    def config(self) -> LossScaleConfig:
        """The settings the state follows."""
        return self._config

    @property
    def enabled(self) -> bool:
        """Whether these functions scale at all."""
        return self._enabled

    @property
    def device(self) -> FunctionalDevice:
        """The backend's device operations."""
        return self._device

    def init(self, state: LossScaleState | None = None) -> Any:
        """A fresh state: the config's initial state, or ``state`` (validated as `load_state_dict` validates a
        state dict's).

        Args:
            state: None, or a `polyamp.LossScaleState` this config can be in (e.g. ``fn.read(old_state)``).

        Returns:
            The backend's state value, to pass to the other functions.

        Raises:
            PolyampTypeError: (a ``TypeError``) ``state`` is not a `polyamp.LossScaleState` of numbers.
            InvalidConfigError: (a ``ValueError``) ``state`` is impossible under this config: a scale that is
                NaN, infinite, zero, negative, subnormal or outside ``[min_scale, max_scale]`` (without
                ``min_scale``, the floor is 1.0), or a counter outside its range.
        """
        if state is None:
            return self._device.init(self._config.initial_state())
        try:
            self._config.check_state(state)
        except (InvalidConfigError, PolyampTypeError) as exc:
            raise type(exc)(
                f"FunctionalLossScaler.init() cannot start from this state: {exc} Pass no state for the config's "
                "initial one, or a state this config reaches (fn.read(state), scaler.get_state())."
            ) from exc
        host = LossScaleState(to_float32(float(state.scale)), int(state.growth_tracker), int(state.hysteresis_left))
        return self._device.init(host)

    def scale(self, state: Any, loss: Any) -> Any:
        """``loss`` times the current scale (``loss`` itself when disabled)."""
        return self._device.scale(state, loss) if self._enabled else loss

    def unscale(self, state: Any, grads: Any) -> tuple[Any, Flag | None]:
        """The gradients divided by the scale, and the flag saying whether one is inf or NaN."""
        if not self._enabled:
            return grads, None
        return self._device.unscale(state, grads)

    def apply_if_finite(self, found_inf: Flag | None, applied: Any, current: Any) -> Any:
        """``applied`` (the values after the optimizer step) unless ``found_inf`` is set, then ``current``:
        a skipped step leaves parameters and optimizer state exactly as they were."""
        if found_inf is None:
            return applied
        return self._device.select(found_inf, current, applied)

    def update(self, state: Any, found_inf: Flag | None) -> Any:
        """The state after one step of the rule (the scale, counters and the count of skipped steps)."""
        if found_inf is None:
            return state
        return self._device.update(state, found_inf)

    def read(self, state: Any) -> LossScaleState:
        """The host view of a state (synchronises)."""
        return self._device.read(state)

    def skipped_steps(self, state: Any) -> Any:
        """How many steps were skipped, as the framework's integer scalar."""
        return self._device.skipped_count(state)

    def state_dict(self, state: Any) -> dict[str, Any]:
        """A state dict interchangeable with `polyamp.LossScaler.state_dict`'s."""
        return to_state_dict(self._config, self.read(state), True)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any:
        """A state from a `polyamp.LossScaler` (or torch GradScaler) state dict; its settings are adopted
        (re-trace jitted steps that captured the old ones).

        Raises:
            StateDictError: the dict is malformed (nothing changes).
        """
        config, host = parse_state_dict(state_dict, self._config)
        if config != self._config:  # the rule's constants live in the device functions: make new ones
            self._device = self._make_device(config)
            self._config = config
        return self._device.init(host)
