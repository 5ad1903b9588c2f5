"""FP8 ``Dense`` and ``EinsumDense`` layers for Keras 3, on every Keras backend.

`apply_policy` under a policy with a `polyamp.Float8Recipe` turns each eligible layer into a `Float8Dense` or
`Float8EinsumDense` in place (its class changes; its variables, their names and the optimizer holding them
stay). The casts are the core's device rules (`polyamp.backend_api.rules.fp8`) over `KerasOps`.

* Delayed scaling (``float8_delayed``) is Keras's own ``quantize("float8")`` training with polyamp's rules:
  the layer gets Keras's float8 variables (``inputs_scale``, ``inputs_amax_history``, ``kernel_scale``, ...,
  in a ``QuantizedFloat8DTypePolicy`` with the recipe's history length), each operand is cast in the compute
  dtype with its stored dequantizing scale and dequantized, the matmul runs in the compute dtype, and the next
  scales and histories reach the variables as their "gradients" (Keras's ``overwrite_with_gradient``), so
  ``fit``, custom loops and checkpoints behave as Keras's float8 layers do, bit for bit.
* Dynamic scaling (``float8_tensorwise``, ``float8_rowwise``, ``float8_rowwise_gw_hp``) follows torchao: each
  matmul's operands are cast with scales from their own amaxes (per tensor, or per row along the contracted
  axis), the float32 kernel is cast (not its compute-dtype copy), the dequantized values are multiplied in
  float32 and the result is given in the compute dtype. ``EinsumDense`` takes the tensorwise recipe.
* MX (``mxfp8``) runs emulated on ``Dense``, as ``polyamp_torch`` runs it: each matmul's operands are cast to
  FP8 in blocks of 32 along the contracted axis sharing an E8M0 exponent (zero-padded to whole blocks) and
  back, and multiplied in the compute dtype.
"""

from __future__ import annotations

from typing import Any

from keras.dtype_policies import DTypePolicyMap, QuantizedFloat8DTypePolicy

# Keras exports no name for the scope that turns its variables' autocast off.
from keras.src.backend.common.variables import AutocastScope

from polyamp import Float8Recipe, InvalidPolicyError, PolyampValueError
from polyamp.backend_api.rules import fp8
from polyamp_keras._float8_counts import delivered
from polyamp_keras._keras import keras
from polyamp_keras._rule import OPS

__all__ = ["Float8Dense", "Float8EinsumDense", "convert_layers", "plan_layers"]

ops = keras.ops
_ROLES = ("input", "weight", "grad_output")
#: The recipes ``EinsumDense`` runs, for the error naming them (``Dense`` runs every recipe).
_EINSUM_RECIPES = ("float8_tensorwise", "float8_delayed")


def _format(recipe: Float8Recipe, role: str) -> fp8.Float8Format:
    return fp8.FORMATS[recipe.format_of(role)]


# -- the casts ------------------------------------------------------------------------------------------------


def current_cast(x: Any, fmt: fp8.Float8Format, axis: int | None, power_of_two: bool) -> tuple[Any, Any]:
    """``x`` cast with its own scale (one, or one per slice along ``axis``, kept with size 1): the FP8 values
    and the multiplying float32 scale (torchao's ``tensor_to_scale`` and ``to_fp8_saturated``)."""
    scale = fp8.scale_from_amax(OPS, fp8.amax(OPS, x, axis), fmt, power_of_two=power_of_two)
    return fp8.quantize(OPS, x, scale, fmt), scale


def _current_dequantized(
    x: Any, fmt: fp8.Float8Format, axis: int | None, power_of_two: bool, found: list[Any] | None = None
) -> Any:
    """``x`` cast with its own scale and back to float32: the FP8 values times the scale's reciprocal, the
    operand ``torch._scaled_mm`` multiplies; with ``found``, what the cast lost is appended to it."""
    x = ops.stop_gradient(x)
    scale = fp8.scale_from_amax(OPS, fp8.amax(OPS, x, axis), fmt, power_of_two=power_of_two)
    values = fp8.scaled(OPS, x, scale)
    cast = fp8.saturating_cast(OPS, values, fmt)
    if found is not None:
        found.append(fp8.cast_counts(OPS, x, values, cast, fmt))
    return ops.cast(cast, "float32") * ops.divide(ops.ones_like(scale), scale)


