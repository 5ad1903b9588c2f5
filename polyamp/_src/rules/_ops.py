"""`ArrayOps`: the small array vocabulary the device rules are written in.

The rules in `polyamp._src.rules` never name a framework: they call these methods, which an `ArrayOps` maps
onto a namespace whose functions follow the array API standard's names (NumPy 2, ``jax.numpy``, torch and
``keras.ops`` spell almost all of them alike). A backend subclasses it only where its framework spells a
function differently or has a fused kernel for one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["ArrayOps"]


class ArrayOps:
    """The operations the device rules use, over the namespace ``xp``.

    Args:
        xp: A namespace with the array API standard's function names: ``numpy`` (2.0 or newer),
            ``jax.numpy``, ``torch`` (whose ``astype`` and ``asarray`` the torch backend overrides) or an
            adapter such as polyamp_keras's over ``keras.ops``.

    A dtype is named by a string (``"float32"``) or given as an array's own ``dtype``; `dtype` turns either
    into the namespace's dtype.
    """

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    # -- dtypes and conversions ------------------------------------------------------------------------

    def dtype(self, spec: Any) -> Any:
        """The namespace's dtype for ``spec``: a name (``"int32"``) or an array's ``dtype``."""
        return getattr(self.xp, spec) if isinstance(spec, str) else spec

    def asarray(self, value: Any, dtype: Any) -> Any:
        """``value`` (a Python number or list) as an array of ``dtype``."""
        return self.xp.asarray(value, dtype=self.dtype(dtype))

    def astype(self, x: Any, dtype: Any) -> Any:
        """``x`` cast to ``dtype``."""
        return self.xp.astype(x, self.dtype(dtype))

    @property
    def has_float64(self) -> bool:
        """Whether float64 arrays compute in float64 as they are (JAX without ``jax_enable_x64`` computes
        them in float32)."""
        return True

    @property
    def has_int64(self) -> bool:
        """Whether int64 arrays compute in int64 (not on JAX without ``jax_enable_x64``)."""
        return True

    def float64(self) -> AbstractContextManager[Any] | None:
        """A context in which float64 arrays compute in float64 (JAX's ``enable_x64``), or None where the
        device has no float64 (Apple's MPS)."""
        return contextlib.nullcontext()

    def quiet(self) -> AbstractContextManager[Any]:
        """A context in which overflow and invalid operations give inf and NaN without a warning (NumPy's
        ``errstate``; other namespaces do not warn)."""
        errstate = getattr(self.xp, "errstate", None)
        return errstate(all="ignore") if errstate is not None else contextlib.nullcontext()

    # -- elementwise ------------------------------------------------------------------------------------

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        return self.xp.where(condition, x, y)

    def maximum(self, x: Any, y: Any) -> Any:
        return self.xp.maximum(x, y)

    def minimum(self, x: Any, y: Any) -> Any:
        return self.xp.minimum(x, y)

    def isfinite(self, x: Any) -> Any:
        return self.xp.isfinite(x)

    def isnan(self, x: Any) -> Any:
        return self.xp.isnan(x)

    def abs(self, x: Any) -> Any:
        return self.xp.abs(x)

    def sqrt(self, x: Any) -> Any:
        return self.xp.sqrt(x)

    def square(self, x: Any) -> Any:
        return self.xp.square(x)

    def log2(self, x: Any) -> Any:
        return self.xp.log2(x)

    def exp2(self, x: Any) -> Any:
        """``2 ** x`` elementwise (NumPy's name; the array API spells it ``pow(2, x)``)."""
        return self.xp.exp2(x)

    def floor(self, x: Any) -> Any:
        return self.xp.floor(x)

    def clip(self, x: Any, low: float, high: float) -> Any:
        """``x`` clamped to ``[low, high]`` (NaN stays NaN)."""
        return self.xp.clip(x, low, high)

    def remainder(self, x: Any, y: Any) -> Any:
        return self.xp.remainder(x, y)

    def logical_and(self, x: Any, y: Any) -> Any:
        return self.xp.logical_and(x, y)

    def logical_or(self, x: Any, y: Any) -> Any:
        return self.xp.logical_or(x, y)

    def logical_not(self, x: Any) -> Any:
        return self.xp.logical_not(x)

    def full_like(self, x: Any, value: Any) -> Any:
        """An array shaped and typed like ``x`` holding ``value``."""
        return self.xp.full_like(x, value)

    def zeros_like(self, x: Any) -> Any:
        return self.xp.zeros_like(x)

    # -- reductions and construction ------------------------------------------------------------------

    def sum(self, x: Any) -> Any:
        """The sum of every element of ``x``."""
        return self.xp.sum(x)

    def max(self, x: Any, axis: int | None = None) -> Any:
        """The largest element of ``x``, or along ``axis`` with that axis kept (as size 1)."""
        if axis is None:
            return self.xp.max(x)
        return self.xp.max(x, axis=axis, keepdims=True)

    def reshape(self, x: Any, shape: Sequence[int]) -> Any:
        return self.xp.reshape(x, tuple(shape))

    def concat(self, arrays: Sequence[Any]) -> Any:
        """The arrays joined along their first axis."""
        return self.xp.concat(list(arrays))

    def stack(self, arrays: Sequence[Any], axis: int = 0) -> Any:
        """The arrays joined along a new axis ``axis``."""
        return self.xp.stack(list(arrays), axis=axis)

    def arange_like(self, n: int, like: Any) -> Any:
        """``0, 1, ..., n - 1`` as an array of ``like``'s dtype (and device)."""
        return self.xp.arange(n, dtype=self.dtype(like.dtype))

    def global_norm(self, arrays: Sequence[Any]) -> Any:
        """The L2 norm of all the elements of ``arrays`` (at least one, of one dtype), in their dtype."""
        return self.sqrt(self.sum(self.stack([self.sum(self.square(array)) for array in arrays])))

    def stop_gradient(self, x: Any) -> Any:
        """``x`` without its gradient (the statistics a rule watches are not differentiated)."""
        return x
