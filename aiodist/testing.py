"""Helpers for testing code that uses aiodist: many ranks in one event loop."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from aiodist._group import ProcessGroup, open_process_group

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

__all__ = ["run_ranks"]

T = TypeVar("T")
_job_ids = itertools.count()


async def run_ranks(
    address: tuple[str, int],
    world_size: int,
    body: Callable[[ProcessGroup], Awaitable[T]],
    *,
    ranks: Sequence[int] | None = None,
    group_name: str | None = None,
    hostnames: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[T]:
    """Join ``world_size`` clients to the server at ``address`` and run ``body`` on each.

    Every client is a task of the calling event loop with its own control
    connection, as separate processes would have.

    Args:
        address: The rendezvous server's ``(host, port)``.
        world_size: Number of clients.
        body: Called with each client's world group once the job has formed.
        ranks: Explicit rank per client (default: automatic ranks).
        group_name: The job's name (default: a fresh one per call).
        hostnames: The host each client counts as (default: this machine's name).
        **kwargs: Passed to ``open_process_group``.

    Returns:
        ``body``'s results in rank order.
    """
    name = group_name or f"test-job-{next(_job_ids)}"
    results: dict[int, T] = {}

    async def one(i: int) -> None:
        async with open_process_group(
            f"tcp://{address[0]}:{address[1]}",
            world_size=world_size,
            rank=-1 if ranks is None else ranks[i],
            group_name=name,
            hostname=None if hostnames is None else hostnames[i],
            **kwargs,
        ) as group:
            results[group.rank] = await body(group)

    async with anyio.create_task_group() as tg:
        for i in range(world_size):
            tg.start_soon(one, i)
    return [results[r] for r in range(world_size)]
