"""The PyTorch loss scaler: polyamp's state machine on the device, torch's kernels for the work.

The step protocol is torch.amp.GradScaler's, call for call, so results match it bit for bit:

* gradients are unscaled and checked by torch's fused ``_amp_foreach_non_finite_check_and_unscale_``
  (one launch per device and dtype), with the reciprocal formed in float64 as GradScaler does;
* optimizers that unscale inside their fused kernel (``_step_supports_amp_scaling``: fused Adam, AdamW,
  SGD, Adagrad) receive ``grad_scale`` and ``found_inf`` tensors and skip on the device: no host sync;
* other optimizers are stepped only if no gradient was non-finite, which costs the one host read of the
  flag that GradScaler also makes;
* `update` never reads the state to the host (see `polyamp_torch._update`).

On top of GradScaler: hysteresis and min/max bounds, clear errors for float16 gradients and misuse, a
per-optimizer record of skipped steps (`step_skipped`) that LR-scheduler guards rely on, and a count of
skipped iterations.
"""

from __future__ import annotations

import enum
import inspect
import math
import numbers
import warnings
import weakref
from collections import abc, defaultdict
from typing import Any

from polyamp import (
    BackendMismatchError,
    LossScaleConfig,
    LossScaler,
    LossScaleState,
    PolyampTypeError,
    ScalerUsageError,
)
from polyamp._src.errors import InvalidConfigError, describe
from polyamp._src.loss_scaler import wrong_object_error
from polyamp._src.registry import backend_name_for
from polyamp._src.scaling import to_float32
from polyamp_torch._framework import torch
from polyamp_torch._update import DeviceState, advance

__all__ = ["TorchLossScaler", "TorchScalerImpl", "impl_of"]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class _OptimizerIteration:
    """What the scaler knows about one optimizer in the current iteration."""

    __slots__ = ("found_inf_per_device", "stage")

    def __init__(self) -> None:
        self.stage = _Stage.READY
        self.found_inf_per_device: dict[torch.device, torch.Tensor] = {}


class _StepRecord:
    """The outcome of an optimizer's most recent step: the device flag, and the host bool when known."""

    __slots__ = ("found_inf", "skipped")

    def __init__(self, found_inf: torch.Tensor | None, skipped: bool | None) -> None:
        self.found_inf = found_inf
        self.skipped = skipped


class _PerDevice:
    """Copies of one tensor on each device that asks for it (model-parallel gradients)."""

    __slots__ = ("copies", "master")

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        copy = self.copies.get(device)
        if copy is None:
            copy = self.master.to(device=device, non_blocking=True, copy=True)
            self.copies[device] = copy
        return copy


_TAKES_GRAD_SCALER: dict[type, bool] = {}


def _takes_grad_scaler(step_type: type) -> bool:
    # Optimizers from before torch's grad_scale/found_inf protocol take the scaler itself; they are
    # stepped like ordinary optimizers (after unscale_), which is always correct. A plain dict cache
    # (not functools.lru_cache) keeps this traceable by torch.compile.
    known = _TAKES_GRAD_SCALER.get(step_type)
    if known is None:
        try:
            known = "grad_scaler" in inspect.signature(step_type.step).parameters  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            known = False
        _TAKES_GRAD_SCALER[step_type] = known
    return known


def _fused_amp_capable(optimizer: Any) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and not _takes_grad_scaler(type(optimizer))


def _fused_step(optimizer: Any, grad_scale: Any, found_inf: torch.Tensor, args: Any, kwargs: Any) -> Any:
    # torch's Optimizer.step breaks the graph twice under torch.compile (pytorch#104053), so the step is
    # never part of a graph; running this block eagerly as one unit keeps the attribute hand-over exact.
    optimizer.grad_scale = grad_scale
    optimizer.found_inf = found_inf
    result = optimizer.step(*args, **kwargs)
    del optimizer.grad_scale
    del optimizer.found_inf
    return result


_fused_step = torch.compiler.disable(_fused_step)  # type: ignore[no-untyped-call]


def _reject(method: str, obj: object, expected: str) -> Exception:
    return wrong_object_error("torch", method, obj, expected)


