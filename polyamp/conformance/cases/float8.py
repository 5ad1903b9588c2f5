"""FP8: one linear layer under each recipe against the reference quantizer, delayed scaling's state step by
step, and that state moving between backends."""

from __future__ import annotations

import dataclasses
from typing import Any

from polyamp import Float8Recipe
from polyamp.conformance._context import expect_divergence, parametrize, requires

#: The dynamic recipes (each cast scaled from its own tensor), by preset.
DYNAMIC = ("float8_tensorwise", "float8_rowwise", "float8_rowwise_gw_hp", "mxfp8")
#: The inputs each recipe is checked on: their kinds of values.
KINDS = ("normal", "outliers", "zero_rows", "tiny")
#: The layer: ``x`` of (M, K) times ``weight.T`` of (K, N).
M, K, N = 16, 64, 32


def _arrays(kind: str, seed: int) -> tuple[Any, Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    weight = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    upstream = rng.standard_normal((M, N)).astype(np.float32)
    if kind == "outliers":
        x[rng.integers(0, M, 4), rng.integers(0, K, 4)] = 3.0e3  # past E4M3's 448 unscaled
        upstream[0, :3] = -1.0e4
    elif kind == "zero_rows":
        x[::4] = 0.0
        upstream[1::5] = 0.0
    elif kind == "tiny":
        x *= np.float32(2.0**-40)  # scales far from 1, values below the formats' subnormals unscaled
        upstream *= np.float32(2.0**-30)
    return x, weight, upstream


def _bounded(name: str, got: Any, expected: Any, a: Any, b: Any, recipe: Float8Recipe, where: str) -> None:
    """``got`` within the bound of a float32 matmul of FP8 operands from the reference's float64 product
    ``expected`` of the same operands: ``(k + 4) * 2**-24 * (|a| @ |b|) * 1.125**2`` for the product ``a @ b``
    of the operands before their casts (a cast moves a value by at most 2**-3 of it, E5M2's spacing), plus
    ``2**-8 * |expected|`` under row scaling (torchao's rowwise kernels, which polyamp_torch follows, round
    the product to bfloat16)."""
    import numpy as np

    got = np.asarray(got, np.float64)
    if got.shape != expected.shape or not np.all(np.isfinite(got)):
        raise AssertionError(f"{where}: {name} has shape {got.shape} or non-finite values; expected {expected.shape}")
    a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    bound = (a.shape[-1] + 4) * 2.0**-24 * (a @ b) * 1.125**2
    if recipe.granularity == "row":
        bound = bound + 2.0**-8 * np.abs(expected.astype(np.float64))
    excess = np.abs(got - expected) - bound
    if np.any(excess > 0):
        index = np.unravel_index(int(np.argmax(excess)), excess.shape)
        raise AssertionError(
            f"{where}: {name}{list(index)} = {got[index]!r}, the reference {expected[index]!r}, off by more than "
            f"the bound {bound[index]!r}"
        )


@parametrize("kind", KINDS)
@parametrize("preset", DYNAMIC)
@requires("float8_linear")
def test_float8_linear_follows_the_reference(harness: Any, preset: str, kind: str) -> None:
    """A linear layer under each dynamic recipe: output, grad-input and grad-weight are the reference's FP8
    operands multiplied in float32 (within float32 accumulation's bound of the reference's float64 product)."""
    from polyamp._src import float8_reference as ref

    recipe = Float8Recipe.preset(preset)
    x, weight, upstream = _arrays(kind, seed=DYNAMIC.index(preset))
    got = harness.float8_linear(recipe, x, weight, upstream)
    expected = ref.linear(x, weight, upstream, recipe)
    where = f"{preset} on {kind} inputs, {harness.backend}-{harness.device}"
    _bounded("output", got["output"], expected["output"], x, weight.T, recipe, where)
    _bounded("grad_input", got["grad_input"], expected["grad_input"], upstream, weight, recipe, where)
    _bounded("grad_weight", got["grad_weight"], expected["grad_weight"], upstream.T, x, recipe, where)


@parametrize("margin", (0, 1))
@requires("float8_delayed")
def test_float8_delayed_steps_follow_the_reference(harness: Any, margin: int) -> None:
    """Delayed scaling over five steps with an outlier in the third: each operand's amax history and scale
    equal the reference's bit for bit, and the outputs are its FP8 operands' products."""
    import numpy as np

    from polyamp._src import float8_reference as ref

    recipe = dataclasses.replace(Float8Recipe.preset("float8_delayed"), amax_history_length=3, margin=margin)
    steps = [_arrays("outliers" if i == 2 else "normal", seed=10 + i) for i in range(5)]
    xs, upstreams = [s[0] for s in steps], [s[2] for s in steps]
    weight = steps[0][1]
    outputs, state = harness.float8_delayed(recipe, xs, weight, upstreams, None)
    expected_outputs, expected = ref.delayed_linear(xs, weight, upstreams, recipe)
    where = f"float8_delayed[margin={margin}] on {harness.backend}-{harness.device}"
    for role, (history, scale) in expected.items():
        got = state["layers"]["layer"][role]
        if got["amax_history"] != history.tolist() or got["scale"] != float(scale):
            raise AssertionError(
                f"{where}: the {role} state is {got}, the reference's history {history.tolist()} and scale {float(scale)!r}"
            )
    expect_divergence(harness, "float8_delayed_cast_scale")  # the states above are the same everywhere
    for step, (got, want) in enumerate(zip(outputs, expected_outputs, strict=True)):
        largest = float(np.abs(want).max())
        reach = largest if largest > 1.0 else 1.0
        if not np.allclose(np.asarray(got, np.float64), want, rtol=2.0**-16, atol=2.0**-16 * reach):
            raise AssertionError(f"{where}: step {step}'s output is off the reference's by more than 2**-16")


@requires("float8_delayed")
def test_float8_delayed_state_resumes_across_backends(harness_pair: Any) -> None:
    """A delayed-scaling run's state, saved on one backend after three steps, resumes on the other: two more
    steps there give the state five steps give on the first, bit for bit."""
    recipe = dataclasses.replace(Float8Recipe.preset("float8_delayed"), amax_history_length=4)
    steps = [_arrays("outliers" if i == 1 else "normal", seed=20 + i) for i in range(5)]
    xs, upstreams, weight = [s[0] for s in steps], [s[2] for s in steps], steps[0][1]
    for source, target in (harness_pair, harness_pair[::-1]):
        _, straight = source.float8_delayed(recipe, xs, weight, upstreams, None)
        _, saved = source.float8_delayed(recipe, xs[:3], weight, upstreams[:3], None)
        _, resumed = target.float8_delayed(recipe, xs[3:], weight, upstreams[3:], saved)
        if resumed["layers"] != straight["layers"]:
            raise AssertionError(
                f"resumed on {target.backend} from {source.backend}: {resumed['layers']}, but five steps on "
                f"{source.backend} give {straight['layers']}"
            )
