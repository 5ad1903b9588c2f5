"""The spike rule: its reference on stored traces, and the device decisions of torch and TensorFlow against it."""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import pytest

import polyamp
from polyamp import LossScaleConfig, PolyampValueError, ScalerUsageError, SpikeRule

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
        ({"window": 1}, "window=...) must be an int >= 2"),
        ({"threshold": 0.0}, "finite positive number"),
        ({"window": 8, "warmup": 9}, "cannot exceed window=8"),
    ],
)
def test_bad_rules_say_what_is_allowed(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PolyampValueError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        SpikeRule(**kwargs)


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
