"""`autocast`: ``torch.autocast`` driven by a polyamp policy."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import polyamp
from polyamp import Policy, PolyampTypeError, PolyampValueError
from polyamp.backend_api.arguments import describe, type_error
from polyamp.backend_api.policies import PolicyLike
from polyamp_torch import _cpu_float32
from polyamp_torch._framework import TORCH_DTYPES, torch

__all__ = [
    "PolicyRegion",
    "autocast",
    "default_device_type",
    "default_device_types",
    "float16_regions_entered",
    "policy_in_effect",
]

_default_device_types: list[tuple[str, ...]] = []

#: The policy of the innermost polyamp region entered in this thread / task (float32 for a disabled one).
_region_policy: contextvars.ContextVar[Policy | None] = contextvars.ContextVar("polyamp_torch_region", default=None)

#: How many regions computing in float16 were entered (a loss scaler that follows the policy checks it).
_float16_regions = [0]


def _accelerator() -> str | None:
    """The machine's accelerator device type: CUDA when available, else the one ``torch.accelerator`` reports
    (MPS, XPU, ...; torch >= 2.6), else MPS when available; None on a machine without one."""
    if torch.cuda.is_available():
        return "cuda"
    api = getattr(torch, "accelerator", None)
    if api is not None and hasattr(api, "is_available") and hasattr(api, "current_accelerator"):
        if not api.is_available():
            return None
        current = api.current_accelerator()
        return None if current is None else str(current.type)
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else None


def default_device_types() -> tuple[str, ...]:
    """The device types a region given ``device_type=None`` covers: the machine's accelerator (CUDA, or MPS,
    XPU, ... as ``torch.accelerator`` reports it) and the CPU, or the CPU alone on a machine without one.
    torch autocasts each op on the device its tensors are on, so a model on either device computes under the
    policy. Checked once per process."""
    # A plain list cache, not functools.lru_cache, which torch.compile warns about on every compile.
    if not _default_device_types:
        accelerator = _accelerator()
        _default_device_types.append(("cpu",) if accelerator is None else (accelerator, "cpu"))
    return _default_device_types[0]


def default_device_type() -> str:
    """The machine's accelerator device type (see `default_device_types`), else "cpu"."""
    return default_device_types()[0]


def policy_in_effect() -> Policy:
    """The policy a region or model given ``policy=None`` runs under: the innermost enclosing
    ``polyamp_torch.autocast`` region's (float32 for ``enabled=False``), else ``polyamp.get_policy()``."""
    if _is_compiling():  # compiled regions are plain torch.autocast regions; only the global policy is known
        return polyamp.get_policy()
    region = _region_policy.get()
    return polyamp.get_policy() if region is None else region


def float16_regions_entered() -> int:
    """How many polyamp regions computing in float16 this process has entered."""
    return _float16_regions[0]


def _policy_argument(policy: object, dtype: object) -> Policy | None:
    """A region's policy from ``policy`` or torch.autocast's ``dtype`` (the compute dtype)."""
    if dtype is not None:
        if policy is not None:
            raise PolyampTypeError(
                f"autocast() takes a policy or a dtype, not both. Received policy={policy!r} and dtype={dtype!r}."
            )
        policy = dtype
    if policy is None:
        return None
    if isinstance(policy, torch.dtype):
        # As in torch.autocast(dtype=...): the compute dtype, with float32 parameters and outputs.
        name = str(policy).removeprefix("torch.")
        if name not in TORCH_DTYPES:
            raise PolyampValueError(
                f"autocast(dtype=...) takes torch.float16, torch.bfloat16 or torch.float32. Received: {policy}."
            )
        return Policy(compute=name)
    if isinstance(policy, str):
        # A region is often made per step from the same name: parsed once (policies are immutable values).
        known = _NAMED_POLICIES.get(policy)
        if known is None:
            known = Policy(policy)
            if len(_NAMED_POLICIES) < 64:
                _NAMED_POLICIES[policy] = known
        return known
    return Policy(policy)  # type: ignore[arg-type]


