"""The conformance cases: polyamp's semantics, checked on any backend through its harness.

Every case takes a `Harness` (or, for cross-backend cases, ``harness_pair``) and talks to the framework
only through it; results are compared as NumPy arrays. Run them with ``python -m polyamp.conformance`` or
import them into a pytest module (see tests/test_conformance.py in polyamp's repository).
"""

from __future__ import annotations

import math
from typing import Any

from polyamp import LossScaleConfig, Policy, SpikeRule
from polyamp.backend_api.records import layer_of
from polyamp.conformance._context import (
    assert_close,
    assert_dtype,
    assert_equal_arrays,
    expect_divergence,
    parametrize,
    requires,
    skip,
)
from polyamp.conformance._protocol import COMPUTE_OPS, OPS

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")

#: Shared trajectory vectors: (name, scaler settings, policy, pattern of F finite / O planted overflow).
TRAJECTORY_VECTORS: list[tuple[str, dict[str, Any], str, str]] = [
    ("default_rule", {"growth_interval": 3}, "mixed_float16", "FFFOFFOOFFFFFF"),
    ("hysteresis", {"growth_interval": 3, "hysteresis": 2}, "float32", "FOFOOOFFFFOFOOOO"),
    (
        "min_max",
        {"init_scale": 64.0, "growth_interval": 2, "min_scale": 16.0, "max_scale": 128.0},
        "float32",
        "FFFFFFOOOOOFF",
    ),
    (
        "odd_factors",
        {"init_scale": 1000.0, "growth_factor": 1.37, "backoff_factor": 0.61, "growth_interval": 2},
        "float32",
        "FFFFOFOOFFFF",
    ),
    ("static", {"init_scale": 512.0, "growth_interval": 1, "dynamic": False}, "float32", "FFOFOOFF"),
    ("growth_guard", {"init_scale": 2.0**100, "growth_factor": 2.0**10, "growth_interval": 1}, "float32", "FFFFF"),
]


def _data(n: int = 256, seed: int = 0) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = x[:, :4].argmax(axis=1).astype("int64")
    return x, y


def _batches(steps: int, size: int = 32) -> list[tuple[Any, Any]]:
    x, y = _data()
    return [(x[(i * size) % len(x) :][:size], y[(i * size) % len(y) :][:size]) for i in range(steps)]


# -- policy -> dtypes ------------------------------------------------------------------------------------


@parametrize("op", OPS)
@parametrize("policy", POLICIES)
@requires("op_dtype")
def test_op_dtype(harness: Any, policy: str, op: str) -> None:
    """matmul/dense/conv run in the compute dtype; softmax, log-softmax, losses, norms, sums in float32."""
    parsed = Policy(policy)
    expected = parsed.compute_dtype if op in COMPUTE_OPS else "float32"
    if parsed.compute_dtype != "float32":
        expect_divergence(harness, f"op:{op}")
    assert_dtype(harness.op_dtype(op, parsed), expected, f"{op}(policy={policy}) on {harness.backend}-{harness.device}")


@parametrize("policy", POLICIES)
@requires("model_dtypes")
def test_model_dtypes(harness: Any, policy: str) -> None:
    """Parameters in the param dtype, model outputs in the output dtype."""
    parsed = Policy(policy)
    params, output = harness.model_dtypes(parsed)
    for index, dtype in enumerate(params):
        assert_dtype(dtype, parsed.param_dtype, f"parameter {index} (policy={policy})")
    assert_dtype(output, parsed.output_dtype, f"model output (policy={policy})")


# -- loss-scale trajectories -----------------------------------------------------------------------------


def _mismatch(states: list[Any], expected: list[Any], pattern: str, what: str) -> None:
    for step, (got, want) in enumerate(zip(states, expected, strict=True)):
        if got != want:
            raise AssertionError(
                f"after step {step} ({pattern[: step + 1]}): (scale, tracker, hysteresis)={got}, but should be "
                f"{want} [{what}]"
            )


def _drive(trainer: Any, pattern: str) -> list[tuple[float, int, int]]:
    states = []
    for (x, y), char in zip(_batches(len(pattern)), pattern, strict=True):
        trainer.step(x, y, overflow=char == "O")
        state = trainer.scaler.state_dict()
        states.append((state["scale"], state["_growth_tracker"], state["hysteresis_left"]))
    return states


def _reference(config: dict[str, Any], pattern: str, state: Any = None) -> list[tuple[float, int, int]]:
    reference = LossScaleConfig(**config)
    return [(s.scale, s.growth_tracker, s.hysteresis_left) for s in reference.states(pattern, state)]


