"""polyamp_keras: Keras follows polyamp's policy in every thread, on every Keras backend, without TensorFlow.

In-process tests use the Keras backend of this process; the import-order and other-backend cases run in
subprocesses (Keras picks its backend once per process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

keras = pytest.importorskip("keras")

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402

if TYPE_CHECKING:
    from conftest import KerasJson

TIMEOUT = 10.0


@pytest.fixture(autouse=True)
def no_explicit_keras_policy() -> Iterator[None]:
    """Tests here set Keras's own per-thread policy; the main thread's is cleared again afterwards."""
    yield
    from keras.src.backend.common import global_state

    global_state.set_global_attribute("dtype_policy", None)


def dense_dtypes() -> tuple[str, str]:
    """(compute dtype, variable dtype) of a Dense layer built now, in the calling thread."""
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    return layer.compute_dtype, layer.kernel.dtype


def in_thread(work: Callable[[], Any]) -> Any:
    """Run ``work`` in a new thread and return its result (re-raising its exception)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the thread did not finish"
    if "error" in box:
        raise box["error"]
    return box["result"]


def wait(event: threading.Event) -> None:
    assert event.wait(TIMEOUT), "an event the test waits for never came"


# -- every thread follows set_policy; policy_scope stays in its thread ---------------------------------


def test_a_layer_built_in_a_worker_follows_set_policy_from_the_main_thread() -> None:
    """D3: Keras keeps its default policy per thread; polyamp's is per process."""
    polyamp.set_policy("mixed_float16")
    assert in_thread(dense_dtypes) == ("float16", "float32")
    assert in_thread(lambda: keras.config.dtype_policy().name) == "mixed_float16"


def test_set_policy_in_a_worker_reaches_keras_in_the_main_thread() -> None:
    """D3: the setting is process-wide whichever thread makes it."""
    in_thread(lambda: polyamp.set_policy("mixed_bfloat16"))
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert dense_dtypes() == ("bfloat16", "float32")


def test_a_thread_started_earlier_follows_a_later_set_policy() -> None:
    started, changed = threading.Event(), threading.Event()

    def worker() -> tuple[tuple[str, str], tuple[str, str]]:
        before = dense_dtypes()
        started.set()
        wait(changed)
        return before, dense_dtypes()

    def change() -> None:
        wait(started)
        polyamp.set_policy("float16")
        changed.set()

    threading.Thread(target=change, daemon=True).start()
    assert in_thread(worker) == (("float32", "float32"), ("float16", "float16"))


def test_policy_scope_reaches_keras_only_in_its_own_thread() -> None:
    polyamp.set_policy("mixed_bfloat16")
    inside, checked = threading.Event(), threading.Event()
    seen: dict[str, tuple[str, str]] = {}

    def scoped() -> tuple[str, str]:
        with polyamp.policy_scope("float16"):
            inside.set()
            wait(checked)
            return dense_dtypes()

    def check_main() -> None:
        wait(inside)
        seen["other thread, scope open"] = in_thread(dense_dtypes)
        checked.set()

    threading.Thread(target=check_main, daemon=True).start()
    assert in_thread(scoped) == ("float16", "float16")
    assert seen == {"other thread, scope open": ("bfloat16", "float32")}
    assert dense_dtypes() == ("bfloat16", "float32")


def test_overrides_reach_keras_in_every_thread() -> None:
    polyamp.set_policy("mixed_float16", overrides={"head": "float32"})

    def build() -> dict[str, str]:
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(2, name="head")(keras.layers.Dense(3, name="body")(inputs))
        return {layer.name: layer.compute_dtype for layer in keras.Model(inputs, outputs).layers[1:]}

    assert in_thread(build) == {"body": "float16", "head": "float32"}
    assert isinstance(in_thread(keras.config.dtype_policy), polyamp_keras.PolicyOverridesMap)


def test_clear_session_does_not_stop_keras_following() -> None:
    polyamp.set_policy("mixed_float16")
    keras.utils.clear_session(free_memory=False)  # Keras drops its per-thread state, polyamp's hook included
    assert dense_dtypes() == ("float16", "float32")
    assert in_thread(dense_dtypes) == ("float16", "float32")


