"""`autocast`: ``torch.autocast`` driven by a polyamp policy."""

from __future__ import annotations

import contextlib
import contextvars
from types import TracebackType
from typing import Any

import polyamp
from polyamp import Policy, PolicyLike, PolyampTypeError, PolyampValueError
from polyamp.backend_api import describe, type_error
from polyamp_torch import _cpu_float32
from polyamp_torch._framework import TORCH_DTYPES, torch

__all__ = ["PolicyRegion", "autocast", "default_device_type", "float16_regions_entered", "policy_in_effect"]

_default_device_type: list[str] = []

#: The policy of the innermost polyamp region entered in this thread / task (float32 for a disabled one).
_region_policy: contextvars.ContextVar[Policy | None] = contextvars.ContextVar("polyamp_torch_region", default=None)

#: How many regions computing in float16 were entered (a loss scaler that follows the policy checks it).
_float16_regions = [0]


def default_device_type() -> str:
    """ "cuda" when a CUDA device is available, else "cpu" (checked once per process)."""
    # A plain list cache, not functools.lru_cache, which torch.compile warns about on every compile.
    if not _default_device_type:
        _default_device_type.append("cuda" if torch.cuda.is_available() else "cpu")
    return _default_device_type[0]


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
    return Policy(policy)  # type: ignore[arg-type]


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
    checker = getattr(torch.amp, "is_autocast_available", None)
    try:
        available = checker is None or checker(name)
    except RuntimeError:  # not even a device type torch knows
        available = False
    if not available:
        raise PolyampValueError(
            f"torch.autocast does not support device_type={device_type!r}. Use 'cuda' or 'cpu' (or another "
            "device type your torch build supports), or leave device_type=None for cuda-if-available."
        )
    return name


def _is_compiling() -> bool:
    checker = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(checker()) if checker is not None else False


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
        if region.device_type != "cpu":
            return region.as_torch_autocast()
        low_precision = enabled and region.policy.compute_dtype != "float32"
        return _cpu_float32.compiled_region(region.as_torch_autocast(), low_precision and cpu_float32_ops)
    return region


_FLOAT32 = Policy("float32")


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
        device_type: "cuda", "cpu" (or a ``torch.device``); None picks "cuda" if available, else "cpu".
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

    Example::

        polyamp.set_policy("mixed_bfloat16")
        with polyamp_torch.autocast():
            logits = model(x)                  # linear layers in bfloat16
            loss = F.cross_entropy(logits, y)  # float32
            with polyamp_torch.autocast(enabled=False):
                exact = head(features.float())  # float32 region

        @polyamp_torch.autocast("mixed_float16")
        def forward(x): ...
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
        self._policy = _policy_argument(policy, dtype)
        self._device_type = _device_type(device_type)
        self._enabled = enabled
        self._cache_enabled = cache_enabled
        self._cpu_float32_ops = cpu_float32_ops
        # Per entry: the torch.autocast entered, for CPU regions the float32-op setting to restore, and the
        # token restoring the enclosing region's policy.
        self._entered: list[tuple[torch.autocast, bool | None, contextvars.Token[Policy | None]]] = []

    @property
    def policy(self) -> Policy:
        """The policy this region uses: the explicit one, or the policy in effect right now."""
        return self._policy if self._policy is not None else policy_in_effect()

    @property
    def device_type(self) -> str:
        """The device type this region applies to."""
        return self._device_type or default_device_type()

    def as_torch_autocast(self) -> torch.autocast:
        """The plain ``torch.autocast`` this region amounts to under the current policy."""
        return self._torch_autocast(self.policy if self._enabled else _FLOAT32)

    def _torch_autocast(self, policy: Policy) -> torch.autocast:
        compute = policy.compute_dtype
        if compute == "float32":
            return torch.autocast(self.device_type, enabled=False)
        kwargs: dict[str, Any] = {}
        if self._cache_enabled is not None:
            kwargs["cache_enabled"] = self._cache_enabled
        return torch.autocast(self.device_type, dtype=TORCH_DTYPES[compute], **kwargs)

    def __enter__(self) -> PolicyRegion:
        policy = self.policy if self._enabled else _FLOAT32
        region = self._torch_autocast(policy)
        low_precision = policy.compute_dtype != "float32"
        if policy.compute_dtype == "float16":
            _float16_regions[0] += 1
        region.__enter__()  # type: ignore[no-untyped-call]
        previous = None
        if self.device_type == "cpu":  # CUDA regions leave the CPU setting of an enclosing region alone
            previous = _cpu_float32.enter_region(low_precision and self._cpu_float32_ops)
        self._entered.append((region, previous, _region_policy.set(policy)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        region, previous, token = self._entered.pop()
        _region_policy.reset(token)
        if previous is not None:
            _cpu_float32.exit_region(previous)
        region.__exit__(exc_type, exc, traceback)

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
