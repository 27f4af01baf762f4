"""The master of master-worker mode: remote tensors, the orders they make, and their replies.

A ``RemoteTensor`` is the master's handle to a tensor on a worker (a "node").
Its shape and dtype are known here without asking: each operation runs first
on ``meta`` tensors (shapes and dtypes only), which also raises a shape
mismatch at once, as torch.cuda raises it when the kernel is launched. The
operation itself is queued as an order to the node that holds its first
remote operand; the orders of one event-loop turn go out in one message per
node. A remote operand on another node is pushed there by its own node, in
its own stream's order, never through the master.

The only waits are sync points: ``fetch`` (a copy to the master),
``synchronize`` and ``Event.synchronize``. An operation that failed on its
worker fails what uses its result, and its error is raised at the sync point
that meets it, naming the operation and the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import operator
import threading
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeAlias

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from aiodist._errors import ArgumentError, ClosedError, DistError, RankFailedError
from aiodist._group.lingering import linger
from aiodist._group.work import Work, running_loop, wait_future
from aiodist._ops.p2p_objects import Tag, receive_object, send_object
from aiodist._remote.orders import Kind, Moved, Rebuild, Ref, flatten, keep
from aiodist._remote.worker import MASTER

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from aiodist._group.group import ProcessGroup

logger = logging.getLogger("aiodist.remote")

#: Seconds the master waits for its workers to stop when it leaves the job.
STOP_TIMEOUT: Final = 30.0

# Methods that answer from the shape alone: nothing is sent.
_QUERIES: Final = frozenset(
    {
        "size", "dim", "ndimension", "numel", "nelement", "stride", "element_size",
        "is_contiguous", "is_floating_point", "is_complex", "storage_offset", "__len__",
    }
)  # fmt: skip
# Methods that need the values here: fetch first.
_VALUES: Final = frozenset(
    {
        "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
        "__complex__", "__array__", "__iter__",
    }
)  # fmt: skip
_DEVICE_MOVES: Final = frozenset({"cuda", "cpu", "to"})

_master: Master | None = None
_node: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "aiodist_remote_node", default=None
)
_streams: contextvars.ContextVar[dict[int, Stream] | None] = contextvars.ContextVar(
    "aiodist_remote_streams", default=None
)


def current_master() -> Master:
    """The master of this process's master-worker job.

    Raises:
        RuntimeError: None runs here.
    """
    if _master is None or _master.closed:
        raise RuntimeError(
            "no master-worker job runs in this process: on rank 0, call "
            "`await aiodist.init_master_worker()` (aiodist.sync: `init_master_worker()`) first"
        )
    return _master


class Master:
    """Rank 0's side of the job: ids, the orders not sent yet, the requests not answered."""

    def __init__(self, g: ProcessGroup) -> None:
        self.g = g
        self.loop = asyncio.get_running_loop()
        self.nodes: tuple[int, ...] = tuple(r for r in range(g.world_size) if r != MASTER)
        self.closed = False
        self._ids = itertools.count(1)  # tensors, transfers, requests, events, streams
        self._lock = threading.Lock()
        self._orders: dict[int, list[tuple[Any, ...]]] = {}
        self._flushing = False
        self._requests: dict[int, tuple[int, asyncio.Future[Any]]] = {}
        self.dead: dict[int, BaseException] = {}
        self._replies: Work[Any] | None = None
        self._receiving = linger(self._receive(), name="aiodist-remote-replies")
        g.session.on_member_gone.append(self._gone)
        g.on_close(self._closing)

    def new_id(self) -> int:
        return next(self._ids)

    def check_node(self, n: object) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n not in self.nodes:
            raise ArgumentError(
                f"node {n!r} is not a worker of this job: pick one of {list(self.nodes)} "
                "(rank 0 is the master)"
            )
        return n

    # --- orders out ---------------------------------------------------------------------------

    def order(self, n: int, order: tuple[Any, ...]) -> None:
        """Queue ``order`` for node ``n``; this loop turn's orders go out together."""
        if self.closed:
            raise ClosedError("the master-worker job has ended: its remote tensors are gone")
        with self._lock:
            self._orders.setdefault(n, []).append(order)
            if self._flushing:
                return
            self._flushing = True
        if running_loop() is self.loop:
            self.loop.call_soon(self.flush)
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        with self._lock:
            orders, self._orders = self._orders, {}
            self._flushing = False
        for n, batch in orders.items():
            if n in self.dead:
                continue  # what it was asked for failed when it died
            try:
                work = send_object(self.g, n, Tag.REMOTE_ORDERS, batch)
            except Exception as exc:  # the session broke, or an order does not pickle
                self._lose(n, exc)
            else:
                work.when_done(functools.partial(self._sent, n))

    def _sent(self, n: int, work: Work[Any]) -> None:
        error = work.exception()
        if error is not None and n not in self.dead:
            self._lose(n, error)

    def request(self, n: int, make: Callable[[int], tuple[Any, ...]]) -> asyncio.Future[Any]:
        """Send node ``n`` the order ``make(request)``; the future its answer settles.

        On the loop's thread.
        """
        request = self.new_id()
        future: asyncio.Future[Any] = self.loop.create_future()
        if n in self.dead:
            future.set_exception(self.dead[n])
            return future
        self._requests[request] = (n, future)
        self.order(n, make(request))
        return future

    # --- answers in ---------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            self._replies = receive_object(
                self.g, None, Tag.REMOTE_REPLIES, with_sender=False, timed=False
            )
            try:
                request, value, error = await self._replies
            except DistError:
                return  # the session ended
            except Exception:  # an answer that does not decode: its request cannot be told
                logger.exception("master-worker: an answer from a worker could not be read")
                continue
            entry = self._requests.pop(request, None)
            if entry is None or entry[1].done():
                continue
            if error is not None:
                entry[1].set_exception(error)
            else:
                entry[1].set_result(value)

    def _gone(self, rank: int) -> None:
        if rank in self.nodes and rank not in self.dead:
            error = self.g.session.failed_ranks.get(rank) or RankFailedError(
                f"worker {rank} failed", rank=rank
            )
            self._lose(rank, error)

    def _lose(self, n: int, error: BaseException) -> None:
        """Node ``n`` is gone: what it was asked for fails with ``error``."""
        self.dead[n] = error
        for request, (node_, future) in list(self._requests.items()):
            if node_ == n:
                del self._requests[request]
                if not future.done():
                    future.set_exception(error)

    # --- the end ------------------------------------------------------------------------------

    def _closing(self) -> asyncio.Task[None]:
        """Close hook of the default group (while it is usable): tell every worker to stop
        once it ran what it was told; a task waiting (bounded) until each did."""
        global _master
        stops = [
            self.request(n, lambda r: (Kind.STOP, r)) for n in self.nodes if n not in self.dead
        ]
        self.flush()
        self.closed = True
        if _master is self:
            _master = None
        task = linger(self._stopped(stops), name="aiodist-remote-stop")
        self.g.spawn(task)
        return task

    async def _stopped(self, stops: list[asyncio.Future[Any]]) -> None:
        if stops:
            await asyncio.wait(stops, timeout=STOP_TIMEOUT)
        with contextlib.suppress(ValueError):
            self.g.session.on_member_gone.remove(self._gone)
        if self._replies is not None:
            self._replies.cancel()
        self._receiving.cancel()

    # --- waiting from either side -------------------------------------------------------------

    def wait(self, make: Callable[[], asyncio.Future[Any]], what: str) -> Any:
        """``make()``'s future: a ``Work`` on the loop, its value in plain code (blocking)."""
        running = running_loop()
        if running is self.loop:
            return Work(make(), what)
        if running is not None:
            raise RuntimeError(
                f"{what} was called on an event loop other than the master's; call it on "
                "the loop that called init_master_worker"
            )

        async def on_loop() -> Any:
            return await make()

        return wait_future(asyncio.run_coroutine_threadsafe(on_loop(), self.loop))


