"""The messages of one collective: one callback-driven exchange, and its awaitable form.

An ``Exchange`` is operation ``seq`` of a group, as its messages see it. Its
messages carry the key ``(COLLECTIVE, group_id, seq, step)``: ``step`` tells
apart the messages one pair exchanges within the operation. Their ``meta`` is
the sender's signature, checked on arrival (``agreement``).

The primitive is callback-driven, as the data plane is: ``post`` a receive and
get the message, checked, in a callback; ``send_now`` writes at once, and a
send the kernel did not take whole finishes in a task of the group's, which
calls back when done. The
small collectives run on these alone, with no task and no coroutine. The
awaitable forms, ``recv`` (a future) and ``send``, are derived from them here,
once, for algorithms written as coroutines. Either way, a message with another
signature, a failed peer or an error in a callback fails the operation by the
group's rules (``ProcessGroup.fail``): a failed collective breaks its group on
every member, which fails every receive still posted; a task driving the
operation stops then too.

Every exchange opens with the agreement (``agreement``). ``rides=True`` says
the algorithm's own messages carry it: it sends to ``r + 1`` and posts from
``r - 1`` at step ``OPEN`` before it waits for anything, and a rank is done
only once every rank's data reached it (an all-reduce, an all-gather, a
barrier). One-way operations (broadcast, gather, scatter, reduce, and their
object forms) do not hear from every rank: their exchange runs the agreement
beside their data, a barrier on the signature (``exchange_rows`` of no bytes,
round 0 at ``OPEN``, later rounds at ``AGREE + k``), and the algorithm numbers
its own steps from 1. Used as ``async with``, an exchange returns only once
that barrier passed, so no rank reports success for a call another rank made
differently.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ProtocolError
from aiodist._group.lingering import linger
from aiodist._ops import agreement, board, schedules
from aiodist._ops.agreement import AGREE, OPEN
from aiodist._wire.keys import MatchKind

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import TracebackType

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.agreement import Signature
    from aiodist._plane.receives import Received
    from aiodist._wire.frame import Buffer


class Exchange:
    """The messages of operation ``seq`` of ``g``, whose handle is ``work``.

    Ranks are group ranks. ``mine`` is this rank's signature (``agreement``).
    """

    __slots__ = ("_opening", "_plane", "_ranks", "_session", "g", "mine", "seq", "work")

    def __init__(
        self,
        g: ProcessGroup,
        work: Work[Any],
        seq: int,
        mine: Signature,
        *,
        rides: bool,
    ) -> None:
        self.g, self.work, self.seq, self.mine = g, work, seq, mine
        self._session = session = g.session
        self._plane = session.plane
        self._ranks = g.ranks
        self._opening: asyncio.Future[None] | None = None
        if not rides and g.world_size > 1:
            self._open()

    def fail(self, exc: BaseException) -> None:
        """End the operation with ``exc`` by the group's rules."""
        self.g.fail(self.work, exc, collective=True)

    # --- the primitive: callbacks ----------------------------------------------------------------

    def post(
        self,
        src: int,
        step: int,
        dest: memoryview | None,
        then: Callable[[Received], None],
    ) -> None:
        """Post the receive of ``step`` from ``src``; ``then(msg)`` once it is in and agrees.

        A payload of ``dest``'s size lands in ``dest``. ``then`` runs in the data
        plane's callback (or here, if the message came first); what it raises
        fails the operation. Nothing is posted once the operation is over.
        """
        work = self.work
        if work.is_completed():
            return
        g, session = self.g, self._session
        if g.error is not None or g.closed or session.error is not None or session.closed:
            # Broken (or gone) already: a receive posted now would never be failed.
            try:
                g.check_usable()
            except Exception as exc:
                self.fail(exc)
                return
        mine = self.mine

        def arrived(msg: Received | BaseException) -> None:
            if work.is_completed():
                return  # failed already: say no more
            try:
                if isinstance(msg, BaseException):
                    raise msg
                if msg.meta != mine:  # the usual equal signature needs no call
                    agreement.check(g, mine, msg)
                then(msg)
            except Exception as exc:
                self.fail(exc)

        key = (MatchKind.COLLECTIVE, g.group_id, self.seq, step)
        self._plane.post(self._ranks[src], key, dest, arrived)

    def send_now(
        self,
        dst: int,
        step: int,
        payload: Buffer | None,
        later: Callable[[], None] | None = None,
        *,
        extra: Any = None,
    ) -> bool:
        """Send ``payload`` to ``dst`` as ``step``: True once written, else it finishes in a task.

        A send the kernel did not take whole finishes in a task of the group's,
        which calls ``later()`` once the payload may be reused. ``extra`` rides
        after the signature (what differs from pair to pair).
        """
        meta = self.mine if extra is None else [*self.mine, extra]
        key = (MatchKind.COLLECTIVE, self.g.group_id, self.seq, step)
        rest = self._plane.send_now(self._ranks[dst], key, meta, payload)
        if rest is None:
            return True
        self.g.spawn(linger(self._finish(rest, later)))
        return False

    async def _finish(self, rest: Awaitable[None], then: Callable[[], None] | None) -> None:
        try:
            await self._rest(rest)
        except Exception as exc:
            self.fail(exc)
        else:
            if then is not None:
                then()

    async def _rest(self, rest: Awaitable[None]) -> None:
        try:
            await rest
        except ConnectionError:
            # A peer that found the group broken tells every member, then may leave while a
            # large payload to it is still being written: report the group's error then.
            self.g.check_usable()
            raise

    # --- the awaitable form, derived ---------------------------------------------------------

    def recv(self, src: int, step: int, dest: memoryview | None = None) -> asyncio.Future[Received]:
        """``post``, as a future of the message (it never resolves if the operation fails:
        the task driving it is stopped then)."""
        future: asyncio.Future[Received] = asyncio.get_running_loop().create_future()

        def got(msg: Received) -> None:
            if not future.done():
                future.set_result(msg)

        self.post(src, step, dest, got)
        return future

    async def send(self, dst: int, step: int, payload: Buffer | None, *, extra: Any = None) -> None:
        """``send_now``, awaited: returns once ``payload`` may be reused."""
        meta = self.mine if extra is None else [*self.mine, extra]
        key = (MatchKind.COLLECTIVE, self.g.group_id, self.seq, step)
        rest = self._plane.send_now(self._ranks[dst], key, meta, payload)
        if rest is not None:
            await self._rest(rest)

    # --- the opening ---------------------------------------------------------------------------

    def _open(self) -> None:
        # The agreement of a one-way operation: a barrier on the signature, beside its data.
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._opening = future
        exchange_rows(self, memoryview(b""), lambda _: future.set_result(None), later=AGREE)

    async def agreed(self) -> None:
        """Return once every rank's signature is known to match (at once if the opening rode)."""
        if self._opening is not None:
            await self._opening

    async def __aenter__(self) -> Exchange:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.agreed()