@parametrize("vector", [name for name, *_ in TRAJECTORY_VECTORS])
@requires("trainer")
def test_trajectory_matches_the_reference(harness: Any, vector: str) -> None:
    """Scale, growth counter and hysteresis after every step equal the core reference's."""
    _, config, policy, pattern = next(v for v in TRAJECTORY_VECTORS if v[0] == vector)
    trainer = harness.trainer(Policy(policy), scaler={**config, "enabled": True})
    states = _drive(trainer, pattern)
    _mismatch(states, _reference(config, pattern), pattern, f"{vector} on {harness.backend}-{harness.device}")


def random_settings(seed: int) -> tuple[dict[str, Any], str]:
    """Loss-scaling settings and an overflow pattern drawn from ``seed`` (the same on every machine)."""
    import random

    rng = random.Random(seed)
    # Scales stay far from float32's overflow, so only the planted overflows overflow.
    init_scale = rng.choice([1.0, 3.0, 512.0, 1000.0, 2.0**16, 2.0**40])
    config: dict[str, Any] = {
        "init_scale": init_scale,
        "growth_factor": rng.choice([2.0, 1.5, rng.uniform(1.01, 4.0)]),
        "backoff_factor": rng.choice([0.5, 0.25, rng.uniform(0.05, 0.95)]),
        "growth_interval": rng.randint(1, 4),
        "hysteresis": rng.randint(1, 3),
        "dynamic": rng.random() > 0.1,
    }
    if rng.random() < 0.4:
        config["min_scale"] = init_scale / rng.choice([2.0, 8.0, 64.0])
    if rng.random() < 0.4:
        config["max_scale"] = init_scale * rng.choice([1.0, 4.0, 1000.0])
    pattern = "".join(rng.choice("FFO") for _ in range(18))
    return config, pattern


@parametrize("seed", list(range(6)))
@requires("trainer")
def test_random_settings_follow_the_reference(harness: Any, seed: int) -> None:
    """Seeded random settings and overflow patterns: the device state equals the reference after every step."""
    config, pattern = random_settings(seed)
    trainer = harness.trainer(Policy("float32"), scaler={**config, "enabled": True}, seed=seed)
    _mismatch(_drive(trainer, pattern), _reference(config, pattern), pattern, f"seed {seed}: {config}")


@parametrize("vector", ["default_rule", "hysteresis", "min_max", "odd_factors"])
@requires("functional")
def test_functional_form_follows_the_reference(harness: Any, vector: str) -> None:
    """The stateless form (state in, state out) follows the same rule, and skips the same steps."""
    _, config, policy, pattern = next(v for v in TRAJECTORY_VECTORS if v[0] == vector)
    trainer = harness.functional_trainer(Policy(policy), scaler={**config, "enabled": True})
    _mismatch(_drive(trainer, pattern), _reference(config, pattern), pattern, f"functional {vector}")
    before = trainer.params()
    ((x, y),) = _batches(1)
    trainer.step(x, y, overflow=True)
    assert_equal_arrays(trainer.params(), before, "parameters after a skipped functional step")


#: The functional case's pattern: F finite, O planted overflow, S a spike (the batch's inputs times 40).
FUNCTIONAL_PATTERN = "FFFFSFOFFSSSFFOFFF"


def _spike_window(rule: SpikeRule, losses: list[float], overflows: list[bool]) -> tuple[list[float], int]:
    """The rule's window and run after ``losses``, by the reference's trace (`SpikeRule.decide`)."""
    window: list[float] = []
    run = 0
    spikes, rebased = rule.decide(losses, overflows), rule.rebased(losses, overflows)
    for x, spike, overflow, rebase in zip(losses, spikes, overflows, rebased, strict=True):
        if spike:
            run += 1
        elif not overflow and math.isfinite(x):
            window = ([] if rebase else window) + [x]
            window, run = window[-rule.window :], 0
    return window, run


