"""A worker of master-worker mode: it holds the master's tensors and runs its orders.

Orders (``_remote.orders``) arrive in batches from the master, in issue order.
Each stream is a queue with one task running its orders one after the other;
orders not on a stream (``FREE``, ``NOTIFY``, ``SYNC``, ``STOP``) are handled
as they arrive. A tensor is dropped once the master freed it and no queued
order still uses it. An operation that fails leaves its error in place of its
outputs: an operation using one of them fails with the same error, and a
fetch raises it on the master, as does the next ``synchronize``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections import Counter
from typing import TYPE_CHECKING, Any

import anyio
import torch
from torch.utils._pytree import tree_flatten

from aiodist._errors import RankFailedError, RemoteError
from aiodist._ops.p2p_objects import Tag, receive_object, send_object
from aiodist._remote.orders import EVENT, TENSOR, Kind, Moved, Ref, flatten

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from aiodist._group.group import ProcessGroup

logger = logging.getLogger("aiodist.remote")

#: The master's rank.
MASTER = 0
#: Seconds a stream runs its queued operations before it lets the rest of the loop run.
TURN = 0.002
#: Errors kept for the next ``synchronize`` (the first ones: each fails what uses it anyway).
MAX_UNREPORTED = 64


class _Failed(Exception):
    """An input of an operation is the error of an earlier one."""

    def __init__(self, error: RemoteError) -> None:
        self.error = error


class Worker:
    def __init__(self, g: ProcessGroup, tg: anyio.abc.TaskGroup) -> None:
        self.g = g
        self.me = g.session.rank
        self._tg = tg
        self._loop = asyncio.get_running_loop()
        self.tensors: dict[int, Any] = {}
        self.errors: dict[int, RemoteError] = {}
        self._uses: Counter[int] = Counter()  # queued orders that use each tensor
        self._freed: set[int] = set()
        self._streams: dict[int, asyncio.Queue[tuple[Any, list[int]]]] = {}
        # Transfers and event notices from other workers, by id: (the sender, its future).
        self._arriving: dict[int, tuple[int, asyncio.Future[Any]]] = {}
        self._noticed: dict[int, tuple[int, asyncio.Future[None]]] = {}
        self._reached: dict[int, asyncio.Future[None]] = {}  # events of this worker
        self._to_notify: dict[int, list[tuple[int, int | None]]] = {}
        self._unreported: list[RemoteError] = []
        g.session.on_member_gone.append(self._gone)

    # --- orders as they arrive ---------------------------------------------------------------

    async def serve(self) -> None:
        """Run the master's orders until it says stop."""
        while True:
            batch = await receive_object(
                self.g, MASTER, Tag.REMOTE_ORDERS, with_sender=False, timed=False
            )
            for order in batch:
                kind = order[0]
                if kind == Kind.FREE:
                    self._free(order[1])
                elif kind == Kind.NOTIFY:
                    self._notify(order[1], order[2], order[3])
                elif kind == Kind.QUERY:
                    reached = self._reached.get(order[1])
                    self._reply(order[2], reached is not None and reached.done(), None)
                elif kind == Kind.STOP:
                    await self._drained()
                    self._reply(order[1], None, None)
                    return
                elif kind == Kind.SYNC or kind == Kind.HELD:
                    # Answered once the streams got here; meanwhile orders go on arriving.
                    self._tg.start_soon(self._answer, kind, order[1], self._drained())
                else:
                    self._queue(order)

    def _queue(self, order: tuple[Any, ...]) -> None:
        kind, stream = order[0], order[1]
        if kind == Kind.OP:
            leaves = flatten(order[3], order[4])[0]
            used = [x.id for x in leaves if isinstance(x, Ref)]
            used += [i for i in order[5] if i is not None]
            for x in leaves:
                if isinstance(x, Moved):
                    self._expect(self._arriving, x.transfer, x.src)
        elif kind in (Kind.PUSH, Kind.FETCH):
            used = [order[2]]
        else:
            used = []
            if kind == Kind.WAIT and order[3] != self.me:
                self._expect(self._noticed, order[2], order[3])
        self._uses.update(used)
        queue = self._streams.get(stream)
        if queue is None:
            queue = self._streams[stream] = asyncio.Queue()
            self._tg.start_soon(self._run_stream, queue)
        queue.put_nowait((order, used))

    def _expect(
        self, table: dict[int, tuple[int, asyncio.Future[Any]]], key: int, src: int
    ) -> None:
        if key not in table:
            future = self._loop.create_future()
            table[key] = (src, future)
            error = self.g.session.failed_ranks.get(src)
            if error is not None:
                future.set_exception(error)

    def _drained(self) -> Awaitable[Any]:
        """Done once every stream ran what is queued on it now."""
        marks = []
        for queue in self._streams.values():
            mark: asyncio.Future[None] = self._loop.create_future()
            queue.put_nowait(((None, mark), []))
            marks.append(mark)
        return asyncio.gather(*marks)

    async def _answer(self, kind: Kind, request: int, drained: Awaitable[Any]) -> None:
        await drained
        if kind == Kind.HELD:
            self._reply(request, len(self.tensors) + len(self.errors), None)
        else:
            errors, self._unreported = self._unreported, []
            self._reply(request, errors, None)

    # --- a stream's orders, one after the other ----------------------------------------------

    async def _run_stream(self, queue: asyncio.Queue[tuple[Any, list[int]]]) -> None:
        clock = self._loop.time
        turn = clock()
        while True:
            if clock() - turn > TURN:  # let the orders that come in, and other streams, go on
                await asyncio.sleep(0)
                turn = clock()
            order, used = await queue.get()
            try:
                kind = order[0]
                if kind is None:
                    order[1].set_result(None)
                elif kind == Kind.OP:
                    await self._op(*order[1:])
                elif kind == Kind.PUSH:
                    self._push(order[2], order[3], order[4])
                elif kind == Kind.FETCH:
                    self._fetch(order[2], order[3])
                elif kind == Kind.RECORD:
                    self._record(order[2])
                elif kind == Kind.WAIT:
                    await self._wait(order[2], order[3])
            finally:
                self._release(used)

    async def _op(
        self,
        stream: int,
        func: Any,
        args: Any,
        kwargs: Any,
        outs: list[int | None],
        whole: bool,
        what: str,
    ) -> None:
        try:
            args, kwargs = await self._inputs(args, kwargs)
            result = func(*args, **kwargs)
        except _Failed as failed:
            error = failed.error
        except Exception as exc:
            error = RemoteError(
                f"{what} failed on worker {self.me}: {type(exc).__name__}: {exc}",
                rank=self.me,
                exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                remote_traceback=traceback.format_exc(),
            )
            if len(self._unreported) < MAX_UNREPORTED:
                self._unreported.append(error)
        else:
            if whole or isinstance(result, torch.Tensor):
                values = [result]
            else:
                values = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
            for i, value in zip(outs, values, strict=False):
                if i is not None:
                    self.tensors[i] = value
            return
        for i in outs:
            if i is not None:
                self.errors[i] = error

    async def _inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves, rebuild = flatten(args, kwargs)
        values = []
        for x in leaves:
            if isinstance(x, Ref):
                x = self._tensor(x.id)
            elif isinstance(x, Moved):
                transfer = x.transfer
                _, future = self._arriving[transfer]
                try:
                    x = await future
                finally:
                    self._arriving.pop(transfer, None)
            values.append(x)
        return rebuild(values)

    def _tensor(self, i: int) -> Any:
        error = self.errors.get(i)
        if error is not None:
            raise _Failed(error)
        return self.tensors[i]

    def _push(self, i: int, dst: int, transfer: int) -> None:
        message: tuple[Any, ...]
        try:
            t = self._tensor(i)
        except _Failed as failed:
            message = (TENSOR, transfer, None, "", failed.error)
        else:
            message = (TENSOR, transfer, t.detach().cpu(), str(t.device), None)
        self._send(dst, Tag.REMOTE_TRANSFERS, message)

    def _fetch(self, i: int, request: int) -> None:
        try:
            t = self._tensor(i)
        except _Failed as failed:
            self._reply(request, None, failed.error)
        else:
            self._reply(request, t.detach().cpu() if isinstance(t, torch.Tensor) else t, None)

    def _record(self, event: int) -> None:
        reached = self._event(event)
        if not reached.done():
            reached.set_result(None)
        for node, request in self._to_notify.pop(event, []):
            self._tell(event, node, request)

    def _event(self, event: int) -> asyncio.Future[None]:
        future = self._reached.get(event)
        if future is None:
            future = self._reached[event] = self._loop.create_future()
        return future

    async def _wait(self, event: int, node: int) -> None:
        if node == self.me:
            await self._event(event)
            return
        _, future = self._noticed[event]
        with contextlib.suppress(Exception):  # a dead recorder: the stream goes on
            await future

    def _notify(self, event: int, node: int, request: int | None) -> None:
        future = self._reached.get(event)
        if future is not None and future.done():
            self._tell(event, node, request)
        else:
            self._to_notify.setdefault(event, []).append((node, request))

    def _tell(self, event: int, node: int, request: int | None) -> None:
        if node == MASTER:
            self._reply(request, None, None)
        else:
            self._send(node, Tag.REMOTE_TRANSFERS, (EVENT, event))

    # --- what other ranks send ---------------------------------------------------------------

    async def receive_transfers(self) -> None:
        while True:
            message, src = await receive_object(
                self.g, None, Tag.REMOTE_TRANSFERS, with_sender=True, timed=False
            )
            if message[0] == TENSOR:
                _, transfer, t, device, error = message
                self._expect(self._arriving, transfer, src)
                _, future = self._arriving[transfer]
                if future.done():
                    continue
                if error is not None:
                    future.set_exception(_Failed(error))
                else:
                    future.set_result(t if device == "cpu" else t.to(device))
            else:
                self._expect(self._noticed, message[1], src)
                _, notice = self._noticed[message[1]]
                if not notice.done():
                    notice.set_result(None)

    def _gone(self, rank: int) -> None:
        """A rank failed: what it was to send here fails with its error."""
        error = self.g.session.failed_ranks.get(rank) or RankFailedError(
            f"rank {rank} failed", rank=rank
        )
        for table in (self._arriving, self._noticed):
            for src, future in table.values():
                if src == rank and not future.done():
                    future.set_exception(error)

    # --- bookkeeping --------------------------------------------------------------------------

    def _free(self, ids: list[int]) -> None:
        for i in ids:
            if self._uses[i]:
                self._freed.add(i)
            else:
                self._drop(i)

    def _release(self, used: list[int]) -> None:
        for i in used:
            self._uses[i] -= 1
            if self._uses[i] <= 0:
                del self._uses[i]
                if i in self._freed:
                    self._freed.discard(i)
                    self._drop(i)

    def _drop(self, i: int) -> None:
        self.tensors.pop(i, None)
        self.errors.pop(i, None)

    def _reply(self, request: int | None, value: Any, error: BaseException | None) -> None:
        self._send(MASTER, Tag.REMOTE_REPLIES, (request, value, error))

    def _send(self, dst: int, tag: int, message: Any) -> None:
        work = send_object(self.g, dst, tag, message)
        work.when_done(_log_failed_send)


def _log_failed_send(work: Any) -> None:
    error = work.exception()
    if error is not None:
        logger.info("master-worker: %s failed: %s", work.description, error)


async def serve(g: ProcessGroup) -> None:
    """Serve the master's orders on this worker until it ends the job.

    Raises:
        RankFailedError: The master failed.
    """
    async with anyio.create_task_group() as tg:
        worker = Worker(g, tg)
        tg.start_soon(worker.receive_transfers)
        try:
            await worker.serve()
        finally:
            g.session.on_member_gone.remove(worker._gone)
            tg.cancel_scope.cancel()
