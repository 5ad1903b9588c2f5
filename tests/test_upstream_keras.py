"""Keras's own optimizer, DTypePolicyMap and float8 tests, run as Keras wrote them and with polyamp's substituted.

``polyamp_tensorflow.LossScaleOptimizer`` is a subclass of Keras's ``LossScaleOptimizer`` and
``polyamp_keras.PolicyOverridesMap`` one of Keras's ``DTypePolicyMap``. This module runs Keras's tests of those
two classes (``keras/src/optimizers/loss_scale_optimizer_test.py`` and
``keras/src/dtype_policies/dtype_policy_map_test.py``), of the base optimizer's behaviours that a wrapping
optimizer must keep (``keras/src/optimizers/optimizer_test.py``, ``optimizer_sparse_test.py``), and Keras's float8
training tests (the float8 cases of ``keras/src/layers/core/dense_test.py`` and ``einsum_dense_test.py``, the
float8 functions' tests of ``keras/src/quantizers/quantizers_test.py``), on the Keras backend of the process:

* ``[native]``: as Keras wrote them. They must pass (or skip where Keras skips them on this backend); this shows
  the tests are read and run correctly here.
* ``[polyamp]``: with polyamp's class in place of Keras's, nothing else changed. The tests import the class from
  its defining module (``from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer``), so that
  name, in the tests' own module, is the one replaced; Keras's public spellings are left alone, since polyamp's
  own code checks against Keras's class through them. The optimizer tests name their optimizers through the
  module ``optimizers``, which is replaced in theirs: in ``optimizer_test.py`` every optimizer it builds comes
  wrapped in polyamp's LossScaleOptimizer at a fixed scale of 1 (the tests pass unscaled gradients), in
  ``optimizer_sparse_test.py`` its ``optimizers.LossScaleOptimizer`` case is polyamp's. In the float8 layer tests
  ``quantize("float8")`` is polyamp's FP8 path (`_float8_through_polyamp`: the layer becomes polyamp's
  ``Float8Dense`` / ``Float8EinsumDense`` with Keras's settings), and in the quantizer tests the float8
  functions are polyamp's rules (`_float8_quantizers`); the tests' expected values stay Keras's.
* ``[polyamp-float16]`` (loss-scale tests only): as ``[polyamp]``, inside ``polyamp.policy_scope("mixed_float16")``,
  the policy polyamp's optimizer is meant to be used under; Keras's tests run under float32.

The loss-scale optimizer is ``polyamp_keras.LossScaleOptimizer`` where that package has one, else
``polyamp_tensorflow.LossScaleOptimizer`` (which imports TensorFlow, whatever the Keras backend).

A polyamp run that fails is a strict xfail whose reason says why (see ``POLYAMP_EXPECTED``): a documented
difference, a gap, or a test of what the inner optimizer holds, which a wrapper does not forward (Keras's own
LossScaleOptimizer fails those the same way).

Every Keras backend: the tests run in this process on its backend (``KERAS_BACKEND``), and
``test_on_keras_backend`` runs this module again, in a subprocess, for each other installed backend
(tensorflow, jax, torch).

The tests are not copied into this repository. They are read, when the module is collected, from the Keras
source tree that the environment variable ``POLYAMP_KERAS_SOURCE`` names (a checkout of Keras at the tag of the
installed version; the seven files above and ``keras/src/version.py`` are all it needs), else from the installed
Keras, whose wheels ship them beside its code (``keras/src/optimizers/*_test.py``, ...); with neither the module
is skipped.
Their source is compiled unchanged; Keras's test helpers come from the installed ``keras.src.testing``::

    POLYAMP_KERAS_SOURCE=/path/to/keras python -m pytest tests/test_upstream_keras.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

keras = pytest.importorskip("keras")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/upstream_support.py
from upstream_support import Upstream, UpstreamUnavailable, load_test_class, source_tree  # noqa: E402

import polyamp  # noqa: E402
import polyamp_keras  # noqa: E402
from polyamp.backend_api.rules import fp8  # noqa: E402
from polyamp_keras._float8 import _delayed_dequantized  # noqa: E402
from polyamp_keras._rule import OPS  # noqa: E402

SOURCE_VARIABLE = "POLYAMP_KERAS_SOURCE"
#: Set to 0 in the subprocesses of test_on_keras_backend, which cover one backend each.
OTHER_BACKENDS_VARIABLE = "POLYAMP_KERAS_OTHER_BACKENDS"
KERAS_BACKENDS = ("tensorflow", "jax", "torch")
BACKEND = keras.backend.backend()


def _loss_scale_optimizer() -> type:
    """polyamp's LossScaleOptimizer: the Keras-only one if there is one, else TensorFlow's."""
    found = getattr(polyamp_keras, "LossScaleOptimizer", None)
    if found is None:
        import polyamp_tensorflow  # TensorFlow, also under the JAX and torch Keras backends

        found = polyamp_tensorflow.LossScaleOptimizer
    return found  # type: ignore[no-any-return]


class _Replaced(types.ModuleType):
    """A Keras module (``keras.src.optimizers``, ``keras.src.quantizers``) as an upstream test module sees it,
    with some of its names replaced."""

    def __init__(self, real: types.ModuleType, replaced: dict[str, Any]) -> None:
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(replaced)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _with_polyamp_loss_scale_optimizer(namespace: dict[str, Any]) -> types.ModuleType:
    """``optimizers`` whose ``LossScaleOptimizer`` is polyamp's (the sparse tests build it as
    ``optimizers.LossScaleOptimizer(...)`` and check ``isinstance(optimizer, optimizers.LossScaleOptimizer)``)."""
    return _Replaced(namespace["optimizers"], {"LossScaleOptimizer": _loss_scale_optimizer()})


def _wrapped_in_polyamp(namespace: dict[str, Any]) -> types.ModuleType:
    """``optimizers`` whose every optimizer comes wrapped in polyamp's LossScaleOptimizer, at a fixed scale of 1.

    ``optimizers.SGD(...)`` and ``optimizers.get(...)`` return ``LossScaleOptimizer(SGD(...), initial_scale=1.0,
    dynamic=False)``: the tests hand ``apply_gradients`` unscaled gradients and expect the inner optimizer's
    results, which a wrapper at scale 1 must give unchanged, skipping only non-finite steps.
    """
    real = namespace["optimizers"]
    wrapper = _loss_scale_optimizer()

    def wrap(optimizer: Any) -> Any:
        if isinstance(optimizer, real.Optimizer) and not isinstance(optimizer, real.LossScaleOptimizer):
            return wrapper(optimizer, initial_scale=1.0, dynamic=False)
        return optimizer

    def wrapping(cls: type) -> Callable[..., Any]:
        def make(*args: Any, **kwargs: Any) -> Any:
            return wrap(cls(*args, **kwargs))

        make.__name__ = make.__qualname__ = cls.__name__
        return make

    replaced: dict[str, Any] = {
        name: wrapping(value)
        for name, value in vars(real).items()
        if isinstance(value, type)
        and issubclass(value, real.Optimizer)
        and value not in (real.Optimizer, real.LossScaleOptimizer)
    }
    replaced["get"] = lambda *args, **kwargs: wrap(real.get(*args, **kwargs))
    return _Replaced(real, replaced)


#: Keras's default amax history length for ``quantize("float8")`` (``QuantizedFloat8DTypePolicy``'s).
KERAS_FLOAT8_HISTORY = 1024


def _keras_float8(history: int) -> str:
    """The FP8 recipe of Keras's ``quantize("float8")`` with an amax history of ``history``: delayed scaling,
    any layer size."""
    return f"float8_delayed[amax_history_length={history},alignment=1]"


#: The layers being converted by polyamp, whose inner ``quantize("float8")`` (apply_policy's) is Keras's own.
_CONVERTING: set[int] = set()


def _float8_through_polyamp(namespace: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``Dense`` and ``EinsumDense`` whose ``quantize("float8")`` is polyamp's FP8 path.

    A layer quantized to float8 (by ``layer.quantize``, ``model.quantize`` or by setting a ``float8_from_...``
    dtype policy on it, which quantizes it) is converted by ``polyamp_keras.apply_policy`` under
    ``"<its policy>+<_keras_float8(history)>"``, Keras's settings: it becomes a ``polyamp_keras.Float8Dense`` /
    ``Float8EinsumDense`` computing its casts, scales and histories with polyamp's rules. Keras's checks of the
    call (built, not yet quantized, a known mode, the class itself unless ``type_check=False``) and its other
    modes stay Keras's. Layers made before the test (none are) keep
    Keras's method: Keras binds ``quantize`` per instance when it makes a layer.
    """
    for cls in (keras.layers.Dense, keras.layers.EinsumDense):
        original = cls.quantize

        def quantize(
            self: Any,
            mode: Any = None,
            type_check: bool = True,
            config: Any = None,
            *,
            _cls: type = cls,
            _original: Callable[..., Any] = original,
        ) -> None:
            if mode != "float8" or id(self) in _CONVERTING or (type_check and type(self) is not _cls):
                _original(self, mode, type_check=type_check, config=config)
                return
            history = KERAS_FLOAT8_HISTORY
            policy = self.dtype_policy
            if policy.quantization_mode == "float8":  # the dtype policy was set to float8: the source policy's
                history = policy.amax_history_length
                self._dtype_policy = keras.dtype_policies.get(policy._source_name)
            _CONVERTING.add(id(self))
            try:
                polyamp_keras.apply_policy(
                    keras.Sequential([self]),
                    f"{self.dtype_policy.name}+{_keras_float8(history)}",
                )
            finally:
                _CONVERTING.discard(id(self))

        monkeypatch.setattr(cls, "quantize", quantize)