@parametrize("mode", ["scaling", "guarding"])
@requires("functional")
def test_functional_form_guards_records_and_spikes(harness: Any, mode: str) -> None:
    """The stateless form with the guard (``enabled=False, guard=True``) or scaling, and a `polyamp.SpikeRule`
    on the loss: it skips the reference's steps (overflows, spikes; a run of ``max_consecutive`` spikes
    re-bases the window), leaves the parameters of a skipped step unchanged, and its records, skip count and
    state dict (spike window and run included) are the reference's."""
    rule = SpikeRule("loss", window=4, warmup=3, threshold=3.0, max_consecutive=2)
    settings: dict[str, Any] = {"growth_interval": 2, "hysteresis": 1}
    options = {"enabled": True} if mode == "scaling" else {"enabled": False, "guard": True}
    trainer = harness.functional_trainer(Policy("float32"), scaler={**settings, **options, "spike": rule})
    where = f"functional {mode} on {harness.backend}-{harness.device}"
    pattern = FUNCTIONAL_PATTERN
    losses, skips = [], []
    for index, ((x, y), char) in enumerate(zip(_batches(len(pattern)), pattern, strict=True)):
        before = trainer.params()
        losses.append(float(trainer.step(x * 40.0 if char == "S" else x, y, overflow=char == "O")))
        skips.append(bool(trainer.step_skipped()))
        if skips[-1]:
            assert_equal_arrays(trainer.params(), before, f"parameters after skipped step {index} ({where})")
    overflows = [char == "O" for char in pattern]
    spikes, rebased = rule.decide(losses, overflows), rule.rebased(losses, overflows)
    missed = [i for i, char in enumerate(pattern) if char == "S" and not spikes[i] and not rebased[i]]
    if missed or not any(rebased):
        raise AssertionError(
            f"the case's spikes did not come out as planned ({where}): losses {losses}; spikes {spikes}; "
            f"re-based {rebased}"
        )
    want_skips = [o or s for o, s in zip(overflows, spikes, strict=True)]
    if skips != want_skips:
        raise AssertionError(f"step_skipped() per step: {skips}, expected {want_skips} ({where})")
    reference = LossScaleConfig(**settings)
    states = [reference.initial_state(), *reference.states("".join("O" if o else "F" for o in overflows))]
    scaled = mode == "scaling"
    overflow = "overflow" if scaled else "non_finite"
    want = [
        (
            i,
            want_skips[i],
            overflow if overflows[i] else "loss_spike" if spikes[i] else None,
            mode,
            states[i].scale if scaled else None,
            states[i + 1].scale if scaled else None,
            rebased[i],
        )
        for i in range(len(pattern))
    ]
    got = [
        (r.iteration, r.skipped, r.reason, r.mode, r.scale, r.next_scale, r.rebased) for r in trainer.scaler.records()
    ]
    if got != want:
        raise AssertionError(f"records ({where}): {got}, expected {want}")
    if int(trainer.scaler.skipped_steps()) != sum(want_skips):
        raise AssertionError(f"skipped_steps() = {int(trainer.scaler.skipped_steps())}, expected {sum(want_skips)}")
    saved = trainer.scaler.state_dict()
    window, run = _spike_window(rule, losses, overflows)
    final = states[-1] if scaled else reference.initial_state()
    got_state = (saved["scale"], saved["_growth_tracker"], saved["spike_window"], saved["spike_run"])
    want_state = (final.scale, final.growth_tracker, window, run)
    if got_state != want_state:
        raise AssertionError(
            f"(scale, tracker, spike_window, spike_run) = {got_state}, expected {want_state} ({where})"
        )


#: One sequence for every loop style: F finite, O a planted inf, N NaN inputs, S a spike (inputs times 40).
ONE_SEQUENCE = "FFFFSFOFFNSSSFFOFF"


def _one_sequence_expected(pattern: str, rule: SpikeRule) -> tuple[list[bool], list[bool], list[bool]]:
    """(overflow, spike, re-based) per step of ``pattern`` under ``rule`` by construction: every S is 40
    times the inputs of an F, far outside any window of F steps, so it is a spike once the window holds
    ``min_values`` statistics, until ``max_consecutive`` spikes in a row make the next one re-base the window;
    F steps never are (the rule is one-sided and they stay within the F steps' spread)."""
    overflows, spikes, rebased = [], [], []
    accepted, run = 0, 0  # statistics in the window; spikes since one was accepted
    for char in pattern:
        overflow = char in "ON"
        at_limit = rule.rebases(run)
        spike = char == "S" and accepted >= rule.min_values and not at_limit
        rebase = not overflow and at_limit
        overflows.append(overflow)
        spikes.append(spike)
        rebased.append(rebase)
        if spike:
            run += 1
        elif not overflow:
            accepted = 1 if rebase else accepted + 1
            run = 0
    return overflows, spikes, rebased


