"""Loss-scaler state dicts: plain JSON-serialisable dicts, portable between backends.

The keys are a superset of ``torch.amp.GradScaler.state_dict()``'s, so a polyamp dict loads into a native
GradScaler (which reads its five keys) and a native dict loads into polyamp (keeping the settings torch
does not have). Everything is validated before anything changes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Final

from polyamp._src.errors import InvalidConfigError, PolyampTypeError, StateDictError, describe
from polyamp._src.scaling import LossScaleConfig, LossScaleState, to_float32

__all__ = ["FORMAT_VERSION", "parse_state_dict", "to_state_dict"]

FORMAT_VERSION: Final = 1
_TORCH_KEYS: Final = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_POLYAMP_KEYS: Final = (
    "init_scale",
    "hysteresis",
    "hysteresis_left",
    "min_scale",
    "max_scale",
    "dynamic",
    "enabled",
    "polyamp_format",
)


def to_state_dict(config: LossScaleConfig, state: LossScaleState, enabled: bool) -> dict[str, Any]:
    """The state dict of a scaler: torch's five keys plus polyamp's settings, all plain Python values."""
    return {
        "scale": float(state.scale),
        "growth_factor": config.growth_factor,
        "backoff_factor": config.backoff_factor,
        "growth_interval": config.growth_interval,
        "_growth_tracker": int(state.growth_tracker),
        "init_scale": config.init_scale,
        "hysteresis": config.hysteresis,
        "hysteresis_left": int(state.hysteresis_left),
        "min_scale": config.min_scale,
        "max_scale": config.max_scale,
        "dynamic": config.dynamic,
        "enabled": enabled,
        "polyamp_format": FORMAT_VERSION,
    }


def _fail(reason: str) -> StateDictError:
    return StateDictError(f"Cannot load this loss-scaler state dict: {reason} The scaler was left unchanged.")


def parse_state_dict(state_dict: Mapping[str, Any], current: LossScaleConfig) -> tuple[LossScaleConfig, LossScaleState]:
    """Validate a polyamp or native torch state dict; return the config and state it describes.

    Settings a native torch dict does not carry (hysteresis, bounds, ...) keep their ``current`` values.

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
    unknown = sorted(set(state_dict) - set(_TORCH_KEYS) - set(_POLYAMP_KEYS), key=str)
    if unknown:
        raise _fail(f"unknown keys {unknown}. Known keys: {list(_TORCH_KEYS + _POLYAMP_KEYS)}.")
    missing = [key for key in _TORCH_KEYS if key not in state_dict]
    if missing:
        raise _fail(f"missing keys {missing}; a state dict holds at least {list(_TORCH_KEYS)}.")
    version = state_dict.get("polyamp_format", FORMAT_VERSION)
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise _fail(
            f"polyamp_format={version!r}, but this polyamp reads format {FORMAT_VERSION}. "
            "Upgrade polyamp to read newer checkpoints."
        )
    if "enabled" in state_dict and state_dict["enabled"] is not True:
        if state_dict["enabled"] is False:
            raise _fail(
                "it was saved from a disabled LossScaler, which has no scale to resume. Start with the "
                "fresh scaler instead."
            )
        raise _fail(f"'enabled' must be a bool. Received: {describe(state_dict['enabled'])}.")

    def get(key: str, default: Any) -> Any:
        return state_dict[key] if key in state_dict else default

    try:
        config = LossScaleConfig(
            init_scale=get("init_scale", current.init_scale),
            growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"],
            hysteresis=get("hysteresis", current.hysteresis),
            min_scale=get("min_scale", current.min_scale),
            max_scale=get("max_scale", current.max_scale),
            dynamic=get("dynamic", current.dynamic),
        )
    except (InvalidConfigError, PolyampTypeError) as exc:
        raise _fail(str(exc)) from exc

    scale = state_dict["scale"]
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale)):
        raise _fail(f"'scale' must be a finite number. Received: {describe(scale)}.")
    counters = {}
    for key, default in (("_growth_tracker", 0), ("hysteresis_left", config.hysteresis)):
        value = get(key, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _fail(f"{key!r} must be an int. Received: {describe(value)}.")
        counters[key] = int(value)
    state = LossScaleState(to_float32(float(scale)), counters["_growth_tracker"], counters["hysteresis_left"])
    try:
        config.check_state(state)
    except InvalidConfigError as exc:
        raise _fail(str(exc)) from exc
    return config, state
