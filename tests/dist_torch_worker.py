"""One rank of the 2-process gloo runs of tests/test_torch_distributed.py (run as a script, not collected).

Usage: python dist_torch_worker.py RANK WORLD PORT OUT_DIR. Each scenario writes OUT_DIR/<scenario>-rank<R>.json.
"""

from __future__ import annotations

import datetime
import json
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import polyamp
import polyamp_torch

RANK, WORLD, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])


def bits(tensors: Any) -> list[list[int]]:
    """Parameters as raw int32 bit patterns: equality of these is bitwise equality."""
    out = []
    for t in tensors:
        t = t.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append(t.float().contiguous().view(torch.int32).flatten().tolist())
    return out


def state(scaler: Any) -> list[float]:
    s = scaler.get_state()
    return [s.scale, s.growth_tracker, s.hysteresis_left]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


# -- DDP: polyamp and native GradScaler side by side ----------------------------------------------------------


def ddp() -> dict[str, Any]:
    ddp_polyamp = torch.nn.parallel.DistributedDataParallel(make_model(0))
    ddp_native = torch.nn.parallel.DistributedDataParallel(make_model(0))
    opt_p = torch.optim.SGD(ddp_polyamp.parameters(), lr=0.05, momentum=0.9)
    opt_n = torch.optim.SGD(ddp_native.parameters(), lr=0.05, momentum=0.9)
    scaler_p = polyamp_torch.TorchLossScaler(growth_interval=3)
    scaler_n = torch.amp.GradScaler("cpu", growth_interval=3)
    generator = torch.Generator().manual_seed(100 + RANK)
    scales_p, scales_n, skipped, equal = [], [], [], []
    for step in range(12):
        x = torch.randn(4, 8, generator=generator)
        if RANK == 1 and step in (2, 6, 7):
            x[0, 0] = 1e30  # only this rank's float16 activations overflow
        for model, opt, scaler, region in (
            (ddp_polyamp, opt_p, scaler_p, polyamp_torch.autocast("mixed_float16", device_type="cpu")),
            (ddp_native, opt_n, scaler_n, torch.autocast("cpu", dtype=torch.float16)),
        ):
            opt.zero_grad()
            with region:
                out = model(x)
            loss = out.float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        scales_p.append(scaler_p.get_scale())
        scales_n.append(scaler_n.get_scale())
        skipped.append(bool(scaler_p.step_skipped(opt_p)))
        equal.append(bits(ddp_polyamp.parameters()) == bits(ddp_native.parameters()))
    return {
        "scales": scales_p,
        "native_scales": scales_n,
        "skipped": skipped,
        "bitwise_equal_each_step": equal,
        "params": bits(ddp_polyamp.parameters()),
    }


# -- ranks holding different gradients: each rank owns half of the parameters ---------------------------------