def _mx_dequantized(
    x: Any, fmt: fp8.Float8Format, recipe: Float8Recipe, dtype: str, found: list[Any] | None = None
) -> Any:
    """``x`` (2-D) cast to MX along its last axis (zero-padded to whole blocks) and back, in ``dtype``: the
    values scaled by their blocks' E8M0 exponents (NaN for a block holding NaN), cast, and multiplied back;
    with ``found``, what the cast lost is appended to it."""
    x = ops.cast(ops.stop_gradient(x), "float32")
    columns = int(x.shape[-1])
    block = recipe.mx_block
    pad = -columns % block
    wide = ops.pad(x, [[0, 0], [0, pad]]) if pad else x
    exponents, scaled = fp8.mx_scaled(OPS, wide, fmt, block=block, rounding=recipe.mx_rounding)
    cast = fp8.saturating_cast(OPS, scaled, fmt)
    if found is not None:
        found.append(fp8.cast_counts(OPS, wide, scaled, cast, fmt))
    back = fp8.mx_dequantize(OPS, exponents, cast, block=block)
    return ops.cast(back[:, :columns], dtype)


def _delayed_dequantized(
    x: Any, scale: Any, fmt: fp8.Float8Format, compute_dtype: str, found: list[Any] | None = None
) -> Any:
    """``x`` cast with delayed scaling's stored dequantizing ``scale`` and dequantized, both in the compute
    dtype (Keras's ``quantize_and_dequantize``); with ``found``, what the cast lost is appended to it."""
    values = fp8.scaled(OPS, x, scale, divide=True, dtype=compute_dtype)
    cast = fp8.saturating_cast(OPS, values, fmt)
    if found is not None:
        found.append(fp8.cast_counts(OPS, x, values, cast, fmt))
    return ops.multiply(ops.cast(cast, compute_dtype), ops.cast(scale, compute_dtype))


def _next_delayed(history: Any, scale: Any, x: Any, fmt: fp8.Float8Format, recipe: Float8Recipe) -> tuple[Any, Any]:
    """The next scale (from the history as it is) and the history with ``x``'s amax pushed."""
    new_scale = fp8.delayed_scale(OPS, history, scale, fmt, margin=recipe.margin, amax_compute=recipe.amax_compute)
    return new_scale, fp8.push_amax(OPS, history, fp8.amax(OPS, x))


def _tensor(variable: Any) -> Any:
    """A variable's value (autocast as Keras reads it) as a tensor: TensorFlow's eager custom gradients
    take a variable read inside them for one they must return a gradient for."""
    return ops.copy(ops.convert_to_tensor(variable))


def _upstream(args: tuple[Any, ...], upstream: Any) -> Any:
    if upstream is None:
        (upstream,) = args
    return upstream


# -- the matmuls ----------------------------------------------------------------------------------------------


def _dynamic_matmul(x: Any, kernel: Any, recipe: Float8Recipe, counts: tuple[Any, ...] = ()) -> Any:
    """``x @ kernel`` (``x`` 2-D in the compute dtype, ``kernel`` float32 ``(in, out)``) with ``recipe``'s
    current-scaling casts in the forward and in the backward, in float32; with ``counts`` (a recorded layer's
    ``float8_counts`` value), the new totals are its gradient."""
    formats = [_format(recipe, role) for role in _ROLES]
    row = recipe.granularity == "row"
    p2 = recipe.power_of_two

    @ops.custom_gradient  # type: ignore[untyped-decorator]
    def matmul(x: Any, kernel: Any, *counts: Any) -> tuple[Any, Any]:
        found: list[Any] | None = [] if counts else None
        out = ops.matmul(
            _current_dequantized(x, formats[0], -1 if row else None, p2, found),
            _current_dequantized(kernel, formats[1], 0 if row else None, p2, found),
        )

        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> tuple[Any, ...]:
            g = _upstream(args, upstream)
            weight_rows = row and not recipe.grad_weight_high_precision
            found_grad: list[Any] | None = [] if counts else None
            grad_input = ops.matmul(
                _current_dequantized(g, formats[2], -1 if row else None, p2, found_grad),
                ops.transpose(_current_dequantized(kernel, formats[1], 1 if weight_rows else None, p2)),
            )
            if recipe.grad_weight_high_precision:
                grad_weight = ops.matmul(ops.transpose(x), ops.cast(g, x.dtype))
            else:
                grad_weight = ops.matmul(
                    ops.transpose(_current_dequantized(x, formats[0], 0 if row else None, p2)),
                    _current_dequantized(g, formats[2], 0 if row else None, p2),
                )
            return (
                ops.cast(grad_input, x.dtype),
                ops.cast(grad_weight, kernel.dtype),
                *_delivered(counts, found, found_grad),
            )

        return ops.cast(out, x.dtype), grad

    return matmul(x, kernel, *counts)


