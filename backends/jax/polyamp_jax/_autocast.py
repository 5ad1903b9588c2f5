"""`autocast`: polyamp's op classes for JAX functions, by interpreting their jaxpr.

Within ``autocast(fn)`` under a policy that computes in float16 or bfloat16, ``fn``'s floating arguments enter
in the compute dtype (as jmp's ``cast_to_compute`` would give them; arrays ``fn`` captures keep their dtype),
and each primitive then runs by class, the classes torch's autocast and polyamp's Keras models use:

* matrix products and convolutions (``dot_general``, ``conv_general_dilated``) in the compute dtype;
* in float32, the ops polyamp's op-class table (`polyamp.backend_api.policies.OP_CLASSES`, CUDA autocast's
  lists) runs in float32, through the primitives standing for them (`PRIMITIVE_OPS`): exponentials and logarithms (``exp``, ``log``,
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
``scan``) runs as ``fn`` wrote it, on operands cast back to the dtypes it was traced with. Calls of jitted
functions are interpreted too, and so are ``jax.checkpoint`` (``jax.remat``) bodies, which stay checkpoints
with their policy. A function with a custom JVP (``jax.custom_jvp``, e.g. ``jax.nn.relu``) runs by class and
keeps its rule, which runs by class too (a rule closing over values traced inside ``fn`` cannot be traced
again: that function is differentiated through its body, with a warning); a function with a custom VJP
(``jax.custom_vjp``) runs as written, on the dtypes it was traced with, with its rule.

Models are arguments like any other: ``fn`` may itself be a pytree holding arrays (an Equinox module, or a bound
method of one), whose arrays then enter as arguments do. A Flax Linen module's bound ``apply``
(``autocast(model.apply)``) takes its variables as Linen stores them: the ``"params"`` collection enters in the
compute dtype, the other collections (``batch_stats``, caches) keep their dtype, and the collections
``mutable=`` returns leave in the dtype they entered with (new ones, such as ``capture_intermediates``'s, in the
dtype they were computed in), so running statistics are never rounded to the compute dtype.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from polyamp import OpClass, Policy, get_policy, op_class
from polyamp_jax._float8 import check_dynamic
from polyamp_jax._float8_autocast import Float8Products, check_counts, ran_layers

__all__ = ["COMPUTE_PRIMITIVES", "FLOAT32_PRIMITIVES", "PRIMITIVE_OPS", "autocast"]

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
"""Each JAX primitive that stands for an op of polyamp's op-class table (`polyamp.backend_api.policies.OP_CLASSES`), by
the table's name. The table decides the class; a primitive not named here computes in the widest dtype of its
operands. JAX's ``x ** n`` with a Python integer ``n`` is ``integer_pow``, a chain of multiplications, and is not
``pow``."""
COMPUTE_PRIMITIVES = frozenset(p for p, op in PRIMITIVE_OPS.items() if op_class(op, strict=True) is OpClass.COMPUTE)
"""Primitives that run in the policy's compute dtype."""
FLOAT32_PRIMITIVES = frozenset(p for p, op in PRIMITIVE_OPS.items() if op_class(op, strict=True) is OpClass.FLOAT32)
"""Primitives that run in float32 whatever the compute dtype."""
#: Call-like primitives whose body is interpreted by class; the closed jaxpr is under one of these params.
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALL_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "core_call"})
#: ``jax.checkpoint`` (``jax.remat``): its body is interpreted by class inside a new checkpoint.
_REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint", "remat"})
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
    def __init__(self, compute: Any, float8: Float8Products | None = None) -> None:
        self.compute = jnp.dtype(compute)
        self.float8 = float8

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
            if self.float8 is not None:
                self.float8.follow(eqn)
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
                if self.float8 is not None:
                    with self.float8.call(eqn, body.jaxpr):
                        return self.run(body.jaxpr, list(body.consts), values)
                return self.run(body.jaxpr, list(body.consts), values)
        if name == "dot_general" and self.float8 is not None:
            product = self.float8.product(eqn, values, self.compute)
            if product is not None:
                return product
        if name in _REMAT_PRIMITIVES and isinstance(params.get("jaxpr"), jcore.Jaxpr) and not params["jaxpr"].constvars:
            if self.float8 is not None:  # its scopes (nn.remat's module) and weights reach the body's products
                with self.float8.call(eqn, params["jaxpr"]):
                    return self.remat(params, values)
            return self.remat(params, values)
        if name == "custom_jvp_call" and isinstance(params.get("call_jaxpr"), jcore.ClosedJaxpr):
            if hasattr(params.get("jvp_jaxpr_fun"), "call_wrapped"):
                return self.custom_jvp(params, values)
        if any(isinstance(value, jcore.ClosedJaxpr | jcore.Jaxpr) for value in params.values()):
            # control flow, and functions with a custom VJP: run as written, on the dtypes they were traced with
            values = [
                _cast(value, var.aval.dtype) if hasattr(var, "aval") else value
                for value, var in zip(values, eqn.invars, strict=True)
            ]
            return primitive.bind(*values, **primitive.get_bind_params(params))
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

    def remat(self, params: dict[str, Any], values: list[Any]) -> list[Any]:
        """A ``jax.checkpoint`` body, interpreted by class inside a checkpoint with the same policy, so its
        residuals are still recomputed in the backward pass."""
        jaxpr = params["jaxpr"]

        def body(*operands: Any) -> list[Any]:
            return self.run(jaxpr, [], list(operands))

        checkpointed = jax.checkpoint(body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))
        return list(checkpointed(*values))

    def custom_jvp(self, params: dict[str, Any], values: list[Any]) -> list[Any]:
        """A function with a custom JVP (``jax.custom_jvp``, e.g. ``jax.nn.relu``): its body runs by class, and
        it is differentiated by its own rule, whose jaxpr runs by class too; each tangent leaves in the dtype of
        the value it belongs to. The leading ``num_consts`` operands (values the function closed over) have no
        tangent in the rule, as in JAX.

        A rule that uses values traced inside ``fn`` (a ``custom_jvp`` defined in ``fn``, closing over them)
        cannot be traced again once ``fn``'s trace has ended: such a function is differentiated through its
        body, as written, with a warning."""
        body, rule, skip = params["call_jaxpr"], params["jvp_jaxpr_fun"], params["num_consts"]

        def run_body(*operands: Any) -> list[Any]:
            return self.run(body.jaxpr, list(body.consts), list(operands))

        name = getattr(body.jaxpr.debug_info, "func_name", None) or "a custom_jvp function"
        run_body.__name__ = name.split(" ")[0]  # the name jaxprs show: the function's own
        call = jax.custom_jvp(run_body)

        def call_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
            outputs = call(*primals)
            try:
                jaxpr, consts, out_zeros = rule.call_wrapped(*([False] * (len(primals) - skip)))
                results = self.run(jaxpr, list(consts), [*primals[skip:], *tangents[skip:]])
            except jax.errors.UnexpectedTracerError:
                warnings.warn(
                    f"polyamp_jax.autocast: the custom JVP rule of {run_body.__name__!r} uses values traced inside the function "
                    "autocast wraps (a jax.custom_jvp defined there, closing over them), and cannot be traced again "
                    "after that trace ended; it is differentiated through its body, as written. Define the "
                    "custom_jvp function outside, taking those values as arguments, to keep its rule.",
                    UserWarning,
                    stacklevel=2,
                )
                return jax.jvp(run_body, primals, tangents)
            nonzero = iter(results[len(out_zeros) :])
            return outputs, [
                _zero_tangent(output) if zero else _cast(next(nonzero), output.dtype)
                for output, zero in zip(outputs, out_zeros, strict=True)
            ]

        call.defjvp(call_jvp)
        return list(call(*values))


