"""all_reduce through shared memory, for groups whose ranks all run on one host.

Each rank copies its tensor into its own shared segment, then reduces one
chunk of every segment in place of a ring's ``2 (size - 1)`` socket hops:

1. copy in, then tell every peer the segment's name (one small message each,
   at step ``OPEN``: the agreement's opening rides on it);
2. reduce chunk ``rank`` over all segments, in rank order, into the own
   segment, slice by slice, and copy each slice into the tensor; tell every
   peer (the own chunk's input never goes into the segment: only its result);
3. copy every other chunk from its owner's segment; tell every peer, so that
   nobody writes a segment (in a later operation) while it is still read.

Each chunk is computed by one rank and copied by the others, so results are
bitwise identical everywhere. Per rank that is one tensor-sized segment (kept
for later operations) and three small messages to each peer, against a
socket ring's twice-copied ``2 (size - 1) / size`` of the tensor per rank.
Copies go through memoryviews and reductions through ``combine``'s sliced
torch calls, so neither wakes torch's intra-op thread pool (every rank of the
host has one, and they spin against each other).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiodist._ops import schedules
from aiodist._ops.agreement import OPEN
from aiodist._ops.tensors import SLICE_NUMEL, copy_into
from aiodist._wire.codec import byte_view

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._ops.exchange import Exchange
    from aiodist._plane.receives import Received
    from aiodist._transport.shm import Segment, Turn


def usable(g: ProcessGroup) -> bool:
    """Whether ``g`` may use shared memory, as far as this rank can tell at call time.

    True if every rank of ``g`` is on this host and shared memory is on here,
    unless ``g``'s ranks are already known to disagree (see ``agreed``). An
    operation that gets True takes a turn when called, and asks ``agreed``
    when it runs: only that answer is the same on every rank.
    """
    plane = g.session.plane
    return (
        plane.use_shm
        and plane.all_local(g.ranks)
        and plane.shm_agreement.get(g.group_id) is not False
    )


async def agreed(g: ProcessGroup) -> bool:
    """True if every rank of ``g`` turned shared memory on (the same answer on every rank).

    Each rank publishes at join whether it will use shared memory (``AIODIST_SHM``,
    a usable ``/dev/shm``, its user id), and every rank reads the same member
    table, so ranks that mix ``AIODIST_SHM=0`` and ``1`` all fall back to sockets
    instead of waiting for each other in different algorithms. Cached per group.
    """
    return await g.session.plane.shares_memory(g.group_id, g.ranks)


async def _notify_all(ex: Exchange, step: int, payload: bytes | None) -> None:
    for r in schedules.direct_peers(ex.g.rank, ex.g.world_size):  # r + 1 first: the opening
        await ex.send(r, step, payload)


async def _peer_segment(ex: Exchange, src: int, msg: Received) -> Segment:
    """Group rank ``src``'s segment, which ``msg`` names, mapped here."""
    name, _, size = bytes(msg.data).decode().rpartition(":")
    return await ex.g.session.plane.peer_segment(ex.g.group_id, ex.g.ranks[src], name, int(size))


def take_turn(g: ProcessGroup) -> Turn:
    """Call when the operation is called (after ``g.start``); enter it when it runs.

    Operations of one group in flight together take turns on its segments in
    call order, which is the same order on every rank.
    """
    return g.session.plane.segments.take_turn(g.group_id)


async def broadcast(ex: Exchange, buf: torch.Tensor, root: int) -> None:
    """Copy contiguous ``buf`` from ``root`` to every rank through ``root``'s segment.

    The root copies in and tells every rank where; each copies out and says so,
    and the root returns once nobody reads its segment any more. Not every
    ring pair exchanges a message: its exchange opens on its own (steps from 1).
    """
    g = ex.g
    segments = g.session.plane.segments
    flat = buf.view(-1)
    numel = flat.numel()
    if g.rank == root:
        seg = segments.own(g.group_id, numel * flat.element_size())
        done = [ex.recv(r, 2) for r in schedules.direct_peers(root, g.world_size)]
        copy_into(seg.tensor(buf.dtype, numel), flat)
        await _notify_all(ex, 1, f"{seg.name}:{seg.nbytes}".encode())
        for future in done:
            await future
        segments.unlink_own(g.group_id)  # every peer has mapped it by now
        return
    msg = await ex.recv(root, 1)
    copy_into(flat, (await _peer_segment(ex, root, msg)).tensor(buf.dtype, numel))
    await ex.send(root, 2, None)


