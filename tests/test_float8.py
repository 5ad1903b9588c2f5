"""FP8 in the core: the recipe and its policy grammar, and the reference quantizer (the device rules over
NumPy and ml_dtypes) against torchao's casts and Flax's delayed scaling, bit for bit."""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator

import numpy as np
import pytest

import polyamp
from polyamp import Float8Recipe, InvalidPolicyError, Policy, PolyampError
from polyamp._src import float8_reference as ref
from polyamp._src.float8 import FLOAT8_PRESETS, parse_recipe
from polyamp._src.rules import fp8

ml_dtypes = pytest.importorskip("ml_dtypes")

KINDS = ("normal", "heavy_tailed", "outliers", "zero_rows", "denormal_rows")


def seeded_tensors(kind: str, count: int = 20, shape: tuple[int, int] = (32, 64)) -> Iterator[np.ndarray]:
    """``count`` float32 tensors of one kind; the five kinds together are the 100 seeded tensors."""
    rng = np.random.default_rng(KINDS.index(kind))
    for _ in range(count):
        x = rng.standard_normal(shape)
        if kind == "heavy_tailed":
            x = rng.standard_t(1.5, shape)
        elif kind == "outliers":
            rows, cols = rng.integers(0, shape[0], 3), rng.integers(0, shape[1], 3)
            x[rows, cols] = rng.choice([1e4, -3e5, 7e6, 1e30], 3)
        elif kind == "zero_rows":
            x[rng.integers(0, shape[0], 5)] = 0.0
        elif kind == "denormal_rows":
            x = x * np.exp2(rng.integers(-140, -118, (shape[0], 1)))  # float32 subnormal and near-subnormal rows
        yield x.astype(np.float32)


def bits(array: np.ndarray) -> np.ndarray:
    return np.asarray(array).view(np.uint8 if np.asarray(array).dtype.itemsize == 1 else np.uint32)


# -- the recipe and the policy grammar ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FLOAT8_PRESETS))
def test_each_preset_round_trips_through_text_dict_and_pickle(name: str) -> None:
    recipe = Float8Recipe.preset(name)
    assert recipe.spec == name
    assert parse_recipe(recipe.spec) == recipe
    assert Float8Recipe.from_dict(recipe.to_dict()) == recipe
    policy = Policy(name)
    assert (policy.compute_dtype, policy.float8, policy.name) == ("bfloat16", recipe, name)
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_a_custom_recipe_is_named_by_its_nearest_preset_and_the_fields_that_differ() -> None:
    policy = Policy("mixed_float16+float8_delayed[amax_history_length=16,margin=1,skip=Head|lm_*]")
    assert policy.compute_dtype == "float16"
    assert policy.float8 == Float8Recipe(scaling="delayed", amax_history_length=16, margin=1, skip=("Head", "lm_*"))
    assert policy.name == "mixed_float16+float8_delayed[margin=1,amax_history_length=16,skip=Head|lm_*]"
    assert Policy(policy.name) == policy
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_a_recipe_makes_a_different_policy_and_replace_adds_or_drops_it() -> None:
    plain = Policy("mixed_bfloat16")
    fp8_policy = plain.replace(float8="float8_rowwise")
    assert fp8_policy != plain and hash(fp8_policy) != hash(plain)
    assert (
        fp8_policy == Policy("float8_rowwise") == Policy("mixed_bfloat16", float8=Float8Recipe.preset("float8_rowwise"))
    )
    assert fp8_policy.replace(float8=False) == plain
    assert fp8_policy.replace(compute="float16").name == "mixed_float16+float8_rowwise"


