"""How a `polyamp.LossScaler` describes itself: its signature, and what a pickle or copy of it holds.

Both are derived from one place each rather than restated: the signature from the constructor's own
(``*positional`` and ``**settings`` expanded into the loss-scaling settings they stand for), the pickle from
`PICKLED_OPTIONS` (the constructor options a scaler keeps, whose defaults for older pickles are the
constructor's), a subclass's ``_pickled_attributes``, and the scaler's settings, state, backend and spike window.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Final

from polyamp._src.scaling import NOT_GIVEN, LossScaleConfig

__all__ = ["PICKLED_OPTIONS", "Pickled", "derive_signature"]

#: The constructor options a scaler keeps, by the keyword that passes them (besides the settings, which its
#: ``config`` holds). A pickle holds each under this name; unpickling passes them back to the same setup.
PICKLED_OPTIONS: Final = ("enabled", "guard", "spike", "on_min_scale", "history", "skip_on_device")


def derive_signature(cls: type, init: Any) -> inspect.Signature:
    """The signature `help()` and IDEs show for ``cls``: its positional settings (``cls._positional_arguments``,
    e.g. torch's ``device, init_scale, ...``), every other loss-scaling setting by keyword with its default, then
    the keyword-only options of ``init`` (the constructor) in their order."""
    defaults = LossScaleConfig.defaults()
    positional_names: tuple[str, ...] = cls._positional_arguments  # type: ignore[attr-defined]
    default_enabled = cls._default_enabled  # type: ignore[attr-defined]
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


def option_defaults(init: Any) -> dict[str, Any]:
    """The constructor's defaults of `PICKLED_OPTIONS` (``enabled`` not given: None, follow the policy)."""
    parameters = inspect.signature(init).parameters
    defaults = {name: parameters[name].default for name in PICKLED_OPTIONS}
    if defaults["enabled"] is NOT_GIVEN:
        defaults["enabled"] = None
    return defaults


class Pickled:
    """Pickling and copying a scaler between iterations (`copy.deepcopy` and `pickle` alike).

    A pickle holds each of `PICKLED_OPTIONS`, each of the class's ``_pickled_attributes`` (a subclass's own
    options, kept as attributes) and what ``_saved_state`` gives; unpickling hands them to ``_restore``. A
    pickle written before an option existed gets the constructor's default for it.
    """

    #: A subclass's own constructor options (popped in ``_take_options`` and kept as attributes of these names)
    #: that a pickle or copy carries, e.g. ``polyamp_torch.TorchLossScaler``'s ``device``.
    _pickled_attributes: ClassVar[tuple[str, ...]] = ()

    def _refuse_mid_iteration(self, what: str) -> None:
        raise NotImplementedError

    def _options(self) -> dict[str, Any]:
        raise NotImplementedError

    def _saved_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _restore(self, saved: dict[str, Any], options: dict[str, Any]) -> None:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        self._refuse_mid_iteration("A LossScaler can be pickled or copied only between iterations; it was copied")
        saved = self._saved_state()
        saved.update((name, getattr(self, name)) for name in type(self)._pickled_attributes)
        options = self._options()
        saved.update((name, options[name]) for name in PICKLED_OPTIONS)
        return saved

    def __setstate__(self, saved: dict[str, Any]) -> None:
        defaults = option_defaults(type(self).__init__)
        options = {name: saved.get(name, defaults[name]) for name in PICKLED_OPTIONS}
        for name in type(self)._pickled_attributes:
            setattr(self, name, saved.get(name))
        self._restore(saved, options)
