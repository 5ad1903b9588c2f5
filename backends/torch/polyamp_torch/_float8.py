"""FP8 linear layers for PyTorch: ``nn.Linear`` whose three matmuls run through ``torch._scaled_mm``.

`apply_policy` under a policy with a `polyamp.Float8Recipe` turns each eligible ``nn.Linear`` into a
`Float8Linear` in place (its class changes; its parameters, their ``state_dict`` keys, hooks and the optimizer
holding them stay). The casts are the core's device rules (`polyamp.backend_api.rules.fp8`) over `TorchOps`;
the matmuls take the operands and scales as torchao's ``Float8Linear`` gives them to ``torch._scaled_mm``, so
the two compute the same values. MX runs emulated: the values are cast to FP8 and back with their block
exponents, and multiplied in the compute dtype.

Delayed scaling keeps, per operand, an amax history and a scale as buffers (in ``state_dict``); they change
in training mode only: the input's and weight's in the forward, the grad-output's in the backward.
"""

from __future__ import annotations

from typing import Any

from polyamp import Float8Recipe
from polyamp.backend_api.records import Float8CastRecord, cast_records
from polyamp.backend_api.rules import fp8
from polyamp.backend_api.state_dicts import LayerState, delayed_recipe, pack_float8_state, parse_float8_state
from polyamp_torch._framework import torch
from polyamp_torch._rule import OPS

__all__ = [
    "Float8Linear",
    "Float8Recorder",
    "convert",
    "float8_state_dict",
    "load_float8_state_dict",
    "record_float8",
    "restore",
]

_ROLES = ("input", "weight", "grad_output")


def _dtype(fmt: fp8.Float8Format) -> torch.dtype:
    return getattr(torch, fmt.dtype)  # type: ignore[no-any-return]


def _cast(
    x: torch.Tensor, scale: torch.Tensor, fmt: fp8.Float8Format, counts: torch.Tensor | None, row: int, *, divide: bool
) -> torch.Tensor:
    """``x`` cast with ``scale`` (`polyamp.backend_api.rules.fp8.quantize`); with ``counts``, what the cast
    lost is added to its row ``row``."""
    values = fp8.scaled(OPS, x.detach(), scale, divide=divide)
    cast = fp8.saturating_cast(OPS, values, fmt)
    if counts is not None:
        with torch.no_grad():
            counts[row] += fp8.cast_counts(OPS, x.detach(), values, cast, fmt)
    return cast  # type: ignore[no-any-return]


def _current(
    x: torch.Tensor,
    fmt: fp8.Float8Format,
    axis: int | None,
    power_of_two: bool,
    counts: torch.Tensor | None = None,
    row: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast with its own scale (one, or one per slice along ``axis``): the FP8 values and the
    dequantizing scale ``scale.reciprocal()`` that ``torch._scaled_mm`` multiplies by."""
    scale = fp8.scale_from_amax(OPS, fp8.amax(OPS, x.detach(), axis), fmt, power_of_two=power_of_two)
    return _cast(x, scale, fmt, counts, row, divide=False), scale.reciprocal()


def _row_major(a: torch.Tensor) -> torch.Tensor:
    return a if a.stride(1) == 1 and a.stride(0) >= a.shape[1] else a.contiguous()


def _column_major(b: torch.Tensor) -> torch.Tensor:
    return b if b.stride(0) == 1 and b.stride(1) >= b.shape[0] else b.t().contiguous().t()


def _scaled_mm(
    a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool
) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` in ``out_dtype`` through ``torch._scaled_mm``, as torchao calls it: rowwise
    scales without fast accumulation are applied after a tensorwise kernel, and a rowwise product in float32
    or float16 is computed in bfloat16 (the kernel's output dtype) and cast."""
    a, b = _row_major(a), _column_major(b)
    if a_inv.dim() == 0 and b_inv.dim() == 2:
        a_inv = a_inv.repeat(a.shape[0]).reshape(-1, 1)
    elif a_inv.dim() == 2 and b_inv.dim() == 0:
        b_inv = b_inv.repeat(b.shape[1]).reshape(1, -1)
    rowwise = a_inv.dim() == 2
    after = None
    if rowwise and not fast_accum:
        after = a_inv * b_inv
        a_inv = b_inv = a_inv.new_ones(())
    kernel_dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    if not _native(a.device):
        out = torch.mm(a.float() * a_inv, b.float() * b_inv).to(kernel_dtype)
    else:
        out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=kernel_dtype, use_fast_accum=fast_accum)
    if after is not None:
        out = out * after
    return out.to(out_dtype)


