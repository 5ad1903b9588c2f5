"""The run summary (``summary()`` on every scaler form) and the logging hooks that show it every N steps.

The core's tally is checked against the summary of the records themselves (`RunSummary.of`), over random
runs; then each scaler form with overflows planted at known iterations: `polyamp.LossScaler` on torch (beside
``torch.amp.GradScaler``), ``polyamp_jax.loss_scaled``, and the Keras ``LossScaleOptimizer`` with its callback
on Keras's TensorFlow, JAX and PyTorch backends. The hooks read nothing between two reports.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polyamp
from polyamp import LossScaleConfig, PolyampTypeError, PolyampValueError, StepRecord
from polyamp._src.records import advance
from polyamp.backend_api.records import MODE_CODES, SPIKE_BIT, Recorder, RunSummary, log_every

ROOT = Path(__file__).resolve().parent.parent


def _records(pattern: str, config: LossScaleConfig | None = None, first: int = 0) -> list[StepRecord]:
    """Records of scaling iterations from ``first``: ``F`` stepped, ``O`` overflowed (the scale replayed)."""
    config = config or LossScaleConfig()
    state = config.initial_state()
    records = []
    for offset, mark in enumerate(pattern):
        after = config.next_state(state, mark == "O")
        skipped = mark == "O"
        reason = "overflow" if skipped else None
        records.append(StepRecord(first + offset, skipped, reason, "scaling", state.scale, after.scale))
        state = after
    return records


def _guarded(pattern: str, first: int = 0, reason: str = "non_finite") -> list[StepRecord]:
    """Records of guarding iterations: ``F`` stepped, anything else skipped for ``reason``."""
    return [
        StepRecord(first + i, mark != "F", None if mark == "F" else reason, "guarding", None, None)  # type: ignore[arg-type]
        for i, mark in enumerate(pattern)
    ]


# -- the line -------------------------------------------------------------------------------------------------


def test_the_line_names_the_skips_by_iteration_with_consecutive_ones_as_ranges() -> None:
    pattern = "".join("O" if i in (50, 51, 120, 121, 122) else "F" for i in range(200))
    summary = RunSummary.of(_records(pattern, LossScaleConfig(init_scale=2.0**13, growth_interval=1000)))
    assert str(summary) == "200 steps, 5 skipped (overflow at 50, 51, 120-122), scale 2^13 -> 2^8"
    assert summary.skipped == 5 and summary.iterations() == [50, 51, 120, 121, 122]
    assert summary.skips == {"overflow": (range(50, 52), range(120, 123))}
    assert (summary.scale_start, summary.scale_end, summary.scale_min, summary.scale_max) == (
        8192.0,
        256.0,
        256.0,
        8192.0,
    )
    assert summary.modes == {"scaling": 200} and summary.brief() == "5 skipped, scale 2^8"


def test_the_line_gives_the_minimum_and_maximum_when_the_scale_passed_them() -> None:
    config = LossScaleConfig(init_scale=1024.0, growth_interval=4)
    summary = RunSummary.of(_records("FFFFFFFFOOOFFFF", config))  # 2^10 grows twice, backs off thrice, grows once
    assert str(summary) == "15 steps, 3 skipped (overflow at 8-10), scale 2^10 (min 2^9, max 2^12)"
    assert str(RunSummary.of(_records("FFFFOOO", config))) == (
        "7 steps, 3 skipped (overflow at 4-6), scale 2^10 -> 2^8 (max 2^11)"
    )
    assert str(RunSummary.of(_records("FFF", config))) == "3 steps, none skipped, scale 2^10"
    odd = LossScaleConfig(init_scale=1000.0, growth_factor=1.5, growth_interval=1)
    assert str(RunSummary.of(_records("FO", odd))) == "2 steps, 1 skipped (overflow at 1), scale 1000 -> 750 (max 1500)"
    assert str(RunSummary.of(_records("OOOO", LossScaleConfig(init_scale=4.0)))) == (
        "4 steps, 4 skipped (overflow at 0-3), scale 2^2 -> 1"
    )


def test_the_line_counts_each_reason_when_there_are_several_and_elides_long_lists() -> None:
    records = [*_guarded("FFOFO"), *_guarded("OO", first=5, reason="loss_spike")]
    assert str(RunSummary.of(records)) == (
        "7 steps, 4 skipped (2 non_finite at 2, 4; 2 loss_spike at 5, 6), no loss scaling (gradients checked)"
    )
    many = _guarded("".join("O" if i % 10 == 0 else "F" for i in range(100)))
    assert str(RunSummary.of(many)) == (
        "100 steps, 10 skipped (10 non_finite at 0, 10, 20, 30, 40, 50, ..., 90), no loss scaling (gradients checked)"
    )


def test_the_line_says_what_was_not_scaled_unrecorded_or_resumed() -> None:
    off = [StepRecord(i, False, None, "off", None, None) for i in range(3)]
    assert str(RunSummary.of(off)) == "3 steps, none skipped, no loss scaling or checks"
    mixed = [*_records("FF"), *_guarded("FO", first=2)]
    assert str(RunSummary.of(mixed)) == "4 steps, 1 skipped (non_finite at 3), scale 2^16, 2 guarded without scaling"
    gap = [*_guarded("F"), *_guarded("FO", first=5)]
    summary = RunSummary.of(gap)
    assert str(summary) == "7 steps, 1 skipped (non_finite at 6), no loss scaling (gradients checked), 4 not recorded"
    assert summary.modes == {"guarding": 3} and summary.unrecorded == 4
    assert str(RunSummary.of(_guarded("FF", first=1000))) == (
        "2 steps (iterations 1000-1001), none skipped, no loss scaling (gradients checked)"
    )
    assert str(RunSummary.of([])) == "no steps recorded" and RunSummary.of([]).skipped == 0


def test_the_line_names_the_layers_of_the_non_finite_gradients() -> None:
    from polyamp.backend_api.records import non_finite_gradients

    names = ["enc.0.weight", "enc.0.bias", "enc.1.weight", "head.weight", "a.w", "b.w", "c.w"]
    records = [
        StepRecord(0, True, "non_finite", "guarding", None, None, non_finite_gradients([(names[0], 1, 0, 0, 4)])),
        StepRecord(1, True, "non_finite", "guarding", None, None, non_finite_gradients((n, 0, 0, 2, 4) for n in names)),
    ]
    assert str(RunSummary.of(records)) == (
        "2 steps, 2 skipped (non_finite at 0, 1), no loss scaling (gradients checked), "
        "non-finite gradients in enc.0, enc.1, head, a, b and 1 more"
    )
    assert RunSummary.of(records).layers == ("enc.0", "enc.1", "head", "a", "b", "c")


# -- the tally against the records ----------------------------------------------------------------------------

#: Ring codes: scaling stepped / overflowed, guarding stepped / skipped, a spike skip, off.
CODES = [0, 1, MODE_CODES["guarding"], MODE_CODES["guarding"] + 1, SPIKE_BIT + 1, MODE_CODES["off"]]


def _consume(recorder: Recorder, codes: list[int], reads: list[int], config: LossScaleConfig) -> None:
    """Hand ``codes`` to ``recorder`` in batches of ``reads`` (cycled), as a scaler reads its ring."""
    count = recorder.read_count
    while count < len(codes):
        for batch in reads:
            count = min(len(codes), count + batch)
            recorder.consume(count, codes[:count], config, lambda: None)


@settings(max_examples=150, deadline=None)
@given(
    codes=st.lists(st.sampled_from(CODES + [0] * 6), max_size=60),
    again=st.lists(st.sampled_from(CODES + [0] * 6), max_size=20),
    reads=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 2),
    capped=st.booleans(),
    cut=st.floats(0, 1),
)
def test_the_tally_is_the_summary_of_the_records(
    codes: list[int], again: list[int], reads: list[int], interval: int, hysteresis: int, capped: bool, cut: float
) -> None:
    """Read in batches (runs of stepped iterations tallied without making their records), rewound and read on
    (a functional run stepped again from an older state), the summary equals the summary of the records, scales
    included, and so does the summary up to an iteration."""
    config = LossScaleConfig(
        init_scale=2.0**10, growth_interval=interval, hysteresis=hysteresis, max_scale=2.0**11 if capped else None
    )
    recorder = Recorder(capacity=1000, on_min_scale="ignore")
    recorder.reanchor(config.initial_state())
    _consume(recorder, codes, reads, config)
    assert recorder.summary() == RunSummary.of(recorder.records)
    upto = int(len(codes) * cut)
    assert recorder.summary(upto) == RunSummary.of([r for r in recorder.records if r.iteration < upto])
    state = config.initial_state()
    for code in codes[:upto]:
        state = advance(config, state, code)
    recorder.rewind(upto, state)
    _consume(recorder, codes[:upto] + again, reads, config)
    assert recorder.summary() == RunSummary.of(recorder.records)


def test_the_tally_covers_more_than_the_records_kept_and_counts_lost_iterations() -> None:
    config = LossScaleConfig(init_scale=2.0**10, growth_interval=3)
    recorder = Recorder(capacity=4, on_min_scale="ignore")
    recorder.reanchor(config.initial_state())
    codes = [0, 0, 1, 0, 0, 0, 0, 1, 1, 0]
    for count in (3, 6, 9, 10):
        recorder.consume(count, codes[max(0, count - 4) : count], config, lambda: None)
    assert [r.iteration for r in recorder.records] == [6, 7, 8, 9]
    assert str(recorder.summary()) == "10 steps, 3 skipped (overflow at 2, 7, 8), scale 2^10 -> 2^8"
    lossy = Recorder(capacity=4, on_min_scale="ignore")
    lossy.reanchor(config.initial_state())
    lossy.consume(10, codes[6:], config, lambda: config.states([True, False]).pop())
    assert str(lossy.summary()) == "10 steps, 2 skipped (overflow at 7, 8), scale 2^9, 6 not recorded"


def test_a_rewound_run_forgets_the_iterations_that_ran_again() -> None:
    config = LossScaleConfig(init_scale=2.0**10, growth_interval=100)
    recorder = Recorder(capacity=100, on_min_scale="ignore")
    recorder.reanchor(config.initial_state())
    recorder.consume(6, [0, 0, 1, 0, 1, 1], config, lambda: None)
    recorder.rewind(3, config.states([False, False, True])[-1])
    recorder.consume(5, [0, 0, 1, 1, 0], config, lambda: None)
    assert str(recorder.summary()) == "5 steps, 2 skipped (overflow at 2, 3), scale 2^10 -> 2^8"
    assert recorder.summary() == RunSummary.of(recorder.records)


# -- the hook's rule ------------------------------------------------------------------------------------------


class _Bar:
    def __init__(self) -> None:
        self.postfix: list[str] = []

    def set_postfix_str(self, text: str) -> None:
        self.postfix.append(text)


def test_log_every_reads_and_shows_every_n_steps_only(capsys: pytest.CaptureFixture[str]) -> None:
    reads: list[int] = []

    def read() -> RunSummary:
        reads.append(len(reads))
        return RunSummary.of(_records("F" * 10 * len(reads)))

    shown = [log_every(read, step, 10) for step in range(30)]
    assert reads == [0, 1, 2] and [step for step, s in enumerate(shown) if s is not None] == [9, 19, 29]
    assert capsys.readouterr().out.splitlines() == [
        "polyamp: 10 steps, none skipped, scale 2^16",
        "polyamp: 20 steps, none skipped, scale 2^16",
        "polyamp: 30 steps, none skipped, scale 2^16",
    ]
    bar, lines = _Bar(), []
    log_every(lambda: RunSummary.of(_records("FO")), 1, 2, bar)
    log_every(lambda: RunSummary.of(_records("FO")), 3, 2, bar, lines.append)
    assert bar.postfix == ["1 skipped, scale 2^15"] * 2 and capsys.readouterr().out == ""
    assert lines == ["polyamp: 2 steps, 1 skipped (overflow at 1), scale 2^16 -> 2^15"]


@pytest.mark.parametrize(
    ("step", "every", "progress", "error", "match"),
    [
        (True, 10, None, PolyampTypeError, r"`step` must be .* Received: True"),
        (-1, 10, None, PolyampTypeError, r"`step` must be .* Received: -1"),
        (1.0, 10, None, PolyampTypeError, r"`step` must be .* Received: 1\.0"),
        (1, 0, None, PolyampValueError, r"`every` must be an int of at least 1.* Received: 0"),
        (1, 2.5, None, PolyampValueError, r"`every` must be .* Received: 2\.5"),
        (1, 2, object(), PolyampTypeError, r"`progress` must be a progress bar with set_postfix_str"),
    ],
)
def test_log_every_refuses_what_is_not_a_count_or_a_bar(
    step: Any, every: Any, progress: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        log_every(lambda: pytest.fail("read"), step, every, progress)


@contextmanager
def _calls(device: Any) -> Iterator[list[str]]:
    """The public methods of ``device`` called inside the block, by name, in order."""
    called: list[str] = []
    own = dict(vars(device))
    names = [n for n in dir(device) if not n.startswith("_") and callable(getattr(device, n, None))]
    for name in names:
        method = getattr(device, name)

        def counted(*args: Any, __name: str = name, __method: Callable[..., Any] = method, **kwargs: Any) -> Any:
            called.append(__name)
            return __method(*args, **kwargs)

        setattr(device, name, counted)
    try:
        yield called
    finally:
        for name in names:
            if name in own:
                setattr(device, name, own[name])
            else:
                delattr(device, name)


# -- torch ----------------------------------------------------------------------------------------------------


def _torch_run(
    steps: int, inf_at: set[int], policy: str, hook: Callable[[Any, int], None] | None = None, **options: Any
) -> tuple[Any, Any, Any]:
    """``steps`` iterations of a small model under ``policy``, an inf planted in layer 2's gradient at ``inf_at``,
    with polyamp's scaler and, under float16, torch's GradScaler beside it on a twin model."""
    torch = pytest.importorskip("torch")
    import polyamp_torch

    models, optimizers = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        models.append(model)
        optimizers.append(torch.optim.SGD(model.named_parameters(), lr=0.01))
    scaler = polyamp.LossScaler(**options)
    settings = {k: v for k, v in options.items() if k in ("init_scale", "growth_interval")}
    native = torch.amp.GradScaler("cpu", **settings) if policy == "mixed_float16" else None
    data = torch.Generator().manual_seed(0)
    with polyamp.policy_scope(policy):
        for step in range(steps):
            x = torch.randn(4, 8, generator=data)
            for model, optimizer, amp in ((models[0], optimizers[0], scaler), (models[1], optimizers[1], native)):
                if amp is None:
                    continue
                optimizer.zero_grad()
                with polyamp_torch.autocast():
                    loss = model(x).float().square().mean()
                amp.scale(loss).backward()
                if step in inf_at:
                    model[2].weight.grad[0, 0] = math.inf
                amp.step(optimizer)
                amp.update()
            if hook is not None:
                hook(scaler, step)
    return scaler, native, models[0]


def test_torch_summary_names_the_planted_overflows_over_more_steps_than_the_history() -> None:
    """200 iterations, 16 records kept: the summary still covers all of them, and its scale is GradScaler's."""
    scaler, native, _ = _torch_run(
        200, {50, 51, 120, 121, 122}, "mixed_float16", init_scale=1024.0, growth_interval=50, history=16
    )
    summary = scaler.summary()
    assert str(summary) == (
        "200 steps, 5 skipped (overflow at 50, 51, 120-122), scale 2^10 -> 2^8 (min 2^7, max 2^11), "
        "non-finite gradients in 2"
    )
    assert len(scaler.records()) == 16 and summary.skipped == int(scaler.skipped_steps()) == 5
    assert summary.scale_end == native.get_scale() == scaler.get_scale() == 256.0
    pattern = [i in (50, 51, 120, 121, 122) for i in range(200)]
    trajectory = LossScaleConfig(init_scale=1024.0, growth_interval=50).trajectory(pattern)
    assert (summary.scale_min, summary.scale_max) == (min(trajectory), max([1024.0, *trajectory]))


