"""The per-step path kept lean: finite runs replayed in one go, records made only when read, a bound scaler's
type check remembered, named region policies parsed once. Each shortcut equals the long way exactly."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest

from polyamp import LossScaleConfig, LossScaleState, StepRecord
from polyamp._src.records import MODE_CODES, SPIKE_BIT, Recorder
from polyamp._src.scaling import to_float32

FLT_MAX = to_float32(3.4028234663852886e38)

CONFIGS = [
    LossScaleConfig(),
    LossScaleConfig(growth_interval=1),
    LossScaleConfig(growth_interval=3, hysteresis=2),
    LossScaleConfig(growth_interval=2, max_scale=2.0**18),
    LossScaleConfig(growth_interval=1, init_scale=2.0**126),  # growth reaches float32's limit
    LossScaleConfig(growth_interval=4, growth_factor=3.0),  # scales that round to float32
    LossScaleConfig(dynamic=False),
]


def _stepped(config: LossScaleConfig, state: LossScaleState, steps: int) -> tuple[list[float], LossScaleState]:
    scales = []
    for _ in range(steps):
        scales.append(state.scale)
        state = config.next_state(state, False)
    return scales, state


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_finite_runs_equal_next_state_step_by_step(config: LossScaleConfig) -> None:
    starts = [config.initial_state()]
    starts += [config.states("FFO")[-1], config.states("FFFFFFF")[-1], config.states("OF")[-1]]
    for state, steps in itertools.product(starts, [0, 1, 2, 3, 5, 8, 13, 40]):
        expected = _stepped(config, state, steps)
        assert config.finite_run(state, steps) == expected
        assert config.after_finite(state, steps) == expected[1]


def _reference(config: LossScaleConfig, codes: list[int], state: LossScaleState) -> list[tuple[Any, ...]]:
    """(iteration, skipped, reason, scale, next_scale) of scaling codes, one by one."""
    rows = []
    for iteration, code in enumerate(codes):
        flagged = code == MODE_CODES["scaling"] + 1
        after = config.next_state(state, flagged)
        rows.append((iteration, flagged, "overflow" if flagged else None, state.scale, after.scale))
        state = after
    return rows


def _rows(records: Any) -> list[tuple[Any, ...]]:
    return [(r.iteration, r.skipped, r.reason, r.scale, r.next_scale) for r in records]


@pytest.mark.parametrize(("capacity", "batch"), [(1, 1), (3, 2), (7, 7), (7, 3), (64, 5), (64, 64)])
def test_records_of_applied_runs_are_made_when_read_and_equal_the_replay(capacity: int, batch: int) -> None:
    config = LossScaleConfig(growth_interval=3)
    pattern = "FFFFFOFFFFFFFFOOFFFFFFFFFFFFFFFFFFOFFFFFFF"
    codes = [MODE_CODES["scaling"] + (1 if c == "O" else 0) for c in pattern]
    expected = _reference(config, codes, config.initial_state())
    recorder = Recorder(capacity, "ignore")
    recorder.reanchor(config.initial_state())
    # Read every `batch` iterations, as the scaler does (at most `capacity` apart: nothing is lost).
    for end in [*range(batch, len(codes), batch), len(codes)]:
        recorder.consume(end, codes[max(0, end - capacity) : end], config, lambda: None)
        assert _rows(recorder.records) == expected[max(0, end - capacity) : end]
    assert recorder.lost == 0
    assert recorder.anchor == config.states(pattern)[-1]
    for record in recorder.records:  # made through the fast path: real records in every respect
        assert type(record) is StepRecord
        assert record == StepRecord(**vars(record)) and hash(record) == hash(StepRecord(**vars(record)))
        with pytest.raises(AttributeError):
            record.skipped = True  # type: ignore[misc]


def test_records_read_late_keep_the_last_capacity_and_their_scales() -> None:
    config = LossScaleConfig(growth_interval=2)
    recorder = Recorder(5, "ignore")
    recorder.reanchor(config.initial_state())
    codes = [0] * 23
    for end in (4, 15, 23):  # runs longer than the capacity: trimmed without being made
        recorder.consume(end, codes[max(0, end - 11) : end], config, lambda: None)
    assert recorder.lost == 0
    assert _rows(recorder.records) == _reference(config, codes, config.initial_state())[-5:]


def test_an_unknown_state_gives_applied_records_without_scales() -> None:
    config = LossScaleConfig()
    recorder = Recorder(8, "ignore")  # never anchored: the scale is unknown
    recorder.consume(12, [0] * 8, config, lambda: None)
    assert recorder.lost == 4
    assert _rows(recorder.records) == [(i, False, None, None, None) for i in range(4, 12)]


def test_a_spike_code_between_runs_keeps_the_replay() -> None:
    config = LossScaleConfig(growth_interval=2)
    recorder = Recorder(16, "ignore", "loss_spike")
    recorder.reanchor(config.initial_state())
    codes = [0, 0, 0, MODE_CODES["scaling"] + 1 + SPIKE_BIT, 0, 0]
    recorder.consume(len(codes), codes, config, lambda: None)
    scales = [r.scale for r in recorder.records]
    # A skip by the spike rule alone does not count as an overflow for the scale.
    state = config.initial_state()
    expected = []
    for _ in codes:
        expected.append(state.scale)
        state = config.next_state(state, False)
    assert scales == expected
    assert [r.reason for r in recorder.records] == [None, None, None, "loss_spike", None, None]


class _OneVariableDevice:
    """A device keeping every outcome in one storage, as Keras's does, counting its writes."""

    def __init__(self) -> None:
        self.storage: list[Any] = [None]
        self.writes: list[Any] = []

    def new_record(self) -> list[Any]:
        return self.storage

    def write_record(self, record: list[Any], flag: Any) -> None:
        record[0] = flag
        self.writes.append(flag)


