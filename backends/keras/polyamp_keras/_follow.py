"""Keras's default dtype policy follows polyamp's, in every thread: the policy hook `follow_polyamp_policy`.

Keras 3 keeps its default dtype policy per thread. ``keras.config.set_dtype_policy`` stores it with
``global_state.set_global_attribute("dtype_policy", ...)`` in the calling thread's slot of a
``threading.local``, and ``keras.config.dtype_policy()`` (which every layer built without ``dtype=`` calls)
reads it back with ``global_state.get_global_attribute("dtype_policy")``, falling back to ``floatx`` in
threads that never set one. Setting Keras's policy on each polyamp change would reach only the thread
making the change, and only until ``keras.utils.clear_session()``.

So, once per process, polyamp interposes on those two accessors of Keras's global state for the one
attribute ``"dtype_policy"``, as the module defining ``keras.config.dtype_policy`` and
``keras.config.set_dtype_policy`` sees them: that module's ``global_state`` becomes a view of Keras's global
state whose two accessors ask polyamp first (every other attribute, and every other module of Keras, goes
to Keras's own functions untouched, so the hundreds of global-state reads of an eager Keras step cost what
they cost without polyamp). Keras then asks polyamp when a layer is built, in whatever thread builds it, and
gets `polyamp.get_policy_setting` for that thread: the thread's innermost ``polyamp.policy_scope``, else the
process-wide ``polyamp.set_policy``. The rule between the two settings, per thread, is that the later one
wins:

* ``keras.config.set_dtype_policy(...)`` (or ``keras.mixed_precision.set_global_policy``) in a thread wins
  in that thread, as Keras documents, for as long as the polyamp setting it was made under is in effect
  there; the next ``polyamp.set_policy`` (from any thread) or a ``policy_scope`` entered in that thread
  takes over again, and leaving that scope gives the Keras setting back;
* until polyamp has a setting at all, Keras keeps its own behaviour untouched.

Why this is robust: the accessors are found through the public ``keras.config.dtype_policy`` and
``keras.config.set_dtype_policy`` (the module they are defined in and the ``global_state`` it uses),
and are used only after checking that those functions really call them, so nothing depends on a private
import path. Both accessors and the attribute name have been the same since Keras 3.0. The view forwards to
Keras's module functions, which ``clear_session`` (it replaces the ``threading.local``) leaves in place, and the mark
telling which polyamp setting a Keras setting was made under is stored in the same per-thread state, so
``clear_session`` drops the two together. Should a future Keras store its policy differently, the hook
says so once (a ``RuntimeWarning``) and sets Keras's policy in the calling thread, as Keras alone would.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from keras.dtype_policies import DTypePolicy

import polyamp
from polyamp import Policy
from polyamp.backend_api.policies import PolicyOverrides, PolicySetting
from polyamp_keras import _float8_build
from polyamp_keras._keras import keras
from polyamp_keras._policies import to_keras_default

__all__ = ["follow_polyamp_policy"]

_ATTRIBUTE = "dtype_policy"  # the name Keras stores its default dtype policy under
_PIN = "polyamp_dtype_policy_made_under"  # beside it: the polyamp setting in effect when Keras's was made
_MARK = "__polyamp_follows__"

_lock = threading.RLock()
_state: ModuleType | None = None  # Keras's global_state module, once polyamp reads through it
_warned = False
_cache: dict[int, tuple[PolicySetting, DTypePolicy]] = {}  # id(setting) -> (setting, its Keras policy)
_CACHE_SIZE = 32


def follow_polyamp_policy(policy: Policy, overrides: PolicyOverrides) -> None:
    """polyamp's policy hook for Keras: make Keras's default dtype policy follow polyamp's, in every thread.

    polyamp calls it on every policy change, at once if keras is imported, else right after keras gets
    imported. Under a policy with an FP8 recipe, ``Dense`` / ``EinsumDense`` layers built from then on run
    FP8 (see ``polyamp_keras._float8_build``). The first call makes Keras ask polyamp whenever it needs its
    default policy (a layer built without ``dtype=``, ``keras.config.dtype_policy()``), in whatever thread
    asks, so later calls have nothing left to do; ``policy`` and ``overrides`` only matter where that is
    impossible (see below).

    What Keras gets, per thread: the policy of ``polyamp.get_policy_setting()`` there (the thread's
    innermost ``polyamp.policy_scope``, else the process-wide ``polyamp.set_policy``), as a Keras
    ``DTypePolicy`` or, with overrides, a `PolicyOverridesMap`; with Keras's own setting, the later wins:

    * ``keras.config.set_dtype_policy(...)`` (or ``keras.mixed_precision.set_global_policy``) in a thread
      holds in that thread, as Keras documents, while the polyamp setting it was made under is in effect
      there; the next ``polyamp.set_policy`` (from any thread) or a ``policy_scope`` entered in that thread
      takes over, and leaving that scope gives the Keras setting back;
    * until polyamp has a setting at all (``get_policy_setting().source == "default"``), Keras behaves as
      if polyamp were not there;
    * ``keras.utils.clear_session()`` drops Keras's settings, not polyamp's: Keras follows polyamp again.

    Should a future Keras keep its default policy where polyamp cannot find it, this warns once
    (``RuntimeWarning``) and sets Keras's policy in the calling thread only, as Keras alone would.
    """
    _float8_build.install(policy, overrides)
    if _follow():
        return
    if polyamp.get_policy_setting().source == "default":
        return  # nothing chosen yet (this runs when keras is imported): leave Keras as it is
    keras.config.set_dtype_policy(to_keras_default(policy, overrides))


def _follow() -> bool:
    """Make Keras read polyamp's setting (once per process); False where this Keras does not allow it."""
    global _state, _warned
    state = _state
    if state is not None and getattr(state, _MARK, False):
        return True
    with _lock:
        found = _keras_global_state()
        if found is None:
            if not _warned and polyamp.get_policy_setting().source != "default":
                _warned = True
                warnings.warn(
                    f"polyamp cannot find where Keras {keras.__version__} keeps its default dtype policy "
                    "(keras.config.dtype_policy no longer reads global_state.get_global_attribute). Keras "
                    "follows polyamp's policy only in the thread that sets it. Please report this, with "
                    "your Keras version, to polyamp.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return False
        module, state = found
        if not getattr(state, _MARK, False):
            state = _FollowingState(state)
            module.global_state = state  # type: ignore[attr-defined]  # Keras's module global, found above
        _state = state
    return True


def _keras_global_state() -> tuple[ModuleType, ModuleType] | None:
    """The module defining Keras's public policy getter and setter, and the global state it uses (Keras's
    module, or polyamp's view of it once made), if the getter and setter go through its accessors."""
    getter = getattr(keras.config, "dtype_policy", None) or getattr(keras.mixed_precision, "global_policy", None)
    setter = getattr(keras.config, "set_dtype_policy", None) or getattr(
        keras.mixed_precision, "set_global_policy", None
    )
    module = sys.modules.get(getattr(getter, "__module__", None) or "")
    state = getattr(module, "global_state", None)
    if not isinstance(state, ModuleType) or getattr(setter, "__module__", None) != module.__name__:  # type: ignore[union-attr]
        return None
    if not (
        callable(getattr(state, "get_global_attribute", None))
        and callable(getattr(state, "set_global_attribute", None))
    ):
        return None
    if not {"global_state", "get_global_attribute"} <= _names_used(getter):
        return None
    if not {"global_state", "set_global_attribute"} <= _names_used(setter):
        return None
    return module, state  # type: ignore[return-value]


def _names_used(function: object) -> set[str]:
    return set(getattr(getattr(function, "__code__", None), "co_names", ()))


class _FollowingState(ModuleType):
    """Keras's global-state module as Keras's default-policy getter and setter see it: its two accessors ask
    polyamp first for the one attribute ``"dtype_policy"``; everything else is Keras's module itself."""

    def __init__(self, state: ModuleType) -> None:
        super().__init__(state.__name__, state.__doc__)
        self.__wrapped__ = state
        original_get: Callable[..., Any] = state.get_global_attribute
        original_set: Callable[[str, Any], None] = state.set_global_attribute

        def get_global_attribute(name: str, default: Any = None, set_to_default: bool = False) -> Any:
            if name == _ATTRIBUTE:
                policy = _polyamp_default(original_get)
                if policy is not None:
                    return policy
            return original_get(name, default, set_to_default)

        def set_global_attribute(name: str, value: Any) -> None:
            original_set(name, value)
            if name == _ATTRIBUTE:
                original_set(_PIN, None if value is None else polyamp.get_policy_setting())

        self.get_global_attribute = functools.update_wrapper(get_global_attribute, original_get)
        self.set_global_attribute = functools.update_wrapper(set_global_attribute, original_set)
        setattr(self, _MARK, True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)


def _polyamp_default(original_get: Callable[..., Any]) -> DTypePolicy | None:
    """Keras's default policy in the calling thread, or None where Keras's own setting applies."""
    setting = polyamp.get_policy_setting()
    if setting.source == "default":
        return None  # polyamp has no setting: Keras as if polyamp were not there
    if original_get(_ATTRIBUTE) is not None and original_get(_PIN) is setting:
        return None  # this thread set Keras's policy under the setting still in effect: the later one wins
    return keras_policy_for(setting)


def keras_policy_for(setting: PolicySetting) -> DTypePolicy:
    """The Keras dtype policy layers built under ``setting`` get (the same object for as long as it holds)."""
    # One Keras object per setting: a layer built under a map may write its own entry into it (as with
    # Keras's own global DTypePolicyMap), and each polyamp setting starts from a fresh map.
    entry = _cache.get(id(setting))
    if entry is not None and entry[0] is setting:
        return entry[1]
    with _lock:
        entry = _cache.get(id(setting))
        if entry is not None and entry[0] is setting:
            return entry[1]
        policy = to_keras_default(setting.policy, setting.overrides)
        if len(_cache) >= _CACHE_SIZE:
            del _cache[next(iter(_cache))]
        _cache[id(setting)] = (setting, policy)
        return policy
