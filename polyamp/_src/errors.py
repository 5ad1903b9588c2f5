"""The exceptions polyamp raises, and the helpers that word them.

Every error polyamp raises derives from :class:`PolyampError`, and also from the built-in exception a
Python user would expect (``ValueError`` for a bad value, ``TypeError`` for a wrong type, ...), so code
that already catches the built-ins keeps working. Messages say what was received, what is allowed and how
to fix it; `describe` renders the received value the same way everywhere.
"""

from __future__ import annotations

__all__ = [
    "BackendConflictError",
    "BackendMismatchError",
    "BackendNotInstalledError",
    "CheckpointError",
    "InvalidConfigError",
    "InvalidPolicyError",
    "PolyampError",
    "PolyampTypeError",
    "PolyampValueError",
    "ScalerUsageError",
    "StateDictError",
    "UnknownBackendError",
    "describe",
    "type_error",
]


class PolyampError(Exception):
    """Base class of every exception polyamp raises."""


class PolyampValueError(PolyampError, ValueError):
    """An argument of the right type but an unusable value (e.g. an unsupported ``device_type``)."""


class InvalidPolicyError(PolyampValueError):
    """A precision policy spec or dtype name that polyamp cannot parse."""


class InvalidConfigError(PolyampValueError):
    """A loss-scaler setting outside its allowed range (e.g. ``growth_factor <= 1``)."""


class StateDictError(InvalidConfigError):
    """A loss-scaler state dict that is malformed or inconsistent; the scaler is left unchanged."""


class CheckpointError(PolyampValueError):
    """A checkpoint file that cannot be read: corrupt, truncated, holding what no reader handles, or declaring
    more bytes than the reading limit allows (``max_bytes`` of `polyamp.check_hazards`)."""


class PolyampTypeError(PolyampError, TypeError):
    """An argument of the wrong type."""


class BackendMismatchError(PolyampTypeError):
    """A scaler bound to one framework was handed another framework's objects."""


class UnknownBackendError(PolyampValueError):
    """A backend name that is neither first-party nor registered."""


class BackendConflictError(PolyampValueError):
    """A backend registered under a name that another backend already has."""


class BackendNotInstalledError(PolyampError, ImportError):
    """The framework a backend needs is not installed; the message says what to ``pip install``."""


class ScalerUsageError(PolyampError, RuntimeError):
    """A loss-scaler method called out of order (e.g. ``unscale_`` twice before ``update``)."""


def describe(value: object) -> str:
    """Render a received value for an error message: its repr (shortened) and its type.

    >>> describe(3.0)
    '3.0 (of type float)'
    """
    try:
        text = repr(value)
    except Exception:  # a value whose repr fails must not hide the error being reported
        text = f"<{type(value).__name__} object>"
    if len(text) > 120:
        text = text[:117] + "..."
    cls = type(value)
    qualname = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return f"{text} (of type {qualname})"


def type_error(what: str, expected: str, received: object, *, fix: str = "") -> PolyampTypeError:
    """The standard wrong-type error: "`what` takes/must be `expected`. Received: ... (of type ...)."

    >>> str(type_error("`enabled`", "None or a bool", "yes"))
    "`enabled` must be None or a bool. Received: 'yes' (of type str)."
    """
    verb = "must be" if what.startswith("`") else "takes"
    tail = f" {fix}" if fix else ""
    return PolyampTypeError(f"{what} {verb} {expected}. Received: {describe(received)}.{tail}")
