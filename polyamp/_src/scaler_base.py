"""What every part of `polyamp.LossScaler` shares: the attributes `LossScaler._setup` gives a scaler, and the
few helpers more than one part uses. The parts (binding and the iteration's start, the two loop styles, the
end of an iteration, the outcomes, the state) are mixins that `polyamp._src.loss_scaler` joins into one class.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, ClassVar, Final

from polyamp._src.errors import InvalidConfigError, describe

if TYPE_CHECKING:
    from polyamp._src.binding import DeviceCapabilities
    from polyamp._src.iteration import Iteration
    from polyamp._src.scaling import LossScaleConfig, LossScaleState
    from polyamp._src.spike_driver import SpikeDriver
    from polyamp._src.step_history import RecordHistory, StepOutcomes

__all__ = ["STYLE_METHODS", "ScalerBase", "check_norm_bound"]

#: The loop methods of each style, in the order error messages list them.
STYLE_METHODS: Final = {
    "imperative": ("scale", "unscale_", "step", "update", "step_skipped", "skipped_steps"),
    "tape": ("scale", "unscale", "apply_gradients", "step", "update", "step_skipped", "skipped_steps"),
}


def check_norm_bound(name: str, value: object) -> None:
    """A clipping norm bound: a real number > 0 (``inf`` clips nothing), a NumPy scalar too."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise InvalidConfigError(f"`{name}` must be a number > 0. Received: {describe(value)}.")


class ScalerBase:
    """The state of a loss scaler that its parts read and write (set by ``LossScaler._setup``)."""

    _positional_arguments: ClassVar[tuple[str, ...]]
    _default_enabled: ClassVar[bool | None]
    _bound_backend: ClassVar[str | None]

    _process_group: Any
    _skipped_before: int
    _config: LossScaleConfig
    _enabled_setting: bool | None
    _guard_setting: bool | None
    _skip_on_device: bool
    _spikes: SpikeDriver
    _host_state: LossScaleState
    _history: RecordHistory
    _outcomes: StepOutcomes
    _device: Any
    _capabilities: DeviceCapabilities | None
    _compiling: Any
    _replica: Any
    _own_types: dict[type, bool]
    _float16_probes: int
    _group_iterations: int
    _backend_name: str | None
    _warned_unscaled_loss: bool
    _adapter_device: bool
    _iterations: dict[Any, Iteration]
    _only_iteration: Iteration | None
    _checked_optimizers: dict[str, Any]
    _device_step: Any

    if TYPE_CHECKING:  # the other parts' methods, joined in LossScaler

        def __getattr__(self, name: str) -> Any: ...
