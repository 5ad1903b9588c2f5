"""The core's training-state plan: policy fields, presets, refusals, and the reference writes."""

from __future__ import annotations

import math
import pickle
import random
import struct

import pytest

import polyamp
import polyamp.backend_api
from polyamp import InvalidPolicyError, Policy
from polyamp.backend_api.training_state import (
    round_to,
    stochastic_round_bfloat16,
    unplanned_hazard_message,
    write_update,
)


def _f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


# --- the policy fields ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "plan"),
    [
        ("float32", ("float32", "float32", "nearest")),
        ("mixed_float16", ("float32", "float32", "nearest")),
        ("mixed_bfloat16", ("float32", "float32", "nearest")),
        ("bfloat16", ("bfloat16", "bfloat16", "nearest")),
        ("float16", ("float16", "float16", "nearest")),
        ("bfloat16_float32_master", ("float32", "float32", "nearest")),
        ("bfloat16_kahan", ("bfloat16", "bfloat16", "kahan")),
        ("bfloat16_stochastic", ("bfloat16", "bfloat16", "stochastic")),
        ("p=bf16,c=bf16,m=f32,s=bf16", ("float32", "bfloat16", "nearest")),
        ("params=float16,compute=float16,rounding=kahan", ("float16", "float16", "kahan")),
        ("params=bfloat16,state=float32", ("bfloat16", "float32", "nearest")),
    ],
)
def test_plan_fields(spec: str, plan: tuple[str, str, str]) -> None:
    policy = Policy(spec)
    assert (policy.master_dtype, policy.state_dtype, policy.rounding) == plan
    assert policy.keeps_master == (policy.master_dtype != policy.param_dtype)
    assert Policy(policy.name) == policy  # the name reads back
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_presets_are_the_issue_spellings() -> None:
    assert Policy("params=bfloat16,compute=bfloat16,output=float32,state=bfloat16,rounding=kahan").name == (
        "bfloat16_kahan"
    )
    assert Policy("p=bf16,c=bf16,o=f32,r=stochastic").name == "bfloat16_stochastic"
    assert Policy("p=bf16,c=bf16,o=f32,m=f32").name == "bfloat16_float32_master"
    assert polyamp.backend_api.policies.PRESET_NAMES == (
        "bfloat16_float32_master",
        "bfloat16_kahan",
        "bfloat16_stochastic",
    )
    assert polyamp.backend_api.policies.ROUNDINGS == ("nearest", "stochastic", "kahan")
    for name in polyamp.backend_api.policies.PRESET_NAMES:
        preset = Policy(name)
        assert (preset.param_dtype, preset.compute_dtype, preset.output_dtype) == ("bfloat16", "bfloat16", "float32")
        assert preset.has_training_state_plan


def test_defaults_leave_names_and_equality_as_before() -> None:
    for name in polyamp.backend_api.policies.POLICY_NAMES:
        assert Policy(name).name == name
        assert not Policy(name).has_training_state_plan
    assert Policy("bfloat16") != Policy("bfloat16", rounding="kahan")
    assert hash(Policy("bfloat16", rounding="kahan")) == hash(Policy("p=bf16,c=bf16,o=bf16,r=kahan"))
    assert Policy("bfloat16", state="float32").name == "params=bfloat16,compute=bfloat16,output=bfloat16,state=float32"


def test_keywords_and_replace() -> None:
    policy = Policy(param="bf16", compute="bf16", output="f32", rounding="kahan")
    assert policy.name == "bfloat16_kahan"
    assert policy.replace(rounding="stochastic").name == "bfloat16_stochastic"
    # A defaulted master/state follows the new parameter dtype; an explicit one is kept.
    assert Policy("bfloat16").replace(param="float32").master_dtype == "float32"
    assert Policy("p=bf16,c=bf16,s=f32").replace(param="float32").state_dtype == "float32"
    assert Policy("bfloat16_kahan", master=None).rounding == "kahan"
    with pytest.raises(InvalidPolicyError, match="rounding"):
        Policy("bfloat16", rounding="up")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("p=bf16,m=f16", "at least as precise"),
        ("p=f32,m=bf16", "at least as precise"),
        ("p=f32,s=f16", "cannot be float16"),
        ("p=bf16,c=bf16,m=f32,r=kahan", "float32 master copy"),
        ("p=f32,c=bf16,r=stochastic", "float32 parameter"),
        ("p=f16,c=f16,r=stochastic", "defined for bfloat16 weights"),
        ("p=bf16,r=round", "Unknown rounding 'round'"),
        ("p=bf16,r=kahan,r=nearest", "twice"),
        ("bfloat16_kahn", "Did you mean 'bfloat16_kahan'"),
    ],
)
def test_refusals_say_what_and_how(spec: str, words: str) -> None:
    with pytest.raises(InvalidPolicyError, match=words) as info:
        Policy(spec)
    assert "Received" in str(info.value) or "Valid names" in str(info.value)


# --- the reference writes ---------------------------------------------------------------------------------------


