"""`prepare_accelerator`: polyamp's loss scaler in a Hugging Face Accelerate ``Accelerator``.

Importing this module imports Accelerate; without it installed it raises ``polyamp.BackendNotInstalledError``
(an ``ImportError``) saying ``pip install accelerate``. ``import polyamp_torch`` never imports it.
"""

from __future__ import annotations

from typing import Any

from polyamp import LossScaler, PolyampTypeError, PolyampValueError, ScalerUsageError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.versions import import_framework
from polyamp_torch._integration import check_scaler_arguments
from polyamp_torch._scaler import TorchLossScaler

import_framework(
    "accelerate",
    "polyamp_torch.accelerate",
    "Accelerate",
    "Install it with: pip install accelerate (or pip install 'polyamp[hf]').",
)
import accelerate  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["prepare_accelerator"]

#: Distributed setups whose engine scales the loss itself (or shards gradients, which needs a process group).
_REFUSED = {
    DistributedType.DEEPSPEED: "DeepSpeed scales the loss inside its engine",
    DistributedType.MEGATRON_LM: "Megatron-LM scales the loss inside its engine",
    DistributedType.XLA: "XLA devices use torch_xla's own GradScaler",
}


def prepare_accelerator(
    accelerator: Any,
    scaler: LossScaler | None = None,
    *,
    guard: bool | None = None,
    spike: Any = None,
) -> LossScaler:
    """Put polyamp's loss scaler in ``accelerator`` in place of Accelerate's ``torch.amp.GradScaler``.

    Call it after creating the ``Accelerator`` and before ``accelerator.prepare(...)``:

        accelerator = Accelerator(mixed_precision="fp16")   # or "bf16"
        scaler = polyamp_torch.accelerate.prepare_accelerator(accelerator)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for x, y in loader:
            with accelerator.autocast():
                loss = loss_fn(model(x), y)
            accelerator.backward(loss)                      # scaler.scale(loss).backward()
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # unscales first (fp16)
            optimizer.step()                                # scaler.step + scaler.update; skipped on inf/NaN
            optimizer.zero_grad()
        scaler.records(), scaler.skipped_steps()

    Accelerate calls the scaler the way it calls its GradScaler: ``scale`` in ``accelerator.backward``,
    ``unscale_`` in ``accelerator.unscale_gradients`` / ``clip_grad_norm_`` (under fp16), ``step(optimizer,
    closure)`` then ``update()`` in the prepared optimizer's ``step``, ``state_dict``/``load_state_dict`` in
    ``save_state``/``load_state``; ``optimizer.step_was_skipped`` and ``accelerator.optimizer_step_was_skipped``
    report polyamp's skips, and gradient accumulation scales each micro-batch and steps once, as with
    GradScaler.

    Under ``mixed_precision="fp16"`` the scaler scales, with the settings of the GradScaler Accelerate made
    (its ``GradScalerKwargs``). Under ``"bf16"`` or ``"no"``, where Accelerate has no scaler, it does not scale
    but guards: a step whose gradients hold inf or NaN is skipped (reason ``"non_finite"``), bitwise unchanged
    otherwise. Accelerate runs fp16 only on accelerators: on the CPU it neither autocasts nor scales, so
    there this function needs an explicit ``scaler`` (and the forward pass a region such as
    `polyamp_torch.autocast`), or use ``"bf16"``.

    Args:
        accelerator: An ``accelerate.Accelerator`` that has not prepared an optimizer yet.
        scaler: The `polyamp.LossScaler` to install. None (default) creates a `polyamp_torch.TorchLossScaler`
            as described above; ``guard`` and ``spike`` go to it.
        guard: For the scaler created here: whether steps that are not scaled still skip on inf/NaN gradients.
            None (default) means True.
        spike: For the scaler created here: a `polyamp.SpikeRule` that also skips outlier steps.

    Returns:
        The installed scaler (also ``accelerator.scaler``), for its records and skip counts.

    Raises:
        PolyampTypeError: ``accelerator`` is not an ``accelerate.Accelerator``, ``scaler`` is not a
            `polyamp.LossScaler` for torch, or ``guard``/``spike`` are given with a ``scaler``.
        ScalerUsageError: ``accelerator.prepare`` already prepared an optimizer (it keeps the scaler it saw).
        PolyampValueError: the setup scales the loss in its own engine (DeepSpeed, Megatron-LM), runs on XLA,
            shards gradients (FSDP) without an explicit scaler, or uses fp8; or fp16 on the CPU without an
            explicit scaler.
    """
    if not isinstance(accelerator, accelerate.Accelerator):
        raise PolyampTypeError(
            f"prepare_accelerator takes an accelerate.Accelerator. Received: {describe(accelerator)}. Create it "
            "first, e.g. Accelerator(mixed_precision='fp16'), and call prepare_accelerator before prepare()."
        )
    check_scaler_arguments("prepare_accelerator", scaler, guard, spike)
    if getattr(accelerator, "_optimizers", None):
        raise ScalerUsageError(
            "prepare_accelerator was called after accelerator.prepare() prepared an optimizer: the prepared "
            "optimizer keeps the scaler it saw then. Call prepare_accelerator(accelerator) right after creating "
            "the Accelerator, before prepare()."
        )
    distributed = accelerator.distributed_type
    if distributed in _REFUSED:
        raise PolyampValueError(
            f"prepare_accelerator does not support Accelerate's {distributed.value} setup: {_REFUSED[distributed]}. "
            "Use Accelerate's own mixed precision there."
        )
    precision = str(accelerator.mixed_precision)
    if precision not in ("fp16", "bf16", "no"):
        raise PolyampValueError(
            f"prepare_accelerator supports mixed_precision 'fp16', 'bf16' or 'no'. Received: {precision!r}. "
            "fp8 training keeps Accelerate's own recipe."
        )
    if scaler is not None:
        accelerator.scaler = scaler
        return scaler
    if distributed in (DistributedType.FSDP,):
        raise PolyampValueError(
            "Under FSDP each rank holds a shard of the gradients, so the skip must be decided over all ranks. Pass "
            "scaler=polyamp_torch.TorchLossScaler(process_group=torch.distributed.group.WORLD) (plus guard/spike "
            "settings) to prepare_accelerator."
        )
    native = accelerator.scaler
    device = accelerator.device.type
    if precision == "fp16":
        if native is None:
            raise PolyampValueError(
                f"Accelerate runs fp16 only on accelerators; on this {device!r} device it neither autocasts nor "
                "scales (accelerator.scaler is None). Use mixed_precision='bf16' on the CPU, or pass "
                "scaler=polyamp_torch.TorchLossScaler('cpu') and run the forward pass in "
                "polyamp_torch.autocast('mixed_float16')."
            )
        enabled = bool(native.is_enabled())
        created = TorchLossScaler(device, enabled=enabled, guard=guard, spike=spike)
        if enabled:
            created.load_state_dict(native.state_dict())  # GradScalerKwargs' settings, as Accelerate applied them
    else:
        created = TorchLossScaler(device, enabled=False, guard=True if guard is None else guard, spike=spike)
    accelerator.scaler = created
    return created
