"""`autocast`: polyamp's op classes for JAX functions, by interpreting their jaxpr.

Within ``autocast(fn)`` under a policy that computes in float16 or bfloat16, ``fn``'s floating arguments enter
in the compute dtype (as jmp's ``cast_to_compute`` would give them; arrays ``fn`` captures keep their dtype),
and each primitive then runs by class, the classes torch's autocast and polyamp's Keras models use:

* matrix products and convolutions (``dot_general``, ``conv_general_dilated``) in the compute dtype;
* in float32, the ops polyamp's op-class table (`polyamp.OP_CLASSES`, CUDA autocast's lists) runs in float32,
  through the primitives standing for them (`PRIMITIVE_OPS`): exponentials and logarithms (``exp``, ``log``,
  ``log1p``, ``expm1``), sums and products over axes (``reduce_sum``, ``reduce_prod``, ``cumsum``,
  ``cumprod``, ``cumlogsumexp``), ``rsqrt``, ``pow`` and the special functions CUDA keeps in float32
  (``erf_inv``, ``tan``, ``acos``, ``asin``, ``cosh``, ``sinh``); so softmax, log-softmax, cross-entropy,
  means, variances and the statistics of layer and RMS norms are float32, while ``logistic`` (sigmoid),
  ``exp2``, ``lgamma`` and ``digamma`` follow their operands, as they do under torch's autocast;
* everything else in the widest floating dtype among its operands (JAX's own promotion; a weakly typed
  constant, such as a Python scalar, takes its partner's dtype), so a value that became float32 stays float32
  until the next matrix product.

Outputs leave in the policy's output dtype. The interpretation happens while ``fn`` is traced, so it costs
nothing per step under ``jax.jit`` and ``jax.grad`` differentiates the result as usual. Explicit casts
written in ``fn`` (``x.astype(jnp.float32)``) are kept. Control flow (``lax.cond``, ``while_loop``,
``scan``) runs as ``fn`` wrote it, on operands cast back to the dtypes it was traced with; calls of jitted
functions and of functions with custom derivatives are interpreted too (their primal operations run by class
and are differentiated as written, without the custom rule).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from polyamp import OpClass, Policy, get_policy, op_class

__all__ = ["COMPUTE_PRIMITIVES", "FLOAT32_PRIMITIVES", "PRIMITIVE_OPS", "autocast"]

#: Each JAX primitive that stands for an op of polyamp's op-class table (`polyamp.OP_CLASSES`), by the
#: table's name. The table decides the class; a primitive not named here computes in the widest dtype of its
#: operands. JAX's ``x ** n`` with a Python integer ``n`` is ``integer_pow``, a chain of multiplications,
#: and is not ``pow``.
PRIMITIVE_OPS: Mapping[str, str] = MappingProxyType(
    {
        "dot_general": "matmul",
        "ragged_dot": "matmul",
        "ragged_dot_general": "matmul",
        "conv_general_dilated": "conv",
        "exp": "exp",
        "log": "log",
        "log1p": "log1p",
        "expm1": "expm1",
        "reduce_sum": "sum",
        "reduce_prod": "prod",
        "cumsum": "cumsum",
        "cumprod": "cumprod",
        "cumlogsumexp": "logsumexp",
        "rsqrt": "rsqrt",
        "pow": "pow",
        "erf_inv": "erfinv",
        "tan": "tan",
        "acos": "acos",
        "asin": "asin",
        "cosh": "cosh",
        "sinh": "sinh",
    }
)
#: Primitives that run in the policy's compute dtype.
COMPUTE_PRIMITIVES = frozenset(p for p, op in PRIMITIVE_OPS.items() if op_class(op, strict=True) is OpClass.COMPUTE)
#: Primitives that run in float32 whatever the compute dtype.
FLOAT32_PRIMITIVES = frozenset(p for p, op in PRIMITIVE_OPS.items() if op_class(op, strict=True) is OpClass.FLOAT32)
#: Call-like primitives whose body is interpreted by class; the closed jaxpr is under one of these params.
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALL_PRIMITIVES = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
)
#: Params that name a result dtype, reset when the operands' dtype changes.
_DTYPE_PARAMS = ("preferred_element_type", "out_dtype")


def _policy(policy: Policy | str | None) -> Policy:
    if policy is None:
        return get_policy()
    return policy if isinstance(policy, Policy) else Policy(policy)


def _floating(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _cast(value: Any, dtype: Any) -> Any:
    if hasattr(value, "dtype") and _floating(value.dtype) and value.dtype != dtype:
        return jax.lax.convert_element_type(value, dtype)
    return value


def _weak(value: Any, var: Any) -> bool:
    """Whether an operand is weakly typed (a Python scalar in ``fn``), so it takes its partners' dtype."""
    aval = getattr(var, "aval", None)
    return bool(getattr(aval, "weak_type", False))


