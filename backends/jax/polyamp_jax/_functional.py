"""`JaxFunctional`: polyamp's functional device form over JAX arrays.

`polyamp.FunctionalLossScaler` gives it polyamp's semantics; it computes, with ``jax.numpy`` only and no
Python branch on an array's value, so every function runs under ``jax.jit``, ``jax.lax.scan``, ``vmap`` and
``shard_map`` and returns new arrays. Gradients are any pytree (None leaves stay None).

The loss-scale rule, the spike rule and the record codes are polyamp's device rules
(`polyamp.backend_api.rules`) over `JaxOps`, the same as every backend's, so a run resumes across torch,
TensorFlow, Keras and JAX with the same scales. Gradients are unscaled by multiplying with the float32 reciprocal of
the scale, as jmp and torch's kernels do: a float16 or bfloat16 gradient is multiplied in float32 and rounded once to
its dtype. XLA on CPU flushes a subnormal reciprocal to zero, so the scale never grows past `RECIPROCAL_CEILING`
(2**126; the core's `polyamp.LossScaleConfig.with_ceiling`), on every device, so that a run keeps the same
scales wherever it resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from polyamp import LossScaleConfig, LossScaleState, PolyampTypeError, SpikeRule
from polyamp.backend_api import rules
from polyamp.backend_api.records import ring_codes, ring_values
from polyamp.backend_api.rules import RECIPROCAL_CEILING, ArrayOps

__all__ = ["OPS", "JaxFunctional", "JaxOps", "all_finite", "statistic_dtype"]


def _x64() -> bool:
    """Whether JAX computes in 64 bits (``jax_enable_x64``)."""
    return bool(getattr(jax.config, "jax_enable_x64", False))


def statistic_dtype() -> Any:
    """float64 where JAX computes it (``jax_enable_x64``), else float32: the spike rule's statistics."""
    return jnp.float64 if _x64() else jnp.float32


def _counter_dtype() -> Any:
    return jnp.int64 if _x64() else jnp.int32


_COUNTABLE = 2**31  # a leaf with fewer elements has int32 counts that cannot wrap


def all_finite(tree: Any) -> Any:
    """A boolean scalar: no floating leaf of ``tree`` holds inf or NaN."""
    checks = [_finite(leaf) for leaf in jax.tree_util.tree_leaves(tree) if _floating(leaf)]
    if not checks:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(checks))


def _finite(leaf: Any) -> Any:
    """A boolean scalar: the floating array ``leaf`` holds no inf or NaN (its `_non_finite` counts are 0)."""
    if int(np.prod(jnp.shape(leaf))) >= _COUNTABLE:  # counts that could wrap: the plain check
        return jnp.all(jnp.isfinite(leaf))
    return jnp.all(_non_finite(leaf) == 0)


def _non_finite(leaf: Any) -> Any:
    """int32[3]: how many +inf, -inf and NaN values the floating array ``leaf`` holds, in one pass over it (one
    variadic reduction).

    The finite check and the counts of a skipped step's gradients both build this from the same leaf, so XLA
    computes it once for both (it merges the common subexpression): the counts cost no second pass over the
    gradients, and no conditional, whose operands XLA's CPU backend copies. On XLA's CPU backend this pass is
    also faster than ``jnp.all(jnp.isfinite(leaf))``.
    """
    value = jnp.asarray(leaf)
    zero = jnp.int32(0)
    sums = jax.lax.reduce(
        (
            (value == jnp.inf).astype(jnp.int32),
            (value == -jnp.inf).astype(jnp.int32),
            jnp.isnan(value).astype(jnp.int32),
        ),
        (zero, zero, zero),
        lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2]),
        tuple(range(value.ndim)),
    )
    return jnp.stack(sums)


def _floating(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)


class JaxOps(ArrayOps):
    """polyamp's array vocabulary over ``jax.numpy``: float64 only under ``jax_enable_x64``, or inside
    ``jax.enable_x64`` for the rule's products."""

    def __init__(self) -> None:
        super().__init__(jnp)

    @property
    def has_float64(self) -> bool:
        return _x64()

    @property
    def has_int64(self) -> bool:
        return _x64()

    def float64(self) -> AbstractContextManager[Any]:
        return jax.enable_x64(True)  # type: ignore[no-any-return]

    def stop_gradient(self, x: Any) -> Any:
        return jax.lax.stop_gradient(x)

    def exp2(self, x: Any) -> Any:
        """``2 ** x``, exact at integers: XLA's CPU ``exp2`` is ``exp(x * ln 2)``, a unit in the last place
        off at most integers, and the FP8 rules build their power-of-two scales and MX exponents with it."""
        return rules.fp8.exp2_exact(jnp, x)