def ready_shapes() -> None:
    """Run a few operations on meta tensors: the first of them readies torch's shape
    machinery (imports and registrations, seconds of CPU once per process)."""
    x = torch.empty(2, 2, device="meta")
    torch.relu(x * 2 + 1).sum(dim=0)
    torch.matmul(x, x)


def install(g: ProcessGroup) -> Master:
    global _master
    _master = Master(g)
    return _master


# --- nodes and streams -----------------------------------------------------------------------


@contextlib.contextmanager
def node(n: int) -> Iterator[int]:
    """New remote tensors go to worker ``n`` inside the block (``torch.cuda.device``'s way)."""
    token = _node.set(current_master().check_node(n))
    try:
        yield n
    finally:
        _node.reset(token)


def current_node() -> int:
    """The worker new remote tensors go to: ``node(n)``'s, else the first worker."""
    n = _node.get()
    if n is not None:
        return n
    nodes = current_master().nodes
    if not nodes:
        raise RuntimeError("this master-worker job has no worker: start it with 2 ranks or more")
    return nodes[0]


class Stream:
    """A queue of operations on one worker, run in issue order (``torch.cuda.Stream``'s way).

    Each worker has a default stream; operations of different streams may run
    in any order relative to each other, unless an ``Event`` orders them.
    """

    def __init__(self, node: int | None = None, *, _id: int | None = None) -> None:
        master = current_master()
        self.node = current_node() if node is None else master.check_node(node)
        self.id = master.new_id() if _id is None else _id

    def __repr__(self) -> str:
        return f"<aiodist.remote.Stream {self.id} on worker {self.node}>"

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) at this point of the stream."""
        event = event if event is not None else Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Later operations of this stream wait until ``event`` is reached."""
        event.wait(self)

    def synchronize(self) -> Any:
        """Wait until this stream ran what was issued to it (a ``Work`` on the loop)."""
        return self.record_event().synchronize()


