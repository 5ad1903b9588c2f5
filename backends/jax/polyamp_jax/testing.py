"""polyamp's conformance harness for JAX (see `polyamp.conformance`): the tiny classifier as a pytree of arrays,
trained by a jitted step through `polyamp_jax.loss_scaled` (optax), or through the functional scaler in a
hand-written step (``functional_trainer``). Under a policy with a training-state plan the optimizer is wrapped
in `polyamp_jax.precision` (inside the scaler: ``loss_scaled(precision(optimizer))``).

The model runs under `polyamp_jax.autocast` (op classes, the policy's compute dtype) and gives its logits in
the output dtype; the op classes are checked on single ops under it. FP8 runs through
`polyamp_jax.float8_dot_general` (the dynamic recipes) and a Flax ``nn.Dense`` with `polyamp_jax.Float8DotGeneral`
(delayed scaling, its state moved in and out through `polyamp_jax.float8_state_dict`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import polyamp
from polyamp import Float8Recipe, Policy
from polyamp.conformance import (
    FunctionalScalerView,
    FunctionalTrainerBase,
    HarnessBase,
    HarnessUnavailable,
    TrainerBase,
    TrainerSettings,
    skip,
)
from polyamp_jax._autocast import autocast
from polyamp_jax._casting import cast_to_param
from polyamp_jax._float8 import float8_dot_general
from polyamp_jax._float8_state import OVERWRITE_WITH_GRADIENT, float8_state_dict, load_float8_state_dict
from polyamp_jax._optax import LossScaledState, loss_scaled, scale_loss
from polyamp_jax._precision import precision

__all__ = ["DIVERGENCES", "JaxHarness"]

#: Where polyamp_jax knowingly differs from the conformance cases' reference.
DIVERGENCES: Mapping[str, str] = {
    "float8_delayed_cast_scale": "polyamp_jax.Float8DotGeneral follows Flax's fp8_ops: each step casts with the "
    "scale computed from the amax history as it was before the step (the scale it then stores), where torch, "
    "Keras and the reference cast with the scale stored by the step before; the histories and scales are the "
    "same step for step, the outputs differ as the scales they were cast with.",
}
_DENSE = (((1,), (0,)), ((), ()))


def _mlp(seed: int, policy: Policy) -> dict[str, Any]:
    """8 inputs, 16 hidden ReLU units, 4 classes; Glorot-uniform weights, zero biases."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))

    def glorot(key: Any, shape: tuple[int, int]) -> Any:
        limit = np.sqrt(6.0 / sum(shape))
        return jax.random.uniform(key, shape, jnp.float32, -limit, limit)

    params = {"w1": glorot(k1, (8, 16)), "b1": jnp.zeros(16), "w2": glorot(k2, (16, 4)), "b2": jnp.zeros(4)}
    return cast_to_param(params, policy)


