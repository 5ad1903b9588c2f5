"""How a `polyamp.LossScaler` describes itself: its signature, and what a pickle or copy of it holds.

Both are derived from one place each rather than restated: the signature from the constructor's own
(``*positional`` and ``**settings`` expanded into the loss-scaling settings they stand for), the pickle from
`PICKLED_OPTIONS` (the constructor options a scaler keeps) plus its state, its backend and its spike window.
"""

from __future__ import annotations

import inspect
from typing import Any, Final

from polyamp._src.scaling import LossScaleConfig

__all__ = ["PICKLED_OPTIONS", "derive_signature"]

#: The constructor options a scaler keeps, by the keyword that passes them (besides the settings, which its
#: ``config`` holds). A pickle holds each under this name; unpickling passes them back to the same setup.
PICKLED_OPTIONS: Final = ("enabled", "guard", "spike", "on_min_scale", "history")


def derive_signature(cls: type, init: Any) -> inspect.Signature:
    """The signature `help()` and IDEs show for ``cls``: its positional settings (``cls.positional_arguments``,
    e.g. torch's ``device, init_scale, ...``), every other loss-scaling setting by keyword with its default, then
    the keyword-only options of ``init`` (the constructor) in their order."""
    defaults = LossScaleConfig.defaults()
    positional_names: tuple[str, ...] = cls.positional_arguments  # type: ignore[attr-defined]
    default_enabled = cls.default_enabled  # type: ignore[attr-defined]
    own = inspect.signature(init).parameters
    parameters = []
    for name in positional_names:
        if name == "enabled":
            default = default_enabled
        else:
            default = defaults.get(name, None)
        parameters.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    for name, default in defaults.items():
        if name not in positional_names:
            parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))
    for name, parameter in own.items():
        if parameter.kind is not inspect.Parameter.KEYWORD_ONLY or name in positional_names:
            continue
        default = default_enabled if name == "enabled" else parameter.default
        parameters.append(parameter.replace(default=default, annotation=inspect.Parameter.empty))
    return inspect.Signature(parameters)