async def all_reduce(
    ex: Exchange,
    buf: torch.Tensor,
    op: str,
    combine: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> None:
    """Reduce contiguous ``buf`` in place across the group (see the module docstring)."""
    g = ex.g
    p, me = g.world_size, g.rank
    segments = g.session.plane.segments
    flat = buf.view(-1)
    numel = flat.numel()
    nbytes = numel * flat.element_size()
    seg = segments.own(g.group_id, nbytes)
    own = seg.tensor(buf.dtype, numel)
    peers = schedules.direct_peers(me, p)
    notices = [{r: ex.recv(r, OPEN + k) for r in peers} for k in range(3)]
    bounds = schedules.chunk_bounds(numel, p)
    a, b = bounds[me]
    # Peers read only the result of this rank's own chunk (written below), not its input.
    copy_into(own[:a], flat[:a])
    copy_into(own[b:], flat[b:])
    await _notify_all(ex, OPEN, f"{seg.name}:{seg.nbytes}".encode())
    parts: list[torch.Tensor] = [flat] * p
    for r, future in notices[0].items():
        parts[r] = (await _peer_segment(ex, r, await future)).tensor(buf.dtype, numel)
    _reduce_chunk(op, combine, parts, own, flat, a, b)
    await _notify_all(ex, OPEN + 1, None)
    for future in notices[1].values():
        await future
    segments.unlink_own(g.group_id)  # every peer has mapped it by now
    for r in peers:
        lo, hi = bounds[r]
        copy_into(flat[lo:hi], parts[r][lo:hi])
    await _notify_all(ex, OPEN + 2, None)
    for future in notices[2].values():
        await future


def _reduce_chunk(
    op: str,
    combine: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], None],
    parts: list[torch.Tensor],
    own: torch.Tensor,
    flat: torch.Tensor,
    a: int,
    b: int,
) -> None:
    # Slice by slice, all parts in rank order into the segment, then into ``flat``: each
    # slice stays in cache from the first add to the copy, where whole-chunk passes would
    # stream the chunk through memory once per part. ``flat`` is ``parts[rank]``: each
    # slice of it is read before it is overwritten.
    flat_bytes, own_bytes = byte_view(flat), byte_view(own)
    size = flat.element_size()
    for start in range(a, b, SLICE_NUMEL):
        stop = min(start + SLICE_NUMEL, b)
        out = own[start:stop]
        combine(op, out, parts[0][start:stop], parts[1][start:stop])
        for part in parts[2:]:
            combine(op, out, out, part[start:stop])
        flat_bytes[start * size : stop * size] = own_bytes[start * size : stop * size]


async def all_gather(ex: Exchange, src: torch.Tensor, out: list[torch.Tensor]) -> None:
    """Fill ``out[r]`` (contiguous, shaped like ``src``) with rank ``r``'s ``src``.

    Every rank copies its tensor into its own segment and says where; each then
    copies every other rank's part straight out of that rank's segment into
    ``out`` and says so, and returns once nobody reads its segment any more:
    one copy in and ``size - 1`` out per rank, against a ring's ``size - 1``
    socket sends each copied twice.
    """
    g = ex.g
    segments = g.session.plane.segments
    flat = src.reshape(-1)
    numel = flat.numel()
    seg = segments.own(g.group_id, numel * flat.element_size())
    peers = schedules.direct_peers(g.rank, g.world_size)
    notices = [{r: ex.recv(r, OPEN + k) for r in peers} for k in range(2)]
    copy_into(seg.tensor(src.dtype, numel), flat)
    await _notify_all(ex, OPEN, f"{seg.name}:{seg.nbytes}".encode())
    copy_into(out[g.rank].view(-1), flat)
    for r, future in notices[0].items():
        peer = await _peer_segment(ex, r, await future)
        copy_into(out[r].view(-1), peer.tensor(src.dtype, numel))
    await _notify_all(ex, OPEN + 1, None)
    for future in notices[1].values():
        await future
    segments.unlink_own(g.group_id)  # every peer has mapped it by now


async def reduce_scatter(
    ex: Exchange,
    inputs: list[torch.Tensor],
    out: torch.Tensor,
    op: str,
    combine: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> None:
    """Reduce contiguous ``inputs[rank]`` of every rank into contiguous ``out``, in rank order.

    Every rank copies the parts meant for the others into its own segment and
    says where; each then reduces its part straight out of the peers' segments
    (and its own input) into ``out``, slice by slice, says so, and returns once
    nobody reads its segment any more.
    """
    g = ex.g
    p, me = g.world_size, g.rank
    segments = g.session.plane.segments
    numel = out.numel()
    part_bytes = numel * out.element_size()
    seg = segments.own(g.group_id, p * part_bytes)
    own = seg.tensor(out.dtype, p * numel)
    peers = schedules.direct_peers(me, p)
    notices = [{r: ex.recv(r, OPEN + k) for r in peers} for k in range(2)]
    for r in peers:
        copy_into(own[r * numel : (r + 1) * numel], inputs[r].view(-1))
    await _notify_all(ex, OPEN, f"{seg.name}:{seg.nbytes}".encode())
    parts = [inputs[me].view(-1)] * p
    for r, future in notices[0].items():
        peer = await _peer_segment(ex, r, await future)
        parts[r] = peer.tensor(out.dtype, p * numel)[me * numel : (me + 1) * numel]
    flat = out.view(-1)
    for start in range(0, numel, SLICE_NUMEL):
        stop = min(start + SLICE_NUMEL, numel)
        dst = flat[start:stop]
        combine(op, dst, parts[0][start:stop], parts[1][start:stop])
        for part in parts[2:]:
            combine(op, dst, dst, part[start:stop])
    await _notify_all(ex, OPEN + 1, None)
    for future in notices[1].values():
        await future
    segments.unlink_own(g.group_id)  # every peer has mapped it by now
