"""Per-module precision for PyTorch: a policy on a model, outputs in the output dtype, float32 islands.

``torch.autocast`` has one dtype per region and no per-module override. `apply_policy` gives a model:

* its forward run under the policy (``polyamp_torch.autocast``) with floating outputs cast to the
  policy's output dtype (float32 for the mixed policies);
* parameters and buffers in the policy's param dtype;
* chosen submodules (by name, glob pattern or instance, or through
  `polyamp.backend_api.policies.PolicyOverrides`) run under their own policy: for float32 that is autocast off with their floating inputs cast to float32.

It works by giving each affected module an instance-level ``forward`` (a picklable callable object), so
``state_dict`` keys, hooks, ``torch.save`` / ``copy.deepcopy`` and wrapping in DDP are unaffected. That
object carries the module's forward signature (``__signature__``, ``__wrapped__``), so code inspecting
``model.forward`` (Hugging Face's ``Trainer`` choosing dataset columns) sees the module's own parameters.
"""

from __future__ import annotations

import fnmatch
import inspect
import warnings
from collections.abc import Iterable
from typing import Any

from torch.utils import _pytree as pytree

import polyamp
import polyamp.backend_api
from polyamp import Float8Recipe, Policy, PolyampTypeError, PolyampValueError
from polyamp.backend_api.arguments import describe
from polyamp.backend_api.policies import OverridesLike, PolicyLike, PolicyOverrides
from polyamp_torch import _float8
from polyamp_torch._autocast import autocast, default_device_type, policy_in_effect
from polyamp_torch._distributed import is_dtensor
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
    """A module's forward, run under a policy. Held in the module's ``__dict__`` (so it pickles with it).

    ``policy`` None means the policy in effect at each call (`polyamp_torch.policy_in_effect`), with
    parameters cast for ``param_dtype`` when the policy was applied.
    """

    def __init__(
        self, module: torch.nn.Module, policy: Policy | None, device_type: str | None, is_root: bool, param_dtype: str
    ) -> None:
        self.module = module
        self.policy = policy
        self.device_type = device_type
        self.is_root = is_root
        self.param_dtype = param_dtype
        self.previous = module.__dict__.get("forward")  # an instance forward someone else installed
        self._warned = False

    @property
    def __wrapped__(self) -> Any:
        """The forward this one runs: the module's class ``forward`` bound to it, or the instance forward that
        was installed before. ``inspect.unwrap`` and tools following wrapper chains find it here."""
        if self.previous is not None:
            return self.previous
        return type(self.module).forward.__get__(self.module, type(self.module))

    @property
    def __signature__(self) -> inspect.Signature | None:
        """The wrapped forward's signature, so ``inspect.signature(model.forward)`` is the module's own.

        Libraries read it to decide what to pass: Hugging Face's ``Trainer`` keeps only the dataset columns
        the forward names. None (``inspect`` then falls back to ``__call__``) if it has no signature.
        """
        try:
            return inspect.signature(self.__wrapped__)
        except (TypeError, ValueError):  # a builtin or C-implemented forward without one
            return None

    def _current_policy(self) -> Policy:
        if self.policy is not None:
            return self.policy
        policy = policy_in_effect()
        if policy.param_dtype != self.param_dtype and not self._warned:
            self._warned = True
            warnings.warn(
                f"{type(self.module).__name__} follows the policy in effect, now {policy.name!r}, which keeps "
                f"{policy.param_dtype} parameters; apply_policy() cast them to {self.param_dtype} for the policy "
                "in effect then. Call polyamp_torch.apply_policy(model) again to cast them (before creating the "
                "optimizer).",
                UserWarning,
                stacklevel=4,
            )
        return policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = self._current_policy()
        device_type = self.device_type or _first_device_type((args, kwargs)) or default_device_type()
        if policy.compute_dtype == "float32":
            args, kwargs = _cast_floating((args, kwargs), torch.float32)
        with autocast(policy, device_type=device_type):
            if self.previous is not None:
                out = self.previous(*args, **kwargs)
            else:
                out = type(self.module).forward(self.module, *args, **kwargs)
        return _cast_floating(out, TORCH_DTYPES[policy.output_dtype])

    def __repr__(self) -> str:
        name = "the policy in effect" if self.policy is None else repr(self.policy.name)
        return f"<polyamp policy {name} forward of {type(self.module).__name__}>"


