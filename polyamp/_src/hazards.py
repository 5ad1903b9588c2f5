"""Checkpoint and model hazards under a precision policy: weights float16 cannot hold, buffers to keep float32.

The rules work on `TensorSummary` triples (name, dtype name, max |w|) and never see a tensor: the backends
(``polyamp_torch``, ``polyamp_keras``) read checkpoints and models and compute max |w| with their framework,
through the ``tensor_reader`` of their `polyamp.backend_api.BackendSpec`. Let ``p`` be the policy checked, "float16
policy" mean ``p.param_dtype`` or ``p.compute_dtype`` is float16, "low-precision policy" that one of them is
float16 or bfloat16, and "floating" a dtype name starting with ``float`` or ``bfloat`` (integer, bool and
complex tensors are ignored). For each floating tensor, in this order:

=================  ========  ==============================================================================
kind               severity  when
=================  ========  ==============================================================================
non_finite         error     max |w| is inf or NaN (any policy)
float16_overflow   error     float16 policy and max |w| > 65504 (float16's largest finite value): the cast
                             to float16 gives inf
float16_range      warning   float16 policy and 4096 < max |w| <= 65504: less than 16x (4 bits) of headroom,
                             so a product with an input above 16 in magnitude, or a sum of 16 such terms,
                             overflows
rotary_buffer      warning   low-precision policy and the name contains ``inv_freq`` or ``rotary``, or a
                             word starting with ``rope`` (at the start or after a non-letter), ignoring case
norm_statistics    warning   low-precision *parameter* dtype (``"float16"``, ``"bfloat16"`` and specs like
                             them) and the name's last part is ``running_mean``, ``running_var``,
                             ``moving_mean`` or ``moving_variance``, or ``mean`` or ``var`` under a
                             ``batch_stats`` part (Flax's batch statistics)
=================  ========  ==============================================================================

A tensor can raise several hazards (one per rule). Under mixed policies parameters and buffers stay float32,
so normalization statistics are safe there; rotary frequencies are not, because autocast multiplies them by
the positions in the compute dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from polyamp._src.checkpoints import DEFAULT_MAX_BYTES
from polyamp._src.policy import Policy, PolicyLike
from polyamp._src.tensor_reading import TensorSummary, read_tensors, summary_of

__all__ = [
    "FLOAT16_MAX",
    "FLOAT16_WARN_ABOVE",
    "HAZARD_KINDS",
    "Hazard",
    "TensorSummary",
    "check_hazards",
    "find_hazards",
    "read_tensors",
]

#: float16's largest finite value.
FLOAT16_MAX: Final = 65504.0
#: Above this max |w| (2**12, 16x below `FLOAT16_MAX`) a float16 policy gets a ``float16_range`` warning.
FLOAT16_WARN_ABOVE: Final = 4096.0

#: Every hazard kind, with what it means.
HAZARD_KINDS: Final = {
    "non_finite": "the tensor holds inf or NaN",
    "float16_overflow": "max |w| > 65504: the tensor becomes inf in float16",
    "float16_range": "4096 < max |w| <= 65504: less than 16x headroom below float16's largest value",
    "rotary_buffer": "rotary-embedding frequencies, which need float32 under a low-precision policy",
    "norm_statistics": "normalization running statistics stored in a low-precision parameter dtype",
}

_ROTARY: Final = re.compile(r"inv_freq|rotary|(?:^|[^a-z])rope", re.IGNORECASE)
_NORM_STATISTICS: Final = frozenset({"running_mean", "running_var", "moving_mean", "moving_variance"})
_LOW: Final = frozenset({"float16", "bfloat16"})


@dataclass(frozen=True)
class Hazard:
    """One tensor that a precision policy would hurt.

    Attributes:
        kind: One of `HAZARD_KINDS` (``"float16_overflow"``, ``"rotary_buffer"``, ...).
        name: The tensor's name in the checkpoint or model.
        dtype: Its dtype name as stored.
        value: Its max |w| (NaN when it holds a NaN; None when the reader gave none).
        severity: ``"error"`` (the run will produce inf/NaN) or ``"warning"`` (precision or range at risk).
        policy: The name of the policy checked against.
        message: What was found, why it matters and the fix.
    """

    kind: str
    name: str
    dtype: str
    value: float | None
    severity: str
    policy: str
    message: str

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """The hazard as JSON-able plain values (``value`` None when not finite, with the text in ``message``)."""
        value = self.value if self.value is None or math.isfinite(self.value) else None
        return {
            "kind": self.kind,
            "name": self.name,
            "dtype": self.dtype,
            "value": value,
            "severity": self.severity,
            "policy": self.policy,
            "message": self.message,
        }


def _is_floating(dtype: str) -> bool:
    text = dtype.lower().removeprefix("torch.")
    return text.startswith(("float", "bfloat")) or text in ("half", "double")


def _keep(name: str) -> str:
    """How to keep the layer holding a tensor in float32 (the layer: the name without its last part)."""
    for sep in ("/", "."):
        head, found, _ = name.rpartition(sep)
        if found and head:
            return f"keep {head!r} in float32 (keep_float32=[{head!r}] in apply_policy, or overrides={{{head!r}: 'float32'}})"
    return "keep the layer holding it in float32 (keep_float32=[...] in apply_policy, or overrides={...: 'float32'})"


def find_hazards(tensors: Iterable[TensorSummary | tuple[str, str, float | None]], policy: PolicyLike) -> list[Hazard]:
    """Apply the hazard rules (see the module's table) to ``(name, dtype, max_abs)`` triples.

    Framework-free: give it triples from any source. ``policy`` is a `polyamp.Policy`, a policy name or a spec
    (``"auto"`` included). Returns the hazards in the order of ``tensors``, each tensor's in the table's order.

    Examples:
        >>> [h.kind for h in find_hazards([("w", "float32", 1e5), ("rope.inv_freq", "float32", 1.0)], "mixed_float16")]
        ['float16_overflow', 'rotary_buffer']
        >>> [h.kind for h in find_hazards([("w", "float32", 1e5), ("steps", "int64", None)], "mixed_bfloat16")]
        []
    """
    resolved = Policy(policy)
    dtypes = (resolved.param_dtype, resolved.compute_dtype)
    float16 = "float16" in dtypes
    low = any(d in _LOW for d in dtypes)
    low_params = resolved.param_dtype in _LOW
    low_dtype = resolved.compute_dtype if resolved.compute_dtype in _LOW else resolved.param_dtype
    found: list[Hazard] = []
    for item in tensors:
        name, dtype, max_abs = summary_of(item)
        if not _is_floating(dtype):
            continue

        def hazard(kind: str, severity: str, message: str) -> None:
            found.append(Hazard(kind, name, dtype, max_abs, severity, resolved.name, message))  # noqa: B023

        keep = _keep(name)
        if max_abs is not None and not math.isfinite(max_abs):
            hazard(
                "non_finite",
                "error",
                f"{name} ({dtype}) holds {'NaN' if math.isnan(max_abs) else 'inf'}: every output computed from it "
                "is non-finite, under any policy, and loss scaling will skip every step. Fix the checkpoint "
                "(reload an earlier one, or re-initialize this tensor).",
            )
        elif float16 and max_abs is not None and max_abs > FLOAT16_MAX:
            hazard(
                "float16_overflow",
                "error",
                f"{name} ({dtype}) has max |w| = {max_abs:.6g}, above float16's largest finite value 65504: under "
                f"{resolved.name!r} it becomes inf when cast to float16. Use 'mixed_bfloat16' (bfloat16 has "
                f"float32's range), or {keep}.",
            )
        elif float16 and max_abs is not None and max_abs > FLOAT16_WARN_ABOVE:
            hazard(
                "float16_range",
                "warning",
                f"{name} ({dtype}) has max |w| = {max_abs:.6g}, within 16x of float16's largest value 65504: under "
                f"{resolved.name!r} a product with an input above {FLOAT16_MAX / max_abs:.3g} in magnitude overflows "
                f"to inf. Prefer 'mixed_bfloat16', or {keep}.",
            )
        if low and _ROTARY.search(name):
            hazard(
                "rotary_buffer",
                "warning",
                f"{name} ({dtype}) looks like rotary-embedding frequencies: under {resolved.name!r} a matmul "
                f"computing the angles position x frequency (as rotary embeddings often do) runs in {low_dtype}, "
                f"whose {'8' if low_dtype == 'bfloat16' else '11'}-bit significand puts them off by whole radians "
                f"at positions in the thousands. Keep the buffer and the angles in float32: {keep}.",
            )
        if low_params and _is_norm_statistic(name):
            hazard(
                "norm_statistics",
                "warning",
                f"{name} ({dtype}) is a normalization running statistic: {resolved.name!r} stores it in "
                f"{resolved.param_dtype}, where a momentum update smaller than 1/"
                f"{'256' if resolved.param_dtype == 'bfloat16' else '2048'} of its value is lost. Use a mixed "
                f"policy ('mixed_{resolved.param_dtype}' keeps parameters and buffers in float32), or {keep}.",
            )
    return found


def _is_norm_statistic(name: str) -> bool:
    parts = name.replace("/", ".").split(".")
    return parts[-1] in _NORM_STATISTICS or (parts[-1] in ("mean", "var") and "batch_stats" in parts[:-1])


def check_hazards(
    state_or_path: object, policy: PolicyLike | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> list[Hazard]:
    """Find the tensors of a checkpoint, model or state dict that ``policy`` would hurt.

    Reads the tensors with `read_tensors` (a file by its suffix, or a ``torch.nn.Module`` / state dict / Keras
    model) and applies `find_hazards`' rules: float16 overflow (max |w| > 65504) and near-overflow
    (> 4096) under float16 policies, rotary frequency buffers under low-precision policies, normalization
    statistics under low-precision parameter dtypes, and inf/NaN under any policy.

    Args:
        state_or_path: A checkpoint path (``.pt``/``.pth``/``.bin``/``.ckpt`` read with
            ``torch.load(weights_only=True)``, a state dict or a dict holding one under ``"state_dict"``,
            ``"model"`` or ``"model_state_dict"``; ``.safetensors`` with the ``safetensors`` package; ``.keras`` /
            ``.weights.h5`` with Keras; ``.npz`` with NumPy; an orbax checkpoint directory with orbax), or an
            in-memory ``torch.nn.Module`` (parameters and all buffers, non-persistent ones included), torch state
            dict, Keras model or layer, JAX pytree (a Flax params dict, an NNX module or state), or nested dicts
            and lists of NumPy arrays.
        policy: The policy to check against: a `polyamp.Policy`, a name (``"auto"`` included) or a spec. None:
            the policy in effect (`polyamp.get_policy`).
        max_bytes: For a file, the most tensor bytes it may declare in all (a ``.keras`` archive: its members
            uncompressed), default 64 GiB; a file declaring more is refused before its tensors are read. A
            ``.keras`` archive's ``config.json`` may inflate to at most 64 MiB. Ignored for objects in memory.

    Returns:
        The hazards found, empty when there is none.

    Raises:
        PolyampValueError: no file at the path, no reader for its suffix, or a bad ``policy``.
        CheckpointError: the file cannot be read (corrupt, truncated, holding what the reader does not
            handle) or declares more than ``max_bytes``; the message names the file and the reason.
        PolyampTypeError: no reader handles the object's framework, or ``max_bytes`` is not an int.
        BackendNotInstalledError: the reader's framework (or ``safetensors``) is not installed.

    Examples:
        >>> import polyamp
        >>> polyamp.check_hazards(model, "mixed_float16")  # doctest: +SKIP
        [Hazard(kind='float16_overflow', name='proj.weight', ...)]
    """
    if policy is None:
        from polyamp._src.global_policy import get_policy

        policy = get_policy()
    resolved = Policy(policy)
    return find_hazards(read_tensors(state_or_path, max_bytes=max_bytes), resolved)
