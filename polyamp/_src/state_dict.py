"""Loss-scaler state dicts: plain JSON-serialisable dicts, portable between backends.

The keys are a superset of ``torch.amp.GradScaler.state_dict()``'s, so a polyamp dict loads into a native
GradScaler (which reads its five keys) and a native dict loads into polyamp (keeping the settings torch
does not have). Everything is validated before anything changes.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

from polyamp._src.errors import InvalidConfigError, PolyampTypeError, StateDictError, describe
from polyamp._src.scaling import LossScaleConfig, LossScaleState, to_float32

__all__ = [
    "FORMAT_VERSION",
    "is_disabled_torch_state",
    "parse_skipped_steps",
    "parse_spike_run",
    "parse_spike_window",
    "parse_state_dict",
    "to_state_dict",
]

FORMAT_VERSION: Final = 1
#: What torch.amp.GradScaler.state_dict() holds: its scale and tracker, and three of the settings.
_TORCH_KEYS: Final = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
#: The state (besides the scale and tracker) and the bookkeeping keys; every setting is a key too.
_STATE_KEYS: Final = ("hysteresis_left", "enabled", "polyamp_format", "spike_window", "spike_run", "skipped_steps")


def _known_keys() -> tuple[str, ...]:
    settings = [name for name in LossScaleConfig.setting_names() if name not in _TORCH_KEYS]
    return (*_TORCH_KEYS, *settings, *_STATE_KEYS)


def to_state_dict(
    config: LossScaleConfig,
    state: LossScaleState,
    enabled: bool | None,
    spike_window: list[float] | None = None,
    spike_run: int = 0,
    skipped_steps: int | None = None,
) -> dict[str, Any]:
    """The state dict of a scaler: torch's five keys plus every other setting and polyamp's state, as plain
    Python values. ``enabled`` is the scaler's setting (None: it follows the policy); ``spike_window``, for a
    scaler with a `polyamp.SpikeRule`, the statistics in its window, oldest first, and ``spike_run`` the spikes
    since a statistic last entered it (`polyamp.SpikeRule`'s ``max_consecutive``); ``skipped_steps``, when
    given, the iterations skipped so far (``LossScaler.skipped_steps``), so that a resumed run counts on."""
    settings = config.settings()
    result: dict[str, Any] = {
        "scale": float(state.scale),
        "growth_factor": settings.pop("growth_factor"),
        "backoff_factor": settings.pop("backoff_factor"),
        "growth_interval": settings.pop("growth_interval"),
        "_growth_tracker": int(state.growth_tracker),
    }
    result.update(settings)
    result.update({"hysteresis_left": int(state.hysteresis_left), "enabled": enabled, "polyamp_format": FORMAT_VERSION})
    if spike_window is not None:
        result["spike_window"] = [float(value) for value in spike_window]
        result["spike_run"] = int(spike_run)
    if skipped_steps is not None:
        result["skipped_steps"] = int(skipped_steps)
    return result


def _count(state_dict: Mapping[str, Any], key: str, what: str) -> int:
    value = state_dict.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise _fail(f"'{key}' must be an int >= 0 ({what}). Received: {describe(value)}.")
    return int(value)


def parse_skipped_steps(state_dict: Mapping[str, Any]) -> int:
    """The count of skipped iterations a state dict carries, validated: 0 when it carries none (a
    ``torch.amp.GradScaler`` dict, which counts none, or one written before polyamp saved the count).

    Raises:
        StateDictError: ``skipped_steps`` is not an int >= 0.
    """
    return _count(state_dict, "skipped_steps", "the iterations the scaler skipped")


def parse_spike_run(state_dict: Mapping[str, Any]) -> int:
    """The spike rule's ``run`` a state dict carries, validated: 0 when it carries none (a dict written before
    the rule had ``max_consecutive``).

    Raises:
        StateDictError: ``spike_run`` is not an int >= 0.
    """
    return _count(state_dict, "spike_run", "the spike rule's consecutive spikes")


def parse_spike_window(state_dict: Mapping[str, Any], window: int | None) -> list[float] | None:
    """The spike rule's window a state dict carries, validated (None when it carries none), keeping the newest
    ``window`` values (a loader with a smaller window); ``window`` None: the loader has no spike rule, which
    takes the dict's window as nothing to restore.

    Raises:
        StateDictError: ``spike_window`` is not a list of finite numbers.
    """
    values = state_dict.get("spike_window")
    if values is None:
        return None
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        raise _fail(f"'spike_window' must be a list of finite numbers. Received: {describe(values)}.")
    result = []
    for value in values:
        if not _finite_number(value):
            raise _fail(f"'spike_window' must hold finite numbers. Received an entry {describe(value)}.")
        result.append(float(value))
    if window is None:
        return None
    return result[-window:]


def _finite_number(value: Any) -> bool:
    """A real number (not a bool) whose float is finite (10**400 is not)."""
    try:
        return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(float(value))
    except OverflowError:
        return False


def _fail(reason: str) -> StateDictError:
    return StateDictError(f"Cannot load this loss-scaler state dict: {reason} The scaler was left unchanged.")


def is_disabled_torch_state(state_dict: object) -> bool:
    """Whether ``state_dict`` is what ``torch.amp.GradScaler(enabled=False).state_dict()`` returns: ``{}``."""
    return isinstance(state_dict, Mapping) and len(state_dict) == 0


def parse_state_dict(
    state_dict: Mapping[str, Any], current: LossScaleConfig, *, loader_disabled: bool = False
) -> tuple[LossScaleConfig, LossScaleState]:
    """Validate a polyamp or native torch state dict; return the config and state it describes.

    Settings the dict does not carry (a native torch dict has no hysteresis or bounds) keep their
    ``current`` values. A dict saved from a disabled scaler (``"enabled": False``) loads only into a disabled
    scaler (``loader_disabled``): its own checkpoint round-trips, settings, scale and spike window included,
    while an enabled scaler refuses to resume from it.

    Raises:
        StateDictError: (a ``ValueError``) anything is missing, unknown, of the wrong type or inconsistent.
    """
    if not isinstance(state_dict, Mapping):
        raise PolyampTypeError(
            f"load_state_dict() takes the dict returned by state_dict(). Received: {describe(state_dict)}."
        )
    if len(state_dict) == 0:
        raise _fail(
            "it is empty, as torch.amp.GradScaler(enabled=False).state_dict() is; a disabled scaler has no "
            "scale to resume. Start with the fresh scaler instead."
        )
    known = _known_keys()
    unknown = sorted(set(state_dict) - set(known), key=str)
    if unknown:
        raise _fail(f"unknown keys {unknown}. Known keys: {list(known)}.")
    missing = [key for key in _TORCH_KEYS if key not in state_dict]
    if missing:
        raise _fail(f"missing keys {missing}; a state dict holds at least {list(_TORCH_KEYS)}.")
    version = state_dict.get("polyamp_format", FORMAT_VERSION)
    if type(version) is not int:
        raise _fail(
            f"'polyamp_format' must be an int (this polyamp writes {FORMAT_VERSION}). Received: {describe(version)}."
        )
    if version != FORMAT_VERSION:
        raise _fail(
            f"polyamp_format={version!r}, but this polyamp reads format {FORMAT_VERSION}. "
            "Upgrade polyamp to read newer checkpoints."
        )
    enabled = state_dict.get("enabled", True)
    if enabled is False and not loader_disabled:
        raise _fail(
            "it was saved from a disabled LossScaler (enabled=False), which has no scale to resume. Start this "
            "scaler fresh, or load the dict into a scaler constructed with enabled=False."
        )
    if not (enabled is True or enabled is None or enabled is False):
        raise _fail(f"'enabled' must be True, False or None. Received: {describe(enabled)}.")

    settings = {name: state_dict[name] for name in LossScaleConfig.setting_names() if name in state_dict}
    try:
        config = LossScaleConfig.from_settings(settings, current, caller="load_state_dict()")
    except (InvalidConfigError, PolyampTypeError) as exc:
        raise _fail(str(exc)) from exc

    scale = state_dict["scale"]
    if not _finite_number(scale):
        raise _fail(f"'scale' must be a finite number. Received: {describe(scale)}.")
    counters = {}
    for key, default in (("_growth_tracker", 0), ("hysteresis_left", config.hysteresis)):
        value = state_dict.get(key, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _fail(f"{key!r} must be an int. Received: {describe(value)}.")
        counters[key] = int(value)
    state = LossScaleState(to_float32(float(scale)), counters["_growth_tracker"], counters["hysteresis_left"])
    if "polyamp_format" not in state_dict and 0 <= state.scale < config.floor_f32:
        # A native GradScaler checkpoint from after a long run of overflows: resume at polyamp's floor, saying so.
        warnings.warn(
            f"The state dict's scale, {state.scale!r}, is below the lowest scale polyamp uses, "
            f"{config.floor_f32!r} (min_scale, or 1.0 without one), where 1/scale overflows or unscaled gradients "
            f"can; the scaler resumes at {config.floor_f32!r}. Pass min_scale to go lower.",
            UserWarning,
            stacklevel=3,
        )
        state = LossScaleState(config.floor_f32, state.growth_tracker, state.hysteresis_left)
    try:
        config.check_state(state)
    except InvalidConfigError as exc:
        raise _fail(str(exc)) from exc
    return config, state


class ParsedState(NamedTuple):
    """Everything a scaler's state dict restores, validated (`parse_scaler_state`)."""

    config: LossScaleConfig
    state: LossScaleState
    spike_window: list[float] | None
    spike_run: int
    skipped_steps: int


def parse_scaler_state(
    state_dict: Mapping[str, Any], config: LossScaleConfig, *, loader_disabled: bool, window: int | None
) -> ParsedState:
    """A scaler's whole state dict (`parse_state_dict`, `parse_spike_window` with the loader's spike
    ``window``, `parse_spike_run`, `parse_skipped_steps`), for `LossScaler` and `FunctionalLossScaler`.

    Raises:
        StateDictError: any part is malformed or inconsistent (nothing is restored).
    """
    loaded, state = parse_state_dict(state_dict, config, loader_disabled=loader_disabled)
    return ParsedState(
        loaded,
        state,
        parse_spike_window(state_dict, window),
        parse_spike_run(state_dict),
        parse_skipped_steps(state_dict),
    )
