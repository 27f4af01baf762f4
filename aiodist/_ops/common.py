"""What every collective shares: group resolution, tensor views, messages, signatures.

Messages of a collective carry the key ``(COLLECTIVE, group_id, seq, step)``:
``seq`` is the operation's sequence number in its group, ``step`` tells apart
the messages one pair exchanges within it. Their ``meta`` is the sender's
*signature* (operation, dtype, shape, op, root): a receiver that finds it
different from its own raises ``CollectiveMismatchError``, which breaks the
group on every member instead of hanging or reducing garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Final, TypeVar

from aiodist._errors import (
    ArgumentError,
    ArgumentTypeError,
    CollectiveMismatchError,
    ProtocolError,
)
from aiodist._group.inflight import fail
from aiodist._group.lingering import linger
from aiodist._group.world import get_default_group
from aiodist._ops import schedules, staging
from aiodist._wire import codec
from aiodist._wire.keys import MatchKind

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._plane.peers import Key, Received
    from aiodist._wire.frame import Buffer

__all__ = [
    "READY_STEP",
    "Slot",
    "agreed",
    "bridged",
    "byte_view",
    "chain",
    "check_alike",
    "check_rank",
    "check_signature",
    "check_tensor",
    "check_tensor_list",
    "clear_to_send",
    "contiguous",
    "copy_into",
    "divide_",
    "exchange_all",
    "outside",
    "recv",
    "recv_tensor",
    "resolve_group",
    "root_of",
    "send",
    "signature",
]

#: The step of a ring's clear-to-send message, sent to the left neighbour before
#: the right one may send. The shared-memory paths exchange it first too: ranks
#: that disagree on a tensor's size may pick different algorithms, and one
#: message they all share makes them meet and report the mismatch rather than
#: wait for each other until the timeout.
READY_STEP: Final = 1 << 18

#: From this many ranks on, ``exchange_all`` takes ``log2 size`` rounds of fewer
#: messages: 4 ranks send 2 messages each instead of 3.
DISSEMINATE_MIN_RANKS: Final = 4

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger(__name__)

_AGREE_STEP = 1 << 20  # steps of the root-agreement check, apart from the data's steps

#: Elements per torch call on large tensors: torch's GRAIN_SIZE, below which it stays serial.
#: Every rank of a host has its own intra-op thread pool, and when several ranks wake
#: theirs at once they spin against each other (a 256 KiB add took 28 ms with 4 ranks on
#: 2 cores), so the data plane keeps its copies and reductions on the loop's thread.
SLICE_NUMEL = 32768


class LazyModule:
    """Imports a module on first attribute access (keeps ``import aiodist`` torch-free)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        # Only called for names not cached yet: after the first use of ``torch.add``
        # it is a plain instance attribute (an import per call cost ~10 us on hot paths).
        import importlib

        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)
        return value


SIGNATURE_FIELDS = ("op", "dtype", "shape", "reduce_op", "root")


def resolve_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """``group``, else the default group, else None (not initialised: world size 1)."""
    if group is not None:
        return group
    return get_default_group()


class Slot:
    """A call's place in its group's order, taken first; an error before the op starts aborts it.

    ``with Slot(g, "all_gather_object") as seq:`` takes the next sequence number
    (``ProcessGroup.take_seq``; 0 when ``g`` is None, not initialised), then runs
    the call's checks and encoding. If they raise, the call is aborted on every
    member (``ProcessGroup.abort``) and the error goes on to the caller: a call
    that fails on one rank neither leaves the others waiting nor hands its
    number to this rank's next call. Start the operation with ``seq`` after the
    block. With ``torch`` (the call may issue collectives to torch.distributed,
    which cannot leave out one rank's part), a failure breaks the group instead.
    """

    __slots__ = ("description", "g", "seq", "torch")

    def __init__(self, g: ProcessGroup | None, description: str, *, torch: bool = False) -> None:
        self.g = g
        self.description = description
        self.torch = torch
        # A process outside ``g`` takes no place: torch.distributed skips the call there.
        self.seq = 0 if g is None or g.rank < 0 else g.take_seq()

    def __enter__(self) -> int:
        return self.seq

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and self.g is not None and self.seq:
            self.g.abort(self.seq, self.description, exc, torch=self.torch)


def outside(g: ProcessGroup | None) -> bool:
    """True on a process that is not a member of ``g``.

    There, as in torch.distributed, a collective does nothing: it returns at
    once with its tensors untouched (torch warns; aiodist logs at debug level).
    """
    if g is None or g.rank >= 0:
        return False
    logger.debug("skipping a collective of %r on a process outside it", g)
    return True


