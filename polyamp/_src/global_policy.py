"""The process-wide policy: `set_policy`, `get_policy`, `policy_scope`, and how frameworks hear of changes.

There is one global policy per process, as in Keras (its global dtype policy is process-wide too, so a
per-thread polyamp policy could not be kept in step with it). Two kinds of code react to a change:

* backends with a global precision setting of their own declare a ``policy_hook`` in their `BackendSpec`;
  it is called as ``hook(policy, overrides)`` now if the framework is imported, or right after it gets imported (see `import_hooks`), so the
  order of ``import keras`` and ``polyamp.set_policy(...)`` does not matter;
* anything else can subscribe with `add_policy_listener`.

If a hook or listener raises, the previous policy is restored (and re-announced) and the error propagates.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from polyamp._src import import_hooks, registry
from polyamp._src.errors import PolyampTypeError, describe
from polyamp._src.overrides import OverridesLike, PolicyOverrides
from polyamp._src.policy import Policy, PolicyLike

__all__ = ["add_policy_listener", "get_policy", "get_policy_overrides", "policy_scope", "set_policy"]

PolicyListener = Callable[[Policy], None]

_lock = threading.RLock()
_current = Policy("float32")
_current_overrides = PolicyOverrides()
_listeners: list[PolicyListener] = []
_hooks: dict[str, Callable[[Policy, PolicyOverrides], Any]] = {}  # backend name -> loaded policy hook
_watching: set[str] = set()  # backend names waiting for their framework's import


def get_policy() -> Policy:
    """Return the global policy (``Policy("float32")`` until `set_policy` is called)."""
    return _current


def get_policy_overrides() -> PolicyOverrides:
    """Return the global per-layer overrides (empty until `set_policy` is given some)."""
    return _current_overrides


def set_policy(spec: PolicyLike, *, overrides: OverridesLike | None = None) -> Policy:
    """Make ``spec`` the global policy and tell every framework that keeps one of its own.

    Keras layers built afterwards use it (float16 or bfloat16 compute, float32 variables for the mixed
    policies), whether ``keras`` is imported before or after this call. PyTorch has no global setting;
    ``polyamp_torch.autocast()`` reads this policy when it is entered.

    Args:
        spec: A `Policy`, a policy name ("mixed_float16", ...) or a spec string.
        overrides: Per-layer policies by layer name or glob pattern (see `PolicyOverrides`), e.g.
            ``{"*norm*": "float32"}``. Replaces the previous overrides; None means none.

    Returns:
        The `Policy` now in effect.

    Raises:
        InvalidPolicyError / PolyampTypeError: ``spec`` is not a valid policy; nothing changes.
    """
    policy = Policy(spec)
    _apply(policy, PolicyOverrides(overrides))
    return policy


@contextmanager
def policy_scope(spec: PolicyLike, *, overrides: OverridesLike | None = None) -> Iterator[Policy]:
    """Use ``spec`` as the global policy inside a ``with`` block (or a decorated function).

    The previous policy and overrides come back on exit, also when the block raises.

    >>> import polyamp
    >>> with polyamp.policy_scope("mixed_bfloat16") as policy:
    ...     polyamp.get_policy().compute_dtype
    'bfloat16'
    >>> polyamp.get_policy().name
    'float32'
    """
    policy = Policy(spec)
    new_overrides = PolicyOverrides(overrides)
    with _lock:
        previous = (_current, _current_overrides)
        _apply(policy, new_overrides)
    try:
        yield policy
    finally:
        _apply(*previous)


def add_policy_listener(listener: PolicyListener) -> Callable[[], None]:
    """Call ``listener(policy)`` after every global policy change; returns a function that unsubscribes."""
    if not callable(listener):
        raise PolyampTypeError(f"add_policy_listener() takes a callable. Received: {describe(listener)}.")
    with _lock:
        _listeners.append(listener)

    def remove() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return remove


def _apply(policy: Policy, overrides: PolicyOverrides) -> None:
    global _current, _current_overrides
    with _lock:
        previous = (_current, _current_overrides)
        _current, _current_overrides = policy, overrides
        try:
            _announce(policy, overrides)
        except BaseException:
            _current, _current_overrides = previous
            try:
                _announce(*previous)
            except Exception:  # restoring is best effort; the original error is the one to report
                pass
            raise


def _announce(policy: Policy, overrides: PolicyOverrides) -> None:
    for spec in registry.backend_specs().values():
        if spec.policy_hook is None:
            continue
        hook = _hooks.get(spec.name)
        if hook is None and any(m in sys.modules for m in spec.policy_modules):
            hook = _load_hook(spec)
        if hook is not None:
            hook(policy, overrides)
        elif spec.name not in _watching:
            _watching.add(spec.name)
            for module in spec.policy_modules:
                import_hooks.when_imported(module, _on_framework_import(spec))
    for listener in list(_listeners):
        listener(policy)


def _load_hook(spec: registry.BackendSpec) -> Callable[[Policy, PolicyOverrides], Any]:
    assert spec.policy_hook is not None
    hook: Callable[[Policy, PolicyOverrides], Any] = registry.load_target(
        spec.policy_hook, backend=spec.name, install_hint=spec.install_hint, frameworks=spec.frameworks
    )
    _hooks[spec.name] = hook
    return hook


def _on_framework_import(spec: registry.BackendSpec) -> import_hooks.Callback:
    def apply_current(_module: object) -> None:
        with _lock:
            _watching.discard(spec.name)
            hook = _hooks.get(spec.name) or _load_hook(spec)
            hook(_current, _current_overrides)

    return apply_current
