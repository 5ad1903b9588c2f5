"""The torch device form of a loss scaler: the scale and counters as tensors, torch's kernels for the work.

It implements `polyamp.backend_api.ImperativeDevice`; `polyamp.LossScaler` drives it and decides every
step semantic (stages, misuse, skip records). The device operations follow ``torch.amp.GradScaler`` call
for call, so results match it bit for bit:

* gradients are unscaled and checked by torch's fused ``_amp_foreach_non_finite_check_and_unscale_``
  (one launch per device and dtype), with the reciprocal formed in float64 as GradScaler does;
* optimizers that unscale inside their fused kernel receive ``grad_scale`` and ``found_inf`` tensors and
  skip on the device: no host sync;
* other optimizers are stepped only if no gradient was non-finite, which costs the one host read of the
  flag that GradScaler also makes;
* `update` never reads the state to the host (see `polyamp_torch._rule`);
* with a process group (ranks holding different gradients), each optimizer step's found-inf flag is
  all-reduced (max) over it, a one-element collective on the device, so every rank skips together.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import abc
from collections.abc import Mapping, Sequence
from typing import Any

from polyamp import InvalidConfigError, LossScaleConfig, LossScaleState, PolyampTypeError, ScalerUsageError
from polyamp.backend_api import StepOutcome, backend_name_for
from polyamp.backend_api.arguments import describe, no_gradients_error, wrong_object_error
from polyamp_torch._autocast import _float16_regions, float16_regions_entered
from polyamp_torch._device_records import RecordMethods, _kept
from polyamp_torch._device_spikes import SpikeMethods
from polyamp_torch._framework import run_uncompiled, torch
from polyamp_torch._gradients import (
    PerDevice,
    fused_amp_capable,
    fused_step,
    non_finite_counts,
    takes_grad_scaler,
    unscale_and_clip_gradients,
    unscale_gradients,
    warn_bfloat16_scaling,
)
from polyamp_torch._masked_step import masked_step
from polyamp_torch._precision import PrecisionOptimizer, is_precision_optimizer, warn_unplanned
from polyamp_torch._rule import DeviceState, advance

__all__ = ["TorchDevice"]

_CPU = torch.device("cpu")


class TorchDevice(RecordMethods, SpikeMethods):
    """polyamp's loss-scaler state on a torch device, and the device operations of a step."""

    def __init__(self, config: LossScaleConfig, state: LossScaleState) -> None:
        self._config = config
        self._checks_unscaled = config.checks_unscaled  # (asked at every unscale; follows `_config`)
        self._host_state = state
        self._state: DeviceState | None = None
        self._state_traced = False  # made inside torch.compile's trace: a CUDA graph may own its tensors
        self._warned_bfloat16 = False
        self._ones: dict[torch.device, torch.Tensor] = {}  # inverse scale 1 for check-only passes (`_one`)
        self._uncounted: list[torch.Tensor] = []  # skip flags not yet added to the state's count (`_count`)
        self._finite_flags: dict[torch.device, torch.Tensor] = {}
        # The finite flag of the state's device, once both exist (the state never moves): `_finite_flags`'s entry
        # for that device, kept where `update` finds it without building a torch.device.
        self._state_finite: torch.Tensor | None = None
        # Counted from this device's creation: regions that ran before belong to other loops (another scaler's,
        # an evaluation), not to this scaler's iterations. A first forward that ran before the scaler bound (it
        # binds at its first scale()) is told from the loss instead (see float16_in_use).
        self._float16_regions_seen = float16_regions_entered()
        self._first_iteration = True
        self._process_group: Any = None
        self._group_iteration = 0  # this rank's iteration count, carried by each reduction over the group
        self._group_mismatch: torch.Tensor | None = None  # set once a reduction paired different iterations
        # The last collective's work object, kept referenced from Python until the next one. Otherwise a gloo
        # worker thread can drop the last reference to it, and so to the reduced tensor, whose Python object it
        # then has to release under the GIL; a worker that gets there while the interpreter exits (a script
        # ending right after its last step) aborts the process ("terminate called without an active exception").
        self._group_work: Any = None

    def set_group_iteration(self, index: int) -> None:
        """The iteration count the following reductions carry (see `_reduce_over_group`)."""
        self._group_iteration = index

    def read_group_mismatch(self) -> bool:
        """Whether a reduction since the last call paired different iterations of the group's ranks."""
        mismatch, self._group_mismatch = self._group_mismatch, None
        return mismatch is not None and bool(mismatch.item())

    def set_process_group(self, group: Any) -> None:
        """Reduce every found-inf flag over ``group`` (a ``torch.distributed.ProcessGroup``) from now on."""
        dist = torch.distributed
        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise PolyampTypeError(
                "process_group takes a torch.distributed.ProcessGroup (dist.new_group(ranks), dist.group.WORLD, "
                f"or a DeviceMesh's mesh.get_group()). Received: {describe(group)}."
            )
        self._process_group = group

    # -- state -------------------------------------------------------------------------------------------

    def _materialize(self, device: torch.device) -> DeviceState:
        state = self._host_state
        self._state = DeviceState(state.scale, state.growth_tracker, state.hysteresis_left, device)
        self._state_traced = torch.compiler.is_compiling()
        self._state_finite = self._finite_flags.get(self._state.scale.device)  # (None until `finite_flag` makes it)
        return self._state

    def _state_near(self, optimizer: Any) -> DeviceState:
        """The device state, created next to the optimizer's parameters if ``scale`` never ran (it may have
        run while scaling was disabled)."""
        if self._state is not None:
            return self._state
        for group in optimizer.param_groups:
            for param in group["params"]:
                return self._materialize(param.device)
        return self._materialize(torch.device("cpu"))

    def read_state(self) -> LossScaleState:
        if self._state is None:
            return self._host_state
        state = self._state
        values = torch.stack([state.scale.double(), state.growth_tracker.double(), state.hysteresis_left.double()])
        scale, tracker, hysteresis = values.tolist()
        return LossScaleState(float(scale), int(tracker), int(hysteresis))

    def write_state(self, config: LossScaleConfig, state: LossScaleState | None) -> None:
        self._config = config
        self._checks_unscaled = config.checks_unscaled
        if state is None:
            return
        self._host_state = state
        if self._state is not None:
            self._state.fill(state.scale, state.growth_tracker, state.hysteresis_left)

    def float16_in_use(self, *, since_last_iteration: bool = False, loss: Any = None) -> bool:
        """Whether this iteration computes in float16: a ``polyamp_torch.autocast`` region computing in float16
        was entered since the previous iteration started (for the first: since this device was made), or, in
        the first iteration, whose forward pass may have run before the scaler bound, ``loss`` came from
        float16 computation (`float16_computed`; not while torch.compile traces)."""
        seen = _float16_regions[0]  # (`float16_regions_entered()`: asked at each iteration's start)
        in_use = seen != self._float16_regions_seen
        if not in_use and self._first_iteration and loss is not None and not self.compiling():
            in_use = self.float16_computed(loss)
        if since_last_iteration:
            self._float16_regions_seen = seen
            self._first_iteration = False
        return in_use

    def float16_computed(self, loss: Any) -> bool:
        """Whether ``loss`` (or a list of losses) came from float16 computation: it is float16, it is computed
        inside a float16 ``torch.autocast`` region, or its autograd graph saved a float16 tensor (a bounded walk
        of at most 1024 nodes; the core asks in the first iterations of a scaler that does not scale only)."""
        losses = [loss] if isinstance(loss, torch.Tensor) else [v for v in loss if isinstance(v, torch.Tensor)]
        for value in losses:
            if value.dtype == torch.float16:
                return True
            kind = value.device.type
            if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.float16:
                return True
        pending: list[Any] = [value.grad_fn for value in losses if value.grad_fn is not None]
        seen: set[int] = set()
        while pending and len(seen) < 1024:
            node = pending.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            for name in dir(node):
                if name.startswith("_saved_"):
                    try:
                        saved = getattr(node, name)
                    except RuntimeError:  # freed by an earlier backward
                        continue
                    if isinstance(saved, torch.Tensor) and saved.dtype == torch.float16:
                        return True
            pending.extend(next_node for next_node, _ in node.next_functions)
        return False

    #: Whether torch.compile is tracing the call (torch's own function: the core asks at every stage).
    compiling = staticmethod(torch.compiler.is_compiling)

    #: ``fn(*args)`` at run time, outside torch.compile's trace and frame handling, as torch runs its own
    #: GradScaler (`polyamp_torch._framework.run_uncompiled`).
    run_uncompiled = staticmethod(run_uncompiled)

    # -- the step ----------------------------------------------------------------------------------------

    def check_optimizer(self, method: str, optimizer: object) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise wrong_object_error("torch", method, optimizer, "a torch.optim.Optimizer")
        if method == "step" and not is_precision_optimizer(optimizer) and not torch.compiler.is_compiling():
            # Every step of an imperative scaler passes here first: the one place to see a plain optimizer
            # updating bfloat16/float16 weights (a PrecisionOptimizer says so itself, for its own plan). The
            # warning points at the user's ``scaler.step`` (through the scaler's `_check`).
            warn_unplanned(optimizer, stacklevel=4)

    def scale(self, outputs: Any) -> Any:
        if isinstance(outputs, torch.Tensor):
            state = self._state or self._materialize(outputs.device)
            scale = state.scale
            device = outputs.device
            return outputs * (scale if scale.device == device else scale.to(device=device, non_blocking=True))
        replicas: list[PerDevice] = []

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if not replicas:
                    state = self._state or self._materialize(value.device)
                    replicas.append(PerDevice(state.scale))
                return value * replicas[0].get(value.device)
            if (
                isinstance(value, abc.Iterable)
                and not isinstance(value, (str, bytes))
                and backend_name_for(value) is None
            ):
                scaled = map(apply, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise wrong_object_error("torch", "scale", value, "a torch.Tensor or an iterable of torch.Tensors")

        return apply(outputs)

    def unscale_gradients(self, optimizer: Any) -> torch.Tensor | None:
        scale = (self._state or self._state_near(optimizer)).scale
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        flag, bfloat16 = unscale_gradients(
            optimizer,
            _inverse(scale),
            found_inf,
            # A PrecisionOptimizer forms its update in float32 from the unscaled float16 gradients.
            allow_fp16=isinstance(optimizer, PrecisionOptimizer),  # (`is_precision_optimizer`, without the call)
            warn_bfloat16=not self._warned_bfloat16,
            check_unscaled=self._checks_unscaled,
        )
        if self._process_group is not None:
            flag = self._reduce_over_group(flag, found_inf)
        self._warned_bfloat16 |= bfloat16
        return flag

    def unscale_and_clip(
        self, optimizer: Any, max_norm: float, norm_type: float
    ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """`unscale_gradients` and ``clip_grad_norm_`` as one pass (``unscale_and_clip``,
        `polyamp.backend_api.OptionalMethods`); None where they stay two: below scale 1 (the unscaled values are
        checked too), across a process group, or where the gradients cannot be folded (see
        `unscale_and_clip_gradients`)."""
        if self._checks_unscaled or self._process_group is not None:
            return None
        scale = self._state_near(optimizer).scale
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        folded = unscale_and_clip_gradients(
            optimizer,
            _inverse(scale),
            found_inf,
            max_norm,
            norm_type,
            allow_fp16=is_precision_optimizer(optimizer),
        )
        if folded is None:
            return None
        flag, total_norm, bfloat16 = folded
        if bfloat16 and not self._warned_bfloat16:
            self._warned_bfloat16 = True
            warn_bfloat16_scaling(stacklevel=5)
        return flag, total_norm

    def check_gradients_finite(self, optimizer: Any) -> torch.Tensor | None:
        """The guard's check, without scaling: the same fused kernel with inverse scale 1, which leaves
        the gradients bitwise unchanged; None when no parameter has a gradient."""
        device = self._state_near(optimizer).scale.device
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        flag, _ = unscale_gradients(optimizer, self._one(device), found_inf, allow_fp16=True, warn_bfloat16=False)
        return flag if self._process_group is None else self._reduce_over_group(flag, found_inf)

    def _one(self, device: torch.device) -> torch.Tensor:
        """An inverse scale of 1 on ``device`` (the kernel then only checks), made once: it is only read.
        Under torch.compile it is a constant of the graph and is not kept: a tensor the graph made lives in
        the graph's memory, which ``mode="reduce-overhead"`` overwrites at its next replay."""
        if torch.compiler.is_compiling():
            return torch.ones((), dtype=torch.float32, device=device)
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return one

    def non_finite_gradients(self, optimizer: Any) -> list[tuple[str, int, int, int, int]]:
        """(name, +inf, -inf, NaN, size) counts of each gradient of ``optimizer``, read in one host transfer.
        Called only for a step the host already knows was skipped. Names come from the optimizer's
        ``param_names`` (torch keeps them when it is built from ``model.named_parameters()``). A sharded
        (DTensor) gradient is counted on this rank's shard."""
        names: list[str] = []
        counts: list[torch.Tensor] = []
        sizes: list[int] = []
        for g, group in enumerate(optimizer.param_groups):
            given = group.get("param_names")
            for i, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                if hasattr(grad, "to_local"):  # a DTensor (FSDP2): this rank's shard
                    grad = grad.to_local()
                values = grad.coalesce().values() if grad.is_sparse else grad
                names.append(str(given[i]) if given is not None else f"param_groups[{g}][{i}]")
                counts.append(non_finite_counts(values).cpu())
                sizes.append(values.numel())
        rows = torch.stack(counts).tolist() if counts else []
        return [(name, *row, size) for name, row, size in zip(names, rows, sizes, strict=True)]

    def non_finite_parameters(self, optimizers: Sequence[Any]) -> list[tuple[str, int, int, int, int]]:
        """(name, +inf, -inf, NaN, size) counts of each parameter of ``optimizers``, read in one host transfer
        (asked during a run of skipped steps; names as in `non_finite_gradients`)."""
        names: list[str] = []
        counts: list[torch.Tensor] = []
        sizes: list[int] = []
        for optimizer in optimizers:
            for g, group in enumerate(optimizer.param_groups):
                given = group.get("param_names")
                for i, param in enumerate(group["params"]):
                    values = param.detach()
                    if hasattr(values, "to_local"):  # a DTensor (FSDP2): this rank's shard
                        values = values.to_local()
                    if not values.is_floating_point():
                        continue
                    names.append(str(given[i]) if given is not None else f"param_groups[{g}][{i}]")
                    counts.append(non_finite_counts(values).cpu())
                    sizes.append(values.numel())
        rows = torch.stack(counts).tolist() if counts else []
        return [(name, *row, size) for name, row, size in zip(names, rows, sizes, strict=True)]

    def count_skip(self, found_inf: torch.Tensor) -> None:
        """Count a guarded iteration as skipped when ``found_inf`` is set; the rule does not run."""
        state = self._state or self._materialize(found_inf.device)
        self._count(state, found_inf.to(state.skipped.device, non_blocking=True))

    def _count(self, state: DeviceState, found_inf: torch.Tensor) -> None:
        """Count the iteration as skipped when ``found_inf`` (on the state's device) is set: the flags are kept
        and added to ``state.skipped`` in one go every `_COUNT_BATCH` iterations and when the count is read
        (`skipped_steps`), not one by one (two operations each iteration)."""
        uncounted = self._uncounted
        kept = _kept(found_inf)  # (a CUDA graph's output is overwritten by the next replay)
        assert kept is not None
        uncounted.append(kept)
        if len(uncounted) >= _COUNT_BATCH:
            self._add_uncounted(state)

    def _add_uncounted(self, state: DeviceState) -> None:
        uncounted = self._uncounted
        if uncounted:
            state.skipped.add_(torch.stack(uncounted).gt(0).sum())
            uncounted.clear()

    def _reduce_over_group(self, flag: torch.Tensor | None, found_inf: torch.Tensor) -> torch.Tensor | None:
        """The flag of a check (`unscale_gradients`, into ``found_inf``; None without gradients) reduced over the
        process group: ONE max all-reduce of one element, issued on the device's stream (no host sync). A rank
        without gradients still takes part (with a zero flag), so the collective matches on every rank, and then
        reports None as usual. DTensor gradients (FSDP2) need no group: torch's DTensor rule for the unscale
        kernel already reduces the flag over the gradients' device mesh."""
        local = found_inf if flag is None else flag
        # (flag, iteration, -iteration) in one MAX all-reduce: the ranks' iterations differ exactly when the
        # maximum of the count and the maximum of its negation do not cancel (a rank discarded an iteration
        # alone); the flag is then set, so every rank skips, and the mismatch is kept for the host to report.
        iteration = float(self._group_iteration)
        packed = torch.stack(
            [local.reshape(()).to(torch.float64), torch.tensor(iteration, dtype=torch.float64, device=local.device)]
        )
        packed = torch.cat([packed, -packed[1:]])
        if torch.compiler.is_compiling():
            torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, group=self._process_group)
        else:
            work = torch.distributed.all_reduce(
                packed, op=torch.distributed.ReduceOp.MAX, group=self._process_group, async_op=True
            )
            work.wait()  # what the synchronous form does (a stream wait on CUDA, no host sync)
            self._group_work = work
        mismatch = (packed[1] + packed[2]) != 0
        local.copy_(torch.maximum(packed[0], mismatch.to(torch.float64)).to(local.dtype).reshape(local.shape))
        known = self._group_mismatch
        self._group_mismatch = mismatch if known is None else known | mismatch
        return flag  # (``local`` itself, or None)

    def unscales_in_step(self, optimizer: Any) -> bool:
        # Fused kernels check the scaled gradients only; below scale 1 the unscaled ones need checking too.
        # (The attribute first: most optimizers lack it, and are then not fused, without a call.)
        return (
            bool(getattr(optimizer, _FUSED_FLAG, False) and fused_amp_capable(optimizer)) and not self._checks_unscaled
        )

    def step(
        self, optimizer: Any, found_inf: torch.Tensor | None, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> StepOutcome:
        if getattr(optimizer, _FUSED_FLAG, False) and fused_amp_capable(optimizer):  # (as in `unscales_in_step`)
            state = self._state_near(optimizer)
            if found_inf is None:
                # Check only (inverse scale 1): the fused kernel unscales by grad_scale itself, as with GradScaler.
                device = state.scale.device
                zero = torch.zeros((), dtype=torch.float32, device=device)
                found_inf, _ = unscale_gradients(
                    optimizer, self._one(device), zero, allow_fp16=True, warn_bfloat16=False
                )
                if self._process_group is not None:
                    found_inf = self._reduce_over_group(found_inf, zero)
                if found_inf is None:
                    raise no_gradients_error()
                grad_scale: Any = state.scale * getattr(optimizer, "grad_scale", 1)
                # The kernel wrote 1.0 or left 0.0 in `zero`: a flag the fused kernel takes as it is.
                binary = found_inf is zero
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
                binary = False
            return StepOutcome(fused_step(optimizer, grad_scale, found_inf, args, kwargs, binary), found_inf, None)
        assert found_inf is not None, "the core unscales before a non-fused step"
        skipped = bool(found_inf.item())  # the one host read GradScaler also makes
        return StepOutcome(None if skipped else optimizer.step(*args, **kwargs), found_inf, skipped)

    def step_on_device(
        self, optimizer: Any, found_inf: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> StepOutcome | None:
        """``step_on_device`` (`polyamp.backend_api.OptionalMethods`): a step that is not fused, committed on the device
        (`polyamp_torch._masked_step`); fused optimizers already skip there, through their own `step`."""
        if fused_amp_capable(optimizer):
            return None
        return masked_step(optimizer, found_inf, args, kwargs)

    def step_own_scaling(self, optimizer: Any, scaler: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """torch's legacy protocol: an optimizer with ``_step_supports_amp_scaling`` whose ``step`` takes
        ``grad_scaler`` gets the scaler itself and does its own unscaling, as with GradScaler."""
        if not (getattr(optimizer, "_step_supports_amp_scaling", False) and takes_grad_scaler(type(optimizer))):
            return NotImplemented
        warnings.warn(
            "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the "
            "near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed "
            "optimizer and let the optimizer use them directly. (polyamp hands over the LossScaler, whose "
            "public unscale_() and get_scale() such an optimizer may use.)",
            FutureWarning,
            stacklevel=4,
        )
        return optimizer.step(*args, **dict(kwargs, grad_scaler=scaler))

    def plain_step(self, optimizer: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        return optimizer.step(*args, **kwargs)

    def combine(self, flags: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(flags) == 1:
            return flags[0]
        device = flags[0].device
        # The largest, not the sum: torch's fused optimizers skip only when found_inf is exactly 1.0, so two set
        # flags (an overflow on a loss spike) must combine to 1.0, not 2.0, which they would apply.
        return torch.stack([flag.to(device, non_blocking=True) for flag in flags]).amax()

    def update(self, found_inf: torch.Tensor | None, new_scale: Any) -> None:
        state = self._state
        if state is None:
            raise ScalerUsageError("update() was called before the scaler created its state with scale().")
        if self._state_traced and not torch.compiler.is_compiling():
            # The state was made by the first compiled call, as that graph's outputs: under CUDA graphs
            # (mode="reduce-overhead") a later replay would overwrite them. This update runs outside the trace,
            # so the state is moved into tensors of its own once.
            self._state_traced = False
            for name in ("scale", "growth_tracker", "hysteresis_left", "skipped"):
                setattr(state, name, _kept(getattr(state, name)))
        # The core passes the finite flag for an iteration the host knows was finite.
        finite = found_inf is not None and found_inf is self._state_finite
        if found_inf is not None and not finite and found_inf.device != state.scale.device:
            found_inf = found_inf.to(state.scale.device, non_blocking=True)
        if new_scale is not None:
            self._set_scale(state, new_scale)
        elif found_inf is not None:
            advance(state, found_inf, self._config, finite=finite)
        if found_inf is not None and not finite:
            self._count(state, found_inf)

    def read_new_scale(self, new_scale: Any) -> float | None:
        if (
            not isinstance(new_scale, torch.Tensor)
            or new_scale.numel() != 1
            or new_scale.requires_grad
            or not new_scale.is_floating_point()
        ):
            raise PolyampTypeError(
                "update(new_scale) takes a float or a one-element floating tensor with requires_grad=False. "
                f"Received: {describe(new_scale)}"
                + (
                    f", shape {tuple(new_scale.shape)}, dtype {new_scale.dtype}, requires_grad={new_scale.requires_grad}."
                    if isinstance(new_scale, torch.Tensor)
                    else "."
                )
            )
        return None if torch.compiler.is_compiling() else float(new_scale.item())

    def _set_scale(self, state: DeviceState, new_scale: Any) -> None:
        if isinstance(new_scale, torch.Tensor):
            state.scale.copy_(new_scale.reshape(()))
            return
        if isinstance(new_scale, bool) or not isinstance(new_scale, numbers.Real) or not math.isfinite(new_scale):
            raise InvalidConfigError(
                f"update(new_scale) needs a finite positive scale. Received: {describe(new_scale)}."
            )
        state.scale.fill_(float(new_scale))

    # -- records (the rest: `RecordMethods`) ----------------------------------------------------------------

    def finite_flag(self) -> torch.Tensor:
        """A zero flag, one per device, made once: flags are only read (records, combine, counts), never
        written in place, and the user gets ``flag > 0``, a new tensor. `update` given it knows the iteration
        was finite: the scale can only stay or grow, so the floor's clamp and the skip count are left out."""
        flag = self._state_finite
        if flag is not None:
            return flag
        state = self._state
        device = state.scale.device if state is not None else _CPU
        flag = self._finite_flags.get(device)
        if flag is None:
            flag = self._finite_flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        if state is not None:
            self._state_finite = flag
        return flag

    def skipped_steps(self) -> torch.Tensor:
        """The count as of this call: a tensor of its own on the state's device (no host read)."""
        state = self._state
        if state is None:
            return torch.zeros((), dtype=torch.int64)
        self._add_uncounted(state)
        return state.skipped.clone()


#: The attribute torch's fused optimizers set (`fused_amp_capable` reads it first).
_FUSED_FLAG = "_step_supports_amp_scaling"

#: How many skip flags `TorchDevice._count` keeps before adding them to the count.
_COUNT_BATCH = 64


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in float32, as GradScaler computes it (in float64, then rounded; MPS has no float64)."""
    return scale.reciprocal() if scale.device.type == "mps" else scale.double().reciprocal().float()
