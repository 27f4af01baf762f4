"""The one set-up every collective shares: ``run(call, start)``.

A public function reads its arguments into a ``Call`` (``forms``,
``object_forms``) and hands it here with its algorithm's ``start``. ``run``
then, in this order:

1. resolves the group (the default group; None when nothing is initialised);
2. takes the call's place in the group's order (``Slot``) before anything
   else, so that a call failing its checks on one rank still holds its number
   there and aborts it on every member (a group that cannot take the call,
   broken or closed, says so; but bad arguments are said first: they are this
   rank's own error, and torch raises them whatever the group's state);
3. runs the call's checks, which return the canonical ``Request``, or its
   answer when nothing is to be sent (a process outside the group, world size 1);
4. hands a call whose tensors a torch bridge carries to torch.distributed
   (``ProcessGroup.bridge``; a failed check then breaks the group, since torch
   cannot leave out one rank's part);
5. stages a call on device tensors through host memory (``staging``): the
   same request on host copies, its results copied back;
6. starts the algorithm: ``start(g, seq, request)``, which returns the ``Work``;
   the request's ``deliver`` makes the call's value of the result (torch's
   output lists filled, mmengine's new tensors returned).

Point-to-point takes no place in a group's order: ``run_p2p(name, ..., start)``
is its set-up, shared by tensors and objects (``p2p``, ``p2p_objects``): the
group (one is needed), the answer outside it, the tag, the peer (never this
rank for a send), then ``start`` and the flight recorder.
"""

from __future__ import annotations

import dataclasses
import logging
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, TypeVar

from aiodist._errors import ArgumentError
from aiodist._group.group import ProcessGroup
from aiodist._group.work import Work
from aiodist._group.world import as_group, default_group_for, group_or_default
from aiodist._ops import staging
from aiodist._ops.requests import NOT_DONE

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from aiodist._group.group import Bridge
    from aiodist._ops.requests import Call, Request

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


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


def run(call: Call, start: Callable[[ProcessGroup, int, Request], Work[Any]]) -> Work[Any]:
    """Make ``call``: the set-up every collective shares (the module docstring), then ``start``."""
    called = perf_counter_ns()
    g = call.group
    if g is None:
        g = default_group_for(call.name)
    elif type(g) is not ProcessGroup:
        g = as_group(g)  # torch's group over the job: the aiodist group under it
    bridge = None if g is None or g.bridge is None else _bridge_for(g, call.first)
    torch = bridge is not None or (call.torch and g is not None and g.bridge is not None)
    try:
        slot = Slot(g, call.name, torch=torch)
    except Exception:
        call.check(g)  # bad arguments are this rank's own error: said before the group's
        raise
    with slot as seq:
        req = call.check(g)
        if req.answer is not NOT_DONE:
            if g is not None and g.rank < 0:
                logger.debug("skipping %s on a process outside %r", call.name, g)
            return Work.completed(req.answer)
        assert g is not None
        if bridge is not None and req.op.torch:
            work = _delivered(bridge.start_collective(req, seq), req)
            record(g, work, call.name, seq, req.first, called)
            return work
    first = req.first
    if first is not None and staging.on_device(first):
        work = _staged(g, seq, req, start)
    else:
        work = _delivered(start(g, seq, req), req)
    record(g, work, call.name, seq, first, called)
    return work


def record(
    g: ProcessGroup, work: Work[Any], name: str, seq: int, first: Any, at: int, peer: int = -1
) -> None:
    """Record the call in its session's flight recorder (``_group/recorder.py``)."""
    rec = g.session.recorder
    if rec is None:
        return
    if first is None:
        rec.record(work, name, g.name, seq, peer, None, None, at)
    else:
        rec.record(work, name, g.name, seq, peer, first.dtype, first.shape, at)


# --- point to point -------------------------------------------------------------------


def run_p2p(
    name: str,
    group: ProcessGroup | None,
    peer: int | None,
    group_peer: int | None,
    tag: int,
    start: Callable[[ProcessGroup, int | None], tuple[Work[T], torch.Tensor | None]],
    *,
    sends: bool,
    outside: Any = None,
    user_tag: bool = True,
) -> Work[T]:
    """Make point-to-point call ``name``: the set-up every one shares, then ``start(g, peer)``.

    The call names its group, its peer (``peer`` a global rank or ``group_peer``
    a rank of the group) and its tag, read as they are here, with no request
    object in between (the small-message path pays for every one). ``sends``:
    a send, whose peer must be given and must not be this rank; a receive's
    peer may be None (any rank). ``outside`` is the call's value on a process
    outside the group (torch.distributed's: nothing happens there).
    ``user_tag``: the tag is the caller's (an int >= 0); else aiodist's own.

    ``start`` gets the group and the peer's global rank (None: any rank) and
    returns the call's ``Work`` and its tensor (None for objects), which the
    flight recorder notes.
    """
    called = perf_counter_ns()
    g = group_or_default(group, name)
    if g.rank < 0:
        return Work.completed(outside)
    if user_tag and (type(tag) is not int or tag < 0):  # the usual tag needs no call
        _check_tag(tag)
    if sends or peer is not None or group_peer is not None:
        peer = peer_of(g, peer, group_peer, "dst" if sends else "src")
    if sends and peer == g.session.rank:
        raise ArgumentError(
            "Invalid destination rank: destination rank should not be the same as the rank "
            "of the current process."
        )
    work, first = start(g, peer)
    record(g, work, name, 0, first, called, -1 if peer is None else peer)
    return work


