"""A rank's rpc agent: remote calls over the job's data plane (``aiodist.rpc``'s internals).

One ``Agent`` per session makes calls (here and ``calls``) and serves them (``serve``),
keeps the objects RRefs name (``rref``) and runs ``rpc.shutdown``
(``shutdown``); ``wire`` has the messages. It starts with the
session's default group (``init_process_group``), or on first use for a group
opened otherwise, and stops when the session closes; nothing of it outlives
the session: its tasks (calls being served, sends still under way) end there.

A call is **prepared** in the caller's thread (the destination checked, the
function and arguments encoded: an error there raises at once and sends
nothing) and **started** on the session's loop: its reply's receive is
posted, its request written, and a ``Work`` handle returned that the reply
settles (from the data plane's callback: no task per call on the caller).
From another thread (plain code, an executor thread) it is started on the
loop with ``call_soon_threadsafe`` and the handle returned at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, TypeVar, cast

from aiodist._errors import ClosedError, DistError, DistTimeoutError, RemoteError
from aiodist._group.inflight import Deadlines
from aiodist._group.work import Work, running_loop
from aiodist._rpc.calls import Call, Request
from aiodist._rpc.contexts import incoming
from aiodist._rpc.names import WorkerInfo, worker
from aiodist._rpc.rref import AGENTS, RRefId, decode, new_id
from aiodist._rpc.serve import Server
from aiodist._rpc.shutdown import Termination
from aiodist._rpc.wire import (
    REQUEST_KEY,
    RPC_GROUP,
    Op,
    Status,
    notify,
    rebuild_error,
    receive_parts,
    reply_key,
    send_parts,
    tensor_meta,
)
from aiodist._rpc.world import rpc_world
from aiodist._wire import codec
from aiodist._wire.keys import MatchKind

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    import torch

    from aiodist._group.session import Session
    from aiodist._plane.receives import Received

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Agent:
    """Remote calls of one session: made, served, shut down."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.plane = session.plane
        self.rank = session.rank
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()
        self.calls: dict[int, Call] = {}
        self.sent = 0  # calls made: rpc.shutdown's waves compare it
        self.closed = False  # the session closed
        self.shut_down = False  # rpc.shutdown completed (or was forced) here
        self.error: BaseException | None = None  # the session's failure
        self.default_timeout: float | None = session.timeout  # None: calls have none
        self._deadlines = Deadlines(self)
        self._ids = itertools.count(1)
        self._idle: list[asyncio.Future[None]] = []
        self.server = Server(self)
        self.termination = Termination(self)
        session.on_member_gone.append(self.termination.member_gone)

    # --- state --------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """The job's ranks so far (an elastic job admits newcomers with the next ranks)."""
        return self.session.world_size

    def check_usable(self) -> None:
        """Raise if this rank may not make calls (session broken or closed, rpc shut down)."""
        if self.closed:
            raise self.closed_reason()
        self.session.check_usable()
        if self.shut_down:
            raise self.closed_reason()

    def ranks_alive(self) -> list[int]:
        """The ranks that neither failed nor left (rpc.shutdown completes among them)."""
        return self.session.ranks_alive()

    def alone(self) -> bool:
        """Whether every other rank failed or left (shutdown needs no one's word then)."""
        return self.ranks_alive() == [self.rank]

    @property
    def timeout(self) -> float:
        """The calls' default timeout, for the ``Deadlines`` of the calls that take it."""
        assert self.default_timeout is not None
        return self.default_timeout

    def configure(self, timeout: float | None, threads: int | None) -> None:
        """Take ``init_rpc``'s options: the calls' default timeout (0: none), the rpc threads."""
        if timeout is not None:
            self.default_timeout = timeout or None
        if threads is not None:
            self.server.max_threads = threads

    def worker_info(self, rank: int) -> WorkerInfo:
        """Rank ``rank``'s ``WorkerInfo`` (named by ``init_rpc``, else ``rank<N>``)."""
        return worker(self.session, rank)

    def in_async_code(self) -> bool:
        """True in a task on this agent's loop: handles are ``Work``s to await there."""
        return threading.get_ident() == self.thread and asyncio.current_task(self.loop) is not None

    def closed_reason(self) -> ClosedError:
        if self.shut_down:
            why = "rpc.shutdown() completed there"
        else:
            why = f"its process group {self.session.group_name!r} was destroyed"
        return ClosedError(f"rank {self.rank} stopped serving remote calls: {why}")

    def maybe_idle(self) -> None:
        """Wake ``wait_idle`` if no call of this rank is pending and none is being served."""
        if self._idle and not self.calls and not self.server.running:
            waiters, self._idle = self._idle, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_idle(self) -> None:
        """Return once no call of this rank is pending and none is being served here."""
        if self.error is not None:
            raise self.error
        if not self.calls and not self.server.running:
            return
        waiter = self.loop.create_future()
        self._idle.append(waiter)
        await waiter

    def spawn_send(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Finish a send in a task the session owns: closing it lets the send complete."""
        task = self.loop.create_task(coro)
        inflight = self.session.inflight
        inflight.add(task)
        task.add_done_callback(inflight.discard)
        return task

    # --- making calls -------------------------------------------------------------------

    def launch(
        self, request: Request, then: Callable[[Work[Any]], object] | None = None
    ) -> Work[Any]:
        """Start ``request`` from any thread, ``then`` listening to its handle; its handle."""
        work: Work[Any] = Work.pending(self.loop, request.what)  # settled on the loop only
        if then is not None:
            work.when_done(then)  # not shared yet: safe here
        if threading.get_ident() == self.thread:
            return self.start(request, work)
        self.loop.call_soon_threadsafe(self._start_into, request, work)
        return work

    def call(self, request: Request) -> Any:
        """Start ``request`` from any thread; a ``Work`` in async code, else a torch Future."""
        if self.in_async_code():
            return self.launch(request)
        from aiodist._rpc.futures import Future, settle  # torch: plain code's only

        future: Future[Any] = Future(self.thread)
        self.launch(request, functools.partial(settle, future))
        return future

    def _start_into(self, request: Request, work: Work[Any]) -> None:
        try:
            self.start(request, work)
        except Exception as exc:
            work.set_exception(exc)

    def start(self, request: Request, work: Work[Any] | None = None) -> Work[Any]:
        """Start ``request`` (on the loop's thread); its handle (``work``, if given).

        Raises:
            DistError: This rank may not make calls (see ``check_usable``).
        """
        self.check_usable()
        if work is None:
            work = Work.pending(self.loop, request.what)
        call = next(self._ids)
        to = request.to
        record = Call(work, to, request.what, request.timeout, keep=request.keep)
        self.calls[call] = record
        self.sent += 1
        plane = self.plane
        plane.post(to, reply_key(call), None, functools.partial(self._replied, call))
        meta = [int(request.op), call, request.target, tensor_meta(request.tensors), request.extra]
        if request.grad is not None:
            meta.append(request.grad)
        try:
            rest = plane.send_now(to, REQUEST_KEY, meta, request.payload)
        except Exception as exc:  # the request could not even be framed
            self._abandon(call, exc)
            return work
        if rest is not None or request.tensors:
            record.sending = self.spawn_send(self._send_rest(call, rest, request.tensors))
        if request.timeout is not None and call in self.calls:  # (a self-call may be done)
            if request.timeout == self.default_timeout:
                self._deadlines.add(self.loop, work, call)
            else:
                record.timer = self.loop.call_later(request.timeout, self.expired, work, call)
        return work

    async def _send_rest(self, call: int, rest: Any, tensors: list[torch.Tensor]) -> None:
        record = self.calls.get(call)
        to = -1 if record is None else record.to
        try:
            if rest is not None:
                await rest
            if tensors:
                await send_parts(self.plane, to, call, tensors, request=True)
        except (OSError, DistError) as exc:  # the session judged whose fault it was
            self._abandon(call, exc)
        except Exception as exc:  # a fault of this rank's own: the call fails, never waits
            logger.error("sending %s to rank %d failed", record and record.what, to, exc_info=exc)
            self._abandon(call, exc)

    def _abandon(self, call: int, exc: BaseException) -> None:
        """The request never (fully) left: fail the call; no reply will come."""
        record = self.calls.pop(call, None)
        key = reply_key(call)
        for posted in self.plane.matcher.take_posted_where(lambda k: k == key):
            posted.callback = None  # taken back: nobody waits for it
        if record is not None:
            if record.timer is not None:
                record.timer.cancel()
            record.work.set_exception(exc)
        self.maybe_idle()

    def expired(self, work: Work[Any], call: int) -> None:
        """Call ``call`` (``work``) is past its timeout: fail it here, cancel it on its callee."""
        record = self.calls.get(call)
        if record is None or work.is_completed():
            return
        work.set_exception(
            DistTimeoutError(
                f"{record.what} did not complete within {record.timeout} s; it was cancelled on "
                f"rank {record.to} (a coroutine function is cancelled there; a plain function "
                "already running in its thread runs to its end, its result dropped). Pass a "
                "longer timeout (0: none) if it needs more time."
            )
        )

        def cancel(_: object = None) -> None:
            notify(self.plane, record.to, Op.CANCEL, call)

        if record.to == self.rank:
            self.loop.call_soon(self.server.cancel, self.rank, call)
        elif record.sending is not None and not record.sending.done():
            record.sending.add_done_callback(cancel)  # after the request: never overtake it
        else:
            cancel()

    def _replied(self, call: int, msg: Received | BaseException) -> None:
        if isinstance(msg, BaseException):  # the session failed, or closed
            self._complete(call, Status.ERROR, None, None, msg)
            return
        status, meta, *more = msg.meta
        grad = more[0] if more else None  # distributed autograd's part, if any
        if not meta:
            self._complete(call, status, msg.data, grad, [])
            return
        done = functools.partial(self._complete, call, status, msg.data, grad)
        receive_parts(self.plane, msg.src, call, meta, request=False, done=done)

    def _complete(
        self,
        call: int,
        status: int,
        data: Any,
        grad: Any,
        tensors: list[torch.Tensor] | BaseException,
    ) -> None:
        record = self.calls.pop(call, None)
        if record is None:
            return  # abandoned, or forced closed: nobody waits for it
        if record.timer is not None:
            record.timer.cancel()
        self.maybe_idle()
        work = record.work
        if work.is_completed():
            return  # it timed out: this is its CANCELLED reply
        try:
            if isinstance(tensors, BaseException):
                raise tensors
            if grad is not None:  # its tensors enter this rank's autograd graph
                incoming(grad, record.to, tensors)
            if status == Status.OK:
                value = None
                if data is not None and memoryview(data).nbytes:
                    value = decode(self, data, tensors)
                work.set_result(value)
            elif status == Status.ERROR:
                work.set_exception(rebuild_error(data, record.to, record.what))
            else:  # CLOSED (CANCELLED replies come after a timeout: handled above)
                work.set_exception(ClosedError(f"{record.what} was not run: {codec.loads(data)}"))
        except Exception as exc:
            if not isinstance(exc, DistError):
                exc = RemoteError(
                    f"the result of {record.what} from rank {record.to} cannot be decoded "
                    f"here: {type(exc).__name__}: {exc}",
                    rank=record.to,
                    exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                )
            work.set_exception(exc)

    # --- remote references --------------------------------------------------------------

    def release(self, owner: int, rid: RRefId, exp: int) -> None:
        """A reference of weight ``2**-exp`` was dropped here: tell its owner (on the loop)."""
        if self.closed or self.shut_down or self.error is not None:
            return  # the objects went with rpc
        if owner == self.rank:
            self.server.owned.release(rid, exp)
            return
        notify(self.plane, owner, Op.RELEASE, [rid[0], rid[1], exp])

    def own(self, value: Any) -> RRefId:
        """Keep ``value`` as an object of this rank (``RRef(value)``), from any thread; its id.

        Raises:
            ClosedError: rpc was shut down here.
        """
        rid = new_id(self)
        _call_on(self.loop, threading.get_ident() == self.thread, self._own, rid, value)
        return rid

    def _own(self, rid: RRefId, value: Any) -> None:
        self.check_usable()
        self.server.owned.created(rid).set_result(value)

    def local_value(self, rid: RRefId, timeout: float | None) -> Any:
        """The object this rank keeps as ``rid``, waiting while it is made (not on the loop).

        Raises:
            RuntimeError: Not made yet, on the loop's thread (which cannot wait).
            DistTimeoutError: Not made within ``timeout`` (None: the rpc timeout).
            Exception: The error making it raised.
        """
        made = self.server.owned.peek(rid)
        if made is not None and made.done():
            return _object(rid, made)
        if threading.get_ident() == self.thread:
            raise RuntimeError(
                f"the object of RRef {rid} is still being made, and the event loop's thread "
                "cannot wait for it: await rref.to_here() there"
            )
        box: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def watch() -> None:
            if self.shut_down or self.closed:
                box.set_exception(self.closed_reason())
                return
            made = self.server.owned.value(rid)  # its making may be on its way
            made.add_done_callback(functools.partial(_settle, box, _object, rid))

        self.loop.call_soon_threadsafe(watch)
        seconds = self.default_timeout if timeout is None else (timeout or None)
        try:
            return box.result(seconds)
        except concurrent.futures.TimeoutError:
            raise DistTimeoutError(
                f"the object of RRef {rid} was not made within {seconds} s"
            ) from None

    def owned_work(self, rid: RRefId) -> Work[Any]:
        """A handle to the object this rank keeps as ``rid``, once made (on the loop)."""
        self.check_usable()
        work: Work[Any] = Work.pending(self.loop, f"RRef {rid}.to_here()")
        made = self.server.owned.value(rid)
        if made.done():
            _settle(work, _object, rid, made)
        else:
            made.add_done_callback(functools.partial(_settle, work, _object, rid))
        return work

    # --- ending -------------------------------------------------------------------------

    def shutdown(self, graceful: bool, timeout: float | None) -> Work[None]:
        """``rpc.shutdown`` on this rank (see ``shutdown``); its handle."""
        if self.closed or self.shut_down:
            return Work.completed(None, "rpc.shutdown")
        if self.alone() and (self.error or self.session.error) is not None:
            # The session broke (a failing rank 0 took its server along) after every
            # other rank was known to have failed or left: there is nobody to agree with.
            self.finish_shutdown()
            return Work.completed(None, "rpc.shutdown")
        if self.error is not None:
            raise self.error
        self.session.check_usable()
        if graceful:
            return self.termination.start(timeout)
        self.finish_shutdown(force=True)
        return Work.completed(None, "rpc.shutdown")

    def finish_shutdown(self, *, force: bool = False) -> None:
        """Stop serving (later requests get ``ClosedError``); drop every owned object.

        ``force`` (``shutdown(graceful=False)``): calls still running here are
        answered ``ClosedError`` and cancelled; this rank's pending calls fail.
        """
        self.shut_down = True
        reason = self.closed_reason()
        self.server.stop(reason, answer=force)
        if force:
            self._fail_calls(reason)
        self.maybe_idle()

    def _fail_calls(self, exc: BaseException) -> None:
        calls, self.calls = self.calls, {}
        for record in calls.values():
            if record.timer is not None:
                record.timer.cancel()
            record.work.set_exception(exc)

    def broken(self, exc: BaseException) -> None:
        """The session failed (every posted receive failed with ``exc``) or closed."""
        if self.error is None:
            self.error = exc
        self.termination.fail(exc)
        waiters, self._idle = self._idle, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(exc)
                waiter.exception()  # retrieved: the shutdown task re-raises it

    def close(self) -> None:
        """The session is closing: stop serving, fail what is pending, drop everything."""
        if self.closed:
            return
        self.closed = True
        AGENTS.pop(self.session, None)
        reason = self.closed_reason()
        self.server.stop(reason, answer=True)
        self.server.close()
        # Every receive of ours: the requests', the replies', their tensors'.
        for posted in self.plane.matcher.take_posted_where(
            lambda k: k[0] == MatchKind.RPC and k[1] == RPC_GROUP
        ):
            posted.settle(reason)
        self._fail_calls(reason)
        self._deadlines.close()
        self.broken(reason)


def _object(rid: RRefId, made: asyncio.Future[Any]) -> Any:
    """The object an owned future holds, or the error its making raised."""
    if made.cancelled():
        raise RuntimeError(f"the object of RRef {rid} was dropped: no reference to it was left")
    return made.result()


def _settle(
    box: Work[Any] | concurrent.futures.Future[Any], fn: Callable[..., Any], *args: Any
) -> None:
    """Settle ``box`` with ``fn(*args)``, or with the error it raises."""
    try:
        box.set_result(fn(*args))
    except Exception as exc:
        box.set_exception(exc)


def _call_on(loop: asyncio.AbstractEventLoop, here: bool, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on ``loop``'s thread (``here``: this one), from any thread; its result."""
    if here:
        return fn(*args)
    box: concurrent.futures.Future[T] = concurrent.futures.Future()
    loop.call_soon_threadsafe(_settle, box, fn, *args)
    return box.result()


def agent_for(session: Session) -> Agent:
    """The session's agent, started (serving) on first use; call on the session's loop.

    Raises:
        DistError: The session is closed or broken.
    """
    agent = cast("Agent | None", AGENTS.get(session))
    if agent is None:
        session.check_usable()
        agent = Agent(session)
        AGENTS[session] = agent
        session.world.on_close(agent.close)
        agent.server.listen()
    return agent


def default_agent(what: str) -> Agent:
    """The rpc world's agent, from any thread (started on its loop if need be).

    The rpc world is the one ``init_rpc`` opened, else the default group's job.

    Raises:
        RuntimeError: Neither ``init_rpc`` nor ``init_process_group`` was called.
        DistError: The rpc world's session is closed or broken.
    """
    session, loop = rpc_world()
    if session is not None:
        agent = cast("Agent | None", AGENTS.get(session))
        if agent is not None:
            return agent
        if session.closed:  # an rpc world of its own, shut down
            raise ClosedError(f"{what}: rpc was shut down on this rank; call init_rpc() again")
    if session is None or loop is None:
        raise RuntimeError(
            f"{what} needs rpc: call aiodist.rpc.init_rpc() (or init_process_group()) first"
        )
    return _call_on(loop, running_loop() is loop, agent_for, session)
