"""The forward watch: which layer first produced an inf or NaN, on torch and on Keras (every Keras backend).

The core's decision is tested on hand-built calls; each backend on a model where one known layer produces
the non-finite values, with the expected counts computed here, independently, from that layer's input.
The Keras tests run in this process on its Keras backend, and `test_keras_on_every_backend` runs them again
in a subprocess per other Keras backend.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import polyamp
from polyamp import ForwardReport, NonFiniteOutput, PolyampTypeError, PolyampValueError
from polyamp.backend_api.forward_watch import ForwardPass, WatchedCall, forward_report

HERE = Path(__file__).resolve()
#: The conftest fixture run_bounded: a subprocess bounded by POLYAMP_TEST_TIMEOUT.
RunBounded = Callable[..., "subprocess.CompletedProcess[str]"]
SUBPROCESS = os.environ.get("POLYAMP_FORWARD_WATCH_SUBPROCESS") == "1"


def _counts(values: Any) -> tuple[int, int, int]:
    """(+inf, -inf, NaN) counts of an array, by NumPy."""
    a = np.asarray(values, dtype=np.float64)
    return int(np.isposinf(a).sum()), int(np.isneginf(a).sum()), int(np.isnan(a).sum())


def _log_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "polyamp"]


# -- the core's decision, on hand-built calls --------------------------------------------------------------------


def test_core_names_the_first_producer_and_the_propagating_calls() -> None:
    calls = [
        WatchedCall("stem", 1, True, True, dtype="float32", size=4),
        WatchedCall("block.0", 3, True, False, inf=2, neg_inf=1, dtype="float16", size=8),  # producer
        WatchedCall("block.1", 4, False, False, inf=2, nan=1, dtype="float16", size=8),  # input non-finite
        WatchedCall("block", 2, True, False, inf=2, nan=1, dtype="float16", size=8),  # a child produced
        WatchedCall("side", 5, True, False, nan=4, dtype="float32", size=4),  # finite inputs again
        WatchedCall("", 0, True, False, nan=3, dtype="float32", size=3),
    ]
    report = forward_report(calls, step=12)
    assert report == ForwardReport(
        step=12,
        producer=NonFiniteOutput("block.0", "produced", 2, 1, 0, "float16", 3, 8),
        propagated=(
            NonFiniteOutput("block.1", "propagated", 2, 0, 1, "float16", 4, 8),
            NonFiniteOutput("block", "propagated", 2, 0, 1, "float16", 2, 8),
            NonFiniteOutput("", "propagated", 0, 0, 3, "float32", 0, 3),
        ),
        also_produced=(NonFiniteOutput("side", "produced", 0, 0, 4, "float32", 5, 4),),
    )
    assert [o.path for o in report.outputs] == ["", "block", "block.0", "block.1", "side"]  # by call index
    text = str(report)
    assert text.splitlines()[0] == (
        "Forward pass 12: 'block.0' produced a non-finite float16 output from finite inputs (call 3): "
        "2 inf, 1 -inf, 0 NaN of 8 values."
    )
    assert "Also produced from finite inputs: 'side' (float32, call 5): 0 inf, 0 -inf, 4 NaN of 4 values" in text
    assert "Propagated by 3: 'block.1' (float16, call 4)" in text and "the model (float32, call 0)" in text


def test_core_all_finite_is_none_and_non_finite_inputs_leave_no_producer() -> None:
    assert forward_report([]) is None
    assert forward_report([WatchedCall("a", 0, True, True), WatchedCall("b", 1, False, True)]) is None
    report = forward_report([WatchedCall("a", 1, False, False, nan=2, size=2), WatchedCall("", 0, False, False)])
    assert report is not None and report.producer is None and report.step is None
    assert [o.path for o in report.propagated] == ["a", ""]
    assert report.message().startswith("Forward pass: no watched layer produced a non-finite output")


def test_core_an_enclosing_call_produces_when_its_own_code_made_the_value() -> None:
    # "block" computed inf from finite inputs and passed it to its child, which only propagated it.
    report = forward_report([WatchedCall("block.0", 1, False, False, inf=1), WatchedCall("block", 0, True, False)])
    assert report is not None and report.producer is not None
    assert report.producer.path == "block" and [o.path for o in report.propagated] == ["block.0"]


def test_core_message_lists_five_propagating_calls_then_a_count() -> None:
    calls = [WatchedCall("p", 0, True, False, inf=1)] + [WatchedCall(f"c{i}", i, False, False) for i in range(1, 9)]
    report = forward_report(calls)
    assert report is not None and len(report.propagated) == 8
    assert "; and 3 more (all in the report's propagated)." in report.message() and "'c6'" not in report.message()


def test_core_forward_pass_assembles_the_calls_a_backend_sees() -> None:
    """ForwardPass, framework-free (lists of floats as tensors): each tensor checked once by identity, a
    version change checks it again, calls nest by begin/end, and the report counts only non-finite outputs."""
    versions: dict[int, int] = {}
    checked: list[list[float]] = []

    def check(values: list[float]) -> bool:
        checked.append(values)
        return all(math.isfinite(v) for v in values)

    x, hidden, out = [1.0, 2.0], [math.inf, 1.0], [math.nan, math.inf, -math.inf]
    forward = ForwardPass(3, check, version=lambda t: versions.get(id(t), 0))
    forward.begin("model", "", [x])
    forward.begin("dense", "dense", [x])  # x again: no second check
    forward.end("dense", [hidden])
    forward.begin("head", "head", [hidden])
    forward.end("other", [out])  # not the innermost open call: ignored
    forward.end("head", [out])
    versions[id(out)] = 1  # changed in place after its check: checked again
    forward.end("model", [out])
    assert checked == [x, hidden, out, out]
    assert forward.report([True] * len(forward.checks), size=len, dtype=lambda t: "float32", counts=len) is None
    report = forward.report(
        [bool(c) for c in forward.checks],
        size=len,
        dtype=lambda t: "float16",
        counts=lambda t: [sum(v == math.inf for v in t), sum(v == -math.inf for v in t), sum(v != v for v in t)],
    )
    assert report is not None and report.step == 3
    assert (report.producer.path, report.producer.inf, report.producer.size) == ("dense", 1, 2)
    assert [(o.path, o.inf, o.neg_inf, o.nan, o.exact) for o in report.propagated] == [
        ("head", 1, 1, 1, False),  # its output changed after its check: counted as it is now, not exact
        ("", 1, 1, 1, True),  # checked again after the change
    ]


def test_core_records_refuse_bad_values() -> None:
    with pytest.raises(PolyampValueError, match="kind must be 'produced' or 'propagated'; received 'made'"):
        NonFiniteOutput("a", "made", 0, 0, 0, "float16", 0)  # type: ignore[arg-type]
    with pytest.raises(PolyampValueError, match="inf must be an int >= 0; received -1"):
        NonFiniteOutput("a", "produced", -1, 0, 0, "float16", 0)
    with pytest.raises(PolyampValueError, match="takes WatchedCall records; received dict at position 0"):
        forward_report([{"path": "a"}])  # type: ignore[list-item]
    assert polyamp.ForwardReport is ForwardReport and "NonFiniteOutput" in polyamp.__all__


# -- torch ---------------------------------------------------------------------------------------------------------


def _torch() -> Any:
    return pytest.importorskip("torch")


def _torch_model() -> Any:
    """stem -> block (Linear, Divide, ReLU) -> head; ``block.1`` divides by zero in its first three columns."""
    torch = _torch()

    class Divide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("divisor", torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]))

        def forward(self, x: Any) -> Any:
            return x / self.divisor

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(6, 6), Divide(), torch.nn.ReLU())
    with torch.no_grad():
        block[0].weight[0].zero_()  # column 0 is exactly 0: 0/0 is NaN
        block[0].bias[0] = 0.0
    model = torch.nn.Sequential(OrderedDict(stem=torch.nn.Linear(4, 6), block=block, head=torch.nn.Linear(6, 3)))
    return model


def _torch_input(seed: int = 1) -> Any:
    torch = _torch()
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))


def _torch_expected(model: Any, x: Any) -> dict[str, tuple[int, int, int]]:
    """The counts of every non-finite output, from the modules called one by one without any watch."""
    torch = _torch()
    with torch.no_grad():
        h = model.block[0](model.stem(x))
        with np.errstate(divide="ignore", invalid="ignore"):
            divided = h.numpy()[:, :3] / np.zeros(3)  # NumPy's division, not torch's
        out = {"block.1": _counts(divided)}
        d = model.block[1](h)
        out["block.2"] = _counts(model.block[2](d).numpy())
        out["block"] = out["block.2"]
        out["head"] = out[""] = _counts(model.head(model.block[2](d)).numpy())
    return out


def test_torch_report_names_the_producer_with_exact_counts_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    import polyamp_torch

    model, x = _torch_model(), _torch_input()
    expected = _torch_expected(model, x)
    assert expected["block.1"][0] > 0 and expected["block.1"][1] > 0 and expected["block.1"][2] == 5
    with caplog.at_level(logging.WARNING, logger="polyamp"), polyamp_torch.watch_forward(model) as watch:
        model(x)
    report = watch.report()
    assert report is not None and report.step == 0
    assert report.producer == NonFiniteOutput("block.1", "produced", *expected["block.1"], "float32", 4, 30)
    assert [(o.path, o.kind) for o in report.propagated] == [
        ("block.2", "propagated"),
        ("block", "propagated"),
        ("head", "propagated"),
        ("", "propagated"),
    ]
    assert [(o.inf, o.neg_inf, o.nan) for o in report.propagated] == [expected[o.path] for o in report.propagated]
    assert report.also_produced == ()
    records = _log_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert records[0].getMessage() == report.message() and "'block.1' produced" in records[0].getMessage()


def test_torch_float16_overflow_under_autocast_is_the_linear_layers() -> None:
    torch = _torch()
    import polyamp_torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(4, 6)))
    with torch.no_grad():
        model[1][1].weight.copy_(torch.tensor([[3e4] * 4, [-3e4] * 4, [1.0] * 4, [0.5] * 4, [2e4] * 4, [-1.0] * 4]))
        model[1][1].bias.zero_()
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    x = torch.rand(3, 4, generator=torch.Generator().manual_seed(2)) + 2.0  # GELU(x) is about x: 2 to 3
    with torch.no_grad():
        a = model[1][0](model[0](x)).double().numpy()
    exact = a @ model[1][1].weight.detach().double().numpy().T  # float64: far from float16's 65504 either way
    assert np.all((np.abs(exact) > 7e4) | (np.abs(exact) < 6e4))
    expected = (int((exact > 7e4).sum()), int((exact < -7e4).sum()), 0)
    assert expected[0] > 0 and expected[1] > 0
    with polyamp_torch.watch_forward(model) as watch, polyamp_torch.autocast("mixed_float16", device_type="cpu"):
        model(x)
    report = watch.report()
    assert report is not None and report.producer is not None
    assert (report.producer.path, report.producer.dtype) == ("1.1", "float16")
    assert (report.producer.inf, report.producer.neg_inf, report.producer.nan) == expected
    assert [o.path for o in report.propagated] == ["1", ""]


def test_torch_finite_forward_reports_none_and_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    torch = _torch()
    import polyamp_torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    with caplog.at_level(logging.DEBUG, logger="polyamp"), polyamp_torch.watch_forward(model) as watch:
        model(_torch_input())
        assert watch.report() is None and watch.forwards == 1
    assert _log_records(caplog) == []


def test_torch_outputs_and_gradients_are_bitwise_unchanged() -> None:
    torch = _torch()
    import polyamp_torch

    x = _torch_input()
    plain = _torch_model()
    watched = _torch_model()
    y_plain = plain(x)
    with polyamp_torch.watch_forward(watched) as watch:
        y_watched = watched(x)
    assert watch.report() is not None
    assert torch.equal(y_plain.view(torch.int32), y_watched.view(torch.int32))  # bit patterns, NaNs included
    finite = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))
    twin.load_state_dict(finite.state_dict())
    finite(x).square().sum().backward()
    with polyamp_torch.watch_forward(twin):
        twin(x).square().sum().backward()
    for p, q in zip(finite.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def _hook_dicts(module: Any) -> list[dict[Any, Any]]:
    names = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")
    return [getattr(module, name) for name in (*names, "_forward_hooks_always_called")]


def test_torch_removal_leaves_no_hook_and_keeps_the_report() -> None:
    import polyamp_torch

    model = _torch_model()
    watch = polyamp_torch.watch_forward(model)
    assert watch.active and all(len(d) > 0 for m in model.modules() for d in _hook_dicts(m)[:2])
    model(_torch_input())
    watch.remove()
    assert not watch.active and all(len(d) == 0 for m in model.modules() for d in _hook_dicts(m))
    report = watch.report()
    assert report is not None and report.producer is not None and report.producer.path == "block.1"
    model(_torch_input())  # not watched any more
    assert watch.forwards == 1 and watch.report() is report
    watch.remove()  # again: nothing left to remove


def test_torch_every_n_watches_one_forward_in_n() -> None:
    import polyamp_torch

    model = _torch_model()
    finite_input = _torch_input()
    with polyamp_torch.watch_forward(model, every=2) as watch:
        model.block[1].divisor.fill_(1.0)
        model(finite_input)  # forward 0: watched, finite
        assert watch.report() is None
        model.block[1].divisor[0] = 0.0
        model(finite_input)  # forward 1: not watched
        assert watch.report() is None and watch.forwards == 2
        model(finite_input)  # forward 2: watched
    report = watch.report()
    assert report is not None and report.step == 2 and report.producer is not None
    assert report.producer.path == "block.1"


def test_torch_non_finite_model_input_has_no_producer() -> None:
    import polyamp_torch

    model = _torch_model()
    x = _torch_input()
    x[0, 0] = float("nan")
    model.block[1].divisor.fill_(1.0)
    with polyamp_torch.watch_forward(model) as watch:
        model(x)
    report = watch.report()
    assert report is not None and report.producer is None
    assert report.propagated[0].path == "stem" and report.propagated[0].nan == 6  # one row of 6 outputs


def test_torch_inplace_change_after_the_call_is_flagged_not_exact() -> None:
    torch = _torch()
    import polyamp_torch

    linear = torch.nn.Linear(2, 4)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[1e38, 1e38], [-1e38, -1e38], [1.0, 1.0], [-1.0, -1.0]]))
        linear.bias.zero_()
    model = torch.nn.Sequential(linear, torch.nn.ReLU(inplace=True))
    with polyamp_torch.watch_forward(model) as watch, torch.no_grad():
        model(torch.full((1, 2), 3.0))  # float32 overflow: +inf, -inf; the in-place ReLU zeroes the -inf
    report = watch.report()
    assert report is not None and report.producer is not None
    assert (report.producer.path, report.producer.exact) == ("0", False)
    assert (report.producer.inf, report.producer.neg_inf) == (1, 0)  # counted after the ReLU
    assert "(counted after an in-place change to the output)" in report.message()
    assert [(o.path, o.kind) for o in report.propagated] == [("1", "propagated"), ("", "propagated")]


def test_torch_an_exception_in_forward_leaves_the_watch_usable() -> None:
    torch = _torch()
    import polyamp_torch

    class Fails(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            raise RuntimeError("boom")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Fails())
    with polyamp_torch.watch_forward(model) as watch:
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(1, 2))
        model[1] = torch.nn.Identity()  # added after the watch began: not watched, the rest still is
        model(torch.ones(1, 2))
        assert watch.report() is None and watch.forwards == 2


def test_torch_refuses_a_non_module_and_a_bad_every() -> None:
    torch = _torch()
    import polyamp_torch

    with pytest.raises(PolyampTypeError, match=r"expects a torch\.nn\.Module; received"):
        polyamp_torch.watch_forward(lambda x: x)  # type: ignore[arg-type]
    model = torch.nn.Linear(2, 2)
    with pytest.raises(PolyampValueError, match=r"every=\.\.\.\) must be an int >= 1; received 0"):
        polyamp_torch.watch_forward(model, every=0)
    assert all(len(d) == 0 for d in _hook_dicts(model))


# -- Keras, on this process's Keras backend (and on the others in subprocesses) -------------------------------------


def _keras() -> Any:
    return pytest.importorskip("keras")


def _keras_model() -> Any:
    """m: stem -> block (Dense d0, Divide, ReLU) -> head; ``block/divide`` divides by zero in 3 columns."""
    keras = _keras()
    ops = keras.ops

    class Divide(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            return x / ops.convert_to_tensor(np.array([0.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype="float32"))

    keras.utils.set_random_seed(0)
    block = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(6, name="d0"), Divide(name="divide"), keras.layers.ReLU(name="relu")],
        name="block",
    )
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(6, name="stem"), block, keras.layers.Dense(3, name="head")], name="m"
    )
    kernel, bias = block.layers[0].get_weights()
    kernel[:, 0] = 0.0  # column 0 is exactly 0: 0/0 is NaN
    bias[:] = 0.0
    block.layers[0].set_weights([kernel, bias])
    return model


def _keras_input() -> Any:
    return np.random.default_rng(1).normal(size=(5, 4)).astype("float32")


def test_keras_report_names_the_producer_with_exact_counts(caplog: pytest.LogCaptureFixture) -> None:
    keras = _keras()
    import polyamp_keras

    ops = keras.ops
    model, x = _keras_model(), _keras_input()
    block = model.layers[1]
    h = ops.convert_to_numpy(block.layers[0](model.layers[0](x)))
    with np.errstate(divide="ignore", invalid="ignore"):
        divided = h[:, :3] / np.zeros(3)
    produced = _counts(divided)
    after_relu = _counts(ops.convert_to_numpy(block.layers[2](block.layers[1](h))))
    out = _counts(ops.convert_to_numpy(model.layers[2](block.layers[2](block.layers[1](h)))))
    assert produced[2] == 5 and produced[0] + produced[1] == 10
    with caplog.at_level(logging.WARNING, logger="polyamp"), polyamp_keras.watch_forward(model) as watch:
        model(x)
    report = watch.report()
    assert report is not None and report.step == 0
    # Keras's own paths: the block was built on its own Input, so its layers' paths start at "block".
    assert [block.layers[1].path, block.path, model.layers[2].path] == ["block/divide", "block", "m/head"]
    assert report.producer == NonFiniteOutput("block/divide", "produced", *produced, "float32", 4, 30)
    assert [o.path for o in report.propagated] == ["block/relu", "block", "m/head", "m"]
    assert [(o.inf, o.neg_inf, o.nan) for o in report.propagated] == [after_relu, after_relu, out, out]
    records = _log_records(caplog)
    assert len(records) == 1 and records[0].getMessage() == report.message()


def test_keras_finite_forward_reports_none_and_outputs_are_unchanged(caplog: pytest.LogCaptureFixture) -> None:
    keras = _keras()
    import polyamp_keras

    ops = keras.ops
    model, x = _keras_model(), _keras_input()
    plain = ops.convert_to_numpy(model(x))
    with caplog.at_level(logging.DEBUG, logger="polyamp"), polyamp_keras.watch_forward(model) as watch:
        watched = ops.convert_to_numpy(model(x))
        assert watch.report() is not None
    assert np.array_equal(plain.view(np.int32), watched.view(np.int32))  # bit patterns, NaNs included
    finite = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.ReLU()])
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="polyamp"), polyamp_keras.watch_forward(finite) as watch:
        finite(x)
        assert watch.report() is None and watch.forwards == 1
    assert _log_records(caplog) == []


def test_keras_removal_restores_every_call() -> None:
    keras = _keras()
    import polyamp_keras

    model = _keras_model()
    layers = [m for m in model._flatten_layers() if not isinstance(m, keras.layers.InputLayer)]
    before = {id(layer): layer.call for layer in layers}
    watch = polyamp_keras.watch_forward(model)
    assert all("call" in layer.__dict__ for layer in layers)
    model(_keras_input())
    watch.remove()
    assert not watch.active and not any("call" in layer.__dict__ for layer in layers)
    assert all(layer.call == before[id(layer)] for layer in layers)  # the class's method, bound again
    report = watch.report()
    assert report is not None and report.producer is not None and report.producer.path == "block/divide"
    model(_keras_input())
    assert watch.forwards == 1


def test_keras_traced_calls_are_counted_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    keras = _keras()
    import polyamp_keras

    model, x = _keras_model(), _keras_input()
    with caplog.at_level(logging.WARNING, logger="polyamp"), polyamp_keras.watch_forward(model) as watch:
        model.predict(x, verbose=0)
        model.predict(x, verbose=0)
    if keras.backend.backend() == "torch":  # Keras on PyTorch runs predict eagerly
        assert (watch.traced, watch.forwards) == (0, 2)
        assert watch.report() is not None
    else:
        assert watch.traced >= 1 and watch.forwards == 0 and watch.report() is None
        traced = [r for r in _log_records(caplog) if "traced calls are not watched" in r.getMessage()]
        assert len(traced) == 1


def test_keras_refuses_a_non_layer_and_a_bad_every() -> None:
    keras = _keras()
    import polyamp_keras

    with pytest.raises(PolyampTypeError, match="expects a Keras model or layer; received"):
        polyamp_keras.watch_forward(object())
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    with pytest.raises(PolyampValueError, match=r"must be an int >= 1; received True"):
        polyamp_keras.watch_forward(model, every=True)
    assert not any("call" in layer.__dict__ for layer in model._flatten_layers())


@pytest.mark.slow
@pytest.mark.skipif(SUBPROCESS, reason="a subprocess covers its own Keras backend only")
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_keras_on_every_backend(backend: str, run_bounded: RunBounded) -> None:
    keras = _keras()
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    if keras.backend.backend() == backend:
        pytest.skip(f"this process runs Keras on {backend}")
    env = dict(os.environ, KERAS_BACKEND=backend, POLYAMP_FORWARD_WATCH_SUBPROCESS="1", TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, "-m", "pytest", str(HERE), "-q", "-p", "no:cacheprovider", "-m", "", "-k", "keras"]
    result = run_bounded(command, env=env, cwd=HERE.parent.parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("5 passed"), result.stdout[-2000:]
