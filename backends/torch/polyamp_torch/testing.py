"""polyamp's conformance harness for PyTorch (see `polyamp.conformance`).

``python -m polyamp.conformance --backend torch --device cuda`` runs the suite through it.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

import polyamp
from polyamp import LossScaler, Policy
from polyamp.conformance import HarnessUnavailable
from polyamp_torch._autocast import autocast
from polyamp_torch._framework import torch
from polyamp_torch._modules import apply_policy
from polyamp_torch._precision import PrecisionOptimizer

__all__ = ["TorchHarness"]

F = torch.nn.functional


def _mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _state_array(value: object) -> np.ndarray:
    """A state value as NumPy: bfloat16 tensors (moments, compensation) as float32, exactly, NumPy having no
    bfloat16."""
    tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    if tensor.dtype is torch.bfloat16:
        tensor = tensor.float()
    return tensor.detach().cpu().numpy().copy()


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class _TorchTrainer:
    def __init__(
        self,
        device: str,
        policy: Policy,
        scaler: Mapping[str, Any] | None,
        optimizer: str,
        clip: float | None,
        seed: int,
    ) -> None:
        self.device = device
        self.policy = policy
        self.clip = clip
        torch.manual_seed(seed)
        self.model = apply_policy(_mlp().to(device), policy, device_type=device)
        params = list(self.model.named_parameters())  # torch keeps the names (param_names) for the records
        #: The parameter ``step(overflow=True)`` plants an inf in (its first gradient element).
        self.planted = params[0][0]
        if optimizer == "sgd":
            self.opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        elif optimizer == "adam":
            self.opt = torch.optim.Adam(params, lr=0.01)
        else:
            raise ValueError(f"unknown optimizer {optimizer!r}; the harness knows 'sgd' and 'adam'")
        if policy.has_training_state_plan:  # the parameters are in the policy's param dtype (apply_policy)
            self.opt = PrecisionOptimizer(self.opt, policy, seed=seed)
        with polyamp.policy_scope(policy):  # enabled=None follows this trainer's policy
            self.scaler: LossScaler | None = None if scaler is None else LossScaler(**scaler, backend="torch")

    def step(self, x: np.ndarray, y: np.ndarray, *, overflow: bool = False) -> float:
        with polyamp.policy_scope(self.policy):  # the program this trainer stands for set this policy
            return self._step(x, y, overflow)

    def _step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        inputs = torch.from_numpy(x).to(self.device)
        targets = torch.from_numpy(y).to(self.device)
        self.opt.zero_grad(set_to_none=True)
        with autocast(self.policy, device_type=self.device):
            loss = F.cross_entropy(self.model(inputs), targets)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if overflow:
            grad = dict(self.model.named_parameters())[self.planted].grad
            assert grad is not None, "the planted parameter has a gradient after backward"
            grad.view(-1)[0] = float("inf")
        if self.clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        return float(loss.detach().float().cpu())

    def params(self) -> list[np.ndarray]:
        return [p.detach().float().cpu().numpy().copy() for p in self.model.parameters()]

    def optimizer_state(self) -> list[np.ndarray]:
        """Every state tensor per parameter, by key: the slots and, under a training-state plan, the master copy
        (``polyamp_master``) and compensation buffer (``polyamp_compensation``), each as stored."""
        arrays = []
        for param in self.model.parameters():
            for _, value in sorted(self.opt.state.get(param, {}).items()):
                arrays.append(_state_array(value))
        return arrays

    def step_skipped(self) -> bool:
        return self.scaler is not None and bool(self.scaler.step_skipped(self.opt))


class _TorchLoop:
    """A two-layer model, one SGD optimizer per layer, driven call by call (see `polyamp.conformance.Loop`)."""

    def __init__(self, device: str, policy: Policy, scaler: Mapping[str, Any], seed: int) -> None:
        self.device = device
        self.policy = policy
        torch.manual_seed(seed)
        mlp = _mlp().to(device)
        layers: list[torch.nn.Module] = [mlp[0], mlp[2]]
        self.model = apply_policy(mlp, policy, device_type=device)
        self.optimizers = [torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9) for layer in layers]
        self._layers = layers
        with polyamp.policy_scope(policy):
            self.scaler = LossScaler(**scaler, backend="torch")
        self._batch = 0

    def backward(self, overflow: Collection[int] = ()) -> None:
        with polyamp.policy_scope(self.policy):
            self._backward(overflow)

    def _backward(self, overflow: Collection[int]) -> None:
        generator = torch.Generator().manual_seed(self._batch)
        self._batch += 1
        x = torch.randn(16, 8, generator=generator).to(self.device)
        y = torch.randint(0, 4, (16,), generator=generator).to(self.device)
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        with autocast(self.policy, device_type=self.device):
            loss = F.cross_entropy(self.model(x), y)
        self.scaler.scale(loss).backward()
        for index in overflow:
            grad = next(self._layers[index].parameters()).grad
            assert grad is not None
            grad.view(-1)[0] = float("inf")

    def unscale(self, index: int) -> None:
        self.scaler.unscale_(self.optimizers[index])

    def step(self, index: int) -> None:
        self.scaler.step(self.optimizers[index])

    def update(self) -> None:
        self.scaler.update()

    def params(self, index: int) -> list[np.ndarray]:
        return [p.detach().float().cpu().numpy().copy() for p in self._layers[index].parameters()]

    def optimizer_state(self, index: int) -> list[np.ndarray]:
        optimizer = self.optimizers[index]
        arrays = []
        for param in self._layers[index].parameters():
            for _, value in sorted(optimizer.state.get(param, {}).items()):
                arrays.append(_state_array(value))
        return arrays


#: Why the records of a run with ``skip_on_device=True`` name no parameter when read after later steps.
SKIPPED_ON_DEVICE_NAMES = (
    "with skip_on_device=True the host does not learn which steps were skipped, so (as with fused optimizers) "
    "the records name the non-finite parameters only when read before the next iteration changes the "
    "gradients; read later, the skipped step is recorded with its reason but without the names"
)


class TorchHarness:
    """PyTorch on one device type ("cpu" or "cuda")."""

    backend = "torch"
    devices = ("cpu", "cuda")
    capabilities = frozenset({"low_precision", "guard", "precision"})
    #: PyTorch follows polyamp's semantics everywhere (on CPU, polyamp regions supply CUDA's float32 ops).
    divergences: Mapping[str, str] = {}

    def __init__(self, device: str) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise HarnessUnavailable(f"torch {torch.__version__} sees no CUDA device")
        if device not in ("cpu", "cuda"):
            raise HarnessUnavailable(f"the torch harness runs on 'cpu' and 'cuda', not {device!r}")
        self.device = device
        #: ``POLYAMP_TORCH_SKIP_ON_DEVICE=1``: every case's scaler takes ``skip_on_device=True``, so the suite
        #: checks the masked commit's semantics against the same expectations.
        self.skip_on_device = os.environ.get("POLYAMP_TORCH_SKIP_ON_DEVICE") == "1"
        if self.skip_on_device:
            self.divergences = {"names_read_late": SKIPPED_ON_DEVICE_NAMES}

    def _tensor(self, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=generator).to(self.device)

    def op_dtype(self, op: str, policy: Policy) -> str:
        a, b = self._tensor((4, 8), 1), self._tensor((8, 8), 2)
        with torch.no_grad(), autocast(policy, device_type=self.device):
            if op == "matmul":
                out = a @ b
            elif op == "dense":
                out = torch.nn.Linear(8, 8).to(self.device)(a)
            elif op == "conv":
                out = torch.nn.Conv2d(3, 4, 3).to(self.device)(self._tensor((2, 3, 8, 8), 3))
            else:
                hidden = a @ b  # activations in the compute dtype, as inside a model
                if op == "softmax":
                    out = torch.softmax(hidden, dim=-1)
                elif op == "log_softmax":
                    out = F.log_softmax(hidden, dim=-1)
                elif op == "cross_entropy":
                    out = F.cross_entropy(hidden, torch.arange(4, device=self.device))
                elif op == "layer_norm":
                    out = torch.nn.LayerNorm(8).to(self.device)(hidden)
                elif op == "sum":
                    out = hidden.sum()
                else:
                    raise ValueError(f"unknown op class {op!r}")
        return _dtype_name(out)

    def model_dtypes(self, policy: Policy) -> tuple[list[str], str]:
        model = apply_policy(_mlp().to(self.device), policy, device_type=self.device)
        with torch.no_grad():
            output = model(self._tensor((2, 8)))
        return [_dtype_name(p) for p in model.parameters()], _dtype_name(output)

    def _scaler_options(self, scaler: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """The case's scaler options, with ``skip_on_device=True`` added when the run asks for it."""
        if scaler is None or not self.skip_on_device:
            return scaler
        return {**scaler, "skip_on_device": True}

    def trainer(
        self,
        policy: Policy,
        *,
        scaler: Mapping[str, Any] | None = None,
        optimizer: str = "sgd",
        clip: float | None = None,
        seed: int = 0,
    ) -> _TorchTrainer:
        return _TorchTrainer(self.device, policy, self._scaler_options(scaler), optimizer, clip, seed)

    def tiny_gradient(
        self, x: np.ndarray, w: np.ndarray, factor: float, policy: Policy, scaler: LossScaler | None
    ) -> np.ndarray:
        weight = torch.nn.Parameter(torch.from_numpy(w).to(self.device))
        inputs = torch.from_numpy(x).to(self.device)
        with autocast(policy, device_type=self.device):
            loss = (inputs @ weight).float().sum() * factor
        if scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
        else:
            opt = torch.optim.SGD([weight], lr=0.0)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        assert weight.grad is not None
        return weight.grad.float().cpu().numpy()

    def passes_loss_through(self, scaler: LossScaler) -> bool:
        loss = torch.tensor(1.5, device=self.device)
        return scaler.scale(loss) is loss

    def loop(self, policy: Policy, *, scaler: Mapping[str, Any], seed: int = 0) -> _TorchLoop:
        options = self._scaler_options(scaler)
        assert options is not None
        return _TorchLoop(self.device, policy, options, seed)
