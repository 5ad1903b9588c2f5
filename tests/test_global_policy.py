"""The global policy, policy_scope, listeners, and framework hooks in either import order."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

import pytest

import polyamp
import polyamp.backend_api
from polyamp import InvalidPolicyError, Policy

if TYPE_CHECKING:
    from conftest import FakeFramework


def test_default_policy_is_float32() -> None:
    assert polyamp.get_policy() == Policy("float32")


def test_set_policy_returns_and_installs_the_parsed_policy() -> None:
    assert polyamp.set_policy("mixed_float16") == Policy("mixed_float16")
    assert polyamp.get_policy().compute_dtype == "float16"
    polyamp.set_policy(Policy("c=bf16"))
    assert polyamp.get_policy() == Policy("params=float32,compute=bfloat16,output=float32")


def test_bad_policy_leaves_the_global_policy_unchanged() -> None:
    polyamp.set_policy("mixed_bfloat16")
    with pytest.raises(InvalidPolicyError):
        polyamp.set_policy("mixed_float61")
    with pytest.raises(TypeError):
        polyamp.set_policy(16)  # type: ignore[arg-type]
    assert polyamp.get_policy() == Policy("mixed_bfloat16")


def test_policy_scope_restores_on_exit_and_on_exception() -> None:
    polyamp.set_policy("mixed_bfloat16")
    with polyamp.policy_scope("mixed_float16") as inner:
        assert inner == polyamp.get_policy() == Policy("mixed_float16")
        with polyamp.policy_scope("float16"):
            assert polyamp.get_policy() == Policy("float16")
        assert polyamp.get_policy() == Policy("mixed_float16")
    assert polyamp.get_policy() == Policy("mixed_bfloat16")
    with pytest.raises(ZeroDivisionError), polyamp.policy_scope("float16"):
        1 / 0  # noqa: B018
    assert polyamp.get_policy() == Policy("mixed_bfloat16")


def test_policy_scope_with_a_bad_spec_changes_nothing() -> None:
    with pytest.raises(InvalidPolicyError), polyamp.policy_scope("nope"):
        pass
    assert polyamp.get_policy() == Policy("float32")


def test_policy_scope_as_a_decorator() -> None:
    @polyamp.policy_scope("mixed_float16")
    def compute_dtype() -> str:
        return polyamp.get_policy().compute_dtype

    assert compute_dtype() == "float16"
    assert compute_dtype() == "float16"  # reusable
    assert polyamp.get_policy() == Policy("float32")


def test_listeners_hear_every_change_and_can_unsubscribe() -> None:
    heard: list[str] = []
    remove = polyamp.backend_api.policies.add_policy_listener(lambda p: heard.append(p.name))
    polyamp.set_policy("mixed_float16")
    with polyamp.policy_scope("bfloat16"):
        pass
    remove()
    polyamp.set_policy("float32")
    assert heard == ["mixed_float16", "bfloat16", "mixed_float16"]
    remove()  # idempotent


def test_a_failing_listener_rolls_the_policy_back_and_reraises() -> None:
    heard: list[str] = []

    def picky(policy: Policy) -> None:
        heard.append(policy.name)
        if policy.compute_dtype == "float16":
            raise RuntimeError("float16 not supported here")

    polyamp.backend_api.policies.add_policy_listener(picky)
    polyamp.set_policy("mixed_bfloat16")
    with pytest.raises(RuntimeError, match="float16 not supported"):
        polyamp.set_policy("mixed_float16")
    assert polyamp.get_policy() == Policy("mixed_bfloat16")
    assert heard == ["mixed_bfloat16", "mixed_float16", "mixed_bfloat16"]


def test_add_policy_listener_rejects_non_callables() -> None:
    with pytest.raises(TypeError, match="takes a callable"):
        polyamp.backend_api.policies.add_policy_listener("not callable")  # type: ignore[arg-type]


def test_hook_runs_when_the_framework_is_imported_after_set_policy(fake_framework: FakeFramework) -> None:
    polyamp.set_policy("mixed_float16")
    assert fake_framework.name not in sys.modules  # polyamp did not import it
    assert fake_framework.backend_module not in sys.modules
    fake_framework.load()
    hook_log = sys.modules[fake_framework.backend_module].POLICIES
    assert hook_log == [Policy("mixed_float16")]
    polyamp.set_policy("mixed_bfloat16")
    assert hook_log == [Policy("mixed_float16"), Policy("mixed_bfloat16")]


def test_hook_runs_at_once_when_the_framework_is_already_imported(fake_framework: FakeFramework) -> None:
    fake_framework.load()
    polyamp.set_policy("bfloat16")
    hook_log = sys.modules[fake_framework.backend_module].POLICIES
    assert hook_log == [Policy("bfloat16")]
    with polyamp.policy_scope("mixed_float16"):
        assert hook_log[-1] == Policy("mixed_float16")
    assert hook_log[-1] == Policy("bfloat16")


def test_import_hook_uses_the_policy_current_at_import_time(fake_framework: FakeFramework) -> None:
    polyamp.set_policy("mixed_float16")
    polyamp.set_policy("float16")
    fake_framework.load()
    assert sys.modules[fake_framework.backend_module].POLICIES == [Policy("float16")]


def test_imported_module_keeps_its_real_loader(fake_framework: FakeFramework) -> None:
    polyamp.set_policy("mixed_float16")
    module = fake_framework.load()
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert type(module.__spec__.loader).__name__ == "SourceFileLoader"


def test_finder_leaves_meta_path_once_nothing_is_pending(fake_framework: FakeFramework) -> None:
    from polyamp._src import import_hooks

    polyamp.set_policy("mixed_float16")
    assert fake_framework.name in import_hooks.pending_modules()
    assert import_hooks._FINDER in sys.meta_path
    fake_framework.load()
    assert fake_framework.name not in import_hooks.pending_modules()
    # Keras may still be awaited (it is not imported in this process); the finder stays exactly as long.
    assert (import_hooks._FINDER in sys.meta_path) == bool(import_hooks.pending_modules())


def test_failing_hook_at_import_warns_and_the_import_still_succeeds(
    fake_framework: FakeFramework, tmp_path: object
) -> None:
    polyamp.backend_api.register_backend(
        polyamp.backend_api.BackendSpec(
            name=fake_framework.name,
            target=fake_framework.spec.target,
            frameworks=fake_framework.spec.frameworks,
            install_hint="x",
            policy_hook=f"{fake_framework.backend_module}:no_such_function",
        ),
        replace=True,
    )
    polyamp.set_policy("mixed_float16")
    with pytest.warns(RuntimeWarning, match=f"after '{fake_framework.name}' was imported"):
        module = fake_framework.load()
    assert module.Tensor(2.0).value == 2.0


def test_policy_is_one_per_process() -> None:
    polyamp.set_policy("mixed_float16")
    seen: list[Policy] = []
    worker = threading.Thread(target=lambda: seen.append(polyamp.get_policy()))
    worker.start()
    worker.join()
    assert seen == [Policy("mixed_float16")]


def test_overrides_travel_with_the_policy_and_reach_hooks(fake_framework: FakeFramework) -> None:
    fake_framework.load()
    polyamp.set_policy("mixed_float16", overrides={"*norm*": "float32"})
    assert polyamp.backend_api.policies.get_policy_overrides() == polyamp.backend_api.policies.PolicyOverrides(
        {"*norm*": "float32"}
    )
    backend = sys.modules[fake_framework.backend_module]
    assert backend.OVERRIDES[-1].resolve("block.layer_norm") == Policy("float32")
    with polyamp.policy_scope("mixed_bfloat16"):
        assert len(polyamp.backend_api.policies.get_policy_overrides()) == 0
        assert len(backend.OVERRIDES[-1]) == 0
    assert backend.OVERRIDES[-1] == polyamp.backend_api.policies.PolicyOverrides({"*norm*": "float32"})
    polyamp.set_policy("mixed_float16")  # a new setting replaces the overrides too
    assert len(polyamp.backend_api.policies.get_policy_overrides()) == 0


def test_bad_overrides_leave_the_setting_unchanged() -> None:
    polyamp.set_policy("mixed_float16", overrides={"head": "float32"})
    with pytest.raises(InvalidPolicyError, match="Override for 'head'"):
        polyamp.set_policy("mixed_float16", overrides={"head": "float64"})
    assert polyamp.backend_api.policies.get_policy_overrides() == polyamp.backend_api.policies.PolicyOverrides(
        {"head": "float32"}
    )
