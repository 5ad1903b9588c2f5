"""polyamp's conformance harness for Keras 3 on the backend this process runs it on (TensorFlow, JAX or
PyTorch), through `polyamp_keras.LossScaleOptimizer` (see `polyamp.conformance`).

Keras picks its backend once per process, so the targets are ``keras-<backend>-<device>``, for the backend
of ``KERAS_BACKEND``: ``KERAS_BACKEND=jax python -m polyamp.conformance --backend keras`` runs the suite on
Keras-on-JAX. The training steps are the custom loops of polyamp's README, one per backend: a
``GradientTape`` on TensorFlow, ``backward()`` on PyTorch, ``jax.value_and_grad`` with ``stateless_apply``
on JAX, the whole step compiled with ``jax.jit`` as ``fit`` compiles it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import polyamp
from polyamp import Float8Recipe, Policy
from polyamp.conformance import HarnessBase, HarnessUnavailable, TrainerBase, TrainerSettings
from polyamp_keras._float8_state import float8_state_dict, load_float8_state_dict
from polyamp_keras._keras import keras
from polyamp_keras._models import apply_policy, op_output_dtype
from polyamp_keras._optimizer import LossScaleOptimizer
from polyamp_keras._outputs import cast_outputs
from polyamp_keras._precision import PrecisionOptimizer

__all__ = ["DIVERGENCES", "KerasHarness", "apply", "float8_model", "gradients", "keras_backend", "keras_op_dtype"]

ops = keras.ops
_OPS_IN_LAYERS = (
    "keras.ops calls inside a user's own layer (here a Lambda running ops.{op}) compute in that layer's dtype: "
    "Keras has no per-op hook, so polyamp_keras.apply_policy cannot give them float32 as torch's autocast does "
    "(it does for Softmax and normalization layers). Put such layers in apply_policy(keep_float32=...)."
)
#: The op classes Keras cannot classify per op: the one documented difference from torch's op classes.
DIVERGENCES: Mapping[str, str] = {f"op:{op}": _OPS_IN_LAYERS.format(op=op) for op in ("log_softmax", "sum")}


def keras_backend() -> str:
    """The backend Keras runs on in this process."""
    return str(keras.backend.backend())


def _numpy(value: Any) -> np.ndarray:
    return np.array(ops.convert_to_numpy(value))


def _mlp() -> Any:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])


def _plant_inf(grad: Any) -> Any:
    return ops.scatter_update(grad, [[0] * len(grad.shape)], ops.convert_to_tensor([float("inf")], dtype=grad.dtype))


def _clip_by_global_norm(grads: list[Any], clip: float) -> list[Any]:
    # tf.clip_by_global_norm's formula, in Keras ops: t * clip / max(global_norm, clip)
    norm = ops.sqrt(sum(ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads))
    factor = clip / ops.maximum(norm, clip)
    return [ops.cast(ops.cast(g, "float32") * factor, g.dtype) for g in grads]


def gradients(model_fn: Any, variables: list[Any], optimizer: Any, scaled: bool) -> tuple[Any, list[Any]]:
    """``(loss, gradients of the (scaled) loss)`` for ``model_fn() -> loss`` w.r.t. ``variables``, the way each
    Keras backend computes gradients; on JAX the optimizer's own variables are read statelessly."""
    backend = keras_backend()
    if backend == "tensorflow":
        tf = sys.modules["tensorflow"]
        with tf.GradientTape() as tape:
            loss = model_fn()
            differentiated = optimizer.scale_loss(loss) if scaled else loss
        return loss, tape.gradient(differentiated, variables)
    if backend == "torch":
        loss = model_fn()
        (optimizer.scale_loss(loss) if scaled else loss).backward()
        grads = [v.value.grad for v in variables]
        for v in variables:
            v.value.grad = None
        return loss, grads
    jax = sys.modules["jax"]
    values = [v.value for v in variables]
    opt_mapping = list(zip(optimizer.variables, [v.value for v in optimizer.variables], strict=True))

    def objective(vals: list[Any]) -> tuple[Any, Any]:
        with keras.StatelessScope(state_mapping=list(zip(variables, vals, strict=True)) + opt_mapping):
            loss = model_fn()
            return (optimizer.scale_loss(loss) if scaled else loss), loss

    (_, loss), grads = jax.value_and_grad(objective, has_aux=True)(values)
    return loss, list(grads)