def _float8_format(dtype_max: Any = None, dtype: str | None = None) -> fp8.Float8Format:
    """The FP8 format Keras names by its largest value or its dtype."""
    for fmt in fp8.FORMATS.values():
        if fmt.dtype == dtype or (dtype is None and float(dtype_max) == fmt.max):
            return fmt
    raise ValueError(f"no FP8 format of max {dtype_max} / dtype {dtype}")


def _compute_float8_scale(amax: Any, scale: Any, dtype_max: Any, margin: int = 0) -> Any:
    history = keras.ops.reshape(keras.ops.convert_to_tensor(amax, "float32"), (1,))
    scale = keras.ops.convert_to_tensor(scale, "float32")
    return fp8.delayed_scale(OPS, history, scale, _float8_format(dtype_max), margin=margin)


def _compute_float8_amax_history(x: Any, amax_history: Any) -> Any:
    return fp8.push_amax(OPS, amax_history, fp8.amax(OPS, x))


def _quantize_and_dequantize(inputs: Any, scale: Any, quantized_dtype: str, compute_dtype: str) -> Any:
    scale = keras.ops.convert_to_tensor(scale, "float32")
    return _delayed_dequantized(inputs, scale, _float8_format(dtype=quantized_dtype), compute_dtype)


def _float8_quantizers(real: types.ModuleType) -> types.ModuleType:
    """``keras.src.quantizers`` with its float8 functions computed by polyamp's FP8 rules (over keras.ops), in
    Keras's signatures: the next dequantizing scale, the amax history push, the cast and back."""
    return _Replaced(
        real,
        {
            "compute_float8_scale": _compute_float8_scale,
            "compute_float8_amax_history": _compute_float8_amax_history,
            "quantize_and_dequantize": _quantize_and_dequantize,
        },
    )


