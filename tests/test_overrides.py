"""PolicyOverrides: the per-layer matching rule shared by every backend."""

from __future__ import annotations

import pickle

import pytest

from polyamp import InvalidPolicyError, Policy, PolyampTypeError
from polyamp.backend_api.policies import PolicyOverrides

F32 = Policy("float32")
BF16 = Policy("bfloat16")


def test_exact_key_beats_patterns() -> None:
    overrides = PolicyOverrides({"*": "bfloat16", "head": "float32"})
    assert overrides.match("head") == F32
    assert overrides.match("body") == BF16


def test_first_matching_pattern_in_insertion_order_wins() -> None:
    assert PolicyOverrides([("enc*", "float32"), ("*norm", "bfloat16")]).match("enc.norm") == F32
    assert PolicyOverrides([("*norm", "bfloat16"), ("enc*", "float32")]).match("enc.norm") == BF16


def test_star_crosses_separators_and_question_mark_is_one_character() -> None:
    overrides = PolicyOverrides({"encoder*norm": "float32", "layer?": "bfloat16"})
    assert overrides.match("encoder.layers.3.norm") == F32
    assert overrides.match("encoder/block/norm") == F32
    assert overrides.match("layer1") == BF16
    assert overrides.match("layer12") is None


def test_resolve_falls_back_to_the_nearest_ancestor() -> None:
    overrides = PolicyOverrides({"encoder": "float32", "encoder.block.attn": "bfloat16"})
    assert overrides.resolve("encoder.block.mlp") == F32
    assert overrides.resolve("encoder.block.attn.query") == BF16
    assert overrides.resolve("decoder.block") is None
    assert overrides.resolve("encoder/block/mlp") == F32  # Keras paths use "/"
    assert overrides.resolve("encoder/block", separators=".") is None


def test_matching_is_case_sensitive_like_layer_names() -> None:
    assert PolicyOverrides({"Head": "float32"}).match("head") is None


def test_mapping_interface_order_equality_and_pickle() -> None:
    overrides = PolicyOverrides({"b": "float32", "a*": "mixed_bfloat16"})
    assert list(overrides) == ["b", "a*"]
    assert dict(overrides) == {"b": F32, "a*": Policy("mixed_bfloat16")}
    assert len(overrides) == 2 and overrides["b"] == F32
    assert PolicyOverrides(overrides) == overrides
    assert pickle.loads(pickle.dumps(overrides)) == overrides
    assert hash(PolicyOverrides({"b": "f32" and "float32", "a*": "mixed_bfloat16"})) == hash(overrides)
    assert repr(overrides) == "PolicyOverrides({'b': 'float32', 'a*': 'mixed_bfloat16'})"
    with pytest.raises(AttributeError, match="immutable"):
        overrides.x = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("overrides", "error", "fragment"),
    [
        ("*norm*", PolyampTypeError, "must be a mapping"),
        (42, PolyampTypeError, "must be a mapping"),
        ({"": "float32"}, PolyampTypeError, "non-empty layer name"),
        ({3: "float32"}, PolyampTypeError, "non-empty layer name"),
        ([("a", "float32", "x")], PolyampTypeError, "pairs must be"),
        ({"head": "float64"}, InvalidPolicyError, "Override for 'head'"),
        ({"head": 16}, PolyampTypeError, "Override for 'head'"),
    ],
)
def test_bad_overrides(overrides: object, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as info:
        PolicyOverrides(overrides)  # type: ignore[arg-type]
    assert fragment in str(info.value)