def test_set_policy_takes_an_fp8_preset() -> None:
    with polyamp.policy_scope("float8_tensorwise"):
        assert polyamp.get_policy().float8 == Float8Recipe()
    assert polyamp.get_policy().float8 is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("float8_rowwize", "Did you mean 'float8_rowwise'"),
        ("mixed_bfloat16+", "empty side of '\\+'"),
        ("mixed_bfloat16+float8_rowwise[margin=1", "without closing it"),
        ("float8_delayed[granularity=row]", "Delayed scaling keeps one amax history per tensor"),
        ("float8_delayed[histroy=4]", "expected field=value"),
        ("float8_delayed[margin=two]", "margin takes an integer.*Received: 'two'"),
        ("float8_tensorwise[input_format=e3m4]", "input_format.*'e4m3', 'e5m2'.*Received: 'e3m4'"),
        ("mxfp8[power_of_two=true]", "MX scales are powers of two already"),
        ("float8_rowwise[amax_history_length=0]", "amax_history_length.*>= 1.*Received: 0"),
        ("float8_rowwise[power_of_two=yes]", "power_of_two takes true or false"),
    ],
)
def test_a_bad_recipe_says_what_was_received_and_what_is_allowed(text: str, message: str) -> None:
    with pytest.raises(InvalidPolicyError, match=message):
        Policy(text)


def test_recipe_fields_are_checked_when_built_and_from_a_dict() -> None:
    with pytest.raises(InvalidPolicyError, match=r"modules.*glob patterns.*Received: 3"):
        Float8Recipe(modules=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidPolicyError, match="pattern 'a,b'"):
        Float8Recipe(skip=("a,b",))
    with pytest.raises(InvalidPolicyError, match="unknown keys \\['scale'\\]"):
        Float8Recipe.from_dict({"scale": 1})
    with pytest.raises(polyamp.PolyampTypeError, match=r"`float8` must be a polyamp\.Float8Recipe"):
        Policy("mixed_bfloat16", float8=3)  # type: ignore[arg-type]


def test_skip_reason_names_the_filter_or_the_dimension_that_keeps_a_layer_out() -> None:
    recipe = Float8Recipe(modules=("blocks.*",), skip=("*.head",))
    assert recipe.skip_reason("blocks.0.fc", 64, 128) is None
    assert recipe.skip_reason("embed", 64, 128) == "not matched by modules=['blocks.*']"
    assert recipe.skip_reason("blocks.1.head", 64, 128) == "matched by skip pattern '*.head'"
    assert recipe.skip_reason("blocks.0.fc", 64, 100) == "out_features=100 not a multiple of 16"
    assert Float8Recipe.preset("mxfp8").skip_reason("fc", 48, 64) == "in_features=48 not a multiple of 32"


# -- the reference against torchao ----------------------------------------------------------------------------

TORCH_FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


@pytest.fixture(scope="module")
def torchao_float8() -> object:
    pytest.importorskip("torch")
    return pytest.importorskip("torchao.float8.float8_scaling_utils")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_current_scales_and_casts_equal_torchaos_bit_for_bit(kind: str, dtype: str, torchao_float8: object) -> None:
    import torch
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import LinearMMConfig

    compared = 0
    for x in seeded_tensors(kind):
        x = x.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else x
        t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(x)
        for fmt, torch_name in TORCH_FORMATS.items():
            for axis in (None, -1, 0):
                granularity = ScalingGranularity.TENSORWISE if axis is None else ScalingGranularity.AXISWISE
                for power_of_two in (False, True):
                    theirs = torchao_float8.hp_tensor_to_float8_dynamic(  # type: ignore[attr-defined]
                        t,
                        getattr(torch, torch_name),
                        LinearMMConfig(),
                        scaling_granularity=granularity,
                        axiswise_dim=axis,
                        round_scales_to_power_of_2=power_of_two,
                    )
                    scale = ref.current_scale(x, fmt, axis=axis, power_of_two=power_of_two)
                    cast = ref.quantize(x, scale, fmt)
                    assert np.array_equal(bits(scale), bits(theirs._scale.numpy())), (kind, fmt, axis, power_of_two)
                    assert np.array_equal(bits(cast), theirs._data.view(torch.uint8).numpy()), (kind, fmt, axis)
                    compared += 1
    assert compared == 20 * 2 * 3 * 2


