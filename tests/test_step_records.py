"""Skip reasons, the guard without scaling, step records, their rate-limited logging and scale collapse (torch
and TensorFlow).

The conformance suite checks the shared semantics on every backend (test_guard_skips_non_finite_steps_without_scaling,
test_records_replay_the_scale_of_every_step); these tests check the rest against plain torch side by side.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

import polyamp
from polyamp import LossScaleConfig, PolyampValueError, ScaleCollapseError
from polyamp._src.records import LOGGED_SKIPS, MAX_HISTORY, Recorder, StepRecord

torch = pytest.importorskip("torch")

import polyamp_torch  # noqa: E402


def _model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(step: int) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)


def _scaled_backward(scaler: Any, model: Any, opt: Any, step: int) -> tuple[Any, Any]:
    """Step ``step``'s batch through ``model`` under polyamp's autocast and the scaled loss's backward pass (the
    gradients zeroed first); returns the batch."""
    x, y = _batch(step)
    opt.zero_grad()
    with polyamp_torch.autocast():
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    return x, y


def _polyamp_messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "polyamp" and r.levelno == level]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_bfloat16_guard_skips_the_planted_inf_and_equals_plain_torch_otherwise(
    fused: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 7 of 20 gets an inf in '2.weight''s gradient: the guard skips it (Adam moments and step bitwise
    unchanged), logs one WARNING, and the run equals plain torch that leaves out step 7."""
    caplog.set_level(logging.INFO, logger="polyamp")
    guarded, plain = _model(), _model()
    opt = torch.optim.Adam(guarded.parameters(), lr=0.01, fused=fused)
    ref_opt = torch.optim.Adam(plain.parameters(), lr=0.01, fused=fused)
    scaler = polyamp.LossScaler()
    with polyamp.policy_scope("mixed_bfloat16"):
        for step in range(20):
            x, y = _scaled_backward(scaler, guarded, opt, step)
            if step == 7:
                dict(guarded.named_parameters())["2.weight"].grad[1, 2] = math.inf
                before = [t.clone() for t in [*guarded.parameters(), *_adam_state(opt)]]
            scaler.step(opt)
            scaler.update()
            if step == 7:
                assert bool(scaler.step_skipped(opt))
                after = [*guarded.parameters(), *_adam_state(opt)]
                assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                continue
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_loss = torch.nn.functional.cross_entropy(plain(x), y)
            ref_loss.backward()
            ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(guarded.parameters(), plain.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_adam_state(opt), _adam_state(ref_opt), strict=True))
    assert not scaler.enabled and scaler.guarding
    assert int(scaler.skipped_steps()) == 1
    records = scaler.records()
    assert [(r.iteration, r.reason) for r in records if r.skipped] == [(7, "non_finite")]
    assert {r.mode for r in records} == {"guarding"} and len(records) == 20
    warnings = _polyamp_messages(caplog, logging.WARNING)
    assert len(warnings) == 1 and "iteration 7: step skipped (non_finite)" in warnings[0]


@pytest.mark.parametrize(("policy", "reason"), [("mixed_float16", "overflow"), ("mixed_bfloat16", "non_finite")])
def test_a_fused_optimizers_skip_names_its_gradients_when_read_before_the_next_iteration(
    policy: str, reason: str
) -> None:
    """A fused optimizer skips on the device (no host read); its non-finite gradients are counted when the
    records are read before the next iteration opens (step 1), and cannot be after it (step 2)."""
    model = _model()
    opt = torch.optim.Adam(model.named_parameters(), lr=0.01, fused=True)
    scaler = polyamp.LossScaler()
    with polyamp.policy_scope(policy):
        for step in range(4):
            _scaled_backward(scaler, model, opt, step)
            if step in (1, 2):
                model[2].weight.grad[1, 2] = math.nan if step == 1 else math.inf
            scaler.step(opt)
            scaler.update()
            if step == 1:
                assert scaler.last_record() is not None  # read while its gradients are still there
    skipped = [(r.iteration, r.reason, [(g.name, g.inf, g.nan, g.size) for g in r.gradients]) for r in scaler.records()]
    assert [entry for entry in skipped if entry[1]] == [(1, reason, [("2.weight", 0, 1, 64)]), (2, reason, [])]