def apply(optimizer: Any, grads: list[Any], variables: list[Any]) -> None:
    """One optimizer step, stateful on TensorFlow and PyTorch, through ``stateless_apply`` on JAX."""
    backend = keras_backend()
    if backend == "torch":
        with sys.modules["torch"].no_grad():  # Keras's backend here, so imported
            optimizer.apply(grads, variables)
        return
    if backend == "tensorflow":
        optimizer.apply(grads, variables)
        return
    opt_values = [v.value for v in optimizer.variables]
    new_values, new_opt_values = optimizer.stateless_apply(opt_values, grads, [v.value for v in variables])
    for variable, value in zip(variables, new_values, strict=True):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_opt_values, strict=True):
        variable.assign(value)


class _KerasTrainer(TrainerBase):
    def __init__(self, harness: KerasHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        with polyamp.policy_scope(policy):
            keras.utils.set_random_seed(settings.seed)
            self.model = cast_outputs(_mlp(), policy)
        inner = settings.make_optimizer(
            {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: keras.optimizers.Adam(0.01)}
        )
        if policy.has_training_state_plan:  # the model's variables are in policy.param_dtype already
            inner = PrecisionOptimizer(inner, policy)
        self.variables = list(self.model.trainable_variables)
        self.planted = str(self.variables[0].path)  # the variable step(overflow=True) plants an inf into
        scaler = settings.scaler
        self.wrapper: LossScaleOptimizer | None = None if scaler is None else LossScaleOptimizer(inner, **scaler)
        # The conformance cases read the scaler the optimizer runs: records, skip count, state dict.
        self.scaler = None if self.wrapper is None else self.wrapper.scaler
        self.opt = self.wrapper if self.wrapper is not None else inner
        self.opt.build(self.variables)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self._jitted: dict[bool, Any] = {}  # JAX: the compiled step, with and without a planted inf

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        if keras_backend() == "jax":
            return self._jitted_step(x, y, overflow)
        inputs, targets = ops.convert_to_tensor(x), ops.convert_to_tensor(y)
        loss, grads = gradients(
            lambda: self.loss_fn(targets, self.model(inputs, training=True)),
            self.variables,
            self.opt,
            scaled=self.wrapper is not None,
        )
        grads = list(grads)
        if overflow:
            grads[0] = _plant_inf(grads[0])
        if self.settings.clip is not None:
            if self.wrapper is not None:
                grads = self.wrapper.get_unscaled_gradients(grads)
            grads = _clip_by_global_norm(grads, self.settings.clip)
        apply(self.opt, grads, self.variables)
        return float(_numpy(loss))

    def _jitted_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        """JAX: the whole step in one ``jax.jit`` (as ``fit`` compiles it): the loss scaled and differentiated,
        the gradients unscaled (and clipped), ``stateless_apply``; the new values written back afterwards."""
        jax = sys.modules["jax"]
        step = self._jitted.get(overflow)
        if step is None:
            step = self._jitted[overflow] = jax.jit(lambda *args: self._stateless_step(*args, overflow=overflow))
        opt_variables = list(self.opt.variables)
        loss, values, opt_values = step(
            [v.value for v in self.variables],
            [v.value for v in opt_variables],
            ops.convert_to_tensor(x),
            ops.convert_to_tensor(y),
        )
        for variable, value in zip(self.variables, values, strict=True):
            variable.assign(value)
        for variable, value in zip(opt_variables, opt_values, strict=True):
            variable.assign(value)
        return float(_numpy(loss))

    def _stateless_step(self, values: list[Any], opt_values: list[Any], x: Any, y: Any, *, overflow: bool) -> Any:
        jax = sys.modules["jax"]
        opt_mapping = list(zip(self.opt.variables, opt_values, strict=True))
        scaled = self.wrapper is not None

        def objective(vals: list[Any]) -> tuple[Any, Any]:
            with keras.StatelessScope(state_mapping=list(zip(self.variables, vals, strict=True)) + opt_mapping):
                loss = self.loss_fn(y, self.model(x, training=True))
                return (self.opt.scale_loss(loss) if scaled else loss), loss

        (_, loss), grads = jax.value_and_grad(objective, has_aux=True)(values)
        grads = list(grads)
        if overflow:
            grads[0] = _plant_inf(grads[0])
        if self.settings.clip is not None:
            if self.wrapper is not None:
                with keras.StatelessScope(state_mapping=opt_mapping):
                    grads = self.wrapper.get_unscaled_gradients(grads)
            grads = _clip_by_global_norm(grads, self.settings.clip)
        new_values, new_opt_values = self.opt.stateless_apply(opt_values, grads, values)
        return loss, list(new_values), list(new_opt_values)

    def to_numpy(self, value: Any) -> np.ndarray:
        return _numpy(value)

    def weights(self) -> list[Any]:
        return self.variables

    def slots(self) -> list[Any]:
        # With a training-state plan, the PrecisionOptimizer's variables: slots, master copies, compensation
        # buffers, the random state and the inner optimizer's iterations and learning rate.
        inner = self.wrapper.inner_optimizer if self.wrapper is not None else self.opt
        return list(inner.variables)

    def step_skipped(self) -> bool:
        return self.wrapper is not None and bool(_numpy(self.wrapper.last_skipped))


def float8_model(recipe: Float8Recipe, weight: np.ndarray) -> tuple[Any, Any]:
    """``(model, kernel)``: one ``Dense`` layer named ``"layer"`` holding ``weight`` (out, in) as its kernel,
    converted by `polyamp_keras.apply_policy` under ``recipe`` with float32 compute (the FP8 cases' layer)."""
    layer = keras.layers.Dense(weight.shape[0], use_bias=False, name="layer")
    model = keras.Sequential([keras.Input((weight.shape[1],)), layer])
    layer.kernel.assign(weight.T)
    return apply_policy(model, Policy("float32").replace(float8=recipe)), layer.kernel


def keras_op_dtype(op: str, policy: Policy) -> str:
    """The output dtype of op class ``op`` (see `polyamp.conformance.OPS`) on Keras under ``policy``, with
    the model given the policy by `polyamp_keras.apply_policy`: what Keras users get with polyamp."""
    layers = keras.layers
    rng = np.random.default_rng(1)
    a = ops.convert_to_tensor(rng.normal(size=(4, 8)).astype("float32"))
    b = ops.convert_to_tensor(np.random.default_rng(2).normal(size=(8, 8)).astype("float32"))
    in_model: dict[str, Any] = {
        "softmax": lambda: layers.Softmax(),
        "log_softmax": lambda: layers.Lambda(lambda t: ops.log_softmax(t, axis=-1)),
        "layer_norm": lambda: layers.LayerNormalization(),
        "sum": lambda: layers.Lambda(lambda t: ops.sum(t)),
    }
    if op in in_model:
        return op_output_dtype(in_model[op](), a, policy)
    with polyamp.policy_scope(policy):
        if op == "matmul":
            out = layers.Lambda(lambda pair: ops.matmul(pair[0], pair[1]))([a, b])
        elif op == "dense":
            out = layers.Dense(8)(a)
        elif op == "conv":
            out = layers.Conv2D(4, 3)(ops.convert_to_tensor(rng.normal(size=(2, 8, 8, 3)).astype("float32")))
        elif op == "cross_entropy":
            out = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(np.arange(4), layers.Dense(8)(a))
        else:
            raise ValueError(f"unknown op class {op!r}")
    return str(keras.backend.standardize_dtype(out.dtype))


def _device_available(device: str) -> bool:
    if device == "cpu":
        return True
    backend = keras_backend()
    if backend == "tensorflow":
        return bool(sys.modules["tensorflow"].config.list_physical_devices("GPU"))
    if backend == "torch":
        return bool(sys.modules["torch"].cuda.is_available())
    jax = sys.modules["jax"]
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


class KerasHarness(HarnessBase):
    """Keras 3 on this process's backend, on one device type ("<backend>-cpu" or "<backend>-cuda").

    Keras computes on the default device of its backend; this harness does not move computation, so a
    "cuda" target runs where the backend puts it (the GPU when there is one).
    """

    backend = "keras"
    devices = (f"{keras_backend()}-cpu", f"{keras_backend()}-cuda")
    capabilities = frozenset({"low_precision", "guard", "precision"})
    divergences: Mapping[str, str] = DIVERGENCES
    trainer_class = _KerasTrainer

    def check_device(self, device: str) -> None:
        backend, _, kind = device.rpartition("-")
        if backend != keras_backend():
            raise HarnessUnavailable(
                f"Keras runs on {keras_backend()} in this process, not {backend!r}: set KERAS_BACKEND={backend} "
                "and run in a new process"
            )
        if kind not in ("cpu", "cuda"):
            raise HarnessUnavailable(f"the keras harness runs on cpu and cuda devices, not {kind!r}")
        if not _device_available(kind):
            raise HarnessUnavailable(f"Keras on {backend} sees no CUDA device")
        if kind == "cpu" and _device_available("cuda"):
            raise HarnessUnavailable(
                f"Keras on {backend} computes on the GPU in this process; run cpu targets without one"
            )

    def op_dtype(self, op: str, policy: Policy) -> str:
        return keras_op_dtype(op, policy)

    def model_dtypes(self, policy: Policy) -> tuple[list[str], str]:
        with polyamp.policy_scope(policy):
            model = cast_outputs(_mlp(), policy)
            output = model(ops.convert_to_tensor(np.ones((2, 8), "float32")))
        dtypes = [str(keras.backend.standardize_dtype(v.dtype)) for v in model.trainable_variables]
        return dtypes, str(keras.backend.standardize_dtype(output.dtype))

    def new_scaler(self, **settings: Any) -> LossScaleOptimizer:
        return LossScaleOptimizer(keras.optimizers.SGD(0.0), **settings)

    def tiny_gradient(self, x: np.ndarray, w: np.ndarray, factor: float, policy: Policy, scaler: Any) -> np.ndarray:
        with polyamp.policy_scope(policy):
            layer = keras.layers.Dense(w.shape[1], use_bias=False)
            layer.build((None, w.shape[0]))
            layer.kernel.assign(w)
            inputs = ops.convert_to_tensor(x)
            optimizer = scaler if scaler is not None else keras.optimizers.SGD(0.0)
            optimizer.build([layer.kernel])
            _, grads = gradients(
                lambda: ops.sum(ops.cast(layer(inputs), "float32")) * factor,
                [layer.kernel],
                optimizer,
                scaled=scaler is not None,
            )
            grads = list(grads)
            if scaler is not None:
                grads = scaler.get_unscaled_gradients(grads)
        return _numpy(grads[0]).astype(np.float32)

    def passes_loss_through(self, scaler: Any) -> bool:
        loss = ops.convert_to_tensor(1.5)
        return scaler.scale_loss(loss) is loss

    def _float8_grads(self, model: Any, inputs: Any, upstream: np.ndarray, variables: list[Any]) -> list[Any]:
        """The gradients for ``variables`` of ``sum(model(inputs) * upstream)``, in a training call."""
        grad = ops.convert_to_tensor(upstream)
        _, grads = gradients(
            lambda: ops.sum(model(inputs, training=True) * grad), variables, keras.optimizers.SGD(0.0), scaled=False
        )
        return list(grads)

    def float8_linear(
        self, recipe: Float8Recipe, x: np.ndarray, weight: np.ndarray, upstream: np.ndarray
    ) -> dict[str, np.ndarray]:
        model, kernel = float8_model(recipe, weight)
        inputs = keras.Variable(x, trainable=True, autocast=False)
        grad_kernel, grad_input = self._float8_grads(model, inputs, upstream, [kernel, inputs])
        return {
            "output": _numpy(model(x)).astype(np.float32),
            "grad_input": _numpy(grad_input).astype(np.float32),
            "grad_weight": _numpy(grad_kernel).T.astype(np.float32),
        }

    def float8_delayed(
        self,
        recipe: Float8Recipe,
        xs: Sequence[np.ndarray],
        weight: np.ndarray,
        upstreams: Sequence[np.ndarray],
        state: Mapping[str, Any] | None,
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        model, _ = float8_model(recipe, weight)
        if state is not None:
            load_float8_state_dict(model, dict(state))
        # The weight stays: SGD at learning rate 0 writes delayed scaling's new scales and histories (their
        # "gradients", Keras's overwrite_with_gradient) and leaves the kernel as it is.
        optimizer = keras.optimizers.SGD(0.0)
        variables = list(model.trainable_variables)
        optimizer.build(variables)
        outputs = []
        for x, upstream in zip(xs, upstreams, strict=True):
            # A forward outside training casts with the stored scales, as the training step's forward does.
            outputs.append(_numpy(model(x, training=False)).astype(np.float32))
            apply(optimizer, self._float8_grads(model, ops.convert_to_tensor(x), upstream, variables), variables)
        return outputs, float8_state_dict(model)
