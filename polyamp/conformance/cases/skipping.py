"""Skipped steps change nothing, scaling rescues underflow, clipping after the unscale, the disabled path, the guard and the records."""

from __future__ import annotations

from typing import Any

from polyamp import LossScaleConfig, Policy
from polyamp.backend_api.records import layer_of
from polyamp.conformance._context import (
    assert_close,
    assert_equal_arrays,
    expect_divergence,
    parametrize,
    requires,
    skip,
)
from polyamp.conformance.cases._shared import _batches, _drive

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
