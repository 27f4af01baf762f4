"""A parameter server with RRef'd parameters and DistributedOptimizer, two trainers.

Written as torch.distributed.rpc programs are (the PyTorch parameter-server
tutorial's pattern), on CPU with synthetic data; ``RPC_SYSTEM`` picks the
imports (``torch``: TensorPipe; ``aiodist``), nothing else differs. Rank 0
is the parameter server and drives the trainers in turn, so that the run is
deterministic; rank 0 prints one JSON line: each step's losses, and the
gradients the first step's context holds on the server.

Usage: ``RPC_SYSTEM=aiodist MASTER_PORT=29500 python parameter_server.py``
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

if os.environ.get("RPC_SYSTEM", "torch") == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
else:
    import aiodist.rpc as rpc
    import aiodist.rpc.dist_autograd as dist_autograd
    from aiodist.rpc import RRef
    from aiodist.rpc.optim import DistributedOptimizer

WORLD = 3
STEPS = 4


def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), call_method, args=[method, rref, *args], kwargs=kwargs)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return F.log_softmax(self.fc2(torch.relu(self.fc1(x))), dim=1)


class ParameterServer:
    def __init__(self):
        torch.manual_seed(0)
        self.model = Net()

    def forward(self, inp):
        return self.model(inp)

    def get_param_rrefs(self):
        return [RRef(param) for param in self.model.parameters()]


PS = None
PS_LOCK = threading.Lock()  # both trainers ask for it at once


def get_parameter_server():
    global PS
    with PS_LOCK:
        if PS is None:
            PS = ParameterServer()
        return PS


def grads_in_context(context_id):
    """The gradients the context holds on the server, in the model's parameter order."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p].tolist() for p in get_parameter_server().model.parameters()]


class TrainerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.param_server_rref = rpc.remote("ps", get_parameter_server)

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


TRAINER = {}


def make_trainer():
    net = TrainerNet()
    opt = DistributedOptimizer(torch.optim.SGD, net.get_global_param_rrefs(), lr=0.1, momentum=0.9)
    rank = rpc.get_worker_info().id
    gen = torch.Generator().manual_seed(100 + rank)
    data = [
        (torch.randn(5, 8, generator=gen), torch.randint(0, 3, (5,), generator=gen))
        for _ in range(STEPS)
    ]
    TRAINER.update(net=net, opt=opt, data=data)


def train_step(step):
    net, opt = TRAINER["net"], TRAINER["opt"]
    x, y = TRAINER["data"][step]
    with dist_autograd.context() as context_id:
        loss = F.nll_loss(net(x), y)
        dist_autograd.backward(context_id, [loss])
        grads = rpc.rpc_sync("ps", grads_in_context, args=(context_id,)) if step == 0 else None
        opt.step(context_id)
    return loss.item(), grads


def run(rank, world):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world)
    if rank == 0:
        trainers = [f"trainer{r}" for r in range(1, world)]
        for fut in [rpc.rpc_async(t, make_trainer) for t in trainers]:
            fut.wait()
        losses, grads = [], {}
        for step in range(STEPS):
            for t in trainers:
                loss, g = rpc.rpc_sync(t, train_step, args=(step,))
                losses.append(loss)
                if g is not None:
                    grads[t] = g
        final = [p.detach().tolist() for p in get_parameter_server().model.parameters()]
        print(json.dumps({"losses": losses, "grads": grads, "params": final}), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    # The workers fork from one interpreter that imported this script (and torch) once.
    mp.start_processes(run, args=(WORLD,), nprocs=WORLD, join=True, start_method="forkserver")
    sys.exit(0)