def _forward(params: Any, x: Any) -> Any:
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def _loss(params: Any, x: Any, y: Any, policy: Policy) -> Any:
    """Cross-entropy of the model's logits, which `polyamp_jax.autocast` computes by op class under
    ``policy`` and gives in its output dtype."""
    logits = autocast(_forward, policy=policy)(params, x).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _op(op: str, x: Any, w: Any, b: Any, k: Any) -> Any:
    """One op class on a hidden layer's output (see `polyamp.conformance.OPS`)."""
    if op == "matmul":
        return x @ w
    if op == "dense":
        return x @ w + b
    if op == "conv":
        image = x.reshape(1, x.shape[0], x.shape[1], 1)
        return jax.lax.conv_general_dilated(image, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    hidden = x @ w + b
    if op == "softmax":
        return jax.nn.softmax(hidden)
    if op == "log_softmax":
        return jax.nn.log_softmax(hidden)
    if op == "cross_entropy":
        return optax.softmax_cross_entropy_with_integer_labels(hidden, jnp.zeros(hidden.shape[0], jnp.int32))
    if op == "layer_norm":
        mean = hidden.mean(-1, keepdims=True)
        return (hidden - mean) * jax.lax.rsqrt(hidden.var(-1, keepdims=True) + 1e-5)
    if op == "sum":
        return jnp.sum(hidden)
    raise ValueError(f"unknown op class {op!r}")


def _plant_inf(grads: Any) -> Any:
    return {**grads, "w1": grads["w1"].at[0, 0].set(jnp.inf)}


class _OptaxTrainer(TrainerBase):
    """The classifier trained by one jitted step through ``loss_scaled(optax.sgd/adam)`` (or the bare optax
    transformation without a scaler)."""

    def __init__(self, harness: JaxHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.tree = _mlp(settings.seed, policy)
        inner = settings.make_optimizer({"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(0.01)})
        if settings.clip is not None:  # after unscaling: loss_scaled hands the chain unscaled gradients
            inner = optax.chain(optax.clip_by_global_norm(settings.clip), inner)
        if policy.has_training_state_plan:  # master copies, state dtype and rounding of the plan
            inner = precision(inner, policy)
        scaler = settings.scaler
        with polyamp.policy_scope(policy):
            self.tx = inner if scaler is None else loss_scaled(inner, **scaler)
        self.opt_state = self.tx.init(self.tree)
        if scaler is not None:
            self.scaler = FunctionalScalerView(
                lambda: (self.opt_state.fn, self.opt_state.scaler), self._load_scaler_state
            )
        self._step = jax.jit(self._pure_step, static_argnames=("overflow",))
        self._skipped_before: int | None = None
        self.planted = "w1"  # the parameter step(overflow=True) plants an inf into

    def _load_scaler_state(self, state: Any) -> None:
        self.opt_state = LossScaledState(state, self.opt_state.inner, self.opt_state.fn)

    def _pure_step(self, params: Any, opt_state: Any, x: Any, y: Any, *, overflow: bool) -> Any:
        scaled = isinstance(opt_state, LossScaledState)

        def objective(p: Any) -> tuple[Any, Any]:
            loss = _loss(p, x, y, self.policy)
            return (scale_loss(opt_state, loss) if scaled else loss), loss

        (_, loss), grads = jax.value_and_grad(objective, has_aux=True)(params)
        if overflow:
            grads = _plant_inf(grads)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        if self.scaler is not None:
            self._skipped_before = int(self.scaler.skipped_steps())
        self.tree, self.opt_state, loss = self._step(
            self.tree, self.opt_state, jnp.asarray(x), jnp.asarray(y), overflow=overflow
        )
        return float(loss)

    def weights(self) -> list[Any]:
        return jax.tree_util.tree_leaves(self.tree)

    def slots(self) -> list[Any]:
        """The optimizer's slots, and under a training-state plan its master copies, compensation buffers and
        random key (`polyamp_jax.PrecisionState`'s leaves)."""
        inner = self.opt_state.inner if isinstance(self.opt_state, LossScaledState) else self.opt_state
        return jax.tree_util.tree_leaves(inner)

    def step_skipped(self) -> bool:
        if self.scaler is None or self._skipped_before is None:
            return False
        return int(self.scaler.skipped_steps()) > self._skipped_before


class _FunctionalTrainer(FunctionalTrainerBase):
    """SGD with momentum written by hand as one jitted function, driven through the functional scaler
    (``polyamp.LossScaler(...).functional(backend="jax")``, the guard, records and spike rule included)."""

    def __init__(self, harness: JaxHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.tree = _mlp(settings.seed, policy)
        self.momentum = jax.tree_util.tree_map(jnp.zeros_like, self.tree)
        self._step = jax.jit(self._pure_step, static_argnames=("overflow",))

    def _pure_step(self, weights: Any, momentum: Any, state: Any, x: Any, y: Any, *, overflow: bool) -> Any:
        fn = self.fn

        def objective(p: Any) -> tuple[Any, Any]:
            loss = _loss(p, x, y, self.policy)
            return fn.scale(state, loss), loss

        (_, loss), grads = jax.value_and_grad(objective, has_aux=True)(weights)
        if overflow:
            grads = _plant_inf(grads)
        grads, found_inf = fn.unscale(state, grads)
        spike = fn.spike(state, loss=loss, grads=grads)
        new_momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, momentum, grads)
        new_weights = jax.tree_util.tree_map(lambda w, m: w - 0.1 * m, weights, new_momentum)
        weights, momentum = fn.apply_if_finite(found_inf, (new_weights, new_momentum), (weights, momentum), spike=spike)
        return weights, momentum, fn.update(state, found_inf, spike=spike), fn.skipped(found_inf, spike), loss

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        self.tree, self.momentum, self.state, self.skipped, loss = self._step(
            self.tree, self.momentum, self.state, jnp.asarray(x), jnp.asarray(y), overflow=overflow
        )
        return float(loss)

    def weights(self) -> list[Any]:
        return jax.tree_util.tree_leaves(self.tree)

    def slots(self) -> list[Any]:
        return jax.tree_util.tree_leaves(self.momentum)


class JaxHarness(HarnessBase):
    """JAX on its default CPU or GPU device."""

    backend = "jax"
    devices = ("cpu", "cuda")
    capabilities = frozenset({"low_precision", "guard", "precision"})
    # None for the loss scaler: loss_scaled's skip selects negative zeros, which XLA does not fold into the
    # parameter update (it folded the positive zeros it once selected, rounding Adam's last bit apart from a step
    # without the scaler).
    divergences: Mapping[str, str] = DIVERGENCES
    trainer_class = _OptaxTrainer

    def check_device(self, device: str) -> None:
        platforms = {d.platform for d in jax.devices()}
        if device == "cuda" and "gpu" not in platforms:
            raise HarnessUnavailable("JAX sees no GPU")
        if device == "cpu" and "gpu" in platforms:
            raise HarnessUnavailable("JAX computes on the GPU in this process; run cpu targets without one")

    def op_dtype(self, op: str, policy: Policy) -> str:
        rng = np.random.default_rng(0)
        x, w = (jnp.asarray(rng.normal(size=shape).astype("float32")) for shape in ((4, 8), (8, 8)))
        b, k = jnp.ones(8), jnp.asarray(rng.normal(size=(3, 3, 1, 2)).astype("float32"))
        region = autocast(lambda *arrays: _op(op, *arrays), policy=policy, cast_outputs=False)
        return str(jax.eval_shape(region, x, w, b, k).dtype)

    def model_dtypes(self, policy: Policy) -> tuple[list[str], str]:
        params = _mlp(0, policy)
        output = autocast(_forward, policy=policy)(params, jnp.ones((2, 8)))
        return [str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(params)], str(output.dtype)

    def functional_trainer(self, policy: Policy, *, scaler: Mapping[str, Any], seed: int = 0) -> _FunctionalTrainer:
        return _FunctionalTrainer(self, policy, self.settings(scaler, seed=seed))

    def float8_linear(
        self, recipe: Float8Recipe, x: np.ndarray, weight: np.ndarray, upstream: np.ndarray
    ) -> dict[str, np.ndarray]:
        def layer(x: Any, kernel: Any) -> Any:
            return float8_dot_general(x, kernel, _DENSE, recipe=recipe, preferred_element_type=jnp.float32)

        @jax.jit  # as a JAX user runs a step (and one compile, not one per operation)
        def forward_backward(x: Any, kernel: Any, upstream: Any) -> tuple[Any, Any, Any]:
            output, vjp = jax.vjp(layer, x, kernel)
            return output, *vjp(upstream)

        # the kernel is (in, out)
        output, grad_input, grad_kernel = forward_backward(jnp.asarray(x), jnp.asarray(weight.T), jnp.asarray(upstream))
        return {
            "output": np.asarray(output, np.float32),
            "grad_input": np.asarray(grad_input, np.float32),
            "grad_weight": np.asarray(grad_kernel, np.float32).T,
        }

    def float8_delayed(
        self,
        recipe: Float8Recipe,
        xs: Sequence[np.ndarray],
        weight: np.ndarray,
        upstreams: Sequence[np.ndarray],
        state: Mapping[str, Any] | None,
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        model = _float8_model(recipe, weight.shape[0])
        variables = model.init(jax.random.key(0), jnp.asarray(xs[0]))
        variables = {**variables, "params": {"layer": {"kernel": jnp.asarray(weight.T)}}}
        if state is not None:
            variables = load_float8_state_dict(variables, dict(state), recipe=recipe)

        @jax.jit
        def step(variables: Any, x: Any, upstream: Any) -> tuple[Any, Any]:
            output, vjp = jax.vjp(lambda v: model.apply(v, x), variables)
            # the collection's gradients are its next values (Flax's overwrite-with-gradient); the kernel stays
            return {**variables, OVERWRITE_WITH_GRADIENT: vjp(upstream)[0][OVERWRITE_WITH_GRADIENT]}, output

        outputs = []
        for x, upstream in zip(xs, upstreams, strict=True):
            variables, output = step(variables, jnp.asarray(x), jnp.asarray(upstream))
            outputs.append(np.asarray(output, np.float32))
        return outputs, float8_state_dict(variables, recipe=recipe)


def _float8_model(recipe: Float8Recipe, features: int) -> Any:
    """A Flax Linen model of one ``nn.Dense`` named ``"layer"`` (no bias) with `polyamp_jax.Float8DotGeneral`."""
    try:
        import flax.linen as nn
    except ImportError:
        skip("delayed FP8 scaling runs through a Flax Linen module; Flax is not installed (pip install flax)")
    from polyamp_jax._float8_linen import Float8DotGeneral

    class Float8Layer(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            dot = functools.partial(Float8DotGeneral, recipe=recipe)
            return nn.Dense(features, use_bias=False, dot_general_cls=dot, name="layer")(x)

    return Float8Layer()
