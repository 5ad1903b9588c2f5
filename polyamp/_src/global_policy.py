"""The policy in effect: `set_policy` (process-wide), `policy_scope` (context-local), `get_policy_setting`.

What code sees is one `PolicySetting` (policy, overrides and where they come from), read in one step:
the innermost open `policy_scope` of the calling context, else the process-wide setting of the last
`set_policy`. Scopes live in a ``contextvars`` variable, as ``decimal.localcontext`` does: per thread like
``torch.autocast`` and Keras's own scopes, and per asyncio task too. Scopes in different threads therefore
never see or undo each other.

Two kinds of code react to changes:

* backends with a global precision setting of their own declare a ``policy_hook`` in their `BackendSpec`;
  it is called as ``hook(policy, overrides)`` on every change (in the thread making it) if the framework
  is imported, or once it has been imported (see `import_hooks`), so the order of ``import keras`` and
  ``polyamp.set_policy(...)`` does not matter. Keras's hook makes Keras read `get_policy_setting` itself,
  so its layers follow in every thread;
* anything else can subscribe with `add_policy_listener`.

If a hook or listener raises, the previous setting is restored (and re-announced) and the error propagates.

Locks, and why there is no deadlock with an import running in another thread: `_lock` guards a few
dictionaries and is never held while importing or calling out. Announcements are serialized by
`_announcing`, and the only import made under it is a hook module whose framework is fully imported and
which is not itself half imported, so it never waits for another thread's import. A framework that is half
imported is left to `import_hooks.when_imported`, which calls back from the importing thread (or a helper
thread), never making this one wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

from polyamp._src import import_hooks, registry
from polyamp._src.errors import PolyampTypeError, describe
from polyamp._src.overrides import OverridesLike, PolicyOverrides
from polyamp._src.policy import Policy, PolicyLike

__all__ = [
    "PolicySetting",
    "add_policy_listener",
    "get_policy",
    "get_policy_overrides",
    "get_policy_setting",
    "policy_scope",
    "set_policy",
]

PolicyListener = Callable[[Policy], None]
PolicySource = Literal["default", "set_policy", "policy_scope"]
_SOURCES: tuple[PolicySource, ...] = ("default", "set_policy", "policy_scope")


@dataclass(frozen=True)
class PolicySetting:
    """The policy in effect and its per-layer overrides, read together (see `get_policy_setting`).

    Attributes:
        policy: The `Policy`.
        overrides: The per-layer `PolicyOverrides` that go with it.
        source: ``"policy_scope"`` inside a `policy_scope`, ``"set_policy"`` after a `set_policy`, else
            ``"default"`` (the float32 policy nobody chose; Keras then keeps its own default).

    Each `set_policy` and each `policy_scope` entry makes a new object, so ``is`` tells whether the
    setting changed since an earlier read even when the values are equal.
    """

    policy: Policy
    overrides: PolicyOverrides
    source: PolicySource

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise PolyampTypeError(f"PolicySetting.policy must be a polyamp.Policy. Received: {describe(self.policy)}.")
        if not isinstance(self.overrides, PolicyOverrides):
            raise PolyampTypeError(
                "PolicySetting.overrides must be a polyamp.backend_api.policies.PolicyOverrides. "
                f"Received: {describe(self.overrides)}."
            )
        if self.source not in _SOURCES:
            raise PolyampTypeError(
                f"PolicySetting.source must be one of {_SOURCES}. Received: {describe(self.source)}."
            )


_DEFAULT = PolicySetting(Policy("float32"), PolicyOverrides(), "default")


class _Scope:
    """One open (or closed) `policy_scope`: its setting and the scope it was entered in."""

    __slots__ = ("is_open", "parent", "setting")

    def __init__(self, setting: PolicySetting, parent: _Scope | None) -> None:
        self.setting = setting
        self.parent = parent
        self.is_open = True


# One reference, replaced whole: a read never sees one setting's policy with another's overrides.
_process: PolicySetting = _DEFAULT
# The innermost scope of each context. A context copied inside a scope (an asyncio task, asyncio.to_thread)
# keeps a reference to it after the scope ends, so readers skip closed scopes: a scope is in effect from
# entry to exit of its block, never longer.
_scoped: ContextVar[_Scope | None] = ContextVar("polyamp_policy_scope", default=None)
# How many scopes are open in the whole process. While none is, a read is one global load: cheap, and
# traceable by torch.compile, which cannot trace ContextVar.get (a compiled region that reads the policy
# while some scope is open falls back to running eagerly).
_open_scopes = 0

_lock = threading.RLock()  # guards the module's mutable state; never held while importing or calling out
_announcing = threading.RLock()  # one change is announced at a time, so hooks and listeners hear them in order
_listeners: list[PolicyListener] = []
_hooks: dict[str, Callable[[Policy, PolicyOverrides], Any]] = {}  # backend name -> loaded policy hook
_watching: set[str] = set()  # backend names waiting for an import to finish


def get_policy_setting() -> PolicySetting:
    """Return the policy and overrides in effect for the caller, in one consistent read.

    That is the innermost `policy_scope` entered in the calling thread or asyncio task, else the
    process-wide setting of the last `set_policy` (from any thread), else the default float32 policy.

    >>> import polyamp
    >>> with polyamp.policy_scope("mixed_bfloat16", overrides={"head": "float32"}):
    ...     setting = polyamp.get_policy_setting()
    >>> setting.policy.name, setting.overrides["head"].name, setting.source
    ('mixed_bfloat16', 'float32', 'policy_scope')
    """
    if not _open_scopes:
        return _process
    scope = _scoped.get()
    while scope is not None and not scope.is_open:
        scope = scope.parent
    return _process if scope is None else scope.setting


def get_policy() -> Policy:
    """Return the policy in effect for the caller: its innermost `policy_scope`, else the process-wide one.

    Threads: a `policy_scope` counts only in the thread or asyncio task that entered it (and in tasks and
    ``asyncio.to_thread`` calls started inside it, while it is open); the process-wide policy is the last
    `set_policy` from any thread. ``Policy("float32")`` until `set_policy` is called. To read the overrides
    too, use
    `get_policy_setting` (one read) rather than this and `get_policy_overrides` (two reads, between which
    another thread may change the setting).
    """
    return get_policy_setting().policy


def get_policy_overrides() -> PolicyOverrides:
    """Return the per-layer overrides in effect for the caller (empty until some are set).

    They go with `get_policy`'s policy; `get_policy_setting` reads both in one step.
    """
    return get_policy_setting().overrides


def set_policy(spec: PolicyLike, *, overrides: OverridesLike | None = None) -> Policy:
    """Make ``spec`` the process-wide policy and tell every framework that keeps one of its own.

    Threads: every thread sees it at once, threads started earlier included, except inside a
    `policy_scope` (which wins in its own thread or task until it ends). Keras layers built afterwards use
    it in every thread (float16 or bfloat16 compute, float32 variables for the mixed policies), whether
    ``keras`` is imported before or after this call; an explicit ``keras.config.set_dtype_policy(...)`` in
    a thread wins there until the next polyamp change. PyTorch has no global setting;
    ``polyamp_torch.autocast()`` reads `get_policy` when it is entered.

    It never imports a framework and never waits for another thread's import.

    Args:
        spec: A `Policy`, a policy name ("mixed_float16", ...) or a spec string.
        overrides: Per-layer policies by layer name or glob pattern (see `PolicyOverrides`), e.g.
            ``{"*norm*": "float32"}``. Replaces the previous overrides; None means none.

    Returns:
        The `Policy` now in effect process-wide.

    Raises:
        InvalidPolicyError / PolyampTypeError: ``spec`` or ``overrides`` is not valid; nothing changes.
    """
    global _process
    setting = PolicySetting(Policy(spec), PolicyOverrides(overrides), "set_policy")
    with _announcing:
        previous, _process = _process, setting
        try:
            _announce(setting)
        except BaseException:
            _process = previous
            _announce_quietly(previous)
            raise
    return setting.policy


@contextmanager
def policy_scope(spec: PolicyLike, *, overrides: OverridesLike | None = None) -> Iterator[Policy]:
    """Use ``spec`` (and ``overrides``) inside a ``with`` block or a decorated function, in this context only.

    Threads: the scope belongs to the thread that enters it, like ``torch.autocast``, and to the asyncio
    task that enters it (a ``contextvars`` variable); tasks and ``asyncio.to_thread`` calls started inside
    the block see it too, until the block ends. Other threads keep the process-wide policy, so scopes in
    different threads never see or undo each other. Keras layers built in this thread inside the block
    follow the scope. On exit the setting that was in effect here comes back, also when the block raises;
    if `set_policy` was called meanwhile (from any thread), that new process-wide setting is what comes back.

    >>> import polyamp
    >>> with polyamp.policy_scope("mixed_bfloat16") as policy:
    ...     polyamp.get_policy().compute_dtype
    'bfloat16'
    >>> polyamp.get_policy().name
    'float32'
    """
    setting = PolicySetting(Policy(spec), PolicyOverrides(overrides), "policy_scope")
    with _announcing:
        scope = _open(setting)
        try:
            _announce(setting)
        except BaseException:
            _close(scope)
            _announce_quietly(get_policy_setting())
            raise
    try:
        yield setting.policy
    finally:
        with _announcing:
            _close(scope)
            _announce(get_policy_setting())


def _open(setting: PolicySetting) -> _Scope:
    global _open_scopes
    scope = _Scope(setting, _scoped.get())
    with _lock:
        _open_scopes += 1
    _scoped.set(scope)
    return scope


def _close(scope: _Scope) -> None:
    global _open_scopes
    with _lock:
        scope.is_open = False
        _open_scopes -= 1
    # Back to the innermost scope still open here. Normally that is the closed scope's parent; after
    # out-of-order exits (two scopes entered by hand, the outer exited first) the inner one stays.
    innermost = _scoped.get()
    while innermost is not None and not innermost.is_open:
        innermost = innermost.parent
    _scoped.set(innermost)


def add_policy_listener(listener: PolicyListener) -> Callable[[], None]:
    """Call ``listener(policy)`` after every policy change; returns a function that unsubscribes.

    It is called in the thread making the change, with the policy that change put in effect there: the
    new process-wide policy for `set_policy`, the scope's policy on entering a `policy_scope`, the
    policy in effect again on leaving one. Changes are announced one at a time, in order, so a listener
    must not wait for another thread that changes the policy.
    """
    if not callable(listener):
        raise PolyampTypeError(f"add_policy_listener() takes a callable. Received: {describe(listener)}.")
    with _lock:
        _listeners.append(listener)

    def remove() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return remove


def _announce(setting: PolicySetting) -> None:
    for spec in registry.backend_specs().values():
        if spec.policy_hook is None:
            continue
        hook = _ready_hook(spec)
        if hook is not None:
            hook(setting.policy, setting.overrides)
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(setting.policy)


def _announce_quietly(setting: PolicySetting) -> None:
    try:
        _announce(setting)
    except Exception:  # restoring is best effort; the original error is the one to report
        pass


def _ready_hook(
    spec: registry.BackendSpec, *, imported: str | None = None
) -> Callable[[Policy, PolicyOverrides], Any] | None:
    """The spec's hook if it can be had without waiting for any import; else watch the import, return None.

    ``imported`` names a module known to be fully imported although importlib still marks it half
    imported (the callback that fires at the end of its own import).
    """
    with _lock:
        hook = _hooks.get(spec.name)
    if hook is not None:
        return hook
    states = {name: "imported" if name == imported else import_hooks.import_state(name) for name in spec.policy_modules}
    importing = [name for name, state in states.items() if state == "importing"]
    if importing:
        _watch(spec, importing)
        return None
    if "imported" not in states.values():
        _watch(spec, list(states))
        return None
    hook_module = spec.policy_hook.partition(":")[0] if spec.policy_hook else ""
    half_imported = [name for name in _packages_of(hook_module) if import_hooks.import_state(name) == "importing"]
    if half_imported:  # importing it here would wait for the thread importing it
        _watch(spec, half_imported[-1:])
        return None
    try:
        return _load_hook(spec)
    except RuntimeError as exc:
        # importlib's own deadlock detection: another thread began importing the hook module between the
        # check above and the import, and waits for a module this thread is importing. Let it finish.
        if type(exc).__name__ != "_DeadlockError":
            raise
        _watch(spec, [hook_module])
        return None


def _packages_of(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _load_hook(spec: registry.BackendSpec) -> Callable[[Policy, PolicyOverrides], Any]:
    assert spec.policy_hook is not None
    hook: Callable[[Policy, PolicyOverrides], Any] = registry.load_target(
        spec.policy_hook, backend=spec.name, install_hint=spec.install_hint, frameworks=spec.frameworks
    )
    with _lock:
        _hooks[spec.name] = hook
    return hook


def _watch(spec: registry.BackendSpec, modules: list[str]) -> None:
    with _lock:
        if spec.name in _watching:
            return
        _watching.add(spec.name)
    callback = _on_import(spec)
    for module in modules:
        import_hooks.when_imported(module, callback)


def _on_import(spec: registry.BackendSpec) -> import_hooks.Callback:
    def announce_current(module: object) -> None:
        with _lock:
            _watching.discard(spec.name)
        try:
            hook = _ready_hook(spec, imported=getattr(module, "__name__", None))
            if hook is None:  # something else is still being imported; _ready_hook watches it
                return
            # Not under _announcing: this may run inside an import, holding its import lock, and the
            # thread holding _announcing may be running a listener that imports that very module. Instead,
            # repeat until the setting did not change while the hook ran: the last call carries the latest.
            while True:
                setting = get_policy_setting()
                hook(setting.policy, setting.overrides)
                if get_policy_setting() is setting:
                    return
        except Exception:
            if get_policy_setting().source == "default":
                return  # nothing was asked of polyamp yet; the next set_policy loads the hook and reports
            raise

    return announce_current


def _watch_first_party_frameworks() -> None:
    """Watch for the imports of first-party frameworks with a policy hook from the start.

    Then an import that begins after ``import polyamp`` is always seen by the finder, and the hook runs in
    the importing thread before its ``import`` returns, even if `set_policy` runs in another thread while
    that import is under way.
    """
    for spec in registry._FIRST_PARTY:
        if spec.policy_hook is None:
            continue
        states = [import_hooks.import_state(name) for name in spec.policy_modules]
        if "imported" not in states:
            _watch(spec, [name for name, state in zip(spec.policy_modules, states, strict=True) if state != "imported"])


_watch_first_party_frameworks()