#: Puts polyamp's in place for a polyamp run, given the tests' module namespace (undone after the test).
Substitute = Callable[[dict[str, Any], pytest.MonkeyPatch], None]


def _replacing(name: str, make: Callable[[dict[str, Any]], Any]) -> Substitute:
    """Replace ``name`` in the tests' module by ``make(namespace)`` (the class under test, a module of them)."""

    def substitute(namespace: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setitem(namespace, name, make(namespace))

    return substitute


class Suite(NamedTuple):
    """One upstream test file, its test class, and how polyamp's runs put polyamp's in place."""

    path: str  # inside the Keras source tree
    upstream_class: str
    substitute: Substitute
    implementations: tuple[str, ...]
    marks: tuple[pytest.MarkDecorator, ...] = ()  # on the polyamp runs
    methods: frozenset[str] | None = None  # the upstream methods run (None: all of them)


_NEEDS_TENSORFLOW = () if hasattr(polyamp_keras, "LossScaleOptimizer") else (pytest.mark.tensorflow,)

#: The float8 tests of Keras's Dense and EinsumDense tests (their other cases test int8, int4, GPTQ, AWQ, LoRA).
FLOAT8_LAYER_TESTS = (
    "test_quantize_float8",
    "test_quantize_float8_fitting",
    "test_quantize_float8_inference",
    "test_quantize_on_unbuilt_layer",
    "test_quantize_on_subclass",
    "test_quantize_when_already_quantized",
    "test_quantize_by_setting_dtype_policy",
)

SUITES = {
    "TestLossScaleOptimizer": Suite(
        "keras/src/optimizers/loss_scale_optimizer_test.py",
        "LossScaleOptimizerTest",
        _replacing("LossScaleOptimizer", lambda namespace: _loss_scale_optimizer()),
        ("native", "polyamp", "polyamp-float16"),
        _NEEDS_TENSORFLOW,
    ),
    "TestDTypePolicyMap": Suite(
        "keras/src/dtype_policies/dtype_policy_map_test.py",
        "DTypePolicyMapTest",
        _replacing("DTypePolicyMap", lambda namespace: polyamp_keras.PolicyOverridesMap),
        ("native", "polyamp"),
    ),
    # The base optimizer's behaviours, with every optimizer the tests build wrapped in polyamp's.
    "TestOptimizer": Suite(
        "keras/src/optimizers/optimizer_test.py",
        "OptimizerTest",
        _replacing("optimizers", _wrapped_in_polyamp),
        ("native", "polyamp"),
        _NEEDS_TENSORFLOW,
    ),
    # Sparse gradients (IndexedSlices on TensorFlow, BCOO on JAX; Keras skips them on torch), in Keras's
    # loss-scale-optimizer case, where polyamp's class replaces Keras's.
    "TestOptimizerSparse": Suite(
        "keras/src/optimizers/optimizer_sparse_test.py",
        "OptimizerSparseTest",
        _replacing("optimizers", _with_polyamp_loss_scale_optimizer),
        ("native", "polyamp"),
        _NEEDS_TENSORFLOW,
    ),
    # Keras's float8 training (`quantize("float8")`: delayed scaling) with polyamp's FP8 path in its place.
    "TestDenseFloat8": Suite(
        "keras/src/layers/core/dense_test.py",
        "DenseTest",
        _float8_through_polyamp,
        ("native", "polyamp"),
        methods=frozenset(FLOAT8_LAYER_TESTS),
    ),
    "TestEinsumDenseFloat8": Suite(
        "keras/src/layers/core/einsum_dense_test.py",
        "EinsumDenseTest",
        _float8_through_polyamp,
        ("native", "polyamp"),
        methods=frozenset(FLOAT8_LAYER_TESTS),
    ),
    # Keras's float8 scale, history and cast functions, computed by polyamp's rules.
    "TestQuantizersFloat8": Suite(
        "keras/src/quantizers/quantizers_test.py",
        "QuantizersTest",
        _replacing("quantizers", lambda namespace: _float8_quantizers(namespace["quantizers"])),
        ("native", "polyamp"),
        methods=frozenset(
            {"test_compute_float8_scale", "test_compute_float8_amax_history", "test_quantize_and_dequantize"}
        ),
    ),
}
#: The instantiations run, per "<upstream class>.<upstream method>" (all of them when absent). The sparse tests'
#: cases of the other optimizers test those optimizers, not a loss-scale optimizer. On JAX, where an eager
#: apply takes seconds, two of the eleven inner optimizers (adam, sgd) of the weight-decay accumulation test.
SELECTED: dict[str, frozenset[str]] = {
    **{
        f"{upstream_class}.{method}": frozenset({"float8"})
        for upstream_class in ("DenseTest", "EinsumDenseTest")
        for method in FLOAT8_LAYER_TESTS[3:]
    },
    "OptimizerSparseTest.test_sparse_gradients": frozenset({"loss_scale_optimizer_sgd"}),
    "OptimizerSparseTest.test_sparse_correctness": frozenset({"loss_scale_optimizer_sgd"}),
    **(
        {"OptimizerTest.test_gradient_accumulation_with_weigth_decay": frozenset({"0", "1"})}
        if BACKEND == "jax"
        else {}
    ),
}
#: Upstream tests run in the slow set only (a fit, two saves and loads, and on TensorFlow an export, each).
SLOW: frozenset[str] = frozenset(
    {"DenseTest.test_quantize_float8_fitting", "EinsumDenseTest.test_quantize_float8_fitting"}
)
POLYAMP_RUNS = ("polyamp", "polyamp-float16")

# -- what polyamp does differently, per upstream test ---------------------------------------------------------
#
# Set against Keras v3.15.1 (commit 250b42181ce9f37df68319d8f4753ec89a349a43), whose tests of these seven files
# pass natively with keras 3.15.1 on the tensorflow, jax and torch backends (Keras skips its sparse tests on
# torch). polyamp's FP8 path passes every float8 test on the three backends: no entry here.
#
# Keys are "<upstream class>.<upstream method>", or "...[variant]" for one of its named parameters (as in the
# test id). An entry applies to the backends and polyamp runs it names. Remove an entry once polyamp closes the
# gap: a strict xfail that passes fails the suite, and `raises` makes one that fails for another reason fail it
# too. The private attributes the optimizer tests read are the inner optimizer's (`inner_only`); the other
# private names used are the tests' own helpers, Layer._flatten_layers and QuantizedDTypePolicy._source_name.


class Expected(NamedTuple):
    mark: pytest.MarkDecorator
    backends: tuple[str, ...] = KERAS_BACKENDS
    runs: tuple[str, ...] = POLYAMP_RUNS


def private(attributes: str, **where: Any) -> Expected:
    """The test reads private attributes of the class under test, which polyamp's need not have."""
    return Expected(
        pytest.mark.xfail(strict=True, raises=AttributeError, reason=f"reads the private {attributes}"), **where
    )


def documented(reason: str, raises: type[BaseException], **where: Any) -> Expected:
    """A difference polyamp documents; the test fails with ``raises``."""
    return Expected(pytest.mark.xfail(strict=True, raises=raises, reason=f"documented difference: {reason}"), **where)


def gap(reason: str, raises: type[BaseException], **where: Any) -> Expected:
    """polyamp is not (yet) compatible with Keras here; the test fails with ``raises``."""
    return Expected(pytest.mark.xfail(strict=True, raises=raises, reason=f"gap: {reason}"), **where)


def inner_only(reason: str, raises: type[BaseException], **where: Any) -> Expected:
    """An optimizer test of what the wrapped (inner) optimizer holds, which the wrapper does not forward: Keras's
    own LossScaleOptimizer, substituted the same way, fails it the same way."""
    return Expected(
        pytest.mark.xfail(
            strict=True,
            raises=raises,
            reason=f"the inner optimizer's, not forwarded by a wrapper (as Keras's): {reason}",
        ),
        **where,
    )


POLYAMP_EXPECTED: dict[str, Expected | tuple[Expected, ...]] = {
    "OptimizerSparseTest.test_sparse_gradients[loss_scale_optimizer_sgd]": documented(
        "on JAX an array is written whole (there is no partial write of a JAX array), and polyamp's optimizer "
        "writes its step-record ring (a non-scalar variable) with the variable's own assign, which the test "
        "forbids for non-scalar variables (it guards sparse updates from being densified; the ring is not one). "
        "On TensorFlow the ring entry is a scatter through the optimizer's assign, and the test passes",
        pytest.fail.Exception,
        backends=("jax",),
    ),
    "OptimizerTest.test_clip_args": inner_only(
        "clipnorm/clipvalue/global_clipnorm read on the wrapper are None", AssertionError
    ),
    "OptimizerTest.test_clip_norm": inner_only("the wrapper's own _clip_gradients() does not clip", AssertionError),
    "OptimizerTest.test_clip_value": inner_only("the wrapper's own _clip_gradients() does not clip", AssertionError),
    "OptimizerTest.test_global_clip_norm": inner_only(
        "the wrapper's own _clip_gradients() does not clip", AssertionError
    ),
    "OptimizerTest.test_ema": inner_only("the wrapper has no _model_variables_moving_average", AttributeError),
    "OptimizerTest.test_ema_with_model_fit": inner_only(
        "the wrapper has no _model_variables_moving_average", AttributeError
    ),
    "OptimizerTest.test_get_method": inner_only(
        "optimizers.SGD, made a factory of wrapped optimizers, is no class for assertIsInstance", TypeError
    ),
    "OptimizerTest.test_static_loss_scaling": inner_only(
        "scale_loss() is the wrapper's (scale 1), not the inner optimizer's loss_scale_factor", AssertionError
    ),
    "OptimizerTest.test_set_weights": inner_only(
        "set_weights() on the wrapper sets its own variables, not the inner optimizer's (their iterations differ)",
        AssertionError,
    ),
    "OptimizerTest.test_gradient_accumulation": inner_only(
        "gradient_accumulation_steps read on the wrapper is None", AssertionError
    ),
    "OptimizerTest.test_overwrite_with_gradient_with_gradient_accumulation": inner_only(
        "_iterations read on the wrapper counts the wrapper's steps, not the inner optimizer's micro-batches",
        AssertionError,
    ),
    "OptimizerTest.test_setting_lr_to_callable_untracks_lr_var": inner_only(
        "the wrapper's variables are its own iteration and learning_rate and the inner optimizer's: 4, not 2",
        AssertionError,
    ),
    "OptimizerTest.test_optimizer_auto_naming": inner_only(
        "the wrapper is named loss_scale_optimizer..., not after the inner optimizer", AssertionError
    ),
    "LossScaleOptimizerTest.test_serialization": documented(
        "get_config() writes polyamp's settings, Keras's two spellings of init_scale/growth_interval and "
        "`enabled`, `guard`, `on_min_scale`, `history` (16 keys), where Keras writes 4 (name, inner_optimizer, "
        "initial_scale, dynamic_growth_steps): assertLen(config, 4) fails with 16 != 4",
        AssertionError,
    ),
    "LossScaleOptimizerTest.test_init_dynamic_arg": documented(
        "dynamic=False is a fixed scale that still skips non-finite steps, where Keras raises ValueError "
        '("set `loss_scale_factor`"): "ValueError not raised"',
        AssertionError,
    ),
}


# -- reading the upstream tests -------------------------------------------------------------------------------


def _installed_tests() -> Path | None:
    """The directory holding the installed ``keras`` package, when it ships the test files (Keras's wheels do)."""
    root = Path(keras.__file__).resolve().parent.parent
    if all((root / suite.path).is_file() for suite in SUITES.values()):
        return root
    return None


def _source_root() -> Path:
    value = os.environ.get(SOURCE_VARIABLE)
    if not value:
        installed = _installed_tests()
        if installed is not None:
            return installed
        raise UpstreamUnavailable(
            f"{SOURCE_VARIABLE} is not set and the installed Keras ships no tests: point it at a Keras source tree "
            f"at tag v{keras.__version__} to run Keras's optimizer and DTypePolicyMap tests"
        )
    hint = f": check out tag v{keras.__version__}"
    return source_tree(SOURCE_VARIABLE, value, "Keras", "keras/src/version.py", keras.__version__, hint)


def _load(root: Path, suite: Suite) -> Upstream:
    path = root / suite.path
    loaded = load_test_class(path, suite.upstream_class, f"keras_upstream.{path.stem}", " from the Keras source tree")
    if suite.methods is None:
        return loaded
    return loaded._replace(tests={name: v for name, v in loaded.tests.items() if name in suite.methods})


try:
    _ROOT = _source_root()
    _UPSTREAM = {name: _load(_ROOT, suite) for name, suite in SUITES.items()}
except UpstreamUnavailable as _reason:
    pytest.skip(str(_reason), allow_module_level=True)


# -- running them ---------------------------------------------------------------------------------------------


def _upstream_marks(test_class: type, method: str) -> list[Any]:
    """Keras's own pytest marks on the class and method, as Keras's conftest reads them."""
    marks: list[Any] = []
    for mark in [*getattr(test_class, "pytestmark", []), *getattr(getattr(test_class, method), "pytestmark", [])]:
        if mark.name in ("skip", "skipif"):
            marks.append(mark)
        elif mark.name == "requires_trainable_backend" and BACKEND == "numpy":
            marks.append(pytest.mark.skip(reason="Trainer not implemented for NumPy backend."))
    return marks


def _expected(upstream_class: str, upstream: str, variant: str, run: str) -> list[pytest.MarkDecorator]:
    if run == "native":
        return []
    key = f"{upstream_class}.{upstream}"
    found = POLYAMP_EXPECTED.get(f"{key}[{variant}]") if variant else None
    if found is None:
        found = POLYAMP_EXPECTED.get(key, ())
    entries = (found,) if isinstance(found, Expected) else found
    return [entry.mark for entry in entries if BACKEND in entry.backends and run in entry.runs][:1]


@pytest.fixture
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The class under test: Keras's ("native"), or polyamp's in its place, under float16 for "polyamp-float16"."""
    suite_name, run = request.param
    if run == "native":
        yield run
        return
    suite = SUITES[suite_name]
    namespace = _UPSTREAM[suite_name].namespace
    try:
        suite.substitute(namespace, monkeypatch)
    except ImportError as exc:
        pytest.skip(f"polyamp's LossScaleOptimizer needs {exc.name}, which is not installed")
    if run == "polyamp-float16":
        with polyamp.policy_scope("mixed_float16"):
            yield run
    else:
        yield run


def _make_test(suite_name: str, upstream: str, variants: dict[str, str]) -> Callable[..., None]:
    suite, loaded = SUITES[suite_name], _UPSTREAM[suite_name]
    params = []
    for variant, method in variants.items():
        for run in suite.implementations:
            marks = _upstream_marks(loaded.test_class, method) + _expected(suite.upstream_class, upstream, variant, run)
            if run != "native":
                marks += suite.marks
            if f"{suite.upstream_class}.{upstream}" in SLOW:
                marks.append(pytest.mark.slow)
            params.append(
                pytest.param(
                    method,
                    (suite_name, run),
                    id="-".join(part for part in (BACKEND, variant, run) if part),
                    marks=marks,
                )
            )

    @pytest.mark.parametrize(("method", "implementation"), params, indirect=["implementation"])
    def test(self: object, method: str, implementation: str) -> None:
        # debug() runs setUp, the test, tearDown and cleanups, letting failures and skips propagate to pytest.
        loaded.test_class(method).debug()

    test.__name__ = test.__qualname__ = upstream
    test.__doc__ = f"Keras's {suite.upstream_class}.{upstream} ({loaded.path}), on the {BACKEND} backend."
    return test


def _selected(upstream_class: str, upstream: str, variants: dict[str, str]) -> dict[str, str]:
    chosen = SELECTED.get(f"{upstream_class}.{upstream}")
    return variants if chosen is None else {v: m for v, m in variants.items() if v in chosen}


for _suite_name, _loaded in _UPSTREAM.items():
    globals()[_suite_name] = type(
        _suite_name,
        (),
        {
            "__doc__": f"Keras's {SUITES[_suite_name].upstream_class} ({_loaded.path}).",
            **{
                name: _make_test(_suite_name, name, _selected(SUITES[_suite_name].upstream_class, name, variants))
                for name, variants in _loaded.tests.items()
            },
        },
    )


def test_expectations_name_upstream_tests() -> None:
    """Every entry of POLYAMP_EXPECTED names an upstream test that was read, variants, backends and runs that exist."""
    known = {
        f"{SUITES[name].upstream_class}.{upstream}": set(variants)
        for name, loaded in _UPSTREAM.items()
        for upstream, variants in loaded.tests.items()
    }
    for key, found in POLYAMP_EXPECTED.items():
        upstream, _, variant = key.partition("[")
        assert upstream in known, f"POLYAMP_EXPECTED names {upstream}, which the Keras tests read do not have"
        if variant:
            assert variant.rstrip("]") in known[upstream], f"POLYAMP_EXPECTED: {key} is not one of its variants"
        for entry in (found,) if isinstance(found, Expected) else found:
            assert set(entry.backends) <= set(KERAS_BACKENDS) and set(entry.runs) <= set(POLYAMP_RUNS), key
    for name, suite in SUITES.items():
        missing = (suite.methods or frozenset()) - set(_UPSTREAM[name].tests)
        assert not missing, f"{name} runs {sorted(missing)}, which {suite.path} does not have"
    for test in SLOW:
        assert test in known, f"SLOW: {test}"
    for test, chosen in SELECTED.items():
        assert test in known and chosen <= known[test], f"SELECTED: {test} {sorted(chosen - known.get(test, set()))}"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(OTHER_BACKENDS_VARIABLE) == "0", reason="this process covers one backend")
@pytest.mark.parametrize("backend", [b for b in KERAS_BACKENDS if b != BACKEND])
def test_on_keras_backend(backend: str, run_bounded: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """This module on another Keras backend, in a subprocess (Keras picks its backend once per process)."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    env = dict(os.environ, KERAS_BACKEND=backend, **{OTHER_BACKENDS_VARIABLE: "0"})
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    result = run_bounded(
        [sys.executable, "-m", "pytest", __file__, "-p", "no:cacheprovider", "-m", "", "-q", "-rfE"],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, f"Keras backend {backend}:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"


def test_float8_substitutes_are_polyamps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The polyamp runs of the float8 tests run polyamp's FP8 path: quantizing a layer (by ``quantize``,
    ``model.quantize`` or its dtype policy) makes it polyamp's, with Keras's settings, and the quantizer
    functions are polyamp's rules."""
    _float8_through_polyamp({}, monkeypatch)
    keras_settings = polyamp.Policy(_keras_float8(KERAS_FLOAT8_HISTORY)).float8
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    dense.quantize("float8")
    assert type(dense) is polyamp_keras.Float8Dense and dense.float8_recipe == keras_settings
    assert dense.dtype_policy.name == "float8_from_float32" and dense.inputs_amax_history.shape == (1024,)
    einsum = keras.layers.EinsumDense("ab,bc->ac", output_shape=4)
    model = keras.Sequential([keras.Input((3,)), einsum])
    model.quantize("float8")
    assert type(einsum) is polyamp_keras.Float8EinsumDense and einsum.float8_recipe == keras_settings
    by_policy = keras.layers.Dense(2)
    by_policy.build((None, 3))
    by_policy.dtype_policy = keras.dtype_policies.QuantizedFloat8DTypePolicy(
        "float8", "mixed_bfloat16", amax_history_length=8
    )
    assert type(by_policy) is polyamp_keras.Float8Dense
    assert by_policy.float8_recipe == polyamp.Policy(_keras_float8(8)).float8
    assert by_policy.dtype_policy.name == "float8_from_mixed_bfloat16" and by_policy.compute_dtype == "bfloat16"

    quantizers = _float8_quantizers(keras.quantizers)
    tiny = keras.ops.convert_to_tensor(1e-37, "float32")  # 448 / it overflows: Keras stores a scale of 0
    assert float(quantizers.compute_float8_scale(tiny, 2.0, 448.0)) == 2.0  # polyamp keeps the previous scale
    assert float(keras.quantizers.compute_float8_scale(tiny, 2.0, 448.0)) != 2.0
