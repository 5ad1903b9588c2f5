"""FP8 linear layers in PyTorch: `polyamp_torch.apply_policy` under an FP8 policy against torchao's
``convert_to_float8_training`` bit for bit, the casts against the reference quantizer, delayed scaling's state,
``torch.compile``, the loss scaler and checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polyamp
from polyamp import Float8Recipe
from polyamp._src import float8_reference as ref
from polyamp.backend_api.rules import fp8

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")
polyamp_torch = pytest.importorskip("polyamp_torch")

from polyamp_torch._float8 import Float8Linear  # noqa: E402
from polyamp_torch._rule import OPS  # noqa: E402

pytestmark = pytest.mark.torch

#: polyamp's preset and torchao's recipe name for the same recipe.
TORCHAO_RECIPES = {
    "float8_tensorwise": "tensorwise",
    "float8_rowwise": "rowwise",
    "float8_rowwise_gw_hp": "rowwise_with_gw_hp",
}


#: The torchao comparisons that run in the fast set (the others are marked slow).
FAST_TORCHAO_CASES = {("float8_tensorwise", "float32"), ("float8_rowwise_gw_hp", "mixed_bfloat16")}


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)
    )


def torchao_model(model: torch.nn.Module, recipe: str) -> torch.nn.Module:
    torchao_float8 = pytest.importorskip("torchao.float8")
    config = torchao_float8.Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe])
    return torchao_float8.convert_to_float8_training(copy.deepcopy(model), config=config)


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


# -- the casts on the device are the reference's ------------------------------------------------------------


@pytest.mark.parametrize("axis", [None, -1, 0])
@pytest.mark.parametrize("fmt", sorted(fp8.FORMATS))
def test_torch_scales_and_casts_equal_the_reference_bit_for_bit(fmt: str, axis: int | None) -> None:
    rng = np.random.default_rng(3)
    spec = fp8.FORMATS[fmt]
    for _ in range(20):
        x = (rng.standard_t(2.0, (32, 64)) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
        x[rng.integers(0, 32, 2)] = 0.0
        scale = fp8.scale_from_amax(OPS, fp8.amax(OPS, torch.from_numpy(x), axis), spec, power_of_two=axis == 0)
        cast = fp8.quantize(OPS, torch.from_numpy(x), scale, spec)
        expected = ref.current_scale(x, fmt, axis=axis, power_of_two=axis == 0)
        assert np.array_equal(scale.numpy().view(np.uint32), expected.view(np.uint32))
        assert np.array_equal(cast.view(torch.uint8).numpy(), ref.quantize(x, expected, fmt).view(np.uint8))
        exponents, values = fp8.mx_quantize(OPS, torch.from_numpy(x), spec)
        ref_exponents, ref_values = ref.mx_quantize(x, fmt)
        assert np.array_equal(exponents.numpy(), ref_exponents)
        assert np.array_equal(values.view(torch.uint8).numpy(), ref_values.view(np.uint8))


# -- the converted model against torchao's ------------------------------------------------------------------


#: The 50-step comparisons run in the slow set, but for one recipe per base.
TORCHAO_CASES = [
    (recipe, base) if (recipe, base) in FAST_TORCHAO_CASES else pytest.param(recipe, base, marks=pytest.mark.slow)
    for recipe in sorted(TORCHAO_RECIPES)
    for base in ("float32", "mixed_bfloat16")
]


@pytest.mark.parametrize(("recipe", "base"), TORCHAO_CASES)
def test_converted_model_equals_torchaos_over_50_adamw_steps(recipe: str, base: str) -> None:
    ours = polyamp_torch.apply_policy(mlp(), f"{base}+{recipe}")
    theirs = torchao_model(mlp(), recipe)
    assert [type(m) for m in ours if isinstance(m, torch.nn.Linear)] == [Float8Linear] * 3
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    compute = torch.bfloat16 if base == "mixed_bfloat16" else torch.float32
    torch.manual_seed(1)
    for step in range(50):
        x = torch.randn(4, 8, 64)
        y_ours = ours(x)
        y_theirs = theirs(x.to(compute)).float()  # torchao takes the compute dtype from its input on the CPU
        assert y_ours.dtype == torch.float32
        assert torch.equal(y_ours, y_theirs), step
        y_ours.square().mean().backward()
        y_theirs.square().mean().backward()
        for mine, other in zip(grads(ours), grads(theirs), strict=True):
            assert torch.equal(mine, other), step
        ours_opt.step()
        theirs_opt.step()
        ours_opt.zero_grad()
        theirs_opt.zero_grad()
    for mine, other in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine, other)


@pytest.mark.parametrize(
    ("plan", "state_bytes", "recipe"),
    [
        ("bfloat16_kahan", 10, "float8_rowwise"),
        pytest.param("bfloat16_kahan", 10, "float8_tensorwise", marks=pytest.mark.slow),
        pytest.param("bfloat16_float32_master", 16, "float8_tensorwise", marks=pytest.mark.slow),
        pytest.param("bfloat16_float32_master", 16, "float8_rowwise", marks=pytest.mark.slow),
        pytest.param("bfloat16_stochastic", 8, "float8_tensorwise", marks=pytest.mark.slow),
        pytest.param("bfloat16_stochastic", 8, "float8_rowwise", marks=pytest.mark.slow),
    ],
)
def test_a_training_state_plan_with_fp8_layers_equals_torchao_under_the_same_plan(
    plan: str, state_bytes: int, recipe: str
) -> None:
    # bfloat16 weights stepped by the plan's PrecisionOptimizer; torchao's model in bfloat16 throughout.
    ours = polyamp_torch.apply_policy(mlp(), f"{plan}+{recipe}")
    theirs = torchao_model(mlp().to(torch.bfloat16), recipe)
    assert type(ours[0]) is Float8Linear and ours[0].weight.dtype == torch.bfloat16
    optimizers = [
        polyamp_torch.PrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), plan)
        for model in (ours, theirs)
    ]
    for step in range(10):
        torch.manual_seed(100 + step)
        x = torch.randn(16, 64)
        for model, optimizer, given in ((ours, optimizers[0], x), (theirs, optimizers[1], x.to(torch.bfloat16))):
            optimizer.zero_grad()
            model(given).float().square().mean().backward()
            optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)), step
    assert polyamp_torch.measure_state_bytes(optimizers[0]).per_parameter == state_bytes


def test_apply_policy_converts_the_eligible_linears_in_place_and_remove_policy_undoes_it() -> None:
    model = torch.nn.ModuleDict(
        {"fc": torch.nn.Linear(64, 64), "odd": torch.nn.Linear(64, 40), "head": torch.nn.Linear(64, 16)}
    )
    weight = model["fc"].weight
    keys = list(model.state_dict())
    with pytest.warns(
        UserWarning, match=r"1 nn.Linear layer .* stays .*'odd' \(out_features=40 not a multiple of 16\)"
    ):
        polyamp_torch.apply_policy(model, "mixed_bfloat16+float8_tensorwise[skip=head]")
    assert [type(model[name]).__name__ for name in ("fc", "odd", "head")] == ["Float8Linear", "Linear", "Linear"]
    assert model["fc"].weight is weight and list(model.state_dict()) == keys
    assert "float8='float8_tensorwise[skip=head]'" in repr(model["fc"])
    polyamp_torch.remove_policy(model)
    assert type(model["fc"]) is torch.nn.Linear and not hasattr(model["fc"], "float8_recipe")


def test_a_subclass_of_linear_with_its_own_forward_is_left_alone() -> None:
    class Scaled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = torch.nn.Sequential(Scaled(64, 64), torch.nn.Linear(64, 32))
    with pytest.warns(UserWarning, match=r"'0' \(a subclass of nn.Linear \(Scaled\) with a forward of its own\)"):
        polyamp_torch.apply_policy(model, "float8_tensorwise")
    assert type(model[0]) is Scaled and type(model[1]).__name__ == "Float8Linear"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a layer named in the skip patterns is left out without a word
        polyamp_torch.apply_policy(model, "float8_tensorwise[skip=0]")


def test_mx_layers_compute_with_the_reference_casts() -> None:
    layer = torch.nn.Linear(64, 32, bias=False)
    model = polyamp_torch.apply_policy(torch.nn.Sequential(layer), "float32+mxfp8")
    x = torch.randn(8, 64)
    exponents, values = ref.mx_quantize(x.numpy(), "e4m3")
    w_exponents, w_values = ref.mx_quantize(layer.weight.detach().numpy(), "e4m3")

    def dequantized(e: np.ndarray, v: np.ndarray) -> torch.Tensor:
        blocks = v.astype(np.float32).reshape(*e.shape, 32) * np.exp2(e.astype(np.float32) - 127.0)[..., None]
        return torch.from_numpy(blocks.reshape(v.shape))

    expected = dequantized(exponents, values) @ dequantized(w_exponents, w_values).t()
    assert torch.equal(model(x), expected)


# -- delayed scaling ----------------------------------------------------------------------------------------


def test_delayed_scaling_state_follows_the_reference_rule_and_rests_in_eval_mode() -> None:
    layer = torch.nn.Linear(32, 16, bias=False)
    polyamp_torch.apply_policy(torch.nn.Sequential(layer), "float32+float8_delayed[amax_history_length=4]")
    history, scale = np.zeros(4, np.float32), np.ones((), np.float32)
    w_history, w_scale = np.zeros(4, np.float32), np.ones((), np.float32)
    g_history, g_scale = np.zeros(4, np.float32), np.ones((), np.float32)
    torch.manual_seed(0)
    for _ in range(6):
        x = torch.randn(8, 32) * 10.0
        out = layer(x)
        upstream = torch.randn_like(out)
        out.backward(upstream)
        _, scale, history = ref.delayed_step(x.numpy(), history, scale, "e4m3")
        _, w_scale, w_history = ref.delayed_step(layer.weight.detach().numpy(), w_history, w_scale, "e4m3")
        _, g_scale, g_history = ref.delayed_step(upstream.numpy(), g_history, g_scale, "e5m2")
        assert np.array_equal(layer.float8_input_amax_history.numpy(), history)
        assert np.array_equal(layer.float8_input_scale.numpy(), scale)
        assert np.array_equal(layer.float8_weight_scale.numpy(), w_scale)
        assert np.array_equal(layer.float8_grad_output_amax_history.numpy(), g_history)
        assert np.array_equal(layer.float8_grad_output_scale.numpy(), g_scale)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.eval()
    layer(torch.randn(8, 32))
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in state.items())


def _delayed_run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        torch.manual_seed(step)
        loss = model(torch.randn(8, 64)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def test_a_delayed_scaling_run_saved_and_resumed_continues_bitwise() -> None:
    policy = "mixed_bfloat16+float8_delayed[amax_history_length=8]"
    model = polyamp_torch.apply_policy(mlp(), policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _delayed_run(model, optimizer, range(5))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    assert "0.float8_grad_output_amax_history" in model.state_dict()
    straight = _delayed_run(model, optimizer, range(5, 10))

    resumed = polyamp_torch.apply_policy(mlp(seed=1), policy)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    again = _delayed_run(resumed, resumed_optimizer, range(5, 10))
    assert all(torch.equal(a, b) for a, b in zip(straight, again, strict=True))
    for key, value in model.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


RESUME_IN_A_NEW_PROCESS = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from test_torch_float8 import _delayed_run, mlp
import polyamp_torch

saved = torch.load(sys.argv[2])
model = polyamp_torch.apply_policy(mlp(seed=3), saved["policy"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model.load_state_dict(saved["model"])
optimizer.load_state_dict(saved["optimizer"])
losses = _delayed_run(model, optimizer, range(5, 10))
torch.save({"losses": losses, "model": model.state_dict()}, sys.argv[3])
"""


