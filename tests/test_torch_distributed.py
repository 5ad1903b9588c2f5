"""polyamp under torch.distributed, two gloo processes on localhost (tests/dist_torch_worker.py is one rank).

* DDP: polyamp's scaler and native ``torch.amp.GradScaler`` side by side in the same workers: bitwise-equal
  parameters and the same scale after every step, on both ranks.
* Ranks holding different gradients (each rank owns half of the parameters, its own optimizer, no DDP):
  with ``process_group=`` both ranks skip exactly the steps where one rank overflowed, keep identical scale
  and counters, and the scaler issues exactly one three-element MAX all-reduce per step (the flag and the
  rank's iteration count, to detect ranks out of step); without a group they diverge. A rank that discards an
  iteration alone is detected, and every rank skips and is told why; ranks that discard together go on.
* FSDP2 on CPU: DTensor gradients, torch's DTensor rule reduces the flag (no group needed), parity with
  native GradScaler under FSDP2; ``apply_policy`` and ``fully_shard`` in both orders.
* FP8 layers (`apply_policy` under an FP8 recipe) under DDP and FSDP2: bitwise the single-process run of
  the averaged gradients for the current-scaling recipes; under delayed scaling the ranks agree on the
  parameters; a model sharded first is refused the recipe.
* State dicts move between a distributed run and a single device both ways.
"""

from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import polyamp  # noqa: E402
import polyamp_torch  # noqa: E402

WORKER = Path(__file__).with_name("dist_torch_worker.py")
#: The state a single-device run saved; the distributed run resumes from it.
RESUME = {"scale": 1024.0, "growth_tracker": 1, "hysteresis_left": 1}
SHARDED_SETTINGS = {"init_scale": 2.0**8, "growth_interval": 3, "hysteresis": 2}
SHARDED_OVERFLOWS = (3, 8)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every scenario's result on rank 0 and rank 1 (one pair of processes for all of them)."""
    out = tmp_path_factory.mktemp("dist")
    single = polyamp.LossScaler(**SHARDED_SETTINGS, enabled=True)
    saved = single.state_dict()
    saved.update(scale=RESUME["scale"], _growth_tracker=RESUME["growth_tracker"])
    saved.update(hysteresis_left=RESUME["hysteresis_left"])
    single.load_state_dict(saved)  # a valid single-device state dict
    (out / "resume.json").write_text(json.dumps(single.state_dict()))
    port = str(_free_port())
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", port, str(out)], stderr=subprocess.PIPE, text=True
        )
        for rank in range(2)
    ]
    try:
        errors = [worker.communicate(timeout=150)[1] for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for worker, err in zip(workers, errors):
        assert worker.returncode == 0, err[-3000:]
    results: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("*-rank0.json")):
        name = path.name.removesuffix("-rank0.json")
        results[name] = [json.loads((out / f"{name}-rank{rank}.json").read_text()) for rank in range(2)]
    return results