def chain(work: Work[T], fn: Callable[[T], R], description: str | None = None) -> Work[R]:
    """A handle that resolves to ``fn(result of work)`` once ``work`` is done (on its loop).

    Takes no place in any order: for calls whose one operation is ``work``
    (a torch-form call that copies a result into the caller's tensors).
    """
    from aiodist._group.work import Work

    name = description or work.description
    if work.is_completed():
        try:
            return Work.completed(fn(work.result()), name)
        except Exception as exc:
            return Work.failed(exc, name)
    loop = work._loop
    assert loop is not None
    out: Work[R] = Work.pending(loop, name)

    def done(w: Work[T]) -> None:
        try:
            value = fn(w.result())
        except BaseException as exc:
            out._set_exception(exc)
        else:
            out._set_result(value)

    work._on_done(done)
    return out


def root_of(g: ProcessGroup | None, root: object, group_root: object, name: str) -> int:
    """The group rank that ``name`` (a global rank) or ``group_name`` (a group rank) names.

    torch.distributed's convention: ``src``/``dst`` are global ranks, and
    ``group_src``/``group_dst`` the same rank counted within the group; one of them.

    Raises:
        ValueError: Neither or both given, or not a member of ``g``.
        TypeError: Not an int.
    """
    size = 1 if g is None else g.world_size
    if root is not None and group_root is not None:
        raise ArgumentError(f"Can not specify both {name} and group_{name}")
    if group_root is not None:
        if not isinstance(group_root, int) or isinstance(group_root, bool):
            raise ArgumentTypeError(
                f"group_{name} must be an int rank, got {type(group_root).__name__}"
            )
        if not 0 <= group_root < size:
            raise ArgumentError(f"group_{name}={group_root} is not a rank of a group of {size}")
        return group_root
    if root is None:
        raise ArgumentError(f"Must specify {name} or group_{name}")
    if g is None:
        if not isinstance(root, int) or isinstance(root, bool):
            raise ArgumentTypeError(f"{name} must be an int rank, got {type(root).__name__}")
        if root != 0:
            raise ArgumentError(f"{name} must be 0 when not initialised (world size 1), got {root}")
        return 0
    return g.group_rank_of(root, name)


def bridged(group: ProcessGroup | None, name: str, *args: Any) -> Work[Any] | None:
    """Start collective ``name`` on torch.distributed, or return None for the data plane.

    It goes to torch when ``group`` is bridged (``ProcessGroup.bridge``) and its
    tensors live on the bridge's device. ``args`` are the collective's
    arguments but ``group``.
    """
    g = resolve_group(group)
    if g is None or g.bridge is None:
        return None
    first = args[0]
    if isinstance(first, list | tuple):  # reduce_scatter, all_to_all: a list of tensors
        first = first[0] if first else None
    if not g.bridge.crosses(first):
        return None
    return g.bridge.start_collective(name, args)


def check_tensor(tensor: object, name: str = "tensor") -> torch.Tensor:
    """Return ``tensor`` if the data plane can carry it, else raise ``TypeError``/``ValueError``.

    CPU tensors travel as they are; CUDA tensors are staged through host
    memory (``staging``). A sparse tensor is refused.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(
            f"Invalid function argument: {name} must be a torch.Tensor, got {type(tensor).__name__}"
        )
    if not tensor.is_cpu and not staging.on_device(tensor):
        raise ArgumentError(
            f"{name} is on {tensor.device}; aiodist's data plane carries CPU and CUDA tensors"
        )
    if tensor.layout != torch.strided:
        raise ArgumentError(f"{name} must be a dense (strided) tensor, got {tensor.layout}")
    return tensor


# Dtypes whose numpy array's memoryview casts to bytes directly (a one-character
# buffer format); the others (complex, bfloat16, ...) are viewed as uint8 first.
_NUMPY_VIEWABLE: dict[Any, bool] = {}


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (no copy)."""
    import torch

    assert tensor.is_contiguous()
    if tensor.numel() == 0:
        return memoryview(bytearray(0))
    dtype = tensor.dtype
    direct = _NUMPY_VIEWABLE.get(dtype)
    if direct is None:
        direct = _NUMPY_VIEWABLE[dtype] = _casts_directly(tensor)
    if direct and not tensor.requires_grad:
        return tensor.numpy().data.cast("B")  # the fast way: half the calls
    flat: torch.Tensor = codec.flat_view(tensor)
    return flat.view(torch.uint8).numpy().data.cast("B")


