"""CUDA tensors on a real GPU: NCCL at world size 1, and CUDA tensors staged through host
memory under the default and gloo backends at world size 2 on one GPU.

Every test carries the ``gpu`` marker and skips without CUDA. The staging logic
itself (streams of the calling thread, copies out behind the caller's work,
handles done once the data is back) is tested without a GPU in test_staging.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests.helpers import ROOT
from tests.helpers.procs import free_port

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    import aiodist.sync as dist

    url, rank, world, backend = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.cuda.set_device(0)  # both ranks on the one GPU
    dist.init_process_group(None if backend == "none" else backend, init_method=url,
                            rank=rank, world_size=world, timeout=60)
    dev = torch.device("cuda", 0)
    out = {}
    # Ordered on the caller's stream: a slow kernel on a side stream writes the input,
    # and the call is made inside that stream's context without any synchronisation.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.zeros(1 << 16, device=dev)
        torch.cuda._sleep(100_000_000)
        t.fill_(float(rank + 1))
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        out["ordered_all_reduce"] = float(t[0].item()), float(t[-1].item())
    torch.cuda.synchronize()
    b = torch.full((3,), float(rank), device=dev)
    dist.broadcast(b, src=1)
    out["broadcast"] = b.tolist()
    parts = dist.all_gather(torch.full((2,), float(rank), device=dev))
    out["all_gather"] = [p.tolist() for p in parts]
    out["all_gather_on_gpu"] = all(p.is_cuda for p in dist.all_gather(torch.ones(1, device=dev)))
    flat = torch.zeros(4, device=dev)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank), device=dev))
    out["all_gather_into_tensor"] = flat.tolist()
    mine = torch.zeros(2, device=dev)
    dist.reduce_scatter_tensor(mine, torch.arange(4.0, device=dev))
    out["reduce_scatter_tensor"] = mine.tolist()
    single = torch.zeros(2, device=dev)
    dist.all_to_all_single(single, torch.tensor([rank * 10.0, rank * 10.0 + 1], device=dev))
    out["all_to_all_single"] = single.tolist()
    got = torch.zeros(3, device=dev)
    if rank == 0:
        dist.send(torch.full((3,), 7.0, device=dev), dst=1)
    else:
        dist.recv(got, src=0)
    out["p2p"] = got.tolist()
    objs = dist.all_gather_object({"t": torch.full((2,), float(rank), device=dev)})
    out["objects"] = [o["t"].tolist() for o in objs]
    dist.destroy_process_group()
    print(json.dumps(out))
    """
)


def _run(tmp: Path, backend: str) -> list[dict[str, Any]]:
    script = tmp / "cuda_worker.py"
    script.write_text(WORKER)
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), url, str(r), "2", backend],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


@pytest.mark.parametrize("backend", ["none", "gloo"])
def test_cuda_tensors_are_staged_in_order_on_the_callers_stream(
    tmp_path: Path, backend: str
) -> None:
    outs = _run(tmp_path, backend)
    for rank, out in enumerate(outs):
        assert out["ordered_all_reduce"] == [3.0, 3.0]  # the slow kernel's values, summed
        assert out["broadcast"] == [1.0] * 3
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["all_gather_on_gpu"]
        assert out["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert out["reduce_scatter_tensor"] == [float(4 * rank), float(4 * rank + 2)]
        assert out["all_to_all_single"] == [float(rank), 10.0 + rank]
        assert out["objects"] == [[0.0, 0.0], [1.0, 1.0]]
    assert outs[1]["p2p"] == [7.0] * 3


def test_nccl_at_world_size_one_sets_the_callers_device() -> None:
    import aiodist.sync as dist

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0, timeout=60
    )
    try:
        g = dist.get_default_group()
        assert g is not None
        assert g.bridge is not None
        assert torch.cuda.current_device() == g.bridge.cuda_device  # type: ignore[attr-defined]
        t = torch.full((4,), 2.0, device="cuda")
        assert dist.all_reduce(t, op="mean") is t
        assert t.tolist() == [2.0] * 4
        parts = dist.all_gather(torch.ones(2, device="cuda"))
        assert [p.tolist() for p in parts] == [[1.0, 1.0]]
        w = dist.broadcast(t, src=0, async_op=True)
        w.wait()
        assert w.get_future().wait()[0].is_cuda
    finally:
        dist.destroy_process_group()


def test_train_overlap_example_on_one_gpu() -> None:
    script = ROOT / "examples" / "train_overlap.py"
    args = ["--device", "cuda", "--backend", "none", "--steps", "5", "--warmup", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "aiodist", "run", "-n", "2", str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("weights in sync") == 2
    assert "overlap efficiency" in result.stdout