@pytest.mark.parametrize("rounding", ["floor", "ceil", "rceil"])
@pytest.mark.parametrize("kind", KINDS)
def test_mx_casts_equal_torchaos_to_mx_bit_for_bit(kind: str, rounding: str) -> None:
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    for x in seeded_tensors(kind):
        for fmt, torch_name in TORCH_FORMATS.items():
            their_scales, their_values = mx.to_mx(
                torch.from_numpy(x), getattr(torch, torch_name), 32, scaling_mode=ScaleCalculationMode(rounding)
            )
            exponents, values = ref.mx_quantize(x, fmt, rounding=rounding)
            assert np.array_equal(exponents, their_scales.view(torch.uint8).numpy()), (kind, fmt)
            assert np.array_equal(bits(values), their_values.view(torch.uint8).numpy()), (kind, fmt)
            assert exponents.shape == (32, 2) and values.dtype == np.dtype(getattr(ml_dtypes, torch_name))


def test_mx_rceil_exponent_is_the_exact_ceiling_where_a_float32_log2_rounds_down() -> None:
    # amax / 448 one unit above 2**-3: a float32 log2 gives exactly -3 (torchao's eager formula then keeps
    # 2**-3 and saturates the largest value); the exact ceiling is -2, as cvt.rp.satfinite.ue8m0 computes.
    descale = np.nextafter(np.float32(2.0**-3), np.float32(1.0))
    block = np.zeros((1, 32), np.float32)
    block[0, 0] = descale * np.float32(448.0)
    assert float(np.float32(block[0, 0]) / np.float32(448.0)) > 2.0**-3
    exponents, values = ref.mx_quantize(block, "e4m3", rounding="rceil")
    assert int(exponents[0, 0]) == 127 - 2
    assert float(values[0, 0].astype(np.float32)) < 448.0  # not saturated


def test_power_of_two_scales_follow_torchaos_float32_log2_just_below_a_power_of_two() -> None:
    torch = pytest.importorskip("torch")
    below = np.nextafter(np.float32(512.0), np.float32(0.0))  # a scale one unit below 2**9
    amax = np.float32(448.0) / below
    scale = ref.current_scale(np.array([amax], np.float32), "e4m3", power_of_two=True)
    theirs = torch.exp2(torch.floor(torch.log2(torch.tensor(448.0 / float(amax), dtype=torch.float32))))
    assert float(scale) == float(theirs) == 512.0  # rounded up, as torchao does; the cast saturates then


# -- no finite input gives a non-finite output ----------------------------------------------------------------

EXTREMES = {
    "zeros": np.zeros((4, 64), np.float32),
    "above_max": np.full((4, 64), 3.0e38, np.float32) * np.array([1, -1, 1, -1], np.float32)[:, None],
    "tiny": np.full((4, 64), 1e-45, np.float32),
    "mixed": np.concatenate([np.zeros((2, 64)), np.full((2, 64), 1e30)]).astype(np.float32),
}


def _finite(values: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(np.asarray(values).astype(np.float32))))


@pytest.mark.parametrize("name", sorted(EXTREMES))
@pytest.mark.parametrize("fmt", sorted(fp8.FORMATS))
def test_no_finite_input_gives_a_non_finite_scale_or_cast(name: str, fmt: str) -> None:
    x = EXTREMES[name]
    for axis in (None, -1, 0):
        for power_of_two in (False, True):
            scale = ref.current_scale(x, fmt, axis=axis, power_of_two=power_of_two)
            assert _finite(scale) and np.all(scale > 0)
            assert _finite(ref.quantize(x, scale, fmt))
    for rounding in fp8.MX_ROUNDINGS:
        exponents, values = ref.mx_quantize(x, fmt, rounding=rounding)
        assert _finite(values) and np.all(exponents < 255)
    history, scale = np.zeros(4, np.float32), np.ones((), np.float32)
    for _ in range(3):
        cast, scale, history = ref.delayed_step(x, history, scale, fmt)
        assert _finite(cast) and _finite(scale) and float(scale) > 0 and _finite(history)


