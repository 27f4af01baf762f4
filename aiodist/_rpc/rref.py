"""Remote references: ``RRef`` on every rank, the objects they name on their owner.

``remote(to, fn)`` runs ``fn`` on ``to`` (the *owner*), which keeps the result;
the caller gets an ``RRef`` naming it by ``(creator rank, number)``. The owner
keeps the object while any reference to it is alive anywhere, and drops it
when the last one is gone or rpc shuts down.

**Weighted reference counting.** Each reference carries a weight, a power of
two ``2**-k``; the owner keeps the sum of the weights of all references alive,
starting at 1 for the creator's. Copying a reference (pickling it into a
call's arguments, or ``copy.copy``) halves its weight and gives the copy the
other half, with no message at all; a reference that is dropped sends its
weight back (``RELEASE``) and the owner drops the object once the sum is 0
and its creation has arrived. No message ever adds weight, so no message race
(a copy's release overtaking the copy's arrival, say) can make the sum reach
0 while a reference lives: the usual trouble of reference counting across
processes, which torch.distributed.rpc solves with acknowledged forks. A
reference whose message is lost (its call failed before it was sent) keeps
its weight, so its object lives until rpc shuts down.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import threading
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from aiodist._rpc.calls import Caller, Request, prepare
from aiodist._rpc.wire import Op
from aiodist._rpc.world import rpc_world
from aiodist._wire import codec

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Mapping, Sequence

    from aiodist._group.session import Session
    from aiodist._group.work import Work
    from aiodist._rpc.names import WorkerInfo
    from aiodist._wire.frame import Buffer

T = TypeVar("T")
RRefId = tuple[int, int]  # (creator's rank, its number there)
# Deeper copy chains than this would make weights no message should carry.
_MAX_EXPONENT = 1 << 16
_numbers = itertools.count(1)  # RRef ids are (creator's rank, one of these)


class RRefAgent(Caller, Protocol):
    """What an RRef needs of its rank's rpc agent (``agent.Agent``)."""

    rank: int
    loop: asyncio.AbstractEventLoop
    thread: int

    def release(self, owner: int, rid: RRefId, exp: int) -> None: ...

    def worker_info(self, rank: int) -> WorkerInfo: ...

    def in_async_code(self) -> bool: ...

    def own(self, value: Any) -> RRefId: ...

    def local_value(self, rid: RRefId, timeout: float | None) -> Any: ...

    def owned_work(self, rid: RRefId) -> Work[Any]: ...

    def launch(self, request: Request) -> Work[Any]: ...

    def call(self, request: Request) -> Any: ...


# The agent of the session whose message is being decoded: RRefs unpickled there belong to it.
DECODING: contextvars.ContextVar[RRefAgent | None] = contextvars.ContextVar(
    "aiodist_rpc_decoding", default=None
)
# Every session's rpc agent (rpc.agent_for); RRefs decoded elsewhere join the rpc world's.
AGENTS: dict[Session, RRefAgent] = {}


def decode(agent: RRefAgent, data: Buffer, tensors: Sequence[Any] | None = None) -> Any:
    """Decode what ``agent``'s session received (``tensors``: set aside); its RRefs join it."""
    token = DECODING.set(agent)
    try:
        return codec.loads(data) if tensors is None else codec.loads_split(data, tensors)
    finally:
        DECODING.reset(token)