def test_the_batched_record_read_takes_flags_of_any_shape_and_dtype() -> None:
    """The records read the iterations' flags in one stack; flags that cannot be stacked as they are (another
    shape or, with several GPUs, another device) are brought to the CPU one by one first."""
    from polyamp_torch._device_records import _read_flags

    assert _read_flags([torch.zeros(()), torch.tensor(True), torch.tensor(2.0)]) == [0.0, 1.0, 2.0]
    assert _read_flags([torch.zeros(()), torch.ones(1), torch.tensor(False)]) == [0.0, 1.0, 0.0]


def _adam_state(opt: Any) -> list[Any]:
    return [value for state in opt.state.values() for value in state.values()]


def _train(scaler: Any, *, inf_at: tuple[int, ...], steps: int = 4, policy: str = "mixed_bfloat16") -> Any:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with polyamp.policy_scope(policy):
        for step in range(steps):
            _scaled_backward(scaler, model, opt, step)
            if step in inf_at:
                model[0].weight.grad[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
    return model


def test_guard_false_and_a_disabled_torch_scaler_step_plainly() -> None:
    """guard=False, and TorchLossScaler(enabled=False) as torch.amp.GradScaler(enabled=False): a plain step, which
    applies the inf (the guard is what prevents this)."""
    for scaler in (polyamp.LossScaler(guard=False), polyamp_torch.TorchLossScaler(enabled=False)):
        model = _train(scaler, inf_at=(1,))
        assert not torch.isfinite(model[0].weight).all()
        assert not scaler.guarding and int(scaler.skipped_steps()) == 0
        assert [r.mode for r in scaler.records()] == ["off"] * 4
    forced = polyamp_torch.TorchLossScaler(enabled=False, guard=True)
    model = _train(forced, inf_at=(1,))
    assert torch.isfinite(model[0].weight).all() and int(forced.skipped_steps()) == 1


def test_overflow_records_follow_the_reference_and_log_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="polyamp")
    scaler = polyamp.LossScaler(growth_interval=2)
    _train(scaler, inf_at=(1, 2), steps=6, policy="mixed_float16")
    states = LossScaleConfig(growth_interval=2).states("FOOFFF")
    records = scaler.records()
    assert [r.next_scale for r in records] == [s.scale for s in states]
    assert [r.scale for r in records] == [65536.0, *[s.scale for s in states[:-1]]]
    assert [r.reason for r in records] == [None, "overflow", "overflow", None, None, None]
    assert len(_polyamp_messages(caplog, logging.INFO)) == 2 and not _polyamp_messages(caplog, logging.WARNING)
    assert scaler.last_record() == records[-1]


