"""Serving remote calls: requests in, functions run, replies out.

A rank serves from the moment its agent starts (at ``init_process_group``,
or on its first rpc use for a group opened otherwise) until ``rpc.shutdown``
completes or the session closes. Serving holds no task of its own: one
receive for requests from any source stays posted, and each request is
driven by callbacks from its arrival to its reply, so calls run concurrently:

- a coroutine function is awaited in a task of its own on the loop;
- a plain function runs in one of the rank's rpc threads
  (``AIODIST_RPC_THREADS``, default 16, as torch's TensorPipe agent;
  ``threads``), so a slow one blocks neither the loop nor other calls; a
  coroutine it returns is then awaited on the loop;
- a plain function marked ``async_execution`` (``ASYNC_MARK``, the attribute
  torch's decorator sets too) returns a ``torch.futures.Future``: its thread is
  free at once, and the call is answered when the future completes.

A caller that gives up on a call (its timeout) sends ``CANCEL``: the call is
answered ``CANCELLED`` at once and stopped: a coroutine function at its next
``await``, a plain function that has not started yet; one already running in
its thread runs to its end (Python cannot stop a thread), and its result is
dropped. Every request gets exactly one reply.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import sys
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist import _settings
from aiodist._errors import DistError
from aiodist._rpc.calls import remember
from aiodist._rpc.contexts import CURRENT, Context, incoming, outgoing, within
from aiodist._rpc.rref import OwnedTable, RRefAgent, decode
from aiodist._rpc.threads import Job, Threads, to_loop
from aiodist._rpc.wire import (
    REQUEST_KEY,
    Op,
    Status,
    encode_error,
    receive_parts,
    reply_key,
    send_parts,
    tensor_meta,
)
from aiodist._wire import codec

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine

    import torch

    from aiodist._plane.peers import DataPlane
    from aiodist._plane.receives import Received
    from aiodist._rpc.shutdown import Termination
    from aiodist._wire.frame import Buffer

logger = logging.getLogger(__name__)

#: The attribute ``rpc.functions.async_execution`` (and torch's decorator) sets on a function.
ASYNC_MARK: Final = "_wrapped_async_rpc_function"


class Host(RRefAgent, Protocol):
    """What serving needs of its rank's agent (``agent.Agent``)."""

    plane: DataPlane

    @property
    def termination(self) -> Termination: ...

    def broken(self, exc: BaseException) -> None: ...

    def closed_reason(self) -> DistError: ...

    def maybe_idle(self) -> None: ...

    def spawn_send(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...


class _Serving:
    """A call being served: from its request's arrival to its reply."""

    __slots__ = (
        "call",
        "context",
        "deferred",
        "extra",
        "finished",
        "grad",
        "job",
        "made",
        "op",
        "src",
        "target",
        "task",
    )

    def __init__(self, src: int, call: int, op: Op, target: Any, extra: Any) -> None:
        self.src, self.call, self.op, self.target, self.extra = src, call, op, target, extra
        self.made: asyncio.Future[Any] | None = None  # the object it makes (remote)
        self.job: Job | None = None
        self.task: asyncio.Task[None] | None = None
        self.deferred = False  # async_execution: its result is a future to wait for
        self.grad: Any = None  # distributed autograd's part of the request, if any
        self.context: Context | None = None  # the autograd context it runs in
        self.finished = False  # answered


class Server:
    """The serving side of one rank's rpc agent."""

    def __init__(self, agent: Host) -> None:
        self.agent = agent
        self.plane = agent.plane
        self.loop = agent.loop
        self.owned = OwnedTable(agent.loop)
        self.served = 0  # requests accepted: rpc.shutdown's waves compare it
        self.running: dict[tuple[int, int], _Serving] = {}
        self.stopped = False  # rpc shut down here: later requests get a CLOSED reply
        self.max_threads: int | None = None  # None: AIODIST_RPC_THREADS, else the default
        self._functions: dict[bytes, tuple[Callable[..., Any], bool]] = {}
        self._threads: Threads | None = None
        self._posting = False
        self._early: Received | BaseException | None = None
        self._listening = False

    # --- requests in --------------------------------------------------------------------

    def listen(self) -> None:
        """Keep a receive for requests posted; handle what is already there."""
        if self._listening:
            return
        self._listening = True
        self._post()

    def _post(self) -> None:
        # A request already buffered settles the receive inside post(): handle it here,
        # in a loop, rather than recursing once per buffered request.
        while self._listening:
            self._posting = True
            try:
                self.plane.post(None, REQUEST_KEY, None, self._arrived)
            finally:
                self._posting = False
            got, self._early = self._early, None
            if got is None:
                return  # posted: _arrived runs when a request comes
            self._dispatch(got)

    def _arrived(self, msg: Received | BaseException) -> None:
        if self._posting:
            self._early = msg
            return
        self._dispatch(msg)
        self._post()

    def _dispatch(self, msg: Received | BaseException) -> None:
        if isinstance(msg, BaseException):
            # Only a failed session (every posted receive fails) or closing takes it.
            self._listening = False
            self.agent.broken(msg)
            return
        try:
            self._handle(msg)
        except Exception:  # a malformed request must not stop serving the others
            logger.exception("dropping a malformed rpc request from rank %d", msg.src)

    def _handle(self, msg: Received) -> None:
        src = msg.src
        op_code, call, target, meta, extra, *more = msg.meta
        op = Op(op_code)
        if op is Op.RELEASE:
            if not self.stopped:
                self.owned.release((int(extra[0]), int(extra[1])), int(extra[2]))
            return
        if op is Op.CANCEL:
            self.cancel(src, int(extra))
            return
        if op is Op.SHUTDOWN:
            self.agent.termination.on_message(src, extra)
            return
        made: tuple[int, int] | None = None  # the RRef id of the object it makes
        if op is Op.REMOTE:
            made = (int(extra[0]), int(extra[1]))
        elif op is Op.METHOD_REMOTE:
            made = (int(extra[1][0]), int(extra[1][1]))
        serving = _Serving(src, int(call), op, target, extra)  # parsed: nothing raises below
        if more:
            serving.grad = more[0]  # checked with its tensors, once they are here
        self.served += 1
        self.running[(src, serving.call)] = serving
        if made is not None and not self.stopped:
            serving.made = self.owned.created(made)
        data = msg.data
        if meta:
            ready = functools.partial(self._ready, serving, data)
            receive_parts(self.plane, src, serving.call, meta, request=True, done=ready)
        else:
            self._ready(serving, data, [])

    def cancel(self, src: int, call: int) -> None:
        """The caller of ``call`` gave up on it: answer it CANCELLED now and stop it."""
        serving = self.running.get((src, call))
        if serving is not None:  # else answered already
            self._stop_call(serving, Status.CANCELLED, "cancelled by its caller")

    def _stop_call(self, serving: _Serving, status: Status, why: object) -> None:
        """Answer ``serving`` now, and stop it: a job not started yet, a task at its ``await``."""
        job, task = serving.job, serving.task
        self._finish(serving, status, why)
        if job is not None:
            job.cancelled = True
        if task is not None:
            task.cancel()

    # --- running a call -----------------------------------------------------------------

    def _ready(
        self, serving: _Serving, data: Buffer, tensors: list[torch.Tensor] | BaseException
    ) -> None:
        """Everything the call needs arrived (or failed to): run it."""
        if serving.finished:
            return
        if self.stopped:
            self._finish(serving, Status.CLOSED, self.agent.closed_reason())
            return
        try:
            if isinstance(tensors, BaseException):
                raise tensors
            if serving.grad is not None:  # run in its autograd context, its tensors in the graph
                serving.context = incoming(serving.grad, serving.src, tensors)
            op = serving.op
            if op is Op.CALL or op is Op.REMOTE:
                fn, is_async = self._function(serving.target)
                args, kwargs = self._arguments(data, tensors)
                self._run(serving, fn, args, kwargs, is_async)
                return
            extra = serving.extra
            rid = extra if op is Op.METHOD or op is Op.TO_HERE else extra[0]
            owned = self.owned.value((int(rid[0]), int(rid[1])))
            if op is Op.TO_HERE:
                args, kwargs = (), {}
            else:
                args, kwargs = self._arguments(data, tensors)
        except Exception as exc:
            self._finish(serving, Status.ERROR, exc)
            return
        # Its object may still be being made: carry on once it is (without awaiting the
        # future, which a cancelled waiter would cancel for every reference).
        if owned.done():
            self._with_object(serving, args, kwargs, owned)
        else:
            owned.add_done_callback(functools.partial(self._with_object, serving, args, kwargs))

    def _with_object(
        self, serving: _Serving, args: Any, kwargs: Any, owned: asyncio.Future[Any]
    ) -> None:
        if serving.finished:
            return
        if owned.cancelled():
            self._finish(serving, Status.ERROR, RuntimeError("its object was dropped"))
            return
        exc = owned.exception()
        if exc is not None:
            self._finish(serving, Status.ERROR, exc)  # the error making it raised
            return
        obj = owned.result()
        if serving.op is Op.TO_HERE:
            self._finish(serving, Status.OK, obj)
            return
        try:
            method = getattr(obj, str(serving.target))
        except AttributeError as error:
            self._finish(serving, Status.ERROR, error)
            return
        self._run(serving, method, args, kwargs, inspect.iscoroutinefunction(method))

    def _run(
        self, serving: _Serving, fn: Callable[..., Any], args: Any, kwargs: Any, is_async: bool
    ) -> None:
        if is_async:
            try:
                coro = fn(*args, **kwargs)
            except Exception as exc:
                self._finish(serving, Status.ERROR, exc)
                return
            context = None
            if serving.context is not None:
                context = contextvars.copy_context()
                context.run(CURRENT.set, serving.context)
            serving.task = self.loop.create_task(self._await(serving, coro), context=context)
            return
        serving.deferred = hasattr(fn, ASYNC_MARK)
        if serving.context is not None:
            fn = functools.partial(within, serving.context, fn)
        serving.job = Job(fn, args, kwargs, functools.partial(self._ran, serving))
        if self._threads is None:
            most = self.max_threads or _settings.RPC_THREADS.read()
            self._threads = Threads(self.loop, most, "aiodist-rpc")
        self._threads.submit(serving.job)

    def _ran(self, serving: _Serving, ok: bool, value: Any) -> None:
        if serving.finished:
            return  # cancelled meanwhile: its result is dropped
        if ok and serving.deferred and _is_torch_future(value):
            self._defer(serving, value)
            return
        if ok and inspect.isawaitable(value):  # a plain function that returned a coroutine
            serving.task = self.loop.create_task(self._await(serving, value))
            return
        if ok and serving.deferred:
            value = TypeError(
                f"a function marked async_execution must return a torch.futures.Future, "
                f"not a {type(value).__name__}"
            )
            ok = False
        self._finish(serving, Status.OK if ok else Status.ERROR, value)

    def _defer(self, serving: _Serving, future: Any) -> None:
        """Answer ``serving`` once ``future`` (a ``torch.futures.Future``) completes."""
        if future.done():  # completed in the function already: no callback, no loop turn
            self._resolved(serving, future)
            return
        # On whichever thread completes it: the answer is made on the loop's.
        done = functools.partial(to_loop, self.loop, self.agent.thread, self._resolved, serving)
        future.add_done_callback(done)

    def _resolved(self, serving: _Serving, future: Any) -> None:
        if serving.finished:
            return
        try:
            value = future.value()
        except Exception as exc:
            self._finish(serving, Status.ERROR, exc)
        else:
            self._finish(serving, Status.OK, value)

    async def _await(self, serving: _Serving, awaitable: Awaitable[Any]) -> None:
        try:
            value = await awaitable
        except asyncio.CancelledError:
            if serving.finished:  # cancelled by its caller or by closing, and answered
                raise
            self._finish(serving, Status.CLOSED, self.agent.closed_reason())
            raise
        except (Exception, SystemExit) as exc:  # its own error: it goes to the caller
            self._finish(serving, Status.ERROR, exc)
        else:
            self._finish(serving, Status.OK, value)

    def _function(self, encoded: bytes) -> tuple[Callable[..., Any], bool]:
        hit = self._functions.get(encoded)
        if hit is not None:
            return hit
        fn = decode(self.agent, encoded)
        if not callable(fn):
            raise TypeError(f"rpc was sent a {type(fn).__name__} object, which is not callable")
        hit = (fn, inspect.iscoroutinefunction(fn))
        remember(self._functions, encoded, fn, hit)  # kept by its encoding
        return hit

    def _arguments(self, data: Buffer, tensors: list[torch.Tensor]) -> tuple[Any, Any]:
        if not memoryview(data).nbytes:
            return (), {}
        args, kwargs = decode(self.agent, data, tensors)
        return args, kwargs or {}

    # --- replies out --------------------------------------------------------------------

    def _finish(self, serving: _Serving, status: Status, value: Any) -> None:
        """Answer the call (once) and forget it."""
        if serving.finished:
            return
        serving.finished = True
        serving.job = serving.task = None  # no cycle through the job's callback: freed at once
        del self.running[(serving.src, serving.call)]
        made = serving.made
        if made is not None:
            if not made.done():
                if status is Status.OK:
                    made.set_result(value)
                else:
                    error = value if isinstance(value, BaseException) else self._stopped(value)
                    made.set_exception(error)
                    made.exception()  # retrieved: to_here and method calls report it
            if status is Status.OK:
                value = None  # kept here; the caller holds the RRef
        self._reply(serving.src, serving.call, status, value, serving.context)
        self.agent.maybe_idle()

    def _stopped(self, why: object) -> DistError:
        return DistError(f"making the object on rank {self.agent.rank} was stopped: {why}")

    def _reply(
        self, src: int, call: int, status: Status, value: Any, context: Context | None
    ) -> None:
        tensors: list[torch.Tensor] = []
        payload: bytes | None = None
        if status is Status.OK and value is not None:
            try:
                payload = codec.dumps_split(value, tensors, grad=context is not None)
            except Exception as exc:
                tensors = []
                error = TypeError(f"the result ({type(value).__name__}) cannot be sent back: {exc}")
                error.__cause__ = exc
                status, value = Status.ERROR, error
        if status is Status.ERROR:
            payload = encode_error(value)
        elif status is not Status.OK:
            payload = codec.dumps(str(value))
        meta = [int(status), tensor_meta(tensors)]
        grad = outgoing(context, tensors, src, force=False)  # its tensors that require grad
        if grad is not None:
            meta.append(grad)
        try:
            rest = self.plane.send_now(src, reply_key(call), meta, payload)
        except Exception:  # cannot even be framed: the caller's timeout reports it
            logger.exception("replying to rank %d's call %d failed", src, call)
            return
        if rest is not None or tensors:
            self.agent.spawn_send(self._reply_rest(src, call, rest, tensors))

    async def _reply_rest(
        self, src: int, call: int, rest: Any, tensors: list[torch.Tensor]
    ) -> None:
        try:
            if rest is not None:
                await rest
            if tensors:
                await send_parts(self.plane, src, call, tensors, request=False)
        except (OSError, DistError) as exc:  # the caller is gone: the session deals with it
            logger.debug("replying to rank %d's call %d failed: %s", src, call, exc)

    # --- stopping -----------------------------------------------------------------------

    def stop(self, reason: BaseException, *, answer: bool) -> None:
        """Stop serving: later requests get a CLOSED reply; drop every owned object.

        With ``answer`` (forced, or the session is closing), calls still running
        are answered CLOSED now, while the channels are still open, and stopped.
        """
        self.stopped = True
        if answer:
            for serving in list(self.running.values()):
                self._stop_call(serving, Status.CLOSED, reason)
        self.owned.clear(reason)
        if self._threads is not None:
            self._threads.close()
            self._threads = None

    def close(self) -> None:
        """The session is closing: stop listening (replies being sent go on, the session's)."""
        self._listening = False


def _is_torch_future(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch._C.Future)