@requires("trainer")
def test_one_sequence_every_loop_style(harness: Any) -> None:
    """One sequence of finite steps, planted infs, NaN batches and gradient-norm spikes, through the harness's
    training loop (the torch and TensorFlow `polyamp.LossScaler`, Keras's ``LossScaleOptimizer`` stateful,
    and stateless under ``jax.jit`` on JAX) and its functional form where it has one: the same skips, records
    (reason, scale, next scale, re-base), skip count and state dict, the reference's, everywhere."""
    rule = SpikeRule("grad_norm", window=4, warmup=3, threshold=6.0, max_consecutive=2)
    settings: dict[str, Any] = {"growth_interval": 2, "hysteresis": 1}
    scaler = {**settings, "enabled": True, "spike": rule}
    loops = [("loop", harness.trainer(Policy("float32"), scaler=scaler))]
    if callable(getattr(harness, "functional_trainer", None)):
        loops.append(("functional", harness.functional_trainer(Policy("float32"), scaler=scaler)))
    pattern = ONE_SEQUENCE
    overflows, spikes, rebased = _one_sequence_expected(pattern, rule)
    want_skips = [o or s for o, s in zip(overflows, spikes, strict=True)]
    reference = LossScaleConfig(**settings)
    states = [reference.initial_state(), *reference.states("".join("O" if o else "F" for o in overflows))]
    want = [
        (
            i,
            want_skips[i],
            "overflow" if overflows[i] else "grad_spike" if spikes[i] else None,
            "scaling",
            states[i].scale,
            states[i + 1].scale,
            rebased[i],
        )
        for i in range(len(pattern))
    ]
    for name, trainer in loops:
        where = f"{name} on {harness.backend}-{harness.device}"
        skips = []
        for index, ((x, y), char) in enumerate(zip(_batches(len(pattern)), pattern, strict=True)):
            before = trainer.params()
            inputs = x * 40.0 if char == "S" else x * float("nan") if char == "N" else x
            trainer.step(inputs, y, overflow=char == "O")
            skips.append(bool(trainer.step_skipped()))
            if skips[-1]:
                assert_equal_arrays(trainer.params(), before, f"parameters after skipped step {index} ({where})")
        if skips != want_skips:
            raise AssertionError(f"skipped per step: {skips}, expected {want_skips} ({where})")
        got = [
            (r.iteration, r.skipped, r.reason, r.mode, r.scale, r.next_scale, r.rebased)
            for r in trainer.scaler.records()
        ]
        if got != want:
            raise AssertionError(f"records ({where}): {got}, expected {want}")
        saved = trainer.scaler.state_dict()
        final = states[-1]
        got_state = (saved["scale"], saved["_growth_tracker"], saved["spike_run"], len(saved["spike_window"]))
        # The window after the sequence: the re-basing spike, then the F steps applied after it.
        applied_after = sum(1 for i in range(pattern.rindex("S") + 1, len(pattern)) if not want_skips[i])
        want_state = (final.scale, final.growth_tracker, 0, min(rule.window, 1 + applied_after))
        if got_state != want_state:
            raise AssertionError(
                f"(scale, tracker, spike_run, window size) = {got_state}, expected {want_state} ({where})"
            )


@requires("trainer")
def test_cross_backend_same_trajectory_and_resume(harness_pair: Any) -> None:
    """One pattern on two backends gives one trajectory; a state dict saved by one resumes on the other."""
    first, second = harness_pair
    config = {"growth_interval": 2, "hysteresis": 2, "min_scale": 1024.0, "enabled": True}
    pattern = "FFOFOOFFFFOOOOFF"
    trajectories = [_drive(h.trainer(Policy("float32"), scaler=config), pattern) for h in (first, second)]
    if trajectories[0] != trajectories[1]:
        raise AssertionError(f"{first.backend}: {trajectories[0]} but {second.backend}: {trajectories[1]}")
    for source, target in ((first, second), (second, first)):
        trainer = source.trainer(Policy("float32"), scaler=config)
        _drive(trainer, pattern[:7])
        saved = trainer.scaler.state_dict()
        resumed = target.trainer(Policy("float32"), scaler={"enabled": True})
        resumed.scaler.load_state_dict(saved)
        states = _drive(resumed, pattern[7:])
        expected = [state for state in _reference({k: v for k, v in config.items() if k != "enabled"}, pattern)][7:]
        if states != expected:
            raise AssertionError(
                f"resumed on {target.backend} from {source.backend}: {states}, but should be {expected}"
            )