def test_update_with_a_new_scale_reanchors_the_records() -> None:
    scaler = polyamp.LossScaler(growth_interval=1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with polyamp.policy_scope("mixed_float16"):
        for step, new_scale in enumerate([None, 1024.0, None, torch.tensor(64.0), None]):
            x, y = _batch(step)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update(new_scale)
    got = [(r.scale, r.next_scale) for r in scaler.records()]
    # An iteration ended by update(new_scale) records the scale it set (a float, or a tensor read eagerly).
    assert got == [(65536.0, 131072.0), (131072.0, 1024.0), (1024.0, 2048.0), (2048.0, 64.0), (64.0, 128.0)]
    assert [r.mode for r in scaler.records()] == ["scaling"] * 5
    assert scaler.state_dict()["scale"] == 128.0


@pytest.mark.parametrize("on_min_scale", ["warn", "raise", "ignore"])
def test_scale_collapse(on_min_scale: str, caplog: pytest.LogCaptureFixture) -> None:
    """The scale reaching its floor warns once per collapse (naming the causes), raises, or says nothing."""
    caplog.set_level(logging.INFO, logger="polyamp")
    scaler = polyamp.LossScaler(init_scale=8.0, min_scale=2.0, on_min_scale=on_min_scale)
    if on_min_scale == "raise":
        with pytest.raises(ScaleCollapseError, match="reached min_scale, 2") as caught:
            _train(scaler, inf_at=(0, 1, 2, 3), policy="mixed_float16")
        assert "bfloat16" in str(caught.value) and scaler.state_dict()["scale"] == 2.0
        return
    _train(scaler, inf_at=(0, 1, 2, 3), policy="mixed_float16")
    collapse = [m for m in _polyamp_messages(caplog, logging.WARNING) if "collapsed" in m]
    if on_min_scale == "ignore":
        assert collapse == []
    else:
        assert len(collapse) == 1 and "iteration 1 overflowed at scale 4" in collapse[0]
        assert "learning rate" in collapse[0] and "doctor" in collapse[0]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"guard": "yes"}, "`guard` must be None"),
        ({"on_min_scale": "stop"}, "`on_min_scale` must be one of 'warn', 'raise', 'ignore'. Received: 'stop'"),
        ({"history": 0}, "`history` must be an int from 1 to 65,536"),
    ],
)
def test_bad_record_settings_say_what_is_allowed(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PolyampValueError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        polyamp.LossScaler(**kwargs)


@pytest.mark.parametrize("history", [MAX_HISTORY + 1, 10**9])
def test_history_is_bounded(history: int) -> None:
    with pytest.raises(PolyampValueError, match=r"`history` must be an int from 1 to 65,536") as caught:
        polyamp.LossScaler(history=history)
    assert f"Received: {history} (of type int)" in str(caught.value)
    assert polyamp.LossScaler(history=MAX_HISTORY).state_dict()["scale"] == 65536.0


def test_records_survive_pickling_settings() -> None:
    import pickle

    scaler = polyamp.LossScaler(guard=True, on_min_scale="raise", history=8)
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy._guard_setting is True and copy.records() == []
    assert copy._history.recorder.on_min_scale == "raise" and copy._history.recorder.capacity == 8


def test_tensorflow_graph_records_are_read_later_and_lost_ones_are_said(caplog: pytest.LogCaptureFixture) -> None:
    """Inside tf.function nothing is read; records() reads the ring afterwards, and says when it overflowed."""
    tf = pytest.importorskip("tensorflow")
    caplog.set_level(logging.INFO, logger="polyamp")
    variable = tf.Variable([1.0, 2.0])
    opt = tf.keras.optimizers.SGD(0.1)
    scaler = polyamp.LossScaler(history=4, enabled=True, backend="tensorflow")

    @tf.function
    def step(bad: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * variable) * bad
            scaled = scaler.scale(loss)
        scaler.apply_gradients(opt, [(tape.gradient(scaled, variable), variable)])

    for bad in [1.0, math.inf, 1.0]:
        step(tf.constant(bad))
    assert [(r.iteration, r.reason) for r in scaler.records()] == [(0, None), (1, "overflow"), (2, None)]
    for _ in range(6):
        step(tf.constant(1.0))
    records = scaler.records()
    assert [r.iteration for r in records][-4:] == [5, 6, 7, 8]
    assert [r.scale for r in records[-4:]] == [None] * 4  # the state before them is unknown
    assert any("2 iterations ended without being recorded" in m for m in _polyamp_messages(caplog, logging.WARNING))
    step(tf.constant(1.0))
    assert scaler.records()[-1].scale == 32768.0  # re-anchored on the device's state


def test_scheduler_guard_holds_the_learning_rate_on_a_guarded_skip() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = polyamp.LossScaler()
    scheduler = polyamp_torch.SchedulerGuard(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), scaler)
    lrs = []
    with polyamp.policy_scope("mixed_bfloat16"):
        for step in range(4):
            x, y = _batch(step)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            if step == 1:
                model[2].bias.grad[0] = math.nan
            scaler.step(opt)
            scaler.update()
            scheduler.step()
            lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 0.5, 0.25, 0.125]


def test_clip_grad_norm_unscales_first_and_matches_native_unscale_then_clip() -> None:
    """Bitwise equal to GradScaler's unscale_ + clip_grad_norm_; clipping scaled gradients by hand (the misuse)
    moves the weights about `scale` times less."""
    models = {name: _model() for name in ("polyamp", "native", "misuse")}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    ours, native = polyamp.LossScaler(enabled=True), torch.amp.GradScaler("cpu")
    misuse = polyamp.LossScaler(enabled=True)
    start = [p.detach().clone() for p in models["misuse"].parameters()]
    for step in range(3):
        x, y = _batch(step)
        for name, scaler in (("polyamp", ours), ("native", native), ("misuse", misuse)):
            opts[name].zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(models[name](x), y)).backward()
            if name == "polyamp":
                assert not ours.is_unscaled(opts[name])
                norm = polyamp_torch.clip_grad_norm_(ours, opts[name], 0.5)
                assert ours.is_unscaled(opts[name])
            elif name == "native":
                native.unscale_(opts[name])
                native_norm = torch.nn.utils.clip_grad_norm_(models[name].parameters(), 0.5)
            else:
                torch.nn.utils.clip_grad_norm_(models[name].parameters(), 0.5)  # still scaled: wrong
            scaler.step(opts[name])
            scaler.update()
        assert torch.equal(norm, native_norm)
    assert all(torch.equal(a, b) for a, b in zip(models["polyamp"].parameters(), models["native"].parameters()))
    moved = sum(float((a.detach() - b).abs().sum()) for a, b in zip(models["polyamp"].parameters(), start, strict=True))
    barely = sum(float((a.detach() - b).abs().sum()) for a, b in zip(models["misuse"].parameters(), start, strict=True))
    assert barely < moved / 1000


