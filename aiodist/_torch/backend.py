"""aiodist as a torch.distributed backend: torch's own calls on aiodist's data plane.

``torch.distributed.init_process_group(backend="aiodist")`` (and a job started
with aiodist's ``init_process_group()`` and no backend) makes torch's group an
``AiodistProcessGroup``: a process group written in Python, as torch accepts
them (its ``ProcessGroup`` trampoline; ``test_c10d_pypg.py``). Each call torch
makes on it (``DistributedDataParallel``'s reducer, ``DistributedSampler``,
``torch.distributed.*``) starts the same operation of aiodist's public API on
aiodist's event loop, in call order, on the aiodist group the torch group
follows, and returns an ``AiodistWork``: a torch ``Work`` whose future
completes from aiodist's loop. So torch's calls are aiodist's calls: a failed
rank fails them naming it, ranks that disagree get ``CollectiveMismatchError``,
they are in the flight recorder and ``aiodist status --job``, they are
encrypted with the job's TLS, and ``shrink_group``/``regroup`` renumber the
torch group underneath (its rank and size follow the aiodist group).

**Threads.** torch's calls are made from the user's threads and block there
(``Work.wait``); aiodist's loop runs the operation. Called on the loop's own
thread (async code calling torch's blocking API) a call would wait for itself:
it raises ``RuntimeError`` at once instead, and names the way out.

**Devices.** CPU tensors ride aiodist's plane. Tensors of another device go to
that device's *part* (``parts``: NCCL for CUDA), a torch process group that
this group builds over its current membership from the job's store, and
builds again when the membership changes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch._C._distributed_c10d import ProcessGroup as TorchProcessGroup
from torch._C._distributed_c10d import Work as TorchWork

from aiodist._errors import DistTimeoutError
from aiodist._group.world import default_group_loop, get_default_group
from aiodist._ops.movement import (
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_to_all,
    all_to_all_single,
    barrier,
    monitored_barrier,
)
from aiodist._ops.p2p import irecv, isend
from aiodist._ops.reductions import all_reduce, reduce, reduce_scatter, reduce_scatter_tensor
from aiodist._ops.rooted import broadcast, gather, scatter
from aiodist._ops.tensor_groups import all_reduce_coalesced

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from datetime import timedelta

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work

__all__ = ["BACKEND", "AiodistProcessGroup", "AiodistWork"]

logger = logging.getLogger(__name__)

#: The backend's name in torch.distributed.
BACKEND = "aiodist"


class AiodistWork(TorchWork):  # type: ignore[misc]
    """A torch ``Work`` for one aiodist operation (or several, for a coalesced call).

    Settled on aiodist's loop; waited for from any other thread.
    """

    def __init__(self, value: Any, description: str, count: int = 1) -> None:
        super().__init__()
        self._value = value
        self._description = description
        self._future: Any = torch.futures.Future()
        self._done = threading.Event()
        self._left = count
        self._error: BaseException | None = None
        self._source = -1
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"<AiodistWork {self._description}>"

    # --- aiodist's side: on the loop's thread ------------------------------------------------

    def _part_done(self, work: Work[Any]) -> None:
        error = work.exception()
        if error is not None and self._error is None:
            self._error = error
        elif error is None and self._source < 0:
            value = work.result()
            if isinstance(value, int) and not isinstance(value, bool):
                self._source = value
        self._left -= 1
        if self._left == 0 or error is not None:
            self._finish()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._finish()

    def _finish(self) -> None:
        if self._done.is_set():
            return
        self._done.set()
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(self._value)

    # --- torch's side -------------------------------------------------------------------------

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done; raise the operation's error (aiodist's, naming what failed)."""
        loop = self._loop
        if loop is not None and _on(loop):
            raise RuntimeError(_ON_LOOP.format(what=f"waiting for {self._description}"))
        seconds = None
        if timeout is not None and timeout.total_seconds() > 0:
            seconds = timeout.total_seconds()
        if not self._done.wait(seconds):
            raise DistTimeoutError(f"{self._description} did not complete within {seconds} s")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Any:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        pass  # CPU tensors: nothing is left on a stream once done