def test_the_iterations_outcome_is_written_once_into_a_shared_outcome_variable() -> None:
    from polyamp._src.step_history import StepOutcomes

    device = _OneVariableDevice()
    outcomes = StepOutcomes()
    optimizer = type("Optimizer", (), {})()
    flag, other = object(), object()
    outcomes.write(device, optimizer, flag, False)  # type: ignore[arg-type]
    outcomes.write_last(device, flag, False)  # type: ignore[arg-type]  # the same flag, the same variable
    assert device.writes == [flag] and outcomes.last is not None and outcomes.last.host is False
    outcomes.iteration_opened()
    outcomes.write(device, optimizer, flag, False)  # type: ignore[arg-type]
    outcomes.write_last(device, other, None)  # type: ignore[arg-type]  # another flag (two optimizers combined)
    assert device.writes == [flag, flag, other] and device.storage[0] is other
    outcomes.iteration_opened()
    outcomes.write(device, optimizer, flag, False)  # type: ignore[arg-type]
    outcomes.iteration_opened()  # (the iteration was discarded: a new one writes its outcome in full)
    outcomes.write_last(device, flag, False)  # type: ignore[arg-type]
    assert device.writes == [flag, flag, other, flag, flag]


torch = pytest.importorskip("torch")
import polyamp  # noqa: E402
import polyamp_torch  # noqa: E402


def test_a_bound_scaler_still_refuses_other_frameworks_objects_after_remembering_its_own() -> None:
    jnp = pytest.importorskip("jax.numpy")
    scaler = polyamp.LossScaler(enabled=True)
    loss = torch.ones((), requires_grad=True)
    scaler.scale(loss)
    scaler.scale([loss, loss])  # a list of its own: lists are looked into every time
    with pytest.raises(polyamp.BackendMismatchError, match="bound to torch"):
        scaler.scale(jnp.ones(()))
    with pytest.raises(polyamp.BackendMismatchError, match="bound to torch"):
        scaler.scale([jnp.ones(())])
    scaler.discard_iteration()


def test_named_region_policies_are_parsed_once_and_bad_names_still_raise() -> None:
    first = polyamp_torch.autocast("mixed_float16", device_type="cpu")
    second = polyamp_torch.autocast("mixed_float16", device_type="cpu")
    assert first.policy is second.policy and first.policy == polyamp.Policy("mixed_float16")
    for _ in range(2):
        with pytest.raises(polyamp.InvalidPolicyError):
            polyamp_torch.autocast("mixed_float17", device_type="cpu")
    with second:
        assert torch.get_autocast_dtype("cpu") == torch.float16


