"""`polyamp.SpikeRule` on Keras variables: the window of accepted statistics, the decision, the statistics.

Keras ops only, so the same code runs on every Keras backend, eagerly, in ``tf.function`` and under
``jax.jit`` (inside Keras's ``StatelessScope``). The rule is `polyamp.SpikeRule`'s, computed in float64 as
polyamp's torch and TensorFlow scalers compute it; on JAX without ``jax_enable_x64`` (JAX's default) in
float32, the only precision JAX computes in there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from polyamp import SpikeRule
from polyamp.backend_api import ring_values
from polyamp_keras._gradients import sparse_values
from polyamp_keras._keras import keras
from polyamp_keras._rule import counter_dtype

__all__ = ["SpikeWindow", "grad_norm", "loss_statistic", "statistic_dtype"]

ops = keras.ops


def statistic_dtype() -> str:
    """float64, or float32 on JAX without ``jax_enable_x64``."""
    if keras.backend.backend() == "jax" and not sys.modules["jax"].config.jax_enable_x64:
        return "float32"
    return "float64"


def loss_statistic(loss: Any) -> Any:
    """The loss (a list of losses: their sum) as a scalar of `statistic_dtype`, without gradient."""
    dtype = statistic_dtype()
    values = loss if isinstance(loss, (list, tuple)) else [loss]
    return ops.sum(ops.stack([ops.sum(ops.cast(ops.stop_gradient(v), dtype)) for v in values]))


def grad_norm(grads: Sequence[Any], scale: Any = None) -> Any:
    """The global L2 norm of the gradients (a sparse gradient's stored values) in `statistic_dtype`, divided by
    ``scale`` (None: they are unscaled already)."""
    dtype = statistic_dtype()
    squares = [ops.sum(ops.square(ops.cast(sparse_values(g), dtype))) for g in grads if g is not None]
    norm = ops.sqrt(ops.sum(ops.stack(squares))) if squares else ops.convert_to_tensor(0.0, dtype)
    return norm if scale is None else ops.divide(norm, ops.cast(scale, dtype))


class SpikeWindow:
    """The rule's window (a ring of the last ``rule.window`` accepted statistics, their count and ``run``, the
    spikes since one was accepted) as variables made by ``add_variable`` (Keras's ``Optimizer.add_variable``
    signature)."""

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

    def is_spike(self, x: Any) -> Any:
        """The rule's decision for ``x`` (a boolean scalar), against the window's values."""
        rule = self.rule
        count = ops.convert_to_tensor(self.count)
        n = ops.minimum(count, ops.cast(rule.window, count.dtype))
        mask = ops.less(ops.arange(rule.window, dtype=count.dtype), n)
        denominator = ops.cast(ops.maximum(n, ops.cast(1, count.dtype)), self.dtype)
        values = ops.convert_to_tensor(self.ring)
        zero = ops.zeros_like(values)
        mu = ops.divide(ops.sum(ops.where(mask, values, zero)), denominator)
        sigma = ops.sqrt(ops.divide(ops.sum(ops.where(mask, ops.square(ops.subtract(values, mu)), zero)), denominator))
        deviation = ops.subtract(x, mu)
        if rule.two_sided:
            deviation = ops.absolute(deviation)
        checks = [
            ops.greater_equal(n, ops.cast(rule.min_values, count.dtype)),
            ops.greater(sigma, ops.cast(0.0, self.dtype)),
            ops.greater(deviation, ops.multiply(ops.cast(rule.threshold, self.dtype), sigma)),
            ops.isfinite(x),
        ]
        if rule.consecutive_limit is not None:  # a run at the bound: a level shift, accepted
            run = ops.convert_to_tensor(self.run)
            checks.append(ops.less(run, ops.cast(rule.consecutive_limit, run.dtype)))
        return ops.all(ops.stack(checks))

    def push(self, x: Any, applied: Any = None, spiked: Any = None) -> Any:
        """End an iteration as `polyamp.SpikeRule.decide` does: an applied iteration's statistic enters the
        window (unless it is not finite), emptying it first when ``run`` reached the rule's bound, and sets
        ``run`` to 0; a skip by the rule alone (``spiked``) adds 1 to ``run``. ``applied`` and ``spiked``,
        boolean scalars, are decided on the device (None: applied; not a spike).

        Returns:
            A boolean scalar: whether the iteration re-based the window.
        """
        rule = self.rule
        count = ops.convert_to_tensor(self.count)
        run = ops.convert_to_tensor(self.run)
        accept = ops.isfinite(x) if applied is None else ops.logical_and(applied, ops.isfinite(x))
        if rule.consecutive_limit is None:
            rebase = ops.logical_and(accept, ops.convert_to_tensor(False))
        else:
            rebase = ops.logical_and(accept, ops.greater_equal(run, ops.cast(rule.consecutive_limit, run.dtype)))
        count = ops.where(rebase, ops.zeros_like(count), count)
        index = ops.mod(count, ops.cast(rule.window, count.dtype))
        at = ops.logical_and(ops.equal(ops.arange(rule.window, dtype=count.dtype), index), accept)
        self.ring.assign(ops.where(at, ops.cast(x, self.dtype), ops.convert_to_tensor(self.ring)))
        self.count.assign(ops.add(count, ops.cast(accept, count.dtype)))
        bump = run if spiked is None else ops.add(run, ops.cast(spiked, run.dtype))
        self.run.assign(ops.where(accept, ops.zeros_like(run), bump))
        return rebase

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