def _casts_directly(tensor: torch.Tensor) -> bool:
    try:
        tensor.detach().numpy().data.cast("B")
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def signature(
    op: str,
    tensor: torch.Tensor | None = None,
    *,
    reduce_op: str | None = None,
    root: int | None = None,
) -> list[Any]:
    """The facts every rank of a collective must agree on, as plain data."""
    if tensor is None:
        return [op, None, None, reduce_op, root]
    return [op, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), reduce_op, root]


def check_signature(group: ProcessGroup, mine: list[Any], msg: Received) -> None:
    """Raise ``CollectiveMismatchError`` if ``msg`` came from a rank that disagrees."""
    theirs = msg.meta
    if theirs == mine:
        return
    src = group.ranks.index(msg.src) if msg.src in group.ranks else msg.src
    for name, a, b in zip(SIGNATURE_FIELDS, mine, theirs, strict=False):
        if a != b:
            values = {group.rank: a, src: b}
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in sorted(values.items()))
            raise CollectiveMismatchError(
                f"ranks disagree on the {name} of collective {mine[0]!r} in group "
                f"{group.name!r}: {shown}. Call collectives in the same order with matching "
                "arguments on every rank.",
                field=name,
                values_by_rank=values,
            )
    raise CollectiveMismatchError(
        f"rank {src} sent {theirs!r} for collective {mine!r}",
        field="op",
        values_by_rank={group.rank: mine, src: theirs},
    )


async def send(
    group: ProcessGroup,
    dst: int,
    seq: int,
    step: int,
    meta: Any,
    payload: Buffer | None,
) -> None:
    """Send a collective's message to group rank ``dst``.

    A peer that found the group broken (say, a mismatch) tells every member,
    then may leave while a large payload to it is still being written: report
    the group's error then, not the closed connection it caused.
    """
    key = (MatchKind.COLLECTIVE, group.group_id, seq, step)
    try:
        await group.session.plane.send(group.ranks[dst], key, meta, payload)
    except ConnectionError:
        group.check_usable()
        raise


def recv(
    group: ProcessGroup,
    src: int,
    seq: int,
    step: int,
    dest: memoryview | None = None,
) -> asyncio.Future[Received]:
    """Post the receive of a collective's message from group rank ``src``."""
    group.check_usable()  # a receive posted after break_() would never be failed
    key = (MatchKind.COLLECTIVE, group.group_id, seq, step)
    return group.session.plane.recv(group.ranks[src], key, dest)


def exchange_all(
    g: ProcessGroup,
    work: Work[Any],
    seq: int,
    mine: list[Any],
    data: memoryview,
    done: Callable[[memoryview], None],
    *,
    step: int = 0,
) -> None:
    """Swap ``data`` with every other rank of ``g``, with no task.

    The path of small collectives (and of the barrier, with no bytes): every
    receive is posted and every send written from the data plane's callbacks.
    Group rank ``r``'s bytes land in row ``r`` of a ``size x data.nbytes``
    staging buffer (this rank's row is a copy of ``data``, which may change
    from now on). Once every row is in and every send was handed to the
    kernel, ``done(staging)`` runs and settles ``work``. A message with
    another signature, a failed peer, an error in ``done``: ``work`` fails by
    the group's rules (``inflight.fail``), which breaks the group on every member.

    Fewer than ``DISSEMINATE_MIN_RANKS`` ranks swap in one round, every rank
    with every other one. More take ``log2 size`` rounds (Bruck's all-gather;
    with no bytes, the dissemination barrier): in round ``k`` a rank sends the
    rows it holds (its own, then those of the ranks before it, up to ``2**k``
    of them) to rank ``r + 2**k`` and gets as many from rank ``r - 2**k``
    (modulo the size), and starts round ``k + 1`` once round ``k``'s message is
    in: ``log2 size`` messages each way instead of ``size - 1``.
    """
    p = g.world_size
    if p >= DISSEMINATE_MIN_RANKS:
        _in_rounds(_Rows(g, work, mine, data, done, 1), seq, step)
    else:
        # Receives still to come, plus one for this rank's sends: however many messages
        # were waiting already, ``done`` runs only once every send went out.
        _in_one_round(_Rows(g, work, mine, data, done, p), seq, step)