# -- one iteration, several optimizers; misuse --------------------------------------------------------------


def _flag(value: Any) -> bool:
    return bool(value)


@requires("loop")
def test_two_optimizers_skip_separately_and_update_once(harness: Any) -> None:
    """First optimizer overflows, second does not: the first skips, the second applies, one backoff."""
    loop = harness.loop(Policy("mixed_float16"), scaler={"growth_interval": 3, "enabled": True})
    scaler = loop.scaler
    loop.backward()
    loop.step(0)
    loop.step(1)
    loop.update()  # a finite iteration: the growth counter goes up once, not once per optimizer
    state = scaler.state_dict()
    if (state["scale"], state["_growth_tracker"]) != (65536.0, 1):
        raise AssertionError(f"after one finite iteration: scale {state['scale']}, tracker {state['_growth_tracker']}")
    first, second = loop.params(0), loop.params(1)
    first_state = loop.optimizer_state(0)
    loop.backward(overflow=(0,))
    loop.step(0)
    loop.step(1)
    loop.update()
    answers = (_flag(scaler.step_skipped(loop.optimizers[0])), _flag(scaler.step_skipped(loop.optimizers[1])))
    if answers != (True, False):
        raise AssertionError(f"step_skipped per optimizer = {answers}, but should be (True, False)")
    if not _flag(scaler.step_skipped()):
        raise AssertionError("step_skipped() for the iteration should be True: one of its steps was skipped")
    assert_equal_arrays(loop.params(0), first, "parameters of the optimizer whose step was skipped")
    assert_equal_arrays(loop.optimizer_state(0), first_state, "state of the optimizer whose step was skipped")
    changed = [not __import__("numpy").array_equal(a, b) for a, b in zip(loop.params(1), second, strict=True)]
    if not any(changed):
        raise AssertionError("the optimizer with finite gradients did not step")
    state = scaler.state_dict()
    expected = LossScaleConfig(growth_interval=3).states("FO")[-1]
    if (state["scale"], state["_growth_tracker"]) != (expected.scale, expected.growth_tracker):
        raise AssertionError(
            f"after the overflowing iteration: (scale, tracker)=({state['scale']}, {state['_growth_tracker']}), "
            f"but should be ({expected.scale}, {expected.growth_tracker}): one update per iteration"
        )
    if int(scaler.skipped_steps()) != 1:
        raise AssertionError(f"skipped_steps()={int(scaler.skipped_steps())}, but one iteration was skipped")


#: Misuse and the calls that commit it, after a backward pass; the same ScalerUsageError on every backend.
MISUSES: dict[str, Any] = {
    "step_twice": lambda loop: (loop.step(0), loop.step(0)),
    "unscale_twice": lambda loop: (loop.unscale(0), loop.unscale(0)),
    "update_with_nothing_stepped": lambda loop: loop.update(),
    "load_state_dict_mid_iteration": lambda loop: (loop.step(0), loop.scaler.load_state_dict(loop.scaler.state_dict())),
    "pickle_mid_iteration": lambda loop: (loop.step(0), __import__("pickle").dumps(loop.scaler)),
}


@parametrize("misuse", list(MISUSES))
@requires("loop")
def test_misuse_is_the_same_error_everywhere_and_leaves_no_trace(harness: Any, misuse: str) -> None:
    """Each misuse raises polyamp.ScalerUsageError (a RuntimeError); afterwards the iteration completes."""
    from polyamp import ScalerUsageError

    loop = harness.loop(Policy("mixed_float16"), scaler={"growth_interval": 3, "enabled": True})
    loop.backward()
    before = loop.scaler.state_dict()
    try:
        MISUSES[misuse](loop)
    except ScalerUsageError as exc:
        if not isinstance(exc, RuntimeError):
            raise AssertionError("ScalerUsageError should be a RuntimeError") from exc
    else:
        raise AssertionError(f"{misuse}: no ScalerUsageError on {harness.backend}-{harness.device}")
    if loop.scaler.state_dict() != before:
        raise AssertionError(f"{misuse}: the refused call changed the scaler's state")
    for index in (0, 1):  # finish the iteration the ordinary way
        try:
            loop.step(index)
        except ScalerUsageError:
            pass  # already stepped by the misuse sequence
    loop.update()
    loop.backward()
    loop.step(0)
    loop.step(1)
    loop.update()
    state = loop.scaler.state_dict()
    if (state["scale"], state["_growth_tracker"]) != (65536.0, 2):
        raise AssertionError(
            f"{misuse}: (scale, tracker)=({state['scale']}, {state['_growth_tracker']}) after two finite "
            "iterations, but should be (65536.0, 2)"
        )


