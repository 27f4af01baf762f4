"""DDP on two trainers beside a four-worker rpc world, with a RemoteModule on a parameter server.

Written as torch.distributed.rpc programs are (the PyTorch example that
combines DDP and RPC), on CPU with synthetic data; ``RPC_SYSTEM`` picks the
rpc imports (``torch``: TensorPipe; ``aiodist``), while DDP runs on
torch.distributed's gloo group in both. Ranks 0 and 1 are trainers (their own
process group of two), rank 2 the master, rank 3 the parameter server
holding an EmbeddingBag behind a RemoteModule. Each trainer looks up rows of
its own half of the table, and they take turns stepping (torch's concurrent
steps could lose one's update), so the run is deterministic. The master
prints one JSON line: every trainer's losses, the first step's gradients of
the local layer, and the final table.

Usage: ``RPC_SYSTEM=aiodist MASTER_PORT=29500 RPC_PORT=29501 python ddp_remote_module.py``
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import optim
from torch.nn.parallel import DistributedDataParallel as DDP

if os.environ.get("RPC_SYSTEM", "torch") == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions
else:
    import aiodist.rpc as rpc
    import aiodist.rpc.dist_autograd as dist_autograd
    from aiodist.rpc import RRef, TensorPipeRpcBackendOptions
    from aiodist.rpc.nn import RemoteModule
    from aiodist.rpc.optim import DistributedOptimizer

NUM_EMBEDDINGS = 40
EMBEDDING_DIM = 6
STEPS = 3


class HybridModel(torch.nn.Module):
    def __init__(self, remote_emb_module):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        torch.manual_seed(5)
        self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, 4))

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


def table_of(module_rref):
    return module_rref.local_value().weight.detach().tolist()


def _run_trainer(remote_emb_module, rank):
    model = HybridModel(remote_emb_module)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(rank)
    half = NUM_EMBEDDINGS // 2
    losses, fc_grads = [], None
    for _ in range(STEPS):
        lengths = torch.randint(1, 4, (5,), generator=gen)
        indices = torch.randint(0, half, (int(lengths.sum()),), generator=gen) + rank * half
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        target = torch.randint(0, 4, (5,), generator=gen)
        with dist_autograd.context() as context_id:
            output = model(indices, offsets)
            loss = criterion(output, target)
            dist_autograd.backward(context_id, [loss])
            if fc_grads is None:
                grads = dist_autograd.get_gradients(context_id)
                fc_grads = [grads[p].tolist() for p in model.fc.parameters()]
            # One trainer steps the parameter server at a time: torch's functional SGD
            # steps concurrently, and a step's dense update of the whole table (zeros
            # beyond its rows) could overwrite the other's. Both are in before the
            # next lookups.
            for turn in range(2):
                if turn == rank:
                    opt.step(context_id)
                dist.barrier()
        losses.append(loss.item())
    return {"losses": losses, "fc_grads": fc_grads}


def run_worker(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    rpc_backend_options = TensorPipeRpcBackendOptions()
    rpc_backend_options.init_method = f"tcp://127.0.0.1:{os.environ['RPC_PORT']}"
    if rank == 2:
        rpc.init_rpc(
            "master", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options
        )
        remote_emb_module = RemoteModule(
            "ps",
            torch.nn.EmbeddingBag,
            args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum"},
        )
        futs = []
        for trainer_rank in [0, 1]:
            trainer_name = f"trainer{trainer_rank}"
            futs.append(
                rpc.rpc_async(trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank))
            )
        results = [fut.wait() for fut in futs]
        table = rpc.rpc_sync("ps", table_of, args=(remote_emb_module.get_module_rref(),))
        print(json.dumps({"trainers": results, "table": table}), flush=True)
    elif rank <= 1:
        dist.init_process_group(
            backend="gloo",
            rank=rank,
            world_size=2,
            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        )
        rpc.init_rpc(
            f"trainer{rank}",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )
    else:
        torch.manual_seed(4)  # the table's initial values
        rpc.init_rpc(
            "ps", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options
        )
    rpc.shutdown()
    if rank <= 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    # The workers fork from one interpreter that imported this script (and torch) once.
    mp.start_processes(run_worker, args=(4,), nprocs=4, join=True, start_method="forkserver")
    sys.exit(0)
