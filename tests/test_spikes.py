"""The spike rule: its arguments, its reference on stored traces (statistics near float64's range included), and
the device decisions of torch and TensorFlow against it."""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import numpy as np
import pytest

import polyamp
from polyamp import LossScaleConfig, PolyampTypeError, PolyampValueError, ScalerUsageError, SpikeRule
from polyamp._src.spikes import MAX_WINDOW

# -- the reference ---------------------------------------------------------------------------------------------

TRACE = [1.0, 1.2, 0.9, 1.1, 1.0, 9.0, 1.05, 0.95, 0.2, 1.0, float("nan"), 1.1, 7.5, 1.0]


def test_reference_on_a_stored_trace() -> None:
    """window 4, threshold 3, one-sided: 9.0 and 7.5 are spikes; 0.2 is not (downward); NaN never is."""
    rule = SpikeRule("loss", window=4, threshold=3.0)
    assert rule.decide(TRACE) == [False] * 5 + [True] + [False] * 6 + [True, False]
    two_sided = SpikeRule("loss", window=4, threshold=3.0, two_sided=True)
    assert two_sided.decide(TRACE) == [False] * 5 + [True, False, False, True] + [False] * 3 + [True, False]
    # warmup: decisions start once 2 values are in the window; the window keeps the last 4 applied values
    early = SpikeRule("loss", window=4, threshold=3.0, warmup=2)
    assert early.decide([1.0, 1.1, 5.0, 1.0, 1.05, 1.0]) == [False, False, True, False, False, False]
    # iterations skipped for another reason (overflow) neither spike nor enter the window
    assert rule.decide([1.0, 1.1, 0.9, 1.0, 50.0, 1.0, 5.0], [False] * 4 + [True] + [False] * 2) == [
        False,
        False,
        False,
        False,
        False,
        False,
        True,
    ]
    # a constant window has sigma 0: nothing is a spike
    assert SpikeRule("loss", window=3, threshold=3.0).decide([2.0, 2.0, 2.0, 2.5]) == [False] * 4


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"on": "grads"}, "must be 'loss' or 'grad_norm'"),
        ({"window": 1}, "window=...) must be an int from 2 to 65,536"),
        ({"threshold": 0.0}, "finite positive number"),
        ({"window": 8, "warmup": 9}, "cannot exceed window=8"),
        ({"max_consecutive": 0}, "max_consecutive=...) must be an int >= 1, 'auto'"),
        ({"max_consecutive": True}, "max_consecutive=...) must be an int >= 1, 'auto'"),
        ({"max_consecutive": "always"}, "max_consecutive=...) must be an int >= 1, 'auto'"),
    ],
)
def test_bad_rules_say_what_is_allowed(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PolyampValueError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        SpikeRule(**kwargs)


def test_a_threshold_beyond_floats_range_is_a_value_error_naming_it() -> None:
    with pytest.raises(PolyampValueError, match=r"threshold=\.\.\.\) must be a finite positive number") as caught:
        SpikeRule(threshold=10**400)
    assert "(of type int)" in str(caught.value) and "1000000" in str(caught.value)


@pytest.mark.parametrize("value", ["yes", None, 1, math.nan], ids=["str", "none", "int", "nan"])
def test_two_sided_must_be_a_bool(value: object) -> None:
    with pytest.raises(PolyampTypeError, match=r"`SpikeRule\(two_sided=\.\.\.\)` must be a bool\. Received: "):
        SpikeRule(two_sided=value)  # type: ignore[arg-type]
    assert SpikeRule(two_sided=True).two_sided is True


@pytest.mark.parametrize("field", ["window", "warmup"])
@pytest.mark.parametrize("value", [MAX_WINDOW + 1, 10**8, 10**12])
def test_window_and_warmup_are_bounded(field: str, value: int) -> None:
    kwargs = {"window": MAX_WINDOW, field: value}
    with pytest.raises(PolyampValueError, match=rf"SpikeRule\({field}=\.\.\.\) must be an int from 2 to 65,536\."):
        SpikeRule(**kwargs)  # type: ignore[arg-type]


def test_the_largest_window_is_accepted() -> None:
    assert MAX_WINDOW == 65_536
    assert SpikeRule(window=MAX_WINDOW, warmup=MAX_WINDOW).min_values == MAX_WINDOW


def test_on_must_be_a_string() -> None:
    # an array holding 'loss' compares equal to 'loss' element-wise: it must not be taken for the string
    with pytest.raises(PolyampValueError, match=r"must be 'loss' or 'grad_norm'\. Received: array\(\['loss'\]"):
        SpikeRule(on=np.array(["loss"]))  # type: ignore[arg-type]


#: Statistics whose squared deviations (above ~1.3e154) or sums (above ~1.8e308) overflow float64.
HUGE_TRACES = {
    "squares_overflow": [1e200, 1.0, 1.0, 1.0, 1.0, 2e154, 1.0, 1.0],
    "sum_overflows": [1e308, 1e308, 1e308, 1e308, 1.0, 1e308],
    "big_but_representable": [1e150, 1.1e150, 0.9e150, 1e150, 5e150, 1e150],
}


def test_the_reference_decides_huge_statistics_without_overflowing() -> None:
    rule = SpikeRule("loss", window=4, threshold=3.0)
    assert rule.decide(HUGE_TRACES["squares_overflow"]) == [False] * 8
    assert rule.decide(HUGE_TRACES["sum_overflows"]) == [False] * 6
    assert rule.decide(HUGE_TRACES["big_but_representable"]) == [False] * 4 + [True, False]
    assert rule.is_spike([0.0, 0.0, 0.0, 2e154], 1e155) is False  # sigma is inf on the devices: no spike


# -- torch -----------------------------------------------------------------------------------------------------


def _torch_run(
    rule: SpikeRule,
    policy: str,
    bad: tuple[int, ...],
    inf_at: tuple[int, ...] = (),
    pickled: bool = False,
    resume_at: int | None = None,
    resume_how: str = "state_dict",
) -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = polyamp.LossScaler(spike=rule, growth_interval=3)
    if pickled:  # a scaler restored from a pickle keeps its rule and the rule's skip reason
        scaler = pickle.loads(pickle.dumps(scaler))
    losses, norms, skipped, unchanged = [], [], [], []
    with polyamp.policy_scope(policy):
        for step in range(24):
            if step == resume_at and resume_how == "pickle":
                scaler = pickle.loads(pickle.dumps(scaler))
            elif step == resume_at:  # a new scaler resumes from the state dict, through JSON
                saved = json.loads(json.dumps(scaler.state_dict()))
                scaler = polyamp.LossScaler(spike=rule, growth_interval=3)
                scaler.load_state_dict(saved)
            generator = torch.Generator().manual_seed(step)
            x = torch.randn(16, 8, generator=generator) * (25.0 if step in bad else 1.0)
            y = torch.randint(0, 4, (16,), generator=generator)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            losses.append(float(loss.detach().double()))
            scaler.scale(loss).backward()
            if step in inf_at:
                model[0].bias.grad[0] = math.inf
            if rule.on == "grad_norm":
                scaler.unscale_(opt) if scaler.enabled else None
                grads = [p.grad.double() for p in model.parameters()]
                norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            skipped.append(bool(scaler.step_skipped(opt)))
            unchanged.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
    return {"losses": losses, "norms": norms, "skipped": skipped, "unchanged": unchanged, "scaler": scaler}


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_torch_loss_spikes_follow_the_reference_and_skip_bitwise(policy: str) -> None:
    rule = SpikeRule("loss", window=8, threshold=4.0)
    run = _torch_run(rule, policy, bad=(12, 19), inf_at=(15,))
    overflow = [step == 15 for step in range(24)]
    spikes = rule.decide(run["losses"], overflow)
    assert [i for i, s in enumerate(spikes) if s] == [12, 19]  # the trace's own outliers: the planted ones
    assert run["skipped"] == [s or o for s, o in zip(spikes, overflow, strict=True)]
    assert all(u for u, s in zip(run["unchanged"], run["skipped"], strict=True) if s)
    scaler = run["scaler"]
    assert scaler.spike is rule
    records = scaler.records()
    nonfinite = "overflow" if policy == "mixed_float16" else "non_finite"
    assert [(r.iteration, r.reason) for r in records if r.skipped] == [
        (12, "loss_spike"),
        (15, nonfinite),
        (19, "loss_spike"),
    ]
    assert int(scaler.skipped_steps()) == 3
    if policy == "mixed_float16":  # the scale backs off for the overflow only; spikes count as finite steps
        states = LossScaleConfig(growth_interval=3).states(overflow)
        assert [r.next_scale for r in records] == [s.scale for s in states]


@pytest.mark.parametrize("pickled", [False, True])
def test_torch_grad_norm_spikes_follow_the_reference(pickled: bool) -> None:
    rule = SpikeRule("grad_norm", window=6, threshold=4.0)
    run = _torch_run(rule, "mixed_bfloat16", bad=(10, 17), pickled=pickled)
    spikes = rule.decide(run["norms"])
    assert spikes[10] and spikes[17]
    assert run["skipped"] == spikes
    assert [r.reason for r in run["scaler"].records() if r.skipped] == ["grad_spike"] * sum(spikes)


@pytest.mark.parametrize("how", ["state_dict", "pickle"])
def test_the_window_travels_in_state_dicts_and_pickles(how: str) -> None:
    """Resumed at step 14 (from a state dict, or a pickle taken there), the run decides step 19 exactly as the
    uninterrupted one: the window came along (an empty one would need 8 new values first)."""
    rule = SpikeRule("loss", window=8, threshold=4.0)
    whole = _torch_run(rule, "mixed_float16", bad=(12, 19))
    resumed = _torch_run(rule, "mixed_float16", bad=(12, 19), resume_at=14, resume_how=how)
    assert whole["skipped"][19] and resumed["skipped"] == whole["skipped"]
    window = whole["scaler"].state_dict()["spike_window"]
    applied = [x for x, skipped in zip(whole["losses"], whole["skipped"], strict=True) if not skipped]
    assert window == applied[-8:]


def test_a_loaded_window_decides_at_once_on_tensorflow_and_bad_windows_are_refused() -> None:
    tf = pytest.importorskip("tensorflow")
    rule = SpikeRule("loss", window=4, threshold=3.0)
    scaler = polyamp.LossScaler(spike=rule, enabled=True, backend="tensorflow")
    scaler.load_state_dict({**scaler.state_dict(), "spike_window": [0.5, 1.0, 1.1, 0.9, 1.0]})
    assert scaler.state_dict()["spike_window"] == [1.0, 1.1, 0.9, 1.0]  # the newest `window` values
    var = tf.Variable([1.0])
    opt = tf.keras.optimizers.SGD(0.1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(var * 50.0)
        scaled = scaler.scale(loss)
    scaler.apply_gradients(opt, zip(tape.gradient(scaled, [var]), [var]))
    assert bool(scaler.step_skipped(opt)) and float(var.numpy()[0]) == 1.0
    before = scaler.state_dict()
    for bad in (["x"], [math.nan], 3.0):
        with pytest.raises(polyamp.StateDictError, match="spike_window"):
            scaler.load_state_dict({**before, "spike_window": bad})
        assert scaler.state_dict() == before
    plain = polyamp.LossScaler(enabled=True)  # no rule: a window in the dict is nothing to restore
    plain.load_state_dict(before)
    assert "spike_window" not in plain.state_dict()


def test_torch_spike_misuse() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 2)
    opts = [torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)]
    scaler = polyamp.LossScaler(spike=SpikeRule("grad_norm", window=4), enabled=True)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opts[0])
    with pytest.raises(ScalerUsageError, match="watches the gradients of one optimizer"):
        scaler.step(opts[1])
    scaler.discard_iteration()
    with pytest.raises(polyamp.PolyampTypeError, match=r"polyamp\.SpikeRule"):
        polyamp.LossScaler(spike={"on": "loss"})  # type: ignore[arg-type]