#: The vocabulary the functional form computes with.
OPS = JaxOps()


def _window(tree: Mapping[str, Any]) -> Any:
    return rules.SpikeWindowArrays(tree["values"], tree["count"], tree["run"])


def _set(flag: Any) -> Any:
    return jnp.asarray(flag) > 0


@jax.tree_util.register_pytree_node_class
class _Names:
    """The gradients' names, carried through ``jax.jit`` as static data of the state (no arrays)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def tree_flatten(self) -> tuple[tuple[()], tuple[str, ...]]:
        return (), self.names

    @classmethod
    def tree_unflatten(cls, names: tuple[str, ...], children: Any) -> _Names:
        return cls(names)

    def __repr__(self) -> str:
        return f"_Names({len(self.names)})"


def _path_name(path: Any) -> str:
    """A gradient's name from its place in the tree: the keys joined by ``/`` (``params/Dense_0/kernel``)."""
    parts = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def non_finite_parameters(params: Any) -> list[tuple[str, int, int, int, int]]:
    """(name, +inf, -inf, NaN, size) of each leaf of ``params``, named by its place in the tree, in one host
    read (asked during a run of skipped steps)."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [_path_name(path) or f"leaf{index}" for index, (path, _) in enumerate(paths)]
    rows = jax.device_get(_counts([leaf for _, leaf in paths])).tolist() if paths else []
    return [(name, *row) for name, row in zip(names, rows, strict=True)]


def _counts(leaves: list[Any]) -> Any:
    """Per leaf, (+inf, -inf, NaN, size) as int32 (None and non-floating leaves: no non-finite values)."""
    rows = []
    for leaf in leaves:
        if leaf is None:
            rows.append(jnp.zeros(4, jnp.int32))
            continue
        size = jnp.asarray(int(np.prod(jnp.shape(leaf))), jnp.int32)
        if not _floating(leaf):
            rows.append(jnp.stack([jnp.int32(0), jnp.int32(0), jnp.int32(0), size]))
            continue
        rows.append(jnp.concatenate([_non_finite(leaf), size[None]]))
    if not rows:
        return jnp.zeros((0, 4), jnp.int32)
    return jnp.stack(rows)


class JaxFunctional:
    """`polyamp.backend_api.FunctionalDevice` over JAX arrays, with records (`FunctionalRecordingDevice`) and
    their run id (``ring_tag``), the guard (`FunctionalGuardingDevice`), the spike rule
    (`FunctionalSpikeDevice`), the counts of non-finite gradients of a skipped step
    (`FunctionalProvenanceDevice`), the scale's ceiling (``rule``) and whether a compiler
    traced the rule (``traced``; both `polyamp.backend_api.OptionalMethods`).

    Trees are dicts of arrays: the scaler ``{"scale", "growth_tracker", "hysteresis_left", "skipped"}``, the
    record ring ``{"codes", "count", "run"}`` (the run id) and the spike window
    ``{"values", "count", "run"}``.

    The scale never grows past `polyamp.backend_api.rules.RECIPROCAL_CEILING` (2**126), the largest scale whose float32
    reciprocal is a normal number, which XLA on CPU does not flush to zero.

    Args:
        config: The settings of the rule.
        axis_name: None, or the named axis of ``pmap``/``shard_map``/``vmap`` whose replicas hold different
            gradients: the found-inf flag is reduced over it with one ``pmax``, so all replicas skip together.
    """

    def __init__(self, config: LossScaleConfig, axis_name: Any = None) -> None:
        self._config = config.with_ceiling(RECIPROCAL_CEILING)
        self._axis_name = axis_name
        self._traced = False

    def traced(self) -> bool:
        """Whether `update` ran under a compiler (``jax.jit``, ``lax.scan``, ...), which then holds this config's
        constants."""
        return self._traced

    @property
    def rule(self) -> LossScaleConfig:
        """The config the rule follows: the one given, with the scale's ceiling `RECIPROCAL_CEILING`
        (`polyamp.backend_api.OptionalMethods`)."""
        return self._config

    # -- FunctionalDevice --------------------------------------------------------------------------------

    def init(self, state: LossScaleState, skipped: int = 0) -> dict[str, Any]:
        return {
            "scale": jnp.asarray(state.scale, jnp.float32),
            "growth_tracker": jnp.asarray(state.growth_tracker, jnp.int32),
            "hysteresis_left": jnp.asarray(state.hysteresis_left, jnp.int32),
            "skipped": jnp.asarray(skipped, _counter_dtype()),
        }

    def read(self, tree: Mapping[str, Any]) -> LossScaleState:
        return LossScaleState(
            float(np.asarray(tree["scale"])),
            int(np.asarray(tree["growth_tracker"])),
            int(np.asarray(tree["hysteresis_left"])),
        )

    def skipped_count(self, tree: Mapping[str, Any]) -> Any:
        return tree["skipped"]

    def scale(self, tree: Mapping[str, Any], loss: Any) -> Any:
        def one(value: Any) -> Any:
            value = jnp.asarray(value)
            # Like torch and Keras, in at least float32: 2**16 is beyond float16's range.
            dtype = jnp.float64 if value.dtype == jnp.float64 else jnp.float32
            return value.astype(dtype) * tree["scale"].astype(dtype)

        if isinstance(loss, (list, tuple)):
            return type(loss)(one(item) for item in loss)
        return one(loss)

    def unscale(self, tree: Mapping[str, Any], grads: Any) -> tuple[Any, Any]:
        inverse = (jnp.float32(1.0) / tree["scale"]).astype(jnp.float32)

        def one(grad: Any) -> Any:
            if not _floating(grad):
                return grad
            # As torch's kernel: a narrower gradient is multiplied in float32 and rounded once to its dtype (the
            # reciprocal in float16 would be rounded, to 0 from a scale of 2**25).
            if jnp.dtype(grad.dtype).itemsize < 4:
                return (grad.astype(jnp.float32) * inverse).astype(grad.dtype)
            return grad * inverse.astype(grad.dtype)

        unscaled = jax.tree_util.tree_map(one, grads)
        return unscaled, self.check(tree, unscaled)

    def update(self, tree: Mapping[str, Any], found_inf: Any) -> dict[str, Any]:
        if isinstance(tree["scale"], jax.core.Tracer):
            self._traced = True
        overflow = _set(found_inf)
        arrays = rules.ScaleArrays(tree["scale"], tree["growth_tracker"], tree["hysteresis_left"])
        new = rules.advance(OPS, self._config, arrays, overflow)
        return {**tree, **new._asdict(), "skipped": tree["skipped"] + overflow.astype(tree["skipped"].dtype)}

    def select(self, found_inf: Any, if_skipped: Any, if_applied: Any) -> Any:
        skip = _set(found_inf)
        return jax.tree_util.tree_map(lambda a, b: jnp.where(skip, a, b), if_skipped, if_applied)

    # -- FunctionalGuardingDevice ------------------------------------------------------------------------

    def check(self, tree: Mapping[str, Any], grads: Any) -> Any:
        flag = jnp.logical_not(all_finite(grads)).astype(jnp.float32)
        if self._axis_name is not None:  # every replica skips when one saw a non-finite gradient
            flag = jax.lax.pmax(flag, self._axis_name)  # type: ignore[no-untyped-call]
        return flag

    def count_skip(self, tree: Mapping[str, Any], flag: Any) -> dict[str, Any]:
        return {**tree, "skipped": tree["skipped"] + _set(flag).astype(tree["skipped"].dtype)}

    # -- FunctionalRecordingDevice -----------------------------------------------------------------------

    def ring_init(self, capacity: int) -> dict[str, Any]:
        return {"codes": jnp.zeros((capacity,), jnp.int32), "count": jnp.zeros((), jnp.int32)}

    def ring_tag(self, ring: Mapping[str, Any], run: int) -> dict[str, Any]:
        return {**ring, "run": jnp.asarray(run, jnp.int32)}

    def ring_run(self, ring: Mapping[str, Any]) -> int | None:
        return int(np.asarray(ring["run"])) if "run" in ring else None

    def ring_write(self, ring: Mapping[str, Any], base: int, flag: Any, spike: Any = None) -> dict[str, Any]:
        code = rules.record_code(OPS, base, None if flag is None else _set(flag), spike)
        codes, count = ring["codes"], ring["count"]
        return {**ring, "codes": codes.at[count % codes.shape[0]].set(code), "count": count + 1}

    def ring_read(self, ring: Mapping[str, Any]) -> tuple[int, list[int]]:
        count = int(np.asarray(ring["count"]))
        return count, ring_codes(count, np.asarray(ring["codes"]).tolist())

    # -- which gradients held inf/NaN (FunctionalProvenanceDevice) -----------------------------------------

    def provenance_init(self, grads: Any) -> dict[str, Any]:
        paths = jax.tree_util.tree_flatten_with_path(grads, is_leaf=lambda leaf: leaf is None)[0]
        names = tuple(_path_name(path) or f"leaf{index}" for index, (path, _) in enumerate(paths))
        return {
            "counts": jnp.zeros((len(names), 4), jnp.int32),
            "at": jnp.asarray(-1, jnp.int32),
            "seen": jnp.asarray(0, jnp.int32),
            "names": _Names(names),
        }

    def provenance_write(self, provenance: Mapping[str, Any], grads: Any, flag: Any) -> dict[str, Any]:
        new = dict(provenance)
        new["seen"] = provenance["seen"] + 1
        if flag is None:
            return new
        leaves = jax.tree_util.tree_leaves(grads, is_leaf=lambda leaf: leaf is None)
        names = provenance["names"].names
        if len(leaves) != len(names):
            raise PolyampTypeError(
                f"FunctionalLossScaler.update(grads=...) received {len(leaves)} gradients, but the state counts "
                f"{len(names)} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): pass the gradients "
                "of the tree init(grads=...) was given."
            )
        skipped = _set(flag)
        # Counted on every step and kept on a skip: the counts are the finite check's own pass (`_non_finite`).
        new["counts"] = jnp.where(skipped, _counts(leaves), provenance["counts"])
        new["at"] = jnp.where(skipped, provenance["seen"], provenance["at"])
        return new

    def provenance_read(self, provenance: Mapping[str, Any]) -> tuple[int, list[tuple[str, int, int, int, int]]]:
        at, counts = jax.device_get((provenance["at"], provenance["counts"]))
        rows = np.asarray(counts).tolist()
        return int(at), [(name, *row) for name, row in zip(provenance["names"].names, rows, strict=True)]

    def provenance_reset(self, provenance: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "counts": jnp.zeros_like(provenance["counts"]),
            "at": jnp.asarray(-1, jnp.int32),
            "seen": jnp.asarray(0, jnp.int32),
            "names": provenance["names"],
        }

    # -- FunctionalSpikeDevice ---------------------------------------------------------------------------

    def window_init(self, rule: SpikeRule) -> dict[str, Any]:
        return {
            "values": jnp.zeros((rule.window,), statistic_dtype()),
            "count": jnp.zeros((), _counter_dtype()),
            "run": jnp.zeros((), _counter_dtype()),
        }

    def spike_statistic(self, loss: Any) -> Any:
        losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
        return rules.loss_statistic(OPS, [jnp.asarray(value) for value in losses])

    def spike_grad_norm(self, grads: Any) -> Any:
        return rules.grad_norm(OPS, [g for g in jax.tree_util.tree_leaves(grads) if _floating(g)])

    def spike_check(self, rule: SpikeRule, window: Mapping[str, Any], x: Any) -> Any:
        x = jnp.asarray(x, window["values"].dtype)
        return rules.is_spike(OPS, rule, _window(window), x).astype(jnp.float32)

    def spike_finish(
        self, rule: SpikeRule, window: Mapping[str, Any], x: Any, spike: Any, overflow: Any
    ) -> tuple[dict[str, Any], Any]:
        x = jnp.asarray(x, window["values"].dtype)
        overflowed = None if overflow is None else _set(overflow)
        new, only, rebase = rules.finish(OPS, rule, _window(window), x, _set(spike), overflowed)
        return new._asdict(), rules.spike_flag(OPS, only, rebase)

    def combine(self, first: Any, second: Any) -> Any:
        return jnp.maximum(first, second)

    def read_window(self, window: Mapping[str, Any]) -> tuple[list[float], int]:
        count = int(np.asarray(window["count"]))
        values = ring_values(count, np.asarray(window["values"]).tolist())
        return [float(v) for v in values], int(np.asarray(window["run"]))

    def write_window(self, window: Mapping[str, Any], values: list[float], run: int) -> dict[str, Any]:
        size = int(window["values"].shape[0])
        kept = list(values)[-size:]
        padded = np.zeros((size,), dtype=np.dtype(window["values"].dtype))
        padded[: len(kept)] = kept
        return {
            "values": jnp.asarray(padded),
            "count": jnp.asarray(len(kept), window["count"].dtype),
            "run": jnp.asarray(run, window["run"].dtype),
        }