def test_record_writer_puts_the_records_in_tensorboard(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    scaler = polyamp.LossScaler(growth_interval=2)
    writer = SummaryWriter(str(tmp_path))
    board = polyamp_torch.RecordWriter(scaler, writer)
    _train(scaler, inf_at=(1,), steps=3, policy="mixed_float16")
    assert board.write() == 3 and board.write() == 0  # each iteration once
    _train(scaler, inf_at=(), steps=2, policy="mixed_float16")
    assert board.write() == 2
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    scales = [s.scale for s in LossScaleConfig(growth_interval=2).states("FOFFF")]
    assert series("polyamp/loss_scale") == list(enumerate([65536.0, *scales[:-1]]))
    assert series("polyamp/skipped") == [(0, 0.0), (1, 1.0), (2, 0.0), (3, 0.0), (4, 0.0)]
    assert series("polyamp/skipped_steps") == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)]
    assert [e.step for e in events.Tensors("polyamp/skip/text_summary")] == [1]
    with pytest.raises(polyamp.PolyampTypeError, match="add_scalar/add_text"):
        polyamp_torch.RecordWriter(scaler, object())


# -- the logging of skipped steps is rate-limited -----------------------------------------------------------


def _polyamp_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "polyamp"]


def test_a_storm_of_guarded_skips_logs_a_handful_of_lines(caplog: pytest.LogCaptureFixture) -> None:
    """200 guarded steps with a NaN gradient (a bfloat16 storm): 8 lines, then one each at 16, 32, 64, 128."""
    caplog.set_level(logging.INFO, logger="polyamp")
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = polyamp.LossScaler()
    with polyamp.policy_scope("mixed_bfloat16"):
        for _ in range(200):
            optimizer.zero_grad()
            scaler.scale((weight * math.nan).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
    records = scaler.records()
    assert len([r for r in records if r.skipped]) == 200 and int(scaler.skipped_steps()) == 200
    lines = _polyamp_lines(caplog)
    assert all(level == logging.WARNING for level, _ in lines)
    assert [message.split(":")[1].strip() for _, message in lines[:LOGGED_SKIPS]] == [
        f"iteration {i}" for i in range(LOGGED_SKIPS)
    ]
    assert "further ones are summarised when their count reaches 16, 32, 64" in lines[LOGGED_SKIPS - 1][1]
    summaries = [message for _, message in lines[LOGGED_SKIPS:]]
    assert [m.split(" steps skipped")[0] for m in summaries] == [
        "polyamp: 16",
        "polyamp: 32",
        "polyamp: 64",
        "polyamp: 128",
    ]
    assert "16 steps skipped (non_finite) so far, 8 since the last such line, in iterations 8 to 15" in summaries[0]
    assert "128 steps skipped (non_finite) so far, 64 since the last such line, in iterations 64 to 127" in summaries[3]
    assert "The last one: iteration 127: step skipped (non_finite)" in summaries[3]
    assert len(lines) == LOGGED_SKIPS + 4


def test_each_reason_has_its_own_budget(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="polyamp")
    recorder = Recorder(64, "ignore")
    config = LossScaleConfig()
    reasons = ["non_finite"] * 20 + ["loss_spike"] * 3
    for i, reason in enumerate(reasons):
        record = StepRecord(i, True, reason, "guarding", None, None)  # type: ignore[arg-type]
        recorder._report(record, config)
    lines = [message for _, message in _polyamp_lines(caplog)]
    assert len(lines) == LOGGED_SKIPS + 1 + 3
    assert [line for line in lines if "(loss_spike)" in line] == [
        lines[-3],
        lines[-2],
        lines[-1],
    ] and lines[-1].startswith("polyamp: iteration 22: step skipped (loss_spike)")


# -- parameters that hold inf or NaN: every step skipped, and the records say why -----------------------------


def _parameter_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in _polyamp_messages(caplog, logging.WARNING) if "parameters themselves hold inf or NaN" in m]