# -- Keras's own setting: the later of the two wins, per thread -----------------------------------------


def test_keras_set_dtype_policy_wins_in_its_thread_until_polyamp_changes() -> None:
    polyamp.set_policy("mixed_float16")
    set_in_worker, changed = threading.Event(), threading.Event()

    def worker() -> tuple[tuple[str, str], tuple[str, str]]:
        keras.config.set_dtype_policy("bfloat16")
        own = dense_dtypes()
        set_in_worker.set()
        wait(changed)
        return own, dense_dtypes()

    def main_side() -> tuple[str, str]:
        wait(set_in_worker)
        here = in_thread(dense_dtypes)  # a third thread: the worker's Keras setting is the worker's only
        polyamp.set_policy("mixed_bfloat16")
        changed.set()
        return here

    checker: dict[str, tuple[str, str]] = {}
    thread = threading.Thread(target=lambda: checker.update(other=main_side()), daemon=True)
    thread.start()
    assert in_thread(worker) == (("bfloat16", "bfloat16"), ("bfloat16", "float32"))
    thread.join(TIMEOUT)
    assert checker == {"other": ("float16", "float32")}


def test_keras_setting_made_under_a_policy_returns_after_a_scope() -> None:
    polyamp.set_policy("mixed_float16")
    keras.mixed_precision.set_global_policy("float16")  # Keras's legacy name for set_dtype_policy
    assert dense_dtypes() == ("float16", "float16")
    with polyamp.policy_scope("mixed_bfloat16"):
        assert dense_dtypes() == ("bfloat16", "float32")
    assert dense_dtypes() == ("float16", "float16")  # made under the setting in effect again
    with polyamp.policy_scope("mixed_bfloat16"):
        keras.config.set_dtype_policy("bfloat16")  # made inside the scope (replacing the one before it)
        assert dense_dtypes() == ("bfloat16", "bfloat16")
    assert dense_dtypes() == ("float16", "float32")  # ... ends with it
    keras.config.set_dtype_policy("float16")
    polyamp.set_policy("mixed_float16")  # a new polyamp setting is the later one
    assert dense_dtypes() == ("float16", "float32")


def test_keras_is_left_alone_until_polyamp_has_a_policy() -> None:
    assert polyamp.get_policy_setting().source == "default"
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert dense_dtypes() == ("bfloat16", "float32")
    assert in_thread(dense_dtypes) == ("float32", "float32")  # Keras's own per-thread default
    polyamp.set_policy("mixed_float16")
    assert dense_dtypes() == ("float16", "float32")


# -- the package: Keras only, names kept -------------------------------------------------------------------


def test_polyamp_tensorflow_re_exports_the_keras_names() -> None:
    pytest.importorskip("tensorflow")
    import polyamp_tensorflow

    for name in ("PolicyOverridesMap", "PolyampDTypePolicy", "to_keras_policy"):
        assert getattr(polyamp_tensorflow, name) is getattr(polyamp_keras, name)


def test_the_policy_hook_lives_in_polyamp_keras() -> None:
    hook = polyamp.backend_api.backend_specs()["keras"].policy_hook
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


@pytest.mark.parametrize("backend", ["jax", pytest.param("torch", marks=pytest.mark.slow)])
def test_polyamp_keras_needs_no_other_framework(backend: str, keras_json: KerasJson) -> None:
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
    assert keras_json(code, backend=backend) == [backend, [], False, ["bfloat16", "float32"]]