class CountingAllReduce:
    """Wraps torch.distributed.all_reduce to record (numel, op) of each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.original = dist.all_reduce

    def __call__(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((tensor.numel(), str(op)))
        return self.original(tensor, op, *args, **kwargs)


def sharded(fused: bool, with_group: bool, resume: dict[str, Any] | None = None) -> dict[str, Any]:
    model = make_model(1)
    params = list(model.parameters())
    mine = params[RANK::2]  # rank 0: weights of layer 1, weights of layer 2; rank 1: the biases
    opt = torch.optim.Adam(mine, lr=0.01, fused=True) if fused else torch.optim.SGD(mine, lr=0.05, momentum=0.9)
    group = dist.new_group([0, 1]) if with_group else None
    scaler = polyamp.LossScaler(2.0**8, growth_interval=3, hysteresis=2, enabled=True, process_group=group)
    if resume is not None:
        scaler.load_state_dict(resume)
    generator = torch.Generator().manual_seed(7)
    counter = CountingAllReduce()
    dist.all_reduce = counter  # type: ignore[assignment]
    records: list[dict[str, Any]] = []
    try:
        for step in range(20):
            x = torch.randn(4, 8, generator=generator)
            opt.zero_grad()
            with polyamp_torch.autocast("mixed_float16", device_type="cpu"):
                out = model(x)
            scaler.scale(out.float().pow(2).mean()).backward()
            if RANK == 1 and step in (3, 8):
                mine[0].grad[0] = float("inf")  # only rank 1 sees a non-finite gradient
            before = bits(mine)
            counter.calls.clear()
            scaler.step(opt)
            scaler.update()
            records.append(
                {
                    "skipped": bool(scaler.step_skipped(opt)),
                    "unchanged": bits(mine) == before,
                    "state": state(scaler),
                    "all_reduces": list(counter.calls),
                }
            )
    finally:
        dist.all_reduce = counter.original
    result: dict[str, Any] = {"records": records, "state_dict": scaler.state_dict()}
    if with_group:
        try:
            pickle.dumps(scaler)
        except Exception as exc:
            result["pickle_error"] = f"{type(exc).__name__}: {exc}"
    return result


def discard(alone: bool) -> dict[str, Any]:
    """Ranks holding different gradients, one process group; at step 5, after backward and before any flag
    reduction, rank 1 (``alone``) or every rank discards the iteration."""
    model = make_model(1)
    params = list(model.parameters())
    mine = params[RANK::2]
    opt = torch.optim.SGD(mine, lr=0.05, momentum=0.9)
    scaler = polyamp.LossScaler(2.0**8, growth_interval=3, enabled=True, process_group=dist.new_group([0, 1]))
    generator = torch.Generator().manual_seed(7)
    steps: list[dict[str, Any]] = []
    error = None
    for step in range(12):
        x = torch.randn(4, 8, generator=generator)
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        if step == 5 and (RANK == 1 or not alone):
            scaler.discard_iteration()  # e.g. after an exception in this rank's step
            continue
        before = bits(mine)
        try:
            scaler.step(opt)
            scaler.update()
        except polyamp.ScalerUsageError as exc:
            error = {"step": step, "message": str(exc), "unchanged": bits(mine) == before}
            break
        steps.append({"step": step, "skipped": bool(scaler.step_skipped(opt)), "unchanged": bits(mine) == before})
    return {"steps": steps, "error": error, "state": state(scaler)}


def no_gradients() -> dict[str, Any]:
    """Rank 1's optimizer has no gradients: it still joins the all-reduce, then raises; rank 0 steps."""
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([used if RANK == 0 else unused], lr=0.1)
    scaler = polyamp.LossScaler(enabled=True, process_group=dist.group.WORLD)
    scaler.scale(used.sum()).backward()
    try:
        scaler.step(opt)
    except polyamp.ScalerUsageError as exc:
        return {"error": str(exc).split(".")[0]}
    scaler.update()
    return {"skipped": bool(scaler.step_skipped(opt)), "param": used.tolist()}


# -- FSDP2 ------------------------------------------------------------------------------------------------------


