"""Long runs, device against reference: the torch and TensorFlow scalers follow `polyamp.LossScaleConfig` step by
step over 10,000-step random soaks, storms of overflows at extreme scales, and a run resumed on the other backend.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest

from polyamp import LossScaleConfig

torch = pytest.importorskip("torch")  # before TensorFlow, in a process that imports both

import polyamp_torch  # noqa: E402

#: Settings at the edges of float32: scales near its smallest normal, odd factors, and a scale that grows
#: towards its largest value.
EXTREME = [
    {"init_scale": 2.0**-100, "min_scale": 2.0**-126, "growth_interval": 5},
    {"init_scale": 3.0e-37, "min_scale": 1.2e-38, "backoff_factor": 0.3, "growth_factor": 1.7, "growth_interval": 3},
    {"init_scale": 2.0**120, "growth_factor": 2.0**5, "growth_interval": 1, "backoff_factor": 1e-30},
]

SOAK_CONFIGS = [
    {},
    {"growth_interval": 7, "hysteresis": 3, "min_scale": 4.0, "max_scale": 2.0**20},
    {"growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 3, "min_scale": 2.0**-100, "init_scale": 5.0},
]


def _torch_steps(config: dict[str, Any], pattern: list[bool]) -> Iterator[Any]:
    """A torch scaler with ``config`` through one step per entry of ``pattern`` (True: an infinite gradient),
    yielded after each step's update."""
    scaler = polyamp_torch.TorchLossScaler("cpu", **config)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.0)
    for overflow in pattern:
        scaler.scale(param.sum() * 0.0).backward()
        if overflow:
            param.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        yield scaler


def _torch_states(config: dict[str, Any], pattern: list[bool]) -> list[tuple[float, int, int]]:
    states = []
    for scaler in _torch_steps(config, pattern):
        state = scaler.get_state()
        states.append((state.scale, state.growth_tracker, state.hysteresis_left))
    return states


def _tensorflow_states(config: dict[str, Any], pattern: list[bool]) -> list[tuple[float, int, int]]:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import polyamp_tensorflow

    scaler = polyamp_tensorflow.TensorFlowLossScaler(enabled=True, **config)
    w = tf.Variable([0.0, 0.0])
    opt = keras.optimizers.SGD(0.0)
    opt.build([w])

    @tf.function
    def step(bad: Any) -> Any:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w * bad))
        scaler.apply_gradients(opt, zip(tape.gradient(scaled, [w]), [w]))
        return scaler.device_form._state().scale  # type: ignore[union-attr]

    states = []
    for overflow in pattern:
        step(tf.constant(math.inf if overflow else 0.0))
        state = scaler.get_state()
        states.append((state.scale, state.growth_tracker, state.hysteresis_left))
    return states


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SOAK_CONFIGS)))
def test_a_10000_step_soak_on_torch_matches_the_reference(index: int) -> None:
    config = {**SOAK_CONFIGS[index], "growth_interval": SOAK_CONFIGS[index].get("growth_interval", 25)}
    rng = random.Random(index)
    pattern = [rng.random() < 0.05 for _ in range(10_000)]
    reference = LossScaleConfig(**config).states(pattern)
    scales = torch.empty(len(pattern))
    for step, scaler in enumerate(_torch_steps(config, pattern)):
        scales[step] = scaler.device_form._state.scale  # device copy, no host read
    assert scales.tolist() == [s.scale for s in reference]


@pytest.mark.slow
@pytest.mark.parametrize("index", [1, 2])
def test_a_10000_step_soak_on_tensorflow_matches_the_reference(index: int) -> None:
    config = {**SOAK_CONFIGS[index]}
    rng = random.Random(100 + index)
    pattern = [rng.random() < 0.1 for _ in range(10_000)]
    expected = [(s.scale, s.growth_tracker, s.hysteresis_left) for s in LossScaleConfig(**config).states(pattern)]
    assert _tensorflow_states(config, pattern) == expected


@pytest.mark.parametrize("index", range(len(EXTREME)))
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_storms_at_extreme_scales_follow_the_reference(backend: str, index: int) -> None:
    """TensorFlow's CPU kernels flush subnormals to zero: scales stay normal, so no backend diverges."""
    config = EXTREME[index]
    pattern = [True] * 200 + [False] * 20 + [random.Random(index).random() < 0.3 for _ in range(80)]
    expected = [(s.scale, s.growth_tracker, s.hysteresis_left) for s in LossScaleConfig(**config).states(pattern)]
    states = _torch_states(config, pattern) if backend == "torch" else _tensorflow_states(config, pattern)
    assert states == expected


def test_cross_backend_resume_at_odd_factors_follows_the_reference() -> None:
    pytest.importorskip("tensorflow")
    config = {"growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 3, "min_scale": 2.0**-60}
    rng = random.Random(7)
    pattern = [rng.random() < 0.4 for _ in range(120)]
    half = 60
    torch_first = _torch_states(config, pattern[:half])
    saved = json.loads(json.dumps(polyamp_torch.TorchLossScaler("cpu", **config).state_dict()))
    reference = LossScaleConfig(**config).states(pattern)
    assert torch_first == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in reference[:half]]
    saved.update(scale=reference[half - 1].scale, _growth_tracker=reference[half - 1].growth_tracker)
    import tensorflow as tf

    import polyamp_tensorflow

    scaler = polyamp_tensorflow.TensorFlowLossScaler(enabled=True)
    scaler.load_state_dict(saved)
    w = tf.Variable([0.0])
    import keras

    opt = keras.optimizers.SGD(0.0)
    got = []
    for overflow in pattern[half:]:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(w) * (math.inf if overflow else 0.0))
        scaler.apply_gradients(opt, zip(tape.gradient(scaled, [w]), [w]))
        state = scaler.get_state()
        got.append((state.scale, state.growth_tracker, state.hysteresis_left))
    assert got == [(s.scale, s.growth_tracker, s.hysteresis_left) for s in reference[half:]]