def _native(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device``: the CPU, and CUDA GPUs of compute capability 8.9 or
    newer (elsewhere the matmul is emulated in float32 with the same casts)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return False


def _mx(
    x: torch.Tensor, fmt: fp8.Float8Format, recipe: Float8Recipe, counts: torch.Tensor | None = None, row: int = 0
) -> torch.Tensor:
    """``x`` (2-D) cast to MX along its last axis (zero-padded to whole blocks) and back, in ``x``'s dtype;
    with ``counts``, what the cast lost is added to its row ``row``."""
    columns = x.shape[1]
    pad = -columns % recipe.mx_block
    wide = torch.nn.functional.pad(x.detach().float(), (0, pad)) if pad else x.detach().float()
    exponents, scaled = fp8.mx_scaled(OPS, wide, fmt, block=recipe.mx_block, rounding=recipe.mx_rounding)
    values = fp8.saturating_cast(OPS, scaled, fmt)
    if counts is not None:
        with torch.no_grad():
            counts[row] += fp8.cast_counts(OPS, wide, scaled, values, fmt)
    back = fp8.mx_dequantize(OPS, exponents, values, block=recipe.mx_block)
    return back[:, :columns].to(x.dtype)  # type: ignore[no-any-return]


class _Float8Matmul(torch.autograd.Function):
    """``x @ w.T`` with the recipe's FP8 casts in the forward and the backward (dynamic or MX scaling)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe, counts: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.counts = recipe, counts
        formats = [fp8.FORMATS[recipe.format_of(role)] for role in _ROLES]
        if recipe.granularity == "mx":
            return torch.mm(
                _mx(x, formats[0], recipe, counts, 0), _mx(weight.to(x.dtype), formats[1], recipe, counts, 1).t()
            )
        axis = None if recipe.granularity == "tensor" else -1
        a, a_inv = _current(x, formats[0], axis, recipe.power_of_two, counts, 0)
        b, b_inv = _current(weight, formats[1], axis, recipe.power_of_two, counts, 1)
        return _scaled_mm(a, a_inv, b.t(), b_inv.t() if axis is not None else b_inv, x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight = ctx.saved_tensors
        recipe: Float8Recipe = ctx.recipe
        formats = [fp8.FORMATS[recipe.format_of(role)] for role in _ROLES]
        if recipe.granularity == "mx":
            grad_input = torch.mm(
                _mx(grad, formats[2], recipe, ctx.counts, 2), _mx(weight.to(grad.dtype).t(), formats[1], recipe).t()
            )
            grad_weight = torch.mm(_mx(grad.t(), formats[2], recipe), _mx(x.t(), formats[0], recipe).t())
            return grad_input, grad_weight.to(weight.dtype), None, None
        row = recipe.granularity == "row"
        g, g_inv = _current(grad, formats[2], -1 if row else None, recipe.power_of_two, ctx.counts, 2)
        weight_rows = row and not recipe.grad_weight_high_precision
        w, w_inv = _current(weight, formats[1], 0 if weight_rows else None, recipe.power_of_two)
        grad_input = _scaled_mm(g, g_inv, w, w_inv, grad.dtype, fast_accum=False)
        if recipe.grad_weight_high_precision:
            grad_weight = torch.mm(grad.t(), x)
        else:
            gt, gt_inv = _current(grad, formats[2], 0 if row else None, recipe.power_of_two)
            xt, xt_inv = _current(x, formats[0], 0 if row else None, recipe.power_of_two)
            grad_weight = _scaled_mm(gt.t(), gt_inv.t() if row else gt_inv, xt, xt_inv, grad.dtype, fast_accum=False)
        return grad_input, grad_weight.to(weight.dtype), None, None


class _DelayedMatmul(torch.autograd.Function):
    """``x @ w.T`` under delayed scaling: each operand cast with its stored scale (divided by it), the next
    scale and amax history written to the layer's buffers in training mode (Keras's and Flax's rule)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, layer: Float8Linear) -> torch.Tensor:
        xq, x_scale = layer._delayed_cast("input", x)
        wq, w_scale = layer._delayed_cast("weight", weight)
        ctx.save_for_backward(xq, wq, x_scale, w_scale)
        ctx.layer, ctx.weight_dtype = layer, weight.dtype
        return _scaled_mm(xq, x_scale, wq.t(), w_scale, x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        xq, wq, x_scale, w_scale = ctx.saved_tensors
        gq, g_scale = ctx.layer._delayed_cast("grad_output", grad)
        grad_input = _scaled_mm(gq, g_scale, wq, w_scale, grad.dtype, fast_accum=False)
        grad_weight = _scaled_mm(gq.t(), g_scale, xq, x_scale, grad.dtype, fast_accum=False)
        return grad_input, grad_weight.to(ctx.weight_dtype), None


class Float8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose matmuls run in FP8 by ``float8_recipe`` (made by `apply_policy`, never built).

    The output is in the input's dtype (the policy's compute dtype under autocast), as ``nn.Linear`` under
    autocast gives it. Under delayed scaling the layer holds ``float8_<role>_amax_history`` and
    ``float8_<role>_scale`` buffers for ``role`` in input, weight, grad_output.
    """

    float8_recipe: Float8Recipe

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            input = input.to(torch.get_autocast_dtype(device_type))
        shape = input.shape
        flat = input.reshape(-1, shape[-1])
        with torch.autocast(device_type, enabled=False):
            if self.float8_recipe.scaling == "delayed":
                out = _DelayedMatmul.apply(flat, self.weight, self)  # type: ignore[no-untyped-call]
            else:
                out = _Float8Matmul.apply(flat, self.weight, self.float8_recipe, self._buffers.get("float8_counts"))  # type: ignore[no-untyped-call]
        out = out.reshape(*shape[:-1], out.shape[-1])
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out  # type: ignore[no-any-return]

    def _delayed_cast(self, role: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` cast with the role's stored scale, and that scale; in training mode the next scale and
        history are stored."""
        recipe = self.float8_recipe
        fmt = fp8.FORMATS[recipe.format_of(role)]
        history = getattr(self, f"float8_{role}_amax_history")
        scale = getattr(self, f"float8_{role}_scale")
        cast = _cast(x, scale, fmt, self._buffers.get("float8_counts"), _ROLES.index(role), divide=True)
        used = scale.clone()
        if self.training:
            with torch.no_grad():
                new_scale = fp8.delayed_scale(
                    OPS, history, scale, fmt, margin=recipe.margin, amax_compute=recipe.amax_compute
                )
                history.copy_(fp8.push_amax(OPS, history, fp8.amax(OPS, x.detach())))
                scale.copy_(new_scale)
        return cast, used

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8={self.float8_recipe.spec!r}"


def convert(linear: torch.nn.Linear, recipe: Float8Recipe) -> None:
    """Make ``linear`` a `Float8Linear` running ``recipe`` (in place; delayed scaling's buffers are added on
    the weight's device, kept when the recipe's history length is unchanged)."""
    previous = getattr(linear, "float8_recipe", None)
    linear.__class__ = Float8Linear
    linear.float8_recipe = recipe  # type: ignore[assignment]
    keep = (
        previous is not None
        and previous.scaling == "delayed"
        and previous.amax_history_length == recipe.amax_history_length
    )
    if recipe.scaling != "delayed":
        _drop_buffers(linear)
    elif not keep:
        device = linear.weight.device
        for role in _ROLES:
            linear.register_buffer(
                f"float8_{role}_amax_history",
                torch.zeros(recipe.amax_history_length, dtype=torch.float32, device=device),
            )
            linear.register_buffer(f"float8_{role}_scale", torch.ones((), dtype=torch.float32, device=device))


def restore(linear: torch.nn.Module) -> None:
    """Make a `Float8Linear` an ``nn.Linear`` again (its delayed-scaling buffers dropped)."""
    if isinstance(linear, Float8Linear):
        _drop_buffers(linear)
        del linear.float8_recipe
        linear.__class__ = torch.nn.Linear  # type: ignore[assignment]


def _drop_buffers(linear: torch.nn.Module) -> None:
    linear._buffers.pop("float8_counts", None)
    for role in _ROLES:
        for what in ("amax_history", "scale"):
            linear._buffers.pop(f"float8_{role}_{what}", None)


class Float8Recorder:
    """Reads the FP8 cast counts of a model's `Float8Linear` layers (see `record_float8`)."""

    def __init__(self, layers: dict[str, Float8Linear]) -> None:
        self.layers = layers

    def read(self, *, reset: bool = True) -> dict[str, dict[str, Float8CastRecord]]:
        """Each layer's `polyamp.backend_api.records.Float8CastRecord` per operand (input, weight,
        grad_output) since the last read, in one host read for all layers; ``reset`` zeroes the counts."""
        if not self.layers:
            return {}
        counts: list[torch.Tensor] = [layer.float8_counts for layer in self.layers.values()]  # type: ignore[misc]
        values = torch.stack([c.to(counts[0].device) for c in counts]).tolist()
        if reset:
            for c in counts:
                c.zero_()
        return cast_records(list(self.layers), values)


def record_float8(model: torch.nn.Module) -> Float8Recorder:
    """Count, on the device, what the FP8 layers' casts lose: for the input and weight casts of the forward
    and the grad-output cast of the backward (under MX, the grad-input matmul's), the values that saturated,
    the nonzero values flushed to zero and the nonzero values. Nothing is read to the host until
    `Float8Recorder.read`.

    Example:
        ```python
        records = polyamp_torch.record_float8(model)
        ...  # train
        for layer, roles in records.read().items():
            print(layer, roles["grad_output"].flushed_fraction, roles["input"].saturated)
        ```
    """
    layers = {}
    for name, sub in model.named_modules():
        if isinstance(sub, Float8Linear):
            if "float8_counts" not in sub._buffers:
                counts = torch.zeros(len(_ROLES), 3, dtype=torch.int64, device=sub.weight.device)
                sub.register_buffer("float8_counts", counts, persistent=False)
            layers[name or type(model).__name__] = sub
    return Float8Recorder(layers)


def _delayed_layers(model: torch.nn.Module, caller: str) -> tuple[Float8Recipe, dict[str, Float8Linear]]:
    """The model's delayed-scaling FP8 layers by name, and their one recipe."""
    layers = {
        name or type(model).__name__: sub
        for name, sub in model.named_modules()
        if isinstance(sub, Float8Linear) and sub.float8_recipe.scaling == "delayed"
    }
    recipes = {name: layer.float8_recipe for name, layer in layers.items()}
    return delayed_recipe(recipes, caller, "polyamp_torch.apply_policy(model, ...)"), layers


def float8_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """Delayed scaling's state of ``model``'s FP8 layers (each operand's amax history and scale) as plain
    Python values that `load_float8_state_dict` of any polyamp backend (``polyamp_keras``, ``polyamp_jax``)
    loads: the way a run moves between frameworks. The model's own ``state_dict`` keeps the same state as
    buffers for checkpoints within PyTorch.

    Raises:
        PolyampValueError: the model has no delayed-scaling FP8 layer, or layers with different recipes.
    """
    recipe, layers = _delayed_layers(model, "float8_state_dict()")
    state: dict[str, LayerState] = {
        name: {
            role: (
                getattr(layer, f"float8_{role}_amax_history").tolist(),
                getattr(layer, f"float8_{role}_scale").item(),
            )
            for role in _ROLES
        }
        for name, layer in layers.items()
    }
    return pack_float8_state(recipe, state)


def load_float8_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load a state dict `float8_state_dict` made (here or in another framework) into ``model``'s
    delayed-scaling FP8 layers, matched by name.

    Raises:
        StateDictError: a malformed dict, layers that do not match, or histories of another length (nothing
            is loaded then).
        PolyampValueError: the model has no delayed-scaling FP8 layer.
    """
    recipe, layers = _delayed_layers(model, "load_float8_state_dict()")
    parsed = parse_float8_state(state, recipe, list(layers))
    with torch.no_grad():
        for name, layer in layers.items():
            for role, (history, scale) in parsed[name].items():
                getattr(layer, f"float8_{role}_amax_history").copy_(torch.tensor(history, dtype=torch.float32))
                getattr(layer, f"float8_{role}_scale").fill_(scale)
