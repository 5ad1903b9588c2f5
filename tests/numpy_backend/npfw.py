"""npfw: a tiny NumPy "framework" for polyamp's test suite: tensors with one-step autodiff, SGD and Adam.

It stands in for a framework polyamp knows nothing about; ``polyamp_npfw`` is its polyamp backend,
written only against ``polyamp`` and ``polyamp.backend_api``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class Tensor:
    """A scalar loss that knows how to backpropagate ``upstream * d(loss)/d(params)`` into its parameters."""

    def __init__(self, value: float, backward_fn: Callable[[float], None] | None = None) -> None:
        self.value = float(value)
        self._backward_fn = backward_fn

    def __mul__(self, factor: Any) -> Tensor:
        factor = float(factor)
        inner = self._backward_fn
        return Tensor(self.value * factor, None if inner is None else (lambda upstream: inner(upstream * factor)))

    def backward(self) -> None:
        if self._backward_fn is None:
            raise RuntimeError("this tensor does not require gradients")
        self._backward_fn(1.0)


class Parameter:
    """A float32 array with an accumulated gradient (None until a backward pass reaches it)."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = np.array(data, dtype=np.float32)
        self.grad: np.ndarray | None = None


class Optimizer:
    """Base: owns a list of parameters and per-parameter state arrays."""

    def __init__(self, params: Sequence[Parameter]) -> None:
        self.params = list(params)
        self.state: list[dict[str, np.ndarray]] = [{} for _ in self.params]
        self.steps = 0

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def step(self) -> None:
        self.steps += 1
        for param, state in zip(self.params, self.state, strict=True):
            if param.grad is not None:
                self._update(param, state)

    def _update(self, param: Parameter, state: dict[str, np.ndarray]) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    def __init__(self, params: Sequence[Parameter], lr: float, momentum: float = 0.0) -> None:
        super().__init__(params)
        self.lr, self.momentum = np.float32(lr), np.float32(momentum)

    def _update(self, param: Parameter, state: dict[str, np.ndarray]) -> None:
        assert param.grad is not None
        buffer = state.get("momentum_buffer")
        buffer = param.grad.copy() if buffer is None else self.momentum * buffer + param.grad
        state["momentum_buffer"] = buffer.astype(np.float32)
        param.data = (param.data - self.lr * buffer).astype(np.float32)


class Adam(Optimizer):
    def __init__(self, params: Sequence[Parameter], lr: float) -> None:
        super().__init__(params)
        self.lr = np.float32(lr)

    def _update(self, param: Parameter, state: dict[str, np.ndarray]) -> None:
        assert param.grad is not None
        step = state.get("step", np.zeros((), np.float32)) + np.float32(1)
        m = state.get("exp_avg", np.zeros_like(param.data)) * np.float32(0.9) + np.float32(0.1) * param.grad
        v = state.get("exp_avg_sq", np.zeros_like(param.data)) * np.float32(0.999) + np.float32(0.001) * param.grad**2
        state.update(step=step, exp_avg=m.astype(np.float32), exp_avg_sq=v.astype(np.float32))
        m_hat = m / (1 - np.float32(0.9) ** step)
        v_hat = v / (1 - np.float32(0.999) ** step)
        param.data = (param.data - self.lr * m_hat / (np.sqrt(v_hat) + np.float32(1e-8))).astype(np.float32)


def mlp(seed: int) -> list[Parameter]:
    """An 8-16-4 ReLU network's parameters: w1, b1, w2, b2."""
    rng = np.random.default_rng(seed)
    return [
        Parameter(rng.normal(scale=0.35, size=(8, 16))),
        Parameter(np.zeros(16)),
        Parameter(rng.normal(scale=0.25, size=(16, 4))),
        Parameter(np.zeros(4)),
    ]


def loss_and_grads(arrays: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """Mean cross-entropy of the network on (x, y) and its gradients, in float32."""
    w1, b1, w2, b2 = arrays
    hidden = x @ w1 + b1
    active = np.maximum(hidden, 0)
    logits = active @ w2 + b2
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    loss = float(-np.log(probs[np.arange(len(y)), y]).mean())
    dlogits = probs.copy()
    dlogits[np.arange(len(y)), y] -= 1
    dlogits /= len(y)
    dw2 = active.T @ dlogits
    dactive = dlogits @ w2.T
    dhidden = dactive * (hidden > 0)
    grads = [x.T @ dhidden, dhidden.sum(axis=0), dw2, dlogits.sum(axis=0)]
    return loss, [g.astype(np.float32) for g in grads]


def loss(params: Sequence[Parameter], x: np.ndarray, y: np.ndarray) -> Tensor:
    """The loss as a `Tensor` whose ``backward()`` accumulates gradients into ``params``."""
    value, grads = loss_and_grads([p.data for p in params], x, y)

    def backward(upstream: float) -> None:
        for param, grad in zip(params, grads, strict=True):
            scaled = (grad * np.float32(upstream)).astype(np.float32)
            param.grad = scaled if param.grad is None else param.grad + scaled

    return Tensor(value, backward)
