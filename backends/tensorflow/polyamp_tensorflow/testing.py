"""polyamp's conformance harness for TensorFlow / Keras 3 (see `polyamp.conformance`).

``python -m polyamp.conformance --backend tensorflow`` runs the suite through it. Its steps are a TensorFlow
user's: a ``tf.GradientTape`` loop with `polyamp_tensorflow`'s scaler; its FP8 layer is the model
``polyamp_tensorflow.apply_policy`` converts, differentiated by a tape inside ``tf.function`` and stepped by
the optimizer's ``apply_gradients``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

import polyamp
from polyamp import Float8Recipe, LossScaler, Policy
from polyamp.conformance import HarnessBase, HarnessUnavailable, LoopBase, TrainerBase, TrainerSettings
from polyamp_keras.testing import DIVERGENCES, float8_model, keras_op_dtype
from polyamp_tensorflow import cast_outputs, float8_state_dict, load_float8_state_dict
from polyamp_tensorflow._framework import keras, tf

__all__ = ["TensorFlowHarness"]

ops = keras.ops


def _dtype_name(value: Any) -> str:
    return str(keras.backend.standardize_dtype(value.dtype))


def _mlp() -> Any:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])


def _model_and_scaler(driver: TrainerBase | LoopBase, device: str) -> tuple[Any, LossScaler | None]:
    """The seeded model and the scaler of a trainer or loop, made on ``device`` under its policy."""
    with tf.device(device), polyamp.policy_scope(driver.policy):
        keras.utils.set_random_seed(driver.settings.seed)
        return cast_outputs(_mlp(), driver.policy), driver.make_scaler()


class _KerasTrainer(TrainerBase):
    def __init__(self, harness: TensorFlowHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.device = harness.tf_device
        self.model, self.scaler = _model_and_scaler(self, self.device)
        self.opt = settings.make_optimizer(
            {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: keras.optimizers.Adam(0.01)}
        )
        self.opt.build(self.model.trainable_variables)
        #: The variable ``step(overflow=True)`` plants an inf in (its first gradient element).
        self.planted = str(self.model.trainable_variables[0].path)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def run_step(self, x: np.ndarray, y: np.ndarray, overflow: bool) -> float:
        variables = self.model.trainable_variables
        clip = self.settings.clip
        with tf.device(self.device):
            with tf.GradientTape() as tape:
                loss = self.loss_fn(y, self.model(x, training=True))
                scaled = self.scaler.scale(loss) if self.scaler is not None else loss
            grads = tape.gradient(scaled, variables)
            if overflow:
                grads[0] = tf.tensor_scatter_nd_update(grads[0], [[0] * len(grads[0].shape)], [float("inf")])
            if clip is not None:
                if self.scaler is not None:
                    grads = self.scaler.unscale(grads)
                grads, _ = tf.clip_by_global_norm(grads, clip)
            if self.scaler is not None:
                self.scaler.apply_gradients(self.opt, zip(grads, variables, strict=True))
            else:
                self.opt.apply_gradients(zip(grads, variables, strict=True))
        return float(loss.numpy())

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value.numpy())

    def weights(self) -> list[Any]:
        return [v.value for v in self.model.trainable_variables]

    def slots(self) -> list[Any]:
        return [v.value for v in self.opt.variables]


class _KerasLoop(LoopBase):
    """A two-layer model, one SGD optimizer per layer, driven call by call (see `polyamp.conformance.Loop`)."""

    def __init__(self, harness: TensorFlowHarness, policy: Policy, settings: TrainerSettings) -> None:
        super().__init__(harness, policy, settings)
        self.device = harness.tf_device
        self.model, self.scaler = _model_and_scaler(self, self.device)
        dense = [layer for layer in self.model.layers[0].layers if isinstance(layer, keras.layers.Dense)]
        self._variables = [layer.trainable_variables for layer in dense]
        self.optimizers = [keras.optimizers.SGD(0.1, momentum=0.9) for _ in dense]
        for optimizer, variables in zip(self.optimizers, self._variables, strict=True):
            optimizer.build(variables)
        self.grads: list[list[Any]] = [[], []]
        self._loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def run_backward(self, overflow: Collection[int]) -> None:
        x, y = self.next_batch()
        with tf.device(self.device):
            with tf.GradientTape() as tape:
                scaled = self.scaler.scale(self._loss_fn(y, self.model(x, training=True)))
            grads = tape.gradient(scaled, self._variables)
        for index in overflow:
            kernel = grads[index][0]
            grads[index][0] = tf.tensor_scatter_nd_update(kernel, [[0] * len(kernel.shape)], [float("inf")])
        self.grads = [list(group) for group in grads]

    def unscale(self, index: int) -> None:
        self.grads[index] = self.scaler.unscale(self.grads[index])

    def step(self, index: int) -> None:
        with tf.device(self.device):
            self.scaler.step(self.optimizers[index], zip(self.grads[index], self._variables[index], strict=True))

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value.numpy())

    def weights(self, index: int) -> list[Any]:
        return [v.value for v in self._variables[index]]

    def slots(self, index: int) -> list[Any]:
        return [v.value for v in self.optimizers[index].variables]


class TensorFlowHarness(HarnessBase):
    """TensorFlow / Keras 3 on one device type ("cpu" or "cuda")."""

    backend = "tensorflow"
    devices = ("cpu", "cuda")
    capabilities = frozenset({"low_precision", "guard"})
    divergences: Mapping[str, str] = DIVERGENCES
    trainer_class = _KerasTrainer

    def check_device(self, device: str) -> None:
        if keras.backend.backend() != "tensorflow":
            raise HarnessUnavailable(
                f"Keras runs on {keras.backend.backend()} in this process; the tensorflow harness needs "
                "KERAS_BACKEND=tensorflow"
            )
        if device == "cuda" and not tf.config.list_physical_devices("GPU"):
            raise HarnessUnavailable(f"TensorFlow {tf.__version__} sees no GPU")

    @property
    def tf_device(self) -> str:
        """The TensorFlow device the harness computes on."""
        return "/GPU:0" if self.device == "cuda" else "/CPU:0"

    def _tensor(self, shape: tuple[int, ...], seed: int = 0) -> Any:
        with tf.device(self.tf_device):
            return tf.constant(np.random.default_rng(seed).normal(size=shape).astype("float32"))

    def op_dtype(self, op: str, policy: Policy) -> str:
        with tf.device(self.tf_device):
            return keras_op_dtype(op, policy)

    def model_dtypes(self, policy: Policy) -> tuple[list[str], str]:
        with tf.device(self.tf_device), polyamp.policy_scope(policy):
            model = cast_outputs(_mlp(), policy)
            output = model(self._tensor((2, 8)))
        return [_dtype_name(v) for v in model.trainable_variables], _dtype_name(output)

    def tiny_gradient(
        self, x: np.ndarray, w: np.ndarray, factor: float, policy: Policy, scaler: LossScaler | None
    ) -> np.ndarray:
        with tf.device(self.tf_device), polyamp.policy_scope(policy):
            layer = keras.layers.Dense(w.shape[1], use_bias=False)
            layer.build((None, w.shape[0]))
            layer.kernel.assign(w)
            with tf.GradientTape() as tape:
                loss = ops.sum(ops.cast(layer(x), "float32")) * factor
                target = scaler.scale(loss) if scaler is not None else loss
            grads = tape.gradient(target, [layer.kernel])
            if scaler is not None:
                grads = scaler.unscale(grads)
        return np.array(grads[0].numpy(), dtype=np.float32)

    def passes_loss_through(self, scaler: LossScaler) -> bool:
        loss = tf.constant(1.5)
        return scaler.scale(loss) is loss

    def loop(self, policy: Policy, *, scaler: Mapping[str, Any], seed: int = 0) -> _KerasLoop:
        return _KerasLoop(self, policy, self.settings(scaler, seed=seed))

    def float8_linear(
        self, recipe: Float8Recipe, x: np.ndarray, weight: np.ndarray, upstream: np.ndarray
    ) -> dict[str, np.ndarray]:
        with tf.device(self.tf_device):
            model, kernel = float8_model(recipe, weight)
            inputs, grad = tf.constant(x), tf.constant(upstream)

            @tf.function  # type: ignore[untyped-decorator]
            def gradients() -> Any:
                with tf.GradientTape() as tape:
                    tape.watch(inputs)
                    loss = tf.reduce_sum(model(inputs, training=True) * grad)
                return tape.gradient(loss, [kernel, inputs])

            grad_kernel, grad_input = gradients()
            output = model(inputs)
        return {
            "output": np.asarray(output.numpy(), np.float32),
            "grad_input": np.asarray(grad_input.numpy(), np.float32),
            "grad_weight": np.asarray(grad_kernel.numpy(), np.float32).T,
        }

    def float8_delayed(
        self,
        recipe: Float8Recipe,
        xs: Sequence[np.ndarray],
        weight: np.ndarray,
        upstreams: Sequence[np.ndarray],
        state: Mapping[str, Any] | None,
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        with tf.device(self.tf_device):
            model, _ = float8_model(recipe, weight)
            if state is not None:
                load_float8_state_dict(model, dict(state))
            # The weight stays: SGD at learning rate 0 writes delayed scaling's new scales and histories (their
            # "gradients", Keras's overwrite_with_gradient) and leaves the kernel as it is.
            optimizer = keras.optimizers.SGD(0.0)
            variables = list(model.trainable_variables)
            optimizer.build(variables)

            @tf.function  # type: ignore[untyped-decorator]
            def train_step(x: Any, upstream: Any) -> None:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(model(x, training=True) * upstream)
                optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))

            outputs = []
            for x, upstream in zip(xs, upstreams, strict=True):
                # A forward outside training casts with the stored scales, as the training step's forward does.
                outputs.append(np.asarray(model(tf.constant(x), training=False).numpy(), np.float32))
                train_step(tf.constant(x), tf.constant(upstream))
        return outputs, float8_state_dict(model)
