"""`Policy`: the three dtypes of a mixed-precision run, parsed once from a name or a spec string."""

from __future__ import annotations

import difflib
from typing import Final, TypeAlias

from polyamp._src.errors import InvalidPolicyError, PolyampTypeError, describe

__all__ = ["DTYPE_NAMES", "POLICY_NAMES", "Policy", "PolicyLike", "canonical_dtype"]

#: The canonical dtype names a policy can hold.
DTYPE_NAMES: Final = ("float32", "float16", "bfloat16")

_DTYPE_ALIASES: Final = {
    "float32": "float32",
    "f32": "float32",
    "full": "float32",
    "float16": "float16",
    "f16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

# (param, compute, output) for each Keras policy name.
_NAMED: Final = {
    "float32": ("float32", "float32", "float32"),
    "mixed_float16": ("float32", "float16", "float32"),
    "mixed_bfloat16": ("float32", "bfloat16", "float32"),
    "float16": ("float16", "float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
}
_NAME_OF: Final = {dtypes: name for name, dtypes in _NAMED.items()}

#: The Keras policy names polyamp understands.
POLICY_NAMES: Final = tuple(_NAMED)

_SPEC_KEYS: Final = {
    "params": "param",
    "param": "param",
    "p": "param",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
}

#: The name that resolves to the recommended policy for this machine (see `Policy`).
AUTO: Final = "auto"

_GRAMMAR: Final = (
    "Valid names: 'float32', 'mixed_float16', 'mixed_bfloat16', 'float16', 'bfloat16', or 'auto' (the policy "
    "`python -m polyamp doctor` recommends for this machine). "
    "Or a spec of comma-separated key=dtype pairs with keys params|p, compute|c, output|o and dtypes "
    "float32|f32|full, float16|f16, bfloat16|bf16 (unspecified keys default to float32), "
    "e.g. 'params=float32,compute=bfloat16,output=float32'."
)


def canonical_dtype(dtype: object, *, what: str = "dtype") -> str:
    """Return the canonical name ("float32", "float16" or "bfloat16") of a dtype.

    Accepts the names and aliases of the spec grammar, and dtype objects of any framework that carry one
    of those names (``torch.bfloat16``, ``tf.float16``, ``numpy.dtype("float16")``, ``numpy.float16``).

    Raises:
        InvalidPolicyError: the dtype is not one of the three floating dtypes a policy can hold.
    """
    if isinstance(dtype, str):
        text = dtype
    elif isinstance(getattr(dtype, "name", None), str):  # numpy / tensorflow / jax dtypes
        text = dtype.name  # type: ignore[attr-defined]
    elif isinstance(getattr(dtype, "__name__", None), str):  # numpy scalar types such as np.float16
        text = dtype.__name__  # type: ignore[attr-defined]
    else:  # torch dtypes print as "torch.float16"
        text = str(dtype).removeprefix("torch.")
    canonical = _DTYPE_ALIASES.get(text.strip().lower())
    if canonical is None:
        raise InvalidPolicyError(
            f"`{what}` must be one of float32|f32|full, float16|f16, bfloat16|bf16 "
            f"(or a framework dtype of those). Received: {describe(dtype)}."
        )
    return canonical


#: Names people write for a policy that polyamp spells otherwise (torch / apex / Lightning habits).
_FAMILIAR: Final = {
    "fp16": "mixed_float16",
    "16": "mixed_float16",
    "16-mixed": "mixed_float16",
    "half": "mixed_float16",
    "amp": "mixed_float16",
    "o1": "mixed_float16",
    "mixed_fp16": "mixed_float16",
    "mixed16": "mixed_float16",
    "bf16": "mixed_bfloat16",
    "bf16-mixed": "mixed_bfloat16",
    "mixed_bf16": "mixed_bfloat16",
    "fp32": "float32",
    "f32": "float32",
    "32": "float32",
    "float": "float32",
    "single": "float32",
    "full": "float32",
    "f16": "mixed_float16",
    "fp16-true": "float16",
    "bf16-true": "bfloat16",
}


def _did_you_mean(text: str) -> str:
    familiar = _FAMILIAR.get(text)
    if familiar is not None:
        dtypes = _NAMED[familiar]
        return f" Did you mean {familiar!r} ({dtypes[0]} parameters, {dtypes[1]} compute, {dtypes[2]} outputs)?" + (
            " For float16 parameters too, 'float16'." if familiar == "mixed_float16" else ""
        )
    hint = difflib.get_close_matches(text, (*POLICY_NAMES, AUTO), n=1)
    return f" Did you mean {hint[0]!r}?" if hint else ""


def _parse_spec(spec: str) -> tuple[str, str, str]:
    text = spec.strip().lower()
    named = _NAMED.get(text)
    if named is not None:
        return named
    if text == AUTO:
        from polyamp._src.doctor import recommended_policy  # probes devices: only when "auto" is asked for

        return _NAMED[recommended_policy().policy]
    if "=" not in text:
        raise InvalidPolicyError(f"Unknown policy {spec!r}.{_did_you_mean(text)} {_GRAMMAR}")
    chosen: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = (piece.strip() for piece in part.partition("="))
        field = _SPEC_KEYS.get(key)
        if not sep or field is None:
            raise InvalidPolicyError(
                f"Cannot parse {part.strip()!r} in policy spec {spec!r}: expected key=dtype with a key "
                f"among params|p, compute|c, output|o. {_GRAMMAR}"
            )
        if field in chosen:
            raise InvalidPolicyError(
                f"Policy spec {spec!r} sets the {field} dtype twice; give each key at most once. {_GRAMMAR}"
            )
        dtype = _DTYPE_ALIASES.get(value)
        if dtype is None:
            raise InvalidPolicyError(f"Unknown dtype {value!r} for {key!r} in policy spec {spec!r}. {_GRAMMAR}")
        chosen[field] = dtype
    return (
        chosen.get("param", "float32"),
        chosen.get("compute", "float32"),
        chosen.get("output", "float32"),
    )


class Policy:
    """Which dtypes a mixed-precision run uses: for parameters, for computation, for outputs.

    A `Policy` is an immutable value. Two policies are equal (and hash equal) when their three dtypes
    are equal, however they were written.

    Args:
        spec: A Keras policy name or a spec string, or another `Policy` (copied). The names:

            ================  =========  =========  ========
            name              param      compute    output
            ================  =========  =========  ========
            "float32"         float32    float32    float32
            "mixed_float16"   float32    float16    float32
            "mixed_bfloat16"  float32    bfloat16   float32
            "float16"         float16    float16    float16
            "bfloat16"        bfloat16   bfloat16   bfloat16
            ================  =========  =========  ========

            A spec is comma-separated ``key=dtype`` pairs, keys ``params|p``, ``compute|c``, ``output|o``,
            dtypes ``float32|f32|full``, ``float16|f16``, ``bfloat16|bf16``; unspecified keys are float32.

            ``"auto"`` is the policy ``python -m polyamp doctor`` recommends for this machine
            (``polyamp._src.doctor.recommend``): ``"mixed_bfloat16"`` on CUDA GPUs of compute capability >= 8.0
            and on TPUs, ``"mixed_float16"`` on 7.x, ``"float32"`` below 7.0; without an accelerator
            ``"mixed_bfloat16"`` when the CPU has AVX512-BF16 or AMX, else ``"float32"``. It is resolved once,
            when the `Policy` is created (asking the frameworks already imported, or the first installed of
            torch, TensorFlow, JAX, about their devices), and the Policy's ``name`` is the concrete one, never
            ``"auto"``. It is not in `POLICY_NAMES`, which lists the concrete names.
        param, compute, output: Keyword form instead of ``spec``; each a dtype name, alias or framework
            dtype object (``torch.bfloat16``, ``tf.float16``); unspecified ones are float32.

    Raises:
        InvalidPolicyError: (a ``ValueError``) the name, spec or a dtype is not understood.
        PolyampTypeError: (a ``TypeError``) ``spec`` is neither a string nor a `Policy`, or both a spec
            and keywords were given.

    Example:
        >>> import polyamp
        >>> policy = polyamp.Policy("mixed_bfloat16")
        >>> policy.param_dtype, policy.compute_dtype, policy.output_dtype
        ('float32', 'bfloat16', 'float32')
        >>> polyamp.Policy("p=f32,c=bf16,o=f32") == policy
        True
        >>> polyamp.Policy(compute="float16").name
        'mixed_float16'
        >>> polyamp.Policy(compute="bf16", output="bf16").name
        'params=float32,compute=bfloat16,output=bfloat16'
        >>> polyamp.Policy("mixed_float16").needs_loss_scaling
        True
    """

    __slots__ = ("_dtypes",)
    _dtypes: tuple[str, str, str]

    def __init__(
        self,
        spec: PolicyLike | None = None,
        *,
        param: object = None,
        compute: object = None,
        output: object = None,
    ) -> None:
        keywords = (param, compute, output)
        if spec is not None and any(k is not None for k in keywords):
            raise PolyampTypeError(
                "Policy() takes either a spec or the param/compute/output keywords, not both. "
                f"Received: spec={spec!r} with keywords. Use Policy({spec!r}).replace(...) to start from a "
                "spec and change one dtype."
            )
        if isinstance(spec, Policy):
            dtypes = spec._dtypes
        elif isinstance(spec, str):
            dtypes = _parse_spec(spec)
        elif spec is None:
            dtypes = tuple(  # type: ignore[assignment]
                "float32" if value is None else canonical_dtype(value, what=name)
                for name, value in zip(("param", "compute", "output"), keywords, strict=True)
            )
        elif _is_framework_policy(spec):
            dtypes = _from_framework_policy(spec)
        else:
            raise _not_a_policy(spec)
        object.__setattr__(self, "_dtypes", dtypes)

    @property
    def param_dtype(self) -> str:
        """The dtype parameters (variables) are stored in."""
        return self._dtypes[0]

    @property
    def compute_dtype(self) -> str:
        """The dtype matmuls, convolutions and other autocast-eligible ops run in."""
        return self._dtypes[1]

    @property
    def output_dtype(self) -> str:
        """The dtype a model's outputs are cast to."""
        return self._dtypes[2]

    @property
    def name(self) -> str:
        """The Keras name when one matches, else the canonical spec string."""
        named = _NAME_OF.get(self._dtypes)
        if named is not None:
            return named
        param, compute, output = self._dtypes
        return f"params={param},compute={compute},output={output}"

    @property
    def needs_loss_scaling(self) -> bool:
        """True when the compute dtype is float16, whose narrow range makes gradients underflow."""
        return self._dtypes[1] == "float16"

    @property
    def is_mixed(self) -> bool:
        """True when computation runs in a different dtype than the parameters are stored in."""
        return self._dtypes[0] != self._dtypes[1]

    def replace(self, *, param: object = None, compute: object = None, output: object = None) -> Policy:
        """Return a new policy with the given dtypes changed and the others kept.

        >>> Policy("mixed_float16").replace(output="float16").name
        'params=float32,compute=float16,output=float16'
        """
        current = self._dtypes
        return Policy(
            param=current[0] if param is None else param,
            compute=current[1] if compute is None else compute,
            output=current[2] if output is None else output,
        )

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Policy is immutable; cannot set {name!r}. Use Policy.replace(...) instead.")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Policy is immutable; cannot delete {name!r}.")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Policy):
            return self._dtypes == other._dtypes
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("polyamp.Policy", self._dtypes))

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple[type[Policy], tuple[str]]:
        return (Policy, (self.name,))