def test_torch_non_finite_parameters_are_named_once_the_skips_run_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="polyamp")
    model = _model()
    opt = torch.optim.Adam(model.named_parameters(), lr=0.01)
    scaler = polyamp.LossScaler()
    checks: list[int] = []
    device = polyamp_torch._device.TorchDevice
    check = device.non_finite_parameters
    monkeypatch.setattr(device, "non_finite_parameters", lambda self, o: checks.append(step) or check(self, o))
    with polyamp.policy_scope("mixed_bfloat16"):
        for step in range(12):
            if step == 5:  # what an overflowed optimizer state leaves: a parameter that is NaN
                with torch.no_grad():
                    model[2].weight[1, 3] = math.nan
            _scaled_backward(scaler, model, opt, step)
            if step == 2:  # a bad batch: one skip, the parameters are fine
                model[0].bias.grad[0] = math.inf
            scaler.step(opt)
            scaler.update()
    assert [r.iteration for r in scaler.records() if r.skipped] == [2, *range(5, 12)]
    # Checked once, when the run of skips reached two iterations; the single skip cost no check.
    assert checks == [6]
    (warning,) = _parameter_warnings(caplog)
    assert warning.startswith(
        "polyamp: every step since iteration 5 was skipped because the parameters themselves hold inf or NaN: "
        "2.weight (1 NaN of 64)."
    )
    assert "Restore the last checkpoint saved before iteration 5" in warning
    lines = [m for m in _polyamp_messages(caplog, logging.WARNING) if "step skipped" in m]
    assert "point at the data" in lines[0] and "iteration 2:" in lines[0]  # the bad batch: the data's
    assert "point at the data" in lines[1] and "iteration 5:" in lines[1]  # read alone, before the run showed
    assert all("the parameters hold inf or NaN (2.weight)" in m and "point at the data" not in m for m in lines[2:])


def test_tensorflow_non_finite_variables_are_named_when_the_records_are_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tf = pytest.importorskip("tensorflow")
    caplog.set_level(logging.INFO, logger="polyamp")
    kernel, bias = tf.Variable([[1.0], [2.0]], name="kernel"), tf.Variable([0.5], name="bias")
    opt = tf.keras.optimizers.SGD(0.01)
    scaler = polyamp.LossScaler(enabled=True, backend="tensorflow", growth_interval=100)

    @tf.function
    def step(x: Any) -> None:
        with tf.GradientTape() as tape:
            scaled = scaler.scale(tf.reduce_sum(tf.square(tf.matmul(x, kernel) + bias)))
        scaler.apply_gradients(opt, zip(tape.gradient(scaled, [kernel, bias]), [kernel, bias]))

    for _ in range(3):
        step(tf.ones((1, 2)))
    kernel.assign([[math.inf], [2.0]])
    for _ in range(4):
        step(tf.ones((1, 2)))
    records = scaler.records()  # one read: the run of skips is seen whole
    assert [r.reason for r in records] == [None] * 3 + ["overflow"] * 4
    (warning,) = _parameter_warnings(caplog)
    assert "since iteration 3" in warning and "kernel:0 (1 inf of 2)" in warning and "bias" not in warning


def test_jax_non_finite_parameters_are_named_given_the_parameters(caplog: pytest.LogCaptureFixture) -> None:
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    import polyamp_jax

    caplog.set_level(logging.INFO, logger="polyamp")
    params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}}
    tx = polyamp_jax.loss_scaled(optax.sgd(0.1), enabled=False, guard=True)
    state = tx.init(params)

    def step(params: Any, state: Any) -> tuple[Any, Any]:
        grads = {"dense": {"kernel": params["dense"]["kernel"] * 2.0, "bias": params["dense"]["bias"] + 1.0}}
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state)
    params = {"dense": {**params["dense"], "kernel": params["dense"]["kernel"].at[0, 1].set(jnp.nan)}}
    for _ in range(3):
        params, state = step(params, state)
    assert [r.reason for r in polyamp_jax.records(state)] == [None, "non_finite", "non_finite", "non_finite"]
    assert _parameter_warnings(caplog) == []  # without the parameters, nothing to check
    again = tx.init(params)
    for _ in range(3):
        _, again = step(params, again)
    polyamp_jax.records(again, params)
    (warning,) = _parameter_warnings(caplog)
    assert "since iteration 0" in warning and "dense/kernel (1 NaN of 4)" in warning