def test_a_delayed_scaling_run_resumed_in_a_new_process_continues_bitwise(tmp_path: Path) -> None:
    policy = "mixed_bfloat16+float8_delayed[amax_history_length=8,margin=1]"
    model = polyamp_torch.apply_policy(mlp(), policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _delayed_run(model, optimizer, range(5))
    torch.save(
        {"policy": policy, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "run.pt"
    )
    straight = _delayed_run(model, optimizer, range(5, 10))
    subprocess.run(
        [
            sys.executable,
            "-c",
            RESUME_IN_A_NEW_PROCESS,
            str(Path(__file__).parent),
            str(tmp_path / "run.pt"),
            str(tmp_path / "resumed.pt"),
        ],
        check=True,
        timeout=120,
    )
    resumed = torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed["losses"], strict=True))
    assert list(resumed["model"]) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(value, resumed["model"][key]), key


def test_the_float8_state_dict_is_plain_data_that_loads_into_a_fresh_model_and_resumes_bitwise() -> None:
    policy = "mixed_bfloat16+float8_delayed[amax_history_length=8]"
    model = polyamp_torch.apply_policy(mlp(), policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _delayed_run(model, optimizer, range(4))
    state = polyamp_torch.float8_state_dict(model)
    assert json.loads(json.dumps(state)) == state  # JSON-able: what another framework reads
    assert state["format"] == "polyamp.float8/1" and Float8Recipe.from_dict(state["recipe"]).amax_history_length == 8
    assert list(state["layers"]) == ["0", "2", "4"]
    assert state["layers"]["2"]["grad_output"]["amax_history"] == model[2].float8_grad_output_amax_history.tolist()
    assert state["layers"]["2"]["grad_output"]["scale"] == model[2].float8_grad_output_scale.item()

    resumed = polyamp_torch.apply_policy(mlp(seed=1), policy)
    resumed.load_state_dict({k: v for k, v in model.state_dict().items() if ".float8_" not in k}, strict=False)
    polyamp_torch.load_float8_state_dict(resumed, state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s.update(format="other"), "format 'polyamp.float8/1'"),
        (lambda s: s["layers"].pop("2"), r"missing \['2'\], unknown \[\]"),
        (lambda s: s["layers"]["0"]["input"].update(amax_history=[0.0] * 3), "amax history of 3 values; the model"),
        (lambda s: s["layers"]["0"]["weight"].update(scale=0.0), "finite scale > 0"),
        (lambda s: s["layers"]["0"]["weight"].update(scale=float("nan")), "finite scale > 0"),
    ],
)
def test_a_bad_float8_state_dict_is_refused_and_nothing_is_loaded(change: Any, match: str) -> None:
    model = polyamp_torch.apply_policy(mlp(), "float8_delayed[amax_history_length=4]")
    model(torch.randn(4, 64)).sum().backward()
    state = copy.deepcopy(polyamp_torch.float8_state_dict(model))
    before = copy.deepcopy(model.state_dict())
    state["layers"]["0"]["input"]["scale"] = 2.0  # a change that would show if anything were loaded
    change(state)
    with pytest.raises(polyamp.StateDictError, match=match):
        polyamp_torch.load_float8_state_dict(model, state)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(polyamp.PolyampValueError, match="dynamic recipes keep no state"):
        polyamp_torch.float8_state_dict(polyamp_torch.apply_policy(mlp(), "float8_tensorwise"))


