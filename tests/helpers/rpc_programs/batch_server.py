"""A batch-updating parameter server: ``async_execution`` answers many trainers at once.

Written as torch.distributed.rpc programs are (the PyTorch batch-RPC
tutorial's pattern), on CPU with synthetic data; ``RPC_SYSTEM`` picks the
imports (``torch``: TensorPipe; ``aiodist``). Rank 0 is the parameter server:
each trainer sends its gradients and gets a future that completes once every
trainer's gradients of that step are in and the server has stepped; the call
returns the updated model. Two trainers: the sum of their gradients does not
depend on which comes first, so the run is deterministic. Rank 0 prints one
JSON line: every trainer's losses and the final model.

Usage: ``RPC_SYSTEM=aiodist MASTER_PORT=29500 python batch_server.py``
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
import torch.multiprocessing as mp
from torch import nn, optim

if os.environ.get("RPC_SYSTEM", "torch") == "torch":
    import torch.distributed.rpc as rpc
else:
    import aiodist.rpc as rpc

WORLD = 3
TRAINERS = WORLD - 1
STEPS = 4


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size=TRAINERS):
        torch.manual_seed(0)
        self.model = nn.Linear(6, 2)
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad += g
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


class Trainer:
    def __init__(self, ps_rref):
        self.ps_rref = ps_rref
        self.loss_fn = nn.MSELoss()
        rank = rpc.get_worker_info().id
        gen = torch.Generator().manual_seed(rank)
        self.batches = [
            (torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen))
            for _ in range(STEPS)
        ]

    def train(self):
        m = self.ps_rref.rpc_sync().get_model()
        losses = []
        for inputs, labels in self.batches:
            loss = self.loss_fn(m(inputs), labels)
            loss.backward()
            losses.append(loss.item())
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]),
            )
        return losses


def run_trainer(ps_rref):
    return Trainer(ps_rref).train()


def run_ps(trainers):
    ps_rref = rpc.RRef(BatchUpdateParameterServer())
    futs = [rpc.rpc_async(trainer, run_trainer, args=(ps_rref,)) for trainer in trainers]
    losses = torch.futures.wait_all(futs)
    model = [p.detach().tolist() for p in ps_rref.local_value().model.parameters()]
    return {"losses": losses, "model": model}


def run(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60)
    if rank != 0:
        rpc.init_rpc(
            f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=options
        )
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        out = run_ps([f"trainer{r}" for r in range(1, world_size)])
        print(json.dumps(out), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    # The workers fork from one interpreter that imported this script (and torch) once.
    mp.start_processes(run, args=(WORLD,), nprocs=WORLD, join=True, start_method="forkserver")
    sys.exit(0)