def _results(runs: dict[str, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    pair = runs[name]
    for rank, outcome in enumerate(pair):
        assert "error" not in outcome, f"rank {rank}:\n{outcome.get('error')}"
    return [outcome["result"] for outcome in pair]


def test_ddp_matches_native_grad_scaler_bitwise(runs: dict[str, list[dict[str, Any]]]) -> None:
    rank0, rank1 = _results(runs, "ddp")
    for result in (rank0, rank1):
        assert result["bitwise_equal_each_step"] == [True] * 12
        assert result["scales"] == result["native_scales"]
        # rank 1 alone overflowed at steps 2, 6 and 7; DDP's all-reduce made every rank see it
        assert result["skipped"] == [step in (2, 6, 7) for step in range(12)]
    assert rank0["scales"] == rank1["scales"]
    assert rank0["params"] == rank1["params"]
    config = polyamp.LossScaleConfig(growth_interval=3)
    assert rank0["scales"] == config.trajectory([step in (2, 6, 7) for step in range(12)])


def _reference_states(start: polyamp.LossScaleState | None = None) -> list[list[float]]:
    config = polyamp.LossScaleConfig(**SHARDED_SETTINGS)
    pattern = [step in SHARDED_OVERFLOWS for step in range(20)]
    return [[s.scale, s.growth_tracker, s.hysteresis_left] for s in config.states(pattern, start)]


@pytest.mark.parametrize("scenario", ["sharded_sgd", "sharded_fused_adam"])
def test_process_group_makes_every_rank_skip_together(runs: dict[str, list[dict[str, Any]]], scenario: str) -> None:
    rank0, rank1 = _results(runs, scenario)
    expected = _reference_states()
    for result in (rank0, rank1):
        records = result["records"]
        assert [r["skipped"] for r in records] == [step in SHARDED_OVERFLOWS for step in range(20)]
        # a skipped step leaves this rank's parameters bitwise unchanged, also on rank 0 whose gradients were finite
        assert [r["unchanged"] for r in records] == [r["skipped"] for r in records]
        assert [r["state"] for r in records] == expected
        # exactly one all-reduce per step from the scaler: MAX of (flag, iteration, -iteration)
        assert [r["all_reduces"] for r in records] == [[[3, "RedOpType.MAX"]]] * 20
    assert [r["state"] for r in rank0["records"]] == [r["state"] for r in rank1["records"]]
    assert rank0["state_dict"] == rank1["state_dict"]
    assert "process_group" not in rank0["state_dict"]
    assert rank0["pickle_error"].startswith("ScalerUsageError: A LossScaler with a process_group cannot be pickled")


def test_without_a_process_group_ranks_with_different_gradients_diverge(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    rank0, rank1 = _results(runs, "sharded_no_group")
    assert [r["all_reduces"] for r in rank0["records"]] == [[]] * 20
    assert [r["skipped"] for r in rank1["records"]][:9] == [step in SHARDED_OVERFLOWS for step in range(9)]
    assert not any(r["skipped"] for r in rank0["records"])  # rank 0 never saw rank 1's inf
    assert rank0["state_dict"]["scale"] != rank1["state_dict"]["scale"]


def test_a_rank_without_gradients_still_joins_the_reduction(runs: dict[str, list[dict[str, Any]]]) -> None:
    rank0, rank1 = _results(runs, "no_gradients")
    # no hang: rank 1 took part in the all-reduce before raising its usual error
    assert rank0 == {"skipped": False, "param": [torch.tensor(1 - 0.1).item()] * 3}
    assert rank1 == {"error": "step(): none of the optimizer's parameters has a gradient"}


def test_state_dicts_move_between_distributed_and_single_device(runs: dict[str, list[dict[str, Any]]]) -> None:
    # single device -> distributed: both ranks resume from a single-device state dict
    resumed = _results(runs, "sharded_resumed")
    start = polyamp.LossScaleState(RESUME["scale"], RESUME["growth_tracker"], RESUME["hysteresis_left"])
    expected = _reference_states(start)
    for result in resumed:
        assert [r["state"] for r in result["records"]] == expected
    # distributed -> single device: rank 0's dict resumes in one process, which goes on like the reference
    saved = _results(runs, "sharded_sgd")[0]["state_dict"]
    single = polyamp_torch.TorchLossScaler(enabled=True)
    single.load_state_dict(saved)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    states = []
    for overflow in (False, True, False, False, False):
        opt.zero_grad()
        single.scale(param.sum()).backward()
        if overflow:
            param.grad[0] = float("inf")
        single.step(opt)
        single.update()
        state = single.get_state()
        states.append([state.scale, state.growth_tracker, state.hysteresis_left])
    config = polyamp.LossScaleConfig(**SHARDED_SETTINGS)
    last = _reference_states()[-1]
    reference = config.states("FOFFF", polyamp.LossScaleState(last[0], int(last[1]), int(last[2])))
    assert states == [[s.scale, s.growth_tracker, s.hysteresis_left] for s in reference]
    # and a torch GradScaler loads the distributed run's dict as well
    native = torch.amp.GradScaler("cpu")
    native.load_state_dict(saved)
    assert native.get_scale() == saved["scale"] == last[0]


def test_fsdp2_on_cpu_skips_together_and_matches_native_grad_scaler(runs: dict[str, list[dict[str, Any]]]) -> None:
    rank0, rank1 = _results(runs, "fsdp")
    for result in (rank0, rank1):
        records = result["records"]
        assert {tuple(r["grad_types"]) for r in records} == {("DTensor",)}
        # rank 1 planted an inf in its own shard at steps 2 and 5: torch's DTensor rule reduced the flag
        assert [r["skipped"] for r in records] == [step in (2, 5) for step in range(10)]
        assert [r["bitwise_equal"] for r in records] == [True] * 10
        assert [r["state"][0] for r in records] == [r["native_scale"] for r in records]
        assert result["param_dtypes"] == ["torch.float32"]  # sharded float32 masters; float16 compute
    assert [r["state"] for r in rank0["records"]] == [r["state"] for r in rank1["records"]]
    config = polyamp.LossScaleConfig(growth_interval=3)
    assert [r["state"][0] for r in rank0["records"]] == config.trajectory([s in (2, 5) for s in range(10)])
    assert rank0["params"] == rank1["params"]  # full parameters, gathered


def test_apply_policy_and_fully_shard_in_either_order(runs: dict[str, list[dict[str, Any]]]) -> None:
    for result in _results(runs, "fsdp_apply_policy"):
        for order in ("policy_first", "shard_first"):
            assert result[order] == {
                "output_dtype": "torch.float32",
                "hidden_dtype": "torch.float16",
                "param_dtypes": ["torch.float32"],
                "param_types": ["DTensor"],
                "skipped": False,
                "policy": "mixed_float16",
            }
        assert result["cast_first"] == {"param_dtypes": ["torch.bfloat16"], "output_dtype": "torch.bfloat16"}
        refused = result["cast_after"]
        assert refused["error"].startswith(
            "PolyampValueError: apply_policy() would cast the sharded (DTensor) parameter 0.weight from "
            "torch.float32 to torch.bfloat16"
        )
        assert "Call apply_policy() before fully_shard()" in refused["error"]
        assert refused["unchanged"] is True
        assert refused["param_dtypes"] == ["torch.float32"]
        assert refused["policy"] is None
        assert refused["output_dtype"] == "torch.float32"


# -- single-process checks ------------------------------------------------------------------------------------


def test_fsdp_mixed_precision_maps_the_policy() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = polyamp_torch.fsdp_mixed_precision("mixed_float16")
    assert mp == MixedPrecisionPolicy(torch.float16, torch.float32, torch.float32, True)
    mp = polyamp_torch.fsdp_mixed_precision("mixed_bfloat16", reduce_dtype="bfloat16", cast_forward_inputs=False)
    assert mp == MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16, torch.float32, False)
    assert polyamp_torch.fsdp_mixed_precision("float32", reduce_dtype=torch.float32) == MixedPrecisionPolicy(
        torch.float32, torch.float32, torch.float32, True
    )
    with polyamp.policy_scope("mixed_bfloat16"):
        assert polyamp_torch.fsdp_mixed_precision().param_dtype == torch.bfloat16
    # The blocks inside the root keep their outputs in the compute dtype; only the root casts the model's output.
    block = polyamp_torch.fsdp_mixed_precision("mixed_float16", root=False)
    assert block == MixedPrecisionPolicy(torch.float16, torch.float32, None, True)
    with pytest.raises(polyamp.PolyampTypeError, match=r"root=\.\.\.\) takes True .* Received: 'blocks'"):
        polyamp_torch.fsdp_mixed_precision("mixed_float16", root="blocks")  # type: ignore[arg-type]
    with pytest.raises(polyamp.PolyampTypeError, match=r"reduce_dtype=\.\.\.\) takes None, 'float32'.*torch.int8"):
        polyamp_torch.fsdp_mixed_precision("mixed_float16", reduce_dtype=torch.int8)
    with pytest.raises(polyamp.InvalidPolicyError):
        polyamp_torch.fsdp_mixed_precision("fp16")


def test_process_group_is_validated() -> None:
    with pytest.raises(polyamp.PolyampTypeError, match=r"process_group=None or a process group.*Received: 3 \(of"):
        polyamp.LossScaler(process_group=3)
    with pytest.raises(polyamp.PolyampTypeError, match=r"a torch.distributed.ProcessGroup.*Received: .*Tensor"):
        polyamp_torch.TorchLossScaler(process_group=torch.zeros(1))  # a torch object, but not a group
    with pytest.raises(polyamp.PolyampTypeError, match="with backend='tensorflow'"):
        polyamp.LossScaler(process_group=torch.zeros(1), backend="tensorflow")
    scaler = polyamp.LossScaler()
    assert scaler.process_group is None
    assert pickle.loads(pickle.dumps(scaler)).process_group is None


def test_a_backend_without_reduction_refuses_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "numpy_backend"))
    import npfw
    import polyamp_npfw

    polyamp.backend_api.register_backend(polyamp_npfw.SPEC)
    try:
        with pytest.raises(polyamp.PolyampTypeError, match="The 'npfw' backend's scaler cannot reduce its found-inf"):
            polyamp.LossScaler(process_group=npfw.Tensor(0.0))
    finally:
        for name in ("npfw", "polyamp_npfw"):
            sys.modules.pop(name, None)