def _is_framework_policy(value: object) -> bool:
    # A Keras DTypePolicy (or anything shaped like one): a variable dtype and a compute dtype, by name.
    return isinstance(getattr(value, "variable_dtype", None), str) and isinstance(
        getattr(value, "compute_dtype", None), str
    )


def _from_framework_policy(value: object) -> tuple[str, str, str]:
    name = getattr(value, "name", None)
    if isinstance(name, str) and name in _NAMED:
        return _NAMED[name]
    param = canonical_dtype(value.variable_dtype, what="variable_dtype")  # type: ignore[attr-defined]
    compute = canonical_dtype(value.compute_dtype, what="compute_dtype")  # type: ignore[attr-defined]
    # A framework policy has no output dtype; polyamp's named policies output in the parameter dtype.
    return (param, compute, param)


def _not_a_policy(spec: object) -> PolyampTypeError:
    try:
        dtype = canonical_dtype(spec)
    except InvalidPolicyError:
        dtype = None
    if dtype is not None and not isinstance(spec, str):
        mixed = "float32" if dtype == "float32" else f"mixed_{dtype}"
        return PolyampTypeError(
            f"A dtype is not a policy: {describe(spec)} could mean computing in {dtype} with float32 parameters "
            f"({mixed!r}, what torch.autocast(dtype=...) does) or keeping everything in {dtype} ({dtype!r}). "
            f"Pass the policy name, or Policy(compute={dtype!r}) for the first."
        )
    return PolyampTypeError(
        "`spec` must be a policy name such as 'mixed_float16', a spec string such as "
        "'params=float32,compute=bfloat16,output=float32', a polyamp.Policy or a Keras DTypePolicy. Received: "
        f"{describe(spec)}."
    )


#: What every polyamp function that takes a policy accepts: a `Policy`, a policy name or a spec string
#: (or a Keras ``DTypePolicy``, which names its variable and compute dtypes).
PolicyLike: TypeAlias = Policy | str