class _Rows:
    """One exchange's staging rows, and the countdown to ``done`` (see ``exchange_all``)."""

    __slots__ = ("_done", "_left", "g", "mine", "n", "staging", "work")

    def __init__(
        self,
        g: ProcessGroup,
        work: Work[Any],
        mine: list[Any],
        data: memoryview,
        done: Callable[[memoryview], None],
        left: int,
    ) -> None:
        self.g, self.work, self.mine, self.n = g, work, mine, data.nbytes
        self.staging = memoryview(bytearray(g.world_size * self.n))
        self.row(g.rank)[:] = data
        self._done = done
        self._left = left  # what is still to come before done may run

    def row(self, r: int) -> memoryview:
        return self.staging[r * self.n : (r + 1) * self.n]

    def one_more(self) -> None:
        self._left += 1

    def one_less(self) -> None:
        self._left -= 1
        if self._left == 0 and not self.work.is_completed():
            try:
                self._done(self.staging)
            except Exception as exc:
                self.fail(exc)

    def accepted(self, msg: Received | BaseException) -> Received | None:
        """``msg`` if it is this exchange's to take; else None (the work failed, or had)."""
        if self.work.is_completed():
            return None
        try:
            if isinstance(msg, BaseException):
                raise msg
            check_signature(self.g, self.mine, msg)
        except Exception as exc:
            self.fail(exc)
            return None
        return msg

    def fail(self, exc: BaseException) -> None:
        fail(self.g, self.work, exc, collective=True)

    def send_now(self, dst: int, key: Key, payload: Buffer | None) -> None:
        """Send to group rank ``dst``; a send that cannot finish here finishes in a task."""
        rest = self.g.session.plane.send_now(self.g.ranks[dst], key, self.mine, payload)
        if rest is not None:  # a first connection, or a full socket
            self.one_more()
            _spawn(self.g, _finish_send(self.g, self.work, rest, self.one_less))


def _in_one_round(rows: _Rows, seq: int, step: int) -> None:
    g, work = rows.g, rows.work
    p, me = g.world_size, g.rank
    plane, ranks = g.session.plane, g.ranks
    key = (MatchKind.COLLECTIVE, g.group_id, seq, step)

    def arrived(msg: Received | BaseException) -> None:
        if rows.accepted(msg) is not None:
            rows.one_less()

    for r in range(p):
        if r != me:
            plane.post(ranks[r], key, rows.row(r), arrived)
    for r in schedules.direct_peers(me, p):
        if work.is_completed():
            return  # failed already (a mismatched message was waiting): say no more
        rows.send_now(r, key, rows.row(me))
    rows.one_less()  # every send went out, or is finishing in a task that counts itself


def _in_rounds(rows: _Rows, seq: int, step: int) -> None:
    g, n = rows.g, rows.n
    p, me = g.world_size, g.rank
    plan = schedules.dissemination_partners(me, p)

    def round_(k: int) -> None:
        if rows.work.is_completed():
            return  # failed already: say no more
        if k == len(plan):
            rows.one_less()
            return
        to, frm = plan[k]
        count = min(1 << k, p - (1 << k))  # rows held before this round: 2**k
        key = (MatchKind.COLLECTIVE, g.group_id, seq, step + k)
        held = [rows.row((me - i) % p) for i in range(count)]
        rows.send_now(to, key, b"".join(held) if n else None)

        def arrived(msg: Received | BaseException) -> None:
            got = rows.accepted(msg)
            if got is None:
                return
            try:
                if got.data.nbytes != count * n:
                    raise ProtocolError(f"{got.data.nbytes} bytes where {count * n} belong")
                for i in range(count):  # the rows of frm, frm - 1, ...
                    rows.row((frm - i) % p)[:] = got.data[i * n : (i + 1) * n]
            except Exception as exc:
                rows.fail(exc)
                return
            round_(k + 1)

        g.session.plane.post(g.ranks[frm], key, memoryview(bytearray(count * n)), arrived)

    round_(0)


async def _finish_send(
    g: ProcessGroup,
    work: Work[Any],
    rest: Coroutine[Any, Any, None],
    then: Callable[[], None],
) -> None:
    try:
        try:
            await rest
        except ConnectionError:
            g.check_usable()  # the peer left because the group broke: say why
            raise
    except Exception as exc:
        fail(g, work, exc, collective=True)
    else:
        then()


def _spawn(g: ProcessGroup, coro: Coroutine[Any, Any, None]) -> None:
    task = linger(coro)
    inflight = g.session.inflight
    inflight.add(task)
    task.add_done_callback(inflight.discard)