class _Interpreter:
    def __init__(self, compute: Any) -> None:
        self.compute = jnp.dtype(compute)

    def run(self, jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(var: Any) -> Any:
            return var.val if isinstance(var, jcore.Literal) else env[var]

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = value
        for var, value in zip(jaxpr.invars, args, strict=True):
            env[var] = value
        for eqn in jaxpr.eqns:
            values = [read(var) for var in eqn.invars]
            outputs = self.equation(eqn, values)
            if not eqn.primitive.multiple_results:
                outputs = [outputs]
            for var, value in zip(eqn.outvars, outputs, strict=True):
                env[var] = value  # a dropped output (DropVar) too: never read, and no version-specific class
        return [read(var) for var in jaxpr.outvars]

    def equation(self, eqn: Any, values: list[Any]) -> Any:
        primitive, params = eqn.primitive, dict(eqn.params)
        name = primitive.name
        if name in _CALL_PRIMITIVES:
            body = next((params[key] for key in _CALLS if key in params), None)
            if isinstance(body, jcore.ClosedJaxpr):
                return self.run(body.jaxpr, list(body.consts), values)
        if any(isinstance(value, jcore.ClosedJaxpr | jcore.Jaxpr) for value in params.values()):
            # control flow: run as written, on the dtypes it was traced with
            values = [
                _cast(value, var.aval.dtype) if hasattr(var, "aval") else value
                for value, var in zip(values, eqn.invars, strict=True)
            ]
            return primitive.bind(*values, **params)
        if name == "convert_element_type":
            value = values[0]
            new = jnp.dtype(params["new_dtype"])
            # Tracing in the compute dtype, JAX casts the float32 results of a float32-class operation back to
            # the compute dtype (a sum keeps its operand's dtype): such a cast is dropped, the value stays float32.
            # Every other cast (to float32, to integers, ...) is kept.
            if new == self.compute and hasattr(value, "dtype") and _floating(value.dtype) and value.dtype != new:
                if jnp.dtype(value.dtype).itemsize > new.itemsize:
                    return value
            return primitive.bind(*values, **params)
        floating = [i for i, value in enumerate(values) if hasattr(value, "dtype") and _floating(value.dtype)]
        if name in COMPUTE_PRIMITIVES:
            target = self.compute
        elif name in FLOAT32_PRIMITIVES:
            target = jnp.dtype(jnp.float32)
        else:
            strong = [values[i].dtype for i in floating if not _weak(values[i], eqn.invars[i])]
            candidates = strong or [values[i].dtype for i in floating]
            if not candidates:
                return primitive.bind(*values, **params)
            target = functools.reduce(jnp.promote_types, candidates)
        changed = False
        for i in floating:
            if values[i].dtype != target:
                values[i] = _cast(values[i], target)
                changed = True
        traced = [var.aval.dtype for var in eqn.invars if hasattr(var, "aval") and hasattr(var.aval, "dtype")]
        if changed or any(_floating(d) and d != target for d in traced):
            for key in _DTYPE_PARAMS:
                if params.get(key) is not None and _floating(params[key]):
                    params[key] = None
        return primitive.bind(*values, **params)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def autocast(
    fn: Callable[..., Any] | None = None, *, policy: Policy | str | None = None, cast_outputs: bool = True
) -> Any:
    """``fn`` running with polyamp's op classes under ``policy`` (None: the policy in effect when it is called;
    see the module's description for the classes). Use it as ``autocast(fn)`` or ``@autocast`` /
    ``@autocast(policy="mixed_bfloat16")``; it composes with ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

    Under a float32 policy ``fn`` runs as it is. Array arguments (any pytree of them) are traced; other
    arguments are taken as constants of the trace. With ``cast_outputs=False`` the outputs leave in the
    dtype their last operation gave them (a region inside a larger function).
    """
    if fn is None:
        return functools.partial(autocast, policy=policy, cast_outputs=cast_outputs)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        chosen = _policy(policy)
        if chosen.compute_dtype == "float32":
            return fn(*args, **kwargs)
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def flat_fn(*arrays: Any) -> Any:
            merged = list(leaves)
            for i, array in zip(dynamic, arrays, strict=True):
                merged[i] = array
            call_args, call_kwargs = jax.tree_util.tree_unflatten(tree, merged)
            return fn(*call_args, **call_kwargs)

        compute = jnp.dtype(chosen.compute_dtype)
        # fn is traced on its arguments in the compute dtype, so the constants it derives from their dtypes are
        # in the compute dtype too; arrays it captures keep theirs (JAX promotes where they meet)
        entered = [_cast(jnp.asarray(leaves[i]), compute) for i in dynamic]
        closed, shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*entered)
        outputs = _Interpreter(compute).run(closed.jaxpr, list(closed.consts), entered)
        if cast_outputs:
            output = jnp.dtype(chosen.output_dtype)
            outputs = [_cast(value, output) for value in outputs]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outputs)

    return wrapped
