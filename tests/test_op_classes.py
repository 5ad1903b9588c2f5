"""The op-class table is the core's, and torch, Keras and JAX follow it."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

import polyamp
from polyamp import OpClass, op_class
from polyamp._src import op_classes
from polyamp.backend_api.policies import OP_CLASSES
from polyamp.conformance import COMPUTE_OPS, OPS


def test_the_table_names_each_op_once_with_its_class() -> None:
    assert not op_classes.COMPUTE_OPS & op_classes.FLOAT32_OPS
    assert set(OP_CLASSES) == op_classes.COMPUTE_OPS | op_classes.FLOAT32_OPS
    assert isinstance(OP_CLASSES, MappingProxyType)
    assert op_class("softmax") is OpClass.FLOAT32 and op_class("layer_norm") is OpClass.FLOAT32
    assert op_class("matmul") is OpClass.COMPUTE and op_class("conv") is OpClass.COMPUTE
    assert op_class("relu") is OpClass.PROMOTE  # not named: the widest dtype of its operands
    assert OpClass.FLOAT32 == "float32" and OpClass("compute") is OpClass.COMPUTE
    # The conformance cases check the table's classes.
    assert COMPUTE_OPS == {op for op in OPS if op_class(op) is OpClass.COMPUTE} == {"matmul", "dense", "conv"}


def test_unknown_names_are_an_error_where_a_backend_asks_strictly() -> None:
    with pytest.raises(polyamp.PolyampValueError, match=r"'sofmax' is not an op .* Did you mean 'softmax'\?"):
        op_class("sofmax", strict=True)
    with pytest.raises(polyamp.PolyampTypeError, match=r"op_class\(\) takes an op name \(str\)\. Received: 3"):
        op_class(3)  # type: ignore[arg-type]


# -- torch ---------------------------------------------------------------------------------------------------

#: Table ops torch reaches through other ops (no autocast entry of their own): F.cross_entropy is log_softmax +
#: nll_loss, float_power computes in float64, F.interpolate dispatches to the upsample kernels.
_TORCH_COMPOSITES = {"cross_entropy", "float_power", "interpolate"}
#: Table ops CUDA autocast lists only from some torch release on.
_TORCH_NEWER = {"rms_norm", "matrix_sqrth"}


def test_torch_cuda_autocasts_exactly_the_tables_float32_ops() -> None:
    torch = pytest.importorskip("torch")
    from polyamp_torch import _cpu_float32

    overloads = [*_cpu_float32._FP32, *_cpu_float32._FP32_SET_OPT_DTYPE, *_cpu_float32._FP32_APPEND_DTYPE]
    on_cuda_list = {
        _cpu_float32.table_name(name)
        for name in overloads
        if _cpu_float32._overload(name) is not None  # an op of this torch
        and torch._C._dispatch_has_kernel_for_dispatch_key("aten::" + name, "AutocastCUDA")
    }
    # Every overload polyamp knows CUDA runs in float32 is a float32 op of the table ...
    assert {op_class(_cpu_float32.table_name(name), strict=True) for name in overloads} == {OpClass.FLOAT32}
    # ... and every float32 op of the table is on this torch's CUDA list (or reached through one that is).
    missing = op_classes.FLOAT32_OPS - on_cuda_list - _TORCH_COMPOSITES
    assert missing <= _TORCH_NEWER, sorted(missing)
    assert {_cpu_float32.table_name(name) for name in _cpu_float32.registered_ops()} <= op_classes.FLOAT32_OPS


def test_torch_cpu_regions_follow_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which ops polyamp registers at AutocastCPU is the table's decision, not a second list."""
    pytest.importorskip("torch")
    from polyamp_torch import _cpu_float32

    installed = _cpu_float32._installed
    _cpu_float32._uninstall()  # torch's own AutocastCPU kernels only: what polyamp would add is then planned
    try:
        planned = {name for name, _ in _cpu_float32._planned()}
        assert "exp" in planned and "softmax.int" in planned
        changed = dict(OP_CLASSES, exp=OpClass.PROMOTE, softmax=OpClass.PROMOTE)
        monkeypatch.setattr(op_classes, "OP_CLASSES", MappingProxyType(changed))
        assert {name for name, _ in _cpu_float32._planned()} == planned - {"exp", "softmax.int", "softmax.Dimname"}
    finally:
        monkeypatch.undo()
        if installed:
            _cpu_float32._install()


# -- JAX -------------------------------------------------------------------------------------------------------


def test_jax_primitives_take_the_tables_classes() -> None:
    pytest.importorskip("jax")
    import polyamp_jax

    for primitive, op in polyamp_jax.PRIMITIVE_OPS.items():
        cls = op_class(op, strict=True)
        assert (primitive in polyamp_jax.COMPUTE_PRIMITIVES) is (cls is OpClass.COMPUTE), primitive
        assert (primitive in polyamp_jax.FLOAT32_PRIMITIVES) is (cls is OpClass.FLOAT32), primitive


def test_jax_autocast_computes_by_the_table() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import polyamp_jax

    x = jnp.asarray(np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4))
    w = jnp.ones((4, 4), jnp.float32)
    ops: dict[str, Any] = {
        "matmul": lambda a, b: a @ b,
        "exp": lambda a, b: jnp.exp(a),
        "sum": lambda a, b: a.sum(axis=-1),
        "softmax": lambda a, b: jax.nn.softmax(a),
        "sigmoid": lambda a, b: jax.nn.sigmoid(a),  # promote: torch's autocast leaves sigmoid alone
        "integer_pow": lambda a, b: a**3,  # a chain of multiplications, not pow
    }
    expected = {"matmul": "float16", "exp": "float32", "sum": "float32", "softmax": "float32"}
    for name, fn in ops.items():
        out = polyamp_jax.autocast(fn, policy="mixed_float16", cast_outputs=False)(x, w)
        assert str(out.dtype) == expected.get(name, "float16"), name


# -- Keras -----------------------------------------------------------------------------------------------------


def test_keras_layers_take_the_tables_classes() -> None:
    pytest.importorskip("torch")  # torch before TensorFlow in one process
    keras = pytest.importorskip("keras")
    import polyamp_keras

    float32 = {name for name, op in polyamp_keras.LAYER_OPS.items() if op_class(op, strict=True) is OpClass.FLOAT32}
    assert {cls.__name__ for cls in polyamp_keras.FLOAT32_LAYERS} == {n for n in float32 if hasattr(keras.layers, n)}
    x = np.linspace(-1, 1, 2 * 4 * 4 * 4, dtype=np.float32).reshape(2, 4, 4, 4)
    layers = {
        "Softmax": keras.layers.Softmax(),
        "LayerNormalization": keras.layers.LayerNormalization(),
        "UnitNormalization": keras.layers.UnitNormalization(),
        "Dense": keras.layers.Dense(3),
        "Conv2D": keras.layers.Conv2D(2, 3),
    }
    for name, layer in layers.items():
        expected = "float32" if op_class(polyamp_keras.LAYER_OPS[name]) is OpClass.FLOAT32 else "float16"
        assert polyamp_keras.op_output_dtype(layer, x, "mixed_float16") == expected, name
