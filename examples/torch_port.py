"""A torch.distributed script, ported to aiodist by changing its import line only.

Written for ``torch.distributed`` (in the style of PyTorch's "Writing Distributed
Applications" tutorial): point-to-point, collectives in torch's forms
(``all_gather(tensor_list, tensor)``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, ``batch_isend_irecv``),
async handles, object collectives, subgroups and a data-parallel step with
averaged gradients. Only the import below differs from the torch version::

    import torch.distributed as dist        # the original
    import aiodist.sync as dist             # the port

Run it with ``aiodist run -n 2 examples/torch_port.py`` (the original with
``torchrun --nproc-per-node 2``); every rank prints the same lines under both.
"""

from __future__ import annotations

import torch
from torch import nn

import aiodist.sync as dist


def p2p(rank: int, world: int) -> None:
    t = torch.zeros(2)
    if rank == 0:
        t += 1
        for dst in range(1, world):
            dist.send(tensor=t, dst=dst)
    else:
        dist.recv(tensor=t, src=0)
    print(f"rank {rank} p2p: {t.tolist()}")
    peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(3)
    ops = [
        dist.P2POp(dist.isend, torch.full((3,), float(rank)), peer_next),
        dist.P2POp(dist.irecv, got, peer_prev),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    print(f"rank {rank} ring: {got.tolist()}")


def collectives(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)))
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    print(f"rank {rank} all_reduce: {t.tolist()}")
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank, rank * 10]))
    print(f"rank {rank} all_gather: {[g.tolist() for g in gathered]}")
    flat = torch.zeros(world * 2)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    print(f"rank {rank} all_gather_into_tensor: {flat.tolist()}")
    mine = torch.zeros(2)
    dist.reduce_scatter_tensor(mine, torch.arange(world * 2, dtype=torch.float32))
    print(f"rank {rank} reduce_scatter_tensor: {mine.tolist()}")
    out = torch.zeros(world, dtype=torch.int64)
    dist.all_to_all_single(out, torch.arange(world) + 100 * rank)
    print(f"rank {rank} all_to_all_single: {out.tolist()}")
    b = torch.tensor([rank * 1.5])
    dist.broadcast(b, src=world - 1)
    print(f"rank {rank} broadcast: {b.tolist()}")
    parts = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), gather_list=parts, dst=0)
    if rank == 0:
        assert parts is not None
        print(f"rank {rank} gather: {[p.tolist() for p in parts]}")
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    print(f"rank {rank} async all_reduce done: {work.is_completed()}")
    dist.barrier()


def objects(rank: int, world: int) -> None:
    everyone: list[object] = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "name": f"worker-{rank}"})
    print(f"rank {rank} all_gather_object: {everyone}")
    config = [{"lr": 0.1, "epochs": 3}] if rank == 0 else [None]
    dist.broadcast_object_list(config, src=0)
    print(f"rank {rank} broadcast_object_list: {config}")
    shard: list[object] = [None]
    dist.scatter_object_list(shard, [f"shard-{i}" for i in range(world)] if rank == 0 else None)
    print(f"rank {rank} scatter_object_list: {shard}")


def train(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        for p in model.parameters():  # average the gradients, as DDP does
            assert p.grad is not None
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world
        opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    total = torch.tensor([float(weights.sum())])
    everyone = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(everyone, total)
    in_sync = all(torch.equal(e, everyone[0]) for e in everyone)
    print(f"rank {rank} train: weights in sync across ranks: {in_sync}")


def main() -> None:
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    p2p(rank, world)
    collectives(rank, world)
    objects(rank, world)
    train(rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
