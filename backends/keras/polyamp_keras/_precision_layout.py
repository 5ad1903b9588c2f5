"""What a `polyamp_keras.PrecisionOptimizer` keeps per trainable variable (its layout), and the dtype helpers
its parts share."""

from __future__ import annotations

from typing import Any

import numpy as np

from polyamp_keras._keras import keras

__all__: list[str] = []

_LOW = ("bfloat16", "float16")


def _dtype(variable: Any) -> str:
    return str(keras.backend.standardize_dtype(variable.dtype))


def _inner_name(inner: Any) -> str:
    return type(inner).__name__


class _Entry:
    """What the optimizer keeps for one trainable variable (a plain object: neither tracked nor saved by
    Keras; the variables it names are the optimizer's own)."""

    __slots__ = ("compensation", "dtype", "key", "master", "slot_keys", "slots", "variable")

    def __init__(self, variable: Any, key: Any) -> None:
        self.variable = variable
        self.key = key
        self.dtype = _dtype(variable)
        self.slot_keys: list[Any] = []
        self.slots: list[Any] = []
        self.master: Any = None
        self.compensation: Any = None


class _Layout:
    """The optimizer's state, per variable, and whether it passes straight through to the inner optimizer."""

    __slots__ = ("entries", "pass_through")

    def __init__(self, entries: list[_Entry], pass_through: bool) -> None:
        self.entries = entries
        self.pass_through = pass_through

    def slots(self) -> list[Any]:
        return [slot for entry in self.entries for slot in entry.slots]

    def masters(self) -> list[Any]:
        return [entry.master for entry in self.entries if entry.master is not None]

    def compensations(self) -> list[Any]:
        return [entry.compensation for entry in self.entries if entry.compensation is not None]


def _numpy_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        import ml_dtypes  # Keras's own dependency for bfloat16 arrays

        return ml_dtypes.bfloat16
    return np.dtype(dtype)