def test_delayed_state_stays_float32_under_bfloat16_parameters() -> None:
    model = polyamp_torch.apply_policy(mlp(), "params=bf16,compute=bf16,output=f32+float8_delayed")
    assert model[0].weight.dtype == torch.bfloat16
    assert model[0].float8_input_scale.dtype == torch.float32


# -- checkpoints between FP8 and 16-bit models --------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["float8_tensorwise", "float8_rowwise", "mxfp8"])
def test_a_checkpoint_made_under_fp8_loads_into_a_bfloat16_model_and_back(recipe: str) -> None:
    fp8_model = polyamp_torch.apply_policy(mlp(), f"mixed_bfloat16+{recipe}")
    plain = polyamp_torch.apply_policy(mlp(seed=1), "mixed_bfloat16")
    plain.load_state_dict(fp8_model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), fp8_model.parameters(), strict=True))
    back = polyamp_torch.apply_policy(mlp(seed=2), f"mixed_bfloat16+{recipe}")
    back.load_state_dict(plain.state_dict())
    x = torch.randn(4, 64)
    assert torch.equal(back(x), fp8_model(x))


def test_a_delayed_scaling_checkpoint_loads_into_a_bfloat16_model_with_its_buffers_as_the_unexpected_keys() -> None:
    fp8_model = polyamp_torch.apply_policy(mlp(), "float8_delayed")
    fp8_model(torch.randn(4, 64)).sum().backward()
    plain = polyamp_torch.apply_policy(mlp(seed=1), "mixed_bfloat16")
    result = plain.load_state_dict(fp8_model.state_dict(), strict=False)
    assert result.missing_keys == [] and all(".float8_" in key for key in result.unexpected_keys)
    assert len(result.unexpected_keys) == 3 * 6
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), fp8_model.parameters(), strict=True))