def peer_of(g: ProcessGroup, peer: int | None, group_peer: int | None, name: str) -> int:
    """The global rank named by ``peer`` (global) or ``group_peer`` (a rank of ``g``)."""
    if group_peer is None:
        if peer is None:
            raise ArgumentError(f"Must specify {name} or group_{name}")
        # A member, as in torch.distributed; its job rank (renumbered after shrink_group).
        return g.job_rank_of(peer, name)
    if peer is not None:
        raise ArgumentError(f"Can not specify both {name} and group_{name}")
    if not isinstance(group_peer, int) or not 0 <= group_peer < g.world_size:
        raise ArgumentError(f"group_{name}={group_peer!r} is not a rank of {g!r}")
    return g.global_rank(group_peer)


def _check_tag(tag: object) -> None:
    if not isinstance(tag, int) or isinstance(tag, bool) or tag < 0:
        raise ArgumentError(f"tag must be an int >= 0, got {tag!r}")


def _bridge_for(g: ProcessGroup, first: object) -> Bridge | None:
    """``g``'s torch bridge if it carries ``first`` (a tensor, or a list of them)."""
    if g.bridge is None:
        return None
    if isinstance(first, list | tuple):  # reduce_scatter, all_to_all: a list of tensors
        first = first[0] if first else None
    return g.bridge if g.bridge.crosses(first) else None


def _delivered(work: Work[Any], req: Request) -> Work[Any]:
    if req.outputs is None and req.resolve is None:
        return work
    return chain(work, req.deliver)


def _staged(
    g: ProcessGroup,
    seq: int,
    req: Request,
    start: Callable[[ProcessGroup, int, Request], Work[Any]],
) -> Work[Any]:
    """The same request on host copies of its device tensors; the results copied back."""
    whole_in, whole_out = req.whole_inputs, req.whole_outputs
    named = [*([req.tensor] if req.tensor is not None else [])]
    named += [whole_in.tensor] if whole_in is not None else req.inputs
    first = req.first
    assert first is not None
    host_out: list[torch.Tensor] = []  # host buffers for the caller's outputs, to copy back

    def on_host(hosts: list[torch.Tensor]) -> Work[Any]:
        tensor = hosts[0] if req.tensor is not None else None
        rest = hosts[1:] if req.tensor is not None else hosts
        outputs = None
        if whole_out is not None:
            host_out.append(staging.host_buffer(whole_out.tensor))
            outputs = whole_out.cut(host_out[0])
        elif req.outputs is not None:
            host_out.extend(staging.host_buffer(o) for o in req.outputs)
            outputs = list(host_out)
        # The same request on the host copies: what it was cut from and what makes its
        # value (``whole``, ``resolve``) stay with the caller's request (``back``).
        host = dataclasses.replace(
            req,
            tensor=tensor,
            inputs=whole_in.cut(rest[0]) if whole_in is not None else rest,
            outputs=outputs,
            whole_inputs=None,
            whole_outputs=None,
            resolve=None,
            shm=False,
        )
        return chain(start(g, seq, host), host.filled)

    def back(hosts: list[torch.Tensor], got: Any) -> Any:
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if req.in_place and req.tensor is not None:
            pairs.append((req.tensor, hosts[0]))
        if host_out:  # the caller's outputs, filled on the host
            outs = req.outputs
            assert outs is not None
            pairs += zip(
                [whole_out.tensor] if whole_out is not None else outs, host_out, strict=True
            )
            value: Any = outs if isinstance(got, list) else outs[0]
        elif isinstance(got, list):
            new, value = staging.new_on_device(got, first)
            pairs += new
        elif got is hosts[0] and req.tensor is not None:
            value = req.tensor
        else:
            new, (value,) = staging.new_on_device([got], first)
            pairs += new
        return pairs, value if req.resolve is None else req.resolve(value)

    return staging.staged(g, seq, req.description, named, on_host, back)


def chain(work: Work[T], fn: Callable[[T], R], description: str | None = None) -> Work[R]:
    """A handle that resolves to ``fn(result of work)`` once ``work`` is done (on its loop).

    Takes no place in any order: for calls whose one operation is ``work``
    (a torch-form call that copies a result into the caller's tensors).
    """
    name = description or work.description
    if work.is_completed():
        try:
            return Work.completed(fn(work.result()), name)
        except Exception as exc:
            return Work.failed(exc, name)
    loop = work.loop
    assert loop is not None
    out: Work[R] = Work.pending(loop, name)

    def done(w: Work[T]) -> None:
        try:
            value = fn(w.result())
        except BaseException as exc:
            out.set_exception(exc)
        else:
            out.set_result(value)

    work.when_done(done)
    return out
