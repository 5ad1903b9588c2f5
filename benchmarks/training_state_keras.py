"""The ``training-state`` benchmark's model and step on Keras 3, on the backend the process runs
(``KERAS_BACKEND``; see `benchmarks.training_state`).

On TensorFlow and JAX the step is compiled (``jit_compile=True``: XLA); Keras on torch runs it eagerly.
"""

from __future__ import annotations

import math
import time
from typing import Any

import keras
import numpy as np
from keras import ops

import polyamp
import polyamp_keras
from benchmarks.training_state import POLICY_OF, Chain, Config, Run, decayed, initial_weights


class GPT(keras.Model):
    """The GPT of `benchmarks.training_state_torch.GPT` over named weights, in the variables' dtype with float32
    norms, softmax and loss."""

    def __init__(self, config: Config, weights: dict[str, np.ndarray], dtype: str) -> None:
        super().__init__(dtype=dtype)
        self.config = config
        self.named: dict[str, Any] = {}
        for name, value in weights.items():
            self.named[name] = self.add_weight(
                shape=value.shape,
                initializer=keras.initializers.Constant(value),
                dtype=dtype,
                name=name.replace(".", "_"),
            )

    def _norm(self, x: Any, g: Any, b: Any) -> Any:
        x32 = ops.cast(x, "float32")
        mean = ops.mean(x32, -1, keepdims=True)
        var = ops.mean(ops.square(x32 - mean), -1, keepdims=True)
        out = (x32 - mean) * ops.rsqrt(var + 1e-5) * ops.cast(g, "float32") + ops.cast(b, "float32")
        return ops.cast(out, x.dtype)

    def call(self, tokens: Any) -> Any:
        c, w = self.config, self.named
        length = c.sequence
        head = c.width // c.heads
        x = ops.take(w["wte"], tokens, axis=0) + w["wpe"][:length]
        mask = np.triu(np.ones((length, length), bool), 1)
        for i in range(c.layers):
            h = self._norm(x, w[f"h{i}.ln1.g"], w[f"h{i}.ln1.b"])
            qkv = ops.matmul(h, w[f"h{i}.attn.w"]) + w[f"h{i}.attn.b"]
            q, k, v = (
                ops.transpose(ops.reshape(t, (-1, length, c.heads, head)), (0, 2, 1, 3)) for t in ops.split(qkv, 3, -1)
            )
            scores = ops.cast(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))), "float32") / math.sqrt(head)
            attention = ops.cast(ops.softmax(ops.where(mask, -np.inf, scores), axis=-1), v.dtype)
            y = ops.reshape(ops.transpose(ops.matmul(attention, v), (0, 2, 1, 3)), (-1, length, c.width))
            x = x + (ops.matmul(y, w[f"h{i}.proj.w"]) + w[f"h{i}.proj.b"])
            h = self._norm(x, w[f"h{i}.ln2.g"], w[f"h{i}.ln2.b"])
            h = ops.gelu(ops.matmul(h, w[f"h{i}.fc.w"]) + w[f"h{i}.fc.b"], approximate=False)
            x = x + (ops.matmul(h, w[f"h{i}.out.w"]) + w[f"h{i}.out.b"])
        x = self._norm(x, w["lnf.g"], w["lnf.b"])
        return ops.cast(ops.matmul(x, w["head.w"]), "float32")


class Schedule(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, config: Config) -> None:
        self.values = np.asarray([config.learning_rate(s) for s in range(config.steps)], np.float32)

    def __call__(self, step: Any) -> Any:
        index = ops.minimum(ops.cast(step, "int32"), len(self.values) - 1)
        return ops.take(ops.convert_to_tensor(self.values), index)


def train(plan: str, seed: int, config: Config, chain: Chain) -> Run:
    keras.utils.set_random_seed(seed)
    policy = polyamp.Policy(POLICY_OF.get(plan, plan))
    weights = initial_weights(config, seed)
    model = GPT(config, weights, policy.param_dtype)
    model.build((None, config.sequence))
    inner = keras.optimizers.AdamW(
        learning_rate=Schedule(config),
        beta_1=config.betas[0],
        beta_2=config.betas[1],
        epsilon=config.eps,
        weight_decay=config.weight_decay,
    )
    inner.exclude_from_weight_decay(var_names=[n.replace(".", "_") for n, w in weights.items() if not decayed(n, w)])
    optimizer = polyamp_keras.PrecisionOptimizer(inner, policy, seed=seed)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=keras.backend.backend() in ("jax", "tensorflow"),
    )
    batches = chain.batches(seed)
    data = [next(batches) for _ in range(config.steps)]
    tokens = np.stack(data)  # (steps, batch, sequence + 1)
    x = tokens[:, :, :-1].reshape(-1, config.sequence)
    y = tokens[:, :, 1:].reshape(-1, config.sequence)

    losses: list[float] = []
    times: list[float] = []

    class Log(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            losses.append(float(logs["loss"]))
            times.append(time.perf_counter())

    model.fit(x, y, batch_size=config.batch, epochs=1, shuffle=False, verbose=0, callbacks=[Log()])
    # Keras's logged loss is the running mean over the epoch; the per-step loss is recovered from it.
    steps = np.arange(1, len(losses) + 1)
    running = np.asarray(losses, np.float64)
    per_step = running * steps - np.concatenate([[0.0], running[:-1] * steps[:-1]])
    seconds = times[-1] - times[config.untimed_steps - 1]
    measured = polyamp_keras.measure_state_bytes(optimizer)
    timed = config.steps - config.untimed_steps
    return Run(plan, seed, per_step.tolist(), seconds, timed, measured.per_parameter, measured.breakdown())