def current_stream(n: int | None = None) -> Stream:
    """The stream operations on worker ``n`` (the current one if None) go to."""
    n = current_node() if n is None else current_master().check_node(n)
    chosen = (_streams.get() or {}).get(n)
    return chosen if chosen is not None else Stream(n, _id=0)


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[Stream]:
    """Operations on ``s``'s worker go to ``s`` inside the block, and new tensors to its worker."""
    chosen = dict(_streams.get() or {})
    chosen[s.node] = s
    token, node_token = _streams.set(chosen), _node.set(s.node)
    try:
        yield s
    finally:
        _node.reset(node_token)
        _streams.reset(token)


class Event:
    """A point in a stream that other streams, on any worker, or the master can wait for."""

    def __init__(self) -> None:
        self._at: tuple[int, int] | None = None  # (node, event id) of the last record

    def record(self, s: Stream | None = None) -> None:
        """Mark the current end of stream ``s`` (the current one if None)."""
        s = s if s is not None else current_stream()
        master = current_master()
        at = (s.node, master.new_id())
        master.order(s.node, (Kind.RECORD, s.id, at[1]))
        self._at = at

    def wait(self, s: Stream | None = None) -> None:
        """Later operations of ``s`` (the current stream if None) wait for this event."""
        at = self._recorded()
        s = s if s is not None else current_stream()
        master = current_master()
        if s.node != at[0]:
            master.order(at[0], (Kind.NOTIFY, at[1], s.node, None))
        master.order(s.node, (Kind.WAIT, s.id, at[1], at[0]))

    def synchronize(self) -> Any:
        """Wait until the event is reached: a ``Work`` on the loop; in plain code, blocks."""
        n, event = self._recorded()
        master = current_master()
        return master.wait(
            lambda: master.request(n, lambda r: (Kind.NOTIFY, event, MASTER, r)),
            "Event.synchronize",
        )

    def query(self) -> Any:
        """Whether the event is reached now: a ``Work`` resolving to a bool on the loop; in
        plain code, the bool."""
        n, event = self._recorded()
        master = current_master()
        return master.wait(
            lambda: master.request(n, lambda r: (Kind.QUERY, event, r)), "Event.query"
        )

    def _recorded(self) -> tuple[int, int]:
        if self._at is None:
            raise RuntimeError("the event was never recorded: call event.record() first")
        return self._at