# -- torch.compile and the loss scaler ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe",
    [
        "float8_tensorwise",
        pytest.param("float8_rowwise", marks=pytest.mark.slow),
        pytest.param("float8_rowwise_gw_hp", marks=pytest.mark.slow),
        pytest.param("float8_delayed", marks=pytest.mark.slow),
        pytest.param("mxfp8", marks=pytest.mark.slow),
    ],
)
def test_torch_compile_of_the_converted_model_has_no_graph_break(recipe: str) -> None:
    # Linear layers only: Inductor's GELU rounds otherwise than eager's, the FP8 layers compute the same.
    torch.manual_seed(0)
    stack = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 32))
    model = polyamp_torch.apply_policy(stack, f"float32+{recipe}")
    polyamp_torch.record_float8(model)
    eager = copy.deepcopy(model)
    x = torch.randn(4, 8, 64)
    explained = torch._dynamo.explain(copy.deepcopy(model))(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(model, fullgraph=True)
    out, expected = compiled(x), eager(x)
    assert torch.equal(out, expected)
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, mine), other in zip(model.named_parameters(), eager.parameters(), strict=True):
        if name.endswith("weight"):
            assert torch.equal(mine.grad, other.grad), name
        else:  # a bias's gradient is a sum, which Inductor reduces in another order
            torch.testing.assert_close(mine.grad, other.grad, rtol=1e-5, atol=1e-7)
    for key, value in model.state_dict().items():
        assert torch.equal(value, eager.state_dict()[key]), key
    counted = [(m.float8_counts, e.float8_counts) for m, e in zip(model, eager, strict=True) if recipe != "mxfp8"]
    assert all(torch.equal(mine, other) and mine.sum() > 0 for mine, other in counted)