def test_an_all_zero_tensor_gets_the_scale_of_an_amax_of_1e_12() -> None:
    scale = ref.current_scale(np.zeros(8, np.float32), "e4m3")
    assert float(scale) == float(np.float32(448.0 / 1e-12))
    assert np.all(ref.quantize(np.zeros(8, np.float32), scale, "e4m3").astype(np.float32) == 0)


# -- delayed scaling against Flax's fp8_ops -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_delayed_scaling_equals_flaxs_fp8_ops_over_steps(fmt: str) -> None:
    pytest.importorskip("flax")
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    dtype = getattr(jnp, TORCH_FORMATS[fmt])
    rng = np.random.default_rng(7)
    history, scale = np.zeros(5, np.float32), np.ones((), np.float32)
    their_history, their_scale = jnp.zeros(5, jnp.float32), jnp.ones((), jnp.float32)
    for step in range(12):
        x = (rng.standard_normal((16, 32)) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
        if step == 4:
            x[:] = 0.0  # an amax of 0 keeps the scale
        cast, scale, history = ref.delayed_step(x, history, scale, fmt)
        their_cast = fp8_ops.quantize(jnp.asarray(x), dtype, their_scale, jnp.float32)
        their_scale, their_history = fp8_ops.update_fp8_meta(jnp.asarray(x), dtype, their_scale, their_history)
        assert np.array_equal(bits(cast), np.asarray(their_cast).view(np.uint8)), step
        assert np.array_equal(bits(scale), bits(np.asarray(their_scale))), step
        assert np.array_equal(bits(history), bits(np.asarray(their_history))), step


def test_delayed_scaling_keeps_the_scale_where_flax_would_store_zero() -> None:
    pytest.importorskip("flax")
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    history = np.full(2, 1e-37, np.float32)  # a normal amax so small that 448 / amax overflows float32
    _, scale, _ = ref.delayed_step(np.zeros(4, np.float32), history, np.float32(0.5), "e4m3")
    their_scale, _ = fp8_ops.update_fp8_meta(jnp.zeros(4), jnp.float8_e4m3fn, jnp.float32(0.5), jnp.asarray(history))
    assert float(scale) == 0.5 and float(their_scale) == 0.0
    cast, _, _ = ref.delayed_step(np.zeros(4, np.float32), history, scale, "e4m3")
    assert np.all(cast.astype(np.float32) == 0.0)  # Flax's scale of 0 casts 0 / 0: NaN


def test_push_amax_keeps_the_last_n_amaxes() -> None:
    history = np.zeros(3, np.float32)
    for value in (1.0, 2.0, 3.0, 4.0):
        history = fp8.push_amax(ref.OPS, history, np.float32(value))
    assert history.tolist() == [4.0, 2.0, 3.0]
    assert fp8.push_amax(ref.OPS, np.zeros(1, np.float32), np.float32(5.0)).tolist() == [5.0]


def test_delayed_scale_from_the_most_recent_amax_and_with_a_margin() -> None:
    history, scale = np.array([2.0, 8.0], np.float32), np.ones((), np.float32)
    most_recent = fp8.delayed_scale(ref.OPS, history, scale, fp8.FORMATS["e4m3"], amax_compute="most_recent")
    with_margin = fp8.delayed_scale(ref.OPS, history, scale, fp8.FORMATS["e4m3"], margin=2)
    assert float(most_recent) == float(np.float32(1.0) / (np.float32(448.0) / np.float32(2.0)))
    assert float(with_margin) == float(np.float32(1.0) / (np.float32(448.0) / np.float32(8.0) / np.float32(4.0)))


def test_cast_counts_count_saturated_flushed_and_nonzero_values() -> None:
    x = np.array([1000.0, -1000.0, 1e-9, 0.0, 1.0], np.float32)
    spec = fp8.FORMATS["e4m3"]
    values = fp8.scaled(ref.OPS, x, np.float32(1.0))
    counts = fp8.cast_counts(ref.OPS, x, values, fp8.saturating_cast(ref.OPS, values, spec), spec)
    assert counts.tolist() == [2, 1, 4]


def test_add_counts_carries_between_the_digits_and_stays_exact_to_2_47() -> None:
    """Counts added into two float32 digits (``low + high * 2**23``): every total is the integer sum, each low
    digit below 2**23, up to a total one short of 2**47, where adding the largest int32 once more carries."""
    digit = fp8.COUNT_DIGIT
    digits = np.zeros((3, 2), np.float32)
    steps = [[2**31 - 1, digit - 1, 0], [1, 1, digit], [2**31 - 1, digit + 5, 3]]
    expected = [0, 0, 0]
    for counts in steps:
        digits = fp8.add_counts(ref.OPS, digits, np.array(counts, np.int32))
        expected = [e + c for e, c in zip(expected, counts, strict=True)]
        assert digits.dtype == np.float32 and fp8.counts_from_digits(digits.tolist()) == expected
        assert (digits[:, 0] < digit).all() and (np.floor(digits) == digits).all()
    # a low digit at its top plus another low digit carries exactly one into the high digit
    near = np.array([[digit - 1, 2**24 - 257]], np.float32)
    top = fp8.add_counts(ref.OPS, near, np.array([2**31 - 1], np.int32))
    assert top.tolist() == [[digit - 2, 2**24 - 1]]
    assert fp8.counts_from_digits(top.tolist()) == [2**47 - 2] == [digit - 1 + (2**24 - 257) * digit + 2**31 - 1]
    assert fp8.counts_from_digits([[[1.0, 2.0], [0.0, 0.0]]]) == [[1 + 2 * digit, 0]]


def test_add_digits_adds_the_digits_of_a_layers_runs_and_carries_exactly() -> None:
    """Digits plus the sum of several products' digits (a layer run more than once in a step): the totals are
    the integer sums, normalised (low digit below 2**23), as adding each product's counts one by one gives."""
    digit = fp8.COUNT_DIGIT
    totals = fp8.add_counts(ref.OPS, np.zeros((3, 2), np.float32), np.array([digit - 1, 5, 2**31 - 1], np.int32))
    runs = [np.array(c, np.int32) for c in ([digit - 1, 0, 1], [digit - 3, digit, 2**31 - 1])]
    summed = sum(fp8.add_counts(ref.OPS, np.zeros((3, 2), np.float32), c) for c in runs)
    assert summed[0, 0] > digit  # the runs' low digits add past a digit
    one_by_one = totals
    for counts in runs:
        one_by_one = fp8.add_counts(ref.OPS, one_by_one, counts)
    added = fp8.add_digits(ref.OPS, totals, summed)
    assert added.dtype == np.float32 and added.tolist() == one_by_one.tolist()
    assert (added[:, 0] < digit).all()


def test_an_fp8_error_is_a_polyamp_error() -> None:
    with pytest.raises(PolyampError, match=r"An FP8 format is one of .e4m3., .e5m2.\. Received: .e3m4."):
        ref.current_scale(np.ones(2, np.float32), "e3m4")
    assert math.isfinite(float(ref.current_scale(np.ones(2, np.float32), "e5m2")))


def test_a_state_dict_holds_the_one_delayed_recipe_of_a_models_layers() -> None:
    from polyamp.backend_api.state_dicts import delayed_recipe

    short, long = (Float8Recipe(scaling="delayed", amax_history_length=n) for n in (4, 8))
    dynamic = Float8Recipe.preset("float8_rowwise")
    assert delayed_recipe({"a": short, "b": short, "c": dynamic}, "float8_state_dict()", "apply_policy") == short
    with pytest.raises(
        polyamp.PolyampValueError, match=r"different recipes \(float8_delayed\[amax_history_length=4\], "
    ):
        delayed_recipe({"a": short, "b": long}, "float8_state_dict()", "apply_policy")
    with pytest.raises(polyamp.PolyampValueError, match=r"^float8_state_dict\(\) needs .*\(apply_policy under "):
        delayed_recipe({"c": dynamic}, "float8_state_dict()", "apply_policy")
