"""The exceptions polyamp raises.

Every error polyamp raises derives from :class:`PolyampError`, and also from the built-in exception a
Python user would expect (``ValueError`` for a bad value, ``TypeError`` for a wrong type, ...), so code
that already catches the built-ins keeps working.
"""

from __future__ import annotations

__all__ = [
    "BackendMismatchError",
    "BackendNotInstalledError",
    "InvalidConfigError",
    "InvalidPolicyError",
    "PolyampError",
    "PolyampTypeError",
    "ScalerUsageError",
    "StateDictError",
    "UnknownBackendError",
    "describe",
]


class PolyampError(Exception):
    """Base class of every exception polyamp raises."""


class InvalidPolicyError(PolyampError, ValueError):
    """A precision policy spec or dtype name that polyamp cannot parse."""


class InvalidConfigError(PolyampError, ValueError):
    """A loss-scaler setting outside its allowed range (e.g. ``growth_factor <= 1``)."""


class StateDictError(InvalidConfigError):
    """A loss-scaler state dict that is malformed or inconsistent; the scaler is left unchanged."""


class PolyampTypeError(PolyampError, TypeError):
    """An argument of the wrong type."""


class BackendMismatchError(PolyampTypeError):
    """A scaler bound to one framework was handed another framework's objects."""


class UnknownBackendError(PolyampError, ValueError):
    """A backend name that is neither first-party nor registered."""


class BackendNotInstalledError(PolyampError, ImportError):
    """The framework a backend needs is not installed; the message says what to ``pip install``."""


class ScalerUsageError(PolyampError, RuntimeError):
    """A loss-scaler method called out of order (e.g. ``unscale_`` twice before ``update``)."""


def describe(value: object) -> str:
    """Render a received value for an error message: its repr (shortened) and its type."""
    text = repr(value)
    if len(text) > 120:
        text = text[:117] + "..."
    cls = type(value)
    qualname = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return f"{text} (of type {qualname})"
