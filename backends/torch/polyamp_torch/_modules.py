"""Per-module precision for PyTorch: a policy on a model, outputs in the output dtype, float32 islands.

``torch.autocast`` has one dtype per region and no per-module override. `apply_policy` gives a model:

* its forward run under the policy (``polyamp_torch.autocast``) with floating outputs cast to the
  policy's output dtype (float32 for the mixed policies);
* parameters and buffers in the policy's param dtype;
* chosen submodules (by name, glob pattern or instance, or through `polyamp.PolicyOverrides`) run under
  their own policy: for float32 that is autocast off with their floating inputs cast to float32.

It works by giving each affected module an instance-level ``forward`` (a picklable callable object), so
``state_dict`` keys, hooks, ``torch.save`` / ``copy.deepcopy`` and wrapping in DDP are unaffected.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

from torch.utils import _pytree as pytree

import polyamp
from polyamp import Policy, PolicyLike, PolicyOverrides, PolyampTypeError
from polyamp._src.errors import InvalidConfigError, describe
from polyamp._src.overrides import OverridesLike
from polyamp_torch._autocast import autocast, default_device_type
from polyamp_torch._framework import TORCH_DTYPES, torch

__all__ = ["apply_policy", "module_policy", "remove_policy"]

_CASTABLE = frozenset(TORCH_DTYPES.values())


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dtype in _CASTABLE and leaf.dtype != dtype:
            return leaf.to(dtype)
        return leaf

    return pytree.tree_map(cast, tree)


def _first_device_type(tree: Any) -> str | None:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return None


class _PolicyForward:
    """A module's forward, run under a policy. Held in the module's ``__dict__`` (so it pickles with it)."""

    def __init__(self, module: torch.nn.Module, policy: Policy, device_type: str | None, is_root: bool) -> None:
        self.module = module
        self.policy = policy
        self.device_type = device_type
        self.is_root = is_root
        self.previous = module.__dict__.get("forward")  # an instance forward someone else installed
        self._output_dtype = TORCH_DTYPES[policy.output_dtype]
        self._float32_region = policy.compute_dtype == "float32"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device_type = self.device_type or _first_device_type((args, kwargs)) or default_device_type()
        if self._float32_region:
            args, kwargs = _cast_floating((args, kwargs), torch.float32)
        with autocast(self.policy, device_type=device_type):
            if self.previous is not None:
                out = self.previous(*args, **kwargs)
            else:
                out = type(self.module).forward(self.module, *args, **kwargs)
        return _cast_floating(out, self._output_dtype)

    def __repr__(self) -> str:
        return f"<polyamp policy {self.policy.name!r} forward of {type(self.module).__name__}>"


def remove_policy(module: torch.nn.Module) -> torch.nn.Module:
    """Undo `apply_policy` on ``module`` and its submodules (parameter dtypes are left as they are)."""
    for sub in module.modules():
        wrapper = sub.__dict__.get("forward")
        if isinstance(wrapper, _PolicyForward):
            if wrapper.previous is None:
                del sub.__dict__["forward"]
            else:
                sub.__dict__["forward"] = wrapper.previous
    return module


def module_policy(module: torch.nn.Module) -> Policy | None:
    """The policy `apply_policy` gave ``module`` itself, or None (it then runs under its parent's)."""
    wrapper = module.__dict__.get("forward")
    return wrapper.policy if isinstance(wrapper, _PolicyForward) else None


def apply_policy(
    module: torch.nn.Module,
    policy: PolicyLike | None = None,
    *,
    keep_float32: Iterable[str | torch.nn.Module] = (),
    overrides: OverridesLike | None = None,
    device_type: str | None = None,
) -> torch.nn.Module:
    """Run ``module`` under a policy, with per-submodule exceptions; modifies and returns ``module``.

    Calling ``module(...)`` then runs autocast in the policy's compute dtype and casts floating outputs
    (through tuples, lists, dicts, dataclass-like pytrees) to its output dtype; parameters and buffers are
    cast to its param dtype. Submodules matched by ``keep_float32`` run in float32: autocast off, floating
    inputs cast to float32, parameters float32. Submodules matched by ``overrides`` run under their own
    policy. A submodule inside a matched one inherits its policy unless it is matched itself. Applying
    again replaces the previous application.

    Do this before creating the optimizer: parameters keep their identity, but their dtype may change.

    Args:
        module: The model.
        policy: The model's policy; None uses ``polyamp.get_policy()`` now.
        keep_float32: Submodule names (as in ``named_modules()``), glob patterns over them
            (``"*norm*"``, ``"encoder.layers.*.attn"``), or submodule instances to keep in float32.
        overrides: Per-submodule policies (`polyamp.PolicyOverrides` or a mapping); None uses
            ``polyamp.get_policy_overrides()``. ``keep_float32`` wins where both match.
        device_type: Autocast device type; None takes it from the first input tensor at each call.

    Returns:
        ``module`` itself.

    Raises:
        PolyampTypeError: ``module`` is not an ``nn.Module``, or ``keep_float32`` holds something else than
            names, patterns and submodules.
        InvalidConfigError: a ``keep_float32`` instance is not a submodule of ``module``, or a name or
            pattern matches no submodule (a typo would otherwise silently keep nothing in float32).

    Example::

        model = polyamp_torch.apply_policy(model, "mixed_float16", keep_float32=["head", "*norm*"])
        with torch.no_grad():
            logits = model(x)                  # float32 logits; body in float16, head and norms in float32
    """
    if not isinstance(module, torch.nn.Module):
        raise PolyampTypeError(f"apply_policy() takes a torch.nn.Module. Received: {describe(module)}.")
    root_policy = polyamp.get_policy() if policy is None else Policy(policy)
    override_map = polyamp.get_policy_overrides() if overrides is None else PolicyOverrides(overrides)
    if isinstance(keep_float32, (str, torch.nn.Module)):
        keep_float32 = [keep_float32]
    named = list(module.named_modules())
    ids = {id(sub) for _, sub in named}
    keep_ids: set[int] = set()
    keep_patterns: list[str] = []
    for item in keep_float32:
        if isinstance(item, torch.nn.Module):
            if id(item) not in ids:
                raise InvalidConfigError(
                    f"keep_float32 holds a {type(item).__name__} that is not a submodule of the model passed "
                    "to apply_policy(). Pass submodules of that model (or their names)."
                )
            keep_ids.add(id(item))
        elif isinstance(item, str) and item:
            if not any(fnmatch.fnmatchcase(name, item) for name, _ in named if name):
                raise InvalidConfigError(
                    f"keep_float32 entry {item!r} matches no submodule name. Names look like "
                    f"{[name for name, _ in named if name][:5]}; patterns may use * and ?."
                )
            keep_patterns.append(item)
        else:
            raise PolyampTypeError(
                f"keep_float32 takes submodule names, glob patterns or submodule instances. Received: {describe(item)}."
            )
    float32 = Policy("float32")
    remove_policy(module)
    effective: dict[int, Policy] = {}
    for name, sub in named:
        if sub is module:
            own: Policy | None = root_policy
        elif id(sub) in keep_ids or any(fnmatch.fnmatchcase(name, p) for p in keep_patterns):
            own = float32
        else:
            own = override_map.match(name)
        if own is not None:
            sub.__dict__["forward"] = _PolicyForward(sub, own, device_type, is_root=sub is module)
        parent = name.rpartition(".")[0]
        effective[id(sub)] = own or effective[id(module.get_submodule(parent))]
    for _, sub in named:
        dtype = TORCH_DTYPES[effective[id(sub)].param_dtype]
        _cast_own_tensors(sub, dtype)
    return module


def _cast_own_tensors(module: torch.nn.Module, dtype: torch.dtype) -> None:
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            if param.dtype in _CASTABLE and param.dtype != dtype:
                param.data = param.data.to(dtype)
                if param.grad is not None:
                    param.grad = param.grad.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.dtype in _CASTABLE and buffer.dtype != dtype:
                module._buffers[name] = buffer.to(dtype)