class RRef(Generic[T]):
    """A reference to an object kept by its owner, a worker of the rpc world.

    ``RRef(value)`` makes this rank the owner of ``value`` (torch's owner RRef:
    ``RRef(self)``, ``RRef(param)``); ``aiodist.rpc.remote`` makes one owned by
    another rank. It may be passed to other ranks in the arguments or results
    of remote calls (it pickles), and each copy keeps the object alive on its
    owner until it is dropped.

    Args:
        value: The object this rank keeps.
        type_hint: Accepted for torch's signature; not used.

    Raises:
        RuntimeError: rpc is not initialised (``init_rpc`` or ``init_process_group``).

    Example:
        >>> rref = aiodist.rpc.remote(1, Counter)          # Counter() runs on rank 1
        >>> await rref.rpc_async().add(5)                  # Counter.add on rank 1
        >>> counter = await rref.to_here()                 # a copy of it, here
        >>> mine = aiodist.rpc.RRef(model)                 # owned here; pass it to others
    """

    __slots__ = ("__weakref__", "_agent", "_exp", "_id", "_made", "_owner")

    _agent: RRefAgent
    _owner: int
    _id: RRefId
    _exp: int
    _made: Work[Any] | None

    def __init__(self, value: T, type_hint: object = None) -> None:
        agent = _default_agent()
        if agent is None:
            raise RuntimeError(
                "RRef(value) needs rpc: call aiodist.rpc.init_rpc() (or init_process_group()) first"
            )
        self._init(agent, agent.rank, agent.own(value), 0, None)

    def _init(
        self, agent: RRefAgent, owner: int, rid: RRefId, exp: int, made: Work[Any] | None
    ) -> None:
        self._agent = agent
        self._owner = owner
        self._id = rid
        self._exp = exp  # this reference's weight is 2**-exp (module docstring)
        self._made = made  # the call that makes the object (remote), on its creator

    @classmethod
    def _make(
        cls, agent: RRefAgent, owner: int, rid: RRefId, exp: int = 0, made: Work[Any] | None = None
    ) -> RRef[Any]:
        """An RRef to an object that ``owner`` keeps (or makes) as ``rid``."""
        rref: RRef[Any] = cls.__new__(cls)
        rref._init(agent, owner, rid, exp, made)
        return rref

    def owner(self) -> WorkerInfo:
        """The worker that keeps the object (its ``.id`` is its rank)."""
        return self._agent.worker_info(self._owner)

    def owner_name(self) -> str:
        """The name of the worker that keeps the object."""
        return self.owner().name

    def is_owner(self) -> bool:
        """True on the owner."""
        return self._owner == self._agent.rank

    def confirmed_by_owner(self) -> bool:
        """True once the owner has the object: always on the owner and for copies received.

        The reference ``remote`` returns is confirmed once the owner answered
        the call that makes the object (successfully or not).
        """
        return self._made is None or self._made.is_completed()

    def local_value(self) -> T:
        """The object itself, on its owner; waits while it is still being made (torch's).

        Raises:
            RuntimeError: Not the owner; or the object is not made yet and this is
                the job's event-loop thread, which cannot wait (await
                ``rref.to_here()`` there).
            DistTimeoutError: Not made within the rpc timeout.
            Exception: The error its making raised.
        """
        if not self.is_owner():
            raise RuntimeError(
                f"local_value() is for the owner (rank {self._owner}); use to_here() elsewhere"
            )
        return self._agent.local_value(self._id, None)  # type: ignore[no-any-return]

    def to_here(self, timeout: float | None = None) -> Any:
        """A copy of the object, fetched from its owner (the object itself on the owner).

        In plain code (any thread but the job's event loop's) it blocks and returns
        the object, as torch's does; in async code it returns a ``Work`` to await:
        ``await rref.to_here()``.

        Args:
            timeout: Seconds (None: the rpc timeout; 0: none).

        Raises:
            Exception: The error the object's making raised.
            DistTimeoutError: No answer within ``timeout``.
        """
        agent = self._agent
        if self.is_owner():
            if agent.in_async_code():
                return agent.owned_work(self._id)
            return agent.local_value(self._id, timeout)
        work = agent.launch(on_object(self, Op.TO_HERE, "", (), None, timeout))
        return work if agent.in_async_code() else work.wait()

    def rpc_async(self, timeout: float | None = None) -> Any:
        """A proxy whose methods call the object's, on the owner, without waiting.

        Each method returns a ``torch.futures.Future`` in plain code, a ``Work``
        in async code (both awaitable).

        Example:
            >>> total = await rref.rpc_async().add(5)
        """
        return _Methods(self, "async", timeout)

    def rpc_sync(self, timeout: float | None = None) -> Any:
        """A proxy whose methods call the object's, on the owner, and block (plain code).

        Example:
            >>> total = rref.rpc_sync().add(5)
        """
        return _Methods(self, "sync", timeout)

    def remote(self, timeout: float | None = None) -> Any:
        """A proxy whose methods call the object's on the owner and keep the result there.

        Each method returns an ``RRef`` (owned by the same rank) to its result.
        """
        return _Methods(self, "remote", timeout)

    def __repr__(self) -> str:
        return f"RRef(owner={self._owner}, id={self._id})"

    def __reduce__(self) -> tuple[Callable[..., RRef[Any]], tuple[int, RRefId, int]]:
        # The copy takes half of this reference's weight: nothing to tell the owner.
        if self._exp >= _MAX_EXPONENT:
            raise ValueError(f"{self!r} was copied from copies {_MAX_EXPONENT} times over")
        self._exp += 1
        return _rebuild, (self._owner, self._id, self._exp)

    def __del__(self) -> None:
        agent = getattr(self, "_agent", None)
        if agent is None:
            return  # its construction failed: it holds no weight
        try:
            if threading.get_ident() == agent.thread:
                agent.loop.call_soon(agent.release, self._owner, self._id, self._exp)
            else:
                agent.loop.call_soon_threadsafe(agent.release, self._owner, self._id, self._exp)
        except RuntimeError:  # the loop is closed: the job ended, and the object with it
            pass


def _default_agent() -> RRefAgent | None:
    """The agent RRefs made or unpickled outside any message belong to: the rpc world's."""
    session = rpc_world()[0]
    return None if session is None else AGENTS.get(session)