# --- rows: every rank's few bytes, everywhere -------------------------------------------------

#: Up to this many ranks, ``exchange_rows`` swaps in one round, everyone with everyone.
ONE_ROUND_MAX_RANKS: Final = 2
#: Up to this many ranks (above ``ONE_ROUND_MAX_RANKS``), ``exchange_rows`` goes through
#: group rank 0: ``2 (size - 1)`` messages in all instead of ``size log2 size``.
STAR_MAX_RANKS: Final = 16


def exchange_rows(
    ex: Exchange,
    data: memoryview,
    done: Callable[[memoryview], None],
    *,
    step: int = OPEN,
    later: int | None = None,
    fold: Callable[[memoryview], memoryview] | None = None,
) -> None:
    """Swap ``data`` with every rank of ``ex``'s group, with no task; then ``done(rows)``.

    The path of small all_reduces, of barriers (no bytes), of metric syncs and
    of the agreement of one-way operations. Group rank ``r``'s bytes land in
    row ``r`` of a ``size x data.nbytes`` staging buffer (this rank's row is a
    copy of ``data``, which may change from now on). Once every row is in and
    every send was handed to the kernel, ``done(staging)`` runs.

    When every rank of the group runs on one host with shared memory on, an
    exchange opened at ``OPEN`` goes through the group's board instead, with no
    message (``board``). Over sockets:

    Up to ``ONE_ROUND_MAX_RANKS`` ranks swap in one round, every rank
    with every other one. Up to ``STAR_MAX_RANKS`` go through group rank 0:
    every other rank sends it its row, and once all are in it sends every rank
    all the rows (``2 (size - 1)`` messages in all, one each way for the
    others). Larger groups take ``log2 size`` rounds (Bruck's all-gather; with
    no bytes, the dissemination barrier): in round ``k`` a rank sends the rows
    it holds (its own, then those of the ranks before it, up to ``2**k`` of
    them) to rank ``r + 2**k`` and gets as many from rank ``r - 2**k`` (modulo
    the size), and starts round ``k + 1`` once round ``k``'s message is in.
    Either way a rank is done only once it heard, directly or through rank 0 or
    the rounds, from every rank: every signature was checked on the way (rank
    0 checks every rank's; the others check rank 0's, which rank 0 sends only
    once every rank agreed with it).

    Why the star up to ``STAR_MAX_RANKS``: a small exchange costs each rank
    mostly the Python that handles each message, not the bytes. The rounds
    cost ``size log2 size`` messages handled, the star ``2 (size - 1)``, on
    the critical path two hops and rank 0's handling of ``2 (size - 1)``
    messages against ``log2 size`` hops. With more ranks than cores (ranks of
    one host, a busy machine), the total is what the wait is: at 8 ranks on 2
    quiet cores a 4-byte all_reduce took 0.65-0.9 ms instead of 1.0-1.5 ms,
    a barrier 0.3-0.5 ms instead of 0.5-1.1 ms
    (``benchmarks/bench_collectives.py --small``); at 3 ranks (4 messages
    instead of 6) a barrier 94-108 us instead of 121-200 us.

    Round 0 uses ``step`` (``OPEN``: it carries the opening) and round ``k``
    ``later + k`` (``step + k`` if ``later`` is None).

    ``fold`` (an all_reduce's reduction) turns the rows into one row of
    ``data.nbytes``, which ``done`` then gets instead of the rows. Through
    rank 0, only rank 0 folds, and sends the others its result instead of the
    rows: they fold nothing, and every rank ends with rank 0's bytes.
    """
    if step == OPEN and board.take(ex, data, done, fold, later, _over_sockets):
        return  # every rank of the group on one host: through shared memory (``board``)
    _over_sockets(ex, data, done, step=step, later=later, fold=fold)


