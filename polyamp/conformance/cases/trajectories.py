"""Loss-scale trajectories: every loop style and the functional form follow the core's rule step by step, and a run resumes on another backend."""

from __future__ import annotations

import math
from typing import Any

from polyamp import LossScaleConfig, Policy, SpikeRule
from polyamp.conformance._context import (
    assert_equal_arrays,
    parametrize,
    requires,
)
from polyamp.conformance.cases._shared import TRAJECTORY_VECTORS, _batches, _drive, _mismatch, _reference

# -- loss-scale trajectories -----------------------------------------------------------------------------


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