def _train(*, general: bool, loop: str) -> tuple[Any, ...]:
    """40 iterations of a small model with overflows injected, through `update`'s steady-state end, or, with
    ``general``, through the general end only; returns everything the two could differ in, and how many
    iterations went the general way."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    optimizers = [
        torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9),
        torch.optim.Adam(models[1].parameters(), lr=0.01),
    ]
    if loop == "fused Adam":
        optimizers = [torch.optim.Adam(models[0].parameters(), lr=0.01, fused=True)]
    elif loop not in ("two optimizers", "fused and host-decided"):
        optimizers = optimizers[:1]
    if loop == "fused and host-decided":
        optimizers[1] = torch.optim.Adam(models[1].parameters(), lr=0.01, fused=True)
    scaler = polyamp.LossScaler(
        enabled=True, init_scale=2.0**16, growth_interval=3, history=16, skip_on_device=loop == "skip on device"
    )
    ends = [0]
    original = scaler._end_iteration

    def counted(*args: Any) -> None:
        ends[0] += 1
        original(*args)

    scaler._end_iteration = counted  # type: ignore[method-assign]
    if general:

        def finish(device: Any, new_scale: Any, method: str) -> None:
            with scaler._history.lock:
                scaler._end_iteration(device, new_scale, method)

        scaler._finish = finish  # type: ignore[method-assign]
    x = torch.randn(8, 4)
    outcomes = []
    for i in range(40):
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = models[1](models[0](x)).pow(2).mean() if len(optimizers) == 2 else models[0](x).pow(2).mean()
        if i in (5, 6, 20, 33):
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        for optimizer in optimizers:
            if loop == "unscale and clip":
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(models[0].parameters(), 1.0)
            scaler.step(optimizer)
        if loop == "new scale" and i == 30:
            scaler.update(new_scale=1024.0)
        else:
            scaler.update()
        outcomes.append((bool(scaler.step_skipped()), *(bool(scaler.step_skipped(o)) for o in optimizers)))
    params = [p.detach().clone() for m in models for p in m.parameters()]
    skipped = int(scaler.skipped_steps())
    return params, scaler.state_dict(), scaler.records(), outcomes, scaler.get_scale(), skipped, ends[0]


#: Per loop: how many of its 40 iterations end the general way: only `update(new_scale=...)` does; overflows,
#: read to the host or decided on the device, end in the steady way.
GENERAL_ENDS = {
    "one optimizer": 0,
    "two optimizers": 0,
    "unscale and clip": 0,
    "new scale": 1,
    "fused Adam": 0,
    "skip on device": 0,
    "fused and host-decided": 0,
}


@pytest.mark.parametrize("loop", list(GENERAL_ENDS))
def test_the_steady_state_end_equals_the_general_end_bit_for_bit(loop: str) -> None:
    *fast, fast_general = _train(general=False, loop=loop)
    *slow, slow_general = _train(general=True, loop=loop)
    assert all(torch.equal(a, b) for a, b in zip(fast[0], slow[0], strict=True))
    assert fast[1:] == slow[1:]
    assert [r.skipped for r in fast[2]][-16:] == [r.skipped for r in slow[2]][-16:]
    assert slow_general == 40  # every iteration ended the general way there
    assert fast_general == GENERAL_ENDS[loop]
    assert sum(skipped for skipped, *_ in fast[3]) == 4
    assert fast[5] == 4  # skipped_steps()
    assert [r.iteration for r in fast[2] if r.skipped] == [33]  # the records kept: the last 16


def test_an_iteration_counts_the_optimizers_with_a_flag_as_found_infs_lists_them() -> None:
    from polyamp._src.iteration import Iteration, Stage

    iteration = Iteration()
    first, second, flag = object(), object(), object()
    marks = [
        (first, Stage.UNSCALED, flag),
        (first, Stage.STEPPED, flag),
        (second, Stage.STEPPED, None),
        (second, Stage.STEPPED, flag),
        (first, Stage.STEPPED, None),
    ]
    for optimizer, stage, found_inf in marks:
        iteration.mark(optimizer, stage, found_inf)
        assert iteration.flagged == len(iteration.found_infs())
    assert iteration.flagged == 1
    iteration.close()
    assert iteration.flagged == 0 == len(iteration.found_infs())


def test_an_iteration_ended_by_another_thread_still_raises_and_changes_nothing() -> None:
    import threading

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = polyamp.LossScaler(enabled=True)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    errors: list[BaseException] = []

    def end() -> None:
        try:
            scaler.update()
        except BaseException as error:  # the error is the result
            errors.append(error)

    thread = threading.Thread(target=end)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], polyamp.ScalerUsageError)
    assert "another thread" in str(errors[0])
    assert scaler.records() == [] and scaler.get_scale() == 2.0**16
    scaler.update()  # this thread ends it
    assert [r.skipped for r in scaler.records()] == [False]


@pytest.mark.parametrize("loop", ["fused Adam", "skip on device", "host-decided SGD"])
def test_the_skip_count_is_exact_whether_read_every_iteration_or_once(loop: str) -> None:
    """Skips decided on the device are counted in batches (`TorchDevice._count`): read every iteration, read
    once after 150 iterations (two batches and a part) or as a snapshot held across them, the count is the
    number of iterations the records say were skipped, and the flags kept stay fewer than a batch."""
    from polyamp_torch._device import _COUNT_BATCH

    overflows = {i for i in range(150) if i % 7 == 3 or i in (64, 65, 128)}

    def train(read_each: bool) -> tuple[list[int], Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=loop == "fused Adam")
        if loop == "host-decided SGD":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = polyamp.LossScaler(
            enabled=True, growth_interval=2, history=200, skip_on_device=loop == "skip on device"
        )
        x = torch.randn(8, 4)
        counts = []
        held = None
        for i in range(150):
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            scaler.scale(loss * float("inf") if i in overflows else loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if i == 9:
                held = scaler.skipped_steps()
            if read_each:
                counts.append(int(scaler.skipped_steps()))
            assert len(scaler._device._uncounted) < _COUNT_BATCH
        return counts, scaler, held

    counts, scaler, held = train(read_each=True)
    skipped = [r.iteration for r in scaler.records() if r.skipped]
    assert skipped == sorted(overflows)
    assert counts == [sum(1 for j in overflows if j <= i) for i in range(150)]
    assert held.dtype == torch.int64 and int(held) == 1  # the count at iteration 9 (iteration 3), not later ones
    _, once, _ = train(read_each=False)
    assert int(once.skipped_steps()) == len(overflows) == int(scaler.skipped_steps())


def _scale_benchmark() -> Any:
    """benchmarks/scale.py, whose scaler-alone sweep counts the Python calls this file's budget test asserts."""
    import importlib
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("benchmarks.scale")