def _delivered(counts: tuple[Any, ...], found: list[Any] | None, found_grad: list[Any] | None) -> tuple[Any, ...]:
    """The gradient of a matmul's ``counts`` input (none without one): the input's and weight's counts
    ``found`` in the forward, the grad-output's in the backward."""
    if not counts or found is None or found_grad is None:
        return ()
    return (delivered(counts[0], {0: found[:1], 1: found[1:], 2: found_grad}),)


def _mx_matmul(x: Any, kernel: Any, recipe: Float8Recipe, counts: tuple[Any, ...] = ()) -> Any:
    """``x @ kernel`` (``x`` 2-D in the compute dtype, ``kernel`` ``(in, out)``) with MX casts along each
    matmul's contracted axis, emulated in the compute dtype as ``polyamp_torch`` runs MX; with ``counts``, the
    new totals of the input's, weight's and grad-input matmul's grad-output casts are its gradient."""
    fx, fw, fg = (_format(recipe, role) for role in _ROLES)

    @ops.custom_gradient  # type: ignore[untyped-decorator]
    def matmul(x: Any, kernel: Any, *counts: Any) -> tuple[Any, Any]:
        dtype = x.dtype
        weight = ops.transpose(ops.cast(kernel, dtype))  # (out, in), rounded to the compute dtype first
        found: list[Any] | None = [] if counts else None
        out = ops.matmul(
            _mx_dequantized(x, fx, recipe, dtype, found),
            ops.transpose(_mx_dequantized(weight, fw, recipe, dtype, found)),
        )

        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> tuple[Any, ...]:
            g = ops.cast(_upstream(args, upstream), dtype)
            found_grad: list[Any] | None = [] if counts else None
            grad_input = ops.matmul(
                _mx_dequantized(g, fg, recipe, dtype, found_grad),
                ops.transpose(_mx_dequantized(ops.transpose(weight), fw, recipe, dtype)),
            )
            grad_kernel = ops.matmul(
                _mx_dequantized(ops.transpose(x), fx, recipe, dtype),
                ops.transpose(_mx_dequantized(ops.transpose(g), fg, recipe, dtype)),
            )
            return grad_input, ops.cast(grad_kernel, kernel.dtype), *_delivered(counts, found, found_grad)

        return out, grad

    return matmul(x, kernel, *counts)


def _counts_grad(counts: tuple[Any, ...], role: str, found: list[Any] | None) -> tuple[Any, ...]:
    """The gradient of a cast's ``counts`` input (none without one: a recorded layer's ``float8_counts``
    value): ``role``'s row with the counts ``found`` added."""
    if not counts or found is None:
        return ()
    return (delivered(counts[0], {_ROLES.index(role): found}),)


def _with_counts(grad: Any, counts: tuple[Any, ...], role: str, found: list[Any] | None) -> Any:
    """``grad``, with the gradient of ``counts`` after it when there is one."""
    extra = _counts_grad(counts, role, found)
    return (grad, *extra) if extra else grad


def _tensorwise_qdq(x: Any, recipe: Float8Recipe, role: str, counts: tuple[Any, ...] = ()) -> Any:
    """``x`` cast with its own tensorwise scale and dequantized (float32), the gradient passing straight
    through (the backward re-casts it with the same scale, as torchao's tensorwise recipe does)."""

    @ops.custom_gradient  # type: ignore[untyped-decorator]
    def qdq(x: Any, *counts: Any) -> tuple[Any, Any]:
        found: list[Any] | None = [] if counts else None
        out = _current_dequantized(x, _format(recipe, role), None, recipe.power_of_two, found)

        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
            return _with_counts(ops.cast(_upstream(args, upstream), x.dtype), counts, role, found)

        return out, grad

    return qdq(x, *counts)


def _tensorwise_grad_qdq(y: Any, recipe: Float8Recipe, counts: tuple[Any, ...] = ()) -> Any:
    """``y`` unchanged (in float32); its gradient cast with its own tensorwise scale and dequantized."""

    @ops.custom_gradient  # type: ignore[untyped-decorator]
    def qdq(y: Any, *counts: Any) -> tuple[Any, Any]:
        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
            g = _upstream(args, upstream)
            found: list[Any] | None = [] if counts else None
            out = _current_dequantized(g, _format(recipe, "grad_output"), None, recipe.power_of_two, found)
            return _with_counts(out, counts, "grad_output", found)

        return y, grad

    return qdq(y, *counts)


