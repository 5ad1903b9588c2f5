"""Reading a `PrecisionOptimizer` checkpoint: every tensor validated and converted to the current plan's dtype
before anything changes, with the conversions collected into one note.

torch's own ``Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype, which
would round a float32 master copy (and float32 moments) to bfloat16; this reader keeps each tensor in the dtype
the plan keeps it in instead, and says so when that differs from the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polyamp import Policy, StateDictError
from polyamp.backend_api import KAHAN_KEY, MASTER_KEY, conversion_note, describe
from polyamp_torch._framework import TORCH_DTYPES, torch

__all__ = ["Loaded", "read_checkpoint"]

_LOW = (torch.bfloat16, torch.float16)


@dataclass
class Loaded:
    """A checkpoint read for one optimizer: the new state per parameter, each group's hyperparameters, the
    random generators and the notes on conversions (in order, each once)."""

    state: dict[torch.Tensor, dict[str, Any]]
    groups: list[dict[str, Any]]
    generators: dict[torch.device, torch.Generator]
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _error(problem: str) -> StateDictError:
    return StateDictError(
        f"Cannot load this optimizer state dict: {problem} Pass the dict that PrecisionOptimizer.state_dict() "
        "(or the wrapped torch optimizer's state_dict()) returned for an optimizer over the same parameters, "
        "in the same groups. The optimizer is left unchanged."
    )


def _structure(state_dict: object, groups: list[dict[str, Any]]) -> tuple[Mapping[Any, Any], list[Mapping[str, Any]]]:
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
        keys = sorted(map(str, state_dict.keys())) if isinstance(state_dict, Mapping) else None
        raise _error(
            "it must be a dict with 'state' and 'param_groups'. Received: "
            + (f"a dict with keys {keys}." if keys is not None else f"{describe(state_dict)}.")
        )
    state, saved_groups = state_dict["state"], state_dict["param_groups"]
    if not isinstance(state, Mapping):
        raise _error(
            f"'state' must be a dict from parameter index to that parameter's state. Received: {describe(state)}."
        )
    if not isinstance(saved_groups, (list, tuple)) or not all(
        isinstance(group, Mapping) and isinstance(group.get("params"), (list, tuple)) for group in saved_groups
    ):
        raise _error(f"'param_groups' must be a list of dicts with 'params' lists. Received: {describe(saved_groups)}.")
    if len(saved_groups) != len(groups):
        raise _error(f"it has {len(saved_groups)} parameter groups; this optimizer has {len(groups)}.")
    for g, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise _error(
                f"its group {g} has {len(saved['params'])} parameters; this optimizer's has {len(group['params'])}."
            )
    return state, list(saved_groups)


def _generators(section: object) -> dict[torch.device, torch.Generator]:
    if section is None:
        return {}
    saved = section.get("generators", {}) if isinstance(section, Mapping) else section
    if not isinstance(saved, Mapping):
        raise _error(f"'polyamp' must be a dict with a 'generators' dict. Received: {describe(section)}.")
    generators = {}
    for name, value in saved.items():
        try:
            device = torch.device(name)
            if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
                raise TypeError
            generator = torch.Generator(device=device)
            generator.set_state(value.cpu())
        except (TypeError, RuntimeError, ValueError) as exc:
            raise _error(
                "'polyamp' -> 'generators' maps device names ('cpu', 'cuda:0') to torch.Generator.get_state() "
                f"byte tensors. Received {name!r}: {describe(value)}."
            ) from exc
        generators[device] = generator
    return generators


def read_checkpoint(
    state_dict: object, groups: list[dict[str, Any]], plan: Policy, is_moment: Any, names: Any
) -> Loaded:
    """Validate ``state_dict`` against the optimizer's ``groups`` and convert it to ``plan``.

    Raises:
        StateDictError: the dict is malformed or does not fit these parameters (nothing is changed).
    """
    saved_state, saved_groups = _structure(state_dict, groups)
    by_index: dict[Any, tuple[torch.Tensor, dict[str, Any], str]] = {}
    for g, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        for i, (index, param) in enumerate(zip(saved["params"], group["params"], strict=True)):
            by_index[index] = (param, group, names(group, g, i))
    loaded = Loaded(
        state={},
        groups=[{k: v for k, v in saved.items() if k not in ("params", "param_names")} for saved in saved_groups],
        generators=_generators(state_dict.get("polyamp") if isinstance(state_dict, Mapping) else None),
    )
    state_dtype = TORCH_DTYPES[plan.state_dtype]
    for index, entry in saved_state.items():
        if index not in by_index:
            raise _error(f"'state' has an entry for parameter index {index!r}, which no parameter group lists.")
        param, group, name = by_index[index]
        if not isinstance(entry, Mapping) or not all(isinstance(key, str) for key in entry):
            raise _error(f"the state of parameter {name} must be a dict with str keys. Received: {describe(entry)}.")
        low = param.dtype in _LOW
        new: dict[str, Any] = {}
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                new[key] = value
                continue
            if value.ndim > 0 and value.shape != param.shape:
                raise _error(
                    f"the state {key!r} of parameter {name} has shape {tuple(value.shape)}; the parameter has "
                    f"shape {tuple(param.shape)}."
                )
            saved_dtype = _dtype_name(value.dtype)
            if key == MASTER_KEY:
                if low and plan.keeps_master:
                    new[key] = value.to(param.device, torch.float32, copy=True)
                    if value.dtype != torch.float32:
                        loaded.note(conversion_note("the master copies", saved_dtype, "float32"))
                else:
                    loaded.note(conversion_note("the master copies", saved_dtype, _dtype_name(param.dtype)))
            elif key == KAHAN_KEY:
                if low and plan.rounding == "kahan":
                    new[key] = value.to(param.device, param.dtype, copy=True)
                    if value.dtype != param.dtype:
                        loaded.note(conversion_note("the Kahan compensation", saved_dtype, _dtype_name(param.dtype)))
                else:
                    loaded.note(
                        f"The checkpoint's Kahan compensation buffers are dropped: the plan {plan.name!r} writes "
                        f"updates with {plan.rounding} rounding"
                        + (" into a float32 master copy." if plan.keeps_master else ".")
                    )
            elif is_moment(key, value, param):
                new[key] = value.to(param.device, state_dtype, copy=True)
                if value.dtype != state_dtype:
                    loaded.note(conversion_note("the optimizer's moments", saved_dtype, plan.state_dtype))
            elif key == "step" and not (group.get("capturable") or group.get("fused")):
                new[key] = value.clone()  # where torch keeps it: on the CPU, unless the optimizer steps on the device
            elif key == "step":
                new[key] = value.to(param.device, torch.float32, copy=True)
            else:
                new[key] = value.to(param.device, copy=True)
        loaded.state[param] = new
    for group in groups:
        for param in group["params"]:
            if param.dtype not in _LOW:
                continue
            state = loaded.state.setdefault(param, {})
            if plan.keeps_master and MASTER_KEY not in state:
                state[MASTER_KEY] = param.detach().to(torch.float32, copy=True)
                loaded.note(
                    conversion_note(
                        "the master copies (not in the checkpoint: made from the weights)",
                        _dtype_name(param.dtype),
                        "float32",
                    )
                )
            if plan.rounding == "kahan" and KAHAN_KEY not in state:
                state[KAHAN_KEY] = torch.zeros_like(param, memory_format=torch.preserve_format)
                loaded.note(
                    "The checkpoint has no Kahan compensation buffers (it was saved under another plan): they start "
                    "at zero."
                )
    return loaded