# -- skipping, underflow, clipping, the disabled path ------------------------------------------------------


@parametrize("optimizer", ["sgd", "adam"])
@requires("trainer")
def test_skipped_step_changes_nothing(harness: Any, optimizer: str) -> None:
    """Parameters, optimizer slots and step counters are bitwise unchanged by a skipped step."""
    trainer = harness.trainer(Policy("mixed_float16"), scaler={"enabled": True}, optimizer=optimizer)
    (x0, y0), (x1, y1) = _batches(2)
    trainer.step(x0, y0)
    params, state = trainer.params(), trainer.optimizer_state()
    trainer.step(x1, y1, overflow=True)
    if not trainer.step_skipped():
        raise AssertionError("the step with a non-finite gradient was not reported as skipped")
    assert_equal_arrays(trainer.params(), params, f"parameters after a skipped {optimizer} step")
    assert_equal_arrays(trainer.optimizer_state(), state, f"{optimizer} state after a skipped step")


def _stored_in(arrays: list[Any], dtype: str) -> bool:
    """Whether every value of ``arrays`` (float32 NumPy arrays) is a value of ``dtype``."""
    import numpy as np

    for array in arrays:
        values = np.ascontiguousarray(array, dtype=np.float32)
        if dtype == "bfloat16" and np.any(values.view(np.uint32) & 0xFFFF):
            return False
        if dtype == "float16" and not np.array_equal(values.astype(np.float16).astype(np.float32), values):
            return False
    return True


@parametrize("plan", ["bfloat16_float32_master", "bfloat16_kahan", "bfloat16_stochastic"])
@parametrize("optimizer", ["sgd", "adam"])
@requires("trainer", "precision")
def test_training_state_plan_skips_keep_every_state_tensor(harness: Any, plan: str, optimizer: str) -> None:
    """A training-state plan (bfloat16 weights; a float32 master copy, or bfloat16 moments with Kahan or
    stochastic rounding) under the guard: every applied step stores bfloat16 weights and moves them; the step
    whose gradient holds inf is skipped and recorded, and weights, master copies, moments, compensation buffers
    and counters keep their bits."""
    trainer = harness.trainer(Policy(plan), scaler={"enabled": None}, optimizer=optimizer)
    bad = 2
    for index, (x, y) in enumerate(_batches(5)):
        before = (trainer.params(), trainer.optimizer_state())
        trainer.step(x, y, overflow=index == bad)
        if index == bad:
            if not trainer.step_skipped():
                raise AssertionError(f"{plan}: the step whose gradient held inf was not skipped")
            assert_equal_arrays(trainer.params(), before[0], f"{plan}: weights after a skipped step")
            assert_equal_arrays(trainer.optimizer_state(), before[1], f"{plan}: training state after a skipped step")
            continue
        if trainer.step_skipped():
            raise AssertionError(f"{plan}: finite step {index} was skipped")
        if not _stored_in(trainer.params(), "bfloat16"):
            raise AssertionError(f"{plan}: after step {index} the weights hold values that are not bfloat16")
        if all(
            a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(trainer.params(), before[0], strict=True)
        ):
            raise AssertionError(f"{plan}: step {index} left every weight as it was")
    records = trainer.scaler.records()
    skipped = [r.iteration for r in records if r.skipped]
    if skipped != [bad] or records[bad].reason != "non_finite":
        raise AssertionError(f"{plan}: records say skipped {skipped} ({records[bad].reason}), expected [{bad}]")


@requires("tiny_gradient", "low_precision")
def test_underflow_rescue(harness: Any) -> None:
    """A ~1e-8 gradient flushes to zero in float16 without scaling and survives with it."""
    import numpy as np

    rng = np.random.default_rng(3)
    x = rng.uniform(0.5, 1.0, size=(4, 8)).astype("float32")
    w = rng.normal(size=(8, 3)).astype("float32")
    factor = 1e-8
    reference = factor * np.repeat(x.sum(axis=0, dtype=np.float64)[:, None], 3, axis=1)
    policy = Policy("mixed_float16")
    unscaled = harness.tiny_gradient(x, w, factor, policy, None)
    if np.any(unscaled != 0):
        skip(f"{harness.backend}-{harness.device} keeps this gradient without scaling; nothing to rescue")
    scaler = _new_scaler(harness, enabled=True)
    rescued = harness.tiny_gradient(x, w, factor, policy, scaler)
    if not np.allclose(rescued, reference, rtol=2e-3, atol=0):
        raise AssertionError(
            f"rescued gradient {rescued.ravel()[:3]} does not match float32's {reference.ravel()[:3]} to float16 precision"
        )


