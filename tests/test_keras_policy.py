"""polyamp_keras: polyamp's policies for Keras on every Keras backend, without TensorFlow.

In-process tests use the Keras backend of this process; the other-backend cases run in subprocesses
(Keras picks its backend once per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# -- the package: Keras only, names kept -------------------------------------------------------------------


def test_polyamp_tensorflow_re_exports_the_keras_names() -> None:
    pytest.importorskip("tensorflow")
    import polyamp_tensorflow

    for name in ("PolicyOverridesMap", "PolyampDTypePolicy", "to_keras_policy"):
        assert getattr(polyamp_tensorflow, name) is getattr(polyamp_keras, name)


def test_the_policy_hook_lives_in_polyamp_keras() -> None:
    hook = polyamp.backend_specs()["tensorflow"].policy_hook
    assert hook == "polyamp_keras:follow_polyamp_policy"


def test_serialization_names_are_unchanged_and_old_configs_load() -> None:
    assert keras.saving.get_registered_name(polyamp_keras.PolyampDTypePolicy) == "polyamp>DTypePolicy"
    assert keras.saving.get_registered_name(polyamp_keras.PolicyOverridesMap) == "polyamp>PolicyOverridesMap"
    # As written by model.save() before the classes moved to polyamp_keras.
    saved = {
        "module": "polyamp_tensorflow._keras_policy",
        "class_name": "PolicyOverridesMap",
        "config": {
            "default_policy": {
                "module": "polyamp_tensorflow._keras_policy",
                "class_name": "PolyampDTypePolicy",
                "config": {"name": "params=bfloat16,compute=float16,output=float32"},
                "registered_name": "polyamp>DTypePolicy",
            },
            "policy_map": {},
            "overrides": {"head": "float32"},
        },
        "registered_name": "polyamp>PolicyOverridesMap",
    }
    loaded = keras.saving.deserialize_keras_object(saved)
    assert isinstance(loaded, polyamp_keras.PolicyOverridesMap)
    assert (loaded.default_policy.variable_dtype, loaded.default_policy.compute_dtype) == ("bfloat16", "float16")
    assert loaded["head"].name == "float32" and loaded["body"] is loaded.default_policy


# -- subprocesses: import orders, other Keras backends -------------------------------------------------------


def run_python(code: str, *, backend: str, timeout: float = 120.0) -> Any:
    """Run ``code`` with KERAS_BACKEND=backend; return the JSON it prints last."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT / "tests",
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_polyamp_keras_needs_no_other_framework(backend: str) -> None:
    """Part of D4: with Keras on JAX or torch, the policy path imports neither TensorFlow nor more."""
    pytest.importorskip(backend)
    code = """
    import json, sys
    FRAMEWORKS = ("tensorflow", "torch", "jax")
    import keras
    before = {m for m in FRAMEWORKS if m in sys.modules}
    import polyamp, polyamp_keras
    polyamp.set_policy("mixed_bfloat16", overrides={"head": "float32"})
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(keras.layers.Dense(3, name="body")(inputs)))
    after = {m for m in FRAMEWORKS if m in sys.modules}
    print(json.dumps([keras.backend.backend(), sorted(after - before), "tensorflow" in sys.modules,
                      [layer.compute_dtype for layer in model.layers[1:]]]))
    """
    assert run_python(code, backend=backend) == [backend, [], False, ["bfloat16", "float32"]]