def check_rank(g: ProcessGroup, rank: object, name: str) -> int:
    """The group rank of global ``rank`` (torch's convention), else ``TypeError``/``ValueError``."""
    return g.group_rank_of(rank, name)


def check_tensor_list(tensors: object, name: str, length: int | None) -> list[torch.Tensor]:
    """Check ``tensors`` is a list of tensors (of ``length``, unless None)."""
    if not isinstance(tensors, (list, tuple)):
        raise ArgumentTypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    out = [check_tensor(t, f"{name}[{i}]") for i, t in enumerate(tensors)]
    if length is not None and len(out) != length:
        raise ArgumentError(f"{name} must hold one tensor per rank ({length}), got {len(out)}")
    return out


def check_alike(tensors: list[torch.Tensor], name: str) -> None:
    """Raise ``ValueError`` unless every tensor has the dtype and shape of the first."""
    first = tensors[0]
    for i, x in enumerate(tensors):
        if x.dtype != first.dtype or x.shape != first.shape:
            raise ArgumentError(f"{name}[{i}] differs from {name}[0] in dtype or shape")


def recv_tensor(
    g: ProcessGroup,
    src: int,
    seq: int,
    step: int,
    dest: torch.Tensor | memoryview | None = None,
) -> asyncio.Future[Received]:
    """Post a receive into ``dest`` (or a new buffer); its failure never goes unretrieved."""
    if dest is not None and not isinstance(dest, memoryview):
        dest = byte_view(dest)
    future = recv(g, src, seq, step, dest)  # checks first that the group is usable
    # A broken group fails every posted receive, including ones an aborted operation no
    # longer awaits; the operation reports the error, so mark it retrieved here.
    future.add_done_callback(_retrieve)
    return future


def _retrieve(future: asyncio.Future[Received]) -> None:
    if not future.cancelled():
        future.exception()


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if contiguous, else a contiguous copy."""
    return t if t.is_contiguous() else t.contiguous()


async def _agree(g: ProcessGroup, seq: int, mine: list[Any]) -> None:
    """Dissemination exchange of signatures: every rank checks ``log2(size)`` others."""
    for k, (to, frm) in enumerate(schedules.dissemination_partners(g.rank, g.world_size)):
        future = recv_tensor(g, frm, seq, _AGREE_STEP + k)
        await send(g, to, seq, _AGREE_STEP + k, mine, None)
        check_signature(g, mine, await future)


async def agreed(g: ProcessGroup, seq: int, mine: list[Any], body: Coroutine[Any, Any, T]) -> T:
    """Run ``body`` beside the signature check; the first error wins."""
    agree, main = linger(_agree(g, seq, mine)), linger(body)  # as the operation's own task
    tasks: tuple[asyncio.Task[Any], ...] = (agree, main)
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                task.result()
        await agree
        return await main
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            elif not task.cancelled():
                task.exception()  # retrieved: ended on its own while this call was cancelled


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` on this thread: one memcpy when both are contiguous and alike."""
    if (
        dst.dtype == src.dtype
        and dst.numel() == src.numel()
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        if dst.numel():
            byte_view(dst)[:] = byte_view(src)
        return
    dst.copy_(src)


def divide_(t: torch.Tensor, divisor: int) -> None:
    """``t /= divisor`` in slices below torch's parallel grain (see ``SLICE_NUMEL``).

    Floating tensors are divided in place; integer and bool ones get
    ``true_divide``'s result copied back (truncated), as mmengine's ``op='mean'`` does.
    """
    if t.numel() <= SLICE_NUMEL or not t.is_contiguous():
        _divide(t, divisor)
        return
    flat = t.view(-1)
    for start in range(0, flat.numel(), SLICE_NUMEL):
        _divide(flat[start : start + SLICE_NUMEL], divisor)


def _divide(t: torch.Tensor, divisor: int) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.div_(divisor)
    else:
        import torch

        t.copy_(torch.true_divide(t, divisor))


async def clear_to_send(g: ProcessGroup, seq: int, mine: list[Any]) -> asyncio.Future[Received]:
    """Tell the left ring neighbour it may send; return the right one's word (check it)."""
    left, right = schedules.ring_neighbours(g.rank, g.world_size)
    ready = recv_tensor(g, right, seq, READY_STEP)
    await send(g, left, seq, READY_STEP, mine, None)
    return ready
