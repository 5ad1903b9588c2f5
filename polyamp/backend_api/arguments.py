"""What a caller passed, checked and named as the core checks and names it: the settings' sentinel and docs, the
scaler's arguments, and the errors' wording."""

from polyamp._src.enabling import check_enabled, resolve_enabled
from polyamp._src.errors import BackendConflictError, UnknownBackendError, describe, type_error
from polyamp._src.iteration import NOT_SCALED_RULE, no_gradients_error, not_scaled_error
from polyamp._src.loss_scaler import bind_arguments
from polyamp._src.records import check_guard, check_history, check_on_min_scale
from polyamp._src.registry import wrong_object_error
from polyamp._src.scaling import INT32_MAX, NOT_GIVEN, SETTING_DOCS, LossScaleSettings, NotGiven
from polyamp._src.spikes import check_spike

__all__ = [
    "INT32_MAX",
    "NOT_GIVEN",
    "NOT_SCALED_RULE",
    "SETTING_DOCS",
    "BackendConflictError",
    "LossScaleSettings",
    "NotGiven",
    "UnknownBackendError",
    "bind_arguments",
    "check_enabled",
    "check_guard",
    "check_history",
    "check_on_min_scale",
    "check_spike",
    "describe",
    "no_gradients_error",
    "not_scaled_error",
    "resolve_enabled",
    "type_error",
    "wrong_object_error",
]