def fsdp_model(seed: int, mp: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def fsdp() -> dict[str, Any]:
    mp = polyamp_torch.fsdp_mixed_precision("mixed_float16")
    model_p, model_n = fsdp_model(2, mp), fsdp_model(2, mp)
    opt_p = torch.optim.SGD(model_p.parameters(), lr=0.05, momentum=0.9)
    opt_n = torch.optim.SGD(model_n.parameters(), lr=0.05, momentum=0.9)
    scaler_p = polyamp.LossScaler(growth_interval=3, enabled=True)
    scaler_n = torch.amp.GradScaler("cpu", growth_interval=3)
    generator = torch.Generator().manual_seed(200 + RANK)
    records = []
    for step in range(10):
        x = torch.randn(4, 8, generator=generator)
        for model, opt, scaler in ((model_p, opt_p, scaler_p), (model_n, opt_n, scaler_n)):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            if RANK == 1 and step in (2, 5):
                grad = next(model.parameters()).grad
                grad._local_tensor[0, 0] = float("inf")  # in this rank's shard only
        grad_types = sorted({type(p.grad).__name__ for p in model_p.parameters()})
        for opt, scaler in ((opt_p, scaler_p), (opt_n, scaler_n)):
            scaler.step(opt)
            scaler.update()
        records.append(
            {
                "skipped": bool(scaler_p.step_skipped(opt_p)),
                "state": state(scaler_p),
                "native_scale": scaler_n.get_scale(),
                "bitwise_equal": bits(model_p.parameters()) == bits(model_n.parameters()),
                "grad_types": grad_types,
            }
        )
    return {
        "records": records,
        "param_dtypes": sorted({str(p.dtype) for p in model_p.parameters()}),
        "params": bits(model_p.parameters()),
    }


def fsdp_apply_policy() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    result: dict[str, Any] = {}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    # Both orders with a policy that keeps float32 parameters: autocast forward, float32 shards.
    for order in ("policy_first", "shard_first"):
        model = make_model(3)
        if order == "policy_first":
            polyamp_torch.apply_policy(model, "mixed_float16")
            fully_shard(model)
        else:
            fully_shard(model)
            polyamp_torch.apply_policy(model, "mixed_float16")
        seen: list[str] = []
        model[0].register_forward_hook(lambda m, i, o, seen=seen: seen.append(str(o.dtype)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = polyamp.LossScaler(enabled=True)
        out = model(x)
        scaler.scale(out.pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        result[order] = {
            "output_dtype": str(out.dtype),
            "hidden_dtype": seen[0],
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "param_types": sorted({type(p).__name__ for p in model.parameters()}),
            "skipped": bool(scaler.step_skipped(opt)),
            "policy": getattr(polyamp_torch.module_policy(model), "name", None),
        }
    # A policy that casts parameters: before fully_shard the shards take its dtype ...
    model = make_model(3)
    polyamp_torch.apply_policy(model, "bfloat16")
    fully_shard(model)
    result["cast_first"] = {
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "output_dtype": str(model(x).dtype),
    }
    # ... after fully_shard it is refused, and the model is left as it was.
    model = make_model(3)
    fully_shard(model)
    before = bits(model.parameters())
    try:
        polyamp_torch.apply_policy(model, "bfloat16")
        result["cast_after"] = {"error": None}
    except Exception as exc:
        result["cast_after"] = {
            "error": f"{type(exc).__name__}: {exc}",
            "unchanged": bits(model.parameters()) == before,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "policy": polyamp_torch.module_policy(model),
            "output_dtype": str(model(x).dtype),
        }
    return result


# -- FP8 layers under DDP and FSDP2 ---------------------------------------------------------------------------


def float8_model(seed: int, policy: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    return polyamp_torch.apply_policy(model, policy)


def float8_parallel() -> dict[str, Any]:
    """Each FP8 recipe trained 4 AdamW steps under DDP and under FSDP2, against one process that computes both
    ranks' gradients and averages them as the two do (``g0 / 2 + g1 / 2``)."""
    from torch.distributed.fsdp import fully_shard

    batches = [
        [torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * r + s)) for s in range(4)] for r in (0, 1)
    ]
    result: dict[str, Any] = {}
    for recipe in ("float8_tensorwise", "float8_rowwise", "float8_delayed[amax_history_length=4]"):
        policy = f"mixed_bfloat16+{recipe}"
        reference = float8_model(0, policy)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(4):
            grads = []
            for rank in (0, 1):
                reference.zero_grad()
                reference(batches[rank][step]).float().pow(2).mean().backward()
                grads.append([p.grad.clone() for p in reference.parameters()])
            for param, mine, other in zip(reference.parameters(), *grads, strict=True):
                param.grad = mine / 2 + other / 2
            optimizer.step()
        for wrapper in ("ddp", "fsdp"):
            model = float8_model(0, policy)
            layer = model[0]
            if wrapper == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model)
            else:
                for sub in model:
                    if isinstance(sub, torch.nn.Linear):
                        fully_shard(sub)
                fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(4):
                optimizer.zero_grad()
                model(batches[RANK][step]).float().pow(2).mean().backward()
                optimizer.step()
            result[f"{recipe}/{wrapper}"] = {
                "classes": [cls.__name__ for cls in type(layer).__mro__[:3]],
                "params": bits(model.parameters()),
                "equal_to_reference": bits(model.parameters()) == bits(reference.parameters()),
                "state": bits(b for name, b in layer.named_buffers() if name.startswith("float8_")),
            }
    # A model sharded first is refused the FP8 policy and left as it was.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    for sub in model:
        fully_shard(sub)
    fully_shard(model)
    before = [type(sub).__name__ for sub in model]
    try:
        polyamp_torch.apply_policy(model, "float8_tensorwise")
        result["shard_first"] = {"error": None}
    except Exception as exc:
        result["shard_first"] = {
            "error": f"{type(exc).__name__}: {exc}",
            "unchanged": [type(sub).__name__ for sub in model] == before,
            "policy": polyamp_torch.module_policy(model),
        }
    return result


def main() -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{PORT}",
        rank=RANK,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    resume = json.loads((OUT / "resume.json").read_text())
    scenarios = {
        "ddp": ddp,
        "sharded_sgd": lambda: sharded(fused=False, with_group=True),
        "sharded_fused_adam": lambda: sharded(fused=True, with_group=True),
        "sharded_no_group": lambda: sharded(fused=False, with_group=False),
        "sharded_resumed": lambda: sharded(fused=False, with_group=True, resume=resume),
        "no_gradients": no_gradients,
        "discard_alone": lambda: discard(alone=True),
        "discard_together": lambda: discard(alone=False),
        "fsdp": fsdp,
        "fsdp_apply_policy": fsdp_apply_policy,
        "float8_parallel": float8_parallel,
    }
    for name, scenario in scenarios.items():
        try:
            outcome: dict[str, Any] = {"result": scenario()}
        except Exception:
            outcome = {"error": traceback.format_exc()}
        (OUT / f"{name}-rank{RANK}.json").write_text(json.dumps(outcome))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
