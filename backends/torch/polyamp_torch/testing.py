"""polyamp's conformance harness for PyTorch (see `polyamp.conformance`).

``python -m polyamp.conformance --backend torch --device cuda`` runs the suite through it.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from polyamp import Float8Recipe, LossScaler, Policy
from polyamp.conformance import HarnessBase, HarnessUnavailable, LoopBase, TrainerBase, TrainerSettings
from polyamp_torch._autocast import autocast
from polyamp_torch._float8 import float8_state_dict, load_float8_state_dict
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


def _state_values(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> Iterator[object]:
    """The optimizer's state values of each parameter in turn, by key."""
    for param in params:
        for _, value in sorted(optimizer.state.get(param, {}).items()):
            yield value


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class _TorchTrainer(TrainerBase):
    def __init__(self, harness: TorchHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.device = harness.device
        torch.manual_seed(settings.seed)
        self.model = apply_policy(_mlp().to(self.device), policy, device_type=self.device)
        params = list(self.model.named_parameters())  # torch keeps the names (param_names) for the records
        #: The parameter ``step(overflow=True)`` plants an inf in (its first gradient element).
        self.planted = params[0][0]
        self.opt: torch.optim.Optimizer = settings.make_optimizer(
            {
                "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                "adam": lambda: torch.optim.Adam(params, lr=0.01),
            }
        )
        if policy.has_training_state_plan:  # the parameters are in the policy's param dtype (apply_policy)
            self.opt = PrecisionOptimizer(self.opt, policy, seed=settings.seed)
        self.scaler = self.make_scaler()

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
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
        if self.settings.clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.clip)
        self.optimizer_step()
        return float(loss.detach().float().cpu())

    def to_numpy(self, value: object) -> np.ndarray:
        return _state_array(value)

    def weights(self) -> Iterator[torch.Tensor]:
        return self.model.parameters()

    def slots(self) -> Iterator[object]:
        """Every state tensor per parameter, by key: the slots and, under a training-state plan, the master copy
        (``polyamp_master``) and compensation buffer (``polyamp_compensation``), each as stored."""
        return _state_values(self.opt, self.model.parameters())


class _TorchLoop(LoopBase):
    """A two-layer model, one SGD optimizer per layer, driven call by call (see `polyamp.conformance.Loop`)."""

    def __init__(self, harness: TorchHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.device = harness.device
        torch.manual_seed(settings.seed)
        mlp = _mlp().to(self.device)
        layers: list[torch.nn.Module] = [mlp[0], mlp[2]]
        self.model = apply_policy(mlp, policy, device_type=self.device)
        self.optimizers = [torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9) for layer in layers]
        self._layers = layers
        self.scaler = self.make_scaler()

    def run_backward(self, overflow: Collection[int]) -> None:
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

    def to_numpy(self, value: object) -> np.ndarray:
        return _state_array(value)

    def weights(self, index: int) -> Iterator[torch.Tensor]:
        return self._layers[index].parameters()

    def slots(self, index: int) -> Iterator[object]:
        return _state_values(self.optimizers[index], self._layers[index].parameters())


#: Why the records of a run with ``skip_on_device=True`` name no parameter when read after later steps.
SKIPPED_ON_DEVICE_NAMES = (
    "with skip_on_device=True the host does not learn which steps were skipped, so (as with fused optimizers) "
    "the records name the non-finite parameters only when read before the next iteration changes the "
    "gradients; read later, the skipped step is recorded with its reason but without the names"
)


class TorchHarness(HarnessBase):
    """PyTorch on one device type ("cpu" or "cuda")."""

    backend = "torch"
    devices = ("cpu", "cuda")
    capabilities = frozenset({"low_precision", "guard", "precision"})
    #: PyTorch follows polyamp's semantics everywhere (on CPU, polyamp regions supply CUDA's float32 ops).
    divergences: Mapping[str, str] = {}
    trainer_class = _TorchTrainer

    def __init__(self, device: str) -> None:
        super().__init__(device)
        #: ``POLYAMP_TORCH_SKIP_ON_DEVICE=1``: every case's scaler takes ``skip_on_device=True``, so the suite
        #: checks the masked commit's semantics against the same expectations.
        if os.environ.get("POLYAMP_TORCH_SKIP_ON_DEVICE") == "1":
            self.extra_scaler_options = {"skip_on_device": True}
            self.divergences = {"names_read_late": SKIPPED_ON_DEVICE_NAMES}

    def check_device(self, device: str) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise HarnessUnavailable(f"torch {torch.__version__} sees no CUDA device")

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

    def _float8_layer(self, recipe: Float8Recipe, weight: np.ndarray) -> torch.nn.ModuleDict:
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=self.device)
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(weight))
        model = torch.nn.ModuleDict({"layer": layer})
        apply_policy(model, Policy("float32").replace(float8=recipe), device_type=self.device)
        return model

    def float8_linear(
        self, recipe: Float8Recipe, x: np.ndarray, weight: np.ndarray, upstream: np.ndarray
    ) -> dict[str, np.ndarray]:
        layer: Any = self._float8_layer(recipe, weight)["layer"]
        inputs = torch.from_numpy(x).to(self.device).requires_grad_()
        output = layer(inputs)
        output.backward(torch.from_numpy(upstream).to(self.device))
        assert inputs.grad is not None and layer.weight.grad is not None
        return {
            "output": output.detach().float().cpu().numpy(),
            "grad_input": inputs.grad.float().cpu().numpy(),
            "grad_weight": layer.weight.grad.float().cpu().numpy(),
        }

    def float8_delayed(
        self,
        recipe: Float8Recipe,
        xs: Sequence[np.ndarray],
        weight: np.ndarray,
        upstreams: Sequence[np.ndarray],
        state: Mapping[str, Any] | None,
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        model = self._float8_layer(recipe, weight)
        if state is not None:
            load_float8_state_dict(model, dict(state))
        outputs = []
        for x, upstream in zip(xs, upstreams, strict=True):
            output = model["layer"](torch.from_numpy(x).to(self.device))
            output.backward(torch.from_numpy(upstream).to(self.device))
            outputs.append(output.detach().float().cpu().numpy())
        return outputs, float8_state_dict(model)

    def loop(self, policy: Policy, *, scaler: Mapping[str, Any], seed: int = 0) -> _TorchLoop:
        return _TorchLoop(self, policy, self.settings(scaler, seed=seed))