_ON_LOOP = (
    "{what} on aiodist's event-loop thread would wait for the loop itself: torch's calls on "
    "the aiodist backend block the calling thread. Make them from another thread (in async "
    "code, `await anyio.to_thread.run_sync(step)`), or use aiodist's async API on the loop"
)


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _op(opts: Any) -> Any:
    """The reduce op of torch's options (or a bare ``ReduceOp``, as some callers pass).

    torch's options hold a ``ReduceOp`` instance; its ``op`` is the ``RedOpType``
    (``ReduceOp.SUM``) that aiodist's operations take.
    """
    if opts is None:
        return "sum"
    op = getattr(opts, "reduceOp", opts)
    return getattr(op, "op", op)


class AiodistProcessGroup(TorchProcessGroup):  # type: ignore[misc]
    """torch's process group over an aiodist group (the default group, followed).

    Args:
        follow: Returns the aiodist group the torch group is now (the default
            group after ``shrink_group`` or ``regroup`` replaced it).
        rank, size: torch's rank and size at creation (they follow ``follow()``).
    """

    def __init__(self, follow: Callable[[], ProcessGroup | None], rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._follow = follow
        self._rank = rank
        self._size = size

    # --- what torch asks of every group -------------------------------------------------------

    def _current(self) -> ProcessGroup | None:
        g = self._follow()
        if g is not None:
            self._rank, self._size = g.rank, g.world_size
        return g

    def getRank(self) -> int:
        self._current()
        return self._rank

    def getSize(self) -> int:
        self._current()
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"<AiodistProcessGroup rank {self.getRank()} of {self.getSize()}>"

    # --- issuing ------------------------------------------------------------------------------

    def _issue(
        self,
        description: str,
        value: Any,
        starts: Sequence[Callable[[ProcessGroup], Work[Any]]],
    ) -> AiodistWork:
        """Start ``starts`` (each an aiodist operation on the group) on aiodist's loop, in order."""
        loop = default_group_loop()
        if loop is None:
            raise RuntimeError(
                f"torch.distributed {description} on the aiodist backend: aiodist's job is not "
                "running in this process (destroy_process_group was called?)"
            )
        if _on(loop):
            raise RuntimeError(_ON_LOOP.format(what=f"torch.distributed {description}"))
        work = AiodistWork(value, description, len(starts))
        work._loop = loop

        def begin() -> None:
            g = self._current()
            if g is None:
                work._fail(RuntimeError(f"{description}: aiodist's job ended"))
                return
            for start in starts:
                try:
                    started = start(g)
                except Exception as exc:
                    work._fail(exc)
                    return
                started.when_done(work._part_done)

        loop.call_soon_threadsafe(begin)
        return work

    def _one(
        self, description: str, value: Any, start: Callable[[ProcessGroup], Work[Any]]
    ) -> AiodistWork:
        return self._issue(description, value, [start])

    # --- the operations -----------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> AiodistWork:
        op = _op(opts)
        if len(tensors) == 1:
            t = tensors[0]
            return self._one("all_reduce", tensors, lambda g: all_reduce(t, op, g))
        return self.allreduce_coalesced(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> AiodistWork:
        op = _op(opts)
        return self._one(
            "all_reduce_coalesced", tensors, lambda g: all_reduce_coalesced(tensors, op, g)
        )

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> AiodistWork:
        root = opts.rootRank if opts is not None else 0
        starts = [
            (lambda g, t=t: broadcast(t, None, g, group_src=root))  # type: ignore[misc]
            for t in tensors
        ]
        return self._issue("broadcast", tensors, starts)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> AiodistWork:
        starts = [
            (lambda g, o=o, i=i: all_gather(o, i, g))  # type: ignore[misc]
            for o, i in zip(output_tensors, input_tensors, strict=True)
        ]
        return self._issue("all_gather", output_tensors, starts)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> AiodistWork:
        return self._one(
            "all_gather_into_tensor", [output], lambda g: all_gather_into_tensor(output, input, g)
        )

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> AiodistWork:
        return self._one(
            "all_gather_coalesced",
            output_lists,
            lambda g: all_gather_coalesced(output_lists, inputs, g),
        )

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> AiodistWork:
        starts = [
            (lambda g, o=o, i=i: all_gather_into_tensor(o, i, g))  # type: ignore[misc]
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._issue("all_gather_into_tensor_coalesced", outputs, starts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> AiodistWork:
        root, op = opts.rootRank, _op(opts)
        t = tensors[0]
        return self._one("reduce", tensors, lambda g: reduce(t, None, op, g, group_dst=root))

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> AiodistWork:
        op = _op(opts)
        starts = [
            (lambda g, o=o, i=i: reduce_scatter(o, i, op, g))  # type: ignore[misc]
            for o, i in zip(outputs, input_lists, strict=True)
        ]
        return self._issue("reduce_scatter", outputs, starts)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> AiodistWork:
        op = _op(opts)
        return self._one(
            "reduce_scatter_tensor", [output], lambda g: reduce_scatter_tensor(output, input, op, g)
        )

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> AiodistWork:
        op = _op(opts)
        starts = [
            (lambda g, o=o, i=i: reduce_scatter_tensor(o, i, op, g))  # type: ignore[misc]
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._issue("reduce_scatter_tensor_coalesced", outputs, starts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> AiodistWork:
        outs = list(output_split_sizes) or None
        ins = list(input_split_sizes) or None
        return self._one(
            "all_to_all_single", [output], lambda g: all_to_all_single(output, input, outs, ins, g)
        )

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> AiodistWork:
        return self._one("all_to_all", outputs, lambda g: all_to_all(outputs, inputs, g))

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> AiodistWork:
        root = opts.rootRank
        t = input_tensors[0]
        out = output_tensors[0] if output_tensors else None
        return self._one(
            "gather",
            output_tensors,
            lambda g: gather(t, out if g.rank == root else None, None, g, group_dst=root),
        )

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> AiodistWork:
        root = opts.rootRank
        t = output_tensors[0]
        ins = input_tensors[0] if input_tensors else None
        return self._one(
            "scatter",
            output_tensors,
            lambda g: scatter(t, ins if g.rank == root else None, None, g, group_src=root),
        )

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> AiodistWork:
        t = tensors[0]
        return self._one("send", tensors, lambda g: isend(t, None, g, tag, group_dst=dst))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> AiodistWork:
        t = tensors[0]
        return self._one("recv", tensors, lambda g: irecv(t, None, g, tag, group_src=src))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> AiodistWork:
        t = tensors[0]
        return self._one("recv", tensors, lambda g: irecv(t, None, g, tag))

    def barrier(self, opts: Any = None) -> AiodistWork:
        return self._one("barrier", [], lambda g: barrier(g))

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        self._one(
            "monitored_barrier", [], lambda g: monitored_barrier(g, timeout, wait_all_ranks)
        ).wait()


def follow_default() -> ProcessGroup | None:
    """The aiodist group torch's default group rides: aiodist's default group, as it is now."""
    return get_default_group()


def create_default(rank: int, size: int) -> AiodistProcessGroup:
    """torch's default group over aiodist's (which must be up in this process)."""
    g = get_default_group()
    if g is None:
        raise RuntimeError("aiodist's default group is not initialised")
    if (g.rank, g.world_size) != (rank, size):
        raise ValueError(
            f"torch.distributed asked for rank {rank} of {size}, and aiodist's job has this "
            f"process as rank {g.rank} of {g.world_size}; pass the same rank and world size"
        )
    return AiodistProcessGroup(follow_default, rank, size)