# -- TensorFlow ------------------------------------------------------------------------------------------------


def test_tensorflow_loss_spikes_in_tf_function_follow_the_reference() -> None:
    tf = pytest.importorskip("tensorflow")
    rule = SpikeRule("loss", window=6, threshold=4.0)
    tf.keras.utils.set_random_seed(0)
    layer = tf.keras.layers.Dense(3)
    layer.build((None, 5))
    opt = tf.keras.optimizers.SGD(0.05)
    scaler = polyamp.LossScaler(spike=rule, enabled=True, backend="tensorflow")

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x) - y))
            scaled = scaler.scale(loss)
        grads = tape.gradient(scaled, layer.trainable_variables)
        scaler.apply_gradients(opt, zip(grads, layer.trainable_variables))
        return loss

    losses, skipped = [], []
    for i in range(18):
        x = tf.random.stateless_normal((8, 5), seed=(i, 1)) * (20.0 if i in (9, 14) else 1.0)
        before = [v.numpy().copy() for v in layer.trainable_variables]
        losses.append(float(tf.cast(step(x, tf.zeros((8, 3))), tf.float64)))
        skipped.append(bool(scaler.step_skipped(opt)))
        if skipped[-1]:
            assert all((a == v.numpy()).all() for a, v in zip(before, layer.trainable_variables, strict=True))
    spikes = rule.decide(losses)
    assert spikes[9] and spikes[14] and skipped == spikes
    assert [(r.iteration, r.reason) for r in scaler.records() if r.skipped] == [
        (i, "loss_spike") for i, s in enumerate(spikes) if s
    ]
    assert scaler.state_dict()["scale"] == LossScaleConfig().initial_state().scale  # never backed off