def _rebuild(owner: int, rid: RRefId, exp: int) -> RRef[Any]:
    """Unpickle an RRef: it joins the agent decoding it, or the rpc world's."""
    agent = DECODING.get() or _default_agent()
    if agent is None:
        raise RuntimeError(
            "an RRef can only be unpickled in a rank of the job that made it, with rpc in use"
        )
    return RRef._make(agent, int(owner), (int(rid[0]), int(rid[1])), int(exp))


class _Methods:
    """``rref.rpc_async()``, ``rpc_sync()``, ``remote()``: attribute access names the method."""

    __slots__ = ("_mode", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], mode: str, timeout: float | None) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        return functools.partial(self._call, name)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        rref, agent = self._rref, self._rref._agent
        if self._mode == "remote":
            made = new_id(agent)
            request = on_object(rref, Op.METHOD_REMOTE, name, args, kwargs, self._timeout, made)
            return RRef._make(agent, rref._owner, made, made=agent.launch(request))
        request = on_object(rref, Op.METHOD, name, args, kwargs, self._timeout)
        if self._mode == "sync":
            return agent.launch(request).wait()
        return agent.call(request)


def on_object(
    rref: RRef[Any],
    op: Op,
    name: str,
    args: tuple[Any, ...],
    kwargs: Any,
    timeout: float | None,
    made: RRefId | None = None,
) -> Request:
    """``to_here`` or a call of method ``name`` of ``rref``'s object, on its owner, prepared.

    ``METHOD_REMOTE`` keeps the result there as ``made``.
    """
    rid: list[Any] = list(rref._id)
    if op is Op.TO_HERE:
        what, extra = f"{rref!r}.to_here()", rid
    elif op is Op.METHOD:
        what, extra = f"{rref!r}.{name}()", rid
    else:
        assert made is not None
        what, extra = f"{rref!r}.remote().{name}()", [rid, list(made)]
    request = prepare(rref._agent, op, rref._owner, name, args, kwargs, timeout, what, extra)
    request.keep = rref  # alive until the call completes: its release comes after
    return request


def make_remote(
    agent: RRefAgent,
    to: object,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    timeout: float | None,
) -> RRef[Any]:
    """``rpc.remote``: run ``fn`` on ``to``, which keeps the result; an RRef to it."""
    rid = new_id(agent)
    what = f"remote(to={to}, {{fn}})"
    request = prepare(agent, Op.REMOTE, to, fn, args, kwargs, timeout, what, list(rid))
    work = agent.launch(request)
    return RRef._make(agent, request.to, rid, made=work)


def new_id(agent: RRefAgent) -> RRefId:
    """A fresh RRef id for an object ``agent``'s rank makes."""
    return (agent.rank, next(_numbers))


class _Owned:
    """One object an owner keeps: its value (once made) and the weight of its references."""

    __slots__ = ("created", "value", "weight")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.value: asyncio.Future[Any] = loop.create_future()
        self.weight = Fraction(0)
        self.created = False  # the creating request arrived (its weight, 1, counted)


class OwnedTable:
    """The objects this rank owns, by RRef id (the owner's side of the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._entries: dict[RRefId, _Owned] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, rid: RRefId) -> _Owned:
        entry = self._entries.get(rid)
        if entry is None:
            entry = self._entries[rid] = _Owned(self._loop)
        return entry

    def created(self, rid: RRefId) -> asyncio.Future[Any]:
        """A request that makes ``rid`` arrived: count the creator's weight; its value's future."""
        entry = self._entry(rid)
        entry.created = True
        entry.weight += 1
        self._drop_if_unused(rid, entry)
        return entry.value

    def peek(self, rid: RRefId) -> asyncio.Future[Any] | None:
        """The future of ``rid``'s value if this rank holds it, else None."""
        entry = self._entries.get(rid)
        return None if entry is None else entry.value

    def value(self, rid: RRefId) -> asyncio.Future[Any]:
        """The future of ``rid``'s value (it may be asked for before its creation arrives)."""
        return self._entry(rid).value

    def release(self, rid: RRefId, exp: int) -> None:
        """A reference of weight ``2**-exp`` went."""
        if not 0 <= exp <= _MAX_EXPONENT:
            return  # not a weight any reference could have had
        entry = self._entry(rid)
        entry.weight -= Fraction(1, 1 << exp)
        self._drop_if_unused(rid, entry)

    def _drop_if_unused(self, rid: RRefId, entry: _Owned) -> None:
        if entry.created and entry.weight == 0:
            del self._entries[rid]
            if not entry.value.done():
                entry.value.cancel()  # nobody can ask for it any more
            elif not entry.value.cancelled():
                entry.value.exception()  # retrieved: its error was for references now gone

    def clear(self, exc: BaseException) -> None:
        """Drop every object (rpc shut down): waiters for one not made yet get ``exc``."""
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            if not entry.value.done():
                entry.value.set_exception(exc)
                entry.value.exception()  # retrieved: a waiter, if any, reports it