def test_torch_summary_under_the_bfloat16_guard_lists_the_skips_without_a_scale() -> None:
    scaler, _, _ = _torch_run(12, {3, 4, 5, 9}, "mixed_bfloat16")
    assert str(scaler.summary()) == (
        "12 steps, 4 skipped (non_finite at 3-5, 9), no loss scaling (gradients checked), non-finite gradients in 2"
    )
    assert scaler.summary().brief() == "4 skipped"


@pytest.mark.parametrize("skip_on_device", [False, True], ids=["host-decided", "device-decided"])
def test_torch_log_summary_reads_nothing_from_the_device_between_reports(
    skip_on_device: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Between two reports the hook makes no host read (counted at torch's dispatcher) and calls nothing of the
    scaler's device; at each report it reads the records."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    import polyamp_torch

    class ScalarReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default:
                ScalarReads.count += 1
            return func(*args, **(kwargs or {}))

    between: list[tuple[int, int, list[str]]] = []
    at_reports: list[list[str]] = []

    def hook(scaler: Any, step: int) -> None:
        reads = ScalarReads.count
        with ScalarReads(), _calls(scaler.device_form) as called:
            shown = polyamp_torch.log_summary(scaler, step, every=10)
        (at_reports.append(called) if shown is not None else between.append((step, ScalarReads.count - reads, called)))

    _torch_run(30, {12}, "mixed_float16", hook, skip_on_device=skip_on_device)
    assert len(between) == 27 and all(reads == 0 and called == [] for _, reads, called in between), between
    assert len(at_reports) == 3 and all("read_history" in called for called in at_reports)
    # A skip decided on the device names its gradients only when the records are read before the next iteration.
    layers = "" if skip_on_device else ", non-finite gradients in 2"
    assert capsys.readouterr().out.splitlines() == [
        "polyamp: 10 steps, none skipped, scale 2^16",
        f"polyamp: 20 steps, 1 skipped (overflow at 12), scale 2^16 -> 2^15{layers}",
        f"polyamp: 30 steps, 1 skipped (overflow at 12), scale 2^16 -> 2^15{layers}",
    ]


def test_torch_log_summary_puts_the_short_form_in_a_tqdm_bar(capsys: pytest.CaptureFixture[str]) -> None:
    tqdm = pytest.importorskip("tqdm")
    import polyamp_torch

    bar = tqdm.tqdm(total=20, file=io.StringIO())
    _torch_run(
        20, {4}, "mixed_float16", lambda scaler, step: polyamp_torch.log_summary(scaler, step, every=10, progress=bar)
    )
    assert bar.postfix == "1 skipped, scale 2^15" and capsys.readouterr().out == ""
    with pytest.raises(PolyampTypeError, match=r"log_summary needs the polyamp\.LossScaler in use\. Received: "):
        polyamp_torch.log_summary(object(), 9, every=10)  # type: ignore[arg-type]


# -- JAX ------------------------------------------------------------------------------------------------------


def _jax_run(
    steps: int, inf_at: set[int], start: Any = None, hook: Callable[[Any, int], None] | None = None, history: int = 8
) -> Any:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp
    import polyamp_jax

    with polyamp.policy_scope("mixed_float16"):  # the transformation scales: made under a float16 policy
        tx = polyamp_jax.loss_scaled(optax.sgd(1e-3), init_scale=2.0**10, growth_interval=10, history=history)
    params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
    opt_state = tx.init(params) if start is None else start

    @jax.jit
    def step(params: Any, opt_state: Any, poison: Any) -> Any:
        def loss(p: Any) -> Any:
            return jnp.mean((jnp.full((4, 8), 0.1) @ p["w"] + p["b"]) ** 2)

        grads = jax.grad(lambda p: polyamp_jax.scale_loss(opt_state, loss(p)))(params)
        grads = {**grads, "b": grads["b"] + poison}
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for index in range(steps):
        params, opt_state = step(params, opt_state, jnp.inf if index in inf_at else 0.0)
        if hook is not None:
            hook(opt_state, index)
    return opt_state


def test_jax_summary_and_log_summary_name_the_planted_overflows(capsys: pytest.CaptureFixture[str]) -> None:
    """Every 8 steps (the ring's history), the hook reads the state's records; in between it calls nothing of
    the functional device."""
    pytest.importorskip("optax")
    import polyamp_jax

    between: list[list[str]] = []

    def hook(opt_state: Any, step: int) -> None:
        with _calls(polyamp_jax.scaler_of(opt_state).device) as called:
            if polyamp_jax.log_summary(opt_state, step, every=8) is None:
                between.append(called)
            else:
                assert "ring_read" in called

    opt_state = _jax_run(40, {5, 6, 20, 21, 22}, hook=hook)
    assert len(between) == 35 and all(called == [] for called in between)
    assert capsys.readouterr().out.splitlines() == [
        "polyamp: 8 steps, 2 skipped (overflow at 5, 6), scale 2^10 -> 2^8, non-finite gradients in b",
        "polyamp: 16 steps, 2 skipped (overflow at 5, 6), scale 2^10 -> 2^8, non-finite gradients in b",
        "polyamp: 24 steps, 5 skipped (overflow at 5, 6, 20-22), scale 2^10 -> 2^6, non-finite gradients in b",
        "polyamp: 32 steps, 5 skipped (overflow at 5, 6, 20-22), scale 2^10 -> 2^6, non-finite gradients in b",
        "polyamp: 40 steps, 5 skipped (overflow at 5, 6, 20-22), scale 2^10 -> 2^7 (min 2^6), non-finite gradients in b",
    ]
    summary = polyamp_jax.summary(opt_state)
    assert summary.scale_end == polyamp_jax.state_dict(opt_state)["scale"] == 128.0
    pattern = [i in (5, 6, 20, 21, 22) for i in range(40)]
    assert summary.scale_end == LossScaleConfig(init_scale=2.0**10, growth_interval=10).trajectory(pattern)[-1]


def test_jax_summary_of_an_older_state_or_a_rerun_covers_that_state_s_own_steps() -> None:
    pytest.importorskip("optax")
    import polyamp_jax

    early = _jax_run(6, {2}, history=16)
    later = _jax_run(6, {4}, start=early, history=16)
    assert str(polyamp_jax.summary(later)) == (
        "12 steps, 2 skipped (overflow at 2, 10), scale 2^10 -> 2^8, non-finite gradients in b"
    )
    # (the state names the gradients of its last skip only: iteration 2's were not read while it was the last)
    assert str(polyamp_jax.summary(early)) == "6 steps, 1 skipped (overflow at 2), scale 2^10 -> 2^9"
    again = _jax_run(6, {0, 1}, start=early, history=16)  # the run stepped again from the older state, other overflows
    assert str(polyamp_jax.summary(again)) == (
        "12 steps, 3 skipped (overflow at 2, 6, 7), scale 2^10 -> 2^7, non-finite gradients in b"
    )


# -- Keras, on each of its backends ---------------------------------------------------------------------------

_KERAS_FIT = textwrap.dedent(
    """
    import json
    import numpy as np
    import keras, polyamp, polyamp_keras

    out = {}
    for policy in ("mixed_float16", "mixed_bfloat16"):
        with polyamp.policy_scope(policy):
            keras.utils.set_random_seed(0)
            layers = [keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="hidden"), keras.layers.Dense(3, name="head")]
            model = polyamp_keras.cast_outputs(keras.Sequential(layers, name="net"))
            optimizer = polyamp_keras.LossScaleOptimizer(keras.optimizers.SGD(0.01), init_scale=1024.0)
            model.compile(optimizer=optimizer, loss="mse")
            rng = np.random.default_rng(0)
            x, y = rng.normal(size=(80, 6)).astype("float32"), rng.normal(size=(80, 3)).astype("float32")
            for batch in (2, 3, 6):
                x[8 * batch, 0] = np.inf  # batches 2, 3 and 6 (shuffle=False): non-finite gradients
            logs = []

            class Logs(keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None, seen=logs):
                    seen.append({k: float(v) for k, v in logs.items() if k != "loss"})

            history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                                callbacks=[polyamp_keras.LossScaleCallback(), Logs()])
            out[policy] = {
                "summary": str(optimizer.summary()),
                "history": sorted(k for k in history.history if k != "loss"),
                "logs": logs,
            }
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.parametrize(
    "backend",
    ["tensorflow", pytest.param("jax", marks=pytest.mark.slow), pytest.param("torch", marks=pytest.mark.slow)],
    ids=lambda b: f"keras-{b}",
)
def test_keras_summary_and_callback_show_what_the_policy_makes_worth_watching(
    backend: str, run_bounded: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    """``fit`` with non-finite batches at 2, 3 and 6: under float16 the callback logs the scale and the skips,
    under bfloat16 the skips alone (no ``loss_scale`` of 1.0); the optimizer's summary names them."""
    import importlib.util

    for module in ("keras", backend):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    paths = [str(ROOT), *(str(ROOT / "backends" / b) for b in ("torch", "tensorflow", "keras", "jax"))]
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.pathsep.join(paths))
    result = run_bounded([sys.executable, "-c", _KERAS_FIT], env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(line[len("RESULT ") :])
    scaled, guarded = out["mixed_float16"], out["mixed_bfloat16"]
    assert scaled["summary"] == (
        "10 steps, 3 skipped (overflow at 2, 3, 6), scale 2^10 -> 2^7, non-finite gradients in net/hidden, net/head"
    )
    assert scaled["history"] == ["loss_scale", "skipped_steps"]
    scales = [1024.0, 1024.0, 512.0, 256.0, 256.0, 256.0, 128.0, 128.0, 128.0, 128.0]
    skips = [0, 0, 1, 2, 2, 2, 3, 3, 3, 3]
    assert scaled["logs"] == [{"loss_scale": s, "skipped_steps": k} for s, k in zip(scales, skips)]
    assert guarded["summary"] == (
        "10 steps, 3 skipped (non_finite at 2, 3, 6), no loss scaling (gradients checked), "
        "non-finite gradients in net/hidden, net/head"
    )
    assert guarded["history"] == ["skipped_steps"]
    assert guarded["logs"] == [{"skipped_steps": k} for k in skips]