class _Float8Layer:
    """What `Float8Dense` and `Float8EinsumDense` share: the recipe (in the config as its text), delayed
    scaling's casts, and the float32 kernel."""

    float8_recipe: Float8Recipe
    compute_dtype: str
    _kernel: Any
    bias: Any
    activation: Any
    dtype_policy: Any

    def _init_recipe(self, float8: Float8Recipe | dict[str, Any] | None) -> None:
        if float8 is None:
            float8 = Float8Recipe.preset("float8_tensorwise")
        self.float8_recipe = float8 if isinstance(float8, Float8Recipe) else Float8Recipe.from_dict(float8)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()  # type: ignore[misc]
        config["float8"] = self.float8_recipe.to_dict()
        return config

    def _float32_kernel(self) -> Any:
        """The kernel as stored (float32 variables are not rounded to the compute dtype first), as a tensor."""
        with AutocastScope(None):
            return ops.copy(self._kernel.value)  # a tensor: TensorFlow's custom gradients refuse variables

    def _delayed_qdq(self, x: Any, role: str, prefix: str, training: Any) -> Any:
        """``x`` quantized and dequantized with the stored scale of ``prefix`` (``"inputs"``, ``"kernel"``);
        in training, the next scale and history are the gradients of those variables."""
        recipe, compute = self.float8_recipe, self.compute_dtype
        fmt = _format(recipe, role)

        @ops.custom_gradient  # type: ignore[untyped-decorator]
        def qdq(x: Any, scale: Any, history: Any, *counts: Any) -> tuple[Any, Any]:
            new_scale, new_history = _next_delayed(history, scale, x, fmt, recipe) if training else (None, None)
            found: list[Any] | None = [] if counts else None
            out = _delayed_dequantized(x, scale, fmt, compute, found)

            def grad(*args: Any, upstream: Any = None, variables: Any = None) -> tuple[Any, ...]:
                return _upstream(args, upstream), new_scale, new_history, *_counts_grad(counts, role, found)

            return out, grad

        scale, history = (_tensor(getattr(self, f"{prefix}_{what}")) for what in ("scale", "amax_history"))
        return qdq(x, scale, history, *self._counts())

    def _delayed_grad_qdq(self, y: Any) -> Any:
        """``y`` unchanged; its gradient quantized and dequantized with the stored grad-output scale, whose
        next value and history are the gradients of those variables."""
        recipe, compute = self.float8_recipe, self.compute_dtype
        fmt = _format(recipe, "grad_output")

        @ops.custom_gradient  # type: ignore[untyped-decorator]
        def qdq(y: Any, scale: Any, history: Any, *counts: Any) -> tuple[Any, Any]:
            def grad(*args: Any, upstream: Any = None, variables: Any = None) -> tuple[Any, ...]:
                g = _upstream(args, upstream)
                new_scale, new_history = _next_delayed(history, scale, g, fmt, recipe)
                found: list[Any] | None = [] if counts else None
                out = _delayed_dequantized(g, scale, fmt, compute, found)
                return out, new_scale, new_history, *_counts_grad(counts, "grad_output", found)

            return y, grad

        return qdq(y, _tensor(self.outputs_grad_scale), _tensor(self.outputs_grad_amax_history), *self._counts())

    def _counts(self) -> tuple[Any, ...]:
        """The value of ``float8_counts`` once `polyamp_keras.record_float8` recorded the layer (none before)."""
        counts = getattr(self, "float8_counts", None)
        return () if counts is None else (_tensor(counts),)

    def _finish(self, x: Any) -> Any:
        """Bias and activation after a delayed-scaling matmul, as Keras's float8 layers add them (a float32
        bias is rounded through bfloat16, which Keras does for TensorFlow's bias-add fusion)."""
        if self.bias is not None:
            bias = self.bias
            if self.dtype_policy.compute_dtype == "float32":
                bias = ops.cast(ops.cast(bias, "bfloat16"), bias.dtype)
            x = ops.add(x, bias)
        if self.activation is not None:
            x = self.activation(x)
        return x

    outputs_grad_scale: Any
    outputs_grad_amax_history: Any