def test_a_rank_discarding_an_iteration_alone_is_detected_on_every_rank(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """Rank 1 discards step 5 before its reduction: rank 0's step 5 meets rank 1's step 6. Both ranks skip that
    step (parameters bitwise unchanged) and raise ScalerUsageError naming discard_iteration, instead of going on
    out of step until the job ends."""
    rank0, rank1 = _results(runs, "discard_alone")
    assert [s["skipped"] for s in rank0["steps"]] == [False] * 5
    assert [s["skipped"] for s in rank1["steps"]] == [False] * 5
    assert (rank0["error"]["step"], rank1["error"]["step"]) == (5, 6)
    for result in (rank0, rank1):
        assert "process_group are out of step" in result["error"]["message"]
        assert "discard_iteration() on every rank" in result["error"]["message"]
        assert result["error"]["unchanged"] is True  # the mismatched step was skipped
    assert rank0["state"] == rank1["state"]


def test_ranks_discarding_the_same_iteration_go_on_in_step(runs: dict[str, list[dict[str, Any]]]) -> None:
    rank0, rank1 = _results(runs, "discard_together")
    for result in (rank0, rank1):
        assert result["error"] is None
        assert [s["step"] for s in result["steps"]] == [s for s in range(12) if s != 5]
        assert not any(s["skipped"] for s in result["steps"])
    assert rank0["state"] == rank1["state"]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
@pytest.mark.parametrize("recipe", ["float8_tensorwise", "float8_rowwise", "float8_delayed[amax_history_length=4]"])
def test_fp8_layers_train_under_ddp_and_fsdp2(runs: dict[str, list[dict[str, Any]]], recipe: str, wrapper: str) -> None:
    ranks = [rank[f"{recipe}/{wrapper}"] for rank in _results(runs, "float8_parallel")]
    assert all("Float8Linear" in rank["classes"] for rank in ranks)
    assert ranks[0]["params"] == ranks[1]["params"]  # the ranks agree bit for bit
    if recipe.startswith("float8_delayed"):
        # Each rank pushes its own amaxes (DDP first broadcasts rank 0's buffers at each forward), so the
        # scales are not those of one process seeing both batches; the ranks still apply the same update.
        assert len(ranks[0]["state"]) == 6
    else:
        assert all(rank["equal_to_reference"] for rank in ranks)


def test_an_fp8_policy_after_fully_shard_is_refused_and_the_model_left_as_it_was(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for rank in _results(runs, "float8_parallel"):
        refused = rank["shard_first"]
        assert refused["error"].startswith("PolyampValueError") and "before fully_shard()" in refused["error"]
        assert refused["unchanged"] and refused["policy"] is None