def remove_policy(module: torch.nn.Module) -> torch.nn.Module:
    """Undo `apply_policy` on ``module`` and its submodules (parameter dtypes are left as they are; FP8 layers
    become ``nn.Linear`` again)."""
    for sub in module.modules():
        _float8.restore(sub)
        wrapper = sub.__dict__.get("forward")
        if isinstance(wrapper, _PolicyForward):
            if wrapper.previous is None:
                del sub.__dict__["forward"]
            else:
                sub.__dict__["forward"] = wrapper.previous
    return module


def module_policy(module: torch.nn.Module) -> Policy | None:
    """The policy `apply_policy` gave ``module`` itself (the policy in effect right now for a model applied
    with ``policy=None``), or None (it then runs under its parent's)."""
    wrapper = module.__dict__.get("forward")
    if not isinstance(wrapper, _PolicyForward):
        return None
    return wrapper.policy if wrapper.policy is not None else policy_in_effect()


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
    again replaces the previous application. ``inspect.signature(module.forward)`` stays the module's own,
    so libraries that read it (Hugging Face's ``Trainer``) pass the same arguments as before.

    Do this before creating the optimizer: parameters keep their identity, but their dtype may change.

    Args:
        module: The model.
        policy: The model's policy; None follows the policy in effect at each call, as
            ``polyamp_torch.autocast()`` does: the enclosing polyamp region's (float32 inside
            ``autocast(enabled=False)``), else ``polyamp.get_policy()``. Parameters are cast for the policy
            in effect now; a later policy with another parameter dtype warns once.
        keep_float32: Submodule names (as in ``named_modules()``), glob patterns over them
            (``"*norm*"``, ``"encoder.layers.*.attn"``), or submodule instances to keep in float32.
        overrides: Per-submodule policies (`polyamp.backend_api.policies.PolicyOverrides` or a mapping); None uses
            ``polyamp.backend_api.policies.get_policy_overrides()``. ``keep_float32`` wins where both match.
        device_type: Autocast device type; None takes it from the first input tensor at each call.

    Returns:
        ``module`` itself.

    Raises:
        PolyampTypeError: ``module`` is not an ``nn.Module``, or ``keep_float32`` holds something else than
            names, patterns and submodules.
        PolyampValueError: a ``keep_float32`` instance is not a submodule of ``module``, or a name or
            pattern matches no submodule (a typo would otherwise silently keep nothing in float32), or a
            sharded (DTensor) parameter would change dtype: apply the policy before ``fully_shard``.

    With FSDP2, apply the policy before or after ``fully_shard``: both compose as long as no sharded
    parameter changes dtype (under the mixed policies they stay float32); a policy that casts parameters
    goes before ``fully_shard``.

    A parameter shared by submodules that would get different parameter dtypes (e.g. an embedding tied to
    a head kept in float32 under a bfloat16-parameter policy) stays in the widest of them, with a warning.

    Example:
        ```python
        model = polyamp_torch.apply_policy(model, "mixed_float16", keep_float32=["head", "*norm*"])
        with torch.no_grad():
            logits = model(x)                  # float32 logits; body in float16, head and norms in float32
        ```
    """
    if not isinstance(module, torch.nn.Module):
        raise PolyampTypeError(f"apply_policy() takes a torch.nn.Module. Received: {describe(module)}.")
    fixed_policy = None if policy is None else Policy(policy)
    setting = polyamp.get_policy_setting()  # policy and overrides in one read (another thread may set_policy)
    root_policy = fixed_policy if fixed_policy is not None else policy_in_effect()
    override_map = setting.overrides if overrides is None else PolicyOverrides(overrides)
    if isinstance(keep_float32, (str, torch.nn.Module)):
        keep_float32 = [keep_float32]
    named = list(module.named_modules())
    ids = {id(sub) for _, sub in named}
    keep_ids: set[int] = set()
    keep_patterns: list[str] = []
    for item in keep_float32:
        if isinstance(item, torch.nn.Module):
            if id(item) not in ids:
                raise PolyampValueError(
                    f"keep_float32 holds a {type(item).__name__} that is not a submodule of the model passed "
                    "to apply_policy(). Pass submodules of that model (or their names)."
                )
            keep_ids.add(id(item))
        elif isinstance(item, str) and item:
            if not any(fnmatch.fnmatchcase(name, item) for name, _ in named if name):
                raise PolyampValueError(
                    f"keep_float32 entry {item!r} matches no submodule name. Names look like "
                    f"{[name for name, _ in named if name][:5]}; patterns may use * and ?."
                )
            keep_patterns.append(item)
        else:
            raise PolyampTypeError(
                f"keep_float32 takes submodule names, glob patterns or submodule instances. Received: {describe(item)}."
            )
    float32 = Policy("float32")
    effective: dict[int, Policy] = {}
    names: dict[int, str] = {}
    owns: list[tuple[torch.nn.Module, Policy]] = []
    for name, sub in named:
        if sub is module:
            own: Policy | None = root_policy
        elif id(sub) in keep_ids or any(fnmatch.fnmatchcase(name, p) for p in keep_patterns):
            own = float32
        else:
            own = override_map.match(name)
        if own is not None:
            owns.append((sub, own))
        parent = name.rpartition(".")[0]
        effective[id(sub)] = own or effective[id(module.get_submodule(parent))]
        names[id(sub)] = name or type(module).__name__
    _refuse_sharded_casts(named, effective, names)
    converted = _float8_layers(named, effective)
    remove_policy(module)
    for sub, recipe in converted:
        _float8.convert(sub, recipe)  # type: ignore[arg-type]
    for sub, own in owns:
        follows = sub is module and fixed_policy is None
        sub.__dict__["forward"] = _PolicyForward(
            sub, None if follows else own, device_type, is_root=sub is module, param_dtype=own.param_dtype
        )
    _cast_parameters(named, effective, names)
    return module


def _float8_layers(
    named: list[tuple[str, torch.nn.Module]], effective: dict[int, Policy]
) -> list[tuple[torch.nn.Module, Float8Recipe]]:
    """The ``nn.Linear`` layers whose policy's FP8 recipe takes them, with the recipe. A layer the recipe's
    patterns select but that must stay in the compute dtype is named in one warning; a sharded one (FSDP2)
    is refused before anything changes, since its class and parameters belong to ``fully_shard``."""
    converted: list[tuple[torch.nn.Module, Float8Recipe]] = []
    staying: list[str] = []
    for name, sub in named:
        recipe = effective[id(sub)].float8
        if recipe is None or not isinstance(sub, torch.nn.Linear) or not recipe.selects(name):
            continue
        if is_dtensor(sub.weight) or _is_fsdp_module(sub):
            raise PolyampValueError(
                f"apply_policy() cannot make the sharded nn.Linear {name!r} an FP8 layer: fully_shard() owns its "
                "class and parameters. Call apply_policy() with the FP8 policy before fully_shard(); FSDP2 then "
                "shards and gathers the FP8 layers' parameters as any other."
            )
        reason = float8_skip_reason(sub, name, recipe)
        if reason is None:
            converted.append((sub, recipe))
        else:
            staying.append(f"{name or type(sub).__name__!r} ({reason})")
    if staying:
        warnings.warn(
            f"{len(staying)} nn.Linear layer{'s' if len(staying) > 1 else ''} selected by the FP8 recipe "
            f"stay{'' if len(staying) > 1 else 's'} in the compute dtype: {', '.join(staying)}. To run them in "
            "FP8, pad their dimensions to the recipe's alignment (a subclass with a forward of its own is never "
            "converted); to keep them out on purpose, name them in the recipe's skip patterns (e.g. "
            "'float8_rowwise[skip=head]').",
            UserWarning,
            stacklevel=3,
        )
    return converted


def _is_fsdp_module(sub: torch.nn.Module) -> bool:
    return any(cls.__name__ == "FSDPModule" for cls in type(sub).__mro__)


def float8_skip_reason(sub: torch.nn.Module, name: str, recipe: Float8Recipe) -> str | None:
    """Why ``sub`` (named ``name``) does not run ``recipe``, or None when it does."""
    if not isinstance(sub, torch.nn.Linear):
        return "not an nn.Linear"
    if type(sub) not in (torch.nn.Linear, _float8.Float8Linear):
        return f"a subclass of nn.Linear ({type(sub).__name__}) with a forward of its own"
    return recipe.skip_reason(name, sub.in_features, sub.out_features)


def _refuse_sharded_casts(
    named: list[tuple[str, torch.nn.Module]], effective: dict[int, Policy], names: dict[int, str]
) -> None:
    """Raise, before anything changes, if a DTensor parameter (FSDP2, tensor parallel) would change dtype:
    assigning ``param.data`` would detach it from the sharding that FSDP2 all-gathers from."""
    for _, sub in named:
        dtype = TORCH_DTYPES[effective[id(sub)].param_dtype]
        for param_name, param in sub.named_parameters(recurse=False):
            if is_dtensor(param) and param.dtype in _CASTABLE and param.dtype != dtype:
                raise PolyampValueError(
                    f"apply_policy() would cast the sharded (DTensor) parameter {names[id(sub)]}.{param_name} from "
                    f"{param.dtype} to {dtype}; FSDP2 and tensor parallelism own the storage of sharded "
                    "parameters, so polyamp does not replace it. Call apply_policy() before fully_shard() (the "
                    "shards then hold the policy's param dtype), or keep the parameters in their dtype and give "
                    "FSDP2 the compute dtype: fully_shard(module, mp_policy=polyamp_torch.fsdp_mixed_precision(policy))."
                )


_WIDTH = {"float32": 2, "bfloat16": 1, "float16": 0}


def _cast_parameters(
    named: list[tuple[str, torch.nn.Module]], effective: dict[int, Policy], names: dict[int, str]
) -> None:
    """Cast each module's own tensors to its policy's param dtype; a tied parameter takes the widest."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for _, sub in named:
        for param in sub.parameters(recurse=False):
            owners.setdefault(id(param), []).append((names[id(sub)], effective[id(sub)].param_dtype))
    for _, sub in named:
        dtype = effective[id(sub)].param_dtype
        with torch.no_grad():
            for param in sub.parameters(recurse=False):
                wanted = {d for _, d in owners[id(param)]}
                chosen = max(wanted, key=_WIDTH.__getitem__)
                if len(wanted) > 1 and dtype == chosen:
                    listed = ", ".join(f"{owner!r} ({d})" for owner, d in owners[id(param)])
                    warnings.warn(
                        f"A parameter of shape {tuple(param.shape)} is shared by modules with different parameter "
                        f"dtypes: {listed}. It stays {chosen} for all of them (the widest).",
                        UserWarning,
                        stacklevel=3,
                    )
                _cast_tensor(param, TORCH_DTYPES[chosen])
            for buffer_name, buffer in sub.named_buffers(recurse=False):
                if buffer_name.startswith("float8_"):  # FP8 amax histories and scales stay float32
                    continue
                if buffer.dtype in _CASTABLE and buffer.dtype != TORCH_DTYPES[dtype]:
                    sub._buffers[buffer_name] = buffer.to(TORCH_DTYPES[dtype])


def _cast_tensor(param: torch.nn.Parameter, dtype: torch.dtype) -> None:
    if param.dtype in _CASTABLE and param.dtype != dtype:
        param.data = param.data.to(dtype)
        if param.grad is not None:
            param.grad = param.grad.to(dtype)