def synchronize(n: int | None = None) -> Any:
    """Wait until worker ``n`` (every worker if None) ran every operation issued to it.

    Returns:
        On the loop, a ``Work`` to await; in plain code it blocks.

    Raises:
        RemoteError: An operation failed there since the last ``synchronize``
            (the first of them, naming the operation and the worker).
        RankFailedError: A worker failed.
    """
    master = current_master()
    nodes = master.nodes if n is None else (master.check_node(n),)

    async def all_synced() -> None:
        answers = [master.request(m, lambda r: (Kind.SYNC, r)) for m in nodes]
        for errors in await asyncio.gather(*answers):
            if errors:
                raise errors[0]

    return master.wait(lambda: asyncio.ensure_future(all_synced()), "synchronize")


def held_tensors(n: int | None = None) -> Any:
    """How many tensors worker ``n`` (every worker if None) holds for the master, by worker.

    Counted once every operation issued before ran (a failed one's outputs count):
    a tensor is freed there once the master's last handle to it is gone.

    Returns:
        On the loop, a ``Work`` resolving to ``{worker: count}``; in plain code, the dict.
    """
    master = current_master()
    nodes = master.nodes if n is None else (master.check_node(n),)

    async def counted() -> dict[int, int]:
        answers = [master.request(m, lambda r: (Kind.HELD, r)) for m in nodes]
        return dict(zip(nodes, await asyncio.gather(*answers), strict=True))

    return master.wait(lambda: asyncio.ensure_future(counted()), "held_tensors")


# --- remote tensors ----------------------------------------------------------------------------


def _method(name: str) -> Callable[..., Any]:
    func = getattr(torch.Tensor, name)

    def method(self: RemoteTensor, *args: Any, **kwargs: Any) -> Any:
        if name in _VALUES:
            _need_values(name)
        return dispatch(func, (self, *args), kwargs)

    method.__name__ = name
    return method