def test_loss_scaling_under_float16_compute_unscales_fp8_gradients() -> None:
    # A power-of-two loss scale moves each dynamic FP8 scale by that power of two, so the unscaled gradients
    # are the unscaled loss's but where that loss's float16 gradients fell below 2**-14 and lost bits
    # (which the scale keeps): a bound, not equality.
    policy = "mixed_float16+float8_tensorwise"
    scaled_model, plain_model = (polyamp_torch.apply_policy(mlp(), policy) for _ in range(2))
    scaler = polyamp.LossScaler(init_scale=2.0**12, growth_interval=1)
    optimizer = torch.optim.SGD(scaled_model.parameters(), lr=1e-2)
    x = torch.randn(16, 64)
    with polyamp.policy_scope(policy):
        scaler.scale(scaled_model(x).float().square().mean()).backward()
        scaler.unscale_(optimizer)
    plain_model(x).float().square().mean().backward()
    scaled_grads, plain_grads = grads(scaled_model), grads(plain_model)
    for mine, other in zip(scaled_grads, plain_grads, strict=True):
        assert ((mine - other).norm() / other.norm()).item() < 0.02
    scaler.step(optimizer)
    scaler.update()
    assert scaler.last_record().mode == "scaling" and scaler.get_scale() == 2.0**13


def test_the_bfloat16_guard_skips_a_step_whose_fp8_gradients_are_not_finite() -> None:
    model = polyamp_torch.apply_policy(mlp(), "float8_rowwise")
    scaler = polyamp.LossScaler()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    with polyamp.policy_scope("float8_rowwise"):
        loss = model(torch.full((4, 64), float("nan"))).float().sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.last_record().mode == "guarding" and int(scaler.skipped_steps()) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# -- records ------------------------------------------------------------------------------------------------