# -- a lasting level shift: max_consecutive --------------------------------------------------------------------

#: The issue's trace: the loss settles at 1.0, then at 2.0 from step 40 (+-0.25% so the window's sigma is not 0).
SHIFT = [(1.0 if step < 40 else 2.0) * (1.0025 if step % 2 else 0.9975) for step in range(240)]
SHIFT_RULE = SpikeRule("loss", window=16, threshold=6.0)


def test_reference_rebases_after_max_consecutive_spikes() -> None:
    """window 16 ("auto": 8 consecutive spikes): steps 40..47 are skipped, 48 re-bases the window and every later
    step is applied; without a bound all 200 later steps are skipped."""
    assert SHIFT_RULE.consecutive_limit == 8
    spikes = SHIFT_RULE.decide(SHIFT)
    assert [step for step, spike in enumerate(spikes) if spike] == list(range(40, 48))
    assert [step for step, rebase in enumerate(SHIFT_RULE.rebased(SHIFT)) if rebase] == [48]
    unbounded = SpikeRule("loss", window=16, threshold=6.0, max_consecutive=None)
    assert unbounded.consecutive_limit is None and sum(unbounded.decide(SHIFT)) == 200
    assert not any(unbounded.rebased(SHIFT))
    assert SpikeRule("loss", window=3, threshold=6.0).consecutive_limit == 1  # max(1, window // 2)
    # overflows neither spike nor end the run; the first applied step after the bound re-bases
    skipped = [step in (44, 48, 49) for step in range(60)]
    three = SpikeRule("loss", window=16, threshold=6.0, max_consecutive=3)
    assert [s for s, spike in enumerate(three.decide(SHIFT[:60], skipped)) if spike] == [40, 41, 42]
    assert [s for s, rebase in enumerate(three.rebased(SHIFT[:60], skipped)) if rebase] == [43]
    # after a re-base the window holds one value: decisions resume at `warmup` values of the new level
    assert three.decide([1.0, 1.1, 0.9, 1.0, 9.0, 9.0, 9.0, 9.0, 9.1, 30.0], None) == [False] * 10
    early = SpikeRule("loss", window=4, threshold=3.0, warmup=2, max_consecutive=2)
    trace = [1.0, 1.1, 9.0, 9.0, 9.0, 9.1, 30.0]
    assert early.decide(trace) == [False, False, True, True, False, False, True]
    assert early.rebased(trace) == [False, False, False, False, True, False, False]


