"""Names that moved out of the top-level ``polyamp`` package: each resolves, for one release, to its new home
with a `DeprecationWarning` that names it."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Final

__all__ = ["MOVED", "moved"]

#: Each name that left ``polyamp``, and the module that holds it now.
MOVED: Final = {
    **dict.fromkeys(
        ("Backend", "BackendSpec", "backend_specs", "get_backend", "register_backend"), "polyamp.backend_api"
    ),
    **dict.fromkeys(
        (
            "DTYPE_NAMES",
            "OP_CLASSES",
            "POLICY_NAMES",
            "PRESET_NAMES",
            "ROUNDINGS",
            "OverridesLike",
            "PolicyLike",
            "PolicyOverrides",
            "PolicySetting",
            "add_policy_listener",
            "get_policy_overrides",
        ),
        "polyamp.backend_api.policies",
    ),
    **dict.fromkeys(("SKIP_REASONS", "SkipReason"), "polyamp.backend_api.records"),
    **dict.fromkeys(("MINIMUM_VERSIONS",), "polyamp.backend_api.versions"),
    **dict.fromkeys(
        ("BackendConflictError", "LossScaleSettings", "UnknownBackendError"), "polyamp.backend_api.arguments"
    ),
    **dict.fromkeys(("MeasuredStateBytes", "StateBytes"), "polyamp.backend_api.training_state"),
}


def moved(package: str, name: str) -> Any:
    """``name`` from its new module, with a warning; an `AttributeError` for a name that never was there."""
    home = MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(
        f"polyamp.{name} moved to {home}.{name} (it serves backends, not training code); import it from there. "
        "polyamp.{name} goes in the next release.".replace("{name}", name),
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(home), name)
