"""Process groups: a set of ranks, their operations' order, and breaking together.

A job's *world* group spans every rank; groups made with ``new_group`` are
subsets that share the session (``session.py``). A group numbers its
collectives at call time (so every rank agrees on their order), starts each
as a ``Work`` handle with a deadline, maps global ranks to its own, and breaks
on every member when one of its operations cannot complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import weakref
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiodist._errors import ClosedError, DistError
from aiodist._group.inflight import Deadlines, start_task
from aiodist._group.lingering import linger
from aiodist._group.work import Work

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Sequence

    from aiodist._control.store import Store
    from aiodist._group.session import Session

__all__ = ["Bridge", "ProcessGroup"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Bridge(Protocol):
    """torch.distributed's side of a group, as the layers below the torch bridge see it.

    ``aiodist._torch.bridge.GroupBridge`` is the one implementation; the
    collectives reach torch only through these methods, so nothing below the
    bridge imports it.
    """

    torch_group: Any  # torch's ProcessGroup; None until brought up

    def crosses(self, tensor: object) -> bool:
        """True if ``tensor`` lives on a device this bridge carries."""
        ...

    def start_collective(self, name: str, args: tuple[Any, ...]) -> Work[Any]:
        """Start collective ``name`` (``args``: its arguments but ``group``) on torch."""
        ...

    async def new_group(self, group: ProcessGroup, backend: str | None) -> None:
        """Bring up torch's side of ``group``, carved from this bridge's group."""
        ...


class ProcessGroup:
    """A set of ranks that communicate together.

    Attributes:
        rank: This process's rank within the group.
        world_size: Number of ranks in the group.
        ranks: The global rank of each group rank.
    """

    def __init__(self, session: Session, ranks: Sequence[int], *, name: str, group_id: int) -> None:
        self._session = session
        self.ranks = ranks  # the world's is a range: O(1) lookups in a job of any size
        self.name = name
        self.group_id = group_id
        self.world_size = len(ranks)
        self.rank = ranks.index(session.rank) if session.rank in ranks else -1
        self.timeout = session.timeout
        self.group_backend: str | None = None  # new_group(backend=...); else the session's
        self.bridge: Bridge | None = None  # torch.distributed's side of this group, if any
        self.error: DistError | None = None
        self.closed = False
        # next() of a count is one step under the GIL: metric syncs on the shared board
        # take their numbers from the training loop's thread, everything else here.
        self._seqs = itertools.count(1)
        self._seq = 0  # the latest number taken (descriptions of point-to-point operations)
        self._index: dict[int, int] | None = None  # global rank -> group rank, on first use
        self.deadlines = Deadlines(self)  # one timer for the timeouts of all its operations
        self._on_close: list[weakref.WeakMethod[Callable[[], object]]] = []

    def check_usable(self) -> None:
        """Raise the error that broke this group (or its session), if any."""
        self._session.check_usable()
        if self.closed:
            raise ClosedError(f"{self!r} was destroyed; create a new group with new_group")
        if self.error is not None:
            raise self.error
        if self.rank < 0:
            raise ValueError(f"this process (rank {self._session.rank}) is not in {self!r}")

    def on_close(self, method: Callable[[], object]) -> None:
        """Call the bound ``method`` (held weakly) when this group or its session closes.

        Before anything fails: what an operation left to do on this side (metric
        records queued on a shared board) still gets done, for the peers' sake.
        A method may return a future (a task it started): leaving the job waits
        for it, bounded (``join.run_close_hooks``).
        """
        self._on_close.append(weakref.WeakMethod(method))

    def run_close_hooks(self) -> list[asyncio.Future[Any]]:
        """Run the close hooks registered so far; return the futures they returned."""
        hooks, self._on_close = self._on_close, []
        started: list[asyncio.Future[Any]] = []
        for ref in hooks:
            method = ref()
            if method is not None:
                result = method()
                if isinstance(result, asyncio.Future):
                    started.append(result)
        return started

    def close(self) -> None:
        """Destroy this group (not the session): its pending receives fail, later calls raise."""
        if self.closed:
            return
        self.run_close_hooks()
        self.closed = True
        self._session.groups.pop(self.group_id, None)
        self._session.plane.fail(ClosedError(f"{self!r} was destroyed"), self.group_id)
        self.deadlines.close()

    def break_(self, exc: DistError, *, notify: bool = True) -> None:
        """Mark this group unusable with ``exc`` on this rank and (``notify``) on every member."""
        if self.error is not None:
            return
        self.error = exc
        logger.error("group %r broken: %s", self.name, exc)
        self._session.note_trouble()
        plane = self._session.plane
        plane.fail(exc, self.group_id)
        if notify:
            header = [self.group_id, exc.code, str(exc), exc.wire_details()]
            for rank in self.ranks:
                if rank != self._session.rank:
                    self._spawn(self._notify(rank, header))

    async def _notify(self, rank: int, header: list[Any]) -> None:
        with contextlib.suppress(OSError, DistError):
            await self._session.plane.send_error(rank, header)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = linger(coro)  # peers learn why even when the loop is ending
        self._session.inflight.add(task)
        task.add_done_callback(self._session.inflight.discard)

    def start(
        self, description: str, op: Callable[[int], Awaitable[T]], *, collective: bool = True
    ) -> Work[T]:
        """Run ``op(seq)`` as this group's next operation and return its handle.

        The sequence number is taken now, at call time, so every rank numbers its
        operations in the same order however tasks are scheduled. A timeout or an
        error that makes the operation impossible breaks the group for every member.
        """
        loop, work, seq = self.begin(description, collective=collective, timed=False)
        start_task(self, loop, work, op, seq, collective)
        return work

    def begin(
        self, description: str, *, collective: bool = True, timed: bool = True
    ) -> tuple[asyncio.AbstractEventLoop, Work[Any], int]:
        """Take the next operation's handle and sequence number, for a callback-driven op.

        The caller settles the handle itself (``inflight.fail`` on errors); with
        ``timed`` it fails with ``DistTimeoutError`` after the group's timeout.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                f"{description} must be called from the event loop that joined the job; "
                "from plain code use aiodist.sync"
            ) from None
        self.check_usable()
        # Point-to-point takes no sequence number: not every rank calls it.
        seq = self.next_seq() if collective else self._seq
        work: Work[Any] = Work.pending(loop, f"{description}#{seq}")
        if timed:
            self.deadlines.add(loop, work, None)
        return loop, work, seq

    def next_seq(self) -> int:
        """Take the group's next sequence number (from any thread)."""
        seq = self._seq = next(self._seqs)
        return seq

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def group_rank_of(self, rank: object, name: str) -> int:
        """The group rank of global ``rank``: ``src``/``dst`` are global ranks, as in torch.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is not a member of this group.
        """
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"{name} must be an int rank, got {type(rank).__name__}")
        if isinstance(self.ranks, range):
            if rank in self.ranks:
                return self.ranks.index(rank)
        else:
            if self._index is None:
                self._index = {r: i for i, r in enumerate(self.ranks)}
            if rank in self._index:
                return self._index[rank]
        raise ValueError(
            f"{name}={rank} is not a member of {self!r} (its global ranks: "
            f"{_ranges(self.ranks)}); {name} is a global rank, as in torch.distributed"
        )

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name!r} rank {self.rank} of {self.world_size}>"

    @property
    def session(self) -> Session:
        return self._session

    @property
    def backend(self) -> str | None:
        return self.group_backend or self._session.backend

    @property
    def store(self) -> Store:
        return self._session.store


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``: short even for large groups."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
