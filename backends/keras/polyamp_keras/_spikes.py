"""`polyamp.SpikeRule` on Keras variables: the window of accepted statistics, the decision, the statistics.

polyamp's device rule (`polyamp.backend_api.rules`) over `KerasOps`, so the same code runs on every Keras
backend, eagerly, in ``tf.function`` and under ``jax.jit`` (inside Keras's ``StatelessScope``), in float64
(on JAX without ``jax_enable_x64``, JAX's default, in float32, the only precision JAX computes in there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from polyamp import SpikeRule
from polyamp.backend_api import rules
from polyamp.backend_api.records import ring_values
from polyamp_keras._gradients import sparse_values
from polyamp_keras._keras import keras
from polyamp_keras._rule import OPS, counter_dtype

__all__ = ["SpikeWindow", "grad_norm", "loss_statistic", "statistic_dtype"]

ops = keras.ops
SpikeWindowArrays = rules.SpikeWindowArrays


def statistic_dtype() -> str:
    """float64, or float32 on JAX without ``jax_enable_x64`` (`polyamp.backend_api.rules.statistic_dtype`)."""
    return rules.statistic_dtype(OPS)


def loss_statistic(loss: Any) -> Any:
    """The loss (a list of losses: their sum) as a scalar of `statistic_dtype`, without gradient."""
    return rules.loss_statistic(OPS, loss)


def grad_norm(grads: Sequence[Any], scale: Any = None) -> Any:
    """The global L2 norm of the gradients (a sparse gradient's stored values) in `statistic_dtype`, divided by
    ``scale`` (None: they are unscaled already)."""
    norm = rules.grad_norm(OPS, [None if g is None else sparse_values(g) for g in grads])
    return norm if scale is None else ops.divide(norm, ops.cast(scale, norm.dtype))


class SpikeWindow:
    """The rule's window (`polyamp.backend_api.rules.SpikeWindowArrays`: a ring of the last ``rule.window``
    accepted statistics, their count and ``run``, the spikes since one was accepted) as variables made by
    ``add_variable`` (Keras's ``Optimizer.add_variable`` signature)."""

    def __init__(self, rule: SpikeRule, add_variable: Callable[..., Any]) -> None:
        self.rule = rule
        self.dtype = statistic_dtype()
        zeros = keras.initializers.Zeros()
        self.ring = add_variable(
            shape=(rule.window,), dtype=self.dtype, initializer=zeros, aggregation="none", name="spike_window"
        )
        self.count = add_variable(
            shape=(), dtype=counter_dtype(), initializer=zeros, aggregation="none", name="spike_count"
        )
        self.run = add_variable(
            shape=(), dtype=counter_dtype(), initializer=zeros, aggregation="none", name="spike_run"
        )

    def values(self) -> SpikeWindowArrays:
        """The variables' current values."""
        return SpikeWindowArrays(*(ops.convert_to_tensor(v) for v in (self.ring, self.count, self.run)))

    def is_spike(self, x: Any) -> Any:
        """The rule's decision for ``x`` (a boolean scalar), against the window's values."""
        return rules.is_spike(OPS, self.rule, self.values(), x)

    def finish(self, x: Any, spike: Any, overflow: Any) -> Any:
        """End an iteration (`polyamp.backend_api.rules.finish`); ``spike`` and ``overflow`` are the float32
        flags (``overflow`` None: not checked). Returns the spike rule's flag (1: a skip by the rule alone,
        -1: a re-base)."""
        overflowed = None if overflow is None else ops.greater(overflow, 0)
        new, only, rebase = rules.finish(OPS, self.rule, self.values(), x, ops.greater(spike, 0), overflowed)
        for variable, value in zip((self.ring, self.count, self.run), new, strict=True):
            variable.assign(value)
        return rules.spike_flag(OPS, only, rebase)

    def read(self) -> list[float]:
        """The window's values, oldest first (one host read)."""
        count = int(ops.convert_to_numpy(self.count))
        return [float(v) for v in ring_values(count, ops.convert_to_numpy(self.ring).tolist())]

    def read_run(self) -> int:
        """``run``: the spikes since a statistic last entered the window (one host read)."""
        return int(ops.convert_to_numpy(self.run))

    def write(self, values: list[float], run: int = 0) -> None:
        """Make the window hold ``values`` (oldest first, at most the rule's window) and ``run``."""
        padded = list(values) + [0.0] * (self.rule.window - len(values))
        self.ring.assign(ops.convert_to_tensor(padded, dtype=self.dtype))
        self.count.assign(ops.cast(len(values), self.count.dtype))
        self.run.assign(ops.cast(run, self.run.dtype))
