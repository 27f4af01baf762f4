"""A parameter server on remote calls: ``aiodist run -n 4 examples/parameter_server.py``.

Rank 0 is the master: it holds the model (a linear regression) and drives
training. Every other rank is a worker whose whole program is
``init_process_group()`` then ``await rpc.shutdown()``: it serves the
master's calls meanwhile. Each step the master sends the current parameters to
every worker at once; each worker computes the gradient of its own data shard
(in an rpc thread, so its event loop stays free) and sends it back; the
master averages them and takes an SGD step. The shards live in ``Shard``
objects the master created on the workers with ``rpc.remote``: they stay
there, and only parameters and gradients travel.

With ``--async-sgd`` the master instead applies each worker's gradient as
soon as it arrives and sends that worker the new parameters at once (the
asynchronous SGD of the original parameter-server papers): fast workers do
not wait for slow ones.
"""

from __future__ import annotations

import argparse
import asyncio

import anyio
import torch

import aiodist
import aiodist.rpc as rpc

FEATURES = 16
ROWS_PER_SHARD = 512


def true_weights() -> torch.Tensor:
    """The weights the data comes from: the same on every rank (a fixed seed)."""
    return torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(0))


class Shard:
    """One worker's data and its copy of the model; lives on the worker (made by rpc.remote)."""

    def __init__(self, rank: int) -> None:
        torch.set_num_threads(1)  # a few ranks share the machine's cores
        gen = torch.Generator().manual_seed(1000 + rank)
        self.x = torch.randn(ROWS_PER_SHARD, FEATURES, generator=gen)
        noise = 0.01 * torch.randn(ROWS_PER_SHARD, 1, generator=gen)
        self.y = self.x @ true_weights() + noise
        self.model = torch.nn.Linear(FEATURES, 1)
        self.rank = rank

    def gradients(self, params: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
        """Loss and gradients of this shard at ``params`` (a plain method: runs in a thread)."""
        with torch.no_grad():
            for p, value in zip(self.model.parameters(), params, strict=True):
                p.copy_(value)
        self.model.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()  # type: ignore[no-untyped-call]
        grads = [p.grad.detach().clone() for p in self.model.parameters() if p.grad is not None]
        return float(loss.detach()), grads


class ParameterServer:
    """The master's model and optimizer."""

    def __init__(self, lr: float) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(FEATURES, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def apply(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.model.parameters(), grads, strict=True):
            p.grad = g
        self.optimizer.step()


async def synchronous(ps: ParameterServer, shards: list[rpc.RRef[Shard]], steps: int) -> float:
    loss = float("nan")
    for step in range(steps):
        params = ps.parameters()
        # Every worker at once: the calls run concurrently on their ranks.
        works = [shard.rpc_async().gradients(params) for shard in shards]
        results = [await work for work in works]
        loss = sum(r[0] for r in results) / len(results)
        mean = [torch.stack(gs).mean(0) for gs in zip(*(r[1] for r in results), strict=True)]
        ps.apply(mean)
        if step % 10 == 0:
            print(f"step {step}: loss {loss:.5f}", flush=True)
    return loss


async def asynchronous(ps: ParameterServer, shards: list[rpc.RRef[Shard]], steps: int) -> float:
    losses: dict[int, float] = {}
    lock = asyncio.Lock()  # one update at a time

    async def worker_loop(shard: rpc.RRef[Shard]) -> None:
        for _ in range(steps):
            loss, grads = await shard.rpc_async().gradients(ps.parameters())
            async with lock:
                ps.apply(grads)  # at once: no waiting for the other workers
            losses[shard.owner().id] = loss

    async with anyio.create_task_group() as tg:
        for shard in shards:
            tg.start_soon(worker_loop, shard)
    return sum(losses.values()) / len(losses)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--async-sgd", action="store_true")
    args = parser.parse_args()

    await aiodist.init_process_group()
    rank, world = aiodist.get_dist_info()
    if rank == 0:
        if world < 2:
            raise SystemExit("run it with workers: aiodist run -n 4 examples/parameter_server.py")
        torch.set_num_threads(1)
        ps = ParameterServer(args.lr)
        shards: list[rpc.RRef[Shard]] = [rpc.remote(w, Shard, (w,)) for w in range(1, world)]
        first, _ = await shards[0].rpc_async().gradients(ps.parameters())
        train = asynchronous if args.async_sgd else synchronous
        loss = await train(ps, shards, args.steps)
        error = float((ps.model.weight.detach().T - true_weights()).abs().max())
        mode = "async" if args.async_sgd else "sync"
        print(
            f"parameter server ({mode}): {args.steps} steps, {world - 1} workers, "
            f"loss {first:.4f} -> {loss:.5f}, max weight error {error:.4f}",
            flush=True,
        )
    await rpc.shutdown()  # the workers' whole job: serve until every rank is done
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