def test_round_to_matches_ml_dtypes() -> None:
    np = pytest.importorskip("numpy")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 2000), np.float32([0, -0.0, 7e4])]
    ).astype(np.float32)
    for dtype, np_dtype in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
        with np.errstate(over="ignore"):  # 7e4 is beyond float16: inf, as round_to says
            expected = values.astype(np_dtype).astype(np.float32)
        got = np.float32([round_to(float(v), dtype) for v in values])
        assert got.tobytes() == expected.tobytes(), dtype


def test_stochastic_rounding_brackets_and_is_unbiased() -> None:
    value = _f32(1.0 + 3 * 2.0**-10)  # between the bfloat16 neighbours 1.0 and 1.0078125, 3/8 of the way up
    low, high = 1.0, 1.0 + 2.0**-7
    outcomes = [stochastic_round_bfloat16(value, r) for r in range(0, 65536, 7)]
    assert set(outcomes) == {low, high}
    assert sum(outcomes) / len(outcomes) == pytest.approx(value, abs=2.0**-7 / 1000)
    assert stochastic_round_bfloat16(1.0, 65535) == 1.0  # exact values never move
    assert math.isnan(stochastic_round_bfloat16(math.nan, 12345))


def test_kahan_carries_what_rounding_loses() -> None:
    weight, compensation = 1.0, 0.0
    nearest = 1.0
    for _ in range(100):  # 100 updates of 1e-4: each rounds away in bfloat16 (half an ulp of 1.0 is 2**-8)
        weight, compensation = write_update(
            weight, _f32(weight + 1e-4), dtype="bfloat16", rounding="kahan", compensation=compensation
        )
        nearest, _ = write_update(nearest, _f32(nearest + 1e-4), dtype="bfloat16", rounding="nearest")
    assert nearest == 1.0
    # (the buffer itself is bfloat16, so it keeps the sum to about 2**-16 per step, not exactly)
    assert weight + compensation == pytest.approx(1.01, abs=5e-4)
    assert round_to(weight, "bfloat16") == weight and round_to(compensation, "bfloat16") == compensation


def test_kahan_write_is_the_stated_float32_sequence() -> None:
    rnd = random.Random(0)
    for _ in range(500):
        w = round_to(rnd.uniform(-4, 4), "bfloat16")
        c = round_to(rnd.uniform(-1e-3, 1e-3), "bfloat16")
        target = _f32(w + rnd.uniform(-1e-2, 1e-2))
        delta = _f32(target - w)
        y = _f32(c + delta)
        new = round_to(_f32(w + y), "bfloat16")
        assert write_update(w, target, dtype="bfloat16", rounding="kahan", compensation=c) == (
            new,
            round_to(_f32(y - _f32(new - w)), "bfloat16"),
        )


# --- bytes and the hazard ---------------------------------------------------------------------------------------


def test_state_bytes() -> None:
    assert polyamp.state_bytes("mixed_bfloat16") == polyamp.backend_api.training_state.StateBytes(4, 4, 0, 8, 0)
    assert polyamp.state_bytes("bfloat16_float32_master") == polyamp.backend_api.training_state.StateBytes(
        2, 2, 4, 8, 0
    )
    assert polyamp.state_bytes("bfloat16_kahan").total == 10
    assert polyamp.state_bytes("bfloat16_stochastic").total == 8
    assert polyamp.state_bytes("bfloat16_kahan", slots=1).total == 8
    rows = polyamp.state_bytes_table(1000)
    assert [row["policy"] for row in rows] == [
        "float32",
        "mixed_bfloat16",
        "bfloat16",
        "bfloat16_float32_master",
        "bfloat16_kahan",
        "bfloat16_stochastic",
    ]
    assert [row["total"] for row in rows] == [16000, 16000, 8000, 16000, 10000, 8000]
    with pytest.raises(polyamp.InvalidConfigError, match="slots"):
        polyamp.state_bytes("bfloat16", slots=-1)


def test_hazard_message() -> None:
    message = unplanned_hazard_message("AdamW", ["bfloat16", "float32"], Policy("bfloat16"))
    assert message is not None and "bfloat16_kahan" in message and "AdamW" in message
    assert unplanned_hazard_message("AdamW", ["bfloat16"], Policy("bfloat16_kahan")) is None
    assert unplanned_hazard_message("AdamW", ["bfloat16"], Policy("bfloat16_float32_master")) is None
    assert unplanned_hazard_message("AdamW", ["float32"], Policy("bfloat16")) is None


def test_what_counts_as_a_slot() -> None:
    from polyamp.backend_api.training_state import KAHAN_KEY, MASTER_KEY, is_state_slot

    assert is_state_slot(floating=True, ndim=2, key="exp_avg")
    assert is_state_slot(floating=True, ndim=2, key="row_var")  # any shape: Adafactor's factored statistics
    assert not is_state_slot(floating=True, ndim=0, key="lr")  # an injected hyperparameter
    assert is_state_slot(floating=True, ndim=0, key="exp_avg", param_ndim=0)  # a scalar parameter's moment
    assert not is_state_slot(floating=True, ndim=0, key="step", param_ndim=0)  # its counter
    assert not is_state_slot(floating=False, ndim=2, key="max_exp_avg_sq_index")
    assert not is_state_slot(floating=True, ndim=2, key=MASTER_KEY)
    assert not is_state_slot(floating=True, ndim=2, key=KAHAN_KEY)
