"""Process groups: a set of ranks, their operations' order, and breaking together.

A job's *world* group spans every rank; groups made with ``new_group`` are
subsets that share the session (``session.py``). A group numbers its
collectives at call time (so every rank agrees on their order), starts each
as a ``Work`` handle with a deadline, maps global ranks to its own, and breaks
on every member when one of its operations cannot complete.

**Every call settles its place in the order.** A collective takes its
sequence number first, before it checks or encodes anything, so a call that
fails on one rank (a bad argument, an object that cannot be pickled) still
holds its place there: that rank aborts it (``abort``), which tells every member,
and their call with that number fails with ``AbortedError`` naming the rank
and the reason (``abort_remote``), now if it runs or as soon as it is made.
Nothing is left waiting and no later call can take that call's data; the
group stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from aiodist._errors import (
    AbortedError,
    ArgumentError,
    ArgumentTypeError,
    ClosedError,
    DistError,
    DistTimeoutError,
    ErrorCode,
    GroupBrokenError,
    RankFailedError,
    counted,
)
from aiodist._group import stalls
from aiodist._group.inflight import Deadlines
from aiodist._group.lingering import LingeringTask, linger
from aiodist._group.work import Work
from aiodist._wire.headers import message_header
from aiodist._wire.keys import call_of
from aiodist._wire.messages import PeerError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Sequence
    from datetime import timedelta

    from aiodist._control.store import Store
    from aiodist._group.session import Session
    from aiodist._wire.keys import Key

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Bridge(Protocol):
    """torch.distributed's side of a group, as the layers below the torch bridge see it.

    ``aiodist._torch.bridge.GroupBridge`` is the one implementation; the
    collectives reach torch only through these methods, so nothing below the
    bridge imports it.
    """

    torch_group: Any  # torch's ProcessGroup; None until brought up
    devices: dict[str, str]  # device type -> torch backend of the calls it carries; {}: none

    def crosses(self, tensor: object) -> bool:
        """True if ``tensor`` lives on a device this bridge carries."""
        ...

    def start_collective(self, request: Any, seq: int) -> Work[Any]:
        """Start ``request`` (a checked ``_ops.requests.Request``) on torch as operation ``seq``.

        Typed ``Any`` here: ``_group`` knows nothing of the operations' requests.
        """
        ...

    async def new_group(self, group: ProcessGroup, backend: str | None) -> None:
        """Bring up torch's side of ``group``, carved from this bridge's group."""
        ...


class Methods(Protocol):
    """torch's ``ProcessGroup`` methods that run an operation, as ``_group`` sees them.

    ``_group`` knows no operation: ``aiodist._sync.portal.GroupMethods`` is the
    one implementation, set as ``ProcessGroup.methods`` when ``aiodist`` is imported.
    """

    def monitored_barrier(
        self, group: ProcessGroup, timeout: float | timedelta | None, wait_all_ranks: bool
    ) -> Work[None]:
        """``aiodist.monitored_barrier(group, ...)``: started in async code, waited for in plain."""
        ...

    def allreduce(self, group: ProcessGroup, tensors: Any, opts: Any) -> Work[Any]:
        """``aiodist.all_reduce(tensor, op, group)``, started (from plain code too)."""
        ...


class ProcessGroup:
    """A set of ranks that communicate together.

    Attributes:
        rank: This process's rank within the group.
        world_size: Number of ranks in the group.
        ranks: The global rank of each group rank.
        session: The session (the job's connection) the group belongs to.
    """

    #: torch's methods that run an operation (see ``Methods``).
    methods: ClassVar[Methods]

    def __init__(self, session: Session, ranks: Sequence[int], *, name: str, group_id: int) -> None:
        self.session = session
        self.ranks = ranks  # the world's is a range: O(1) lookups in a job of any size
        self.name = name
        self.group_id = group_id
        self.world_size = len(ranks)
        self.rank = ranks.index(session.rank) if session.rank in ranks else -1
        self.timeout = session.timeout
        self.group_backend: str | None = None  # new_group(backend=...); else the session's
        self.bridge: Bridge | None = None  # torch.distributed's side of this group, if any
        self.error: DistError | None = None
        self.keeps_p2p = False  # broken by a member's failure: point-to-point goes on
        self.closed = False
        # next() of a count is one step under the GIL: metric syncs on the shared board
        # take their numbers from the training loop's thread, everything else here.
        self._seqs = itertools.count(1)
        self._seq = 0  # the latest number taken
        self._p2p_seqs = itertools.count(1)  # point-to-point's own numbers (descriptions)
        # Global rank -> group rank; the world's range needs none (O(1) in a job of any size).
        self._index: dict[int, int] | None = (
            None if isinstance(ranks, range) else {r: i for i, r in enumerate(ranks)}
        )
        self.deadlines = Deadlines(self)  # one timer for the timeouts of all its operations
        self._on_close: list[weakref.WeakMethod[Callable[[], object]]] = []
        # Calls a member aborted before this rank made them: they fail when made.
        self._aborted: dict[int, AbortedError] = {}
        self._on_break: list[Callable[[DistError], object]] = []
        # What the operations keep per group (``_ops``): sends to (destination, key) still
        # being staged from a device (a later send there waits for them: ``p2p.py``); the
        # output tensors of its last large call of each operation (``outputs.py``); how
        # many times it was shrunk on this rank (its survivors' agreements: ``shrink.py``).
        self.staging_sends: dict[tuple[int, Key], asyncio.Future[None]] = {}
        self.kept_outputs: dict[str, Any] = {}
        self.shrinks = 0
        self.rows: Any = None  # its board of small exchanges, once decided (``_ops.board``)

    def check_usable(self, *, p2p: bool = False) -> None:
        """Raise the error that broke this group (or its session), if any.

        With ``p2p`` (a point-to-point call), a group broken by a member's failure
        is usable: the plane fails what needs the failed rank.

        :meta private:
        """
        self.session.check_usable()
        if self.closed:
            raise ClosedError(f"{self!r} was destroyed; create a new group with new_group")
        if self.error is not None and not (p2p and self.keeps_p2p):
            raise self.error
        if self.rank < 0:
            raise ValueError(f"this process (rank {self.session.rank}) is not in {self!r}")

    def on_close(self, method: Callable[[], object]) -> None:
        """Call the bound ``method`` (held weakly) when this group or its session closes.

        Before anything fails: what an operation left to do on this side (metric
        records queued on a shared board) still gets done, for the peers' sake.
        A method may return a future (a task it started): leaving the job waits
        for it, bounded (``join.run_close_hooks``).

        :meta private:
        """
        self._on_close.append(weakref.WeakMethod(method))

    def run_close_hooks(self) -> list[asyncio.Future[Any]]:
        """Run the close hooks registered so far; return the futures they returned.

        :meta private:
        """
        hooks, self._on_close = self._on_close, []
        started: list[asyncio.Future[Any]] = []
        for ref in hooks:
            method = ref()
            if method is not None:
                result = method()
                if isinstance(result, asyncio.Future):
                    started.append(result)
        return started

    def on_break(self, fn: Callable[[DistError], object]) -> None:
        """Call ``fn(error)`` on the loop's thread once this group breaks (at once if it has).

        For what runs beside the group's own operations and must end with them: the
        torch backend's device parts (an NCCL communicator is aborted). ``fn`` must not
        block; what it raises is logged.

        :meta private:
        """
        if self.error is not None:
            fn(self.error)
        else:
            self._on_break.append(fn)

    def close(self) -> None:
        """Destroy this group (not the session): its pending receives fail, later calls raise.

        :meta private:
        """
        if self.closed:
            return
        self.run_close_hooks()
        self.closed = True
        self.session.groups.pop(self.group_id, None)
        self.session.plane.fail(ClosedError(f"{self!r} was destroyed"), self.group_id)
        self.deadlines.close()

    def break_(self, exc: DistError, *, notify: bool = True, keep_p2p: bool = False) -> None:
        """Mark this group unusable with ``exc`` on this rank and (``notify``) on every member.

        With ``keep_p2p`` (a member failed: ``membership.py``), its collectives
        break and its point-to-point with the other members goes on.

        :meta private:
        """
        if self.error is not None:
            return
        self.error = exc
        # A member failed or left (as the server, the data plane or a member said): only what
        # needs it fails, point-to-point with the others goes on.
        self.keeps_p2p = keep_p2p or (
            isinstance(exc, RankFailedError) and exc.rank not in (-1, self.session.rank)
        )
        self._aborted.clear()
        # INFO: every operation on it raises ``exc`` itself; code that handles it (a
        # shrink_group) needs no line of its own on stderr.
        logger.info("group %r broken: %s", self.name, exc)
        listeners, self._on_break = self._on_break, []
        for fn in listeners:
            try:
                fn(exc)
            except Exception:
                logger.exception("a listener of group %r's break failed", self.name)
        self.session.note_trouble()
        plane = self.session.plane
        plane.fail(exc, self.group_id, keep_p2p=self.keeps_p2p)
        if notify:
            error = PeerError(self.group_id, exc.code, str(exc), exc.wire_details())
            for rank in self.ranks:
                if rank != self.session.rank:
                    self._spawn(self._notify(rank, error))

    async def _notify(self, rank: int, error: PeerError) -> None:
        with contextlib.suppress(OSError, DistError):
            await self.session.plane.send_error(rank, error)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.spawn(linger(coro))  # peers learn why even when the loop is ending

    def spawn(self, task: asyncio.Task[Any]) -> None:
        """Keep ``task`` (part of an operation, started here) until it ends: closing waits.

        :meta private:
        """
        inflight = self.session.inflight
        inflight.add(task)
        task.add_done_callback(inflight.discard)

    # --- operations: begun, driven, failed ------------------------------------------------------

    def begin(
        self,
        description: str,
        *,
        seq: int | None = None,
        collective: bool = True,
        timed: bool = True,
    ) -> Work[Any]:
        """The handle of operation ``seq`` of this group, running (see ``inflight``).

        ``seq`` is what the call took with ``take_seq`` when it was made (or a
        ``sub_seq`` of it): every rank numbers its operations in the same order
        however tasks are scheduled. None, for a collective, takes the next one
        now; for point-to-point (not ``collective``) it is 0, the number no call
        has, and the handle is numbered in point-to-point's own order: aborting
        a call can never reach it. With ``timed``, the handle fails with
        ``DistTimeoutError`` after the group's timeout and breaks the group.

        The operation settles the handle itself (``Work.set_result``, ``fail``),
        from the data plane's callbacks or from a task (``drive``). It comes back
        already failed when a member aborted the call: the operation then sends
        and posts nothing.

        Raises:
            RuntimeError: Not called on an event loop.
            DistError, ValueError: The group is unusable here (for a new number).

        :meta private:
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                f"{description} must be called from the event loop that joined the job; "
                "from plain code use aiodist.sync"
            ) from None
        if seq is None:
            self.check_usable(p2p=not collective)
            if not collective:
                work: Work[Any] = Work.pending(loop, f"{description}#p{next(self._p2p_seqs)}")
                if timed:
                    self.deadlines.add(loop, work, 0)
                return work
            seq = self.next_seq()
        work = Work.pending(loop, f"{description}#{seq}")
        if self._aborted and collective:
            call = call_of(seq)
            aborted = self._aborted.get(call)
            if aborted is not None:
                if call == seq:  # the call itself: its parts (sub_seq) started before it
                    del self._aborted[call]
                work.set_exception(aborted)
                return work
        if timed:
            self.deadlines.add(loop, work, seq)
        return work

    def drive(
        self,
        work: Work[T],
        op: Callable[[int], Awaitable[T]],
        seq: int,
        *,
        collective: bool = True,
        on_end: Callable[[], object] | None = None,
    ) -> Work[T]:
        """Run ``op(seq)`` as a task that settles ``work`` (from ``begin``); return ``work``.

        The task is the session's (closing waits for it) and lingers through the
        end of its loop (peers take part in it). It stops when ``work`` is settled
        by someone else (its deadline, a member's abort). ``on_end()`` runs once
        the task is over, however it ended, also when ``work`` was failed before
        ``op`` ever ran: what the operation holds (a turn on shared memory) is
        released there, not when the handle settles, since ``op`` may still be
        unwinding then.

        :meta private:
        """
        if work.is_completed():  # a member aborted the call
            if on_end is not None:
                on_end()
            return work
        loop = work.loop
        assert loop is not None
        task = LingeringTask(self._run(work, op, seq, collective), loop=loop)
        self.spawn(task)
        if on_end is not None:
            task.add_done_callback(lambda _: on_end())
        work.when_done(lambda w: _stop(task, w))
        return work

    def start(
        self,
        description: str,
        op: Callable[[int], Awaitable[T]],
        *,
        collective: bool = True,
        seq: int | None = None,
        on_end: Callable[[], object] | None = None,
    ) -> Work[T]:
        """``begin`` then ``drive``: run ``op(seq)`` as this group's operation ``seq``.

        ``seq`` None takes the next number now (point-to-point: its own numbering).

        :meta private:
        """
        if seq is None and collective:
            seq = self.take_seq()
        work = self.begin(description, collective=collective, seq=seq)
        return self.drive(work, op, seq or 0, collective=collective, on_end=on_end)

    async def _run(
        self, work: Work[T], op: Callable[[int], Awaitable[T]], seq: int, collective: bool
    ) -> None:
        try:
            result = await op(seq)
        except asyncio.CancelledError:
            if work.is_completed():
                return  # settled by its deadline or an abort, which stopped us
            work.set_exception(asyncio.CancelledError(f"{work.description} was cancelled"))
            raise
        except BaseException as exc:
            self.fail(work, exc, collective=collective)
            if not isinstance(exc, Exception):
                raise
        else:
            work.set_result(result)

    def fail(self, work: Work[Any], exc: BaseException, *, collective: bool) -> None:
        """End ``work`` with ``exc`` by the group's rules (a failed collective breaks the group).

        :meta private:
        """
        if work.is_completed():
            return  # timed out, or failed by the group's error already
        if isinstance(exc, AbortedError):  # a member aborted this call: the group stays usable
            work.set_exception(exc)
            return
        if isinstance(exc, DistError):  # before TimeoutError: DistTimeoutError is one too
            if collective:
                # Tell the group's members why (a rank dying breaks a ring in several
                # places; the first cause should reach everyone, not a later symptom).
                self.break_(exc)
                if isinstance(exc, GroupBrokenError) and self.error is not None:
                    exc = self.error  # the group's first error: the same on every member
        elif isinstance(exc, TimeoutError):  # an op's own wait ran out: the group's timeout rules
            exc = DistTimeoutError(
                f"{work.description} on group {self.name!r} timed out ({exc or 'no answer'}); "
                "a rank may not have called it, or may be stuck. The group is broken."
            )
            self.break_(exc)
        elif collective and isinstance(exc, Exception) and self.error is None:
            # Peers wait on this rank's part: tell them instead of letting them hang.
            self.break_(
                GroupBrokenError(
                    f"{work.description} on group {self.name!r} failed on rank "
                    f"{self.session.rank}: {type(exc).__name__}: {exc}; the group is "
                    "broken. Restart the job."
                )
            )
        work.set_exception(exc)

    def expired(self, work: Work[Any], seq: int) -> None:
        """``work`` passed the group's timeout (``Deadlines``): fail it, break the group.

        A collective first asks the server who it waits for (``stalls.py``, briefly).

        :meta private:
        """
        if seq and not self.session.conn.closed:
            self._spawn(self._expire_named(work, seq))
        else:
            self._expire(work, "")

    async def _expire_named(self, work: Work[Any], seq: int) -> None:
        session = self.session
        where = await stalls.where_others_are(session.conn, session.group_name, self.name, seq)
        self._expire(work, where)

    def _expire(self, work: Work[Any], where: str) -> None:
        if work.is_completed():
            return
        said = f" Where the ranks are: {where}." if where else ""
        timed_out = DistTimeoutError(
            f"Timed out: {work.description} on group {self.name!r} timed out after "
            f"{self.timeout:.1f} s (the timeout given to init_process_group or new_group); "
            "a rank may not have called it, or may be stuck."
            f"{said} The group is broken."
        )
        work.set_exception(timed_out)
        self.break_(timed_out)

    def take_seq(self) -> int:
        """Take this call's place in the group's order, before checking anything else.

        Whatever happens next on this rank, the call must then either start an
        operation with that number or ``abort`` it, so that every rank keeps the
        same numbering (see the module's docstring).

        Raises:
            DistError, ValueError: The group is unusable here (broken, closed, or
                this rank is no member); no number was taken.

        :meta private:
        """
        self.check_usable()
        return self.next_seq()

    def abort(self, seq: int, description: str, exc: BaseException, *, torch: bool = False) -> None:
        """This rank's call ``seq`` failed before it sent anything: fail it on every member.

        The caller re-raises ``exc`` on this rank; the other members' call
        ``seq`` fails with ``AbortedError`` naming this rank and ``exc``. With
        ``torch`` (the others may have issued their part to torch.distributed,
        which cannot leave one rank's part out), the group breaks instead.

        :meta private:
        """
        if self.error is not None or self.closed:
            return  # every member fails its calls with the group's error anyway
        me = self.session.rank
        reason = f"{type(exc).__name__}: {exc}"
        if torch:
            self.break_(
                GroupBrokenError(
                    f"{description} failed on rank {me} before it was issued ({reason}); "
                    "torch.distributed cannot leave out one rank's part of a collective, so "
                    f"group {self.name!r} is broken on every rank. Fix that rank's call and "
                    "restart the job."
                )
            )
            return
        aborted = AbortedError(
            f"{description} failed on rank {me} before that rank sent its part ({reason}); "
            f"this call (number {seq} of group {self.name!r}) fails on every rank and the "
            "group stays usable. Fix that rank's call.",
            rank=me,
            reason=reason,
        )
        self.session.plane.drop_call(self.group_id, seq, aborted)
        details = {**aborted.wire_details(), "seq": seq}
        header = message_header(PeerError(self.group_id, ErrorCode.ABORTED, str(aborted), details))
        plane = self.session.plane
        for rank in self.ranks:
            if rank != me:  # written now: this rank's next messages cannot overtake it
                plane.send_notice(rank, PeerError.KIND, header)

    def abort_remote(self, seq: int, exc: AbortedError) -> None:
        """A member aborted call ``seq``: fail it here, now if it runs, else when it is made.

        :meta private:
        """
        if seq > self._seq:
            self._aborted[seq] = exc  # not made here yet
        for work in self.deadlines.running_call(seq):
            work.set_exception(exc)  # its callbacks then stand down, its task stops
        self.session.plane.drop_call(self.group_id, seq, exc)

    def next_seq(self) -> int:
        """Take the group's next sequence number (from any thread).

        :meta private:
        """
        seq = self._seq = next(self._seqs)
        return seq

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def job_rank_of(self, rank: object, name: str) -> int:
        """``global_rank(group_rank_of(rank, name))``: the job rank of member ``rank``.

        Raises:
            TypeError, ValueError: As ``group_rank_of``.

        :meta private:
        """
        if type(rank) is int and self.session.numbering is None:
            # Global ranks are job ranks (not renumbered): a member names itself.
            if rank in (self.ranks if self._index is None else self._index):
                return rank
        return self.ranks[self.group_rank_of(rank, name)]

    def group_rank_of(self, rank: object, name: str) -> int:
        """The group rank of global ``rank``: ``src``/``dst`` are global ranks, as in torch.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is not a member of this group.

        :meta private:
        """
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise ArgumentTypeError(f"{name} must be an int rank, got {type(rank).__name__}")
        if (numbering := self.session.numbering) is not None:
            # The default group was shrunk: global ranks are renumbered, as in torch.
            if not 0 <= rank < len(numbering):
                raise ArgumentError(
                    f"{name}={rank} is not a global rank: the default group has "
                    f"{counted(len(numbering), 'rank')} since shrink_group renumbered them"
                )
            rank = numbering[rank]
        index = self._index
        if index is None:  # a range
            if rank in self.ranks:
                return self.ranks.index(rank)
        elif rank in index:
            return index[rank]
        raise ArgumentError(
            f"{name}={rank} is not a member of {self!r} (its global ranks: "
            f"{_ranges(self.ranks)}); {name} is a global rank, as in torch.distributed"
        )

    def size(self) -> int:
        """Number of ranks in the group (torch's ``ProcessGroup.size()``)."""
        return self.world_size

    def monitored_barrier(
        self, timeout: float | timedelta | None = None, wait_all_ranks: bool = False
    ) -> Work[None]:
        """torch's ``ProcessGroup.monitored_barrier``: ``monitored_barrier(self, timeout)``.

        In async code it returns the running ``Work`` (await it); in plain code
        (``aiodist.sync``) it blocks until every member arrived and raises as
        torch's does, naming the ranks that never came (then returns the ``Work``, done).
        """
        return self.methods.monitored_barrier(self, timeout, wait_all_ranks)

    def allreduce(self, tensors: Any, opts: Any = None) -> Work[Any]:
        """torch's ``ProcessGroup.allreduce``: ``all_reduce(tensor, op, group=self)``, started.

        ``tensors`` is one tensor or a list of one; ``opts`` torch's
        ``AllreduceOptions`` or a ``ReduceOp`` (sum if None). It returns the
        running ``Work`` from plain and async code alike, as torch's does
        (``.get_future()``, ``.wait()``, or ``await`` it).
        """
        return self.methods.allreduce(self, tensors, opts)

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name!r} rank {self.rank} of {self.world_size}>"

    @property
    def backend(self) -> str | None:
        return self.group_backend or self.session.backend

    @property
    def store(self) -> Store:
        return self.session.store


def _stop(task: asyncio.Task[Any], work: Work[Any]) -> None:
    # Its handle failed (its deadline, an abort, a callback of its own exchange): the task
    # must not outlive it, even when the failure came from inside the task itself (it then
    # stops at its next await). A handle settled with a result was settled by the task.
    if not task.done() and work.exception() is not None:
        task.cancel()


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``: short even for large groups."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