def _zero_tangent(value: Any) -> Any:
    """The zero tangent of ``value``: zeros of its dtype, or float0 for an integer or boolean value."""
    if _floating(value.dtype):
        return jnp.zeros_like(value)
    return np.zeros(np.shape(value), dtype=jax.dtypes.float0)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _holds_arrays(tree: Any) -> bool:
    """Whether ``tree`` is a pytree (not a leaf) with an array among its leaves: an Equinox module."""
    leaves = jax.tree_util.tree_leaves(tree)
    return not (len(leaves) == 1 and leaves[0] is tree) and any(_is_array(leaf) for leaf in leaves)


def _as_arguments(fn: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``fn`` as a function of its own arrays and the arguments: ``(call, leading)``, where ``call(*leading,
    *args, **kwargs)`` is ``fn(*args, **kwargs)`` and ``leading`` holds the pytree whose arrays are ``fn``'s
    (``fn`` itself, or the object ``fn`` is a bound method of), if any."""
    if _holds_arrays(fn):
        return (lambda module, *args, **kwargs: module(*args, **kwargs)), (fn,)
    owner, function = getattr(fn, "__self__", None), getattr(fn, "__func__", None)
    if owner is not None and function is not None and _holds_arrays(owner):
        return function, (owner,)
    return fn, ()


def _is_linen_apply(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a Flax Linen module's bound ``apply`` (flax is never imported here: a Linen module
    exists only once ``flax.linen`` is)."""
    linen = sys.modules.get("flax.linen")
    owner = getattr(fn, "__self__", None)
    return linen is not None and isinstance(owner, linen.Module) and getattr(fn, "__name__", None) == "apply"


def _key(entry: Any) -> Any:
    for name in ("key", "idx", "name"):
        if hasattr(entry, name):
            return getattr(entry, name)
    return entry


def _linen_collections(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[tuple[Any, ...], Any]:
    """The dtype of each floating leaf of a Linen ``apply``'s variables, by (collection, ...path)."""
    variables = args[0] if args else kwargs.get("variables")
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        if hasattr(leaf, "dtype") and _floating(leaf.dtype):
            found[tuple(_key(entry) for entry in path)] = jnp.dtype(leaf.dtype)
    return found


def _linen_entry(path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The (collection, ...path) of an argument leaf of a Linen ``apply``, when it is one of the variables
    (the first positional argument, or ``variables=``); else None."""
    keys = tuple(_key(entry) for entry in path)
    if len(keys) > 2 and keys[:2] == (0, 0):
        return keys[2:]
    if len(keys) > 2 and keys[:2] == (1, "variables"):
        return keys[2:]
    return None


def _field_path(path: tuple[Any, ...]) -> str:
    """A module field's path within ``fn``'s arguments (``((*leading, *args), kwargs)``), without the argument's
    position and the field's own name: ``"layers.0"`` for an Equinox ``model.layers[0].weight`` and for Flax
    NNX state's ``["layers"][0]["kernel"].value`` (a ``Variable``'s ``value`` is not a name)."""
    keys = [str(_key(entry)) for entry in path[2:]]
    if len(keys) > 1 and keys[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        keys.pop()
    return ".".join(keys[:-1])


def _linen_returns_state(kwargs: dict[str, Any]) -> bool:
    """Whether a Linen ``apply`` returns ``(output, collections)``: as Linen decides it, when ``mutable`` is not
    False or intermediates are captured."""
    return kwargs.get("mutable", False) is not False or bool(kwargs.get("capture_intermediates", False))


def autocast(
    fn: Callable[..., Any] | None = None, *, policy: Policy | str | None = None, cast_outputs: bool = True
) -> Any:
    """``fn`` running with polyamp's op classes under ``policy`` (None: the policy in effect when it is called;
    see the module's description for the classes). Use it as ``autocast(fn)`` or ``@autocast`` /
    ``@autocast(policy="mixed_bfloat16")``; it composes with ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

    Under a float32 policy ``fn`` runs as it is. Array arguments (any pytree of them) are traced; other
    arguments are taken as constants of the trace. With ``cast_outputs=False`` the outputs leave in the
    dtype their last operation gave them (a region inside a larger function).

    ``fn`` may be a model: an Equinox module (or its bound method), whose arrays enter in the compute dtype as
    arguments do (``autocast(model)(x)``); a Flax Linen module's ``apply`` (``autocast(model.apply)(variables,
    x, mutable=["batch_stats"])``), whose ``"params"`` enter in the compute dtype while the other collections
    keep their dtype, in and out.

    Under a policy with an FP8 recipe its linear layers' products run in FP8 (`polyamp_jax._float8_autocast`),
    and the returned function takes the keyword ``float8_counts=`` (never passed to ``fn``): a dict of cast
    counts per FP8 layer, from `polyamp_jax.float8_counts` ``(forward, *args)``, that the layers' casts count
    into; their gradient is their next value, read by `polyamp_jax.float8_records`.
    """
    if fn is None:
        return functools.partial(autocast, policy=policy, cast_outputs=cast_outputs)
    call, leading = _as_arguments(fn)
    linen = _is_linen_apply(fn)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        chosen = _policy(policy)
        counts = kwargs.pop("float8_counts", None)
        if counts is not None:
            check_counts(counts, chosen)
        if chosen.compute_dtype == "float32" and chosen.float8 is None:
            return fn(*args, **kwargs)
        pairs, tree = jax.tree_util.tree_flatten_with_path(((*leading, *args), kwargs))
        leaves = [leaf for _, leaf in pairs]
        dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def flat_fn(*arrays: Any) -> Any:
            merged = list(leaves)
            for i, array in zip(dynamic, arrays, strict=True):
                merged[i] = array
            call_args, call_kwargs = jax.tree_util.tree_unflatten(tree, merged)
            return call(*call_args, **call_kwargs)

        compute = jnp.dtype(chosen.compute_dtype)

        # fn is traced on its arguments in the compute dtype, so the constants it derives from their dtypes are
        # in the compute dtype too; arrays it captures keep theirs (JAX promotes where they meet)
        def enter(i: int) -> Any:
            entry = _linen_entry(pairs[i][0]) if linen else None
            if entry is not None and entry[0] != "params":  # batch_stats, caches: as stored
                return jnp.asarray(leaves[i])
            return _cast(jnp.asarray(leaves[i]), compute)

        entered = [enter(i) for i in dynamic]
        closed, shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*entered)
        float8 = None
        if chosen.float8 is not None:
            check_dynamic(chosen.float8, "polyamp_jax.autocast")

            def is_weight(i: int) -> bool:
                if linen:
                    return bool((_linen_entry(pairs[i][0]) or ("",))[0] == "params")
                # a field of a module-like pytree (an Equinox module's array), or of the module autocast wraps
                path = pairs[i][0]
                if any(isinstance(entry, jax.tree_util.GetAttrKey) for entry in path):
                    return True
                return len(path) > 1 and _key(path[0]) == 0 and _key(path[1]) < len(leading)

            weights = {
                var: jnp.asarray(leaves[i]) for var, i in zip(closed.jaxpr.invars, dynamic, strict=True) if is_weight(i)
            }
            fields = {
                var: _field_path(pairs[i][0])
                for var, i in zip(closed.jaxpr.invars, dynamic, strict=True)
                if var in weights and not linen
            }
            float8 = Float8Products(chosen.float8, weights, drop_root=linen, paths=fields, counts=counts)
        outputs = _Interpreter(compute, float8).run(closed.jaxpr, list(closed.consts), entered)
        if float8 is not None:
            ran_layers(float8.layers, counts)
        structure = jax.tree_util.tree_structure(shapes)
        if cast_outputs:
            output = jnp.dtype(chosen.output_dtype)
            if linen and _linen_returns_state(kwargs):
                # (output, collections): the output in the output dtype, each collection leaf in the dtype it
                # entered with, and a new one (intermediates) as it was computed
                stored = _linen_collections(args, kwargs)
                paths = [
                    tuple(_key(entry) for entry in path) for path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]
                ]
                outputs = [
                    _cast(value, output)
                    if path[:1] == (0,)
                    else _cast(value, stored[path[1:]])
                    if path[1:] in stored
                    else value
                    for value, path in zip(outputs, paths, strict=True)
                ]
            else:
                outputs = [_cast(value, output) for value in outputs]
        return jax.tree_util.tree_unflatten(structure, outputs)

    if leading and leading[0] is fn:  # a module: its fields are not the wrapper's attributes
        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped
    return functools.wraps(fn)(wrapped)