def _rebase_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "polyamp" and "re-based" in r.getMessage()]


@pytest.mark.parametrize("resume_how", [None, "state_dict", "pickle"])
def test_torch_level_shift_rebases_once_and_trains_on(resume_how: str | None, caplog: pytest.LogCaptureFixture) -> None:
    """A fused Adam under the float32 policy (guarding); resumed in the middle of the run of spikes (step 44),
    the scaler carries the run along: the same decisions, one re-base warning, every step after 48 applied."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = polyamp.LossScaler(spike=SHIFT_RULE)
    skipped, records = [], []
    with polyamp.policy_scope("float32"), caplog.at_level("WARNING", logger="polyamp"):
        for step, value in enumerate(SHIFT[:120]):
            if step == 44 and resume_how == "pickle":
                records += scaler.records()
                scaler = pickle.loads(pickle.dumps(scaler))
            elif step == 44 and resume_how == "state_dict":
                records += scaler.records()
                saved = json.loads(json.dumps(scaler.state_dict()))
                assert saved["spike_run"] == 4
                scaler = polyamp.LossScaler(spike=SHIFT_RULE)
                scaler.load_state_dict(saved)
            opt.zero_grad()
            out = model(torch.ones(4, 3)).sum()
            scaler.scale(out - out.detach() + value).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(bool(scaler.step_skipped(opt)))
        records += scaler.records()  # a resumed scaler records from its own iteration 0
    assert skipped == SHIFT_RULE.decide(SHIFT[:120])
    assert len(records) == 120
    assert [i for i, r in enumerate(records) if r.rebased] == [48]
    assert [r.reason for r in records].count("loss_spike") == 8
    assert [r.rebased for r in records].count(True) == 1
    assert len(_rebase_warnings(caplog)) == 1
    state = scaler.state_dict()
    assert state["spike_run"] == 0
    assert state["spike_window"] == [float(torch.tensor(v, dtype=torch.float32)) for v in SHIFT[104:120]]
    assert int(opt.state[model.weight]["step"]) == 120 - 8


def test_spike_run_is_validated_in_state_dicts() -> None:
    scaler = polyamp.LossScaler(spike=SHIFT_RULE, enabled=True)
    before = scaler.state_dict()
    assert before["spike_run"] == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(polyamp.StateDictError, match="'spike_run' must be an int >= 0"):
            scaler.load_state_dict({**before, "spike_run": bad})
        assert scaler.state_dict() == before
    scaler.load_state_dict({**before, "spike_run": 5})
    assert scaler.state_dict()["spike_run"] == 5
    assert pickle.loads(pickle.dumps(scaler)).state_dict()["spike_run"] == 5
    older = {key: value for key, value in before.items() if key != "spike_run"}  # saved before spike_run existed
    scaler.load_state_dict(older)
    assert scaler.state_dict()["spike_run"] == 0


def test_tensorflow_level_shift_rebases_once_in_tf_function(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torch")  # torch before TensorFlow in one process
    tf = pytest.importorskip("tensorflow")
    var = tf.Variable([1.0, 2.0])
    opt = tf.keras.optimizers.SGD(0.01)
    scaler = polyamp.LossScaler(spike=SHIFT_RULE, enabled=False, guard=True, backend="tensorflow")

    @tf.function
    def step(value: Any) -> None:
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(var)
            scaled = scaler.scale(total - tf.stop_gradient(total) + value)
        scaler.apply_gradients(opt, zip(tape.gradient(scaled, [var]), [var], strict=True))

    skipped = []
    with caplog.at_level("WARNING", logger="polyamp"):
        for value in SHIFT[:80]:
            step(tf.constant(value, tf.float32))
            skipped.append(bool(scaler.step_skipped(opt)))
        records = scaler.records()
    assert skipped == SHIFT_RULE.decide(SHIFT[:80])
    assert [r.iteration for r in records if r.rebased] == [48]
    assert len(_rebase_warnings(caplog)) == 1
    assert scaler.state_dict()["spike_run"] == 0 and int(opt.iterations.numpy()) == 80 - 8


@pytest.mark.parametrize("enabled", [False, True], ids=["guarding", "scaling"])
def test_a_spike_on_an_overflowing_step_skips_a_fused_optimizer(enabled: bool) -> None:
    # Both flags set at once: torch's fused optimizers skip only when found_inf is exactly 1.0.
    torch = pytest.importorskip("torch")
    import polyamp_torch

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    scaler = polyamp_torch.TorchLossScaler(enabled=enabled, guard=True, spike=SpikeRule(window=4, warmup=2))
    for i in range(5):
        loss = (weight * (1000.0 if i == 4 else 1.0 + 0.01 * i)).sum()  # the last loss is a spike
        scaler.scale(loss).backward()
        if i == 4:
            weight.grad.fill_(float("inf"))
        before = weight.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert scaler.records()[-1].skipped
    assert torch.equal(weight.detach(), before)
    assert int(scaler.skipped_steps()) == 1


# -- huge statistics on the devices ------------------------------------------------------------------------------


def _torch_decisions(rule: SpikeRule, trace: list[float]) -> list[bool]:
    torch = pytest.importorskip("torch")
    weight = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scaler = polyamp.LossScaler(spike=rule)
    skipped = []
    for value in trace:
        optimizer.zero_grad()
        scaler.scale(weight * value).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped.append(bool(scaler.step_skipped(optimizer)))
    return skipped


def _tensorflow_decisions(rule: SpikeRule, trace: list[float]) -> list[bool]:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    weight = tf.Variable(1.0, dtype=tf.float64)
    optimizer = keras.optimizers.SGD(0.0)
    scaler = polyamp.LossScaler(spike=rule, backend="tensorflow")
    skipped = []
    for value in trace:
        with tf.GradientTape() as tape:
            loss = scaler.scale(weight * value)
        scaler.apply_gradients(optimizer, [(tape.gradient(loss, weight), weight)])
        skipped.append(bool(scaler.step_skipped()))
    return skipped


@pytest.mark.parametrize("trace", list(HUGE_TRACES), ids=list(HUGE_TRACES))
@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_the_devices_decide_huge_statistics_as_the_reference(backend: str, trace: str) -> None:
    rule = SpikeRule("loss", window=4, threshold=3.0)
    run = _torch_decisions if backend == "torch" else _tensorflow_decisions
    assert run(rule, HUGE_TRACES[trace]) == rule.decide(HUGE_TRACES[trace])