def test_records_count_saturated_and_flushed_values_per_layer_and_reset_when_read() -> None:
    layer = torch.nn.Linear(64, 16, bias=False)
    model = polyamp_torch.apply_policy(torch.nn.Sequential(layer), "float32+float8_delayed[amax_history_length=2]")
    records = polyamp_torch.record_float8(model)
    x = torch.randn(8, 64)
    x[0, :5] = 1000.0  # past E4M3's 448 with the initial scale of 1
    x[1, :3] = 1e-12  # below E4M3's smallest subnormal: flushed
    model(x).sum().backward()
    read = records.read()
    assert list(read) == ["0"]
    assert read["0"]["input"] == polyamp.backend_api.records.Float8CastRecord(5, 3, int((x != 0).sum()))
    assert read["0"]["grad_output"].saturated == 0 and read["0"]["grad_output"].nonzero == 8 * 16
    assert read["0"]["input"].flushed_fraction == 3 / int((x != 0).sum())
    assert records.read()["0"]["input"].nonzero == 0


def test_records_of_current_scaling_equal_the_reference_counts() -> None:
    model = polyamp_torch.apply_policy(mlp(), "float32+float8_tensorwise")
    records = polyamp_torch.record_float8(model)
    x = torch.randn(16, 64) * torch.logspace(-30, 3, 64)
    model(x).sum().backward()
    scale = ref.current_scale(x.numpy(), "e4m3")
    cast = ref.quantize(x.numpy(), scale, "e4m3")
    flushed = int(np.sum((x.numpy() != 0) & (cast.astype(np.float32) == 0)))
    assert records.read()["0"]["input"] == polyamp.backend_api.records.Float8CastRecord(0, flushed, x.numel())


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_records_of_mx_layers_equal_the_reference_counts(rounding: str) -> None:
    model = polyamp_torch.apply_policy(mlp(), f"float32+mxfp8[mx_rounding={rounding}]")
    records = polyamp_torch.record_float8(model)
    x = torch.randn(16, 64) * torch.logspace(-45, 3, 64)  # whole blocks of tiny values beside large ones
    model(x).sum().backward()
    exponents, cast = ref.mx_quantize(x.numpy(), "e4m3", rounding=rounding)
    scale = np.exp2(exponents.astype(np.float32) - 127.0).repeat(32, axis=-1)
    magnitude = np.abs(x.numpy() / scale)
    expected = polyamp.backend_api.records.Float8CastRecord(
        int(np.sum(magnitude > 448.0)),
        int(np.sum((x.numpy() != 0) & (cast.astype(np.float32) == 0))),
        int(np.sum(x.numpy() != 0)),
    )
    read = records.read()
    assert list(read) == ["0", "2", "4"]
    assert read["0"]["input"] == expected and expected.flushed > 0
    if rounding == "floor":  # the OCP rule rounds the block's exponent down: its largest values saturate
        assert expected.saturated > 0
    assert read["4"]["grad_output"] == polyamp.backend_api.records.Float8CastRecord(0, 0, 16 * 32)  # sum()'s ones


def test_the_policy_reports_its_recipe() -> None:
    model = polyamp_torch.apply_policy(mlp(), "float8_rowwise")
    assert polyamp_torch.module_policy(model).float8 == Float8Recipe.preset("float8_rowwise")


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_an_mx_block_holding_a_nan_comes_back_all_nan_on_the_device_and_in_the_reference(rounding: str) -> None:
    # E8M0's exponent 255 is NaN: the block decodes to NaN whatever its FP8 values (floor leaves them finite).
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((32, 64)).astype(np.float32)
    x[0, 5] = np.nan
    layer = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
    polyamp_torch.apply_policy(torch.nn.Sequential(layer), f"float32+mxfp8[mx_rounding={rounding}]")
    out = layer(torch.from_numpy(x)).detach().numpy()
    recipe = dataclasses.replace(Float8Recipe.preset("mxfp8"), mx_rounding=rounding)
    expected = ref.linear(x, w, np.ones((4, 32), np.float32), recipe)["output"]
    assert np.isnan(out[0]).all() and np.isnan(expected[0]).all()
    assert np.isfinite(out[1:]).all() and np.allclose(out[1:], expected[1:], rtol=1e-5, atol=1e-5)
