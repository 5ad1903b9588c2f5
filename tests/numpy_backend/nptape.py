"""nptape: a tiny NumPy "framework" with TensorFlow's loop style, for polyamp's test suite.

Gradients are values: ``gradient(loss, variables)`` returns them (as ``tf.GradientTape.gradient`` does) and an
optimizer applies them with ``apply(grads, variables)``. It shares npfw's network and arithmetic, so the two
backends train the same model on the same data; ``polyamp_nptape`` is its polyamp backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import npfw
import numpy as np


class Tensor:
    """A scalar loss that knows ``upstream * d(loss)/d(variables)``."""

    def __init__(self, value: float, grad_fn: Callable[[float], list[np.ndarray]] | None = None) -> None:
        self.value = float(value)
        self._grad_fn = grad_fn

    def __mul__(self, factor: Any) -> Tensor:
        factor = float(factor)
        inner = self._grad_fn
        return Tensor(self.value * factor, None if inner is None else (lambda upstream: inner(upstream * factor)))


class Variable:
    """A named float32 array."""

    def __init__(self, name: str, data: np.ndarray) -> None:
        self.name = name
        self.data = np.array(data, dtype=np.float32)


class Optimizer:
    """Base: per-variable state arrays, created on the first apply; ``iterations`` counts applies."""

    def __init__(self) -> None:
        self.state: dict[int, dict[str, np.ndarray]] = {}
        self.iterations = 0

    def apply(self, grads: Sequence[np.ndarray | None], variables: Sequence[Variable]) -> int:
        self.iterations += 1
        for grad, variable in zip(grads, variables, strict=True):
            if grad is not None:
                self._update(variable, np.asarray(grad, dtype=np.float32), self.state.setdefault(id(variable), {}))
        return self.iterations

    def _update(self, variable: Variable, grad: np.ndarray, state: dict[str, np.ndarray]) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    def __init__(self, lr: float, momentum: float = 0.0) -> None:
        super().__init__()
        self.lr, self.momentum = np.float32(lr), np.float32(momentum)

    def _update(self, variable: Variable, grad: np.ndarray, state: dict[str, np.ndarray]) -> None:
        buffer = state.get("momentum")
        buffer = grad.copy() if buffer is None else self.momentum * buffer + grad
        state["momentum"] = buffer.astype(np.float32)
        variable.data = (variable.data - self.lr * buffer).astype(np.float32)


class Adam(Optimizer):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = np.float32(lr)

    def _update(self, variable: Variable, grad: np.ndarray, state: dict[str, np.ndarray]) -> None:
        step = state.get("step", np.zeros((), np.float32)) + np.float32(1)
        m = state.get("m", np.zeros_like(variable.data)) * np.float32(0.9) + np.float32(0.1) * grad
        v = state.get("v", np.zeros_like(variable.data)) * np.float32(0.999) + np.float32(0.001) * grad**2
        state.update(step=step, m=m.astype(np.float32), v=v.astype(np.float32))
        m_hat = m / (1 - np.float32(0.9) ** step)
        v_hat = v / (1 - np.float32(0.999) ** step)
        variable.data = (variable.data - self.lr * m_hat / (np.sqrt(v_hat) + np.float32(1e-8))).astype(np.float32)


def mlp(seed: int) -> list[Variable]:
    """npfw's 8-16-4 network, as named variables: dense_1/kernel, dense_1/bias, dense_2/kernel, dense_2/bias."""
    names = ("dense_1/kernel", "dense_1/bias", "dense_2/kernel", "dense_2/bias")
    return [Variable(name, param.data) for name, param in zip(names, npfw.mlp(seed), strict=True)]


def loss(variables: Sequence[Variable], x: np.ndarray, y: np.ndarray) -> Tensor:
    """The loss as a `Tensor` whose gradients `gradient` returns."""
    value, grads = npfw.loss_and_grads([v.data for v in variables], x, y)
    return Tensor(value, lambda upstream: [(g * np.float32(upstream)).astype(np.float32) for g in grads])


def gradient(target: Tensor, variables: Sequence[Variable]) -> list[np.ndarray]:
    """The gradients of ``target`` with respect to ``variables`` (the ones ``loss`` was computed from)."""
    if target._grad_fn is None:
        raise RuntimeError("this tensor was not computed from variables")
    grads = target._grad_fn(1.0)
    if len(grads) != len(variables):
        raise RuntimeError("gradient() takes the variables the loss was computed from")
    return grads
