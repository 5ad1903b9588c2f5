"""One iteration: several optimizers skip separately and update once; misuse is the same error everywhere."""

from __future__ import annotations

from typing import Any

from polyamp import LossScaleConfig, Policy
from polyamp.conformance._context import (
    assert_equal_arrays,
    parametrize,
    requires,
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