@requires("trainer")
def test_unscale_then_clip_equals_the_float32_update(harness: Any) -> None:
    """Clipping after unscaling gives the float32 run's clipped update (to float16 precision)."""
    import numpy as np

    batches = _batches(3)
    runs = []
    for policy, scaler in (("mixed_float16", {"enabled": True}), ("float32", None)):
        trainer = harness.trainer(Policy(policy), scaler=scaler, clip=0.05)
        start = trainer.params()
        for x, y in batches:
            trainer.step(x, y)
        runs.append([after - before for after, before in zip(trainer.params(), start, strict=True)])
    amp, reference = runs
    amp_norm = float(np.sqrt(sum(float((d.astype(np.float64) ** 2).sum()) for d in amp)))
    ref_norm = float(np.sqrt(sum(float((d.astype(np.float64) ** 2).sum()) for d in reference)))
    assert_close(amp_norm, ref_norm, rel=0.02, abs_=0.0, what="norm of the clipped updates, mixed_float16 vs float32")
    for index, (a, b) in enumerate(zip(amp, reference, strict=True)):
        if not np.allclose(a, b, rtol=0.05, atol=2e-3 * max(1.0, float(np.abs(b).max()))):
            raise AssertionError(f"update of parameter {index} differs from float32's beyond float16 precision")


@requires("trainer", "passes_loss_through")
def test_disabled_scaler_passes_the_loss_through_and_changes_nothing(harness: Any) -> None:
    """Under a bfloat16 policy the scaler is off: scale() returns the loss itself; training is unchanged."""
    policy = Policy("mixed_bfloat16")
    with _policy(policy):
        scaler = _new_scaler(harness, enabled=None)
        if scaler.enabled or scaler.get_scale() != 1.0:
            raise AssertionError("a LossScaler used under mixed_bfloat16 should be disabled with scale 1.0")
        if not harness.passes_loss_through(scaler):
            raise AssertionError("a disabled scaler's scale(loss) did not return the loss object itself")
    runs = []
    scaler_kwargs: dict[str, Any] | None
    for scaler_kwargs in ({"enabled": None}, None):
        trainer = harness.trainer(policy, scaler=scaler_kwargs)
        for x, y in _batches(4):
            trainer.step(x, y)
        runs.append(trainer.params())
    assert_equal_arrays(runs[0], runs[1], "parameters with a disabled scaler vs without a scaler")


@requires("trainer", "guard")
@parametrize("optimizer", ["sgd", "adam"])
def test_guard_skips_non_finite_steps_without_scaling(harness: Any, optimizer: str) -> None:
    """Under mixed_bfloat16 the scaler does not scale but guards: a step with an inf gradient is skipped
    (parameters, slots and step counters bitwise unchanged) and recorded with reason "non_finite"; every other
    step equals training without a scaler, bitwise."""
    policy = Policy("mixed_bfloat16")
    guarded = harness.trainer(policy, scaler={"enabled": None}, optimizer=optimizer)
    plain = harness.trainer(policy, scaler=None, optimizer=optimizer)
    bad = 3
    for index, (x, y) in enumerate(_batches(6)):
        if index != bad:
            guarded.step(x, y)
            plain.step(x, y)
            continue
        before = (guarded.params(), guarded.optimizer_state())
        guarded.step(x, y, overflow=True)
        if not guarded.step_skipped():
            raise AssertionError("the guard did not skip a step whose gradient held inf")
        assert_equal_arrays(guarded.params(), before[0], "parameters after a guarded skip")
        assert_equal_arrays(guarded.optimizer_state(), before[1], "optimizer slots and counters after a guarded skip")
    records = guarded.scaler.records()
    got = [(r.iteration, r.skipped, r.reason, r.mode, r.scale) for r in records]
    want = [(i, i == bad, "non_finite" if i == bad else None, "guarding", None) for i in range(6)]
    if got != want:
        raise AssertionError(f"records of the guarded run: {got}, expected {want}")
    if int(guarded.scaler.skipped_steps()) != 1:
        raise AssertionError(f"skipped_steps() = {int(guarded.scaler.skipped_steps())}, expected 1")
    expect_divergence(harness, f"guard_vs_plain:{optimizer}")  # the checks above hold everywhere
    assert_equal_arrays(guarded.params(), plain.params(), "parameters: guarded run vs a run without scaler")
    assert_equal_arrays(guarded.optimizer_state(), plain.optimizer_state(), "optimizer state: guarded vs plain")