class RemoteTensor:
    """A tensor on a worker of a master-worker job, as the master sees it.

    Operations on it (``x + y``, ``torch.matmul(x, y)``, methods, in-place
    methods, ``.cuda()``) return new remote tensors at once and run on its
    worker in issue order; ``fetch`` copies it to the master.
    """

    __slots__ = ("__weakref__", "_master", "device", "id", "meta", "node")

    _NO_META: ClassVar[str] = (
        "its shape depends on its values (the operation that made it has no shape "
        "function); fetch it to see it"
    )

    def __init__(
        self, master: Master, node: int, id: int, device: torch.device, meta: torch.Tensor | None
    ) -> None:
        self._master = master
        self.node = node
        self.id = id
        self.device = device
        self.meta = meta
        weakref.finalize(self, _free, weakref.ref(master), node, id).atexit = False

    # --- what the master knows ----------------------------------------------------------------

    def get_node(self) -> int:
        """The worker that holds it."""
        return self.node

    def get_device(self) -> int:
        """Its device index on its worker, -1 for the CPU (``Tensor.get_device``'s answer)."""
        return -1 if self.device.type == "cpu" else (self.device.index or 0)

    def _known(self) -> torch.Tensor:
        if self.meta is None:
            raise RuntimeError(f"the shape of {self!r} is not known: {self._NO_META}")
        return self.meta

    @property
    def shape(self) -> torch.Size:
        return self._known().shape

    @property
    def dtype(self) -> torch.dtype:
        return self._known().dtype

    @property
    def ndim(self) -> int:
        return self._known().ndim

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def __repr__(self) -> str:
        if self.meta is None:
            return f"RemoteTensor(worker={self.node}, device={self.device}, shape=unknown)"
        return (
            f"RemoteTensor(worker={self.node}, device={self.device}, "
            f"shape={tuple(self.meta.shape)}, dtype={self.meta.dtype})"
        )

    # --- the one sync point -------------------------------------------------------------------

    def fetch(self) -> Any:
        """Copy it to the master once every operation issued before has made it.

        Returns:
            On the master's event loop, a ``Work`` resolving to the tensor (on the
            master's CPU); in plain code, the tensor (it blocks).

        Raises:
            RemoteError: The operation that made it (or one it depends on) failed
                on its worker; the message names both.
            RankFailedError: Its worker failed.
        """
        master, s = self._master, current_stream(self.node)
        return master.wait(
            lambda: master.request(self.node, lambda r: (Kind.FETCH, s.id, self.id, r)),
            f"fetch of {self!r}",
        )

    # --- operations -----------------------------------------------------------------------------

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return dispatch(func, tuple(args), kwargs or {})

    def __getattr__(self, name: str) -> Any:
        found = getattr(torch.Tensor, name, None)
        if found is None or name.startswith("_"):
            raise AttributeError(f"'RemoteTensor' object has no attribute {name!r}")
        if name in _VALUES:
            _need_values(name)
        if callable(found):
            return lambda *args, **kwargs: dispatch(found, (self, *args), kwargs)
        return dispatch(operator.attrgetter(name), (self,), {})  # a property: .T, .real, ...

    # Operators: as the tensor methods of the same names, run on the worker.
    __add__ = _method("__add__")
    __radd__ = _method("__radd__")
    __iadd__ = _method("__iadd__")
    __sub__ = _method("__sub__")
    __rsub__ = _method("__rsub__")
    __isub__ = _method("__isub__")
    __mul__ = _method("__mul__")
    __rmul__ = _method("__rmul__")
    __imul__ = _method("__imul__")
    __truediv__ = _method("__truediv__")
    __rtruediv__ = _method("__rtruediv__")
    __itruediv__ = _method("__itruediv__")
    __floordiv__ = _method("__floordiv__")
    __rfloordiv__ = _method("__rfloordiv__")
    __mod__ = _method("__mod__")
    __pow__ = _method("__pow__")
    __rpow__ = _method("__rpow__")
    __matmul__ = _method("__matmul__")
    __rmatmul__ = _method("__rmatmul__")
    __neg__ = _method("__neg__")
    __pos__ = _method("__pos__")
    __abs__ = _method("__abs__")
    __invert__ = _method("__invert__")
    __and__ = _method("__and__")
    __or__ = _method("__or__")
    __xor__ = _method("__xor__")
    __lshift__ = _method("__lshift__")
    __rshift__ = _method("__rshift__")
    __eq__ = _method("__eq__")
    __ne__ = _method("__ne__")
    __lt__ = _method("__lt__")
    __le__ = _method("__le__")
    __gt__ = _method("__gt__")
    __ge__ = _method("__ge__")
    __getitem__ = _method("__getitem__")
    __setitem__ = _method("__setitem__")
    __len__ = _method("__len__")
    __bool__ = _method("__bool__")
    __int__ = _method("__int__")
    __float__ = _method("__float__")
    __index__ = _method("__index__")
    __iter__ = _method("__iter__")
    __hash__ = object.__hash__  # ``==`` is elementwise, as a tensor's


def _need_values(name: str) -> None:
    raise RuntimeError(
        f"{name}() needs the tensor's values on the master: fetch it first "
        "(`await x.fetch()`; in plain code `x.fetch()`)"
    )