@keras.saving.register_keras_serializable(package="polyamp", name="Float8Dense")
class Float8Dense(_Float8Layer, keras.layers.Dense):  # type: ignore[misc]
    """A ``keras.layers.Dense`` whose matmul runs in FP8 by ``float8_recipe`` (made by `apply_policy`; its
    config holds the recipe, so it saves and loads as ``polyamp>Float8Dense``). Its class is named ``Dense``,
    as Keras's weights files name layers by class."""

    def __init__(self, *args: Any, float8: Float8Recipe | dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_recipe(float8)

    def call(self, inputs: Any, training: Any = None) -> Any:
        if self.lora_enabled:
            raise PolyampValueError(f"Float8Dense {self.name!r} cannot run with LoRA enabled; disable it first.")
        shape = ops.shape(inputs)
        flat = ops.reshape(inputs, (-1, shape[-1]))
        matmul = _mx_matmul if self.float8_recipe.granularity == "mx" else _dynamic_matmul
        out = matmul(flat, self._float32_kernel(), self.float8_recipe, self._counts())
        x = ops.reshape(out, (*shape[:-1], self.units))
        if self.bias is not None:
            x = ops.add(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x

    def _float8_call(self, inputs: Any, training: Any = None) -> Any:
        if self.lora_enabled:
            raise PolyampValueError(f"Float8Dense {self.name!r} cannot run with LoRA enabled; disable it first.")
        x = ops.matmul(
            self._delayed_qdq(inputs, "input", "inputs", training),
            self._delayed_qdq(_tensor(self._kernel), "weight", "kernel", training),
        )
        return self._finish(self._delayed_grad_qdq(x))


@keras.saving.register_keras_serializable(package="polyamp", name="Float8EinsumDense")
class Float8EinsumDense(_Float8Layer, keras.layers.EinsumDense):  # type: ignore[misc]
    """A ``keras.layers.EinsumDense`` whose einsum runs in FP8 by ``float8_recipe`` (tensorwise or delayed
    scaling; made by `apply_policy`, saved and loaded as ``polyamp>Float8EinsumDense``)."""

    def __init__(self, *args: Any, float8: Float8Recipe | dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_recipe(float8)

    def call(self, inputs: Any, training: Any = None) -> Any:
        if self.lora_enabled:
            raise PolyampValueError(f"Float8EinsumDense {self.name!r} cannot run with LoRA enabled; disable it first.")
        recipe = self.float8_recipe
        x = ops.einsum(
            self.equation,
            _tensorwise_qdq(inputs, recipe, "input", self._counts()),
            _tensorwise_qdq(self._float32_kernel(), recipe, "weight", self._counts()),
        )
        x = ops.cast(_tensorwise_grad_qdq(x, recipe, self._counts()), self.compute_dtype)
        if self.bias is not None:
            x = ops.add(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x

    def _float8_call(self, inputs: Any, training: Any = None) -> Any:
        if self.lora_enabled:
            raise PolyampValueError(f"Float8EinsumDense {self.name!r} cannot run with LoRA enabled; disable it first.")
        x = ops.einsum(
            self.equation,
            self._delayed_qdq(inputs, "input", "inputs", training),
            self._delayed_qdq(_tensor(self._kernel), "weight", "kernel", training),
        )
        return self._finish(self._delayed_grad_qdq(x))


# Keras's weights files name a model's layers by their class names: keeping Keras's names lets the weights of
# Keras's own (float8-quantized or plain) layers and of these load into each other.
Float8Dense.__name__ = Float8Dense.__qualname__ = "Dense"
Float8EinsumDense.__name__ = Float8EinsumDense.__qualname__ = "EinsumDense"

# -- conversion -----------------------------------------------------------------------------------------------

_PLAIN = {Float8Dense: keras.layers.Dense, Float8EinsumDense: keras.layers.EinsumDense}
_FLOAT8 = {plain: converted for converted, plain in _PLAIN.items()}


def _features(layer: Any) -> tuple[int, int]:
    """``(in_features, out_features)`` of a built layer: the kernel's contracted and kept sizes."""
    shape = tuple(int(n) for n in layer._kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        lhs, kernel_axes = layer.equation.split("->")[0].split(",")
        contracted = [n for axis, n in zip(kernel_axes.strip(), shape, strict=True) if axis in lhs]
        kept = [n for axis, n in zip(kernel_axes.strip(), shape, strict=True) if axis not in lhs]
        return _product(contracted), _product(kept)
    return shape[0], shape[1]


def _product(sizes: list[int]) -> int:
    result = 1
    for n in sizes:
        result *= n
    return result


def skip_reason(layer: Any, name: str, recipe: Float8Recipe) -> str | None:
    """Why ``layer`` (at ``name`` within the model) does not run ``recipe``, or None when it does."""
    if type(layer) not in _FLOAT8 and type(layer) not in _PLAIN:
        return "not a keras.layers.Dense or EinsumDense"
    if layer.quantization_mode not in (None, "float8"):
        return f"quantized by Keras ({layer.quantization_mode})"
    length = getattr(layer.dtype_policy, "amax_history_length", None)
    if layer.quantization_mode == "float8" and (recipe.scaling != "delayed" or recipe.amax_history_length != length):
        return f"Keras's float8 variables hold amax histories of length {length}"
    if not layer.built:
        return None  # refused by `_check` with a clear error
    return recipe.skip_reason(name, *_features(layer))


def _check(name: str, layer: Any, recipe: Float8Recipe | None) -> None:
    """Raise, before anything changes, for what no conversion can do."""
    current: Float8Recipe | None = getattr(layer, "float8_recipe", None)
    if (
        current is not None
        and current.scaling == "delayed"
        and (recipe is None or recipe.scaling != "delayed" or recipe.amax_history_length != current.amax_history_length)
    ):
        raise PolyampValueError(
            f"Layer {name!r} runs delayed FP8 scaling with Keras's float8 variables (scales and amax histories of "
            f"length {current.amax_history_length}), which a Keras layer cannot drop or resize. Received the "
            f"recipe {recipe.spec if recipe else None!r}. Build the model again and apply that policy before "
            "training (load its kernel and bias into it), or keep a delayed recipe of the same history length."
        )
    if recipe is None:
        return
    if isinstance(layer, keras.layers.EinsumDense) and recipe.granularity != "tensor":
        raise InvalidPolicyError(
            f"EinsumDense layer {name!r} cannot run the FP8 recipe {recipe.spec!r}: EinsumDense layers take "
            f"{', '.join(_EINSUM_RECIPES)} (one scale per tensor). Skip it with the recipe's skip patterns, e.g. "
            f"'{recipe.spec.partition('[')[0]}[skip={name}]', or use a tensorwise recipe."
        )
    if not layer.built:
        raise PolyampValueError(
            f"Layer {name!r} is not built, so its dimensions, which the FP8 recipe {recipe.spec!r} checks, are "
            "unknown. Build the model first (call it once, or model.build(input_shape)), then apply the policy."
        )


def plan_layers(layers: list[tuple[str, Any, Float8Recipe | None]]) -> list[tuple[Any, Float8Recipe | None]]:
    """The recipe each ``(name, layer, recipe)`` will run (None: plain), for `convert_layers`; an eligible
    ``Dense`` or ``EinsumDense`` takes its recipe unless the recipe skips it.

    Raises:
        InvalidPolicyError: a rowwise or MX recipe for an ``EinsumDense``.
        PolyampValueError: an eligible layer that is not built, or a delayed-scaling layer given another
            recipe.
    """
    plan = []
    for name, layer, recipe in layers:
        if type(layer) not in _FLOAT8 and type(layer) not in _PLAIN:
            continue
        own = recipe if recipe is not None and skip_reason(layer, name, recipe) is None else None
        _check(name, layer, own)
        plan.append((layer, own))
    return plan


def convert_layers(plan: list[tuple[Any, Float8Recipe | None]]) -> None:
    """Make each layer of a `plan_layers` plan a `Float8Dense` or `Float8EinsumDense` running its recipe, or
    plain again (delayed scaling's variables are made in the layer's dtype policy as it is now)."""
    for layer, recipe in plan:
        if recipe is None:
            _restore(layer)
        else:
            _convert(layer, recipe)


def _convert(layer: Any, recipe: Float8Recipe) -> None:
    if recipe.scaling == "delayed" and layer.quantization_mode is None:
        # Keras's own float8 variables, with the recipe's history length (its quantize reads the policy's).
        source = layer.dtype_policy
        if isinstance(source, DTypePolicyMap):
            source = source.default_policy
        layer._dtype_policy = QuantizedFloat8DTypePolicy(
            "float8", source_name=source.name, amax_history_length=recipe.amax_history_length
        )
        layer.quantize("float8")
    layer.__class__ = _FLOAT8.get(type(layer), type(layer))
    layer.float8_recipe = recipe


def _restore(layer: Any) -> None:
    if type(layer) in _PLAIN:
        del layer.float8_recipe
        layer.__class__ = _PLAIN[type(layer)]