def test_keras_imported_first_in_a_worker_follows_in_every_thread(keras_json: KerasJson) -> None:
    """D3: set_policy, then a worker imports keras; every thread's layers follow, the main thread's too."""
    pytest.importorskip("jax")
    code = """
    import json, threading
    import polyamp
    polyamp.set_policy("mixed_float16")
    started, imported = threading.Event(), threading.Event()
    seen = {}

    def dense(where):
        import keras
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        seen[where] = [layer.compute_dtype, layer.kernel.dtype]

    def early():  # running before keras is imported at all
        started.set()
        imported.wait(60)
        dense("thread started before the import")

    def importer():
        import keras
        dense("importing thread")
        imported.set()

    threads = [threading.Thread(target=early), threading.Thread(target=importer)]
    threads[0].start(); started.wait(60); threads[1].start()
    for thread in threads:
        thread.join(60)
    dense("main thread")
    print(json.dumps(seen))
    """
    expected = ["float16", "float32"]
    assert keras_json(code, backend="jax") == {
        "importing thread": expected,
        "thread started before the import": expected,
        "main thread": expected,
    }


def test_a_keras_that_keeps_its_policy_elsewhere_gets_the_calling_thread_and_a_warning(keras_json: KerasJson) -> None:
    """Should Keras change how it stores its default policy, polyamp says so and does what it can."""
    pytest.importorskip("jax")
    code = """
    import json, threading, warnings
    import keras  # before polyamp: nothing of polyamp's is set up in Keras yet
    import polyamp, polyamp_keras._follow as follow
    follow._keras_global_state = lambda: None  # as if keras.config.dtype_policy read something else
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        polyamp.set_policy("mixed_float16")
        polyamp.set_policy("mixed_bfloat16")
    worker = []
    thread = threading.Thread(target=lambda: worker.append(keras.config.dtype_policy().name))
    thread.start(); thread.join()
    print(json.dumps([[str(w.message) for w in caught], keras.config.dtype_policy().name, worker]))
    """
    messages, here, worker = keras_json(code, backend="jax")
    assert len(messages) == 1 and messages[0].startswith("polyamp cannot find where Keras"), messages
    assert (here, worker) == ("mixed_bfloat16", ["float32"])


@pytest.mark.tensorflow
@pytest.mark.parametrize(
    "moment",
    [
        "keras_appears",
        pytest.param("tensorflow_appears", marks=pytest.mark.slow),
        pytest.param("watched", marks=pytest.mark.slow),
    ],
)
def test_set_policy_while_another_thread_imports_keras(moment: str, keras_json: KerasJson) -> None:
    """D4: set_policy mid-import (Keras on TensorFlow, which imports for seconds) neither raises nor
    blocks, leaves TensorFlow importable, and every thread's Keras follows once the import is done."""
    pytest.importorskip("tensorflow")
    code = f"""
    import json, sys, threading, time, warnings
    warnings.simplefilter("error", RuntimeWarning)
    import polyamp
    MOMENT = {moment!r}
    if MOMENT == "watched":
        polyamp.set_policy("mixed_bfloat16")  # polyamp now waits for keras's import
    result = {{}}

    def importer():
        import keras
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        result["importing thread"] = [layer.compute_dtype, layer.kernel.dtype]

    thread = threading.Thread(target=importer)
    thread.start()
    marker = "tensorflow" if MOMENT == "tensorflow_appears" else "keras"
    deadline = time.monotonic() + 60
    while marker not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.0005)
    result["mid-import"] = getattr(getattr(sys.modules.get("keras"), "__spec__", None), "_initializing", False)
    began = time.monotonic()
    try:
        polyamp.set_policy("mixed_float16")
        result["set_policy"] = "ok"
    except BaseException as exc:
        result["set_policy"] = repr(exc)
    result["set_policy seconds"] = time.monotonic() - began
    result["returned mid-import"] = getattr(sys.modules["keras"].__spec__, "_initializing", False)
    thread.join(120)
    import keras
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    result["main thread"] = [layer.compute_dtype, layer.kernel.dtype]
    import tensorflow as tf
    result["tensorflow works"] = float(tf.constant(1.0) + 1.0)
    print(json.dumps(result))
    """
    result = keras_json(code, backend="tensorflow")
    assert result.pop("mid-import") is True, "the import finished before set_policy: the test proves nothing"
    assert result.pop("set_policy seconds") < 1.0
    assert result == {
        "set_policy": "ok",
        "returned mid-import": True,
        "importing thread": ["float16", "float32"],
        "main thread": ["float16", "float32"],
        "tensorflow works": 2.0,
    }