def _policy_following_iteration(scale: Any, width: int) -> tuple[Any, Any]:
    """The `scale` benchmark's scaler-alone iteration with ``polyamp.LossScaler()`` (``enabled=None``), and
    that scaler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    for param in model.parameters():
        param.grad = torch.full_like(param, 2.0**-20)
    optimizer = scale._NoStep(model.parameters(), lr=0.0)
    loss = torch.ones(())
    scaler = polyamp.LossScaler()

    def iteration() -> None:
        scaler.scale(loss)
        scaler.step(optimizer)
        scaler.update()

    return iteration, scaler


@pytest.mark.parametrize("width", [8, 64])
def test_the_scalers_iteration_makes_no_more_python_calls_than_grad_scalers(width: int) -> None:
    """``scale`` + ``step`` + ``update`` of a `LossScaler` (records on) costs no more Python calls than
    torch.amp.GradScaler's over the same gradients, counted exactly (the `scale` benchmark's count), and the
    count does not grow with the model. So does a `LossScaler()` following a float16 policy, which decides at
    each iteration's start whether to scale (and would guard under a bfloat16 one)."""
    scale = _scale_benchmark()
    calls = {variant: scale._python_calls(scale._scaler_iteration(variant, width)) for variant in scale.SCALERS}
    assert calls["polyamp LossScaler"] <= calls["GradScaler"], calls
    assert calls["polyamp LossScaler"] == scale._python_calls(scale._scaler_iteration("polyamp LossScaler", 2 * width))
    with polyamp.policy_scope("mixed_float16"):
        iteration, scaler = _policy_following_iteration(scale, width)
        following = scale._python_calls(iteration)
        assert scaler.enabled_setting is None and scaler.enabled and scaler.records()[-1].scale is not None
    assert following <= calls["GradScaler"], (following, calls)


def test_the_remembered_optimizer_check_and_outcome_follow_the_optimizer_given() -> None:
    """The optimizer checked last and the outcome record read last are remembered per scaler, but a different
    optimizer is still checked and answered for itself: two optimizers alternated, one of them overflowing
    every other iteration, each gets its own skip; an object that is no optimizer is still refused, and a
    plain optimizer over bfloat16 weights still warns when it first steps after another."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    optimizers = [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)]
    scaler = polyamp.LossScaler(enabled=True)
    x = torch.randn(8, 4)
    for i in range(6):
        losses = [first(x).pow(2).mean(), second(x).pow(2).mean() * (float("inf") if i % 2 else 1.0)]
        for optimizer, loss in zip(optimizers, losses, strict=True):
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            assert bool(scaler.step_skipped(optimizer)) is (optimizer is optimizers[1] and i % 2 == 1)
        scaler.update()
        assert [bool(scaler.step_skipped(o)) for o in optimizers] == [False, i % 2 == 1]
    scaler.scale(first(x).pow(2).mean()).backward()
    with pytest.raises(polyamp.PolyampTypeError, match=r"torch\.optim\.Optimizer"):
        scaler.step(object())
    low = torch.nn.Linear(4, 3).to(torch.bfloat16)
    plain = torch.optim.SGD(low.parameters(), lr=0.1)
    scaler.discard_iteration()
    scaler.scale(low(x.bfloat16()).float().pow(2).mean()).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.step(plain)  # (also warned: scaling bfloat16 gradients)
    hazards = [w for w in caught if issubclass(w.category, polyamp.TrainingStateWarning)]
    assert [str(w.message).startswith("SGD updates bfloat16 weights directly") for w in hazards] == [True]
    assert hazards[0].filename == __file__