_NAMED_POLICIES: dict[str, Policy] = {}


def _device_type(device_type: object) -> str | None:
    if device_type is None:
        return None
    if isinstance(device_type, torch.device):
        return device_type.type
    if not isinstance(device_type, str):
        raise type_error(
            "`device_type`", "None, a device type string such as 'cuda' or 'cpu', or a torch.device", device_type
        )
    name = device_type.partition(":")[0]
    if not _autocast_available(name):
        raise PolyampValueError(
            f"torch.autocast does not support device_type={device_type!r}. Use 'cuda' or 'cpu' (or another "
            "device type your torch build supports), or leave device_type=None for the machine's accelerator "
            "and the CPU."
        )
    return name


#: Device types torch.autocast supports, asked once per name: the question is a C++ builtin that some torch
#: releases' dynamo cannot trace (a graph break in every compiled region), and its answer never changes.
_autocast_support: dict[str, bool] = {}


def _autocast_available(name: str) -> bool:
    known = _autocast_support.get(name)
    if known is None:
        if _is_compiling():
            return True  # asked while tracing a name never seen eagerly: torch.autocast checks it on entry
        checker = getattr(torch.amp, "is_autocast_available", None)
        try:
            known = checker is None or bool(checker(name))
        except RuntimeError:  # not even a device type torch knows
            known = False
        _autocast_support[name] = known
    return known


_is_compiling = torch.compiler.is_compiling
_CPU_REGION = _cpu_float32.REGION_STATE