def _over_sockets(
    ex: Exchange,
    data: memoryview,
    done: Callable[[memoryview], None],
    *,
    step: int = OPEN,
    later: int | None = None,
    fold: Callable[[memoryview], memoryview] | None = None,
) -> None:
    p = ex.g.world_size
    later = step if later is None else later
    if p > STAR_MAX_RANKS:
        _in_rounds(_Rows(ex, data, done, 1, fold), step, later)
    elif p > ONE_ROUND_MAX_RANKS:
        _through_root(_Rows(ex, data, done, 1, fold), step, later)
    else:
        # Receives still to come, plus one for this rank's sends: however many messages
        # were waiting already, ``done`` runs only once every send went out.
        _in_one_round(_Rows(ex, data, done, p, fold), step)


class _Rows:
    """One exchange's staging rows, and the countdown to ``done``."""

    __slots__ = ("_done", "_left", "ex", "fold", "folded", "n", "staging")

    def __init__(
        self,
        ex: Exchange,
        data: memoryview,
        done: Callable[[memoryview], None],
        left: int,
        fold: Callable[[memoryview], memoryview] | None,
    ) -> None:
        n = data.nbytes
        self.ex, self.n = ex, n
        self.staging = staging = memoryview(bytearray(ex.g.world_size * n))
        me = ex.g.rank
        staging[me * n : (me + 1) * n] = data  # this rank's row
        self._done = done
        self._left = left  # what is still to come before done may run
        self.fold = fold
        self.folded: memoryview | None = None  # the fold's result, made (or received) once

    def row(self, r: int) -> memoryview:
        return self.staging[r * self.n : (r + 1) * self.n]

    def one_more(self) -> None:
        self._left += 1

    def one_less(self, _: object = None) -> None:
        """One thing less to wait for (a message in, a send finished)."""
        self._left -= 1
        if self._left == 0 and not self.ex.work.is_completed():
            try:
                if self.fold is None:
                    self._done(self.staging)
                else:
                    folded = self.folded
                    self._done(self.fold(self.staging) if folded is None else folded)
            except Exception as exc:
                self.ex.fail(exc)

    def send(self, dst: int, step: int, payload: memoryview | bytes | None) -> None:
        if not self.ex.send_now(dst, step, payload, self.one_less):
            self.one_more()  # until the kernel took it all (the task calls one_less)


