"""`Float8Recipe`: how a policy's matmuls run in FP8, as a value every backend reads the same way.

A recipe says, for the three operands of a linear layer's matmuls (input, weight, grad-output), the FP8
format, how the scales are found (from the tensor itself, or from a history of amaxes), their granularity
(one per tensor, per row along the contracted axis, or per 32-value MX block), and which layers it applies
to. Its text form is part of the policy grammar (``"mixed_bfloat16+float8_rowwise[margin=1]"``); its
arithmetic lives in `polyamp._src.rules.fp8`.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from dataclasses import dataclass
from typing import Any, Final

from polyamp._src.errors import InvalidPolicyError, PolyampTypeError, describe
from polyamp._src.rules.fp8 import FORMATS, MX_ROUNDINGS

__all__ = ["CAST_ROLES", "FLOAT8_PRESETS", "Float8CastRecord", "Float8Recipe", "cast_records", "parse_recipe"]

SCALINGS: Final = ("dynamic", "delayed")
GRANULARITIES: Final = ("tensor", "row", "mx")
AMAX_COMPUTES: Final = ("max", "most_recent")
_PATTERN_FORBIDDEN: Final = frozenset(",=|[]+")


def _allowed(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidPolicyError(
            f"Float8Recipe `{field}` must be one of {', '.join(map(repr, allowed))}. Received: {describe(value)}."
        )


def _whole(field: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidPolicyError(f"Float8Recipe `{field}` must be an int >= {low}. Received: {describe(value)}.")


@dataclass(frozen=True)
class Float8Recipe:
    """An FP8 training recipe: formats, scaling and granularity of each matmul operand, and which layers.

    A linear layer ``y = x @ w.T`` runs three matmuls: the output (input by weight), the grad-input
    (grad-output by weight) and the grad-weight (grad-output by input). Under a recipe each operand is cast to
    FP8 with a scale, the matmul accumulates in float32 and the result is unscaled. Use a preset through the
    policy grammar (``polyamp.set_policy("float8_rowwise")``) or build one:

    Args:
        scaling: ``"dynamic"`` (each cast's scale from the tensor's own amax, as torchao and Transformer
            Engine's current scaling) or ``"delayed"`` (from a history of previous amaxes, kept as layer
            state, as Keras's ``quantize("float8")``, Flax's ``fp8_ops`` and Transformer Engine's
            ``DelayedScaling``; tensorwise only).
        granularity: ``"tensor"`` (one scale per tensor), ``"row"`` (one per row along the contracted axis of
            each matmul) or ``"mx"`` (one E8M0 power of two per ``mx_block`` values along it).
        input_format, weight_format, grad_output_format: ``"e4m3"`` (448 at most, 3 mantissa bits) or
            ``"e5m2"`` (57344 at most, 2 mantissa bits).
        power_of_two: Round each dynamic scale down to a power of two (exact rescaling; torchao's rowwise).
        margin: Delayed scaling's headroom: the scale maps the amax to ``max / 2**margin``.
        amax_history_length: Delayed scaling's history of amaxes per cast (Keras, Flax and TE default 1024).
        amax_compute: ``"max"`` (the history's largest, the default everywhere) or ``"most_recent"``.
        grad_weight_high_precision: The grad-weight matmul stays in the compute dtype, and the grad-input
            matmul takes the weight with one scale per tensor (torchao's ``rowwise_with_gw_hp``).
        mx_block: Values per MX block (32, the OCP MX format).
        mx_rounding: How an MX block's exponent is rounded: ``"rceil"`` (the exponent of ``amax / max``
            rounded up: cuBLAS, Transformer Engine and torchao's MXFP8 training), ``"floor"`` (the OCP
            specification's rule, torchao's ``to_mx`` default) or ``"ceil"``.
        modules: Glob patterns over layer names (as ``named_modules()`` gives them) of the layers to convert.
        skip: Glob patterns of layers never converted (the output head, say).
        alignment: The layer dimensions must be multiples of it (FP8 kernels take multiples of 16).

    Raises:
        InvalidPolicyError: a field outside its allowed values, or a combination no kernel runs (delayed
            scaling with rows or MX blocks, a power-of-two rounding of MX scales, which are powers of two).

    >>> import polyamp
    >>> recipe = polyamp.Float8Recipe.preset("float8_rowwise")
    >>> recipe.granularity, recipe.power_of_two, recipe.grad_output_format
    ('row', True, 'e4m3')
    >>> polyamp.Policy("float8_rowwise").float8 == recipe
    True
    >>> polyamp.Policy("mixed_bfloat16+float8_delayed[amax_history_length=16]").float8.amax_history_length
    16
    >>> polyamp.Float8Recipe.from_dict(recipe.to_dict()) == recipe
    True
    """

    scaling: str = "dynamic"
    granularity: str = "tensor"
    input_format: str = "e4m3"
    weight_format: str = "e4m3"
    grad_output_format: str = "e5m2"
    power_of_two: bool = False
    margin: int = 0
    amax_history_length: int = 1024
    amax_compute: str = "max"
    grad_weight_high_precision: bool = False
    mx_block: int = 32
    mx_rounding: str = "rceil"
    modules: tuple[str, ...] = ("*",)
    skip: tuple[str, ...] = ()
    alignment: int = 16

    def __post_init__(self) -> None:
        for field in ("modules", "skip"):
            value = getattr(self, field)
            if isinstance(value, str):
                value = (value,)
            if not isinstance(value, (tuple, list)) or not all(isinstance(p, str) and p for p in value):
                raise InvalidPolicyError(
                    f"Float8Recipe `{field}` must be a tuple of glob patterns over layer names such as "
                    f"('blocks.*', '*.mlp.*'). Received: {describe(value)}."
                )
            bad = [p for p in value if _PATTERN_FORBIDDEN & set(p)]
            if bad:
                raise InvalidPolicyError(
                    f"Float8Recipe `{field}` pattern {bad[0]!r} holds one of {''.join(sorted(_PATTERN_FORBIDDEN))}, "
                    "which the policy text uses; write patterns with * and ? only."
                )
            object.__setattr__(self, field, tuple(value))
        _allowed("scaling", self.scaling, SCALINGS)
        _allowed("granularity", self.granularity, GRANULARITIES)
        for role in ("input_format", "weight_format", "grad_output_format"):
            _allowed(role, getattr(self, role), tuple(FORMATS))
        _allowed("amax_compute", self.amax_compute, AMAX_COMPUTES)
        _allowed("mx_rounding", self.mx_rounding, MX_ROUNDINGS)
        for flag in ("power_of_two", "grad_weight_high_precision"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidPolicyError(
                    f"Float8Recipe `{flag}` must be a bool. Received: {describe(getattr(self, flag))}."
                )
        _whole("margin", self.margin, 0)
        _whole("amax_history_length", self.amax_history_length, 1)
        _whole("mx_block", self.mx_block, 1)
        _whole("alignment", self.alignment, 1)
        if self.scaling == "delayed" and self.granularity != "tensor":
            raise InvalidPolicyError(
                f"Delayed scaling keeps one amax history per tensor; granularity={self.granularity!r} needs "
                "scaling='dynamic'. Use granularity='tensor' with delayed scaling, or dynamic scaling for rows "
                f"and MX blocks. Received: scaling='delayed', granularity={self.granularity!r}."
            )
        if self.granularity == "mx" and self.power_of_two:
            raise InvalidPolicyError(
                "MX scales are powers of two already (E8M0 exponents); leave power_of_two=False with "
                "granularity='mx' and choose mx_rounding instead."
            )
        if self.granularity == "mx" and self.grad_weight_high_precision:
            raise InvalidPolicyError(
                "grad_weight_high_precision is torchao's rowwise variant; with granularity='mx' every matmul "
                "runs in MX. Use granularity='row' for it."
            )

    # -- text and dict forms ----------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> Float8Recipe:
        """The preset called ``name`` (see `FLOAT8_PRESETS`)."""
        if name not in FLOAT8_PRESETS:
            hint = difflib.get_close_matches(name, FLOAT8_PRESETS, n=1)
            raise InvalidPolicyError(
                f"Unknown FP8 recipe {name!r}.{f' Did you mean {hint[0]!r}?' if hint else ''} The presets: "
                f"{', '.join(FLOAT8_PRESETS)}."
            )
        return FLOAT8_PRESETS[name]

    @property
    def spec(self) -> str:
        """The recipe as policy text: a preset's name, or the nearest preset with the fields that differ
        in brackets (``"float8_delayed[margin=1]"``); `parse_recipe` reads it back."""
        best: tuple[int, str, list[str]] | None = None
        for name, preset in FLOAT8_PRESETS.items():
            diffs = [
                f"{f.name}={_text(getattr(self, f.name))}"
                for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(preset, f.name)
            ]
            if best is None or len(diffs) < best[0]:
                best = (len(diffs), name, diffs)
        assert best is not None
        _, name, diffs = best
        return f"{name}[{','.join(diffs)}]" if diffs else name

    def to_dict(self) -> dict[str, Any]:
        """The recipe's fields as JSON-compatible values (patterns as lists)."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Float8Recipe:
        """The recipe `to_dict` gave (missing fields take their defaults).

        Raises:
            InvalidPolicyError: a key that is no field, or a field's value outside its allowed values.
        """
        if not isinstance(data, dict):
            raise InvalidPolicyError(f"Float8Recipe.from_dict takes a dict from to_dict(). Received: {describe(data)}.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise InvalidPolicyError(
                f"Float8Recipe.from_dict got unknown keys {unknown}; the fields are {sorted(names)}."
            )
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fields)

    # -- which layers -------------------------------------------------------------------------------------

    def skip_reason(self, name: str, in_features: int, out_features: int) -> str | None:
        """Why the layer ``name`` (``in_features`` → ``out_features``) stays in the compute dtype, or None
        when the recipe converts it: not matched by ``modules``, matched by ``skip``, or a dimension the FP8
        kernels cannot take (not a multiple of ``alignment``, or of ``mx_block`` under MX)."""
        if not any(fnmatch.fnmatchcase(name, p) for p in self.modules):
            return f"not matched by modules={list(self.modules)}"
        matched = [p for p in self.skip if fnmatch.fnmatchcase(name, p)]
        if matched:
            return f"matched by skip pattern {matched[0]!r}"
        multiple = self.mx_block if self.granularity == "mx" else self.alignment
        odd = [
            f"{what}={n}" for what, n in (("in_features", in_features), ("out_features", out_features)) if n % multiple
        ]
        if odd:
            return f"{', '.join(odd)} not a multiple of {multiple}"
        return None

    def selects(self, name: str) -> bool:
        """Whether the layer ``name`` is matched by ``modules`` and by no ``skip`` pattern: a layer the user
        asked for, which `skip_reason` may still keep out for its dimensions."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.modules) and not any(
            fnmatch.fnmatchcase(name, p) for p in self.skip
        )

    def format_of(self, role: str) -> str:
        """The format of ``role``: ``"input"``, ``"weight"`` or ``"grad_output"``."""
        return getattr(self, f"{role}_format")  # type: ignore[no-any-return]


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "|".join(value)
    return str(value)


def _value(recipe_text: str, key: str, text: str) -> object:
    default = getattr(Float8Recipe, key)
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise InvalidPolicyError(f"{key} takes true or false in FP8 recipe {recipe_text!r}. Received: {text!r}.")
        return text.lower() == "true"
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise InvalidPolicyError(
                f"{key} takes an integer in FP8 recipe {recipe_text!r}. Received: {text!r}."
            ) from None
    if isinstance(default, tuple):
        return tuple(p for p in text.split("|") if p)
    return text.lower()


def parse_recipe(text: str) -> Float8Recipe:
    """The recipe named by ``text``: a preset's name, optionally followed by ``[field=value,...]`` changing
    some of its fields (booleans ``true``/``false``, patterns joined by ``|``), e.g.
    ``"float8_delayed[amax_history_length=16,margin=1]"`` or ``"float8_rowwise[skip=head|embed]"``.

    Raises:
        InvalidPolicyError: an unknown preset or field, or a value the field does not take.
    """
    name, bracket, rest = text.strip().partition("[")
    recipe = Float8Recipe.preset(name.strip().lower())
    if not bracket:
        return recipe
    if not rest.endswith("]"):
        raise InvalidPolicyError(
            f"FP8 recipe {text!r} opens '[' without closing it; write e.g. 'float8_delayed[margin=1]'."
        )
    fields = {f.name for f in dataclasses.fields(Float8Recipe)}
    changes: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in rest[:-1].split(","))):
        key, sep, value = (piece.strip() for piece in part.partition("="))
        key = key.lower()
        if not sep or key not in fields:
            hint = difflib.get_close_matches(key, fields, n=1)
            raise InvalidPolicyError(
                f"Cannot read {part!r} in FP8 recipe {text!r}: expected field=value with a field among "
                f"{', '.join(sorted(fields))}.{f' Did you mean {hint[0]!r}?' if hint else ''}"
            )
        changes[key] = _value(text, key, value)
    return dataclasses.replace(recipe, **changes)  # type: ignore[arg-type]


#: The named recipes (each on top of the policy's 16-bit compute dtype), with the library they follow.
FLOAT8_PRESETS: Final = {
    # torchao's "tensorwise" and Transformer Engine's Float8CurrentScaling: E4M3 forward, E5M2 gradients.
    "float8_tensorwise": Float8Recipe(),
    # torchao's "rowwise": E4M3 everywhere, one power-of-two scale per row.
    "float8_rowwise": Float8Recipe(granularity="row", grad_output_format="e4m3", power_of_two=True),
    # torchao's "rowwise_with_gw_hp": rowwise, grad-weight in the compute dtype.
    "float8_rowwise_gw_hp": Float8Recipe(
        granularity="row", grad_output_format="e4m3", power_of_two=True, grad_weight_high_precision=True
    ),
    # Keras's quantize("float8"), Flax's fp8_ops, Transformer Engine's DelayedScaling (HYBRID formats).
    "float8_delayed": Float8Recipe(scaling="delayed"),
    # MXFP8: E4M3 values in 32-value blocks with an E8M0 exponent rounded up (cuBLAS, TE, torchao training).
    "mxfp8": Float8Recipe(granularity="mx", grad_output_format="e4m3"),
}


#: The operands whose casts the FP8 records count, in the order of a layer's count rows.
CAST_ROLES: Final = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Float8CastRecord:
    """What one layer's casts of one operand lost since the records were last read.

    Attributes:
        saturated: Values past the format's max after scaling, clamped to it.
        flushed: Nonzero values that became zero.
        nonzero: Nonzero values cast.
    """

    saturated: int
    flushed: int
    nonzero: int

    @property
    def flushed_fraction(self) -> float:
        """``flushed / nonzero`` (0.0 when nothing nonzero was cast)."""
        return self.flushed / self.nonzero if self.nonzero else 0.0


def cast_records(names: list[str], counts: list[list[list[int]]]) -> dict[str, dict[str, Float8CastRecord]]:
    """The records of layers ``names`` from their count rows (`polyamp.backend_api.rules.fp8.cast_counts` per
    operand, in `CAST_ROLES` order), read from the device in one batch."""
    return {
        name: {role: Float8CastRecord(*(int(v) for v in row)) for role, row in zip(CAST_ROLES, rows, strict=True)}
        for name, rows in zip(names, counts, strict=True)
    }


def split_policy_spec(spec: str) -> tuple[str, Float8Recipe | None]:
    """The base policy text and the FP8 recipe of ``"<policy>+<recipe>"`` or of a recipe alone (whose base is
    ``"mixed_bfloat16"``); ``(spec, None)`` without one."""
    base, plus, recipe = spec.partition("+")
    if plus:
        if not base.strip() or not recipe.strip():
            raise InvalidPolicyError(
                f"Policy spec {spec!r} has an empty side of '+': write '<policy>+<fp8 recipe>', e.g. "
                "'mixed_bfloat16+float8_rowwise'."
            )
        return base, parse_recipe(recipe)
    if spec.strip().lower().partition("[")[0].strip() in FLOAT8_PRESETS:
        return "mixed_bfloat16", parse_recipe(spec)
    return spec, None


def as_recipe(value: object) -> Float8Recipe:
    """``value`` (a `Float8Recipe` or a recipe's text) as a `Float8Recipe`."""
    if isinstance(value, Float8Recipe):
        return value
    if isinstance(value, str):
        return parse_recipe(value)
    raise PolyampTypeError(
        f"`float8` must be a polyamp.Float8Recipe or a recipe's text such as 'float8_rowwise'. Received: "
        f"{describe(value)}."
    )