def _free(master_ref: weakref.ref[Master], n: int, i: int) -> None:
    master = master_ref()
    if master is None or master.closed or n in master.dead:
        return
    with contextlib.suppress(Exception):  # the loop may be gone at interpreter exit
        master.order(n, (Kind.FREE, [i]))


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on the worker of its first remote operand; its remote result at once."""
    leaves, rebuild = flatten(args, kwargs)
    remotes = [x for x in leaves if isinstance(x, RemoteTensor)]
    if not remotes:
        return func(*args, **kwargs)
    name = getattr(func, "__name__", "")
    if name in _VALUES:
        _need_values(name)
    first = remotes[0]
    master, n = first._master, first.node
    if name in _QUERIES:  # answered from the shape alone, if it is known
        answer = _meta(func, name, leaves, rebuild)
        if answer is not None:
            return answer
    # The result's shape and dtype, from meta tensors (a shape mismatch raises here).
    shape = _shape_of(func, name, leaves, rebuild)
    s = current_stream(n)
    shipped_args, shipped_kwargs = rebuild([_ship(master, x, n) for x in leaves])
    device = _device_of(name, args, kwargs, first)
    if shape is None:  # known from the values only
        out = RemoteTensor(master, n, master.new_id(), device, None)
        order = (Kind.OP, s.id, func, shipped_args, shipped_kwargs, [out.id], True, _what(func))
        master.order(n, order)
        return out
    outs_made, spec = shape
    outs: list[int | None] = []
    results: list[Any] = []
    for made in outs_made:
        if made[0] == _IN:  # changed in place: the input itself (if it lives there)
            same = leaves[made[1]]
            if same.node == n:
                outs.append(None)
                results.append(same)
                continue
            made = (_NEW, torch.empty_like(same.meta))
        if made[0] == _NEW:
            out = RemoteTensor(master, n, master.new_id(), device, made[1])
            outs.append(out.id)
            results.append(out)
        else:
            results.append(made[1])
    master.order(n, (Kind.OP, s.id, func, shipped_args, shipped_kwargs, outs, False, _what(func)))
    return results[0] if spec is None else tree_unflatten(results, spec)


# What the shape cache keeps of each leaf of a result: a new tensor (its meta), an
# input changed in place (its place among the leaves), or a value.
_NEW, _IN, _VALUE = 0, 1, 2
Made: TypeAlias = "tuple[int, Any]"
Shape: TypeAlias = "tuple[list[Made], Any]"  # (the result's leaves, its spec)
_SHAPES: dict[Any, Shape] = {}
_SHAPES_KEPT: Final = 2048


def _shape_of(func: Any, name: str, leaves: list[Any], rebuild: Rebuild) -> Shape | None:
    """What ``func`` makes of its inputs' shapes and dtypes (cached by them); None when
    its shape needs the values."""
    key = _key(func, leaves)
    if key is not None:
        found = _SHAPES.get(key)
        if found is not None:
            cached, cached_spec = found
            fresh = [
                (_NEW, torch.empty_strided(m[1][0], m[1][1], dtype=m[1][2], device="meta"))
                if m[0] == _NEW
                else m
                for m in cached
            ]
            return fresh, cached_spec
    meta = _meta(func, name, leaves, rebuild)
    if meta is None:
        return None
    out_leaves, spec = ([meta], None) if isinstance(meta, torch.Tensor) else tree_flatten(meta)
    inputs = {id(x.meta): i for i, x in enumerate(leaves) if isinstance(x, RemoteTensor)}
    made: list[Made] = []
    for leaf in out_leaves:
        if not isinstance(leaf, torch.Tensor):
            made.append((_VALUE, leaf))
        elif id(leaf) in inputs:
            made.append((_IN, inputs[id(leaf)]))
        else:
            made.append((_NEW, leaf))
    if key is not None:
        if len(_SHAPES) >= _SHAPES_KEPT:
            _SHAPES.clear()
        _SHAPES[key] = (
            [
                (_NEW, (tuple(m[1].shape), m[1].stride(), m[1].dtype)) if m[0] == _NEW else m
                for m in made
            ],
            spec,
        )
    return made, spec


def _key(func: Any, leaves: list[Any]) -> tuple[Any, ...] | None:
    """What a meta result depends on: the function, its tensors' layouts, its other
    arguments (None: one of them cannot be told apart by value)."""
    parts: list[Any] = [func, len(leaves)]
    for x in leaves:
        if isinstance(x, RemoteTensor):
            m = x.meta
            if m is None:
                return None
            parts.append((m.shape, m.dtype, m.stride()))
        elif isinstance(x, torch.Tensor):
            parts.append((x.shape, x.dtype, x.stride()))
        elif x is None or type(x) in _PLAIN:
            parts.append((type(x), x))
        else:
            return None
    return tuple(parts)


_PLAIN: Final = frozenset({int, float, bool, str, torch.dtype, torch.device, torch.Size})


def _meta(func: Any, name: str, leaves: list[Any], rebuild: Rebuild) -> Any:
    """What ``func`` makes of meta tensors; None when its shape needs the values."""
    try:
        margs, mkwargs = rebuild([_to_meta(x) for x in leaves])
        if name in _DEVICE_MOVES:
            dtype = _parse_to(*margs[1:], **mkwargs)[1] if name == "to" else None
            return torch.empty_like(margs[0], dtype=dtype)
        if "device" in mkwargs:
            mkwargs = {**mkwargs, "device": "meta"}
        return func(*margs, **mkwargs)
    except (_Unknown, NotImplementedError):
        return None
    except RuntimeError as exc:
        if "meta" in str(exc):  # no shape function, or one that needs values
            return None
        raise


def _to_meta(x: Any) -> Any:
    if isinstance(x, RemoteTensor):
        if x.meta is None:
            raise _Unknown
        return x.meta
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    return x


class _Unknown(Exception):
    pass


# torch's own reading of ``Tensor.to``'s arguments: (device, dtype, non_blocking, format).
_parse_to: Any = torch._C._nn._parse_to


def _ship(master: Master, x: Any, n: int) -> Any:
    """How operand ``x`` reaches node ``n``: a reference, a push from its node, or itself."""
    if not isinstance(x, RemoteTensor):
        return x
    if x.node == n:
        return Ref(x.id)
    transfer = master.new_id()
    master.order(x.node, (Kind.PUSH, current_stream(x.node).id, x.id, n, transfer))
    return Moved(transfer, x.node)


def _device_of(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], first: RemoteTensor
) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        index = args[1] if len(args) > 1 else kwargs.get("device")
        return (
            torch.device(index)
            if isinstance(index, str | torch.device)
            else torch.device("cuda", index or 0)
        )
    if name == "to":
        rest = [a.meta if isinstance(a, RemoteTensor) else a for a in args[1:]]
        if rest and isinstance(args[1], RemoteTensor):
            return args[1].device
        device = _parse_to(*rest, **kwargs)[0]
        return device if device is not None else first.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else first.device


def _what(func: Any) -> str:
    """How errors name the operation: ``torch.matmul``, ``Tensor.add_``, ``Tensor.T``."""
    if isinstance(func, operator.attrgetter):
        return f"Tensor.{repr(func).split(chr(39))[1]}"  # attrgetter('T')
    name = getattr(func, "__name__", None) or repr(func)
    if hasattr(func, "__objclass__") or getattr(func, "__module__", None) is None:
        return f"Tensor.{name}"  # a method of torch's tensors
    return f"{func.__module__}.{name}"


# --- tensors made on a worker, or sent there ----------------------------------------------------


def factory(
    func: Callable[..., torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> RemoteTensor:
    """``func(*args, **kwargs)`` run on the current worker (``node``), ``node=`` if given."""
    master = current_master()
    chosen = kwargs.pop("node", None)
    n = current_node() if chosen is None else master.check_node(chosen)
    device = kwargs.get("device")
    if isinstance(device, int) and not isinstance(device, bool):
        kwargs["device"] = device = torch.device("cuda", device)  # FloatTensor(10, device=1)
    meta = func(*args, **{**kwargs, "device": "meta"})
    out = RemoteTensor(master, n, master.new_id(), torch.device(device or "cpu"), meta)
    s = current_stream(n)
    master.order(n, (Kind.OP, s.id, func, args, kwargs, [out.id], False, _what(func)))
    return out


def send(t: torch.Tensor, node: int | None = None) -> RemoteTensor:
    """Copy the master's tensor ``t`` to worker ``node`` (the current one if None)."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"send() takes a torch.Tensor, got {type(t).__name__}")
    master = current_master()
    n = current_node() if node is None else master.check_node(node)
    copy = t.detach().cpu().clone()  # what it is now, whatever the caller does to it next
    out = RemoteTensor(master, n, master.new_id(), torch.device("cpu"), copy.to("meta"))
    s = current_stream(n)
    master.order(n, (Kind.OP, s.id, keep, (copy,), {}, [out.id], False, "aiodist.remote.send"))
    return out
