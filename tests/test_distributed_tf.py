"""Distributed training: tf.distribute.MirroredStrategy over two logical CPU devices (polyamp's Keras optimizer and
the tape scaler, custom loops and model.fit) and Keras on JAX with keras.distribution.DataParallel over two CPU
devices. Each runs in a fresh process (devices are configured before the framework starts; Keras picks its
backend once per process): tests/distributed_tf_worker.py and tests/distributed_jax_worker.py, started together.
A one-replica MirroredStrategy (what a one-GPU machine gives) runs in this process.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polyamp

#: MirroredStrategy workers in subprocesses: the slow set.
pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
TIMEOUT = 600


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class _Worker:
    """A worker process started at once; `results` waits for its JSON."""

    def __init__(self, script: str, folder: Path, **env: str) -> None:
        environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env)
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / script), str(folder)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
            cwd=HERE.parent,
        )
        self._results: dict[str, Any] | None = None

    def results(self) -> dict[str, Any]:
        if self._results is None:
            try:
                out, err = self.process.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                out, err = self.process.communicate()
                pytest.fail(f"the worker ran past {TIMEOUT} s:\n{err[-3000:]}")
            lines = [line for line in out.splitlines() if line.startswith("RESULTS ")]
            assert self.process.returncode == 0 and lines, err[-4000:]
            self._results = json.loads(lines[-1].removeprefix("RESULTS "))
        return self._results

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Worker]]:
    started = {}
    if _has("tensorflow"):
        started["tf"] = _Worker("distributed_tf_worker.py", tmp_path_factory.mktemp("tf"))
    if _has("jax"):
        started["jax"] = _Worker(
            "distributed_jax_worker.py",
            tmp_path_factory.mktemp("jax"),
            KERAS_BACKEND="jax",
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
        )
    yield started
    for worker in started.values():
        worker.stop()


def _results(workers: dict[str, _Worker], name: str) -> dict[str, Any]:
    if name not in workers:
        pytest.skip(f"{'TensorFlow' if name == 'tf' else 'JAX'} is not installed")
    return workers[name].results()


PATTERN = "FFOFFFOOF"  # as in the worker: O overflows on replica 1 only
SETTINGS = dict(init_scale=1024.0, growth_interval=2, hysteresis=1)
LOOPS = ["optimizer-eager", "optimizer-function", "guard-eager", "guard-function", "scaler-eager", "scaler-function"]


@pytest.mark.parametrize("loop", LOOPS)
def test_overflow_on_one_replica_skips_the_step_on_every_replica(workers: dict[str, _Worker], loop: str) -> None:
    result = _results(workers, "tf")[loop]
    # Each skipped step left weights, Adam's slots and iterations bitwise unchanged, on both replicas.
    assert result["skips_unchanged"] == [True] * PATTERN.count("O")
    assert result["finite"] is True
    assert result["iterations"] == PATTERN.count("F")


@pytest.mark.parametrize("loop", LOOPS)
def test_scale_trajectory_equals_the_reference_and_is_the_same_on_every_replica(
    workers: dict[str, _Worker], loop: str
) -> None:
    result = _results(workers, "tf")[loop]
    config = polyamp.LossScaleConfig(**SETTINGS)
    if loop.startswith("guard"):  # not scaling: the rule does not run, the guard skips
        reference = [config.initial_state()] * len(PATTERN)
    else:
        reference = config.states(PATTERN)
    assert result["states"] == [[s.scale, s.growth_tracker, s.hysteresis_left] for s in reference]
    assert result["reference"] == result["states"]
    # Scale, counter, hysteresis, weights and slots: one copy per replica, bitwise equal, after every step.
    assert result["identical"] == [True] * len(PATTERN)
    # The records: one per iteration, not one per replica.
    if loop.startswith("guard"):
        assert result["records"] == [[i, "non_finite" if c == "O" else None, None, None] for i, c in enumerate(PATTERN)]
    else:
        states = [config.initial_state(), *reference]
        assert result["records"] == [
            [i, "overflow" if c == "O" else None, states[i].scale, states[i + 1].scale] for i, c in enumerate(PATTERN)
        ]


@pytest.mark.parametrize("loop", ["scaler-eager", "scaler-function"])
def test_the_tape_scalers_skipped_steps_reads_as_an_int_under_the_strategy(
    workers: dict[str, _Worker], loop: str
) -> None:
    # int(scaler.skipped_steps()) after each iteration, eagerly and from a tf.function: the count so far.
    counts = _results(workers, "tf")[loop]["skip_counts"]
    expected = [PATTERN[: i + 1].count("O") for i in range(len(PATTERN))]
    assert counts == [[n, n] for n in expected]


def test_fit_under_mirrored_strategy_trains_and_skips_an_overflow_seen_by_one_replica(
    workers: dict[str, _Worker],
) -> None:
    fit = _results(workers, "tf")["fit"]
    # First epoch: 4 batches, the first overflows on replica 1 only -> skipped: 3 steps, the scale halved.
    assert fit["weights_finite"] is True
    assert fit["after_overflow"] == {"iterations": 3, "scale": 512.0}
    losses = fit["losses"]
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.8 * losses[0]
    assert fit["identical"] is True and fit["replicated"] is True
    assert fit["state"]["scale"] == 512.0 and fit["state"]["_growth_tracker"] == 3 + 4 * 4


def test_checkpoints_move_between_distributed_and_single_device(workers: dict[str, _Worker]) -> None:
    fit = _results(workers, "tf")["fit"]
    # Saved under the strategy, loaded on one device (model.save/load_model and state_dict).
    assert fit["loaded_single_state"] == fit["state"]
    assert fit["state_dict_single"] == fit["state"]
    assert fit["loaded_single_weights_equal"] is True
    assert fit["single_resumed_steps"] == 4
    # Saved on one device, loaded under the strategy: mirrored again, same state, and it trains on.
    assert fit["loaded_distributed_state"] == fit["single_saved_state"]
    assert fit["loaded_distributed_mirrored"] is True and fit["loaded_distributed_identical"] is True
    resumed = fit["distributed_resumed_state"]
    assert resumed["_growth_tracker"] == fit["single_saved_state"]["_growth_tracker"] + 4


def test_jit_compile_runs_wherever_plain_keras_runs(workers: dict[str, _Worker]) -> None:
    results = _results(workers, "tf")
    # keras#21366's configuration (MirroredStrategy, mixed_float16, jit_compile=True) trains with polyamp's optimizer.
    assert results["jit_one_device"] == "ok"
    # Over two devices XLA cannot compile a step whose variables live on another device, for any optimizer
    # (TensorFlow 2.21, Keras 3.15); polyamp's optimizer fails or runs exactly as a plain Adam does.
    two = results["jit_two_devices"]
    assert two["polyamp"] == two["plain"], two


def test_keras_on_jax_data_parallel_trains_and_skips_an_overflow_in_one_shard(workers: dict[str, _Worker]) -> None:
    results = _results(workers, "jax")
    assert results["backend"] == "jax"
    distributed, single = results["distributed"], results["single"]
    assert distributed["devices"] == ["cpu:0", "cpu:1"]
    # The overflowing sample is in device 1's shard only; the step is skipped, bitwise, as on one device.
    skipped = distributed["skipped"]
    assert skipped["weights_unchanged"] is True and skipped["slots_unchanged"] is True
    expected = polyamp.LossScaleConfig(init_scale=1024.0, growth_interval=3).states("FO")[-1]
    assert (skipped["state"]["scale"], skipped["state"]["_growth_tracker"]) == (expected.scale, 0)
    assert skipped == single["skipped"]
    # XLA's sharding all-reduces the gradients: the run follows the single-device one (up to summation order),
    # with the same steps and scale trajectory, every variable replicated and equal on both devices.
    assert distributed["state"] == single["state"] and distributed["iterations"] == single["iterations"]
    assert distributed["losses"] == pytest.approx(single["losses"], rel=1e-4)
    assert distributed["losses"][-1] < 0.8 * distributed["losses"][0]
    for a, b in zip(distributed["weights"], single["weights"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
    assert distributed["copies"] == [2] * len(distributed["copies"]) and distributed["identical"] is True
    assert single["copies"] == [1] * len(single["copies"])
    # A state saved under DataParallel resumes on one device.
    assert distributed["loaded_single_state"] == distributed["state"]
    assert distributed["state_dict_single"] == distributed["state"]


# -- one replica, in this process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("function", [True, False], ids=["tf_function", "eager"])
def test_tape_scaler_under_a_one_replica_mirrored_strategy(function: bool) -> None:
    """What MirroredStrategy() gives on a one-GPU machine: the apply is a merge_call there too, which must not be
    taken inside a cond in the replica context ("merge_call called while defining a new graph")."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("Keras runs on another backend here")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
        scaler = polyamp.LossScaler(enabled=True, init_scale=1024.0, growth_interval=2, backend="tensorflow")

    def step(x: Any, y: Any, bad: Any) -> None:
        with tf.GradientTape() as tape:
            loss = scaler.scale(tf.reduce_mean((model(x) - y) ** 2) * bad)
        grads = tape.gradient(loss, model.trainable_variables)
        scaler.apply_gradients(optimizer, zip(grads, model.trainable_variables))

    def train_step(x: Any, y: Any, bad: Any) -> None:
        strategy.run(step, args=(x, y, bad))

    run = tf.function(train_step) if function else train_step
    pattern = "FOFFF"
    x, y = tf.ones((4, 3)), tf.zeros((4, 2))
    skipped_unchanged = []
    for char in pattern:
        before = [v.numpy().copy() for v in model.trainable_variables]
        run(x, y, tf.constant(math.inf if char == "O" else 1.0))
        after = [v.numpy() for v in model.trainable_variables]
        skipped_unchanged.append(all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)))
    assert skipped_unchanged == [char == "O" for char in pattern]
    assert int(optimizer.iterations.numpy()) == pattern.count("F")
    assert int(scaler.skipped_steps().numpy()) == 1
    assert [r.next_scale for r in scaler.records()] == polyamp.LossScaleConfig(
        init_scale=1024.0, growth_interval=2
    ).trajectory(pattern)
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


