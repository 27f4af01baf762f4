"""Point-to-point order: receives match sends by (sender, group, tag) in send order.

Whatever the size of each message (inline, at the clear-to-send threshold,
through a shared-memory ring, larger than the ring) and whatever the
transport, a later small message never overtakes an earlier large one. The
randomized test draws sequences of tensor and object messages over several
tags and two groups, in both directions at once, posts the receives in a
random order that keeps each key's order, and checks every value.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel
import pytest
import torch

import aiodist
from aiodist._plane.bulk import BULK_MIN_BYTES
from aiodist._transport import shmring
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from aiodist import ProcessGroup, RendezvousServer, Work

# (transport, hostnames): a Unix socket with rings, one without, TCP as between two hosts.
ROUTES: Final = pytest.mark.parametrize(
    ("transport", "hostnames"),
    [("shm", None), ("uds", None), ("tcp", ["host-a", "host-b"])],
    ids=["shm", "uds", "tcp"],
)
RING_BYTES: Final = shmring.SLOT_BYTES * shmring.SLOTS
# Payload sizes in bytes, across every threshold a message may cross.
SIZES: Final = (
    4,
    4096,
    BULK_MIN_BYTES - 4,
    BULK_MIN_BYTES,
    shmring.MIN_RING_BYTES + 4,
    shmring.SLOT_BYTES,
    shmring.SLOT_BYTES + 4,
    RING_BYTES + 4096,
)


def _tensor(ident: int, nbytes: int) -> torch.Tensor:
    # Each message's values say which message it is: a mix-up cannot go unseen.
    return torch.arange(nbytes // 4, dtype=torch.float32) + ident * 1000.0


async def _connect(g: ProcessGroup) -> None:
    # The channel between the two ranks, up: a send then takes the direct path.
    peer = 1 - g.rank
    sent = aiodist.isend_object("hello", peer, group=g)
    assert await aiodist.irecv_object(peer, group=g) == "hello"
    await sent


@ROUTES
async def test_a_small_send_after_a_large_one_does_not_overtake_it(
    server: RendezvousServer, transport: str, hostnames: list[str] | None
) -> None:
    async def body(g: ProcessGroup) -> Any:
        await _connect(g)
        if g.rank == 0:
            sends = [
                aiodist.isend(torch.zeros(500_000), 1, group=g),
                aiodist.isend(torch.tensor([1.0]), 1, group=g),
                aiodist.isend(torch.tensor([2.0]), 1, group=g),
            ]
            for sent in sends:
                await sent
            return None
        got = [torch.ones(500_000), torch.empty(1), torch.empty(1)]
        recvs = [aiodist.irecv(t, 0, group=g) for t in got]
        for w in recvs:
            await w
        return [float(got[0].abs().sum()), float(got[1][0]), float(got[2][0])]

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body, transport=transport, hostnames=hostnames)
    assert outs[1] == [0.0, 1.0, 2.0]


@ROUTES
async def test_an_object_after_a_large_send_keeps_its_place_on_the_channel(
    server: RendezvousServer, transport: str, hostnames: list[str] | None
) -> None:
    # Rank 1 learns from the object that the large send was made; the large receive
    # it posts then must get the large payload, and the small tensor after it, its own.
    async def body(g: ProcessGroup) -> Any:
        await _connect(g)
        if g.rank == 0:
            large = aiodist.isend(_tensor(1, 2 * BULK_MIN_BYTES), 1, group=g)
            small = aiodist.isend(_tensor(2, 8), 1, group=g)
            await aiodist.isend_object("both sent", 1, group=g)
            await small
            await large
            return None
        said = await aiodist.irecv_object(0, group=g)
        big, little = torch.empty(2 * BULK_MIN_BYTES // 4), torch.empty(2)
        await aiodist.recv(big, 0, group=g)
        await aiodist.recv(little, 0, group=g)
        return said, torch.equal(big, _tensor(1, 2 * BULK_MIN_BYTES)), little.tolist()

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body, transport=transport, hostnames=hostnames)
    assert outs[1] == ("both sent", True, [2000.0, 2001.0])


def _plan(seed: int, count: int) -> list[tuple[int, int, str, int]]:
    """``count`` messages for one direction: (group index, tag, "tensor"/"object", bytes)."""
    rng = random.Random(seed)
    return [
        (
            rng.randrange(2),
            rng.randrange(3),
            rng.choice(("tensor", "tensor", "object")),
            rng.choice(SIZES),
        )
        for _ in range(count)
    ]


def _receive_order(seed: int, plan: list[tuple[int, int, str, int]]) -> list[int]:
    """A random order of the plan's indices that keeps each (group, tag, kind)'s order."""
    rng = random.Random(seed)
    queues: dict[tuple[int, int, str], list[int]] = {}
    for i, (group, tag, kind, _) in enumerate(plan):
        queues.setdefault((group, tag, kind), []).append(i)
    order: list[int] = []
    while queues:
        key = rng.choice(sorted(queues))
        order.append(queues[key].pop(0))
        if not queues[key]:
            del queues[key]
    return order


MESSAGES: Final = 24


@ROUTES
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_p2p_sequences_deliver_every_value_in_send_order(
    server: RendezvousServer, transport: str, hostnames: list[str] | None, seed: int
) -> None:
    async def body(g: ProcessGroup) -> list[int]:
        sub = await aiodist.new_group([0, 1], group_desc="order", parent=g)
        await _connect(g)
        groups = (g, sub)
        peer = 1 - g.rank
        rng = random.Random(seed * 10 + g.rank)
        sending = _plan(seed * 100 + g.rank, MESSAGES)
        expected = _plan(seed * 100 + peer, MESSAGES)
        ident = {"sent": g.rank * MESSAGES, "expected": peer * MESSAGES}
        sends: list[Work[Any]] = []
        receives: list[tuple[int, Work[Any], torch.Tensor | None]] = []

        def send(i: int) -> None:
            group, tag, kind, nbytes = sending[i]
            value = ident["sent"] + i
            if kind == "object":
                obj = {"message": value, "pad": b"x" * nbytes}
                sends.append(aiodist.isend_object(obj, peer, group=groups[group], tag=tag))
            else:
                t = _tensor(value, nbytes)
                sends.append(aiodist.isend(t, peer, group=groups[group], tag=tag))

        def post(i: int) -> None:
            group, tag, kind, nbytes = expected[i]
            if kind == "object":
                w = aiodist.irecv_object(peer, group=groups[group], tag=tag)
                receives.append((i, w, None))
            else:
                t = torch.full((nbytes // 4,), -1.0)
                receives.append((i, aiodist.irecv(t, peer, group=groups[group], tag=tag), t))

        # Sends and receives interleaved at random, with loop turns between some of
        # them, so that some receives are posted before their message comes and
        # some after; each key's receives in its send order.
        to_send = list(range(MESSAGES))
        to_post = _receive_order(seed * 7 + g.rank, expected)
        while to_send or to_post:
            if to_send and (not to_post or rng.random() < 0.5):
                send(to_send.pop(0))
            else:
                post(to_post.pop(0))
            if rng.random() < 0.3:
                await anyio.lowlevel.checkpoint()
        wrong = []
        for i, w, t in receives:
            value = ident["expected"] + i
            got = await w
            if t is None:
                ok = got == {"message": value, "pad": b"x" * expected[i][3]}
            else:
                ok = torch.equal(t, _tensor(value, expected[i][3]))
            if not ok:
                wrong.append(i)
        for w in sends:
            await w
        return wrong

    with anyio.fail_after(120):
        outs = await run_ranks(server.address, 2, body, transport=transport, hostnames=hostnames)
    assert outs == [[], []]