def _in_one_round(rows: _Rows, step: int) -> None:
    ex, staging, n = rows.ex, rows.staging, rows.n
    p, me = ex.g.world_size, ex.g.rank
    one_less = rows.one_less
    for r in range(p):
        if r != me:
            ex.post(r, step, staging[r * n : (r + 1) * n], one_less)
    mine = staging[me * n : (me + 1) * n]
    for r in schedules.direct_peers(me, p):
        if ex.work.is_completed():
            return  # failed already (a mismatched message was waiting): say no more
        rows.send(r, step, mine)
    one_less()  # every send went out, or is finishing in a task that counts itself


def _in_rounds(rows: _Rows, step: int, later: int) -> None:
    ex, n = rows.ex, rows.n
    p, me = ex.g.world_size, ex.g.rank
    plan = schedules.dissemination_partners(me, p)

    def round_(k: int) -> None:
        if ex.work.is_completed():
            return  # failed already: say no more
        if k == len(plan):
            rows.one_less()
            return
        to, frm = plan[k]
        count = min(1 << k, p - (1 << k))  # rows held before this round: 2**k
        held = [rows.row((me - i) % p) for i in range(count)]
        at = later + k if k else step
        rows.send(to, at, b"".join(held) if n else None)

        def arrived(got: Received) -> None:
            if got.data.nbytes != count * n:
                raise ProtocolError(f"{got.data.nbytes} bytes where {count * n} belong")
            for i in range(count):  # the rows of frm, frm - 1, ...
                rows.row((frm - i) % p)[:] = got.data[i * n : (i + 1) * n]
            round_(k + 1)

        ex.post(frm, at, memoryview(bytearray(count * n)), arrived)

    round_(0)


def _through_root(rows: _Rows, step: int, later: int) -> None:
    """Every row to group rank 0 at ``step``; all of them (or their fold) back at ``later + 1``."""
    ex, n = rows.ex, rows.n
    p, me = ex.g.world_size, ex.g.rank
    if me:
        rows.send(0, step, rows.row(me))
        back_n = p * n if rows.fold is None else n
        into = rows.staging if rows.fold is None else memoryview(bytearray(n))

        def back(got: Received) -> None:
            if got.data.nbytes != back_n:
                raise ProtocolError(f"{got.data.nbytes} bytes where {back_n} belong")
            if rows.fold is not None:
                rows.folded = got.data
            rows.one_less()

        ex.post(0, later + 1, into if n else None, back)
        return
    left = p - 1

    def arrived(_: Received) -> None:
        nonlocal left
        left -= 1
        if left:
            return
        out = rows.staging
        if rows.fold is not None:
            try:
                out = rows.folded = rows.fold(out)
            except Exception as exc:
                ex.fail(exc)
                return
        for r in range(1, p):
            if ex.work.is_completed():
                return
            rows.send(r, later + 1, out if n else None)
        rows.one_less()

    staging = rows.staging
    for r in range(1, p):
        ex.post(r, step, staging[r * n : (r + 1) * n], arrived)