class TorchScalerImpl:
    """The device form of a polyamp loss scaler for PyTorch (see the module docstring)."""

    def __init__(self, config: LossScaleConfig, state: LossScaleState, enabled: bool) -> None:
        self._config = config
        self._enabled = enabled
        self._host_state = state
        self._device: DeviceState | None = None
        self._iteration: dict[int, _OptimizerIteration] = defaultdict(_OptimizerIteration)
        self._records: weakref.WeakKeyDictionary[Any, _StepRecord] = weakref.WeakKeyDictionary()
        self._last_found_inf: torch.Tensor | None = None
        self._warned_bfloat16 = False

    # -- state -------------------------------------------------------------------------------------------

    def _materialize(self, device: torch.device) -> DeviceState:
        state = self._host_state
        self._device = DeviceState(state.scale, state.growth_tracker, state.hysteresis_left, device)
        return self._device

    def _require_device(self, method: str) -> DeviceState:
        if self._device is None:
            raise ScalerUsageError(
                f"LossScaler.{method}() was called before scale(): call scaler.scale(loss).backward() first "
                "in each iteration."
            )
        return self._device

    def get_state(self) -> LossScaleState:
        if self._device is None:
            return self._host_state
        values = torch.stack(
            [self._device.scale.double(), self._device.growth_tracker.double(), self._device.hysteresis_left.double()]
        ).tolist()
        return LossScaleState(float(values[0]), int(values[1]), int(values[2]))

    def set_state(self, config: LossScaleConfig, state: LossScaleState) -> None:
        if self._iteration:
            raise ScalerUsageError(
                "load_state_dict() was called in the middle of an iteration (after step() or unscale_(), "
                "before update()). Load the state at the start of an iteration or after update()."
            )
        self._config = config
        self._host_state = state
        if self._device is not None:
            self._device.fill(state.scale, state.growth_tracker, state.hysteresis_left)

    def get_scale(self) -> float:
        if self._device is None:
            return self._host_state.scale
        return float(self._device.scale.item())

    def between_iterations(self) -> bool:
        """True unless a step()/unscale_() has happened since the last update()."""
        return not self._iteration

    # -- the step protocol -------------------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            device = self._device or self._materialize(outputs.device)
            return outputs * device.scale.to(device=outputs.device, non_blocking=True)
        replicas: list[_PerDevice] = []

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if not replicas:
                    device = self._device or self._materialize(value.device)
                    replicas.append(_PerDevice(device.scale))
                return value * replicas[0].get(value.device)
            if (
                isinstance(value, abc.Iterable)
                and not isinstance(value, (str, bytes))
                and backend_name_for(value) is None
            ):
                scaled = map(apply, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise _reject("scale", value, "a torch.Tensor or an iterable of torch.Tensors")

        return apply(outputs)

    def _unscale_grads(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        per_device_inv_scale = _PerDevice(inv_scale)
        per_device_found_inf = _PerDevice(found_inf)
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if grad.dtype == torch.float16 and not allow_fp16:
                        raise ScalerUsageError(
                            f"Cannot unscale float16 gradients (a parameter of shape {tuple(param.shape)} has "
                            "a float16 gradient). Loss scaling needs float32 master parameters: 1/scale and the "
                            "unscaled values underflow in float16. Keep the parameters in float32 and let "
                            "polyamp_torch.autocast() run the float16 math (the 'mixed_float16' policy), or "
                            "train with a bfloat16 policy without loss scaling."
                        )
                    if grad.dtype == torch.bfloat16 and not self._warned_bfloat16:
                        self._warned_bfloat16 = True
                        warnings.warn(
                            "Loss scaling is enabled but the gradients are bfloat16. bfloat16 has float32's "
                            "range, so scaling only costs time (and rounds, for non-power-of-two scales). "
                            "Construct the LossScaler with enabled=False, or leave enabled=None under a "
                            "bfloat16 policy.",
                            UserWarning,
                            stacklevel=4,
                        )
                    if grad.is_sparse:
                        # Duplicate indices of a float16 sparse grad may overflow once summed: check coalesced.
                        if grad.dtype == torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    grouped[grad.device][grad.dtype].append(grad)
            for device, by_dtype in grouped.items():
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        grads, per_device_found_inf.get(device), per_device_inv_scale.get(device)
                    )
        return per_device_found_inf.copies

    def _check_optimizer(self, method: str, optimizer: Any) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise _reject(method, optimizer, "a torch.optim.Optimizer")

    def unscale_(self, optimizer: Any) -> None:
        self._check_optimizer("unscale_", optimizer)
        if not self._enabled:
            return
        device = self._require_device("unscale_")
        iteration = self._iteration[id(optimizer)]
        if iteration.stage is _Stage.UNSCALED:
            raise ScalerUsageError(
                "unscale_() was already called for this optimizer since the last update(); a second call would "
                "divide the gradients by the scale twice. Call it at most once per optimizer per iteration."
            )
        if iteration.stage is _Stage.STEPPED:
            raise ScalerUsageError(
                "unscale_() was called after step() for this optimizer. Call unscale_() before step() (step() "
                "unscales by itself when you do not)."
            )
        scale = device.scale
        inv_scale = scale.reciprocal() if scale.device.type == "mps" else scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        iteration.found_inf_per_device = self._unscale_grads(optimizer, inv_scale, found_inf, allow_fp16=False)
        iteration.stage = _Stage.UNSCALED

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        self._check_optimizer("step", optimizer)
        if not self._enabled:
            result = optimizer.step(*args, **kwargs)
            self._records[optimizer] = _StepRecord(None, False)
            return result
        if "closure" in kwargs or (args and callable(args[0])):
            raise ScalerUsageError(
                "step() with a closure is not supported while loss scaling is enabled: the closure would "
                "recompute gradients that are scaled but never unscaled. Compute the loss and gradients before "
                "step(), or use a bfloat16 policy without loss scaling."
            )
        device = self._require_device("step")
        iteration = self._iteration[id(optimizer)]
        if iteration.stage is _Stage.STEPPED:
            raise ScalerUsageError(
                "step() was already called for this optimizer since the last update(). Call update() once at "
                "the end of each iteration."
            )
        if _fused_amp_capable(optimizer):
            if iteration.stage is _Stage.READY:
                iteration.found_inf_per_device = self._unscale_grads(
                    optimizer,
                    torch.ones((), dtype=torch.float32, device=device.scale.device),
                    torch.zeros((), dtype=torch.float32, device=device.scale.device),
                    allow_fp16=True,
                )
            found_inf = sum(
                t.to(device.scale.device, non_blocking=True) for t in iteration.found_inf_per_device.values()
            )
            assert isinstance(found_inf, torch.Tensor), "no gradients were checked"
            # The fused kernel unscales by grad_scale itself unless unscale_() already did (as GradScaler).
            grad_scale = (
                getattr(optimizer, "grad_scale", None)
                if iteration.stage is _Stage.UNSCALED
                else device.scale * getattr(optimizer, "grad_scale", 1)
            )
            result = _fused_step(optimizer, grad_scale, found_inf, args, kwargs)
            iteration.stage = _Stage.STEPPED
            self._records[optimizer] = _StepRecord(found_inf, None)
            return result
        if iteration.stage is _Stage.READY:
            self.unscale_(optimizer)
        if not iteration.found_inf_per_device:
            raise ScalerUsageError(
                "step(): none of the optimizer's parameters has a gradient. Call scaler.scale(loss).backward() "
                "before step()."
            )
        flags = list(iteration.found_inf_per_device.values())
        skipped = bool(sum(v.item() for v in flags))  # the one host read GradScaler also makes
        result = None if skipped else optimizer.step(*args, **kwargs)
        iteration.stage = _Stage.STEPPED
        flag = flags[0] if len(flags) == 1 else torch.stack([f.to(device.scale.device) for f in flags]).sum()
        self._records[optimizer] = _StepRecord(flag, skipped)
        return result

    def update(self, new_scale: Any = None) -> None:
        if not self._enabled:
            return
        device = self._require_device("update")
        found_infs = [
            found_inf.to(device=device.scale.device, non_blocking=True)
            for iteration in self._iteration.values()
            for found_inf in iteration.found_inf_per_device.values()
        ]
        if not found_infs:
            raise ScalerUsageError(
                "update() was called but no step() or unscale_() happened since the last update(). Call "
                "scaler.step(optimizer) for each optimizer, then update() once per iteration."
            )
        combined = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
        if new_scale is not None:
            self._set_scale(device, new_scale)
        else:
            advance(device, combined, self._config)
        device.skipped.add_(combined > 0)
        self._last_found_inf = combined
        self._iteration.clear()

    def _set_scale(self, device: DeviceState, new_scale: Any) -> None:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
                raise PolyampTypeError(
                    "update(new_scale) takes a float or a one-element floating tensor with requires_grad=False. "
                    f"Received a tensor of shape {tuple(new_scale.shape)}, dtype {new_scale.dtype}, "
                    f"requires_grad={new_scale.requires_grad}."
                )
            device.scale.copy_(new_scale.reshape(()))
            return
        if isinstance(new_scale, bool) or not isinstance(new_scale, numbers.Real):
            raise PolyampTypeError(
                f"update(new_scale) takes a float or a one-element tensor. Received: {describe(new_scale)}."
            )
        value = to_float32(float(new_scale))
        config = self._config
        if not (math.isfinite(value) and value > 0):
            raise InvalidConfigError(f"update(new_scale) needs a finite positive scale. Received: {new_scale!r}.")
        if (config.min_scale_f32 is not None and value < config.min_scale_f32) or (
            config.max_scale_f32 is not None and value > config.max_scale_f32
        ):
            raise InvalidConfigError(
                f"update(new_scale={new_scale!r}) is outside [min_scale, max_scale] = "
                f"[{config.min_scale!r}, {config.max_scale!r}]."
            )
        device.scale.fill_(value)

    # -- what happened -----------------------------------------------------------------------------------

    def step_skipped(self, optimizer: Any = None) -> torch.Tensor:
        if optimizer is None:
            if not self._enabled:
                return torch.tensor(False)
            if self._last_found_inf is None:
                raise ScalerUsageError("step_skipped() was called before the first update().")
            return self._last_found_inf > 0
        record = self._records.get(optimizer)
        if record is None:
            raise ScalerUsageError("step_skipped(optimizer): this optimizer has not been stepped by this scaler.")
        if record.found_inf is None:
            return torch.tensor(False)
        return record.found_inf > 0

    def skipped_steps(self) -> torch.Tensor:
        if self._device is None:
            return torch.zeros((), dtype=torch.int64)
        return self._device.skipped

    def was_skipped(self, optimizer: Any) -> bool | None:
        """Host answer for the optimizer's last step, reading the device only when step() did not already."""
        record = self._records.get(optimizer)
        if record is None:
            return None
        if record.skipped is None:
            record.skipped = bool(record.found_inf.item() > 0)  # type: ignore[union-attr]
        return record.skipped


def impl_of(scaler: Any, *, bind_from: Any = None) -> TorchScalerImpl:
    """The torch device form behind a `polyamp.LossScaler`, binding it to torch if it is not bound yet."""
    if not isinstance(scaler, LossScaler):
        raise PolyampTypeError(f"Expected a polyamp.LossScaler. Received: {describe(scaler)}.")
    if scaler.backend is None:
        if bind_from is not None:
            scaler._impl_for("step", bind_from)
        else:
            scaler._bind("torch")
    if scaler.backend != "torch":
        raise BackendMismatchError(f"This LossScaler is bound to {scaler.backend}, not torch.")
    return scaler._impl  # type: ignore[no-any-return]


class TorchLossScaler(LossScaler):
    """A `polyamp.LossScaler` bound to PyTorch from construction; same arguments, same methods.

    Use it when you want the torch type up front (type checkers, ``isinstance``); ``polyamp.LossScaler()``
    becomes the same thing on first use with a torch tensor. It is a drop-in for ``torch.amp.GradScaler``
    in the usual loop::

        scaler = polyamp_torch.TorchLossScaler()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)               # optional, e.g. before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)                   # skipped if a gradient is inf/NaN
        scaler.update()
        scaler.step_skipped(optimizer)           # bool tensor, no host sync
    """

    bound_backend = "torch"
