"""DDP needs nothing special: gradients are all-reduced during backward, so every rank sees the same
non-finite flags, skips the same steps and follows the same scale trajectory."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    import polyamp, polyamp_torch

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    polyamp.set_policy("mixed_float16")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = polyamp.LossScaler(growth_interval=2)
    generator = torch.Generator().manual_seed(100 + rank)
    scales = []
    for step in range(8):
        x = torch.randn(4, 8, generator=generator)
        if rank == 1 and step in (2, 5):
            x[0, 0] = 1e30  # this rank's float16 activations overflow; the other rank's are fine
        opt.zero_grad()
        with polyamp_torch.autocast(device_type="cpu"):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    with open(out, "w") as f:
        json.dump({"scales": scales, "skipped": int(scaler.skipped_steps()), "params": params}, f)
    dist.barrier()  # both ranks done before either tears its connections down
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's background threads can still be joinable when C++ static
    # destructors run at exit, which aborts the process ("terminate called without an active exception") after
    # everything this test checks was written.
    os._exit(0)
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_ranks_skip_together_and_stay_identical(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    outputs = [tmp_path / f"rank{r}.json" for r in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), "2", port, str(outputs[r])], stderr=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-2000:]
    rank0, rank1 = (json.loads(p.read_text()) for p in outputs)
    assert rank0["scales"] == rank1["scales"]
    assert rank0["skipped"] == rank1["skipped"] == 2
    assert rank0["params"] == rank1["params"]
    expected = [65536.0, 131072.0, 65536.0, 65536.0, 131072.0, 65536.0, 65536.0, 131072.0]
    assert rank0["scales"] == expected
