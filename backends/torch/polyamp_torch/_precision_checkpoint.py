"""Reading a `PrecisionOptimizer` checkpoint: every tensor validated and converted to the current plan's dtype
before anything changes, with the conversions collected into one note.

torch's own ``Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype, which
would round a float32 master copy (and float32 moments) to bfloat16; this reader keeps each tensor in the dtype
the plan keeps it in instead, and says so when that differs from the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from polyamp import Policy, StateDictError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.training_state import COUNTER_KEYS, KAHAN_KEY, MASTER_KEY, checkpoint_changes
from polyamp_torch._framework import TORCH_DTYPES, torch
from polyamp_torch._precision_layout import Kept

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
    state_dict: object,
    groups: list[dict[str, Any]],
    plan: Policy,
    is_moment: Any,
    names: Any,
    layout: Callable[[list[dict[str, Any]]], dict[torch.Tensor, dict[str, Kept]] | None],
    optimizer: str,
) -> Loaded:
    """Validate ``state_dict`` against the optimizer's ``groups`` and convert it to ``plan``. ``layout(values)``
    gives what the inner optimizer (named ``optimizer`` in messages) keeps for each parameter under the groups'
    hyperparameters ``values`` (`polyamp_torch._precision_layout.state_layout`), or None when it cannot tell.

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
    expected = layout(loaded.groups) if any(saved_state.values()) else None
    for index, entry in saved_state.items():
        if index not in by_index:
            raise _error(f"'state' has an entry for parameter index {index!r}, which no parameter group lists.")
        param, group, name = by_index[index]
        if not isinstance(entry, Mapping) or not all(isinstance(key, str) for key in entry):
            raise _error(f"the state of parameter {name} must be a dict with str keys. Received: {describe(entry)}.")
        _check_entry(entry, param, name, None if expected is None else expected.get(param), optimizer)
        loaded.state[param] = _convert_entry(entry, param, group, plan, is_moment, loaded)
    for group in groups:
        for param in group["params"]:
            if param not in loaded.state:  # no state saved: what the plan keeps besides the slots starts afresh
                loaded.state[param] = _convert_entry({}, param, group, plan, is_moment, loaded)
    return loaded


def _check_entry(
    entry: Mapping[str, Any], param: torch.Tensor, name: str, kept: dict[str, Kept] | None, optimizer: str
) -> None:
    """Refuse a parameter's saved state that the next step could not use.

    With the inner optimizer's layout (``kept``), a non-empty entry must hold every tensor it keeps, each a
    tensor of the same shape (a one-element tensor for a 0-d one: a step counter) and of the same kind, floating
    or not; entries it does not keep are left to it. Without one, a master copy or compensation buffer must have
    the parameter's shape, a step counter one element, and any other tensor a shape that broadcasts to it.
    """
    for key in (MASTER_KEY, KAHAN_KEY):
        value = entry.get(key)
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(param.shape):
            raise _error(_shape_problem(key, name, value, param))
    if kept is None:
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key in COUNTER_KEYS and value.numel() != 1:
                raise _error(
                    f"the state {key!r} of parameter {name} is a step counter, which holds one number. Received: "
                    f"a tensor of shape {tuple(value.shape)}."
                )
            if not _fits(key, value, param):
                raise _error(_shape_problem(key, name, value, param))
        return
    if all(key in (MASTER_KEY, KAHAN_KEY) for key in entry):
        return  # the inner optimizer has not stepped this parameter yet: its next step makes the state
    for key, want in kept.items():
        if not want.tensor:
            continue
        value = entry.get(key)
        if isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            if (shape == want.shape or (want.shape == () and value.numel() == 1)) and (
                value.is_floating_point() == want.floating
            ):
                continue
            dtype = _dtype_name(value.dtype)
            received = f"{'an' if dtype[0] in 'aeiou' else 'a'} {dtype} tensor of shape {shape}"
        else:
            received = "nothing" if key not in entry else describe(value)
        kind = "floating" if want.floating else "non-floating"
        raise _error(
            f"the state {key!r} of parameter {name} (shape {tuple(param.shape)}) must be a {kind} tensor of shape "
            f"{want.shape}, as {optimizer} keeps it. Received: {received}."
        )


def _shape_problem(key: str, name: str, value: torch.Tensor, param: torch.Tensor) -> str:
    return (
        f"the state {key!r} of parameter {name} has shape {tuple(value.shape)}, which does not fit the parameter's "
        f"shape {tuple(param.shape)}."
    )


def _fits(key: str, value: torch.Tensor, param: torch.Tensor) -> bool:
    """A master copy or compensation buffer has the parameter's shape; any other tensor broadcasts to it
    (Adam's moments have it, Adafactor's factored statistics broadcast, step counters are scalars)."""
    if key in (MASTER_KEY, KAHAN_KEY):
        return tuple(value.shape) == tuple(param.shape)
    shape, target = tuple(value.shape), tuple(param.shape)
    return len(shape) <= len(target) and all(
        size in (1, wanted) for size, wanted in zip(reversed(shape), reversed(target), strict=False)
    )


def _convert_entry(
    entry: Mapping[str, Any],
    param: torch.Tensor,
    group: dict[str, Any],
    plan: Policy,
    is_moment: Any,
    loaded: Loaded,
) -> dict[str, Any]:
    """One parameter's saved state under ``plan``, converted as the core's `checkpoint_changes` decides."""
    master = entry.get(MASTER_KEY)
    compensation = entry.get(KAHAN_KEY)
    slots = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor) and is_moment(k, v, param)}
    changes = checkpoint_changes(
        plan,
        weights=_dtype_name(param.dtype),
        saved_master=_dtype_name(master.dtype) if isinstance(master, torch.Tensor) else None,
        saved_compensation=_dtype_name(compensation.dtype) if isinstance(compensation, torch.Tensor) else None,
        saved_slots=[_dtype_name(v.dtype) for v in slots.values()],
    )
    for note in changes.notes:
        loaded.note(note)
    state_dtype = TORCH_DTYPES[plan.state_dtype]
    new: dict[str, Any] = {}
    for key, value in entry.items():
        if key in (MASTER_KEY, KAHAN_KEY):
            continue
        if not isinstance(value, torch.Tensor):
            new[key] = value
        elif key in slots:
            new[key] = value.to(param.device, state_dtype, copy=True)
        elif key == "step" and not (group.get("capturable") or group.get("fused")):
            new[key] = value.clone()  # where torch keeps it: on the CPU, unless the optimizer steps on the device
        elif key == "step":
            new[key] = value.to(param.device, torch.float32, copy=True)
        else:
            new[key] = value.to(param.device, copy=True)
    if changes.master in ("keep", "convert"):
        new[MASTER_KEY] = master.to(param.device, torch.float32, copy=True)  # type: ignore[union-attr]
    elif changes.master == "make":
        new[MASTER_KEY] = param.detach().to(torch.float32, copy=True)
    if changes.compensation in ("keep", "convert"):
        new[KAHAN_KEY] = compensation.to(param.device, param.dtype, copy=True)  # type: ignore[union-attr]
    elif changes.compensation == "make":
        new[KAHAN_KEY] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return new
