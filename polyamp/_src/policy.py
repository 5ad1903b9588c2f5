"""`Policy`: the three dtypes of a mixed-precision run, parsed once from a name or a spec string."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Final, TypeAlias

from polyamp._src.errors import InvalidPolicyError, PolyampTypeError, describe

if TYPE_CHECKING:
    from polyamp._src.float8 import Float8Recipe

__all__ = [
    "DTYPE_NAMES",
    "POLICY_NAMES",
    "PRESET_NAMES",
    "ROUNDINGS",
    "Policy",
    "PolicyLike",
    "canonical_dtype",
]

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

#: How an update is written into weights less precise than float32 (see `Policy`).
ROUNDINGS: Final = ("nearest", "stochastic", "kahan")

# The training-state presets: (param, compute, output) and (master, state, rounding).
_PRESETS: Final = {
    "bfloat16_float32_master": (("bfloat16", "bfloat16", "float32"), ("float32", "float32", "nearest")),
    "bfloat16_kahan": (("bfloat16", "bfloat16", "float32"), ("bfloat16", "bfloat16", "kahan")),
    "bfloat16_stochastic": (("bfloat16", "bfloat16", "float32"), ("bfloat16", "bfloat16", "stochastic")),
}
_PRESET_OF: Final = {value: name for name, value in _PRESETS.items()}

#: The named training-state plans (besides `POLICY_NAMES`, whose master copy is their parameter dtype).
PRESET_NAMES: Final = tuple(_PRESETS)

_PRECISION: Final = {"float32": 2, "bfloat16": 1, "float16": 1}

_SPEC_KEYS: Final = {
    "params": "param",
    "param": "param",
    "p": "param",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
    "master": "master",
    "m": "master",
    "state": "state",
    "s": "state",
    "rounding": "rounding",
    "r": "rounding",
}

#: The name that resolves to the recommended policy for this machine (see `Policy`).
AUTO: Final = "auto"

_GRAMMAR: Final = (
    "Valid names: 'float32', 'mixed_float16', 'mixed_bfloat16', 'float16', 'bfloat16', or 'auto' (the policy "
    "`python -m polyamp doctor` recommends for this machine). "
    "Or a training-state preset: 'bfloat16_float32_master', 'bfloat16_kahan', 'bfloat16_stochastic'. "
    "Or a spec of comma-separated key=value pairs with keys params|p, compute|c, output|o, master|m, state|s "
    "(dtypes float32|f32|full, float16|f16, bfloat16|bf16) and rounding|r (nearest, stochastic, kahan); "
    "params, compute and output default to float32, master to params, state to master, rounding to nearest; "
    "e.g. 'params=float32,compute=bfloat16,output=float32' or 'params=bf16,compute=bf16,rounding=kahan'. "
    "Any of these may be followed by '+' and an FP8 recipe ('mixed_bfloat16+float8_rowwise'); an FP8 preset "
    "alone ('float8_tensorwise', 'float8_rowwise', 'float8_rowwise_gw_hp', 'float8_delayed', 'mxfp8') runs "
    "on 'mixed_bfloat16'."
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
    from polyamp._src.float8 import FLOAT8_PRESETS

    hint = difflib.get_close_matches(text, (*POLICY_NAMES, *PRESET_NAMES, *FLOAT8_PRESETS, AUTO), n=1)
    return f" Did you mean {hint[0]!r}?" if hint else ""


def _parse_spec(spec: str) -> tuple[tuple[str, str, str], tuple[str | None, str | None, str | None]]:
    text = spec.strip().lower()
    named = _NAMED.get(text)
    if named is not None:
        return named, (None, None, None)
    preset = _PRESETS.get(text)
    if preset is not None:
        return preset
    if text == AUTO:
        from polyamp._src.doctor import recommended_policy  # probes devices: only when "auto" is asked for

        return _NAMED[recommended_policy().policy], (None, None, None)
    if "=" not in text:
        raise InvalidPolicyError(f"Unknown policy {spec!r}.{_did_you_mean(text)} {_GRAMMAR}")
    chosen: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = (piece.strip() for piece in part.partition("="))
        field = _SPEC_KEYS.get(key)
        if not sep or field is None:
            raise InvalidPolicyError(
                f"Cannot parse {part.strip()!r} in policy spec {spec!r}: expected key=value with a key "
                f"among params|p, compute|c, output|o, master|m, state|s, rounding|r. {_GRAMMAR}"
            )
        if field in chosen:
            raise InvalidPolicyError(
                f"Policy spec {spec!r} sets the {field} {'mode' if field == 'rounding' else 'dtype'} twice; give "
                f"each key at most once. {_GRAMMAR}"
            )
        if field == "rounding":
            if value not in ROUNDINGS:
                raise InvalidPolicyError(
                    f"Unknown rounding {value!r} in policy spec {spec!r}: expected one of {', '.join(ROUNDINGS)}. "
                    f"{_GRAMMAR}"
                )
            chosen[field] = value
            continue
        dtype = _DTYPE_ALIASES.get(value)
        if dtype is None:
            raise InvalidPolicyError(f"Unknown dtype {value!r} for {key!r} in policy spec {spec!r}. {_GRAMMAR}")
        chosen[field] = dtype
    return (
        (chosen.get("param", "float32"), chosen.get("compute", "float32"), chosen.get("output", "float32")),
        (chosen.get("master"), chosen.get("state"), chosen.get("rounding")),
    )


def _resolve_plan(
    param: str, master: str | None, state: str | None, rounding: str | None, *, given: object
) -> tuple[str, str, str]:
    """Fill the plan's defaults (master: the parameter dtype, state: the master dtype, rounding: nearest) and
    refuse the combinations that cannot be meant."""
    explicit_state = state
    master = param if master is None else master
    state = master if state is None else state
    rounding = "nearest" if rounding is None else rounding
    where = f"Received: {given}."
    if master != param and _PRECISION[master] <= _PRECISION[param]:
        raise InvalidPolicyError(
            f"The master copy must be at least as precise as the parameters: master={master} with params={param} "
            f"would round every update twice. Use master=float32 (a float32 copy the optimizer updates) or leave "
            f"master out (the parameters themselves are updated). {where}"
        )
    if explicit_state == "float16":  # (the "float16" policy's state follows its parameters, as in every framework)
        raise InvalidPolicyError(
            "Optimizer state cannot be float16: a second moment holds squared gradients, which leave float16's "
            f"range (above 65504, below 6e-8). Use state=bfloat16 (same 2 bytes, float32's range) or state=float32. "
            f"{where}"
        )
    if rounding != "nearest" and master == "float32":
        raise InvalidPolicyError(
            f"rounding={rounding} applies to weights updated in {param if param != 'float32' else 'bfloat16'}; "
            f"here the optimizer updates a float32 {'master copy' if param != 'float32' else 'parameter'}, which "
            "holds every update as it is. Leave rounding out, or drop master=float32 and keep the weights in "
            f"bfloat16 (e.g. 'bfloat16_{rounding}'). {where}"
        )
    if rounding == "stochastic" and master != "bfloat16":
        raise InvalidPolicyError(
            f"rounding=stochastic is defined for bfloat16 weights (the low 16 bits of the float32 update are "
            f"rounded at random); these are {master}. Use rounding=kahan for float16 weights. {where}"
        )
    return master, state, rounding


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
        master, state, rounding: The training state (keywords, or the spec keys ``master|m``, ``state|s``,
            ``rounding|r``), followed by `polyamp_torch.PrecisionOptimizer`, `polyamp_keras.PrecisionOptimizer`
            and `polyamp_jax.precision`:

            - ``master``: the dtype of the copy the optimizer updates. Default: the parameter dtype (the
              parameters are updated themselves). ``float32`` with bfloat16/float16 parameters keeps a float32
              master copy, written back to the parameters (rounded to nearest) after every step.
            - ``state``: the dtype of the optimizer's moments and other floating slots. Default: the master dtype.
              float32 or bfloat16 when given (float16 cannot hold a second moment's range).
            - ``rounding``: how an update formed in float32 is written into bfloat16/float16 weights:
              ``"nearest"`` (default; small updates round away), ``"stochastic"`` (bfloat16 only: rounded up or
              down at random with the probabilities that make it exact on average) or ``"kahan"`` (a
              compensation buffer in the parameter dtype carries what rounding lost into the next step).
              Only for weights updated in bfloat16/float16 (not with a float32 master).

            The presets: ``"bfloat16_float32_master"`` (bfloat16 weights and compute, a float32 master and
            float32 state), ``"bfloat16_kahan"`` and ``"bfloat16_stochastic"`` (bfloat16 weights, compute and
            state, updated with that rounding); all three output float32. The mixed policies keep float32
            parameters, which are their own master copy.
        float8: An FP8 recipe for the linear layers (`polyamp.Float8Recipe`, or its text), or in the spec
            string ``"<policy>+<recipe>"``: ``"mixed_bfloat16+float8_rowwise"``. A preset alone
            (``"float8_tensorwise"``, ``"float8_rowwise"``, ``"float8_rowwise_gw_hp"``, ``"float8_delayed"``,
            ``"mxfp8"``) runs on ``"mixed_bfloat16"``; ``"float8_delayed[amax_history_length=16]"`` changes a
            preset's field. See the FP8 guide.

    Raises:
        InvalidPolicyError: (a ``ValueError``) the name, spec or a dtype is not understood, or the training
            state cannot be meant (a master less precise than the parameters, float16 state, stochastic or
            Kahan rounding of a float32 master, stochastic rounding of float16 weights), or the FP8 recipe
            is not understood.
        PolyampTypeError: (a ``TypeError``) ``spec`` is neither a string nor a `Policy`, or both a spec
            and keywords were given.

    Examples:
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
        >>> kahan = polyamp.Policy("params=bfloat16,compute=bfloat16,output=float32,state=bfloat16,rounding=kahan")
        >>> kahan.name, kahan.master_dtype, kahan.state_dtype, kahan.rounding
        ('bfloat16_kahan', 'bfloat16', 'bfloat16', 'kahan')
        >>> polyamp.Policy("bfloat16", state="float32").name
        'params=bfloat16,compute=bfloat16,output=bfloat16,state=float32'
        >>> fp8 = polyamp.Policy("float8_rowwise")
        >>> fp8.compute_dtype, fp8.float8.granularity, polyamp.Policy("mixed_float16+float8_delayed").name
        ('bfloat16', 'row', 'mixed_float16+float8_delayed')
    """

    __slots__ = ("_dtypes", "_float8", "_plan")
    _dtypes: tuple[str, str, str]
    _plan: tuple[str, str, str]
    _float8: Float8Recipe | None

    def __init__(
        self,
        spec: PolicyLike | None = None,
        *,
        param: object = None,
        compute: object = None,
        output: object = None,
        master: object = None,
        state: object = None,
        rounding: str | None = None,
        float8: Float8Recipe | str | None = None,
    ) -> None:
        keywords = (param, compute, output)
        if spec is not None and any(k is not None for k in keywords):
            raise PolyampTypeError(
                "Policy() takes either a spec or the param/compute/output keywords, not both. "
                f"Received: spec={spec!r} with keywords. Use Policy({spec!r}).replace(...) to start from a "
                "spec and change one dtype."
            )
        plan: tuple[str | None, str | None, str | None] = (None, None, None)
        recipe: Float8Recipe | None = None
        if isinstance(spec, Policy):
            dtypes = spec._dtypes
            plan = spec._given_plan()
            recipe = spec._float8
        elif isinstance(spec, str):
            from polyamp._src.float8 import split_policy_spec

            base, recipe = split_policy_spec(spec)
            dtypes, plan = _parse_spec(base)
        elif spec is None:
            dtypes = tuple(  # type: ignore[assignment]
                "float32" if value is None else canonical_dtype(value, what=name)
                for name, value in zip(("param", "compute", "output"), keywords, strict=True)
            )
        elif _is_framework_policy(spec):
            dtypes = _from_framework_policy(spec)
        else:
            raise _not_a_policy(spec)
        if rounding is not None and (not isinstance(rounding, str) or rounding.strip().lower() not in ROUNDINGS):
            raise InvalidPolicyError(
                f"`rounding` must be one of {', '.join(map(repr, ROUNDINGS))}. Received: {describe(rounding)}."
            )
        given = (
            plan[0] if master is None else canonical_dtype(master, what="master"),
            plan[1] if state is None else canonical_dtype(state, what="state"),
            plan[2] if rounding is None else rounding.strip().lower(),
        )
        described = spec if isinstance(spec, str) else None
        resolved = _resolve_plan(
            dtypes[0],
            *given,
            given=repr(described)
            if described is not None and (master, state, rounding) == (None, None, None)
            else ", ".join(
                f"{key}={value}"
                for key, value in zip(("params", "master", "state", "rounding"), (dtypes[0], *given), strict=True)
                if value is not None
            ),
        )
        object.__setattr__(self, "_dtypes", dtypes)
        object.__setattr__(self, "_plan", resolved)
        if float8 is not None:
            from polyamp._src.float8 import as_recipe

            recipe = as_recipe(float8)
        object.__setattr__(self, "_float8", recipe)

    def _given_plan(self) -> tuple[str | None, str | None, str | None]:
        # The plan with its defaults left out, so that replace(param=...) moves a default master along.
        master, state, rounding = self._plan
        return (
            None if master == self._dtypes[0] else master,
            None if state == master else state,
            None if rounding == "nearest" else rounding,
        )

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
    def master_dtype(self) -> str:
        """The dtype of the copy the optimizer updates: the parameter dtype unless a master copy is kept."""
        return self._plan[0]

    @property
    def state_dtype(self) -> str:
        """The dtype of the optimizer's moments and other floating slots."""
        return self._plan[1]

    @property
    def rounding(self) -> str:
        """How an update is written into bfloat16/float16 weights: "nearest", "stochastic" or "kahan"."""
        return self._plan[2]

    @property
    def float8(self) -> Float8Recipe | None:
        """The FP8 recipe the policy's linear layers run with (`polyamp.Float8Recipe`), or None."""
        return self._float8

    @property
    def keeps_master(self) -> bool:
        """True when the optimizer updates a master copy more precise than the parameters."""
        return self._plan[0] != self._dtypes[0]

    @property
    def has_training_state_plan(self) -> bool:
        """True when master, state or rounding differ from their defaults (an optimizer must follow them)."""
        return self._given_plan() != (None, None, None)

    @property
    def name(self) -> str:
        """The Keras name or preset name when one matches, else the canonical spec string (the plan's keys
        only where they differ from their defaults); with an FP8 recipe, ``"+"`` and its text after it (the
        recipe's text alone on ``"mixed_bfloat16"``)."""
        if self._float8 is None:
            return self._base_name()
        base = self._base_name()
        return self._float8.spec if base == "mixed_bfloat16" else f"{base}+{self._float8.spec}"

    def _base_name(self) -> str:
        preset = _PRESET_OF.get((self._dtypes, self._plan))
        if preset is not None:
            return preset
        extras = self._given_plan()
        named = _NAME_OF.get(self._dtypes)
        if named is not None and extras == (None, None, None):
            return named
        param, compute, output = self._dtypes
        text = f"params={param},compute={compute},output={output}"
        for key, value in zip(("master", "state", "rounding"), extras, strict=True):
            if value is not None:
                text += f",{key}={value}"
        return text

    @property
    def needs_loss_scaling(self) -> bool:
        """True when the compute dtype is float16, whose narrow range makes gradients underflow."""
        return self._dtypes[1] == "float16"

    @property
    def is_mixed(self) -> bool:
        """True when computation runs in a different dtype than the parameters are stored in."""
        return self._dtypes[0] != self._dtypes[1]

    def replace(
        self,
        *,
        param: object = None,
        compute: object = None,
        output: object = None,
        master: object = None,
        state: object = None,
        rounding: str | None = None,
        float8: Float8Recipe | str | bool | None = None,
    ) -> Policy:
        """Return a new policy with the given fields changed and the others kept (a master, state or rounding
        left at its default follows the new parameter dtype; ``float8=False`` drops the FP8 recipe).

        >>> Policy("mixed_float16").replace(output="float16").name
        'params=float32,compute=float16,output=float16'
        >>> Policy("bfloat16").replace(output="float32", rounding="kahan").name
        'bfloat16_kahan'
        """
        current = self._dtypes
        given = self._given_plan()
        return Policy(
            param=current[0] if param is None else param,
            compute=current[1] if compute is None else compute,
            output=current[2] if output is None else output,
            master=given[0] if master is None else master,
            state=given[1] if state is None else state,
            rounding=given[2] if rounding is None else rounding,
            float8=self._float8 if float8 is None or float8 is True else (float8 or None),
        )

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Policy is immutable; cannot set {name!r}. Use Policy.replace(...) instead.")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Policy is immutable; cannot delete {name!r}.")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Policy):
            return self._dtypes == other._dtypes and self._plan == other._plan and self._float8 == other._float8
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("polyamp.Policy", self._dtypes, self._plan, self._float8))

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