@requires("trainer", "guard")
def test_records_replay_the_scale_of_every_step(harness: Any) -> None:
    """Under mixed_float16, records() gives each iteration's scale, next scale and reason, equal to the core
    reference for the overflow pattern, and the replayed state equals the device's."""
    pattern = "FFOFFFOOFF"
    config: dict[str, Any] = {"growth_interval": 2, "hysteresis": 2}
    trainer = harness.trainer(Policy("mixed_float16"), scaler={**config, "enabled": True})
    _drive(trainer, pattern)
    reference = LossScaleConfig(**config)
    states = [reference.initial_state(), *reference.states(pattern)]
    want = [
        (i, c == "O", "overflow" if c == "O" else None, "scaling", states[i].scale, states[i + 1].scale)
        for i, c in enumerate(pattern)
    ]
    got = [(r.iteration, r.skipped, r.reason, r.mode, r.scale, r.next_scale) for r in trainer.scaler.records()]
    if got != want:
        raise AssertionError(f"records: {got}, expected {want}")
    if got[-1][5] != trainer.scaler.state_dict()["scale"]:
        raise AssertionError(f"the replayed scale {got[-1][5]} differs from the device's")


@requires("trainer", "guard")
@parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_skipped_step_names_the_parameter_that_overflowed(harness: Any, policy: str) -> None:
    """An inf planted in one parameter's gradient at step 7 of 12: the record of step 7, and no other, names
    exactly that parameter and its layer, with one inf (reason "overflow" while scaling, "non_finite" while
    guarding). Read after the run: a skip the host never learned of (decided on the device) is named only
    when the records are read before the gradients change, a difference a harness lists as
    ``names_read_late``."""
    expect_divergence(harness, "names_read_late")
    trainer = harness.trainer(Policy(policy), scaler={"enabled": None})
    for index, (x, y) in enumerate(_batches(12)):
        trainer.step(x, y, overflow=index == 7)
    got = [
        (r.iteration, r.reason, [(g.name, g.layer, g.inf, g.neg_inf, g.nan) for g in r.gradients], r.layers)
        for r in trainer.scaler.records()
        if r.skipped or r.gradients
    ]
    planted = trainer.planted
    reason = "overflow" if policy == "mixed_float16" else "non_finite"
    want = [(7, reason, [(planted, layer_of(planted), 1, 0, 0)], (layer_of(planted),))]
    if got != want:
        raise AssertionError(f"records of skipped steps: {got}, expected {want}")


def _new_scaler(harness: Any, **settings: Any) -> Any:
    """The backend's scaler: ``harness.new_scaler(**settings)`` where the harness offers one (a backend whose
    scaler is not a `polyamp.LossScaler`, e.g. Keras's optimizer wrapper), else a bound LossScaler."""
    make = getattr(harness, "new_scaler", None)
    if make is not None:
        return make(**settings)
    from polyamp import LossScaler

    return LossScaler(**settings, backend=harness.backend)


def _policy(policy: Policy) -> Any:
    from polyamp import policy_scope

    return policy_scope(policy)


# -- convergence ---------------------------------------------------------------------------------------------

#: Final-loss tolerance against the float32 run: |amp - float32| <= CONVERGENCE_ABS + CONVERGENCE_REL * float32.
CONVERGENCE_ABS = 0.05
CONVERGENCE_REL = 0.10


@parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@requires("trainer", "low_precision")
def test_converges_like_float32(harness: Any, policy: str) -> None:
    """80 Adam steps under a mixed policy end within tolerance of the float32 run's loss."""
    batches = _batches(80)

    def final_loss(spec: str) -> float:
        trainer = harness.trainer(Policy(spec), scaler={"enabled": None}, optimizer="adam")
        losses = [float(trainer.step(x, y)) for x, y in batches]
        return sum(losses[-10:]) / 10

    amp, reference = final_loss(policy), final_loss("float32")
    if not abs(amp - reference) <= CONVERGENCE_ABS + CONVERGENCE_REL * reference:
        raise AssertionError(f"final loss {amp:.4f} under {policy}, {reference:.4f} in float32: beyond tolerance")
