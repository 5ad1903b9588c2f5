"""polyamp_keras.LossScaleOptimizer's saved state: the variables a weights file hands back are checked before they
are loaded (a corrupt scale or an impossible counter is refused, naming the entry, and the optimizer is left
unchanged), a valid one resumes the run and its records, and ``from_config`` names what is wrong.

The tests run on this process's Keras backend; `test_jax_runs_the_keras_checks` runs them again on Keras's JAX
backend in a subprocess (Keras picks its backend once per process).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polyamp import PolyampTypeError, PolyampValueError, StateDictError

HERE = Path(__file__).resolve()
#: Set in the subprocess that runs the Keras tests on JAX.
SUBPROCESS = os.environ.get("POLYAMP_KERAS_SAVED_STATE_SUBPROCESS") == "1"


def _keras() -> Any:
    return pytest.importorskip("keras")


def _keras_model_and_optimizer() -> tuple[Any, Any]:
    keras = _keras()
    import polyamp_keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01), growth_interval=4)
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _fit_once(model: Any) -> None:
    model.fit(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), batch_size=4, epochs=1, verbose=0)


def _saved_weights(tmp_path: Path, edits: dict[str, Any]) -> tuple[Path, dict[str, np.ndarray]]:
    """A model.weights.h5 after one step, with some of the optimizer's variables (by name) overwritten; and the
    optimizer's entries as a store (``store[str(i)]``)."""
    h5py = pytest.importorskip("h5py")
    model, optimizer = _keras_model_and_optimizer()
    _fit_once(model)
    path = tmp_path / "model.weights.h5"
    model.save_weights(str(path))
    index = {name: i for i, name in enumerate(v.name for v in optimizer.variables)}
    with h5py.File(path, "r+") as file:
        for name, value in edits.items():
            file[f"optimizer/vars/{index[name]}"][...] = value
        store = {key: np.asarray(file[f"optimizer/vars/{key}"]) for key in file["optimizer/vars"]}
    return path, store


def _snapshot(optimizer: Any) -> list[bytes]:
    return [np.asarray(_keras().ops.convert_to_numpy(v)).tobytes() for v in optimizer.variables]


CORRUPT_SCALES = {"zero": 0.0, "subnormal": 1e-42, "nan": math.nan, "inf": math.inf, "negative": -4.0}


@pytest.mark.parametrize("value", list(CORRUPT_SCALES.values()), ids=list(CORRUPT_SCALES))
def test_keras_corrupted_saved_scale_is_refused_and_the_optimizer_unchanged(tmp_path: Path, value: float) -> None:
    path, store = _saved_weights(tmp_path, {"dynamic_scale": value})
    model, optimizer = _keras_model_and_optimizer()
    _fit_once(model)
    before = _snapshot(optimizer)
    with pytest.raises(StateDictError) as caught:
        optimizer.load_own_variables(store)
    message = str(caught.value)
    shown = repr(float(np.float32(value)))
    assert "dynamic_scale (entry 'optimizer/vars/" in message and f"= {shown}" in message
    assert "The optimizer was left unchanged" in message and "h5py.File('model.weights.h5', 'r+')" in message
    assert "skip_mismatch=True" in message
    assert _snapshot(optimizer) == before
    # through Keras, which wraps the refusal into its own ValueError
    with pytest.raises(ValueError, match="Cannot load the variables of LossScaleOptimizer"):
        model.load_weights(str(path))
    assert _snapshot(optimizer) == before
    _fit_once(model)
    assert all(np.isfinite(_keras().ops.convert_to_numpy(w)).all() for w in model.trainable_variables)


@pytest.mark.parametrize(
    ("edits", "fragment"),
    [
        ({"step_counter": 4}, "growth tracker must be in [0, growth_interval=4). Received: 4"),
        ({"step_counter": -1}, "growth tracker must be in [0, growth_interval=4). Received: -1"),
        ({"hysteresis_left": 0}, "hysteresis_left must be in [1, hysteresis=1]. Received: 0"),
        ({"skipped_steps": -3}, "is -3, a count that cannot be negative"),
    ],
    ids=["tracker_at_interval", "tracker_negative", "hysteresis_zero", "negative_count"],
)
def test_keras_impossible_saved_counters_are_refused(tmp_path: Path, edits: dict[str, Any], fragment: str) -> None:
    _, store = _saved_weights(tmp_path, edits)
    _, optimizer = _keras_model_and_optimizer()
    before = _snapshot(optimizer)
    with pytest.raises(StateDictError) as caught:
        optimizer.load_own_variables(store)
    assert fragment in str(caught.value)
    assert _snapshot(optimizer) == before


def test_keras_a_valid_saved_state_loads_and_the_records_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="polyamp")
    path, _ = _saved_weights(tmp_path, {"dynamic_scale": 1024.0})
    model, optimizer = _keras_model_and_optimizer()
    model.load_weights(str(path))
    assert optimizer.get_scale() == 1024.0
    assert optimizer.state_dict()["_growth_tracker"] == 1
    _fit_once(model)
    records = optimizer.records()
    assert [(r.iteration, r.scale) for r in records] == [(1, 1024.0)]  # the saved run's step is not replayed
    assert not [r for r in caplog.records if r.name == "polyamp" and "without being recorded" in r.getMessage()]


def test_keras_from_config_names_what_is_wrong() -> None:
    keras = _keras()
    import polyamp_keras

    config = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1)).get_config()
    with pytest.raises(PolyampTypeError, match=r"'spike' holds \['bogus'\], which SpikeRule does not take"):
        polyamp_keras.LossScaleOptimizer.from_config(dict(config, spike={"bogus": 1}))
    without = {key: value for key, value in config.items() if key != "inner_optimizer"}
    with pytest.raises(PolyampValueError, match=r"needs 'inner_optimizer'.*Received the keys: \["):
        polyamp_keras.LossScaleOptimizer.from_config(without)
    with pytest.raises(PolyampTypeError, match=r"takes the dict get_config\(\) returned\. Received: \[\]"):
        polyamp_keras.LossScaleOptimizer.from_config([])  # type: ignore[arg-type]
    assert polyamp_keras.LossScaleOptimizer.from_config(config).get_config() == config


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


@pytest.mark.slow
@pytest.mark.skipif(SUBPROCESS, reason="the subprocess runs the Keras tests on its own backend")
def test_jax_runs_the_keras_checks() -> None:
    """The same Keras tests on Keras's JAX backend, in a fresh process (Keras picks its backend once)."""
    if any(_missing(module) for module in ("jax", "keras", "h5py")):
        pytest.skip("jax, keras or h5py is not installed")
    env = dict(os.environ, KERAS_BACKEND="jax", POLYAMP_KERAS_SAVED_STATE_SUBPROCESS="1", TF_CPP_MIN_LOG_LEVEL="3")
    # Every test of this module but this one (``-k`` also matches the module's name, so no name prefix selects).
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(HERE),
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "",
        "-k",
        "not test_jax_runs",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=HERE.parent.parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in result.stdout.splitlines()[-1] and "skipped" not in result.stdout.splitlines()[-1]
