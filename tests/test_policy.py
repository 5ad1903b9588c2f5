"""Policy: every name, every spec form, value semantics, every error."""

from __future__ import annotations

import copy
import pickle
import re

import pytest

import polyamp
import polyamp.backend_api
from polyamp import InvalidPolicyError, Policy, PolyampError, PolyampTypeError

NAMED = {
    "float32": ("float32", "float32", "float32"),
    "mixed_float16": ("float32", "float16", "float32"),
    "mixed_bfloat16": ("float32", "bfloat16", "float32"),
    "float16": ("float16", "float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
}


def dtypes(policy: Policy) -> tuple[str, str, str]:
    return (policy.param_dtype, policy.compute_dtype, policy.output_dtype)


@pytest.mark.parametrize("name", list(NAMED))
def test_keras_names_give_their_dtypes_and_keep_their_name(name: str) -> None:
    policy = Policy(name)
    assert dtypes(policy) == NAMED[name]
    assert policy.name == name
    assert str(policy) == name
    assert repr(policy) == f"Policy({name!r})"


@pytest.mark.parametrize("name", list(NAMED))
def test_needs_loss_scaling_exactly_when_compute_is_float16(name: str) -> None:
    assert Policy(name).needs_loss_scaling is (NAMED[name][1] == "float16")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("params=float32,compute=bfloat16,output=float32", ("float32", "bfloat16", "float32")),
        ("p=f32,c=bf16,o=f32", ("float32", "bfloat16", "float32")),
        ("param=full,compute=f16,output=f16", ("float32", "float16", "float16")),
        ("c=f16", ("float32", "float16", "float32")),
        ("o=bf16", ("float32", "float32", "bfloat16")),
        ("p=bf16", ("bfloat16", "float32", "float32")),
        (" compute = float16 , params = bfloat16 ", ("bfloat16", "float16", "float32")),
        ("P=F16,C=F16,O=F16", ("float16", "float16", "float16")),
        ("output=float32,compute=float16", ("float32", "float16", "float32")),
    ],
)
def test_spec_strings(spec: str, expected: tuple[str, str, str]) -> None:
    assert dtypes(Policy(spec)) == expected


def test_spec_matching_a_keras_policy_takes_its_name() -> None:
    assert Policy("p=f32,c=f16,o=f32").name == "mixed_float16"
    assert Policy("c=f32").name == "float32"
    assert Policy("p=bf16,c=bf16,o=bf16").name == "bfloat16"


def test_unnamed_policy_name_is_a_canonical_spec_that_parses_back() -> None:
    policy = Policy("c=bf16,o=f16")
    assert policy.name == "params=float32,compute=bfloat16,output=float16"
    assert Policy(policy.name) == policy


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, ("float32", "float32", "float32")),
        ({"compute": "bfloat16"}, ("float32", "bfloat16", "float32")),
        ({"param": "f16", "compute": "f16", "output": "f16"}, ("float16", "float16", "float16")),
        ({"compute": "full", "output": "bf16"}, ("float32", "float32", "bfloat16")),
    ],
)
def test_keyword_form(kwargs: dict[str, str], expected: tuple[str, str, str]) -> None:
    assert dtypes(Policy(**kwargs)) == expected


class _NamedDtype:  # like numpy/tensorflow dtypes: a `.name`
    def __init__(self, name: str) -> None:
        self.name = name


class _PrintedDtype:  # like torch dtypes: only str() says "torch.bfloat16"
    def __str__(self) -> str:
        return "torch.bfloat16"


class float16:  # like numpy scalar types: a class named after the dtype
    pass


def test_keyword_form_accepts_framework_dtype_objects() -> None:
    policy = Policy(param=_NamedDtype("float32"), compute=_PrintedDtype(), output=float16)
    assert dtypes(policy) == ("float32", "bfloat16", "float16")


def test_policy_of_a_policy_is_an_equal_policy() -> None:
    original = Policy("mixed_bfloat16")
    assert Policy(original) == original
    assert Policy(original) is not original


def test_equality_and_hash_follow_the_three_dtypes() -> None:
    assert Policy("mixed_float16") == Policy("params=float32,compute=float16,output=float32")
    assert hash(Policy("mixed_float16")) == hash(Policy("p=f32,c=f16,o=f32"))
    assert Policy("mixed_float16") != Policy("float16")
    assert Policy("mixed_float16") != "mixed_float16"
    assert len({Policy("float32"), Policy("c=f32"), Policy(compute="float32")}) == 1


def test_policy_is_immutable() -> None:
    policy = Policy("mixed_float16")
    with pytest.raises(AttributeError, match="immutable"):
        policy.compute_dtype = "bfloat16"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        policy.anything = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="immutable"):
        del policy._dtypes
    assert policy.compute_dtype == "float16"


def test_replace_changes_only_what_is_given() -> None:
    base = Policy("mixed_float16")
    assert dtypes(base.replace(output="float16")) == ("float32", "float16", "float16")
    assert dtypes(base.replace(compute="bf16")) == ("float32", "bfloat16", "float32")
    assert base == Policy("mixed_float16")


def test_pickle_and_copy_round_trip() -> None:
    for policy in (Policy("mixed_float16"), Policy("c=bf16,o=f16")):
        assert pickle.loads(pickle.dumps(policy)) == policy
        assert copy.deepcopy(policy) == policy


def test_is_mixed() -> None:
    assert Policy("mixed_bfloat16").is_mixed
    assert not Policy("bfloat16").is_mixed
    assert not Policy("float32").is_mixed


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("mixed_float61", "Did you mean 'mixed_float16'?"),
        ("", "Unknown policy ''"),
        ("float64", "Unknown policy 'float64'"),
        ("c=float64", "Unknown dtype 'float64' for 'c'"),
        ("compute=f16,compute=bf16", "sets the compute dtype twice"),
        ("weights=f16", "Cannot parse 'weights=f16'"),
        ("c=f16,", "Cannot parse ''"),
        ("c:f16=", "Cannot parse 'c:f16='"),
    ],
)
def test_bad_specs_raise_value_error_naming_input_and_grammar(spec: str, fragment: str) -> None:
    with pytest.raises(InvalidPolicyError) as info:
        Policy(spec)
    message = str(info.value)
    assert fragment in message
    assert "'mixed_float16'" in message and "params|p" in message and "bf16" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, PolyampError)


@pytest.mark.parametrize("spec", [16, 1.5, b"float16", ["mixed_float16"], object()])
def test_non_string_spec_is_a_type_error_naming_what_was_received(spec: object) -> None:
    with pytest.raises(PolyampTypeError) as info:
        Policy(spec)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    assert type(spec).__name__ in str(info.value)
    assert "'mixed_float16'" in str(info.value)


def test_spec_and_keywords_together_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="either a spec or the param/compute/output keywords"):
        Policy("mixed_float16", compute="bfloat16")


@pytest.mark.parametrize("value", ["float64", "int8", 16, None.__class__])
def test_bad_keyword_dtype_is_a_value_error_naming_the_keyword(value: object) -> None:
    with pytest.raises(InvalidPolicyError, match=re.escape("`compute` must be one of float32|f32|full")):
        Policy(compute=value)


def test_module_constants() -> None:
    assert polyamp.backend_api.policies.POLICY_NAMES == (
        "float32",
        "mixed_float16",
        "mixed_bfloat16",
        "float16",
        "bfloat16",
    )
    assert polyamp.backend_api.policies.DTYPE_NAMES == ("float32", "float16", "bfloat16")