def autocast(
    policy: PolicyLike | torch.dtype | None = None,
    *,
    device_type: str | torch.device | None = None,
    enabled: bool = True,
    dtype: torch.dtype | None = None,
    cache_enabled: bool | None = None,
    cpu_float32_ops: bool = True,
) -> PolicyRegion | contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` with the dtype taken from a polyamp policy; a context manager and a decorator.

    Returns a `PolicyRegion` (see there for the arguments and semantics). Inside code being compiled by
    ``torch.compile`` it returns the equivalent ``torch.autocast`` instead (on CPU wrapped so that CUDA's
    float32 op list applies as in eager regions), which dynamo traces without graph breaks; there the
    policy is read when the region is created.
    """
    region = PolicyRegion(
        policy,
        device_type=device_type,
        enabled=enabled,
        dtype=dtype,
        cache_enabled=cache_enabled,
        cpu_float32_ops=cpu_float32_ops,
    )
    if _is_compiling():
        return region.compiled()
    return region


@contextlib.contextmanager
def _both(outer: Any, inner: Any) -> Iterator[None]:
    # A generator context manager of context managers dynamo traces: it traces through without a graph break.
    with outer, inner:
        yield


_FLOAT32 = Policy("float32")

_AutocastKey = tuple[str, str, "bool | None"]  # device type, compute dtype name, cache_enabled


def _new_autocast(key: _AutocastKey) -> torch.autocast:
    device_type, compute, cache_enabled = key
    if compute == "float32":
        return torch.autocast(device_type, enabled=False)
    if cache_enabled is None:
        return torch.autocast(device_type, dtype=TORCH_DTYPES[compute])
    return torch.autocast(device_type, dtype=TORCH_DTYPES[compute], cache_enabled=cache_enabled)


#: What entering a torch.autocast does, as torch.autocast.__enter__/__exit__ make the calls: a region enters
#: through these directly, without torch.autocast's Python methods around them (a region is entered every
#: step). Under a torch function mode (torch.export's pre-dispatch tracing
#: among them), which torch.autocast tells of its entry and exit, a region enters torch.autocast itself.
_autocast_enabled = torch.is_autocast_enabled
_set_autocast_enabled = torch.set_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype
_set_autocast_dtype = torch.set_autocast_dtype
_cache_enabled = torch.is_autocast_cache_enabled
_set_cache_enabled = torch.set_autocast_cache_enabled
_increment_nesting = torch.autocast_increment_nesting
_decrement_nesting = torch.autocast_decrement_nesting
_clear_cache = torch.clear_autocast_cache
_function_mode_enabled = torch._C._is_torch_function_mode_enabled

#: Per (device type or None for `default_device_types`, compute dtype name): for each device type the region
#: covers, the device, dtype (None: leave the one in effect, as a float32 region does) and enabled flag that
#: torch.autocast's constructor settles for it; and whether the CPU is among them. The constructor validates the
#: pair and may turn autocast off with a warning (CUDA autocast without CUDA, a dtype the device does not
#: autocast); it runs once per pair, and regions enter with what it settled.
_Plan = tuple[tuple[tuple[str, "torch.dtype | None", bool], ...], bool]
_PLANS: dict[tuple[str | None, str], _Plan] = {}


def _plan(device_type: str | None, compute: str) -> _Plan:
    """Makes and keeps the plan of a pair not in `_PLANS` (regions look there first)."""
    device_types = (device_type,) if device_type is not None else default_device_types()
    settled = []
    for name in device_types:
        made = _new_autocast((name, compute, None))
        settled.append((made.device, None if compute == "float32" else made.fast_dtype, bool(made._enabled)))
    plan = _PLANS[(device_type, compute)] = (tuple(settled), "cpu" in device_types)
    return plan


#: Per device type a region entered directly: the device, and the autocast-enabled flag, dtype and cache
#: setting its entry found (restored on exit, as torch.autocast restores them).
_Saved = tuple[str, bool, "torch.dtype", bool]


def _enter(device: str, dtype: torch.dtype | None, enabled: bool, cache_enabled: bool | None) -> _Saved:
    """What torch.autocast's entry does for ``device``, with the values its constructor settled (`_plan`);
    returns what `_leave` restores. A cache setting of None leaves the one in effect (torch.autocast sets it to
    the value it read)."""
    saved = (device, _autocast_enabled(device), _autocast_dtype(device), _cache_enabled())
    _set_autocast_enabled(device, enabled)
    if dtype is not None:
        _set_autocast_dtype(device, dtype)
    _increment_nesting()
    if cache_enabled is not None:
        _set_cache_enabled(cache_enabled)
    return saved


def _leave(saved: _Saved) -> None:
    """What torch.autocast's exit does: leaving the outermost autocast region drops the cast cache, and the
    settings `_enter` found are restored."""
    device, enabled, dtype, cache_enabled = saved
    if _decrement_nesting() == 0:
        _clear_cache()
    _set_autocast_enabled(device, enabled)
    _set_autocast_dtype(device, dtype)
    _set_cache_enabled(cache_enabled)


class PolicyRegion(contextlib.ContextDecorator):
    """``torch.autocast`` with the dtype taken from a polyamp policy; a context manager and a decorator.

    Inside the region, autocast-eligible ops (matmul, linear, conv, ...) run in the policy's compute dtype
    and precision-sensitive ones in float32, as ``torch.autocast(device_type, dtype=...)`` does. On CPU,
    where torch's autocast leaves softmax, log_softmax, layer/group norm and reductions in the low dtype,
    polyamp regions run CUDA's float32 op list too, so a model computes the same way on both devices
    (see `polyamp_torch.FLOAT32_OP_NAMES`). A policy computing in float32 turns autocast off, which also
    makes a float32 region inside an outer autocast region; so does ``enabled=False``.

    Args:
        policy: A `polyamp.Policy`, name or spec, or a ``torch.dtype`` (the compute dtype, as
            ``torch.autocast``'s ``dtype``: ``torch.bfloat16`` means ``"mixed_bfloat16"``). None (default)
            uses the policy in effect each time the region is entered: the enclosing polyamp region's, else
            ``polyamp.get_policy()`` (see `policy_in_effect`).
        device_type: "cuda", "cpu", "mps", ... (or a ``torch.device``): the device type whose ops autocast.
            None (default) covers the machine's accelerator and the CPU (`default_device_types`): ops autocast
            on whichever of them their tensors are on, so a model left on the CPU of a GPU machine is not
            silently run without autocast.
        enabled: False makes the region run in float32 (autocast off); regions and models inside it that
            follow the policy in effect run in float32 too.
        dtype: ``torch.autocast``'s spelling of a compute dtype, instead of ``policy``.
        cache_enabled: Forwarded to ``torch.autocast`` (None keeps torch's default).
        cpu_float32_ops: On CPU, run CUDA's float32 op list in float32 (default). False gives torch's CPU
            lists exactly, saving the listed ops' dispatch cost (a few us per listed op, nothing for other
            ops; see benchmarks/).

    Raises:
        InvalidPolicyError / PolyampTypeError: ``policy`` is invalid.
        PolyampValueError: torch.autocast does not support ``device_type``.

    Example:
        ```python
        polyamp.set_policy("mixed_bfloat16")
        with polyamp_torch.autocast():
            logits = model(x)                  # linear layers in bfloat16
            loss = F.cross_entropy(logits, y)  # float32
            with polyamp_torch.autocast(enabled=False):
                exact = head(features.float())  # float32 region

        @polyamp_torch.autocast("mixed_float16")
        def forward(x): ...
        ```
    """

    def __init__(
        self,
        policy: PolicyLike | torch.dtype | None = None,
        *,
        device_type: str | torch.device | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        cache_enabled: bool | None = None,
        cpu_float32_ops: bool = True,
    ) -> None:
        if not isinstance(enabled, bool):
            raise PolyampTypeError(f"`enabled` must be a bool. Received: enabled={describe(enabled)}.")
        if not isinstance(cpu_float32_ops, bool):
            raise PolyampTypeError(
                f"`cpu_float32_ops` must be a bool. Received: cpu_float32_ops={describe(cpu_float32_ops)}."
            )
        if cache_enabled is not None and not isinstance(cache_enabled, bool):
            raise PolyampTypeError(
                f"`cache_enabled` must be None or a bool. Received: cache_enabled={describe(cache_enabled)}."
            )
        # A region is often made per step: no policy (the one in effect), a policy name seen before and a device
        # type seen before are taken without a call; every other spelling goes through the checks.
        if policy is None and dtype is None:
            self._policy: Policy | None = None
        else:
            known = _NAMED_POLICIES.get(policy) if dtype is None and policy.__class__ is str else None
            self._policy = known if known is not None else _policy_argument(policy, dtype)
        if device_type is None or (isinstance(device_type, str) and _autocast_support.get(device_type)):
            self._device_type: str | None = device_type
        else:
            self._device_type = _device_type(device_type)
        self._enabled = enabled
        self._cache_enabled = cache_enabled
        self._cpu_float32_ops = cpu_float32_ops
        # What an entry enters, worked out once: the policy and its compute dtype (float32 for a disabled region),
        # or None for the policy in effect at entry (`_policy_entered`).
        entry_policy = self._policy if enabled else _FLOAT32
        self._entry = None if entry_policy is None else (entry_policy, entry_policy.compute_dtype)
        # Per entry: what the entry found (one device type's `_Saved`; for several, or under a torch function
        # mode the torch.autocast regions entered, a list), for regions covering the CPU the float32-op setting
        # to restore, and the token restoring the enclosing region's policy.
        self._entered: list[
            tuple[_Saved | list[_Saved | torch.autocast], bool | None, contextvars.Token[Policy | None]]
        ] = []

    @property
    def policy(self) -> Policy:
        """The policy this region uses: the explicit one, or the policy in effect right now."""
        return self._policy if self._policy is not None else policy_in_effect()

    @property
    def device_type(self) -> str:
        """The device type this region applies to: the one given, else the machine's accelerator ("cpu"
        without one). A region given none also covers the CPU (`device_types`)."""
        return self._device_type or default_device_type()

    @property
    def device_types(self) -> tuple[str, ...]:
        """Every device type this region autocasts: the one given, else `default_device_types`."""
        return (self._device_type,) if self._device_type is not None else default_device_types()

    def as_torch_autocast(self) -> torch.autocast:
        """The plain ``torch.autocast`` this region amounts to under the current policy, for `device_type`."""
        return self._torch_autocast(self._policy_entered(), self.device_type)

    def compiled(self) -> contextlib.AbstractContextManager[Any]:
        """The region in the form ``torch.compile`` traces without graph breaks: ``torch.autocast`` per device
        type, the CPU's with CUDA's float32 op list on or off inside as in eager regions. The policy is read
        now."""
        policy = self._policy_entered()
        regions: list[contextlib.AbstractContextManager[Any]] = []
        low_precision = policy.compute_dtype != "float32"
        for device_type in self.device_types:
            region = self._torch_autocast(policy, device_type)
            if device_type == "cpu":
                regions.append(_cpu_float32.compiled_region(region, low_precision and self._cpu_float32_ops))
            else:
                regions.append(region)
        return regions[0] if len(regions) == 1 else _both(*regions)

    def _policy_entered(self) -> Policy:
        """The policy an entry now enters: float32 for a disabled region, else `policy`."""
        return policy_in_effect() if self._entry is None else self._entry[0]

    def _torch_autocast(self, policy: Policy, device_type: str) -> torch.autocast:
        return _new_autocast((device_type, policy.compute_dtype, self._cache_enabled))

    def __enter__(self) -> PolicyRegion:
        # Entered every step: straight-line code for one device type, the common case.
        entry = self._entry  # `_policy_entered`, with its compute dtype
        if entry is None:
            policy = policy_in_effect()
            compute = policy.compute_dtype
        else:
            policy, compute = entry
        device_type = self._device_type
        settled, covers_cpu = _PLANS.get((device_type, compute)) or _plan(device_type, compute)
        entered: _Saved | list[_Saved | torch.autocast]
        if _function_mode_enabled():
            entered = []
            for device, _, _ in settled:
                region = _new_autocast((device, compute, self._cache_enabled))
                region.__enter__()  # type: ignore[no-untyped-call]
                entered.append(region)
        elif len(settled) == 1:
            entered = _enter(*settled[0], self._cache_enabled)
        else:
            entered = [_enter(*each, self._cache_enabled) for each in settled]
        if compute == "float16":
            _float16_regions[0] += 1
        previous = None
        if covers_cpu:  # CUDA-only regions leave the CPU setting of an enclosing region alone
            active = compute != "float32" and self._cpu_float32_ops
            if active or _CPU_REGION.active:  # (off where it is off already: nothing to set or restore)
                previous = _cpu_float32.enter_region(active)
        self._entered.append((entered, previous, _region_policy.set(policy)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        entered, previous, token = self._entered.pop()
        _region_policy.reset(token)
        if previous is not None:
            _cpu_float32.exit_region(previous)
        if isinstance(entered, tuple):
            _leave(entered)
            return
        for each in reversed(entered):
            if isinstance(each, tuple):
                _leave(each)
            else:
                each.__exit__(exc_type, exc, traceback)

    def _recreate_cm(self) -> PolicyRegion:
        # A decorated function gets a fresh region per call, so recursion and threads never share state.
        fresh = PolicyRegion.__new__(PolicyRegion)
        fresh.__dict__.update(self.__dict__)
        fresh._entered = []
        return fresh

    def __repr__(self) -> str:
        policy = "None (global)" if self._policy is None else repr(self._policy.name)
        return (
            f"polyamp_torch.PolicyRegion(policy={policy}, device_type={self._device_type!r}, enabled={self._enabled})"
        )


# Asked once now, eagerly, for the device types regions name most, so that a region first made inside
# torch.compile's trace finds the answer without calling into torch.
for _name in ("cpu", "cuda"):
    _autocast_available(_name)
del _name