@pytest.mark.parametrize("function", [True, False], ids=["tf_function", "eager"])
def test_guard_of_the_keras_optimizer_under_a_one_replica_mirrored_strategy(function: bool) -> None:
    """The guard (enabled=None under a float32 policy) takes its cond around the inner optimizer's merge_call: not
    in the replica context, where it would fail, model.fit included."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import polyamp_keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip("tf.distribute needs Keras on TensorFlow")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01), enabled=False, guard=True)
        optimizer.build(model.trainable_variables)

    def step(x: Any, y: Any, bad: Any) -> None:
        with tf.GradientTape() as tape:
            loss = optimizer.scale_loss(tf.reduce_mean((model(x) - y) ** 2) * bad)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    def train_step(x: Any, y: Any, bad: Any) -> None:
        strategy.run(step, args=(x, y, bad))

    run = tf.function(train_step) if function else train_step
    x, y = tf.ones((4, 3)), tf.zeros((4, 2))
    unchanged = []
    for bad in [1.0, math.nan, 1.0]:
        before = [v.numpy().copy() for v in model.trainable_variables]
        run(x, y, tf.constant(bad))
        unchanged.append(
            all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables, strict=True))
        )
    assert unchanged == [False, True, False]
    assert int(optimizer.iterations.numpy()) == 2 and int(optimizer.skipped_steps.numpy()) == 1
    assert [(r.mode, r.reason) for r in optimizer.records()] == [
        ("guarding", None),
        ("guarding", "non_finite"),
        ("guarding", None),
    ]
    with strategy.scope():
        fitted = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        fitted.compile(polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), enabled=None), "mse")
    history = fitted.fit(np.ones((8, 3), "float32"), np.zeros((8, 2), "float32"), batch_size=4, verbose=0)
    assert math.isfinite(history.history["loss"][-1]) and int(fitted.optimizer.iterations.numpy()) == 2
