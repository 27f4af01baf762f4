"""Large point-to-point tensors: announced, cleared by the receive, then moved in place.

Ranks run as clients of one loop (``run_ranks``) on the same host (shared
rings) or as if on two hosts (TCP), except the failure tests, whose ranks are
real processes that really die.
"""

from __future__ import annotations

import glob
import json
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
from aiodist._errors import CollectiveMismatchError
from aiodist._plane.bulk import BULK_MIN_BYTES
from aiodist._transport import shm
from aiodist.testing import run_ranks
from tests.helpers.procs import run

if TYPE_CHECKING:
    from pathlib import Path

    from aiodist import ProcessGroup, RendezvousServer

NUMEL = 2 * BULK_MIN_BYTES // 4  # float32 elements of a payload that takes the rendezvous
PATHS = pytest.mark.parametrize(
    "hostnames", [None, ["host-a", "host-b"]], ids=["same-host", "two-hosts"]
)


def _payload(rank: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * (rank + 1)


@PATHS
@pytest.mark.parametrize("blocking", [False, True], ids=["isend-irecv", "send-then-recv"])
async def test_large_sends_both_ways_at_once_complete(
    server: RendezvousServer, hostnames: list[str] | None, blocking: bool
) -> None:
    # Blocking: each rank waits for its own send before posting its receive. Each
    # waits for a clear-to-send the other can only give once its receive is posted;
    # a rank waiting for one clears what it holds, so neither waits for ever.
    async def body(g: ProcessGroup) -> bool:
        peer = 1 - g.rank
        got = torch.empty(NUMEL)
        if blocking:
            await aiodist.send(_payload(g.rank), peer, group=g)
            await aiodist.recv(got, peer, group=g)
        else:
            w = aiodist.irecv(got, peer, group=g)
            await aiodist.isend(_payload(g.rank), peer, group=g)
            await w
        return torch.equal(got, _payload(peer))

    with anyio.fail_after(60):
        assert await run_ranks(server.address, 2, body, hostnames=hostnames) == [True, True]


@PATHS
async def test_large_send_waits_for_its_receive_while_small_messages_pass(
    server: RendezvousServer, hostnames: list[str] | None
) -> None:
    # The receiver takes a small message sent after the large one before it posts
    # the large receive: the announcement must not hold up the channel, and the
    # payload must stay at the sender until the receive is posted.
    sends: dict[str, aiodist.Work[None]] = {}

    async def body(g: ProcessGroup) -> Any:
        plane = g.session.plane
        if g.rank == 0:
            sends["large"] = aiodist.isend(_payload(0), 1, tag=5, group=g)
            sends["small"] = aiodist.isend(torch.tensor([7.0]), 1, tag=6, group=g)
            await sends["large"]
            await sends["small"]
            return None
        small = torch.empty(1)
        await aiodist.recv(small, 0, tag=6, group=g)
        held = [(len(plane.bulk.held), plane.matcher.num_unexpected)]
        not_sent = not sends["large"].is_completed()
        big = torch.empty(NUMEL)
        await aiodist.recv(big, 0, tag=5, group=g)
        return float(small[0]), held, not_sent, torch.equal(big, _payload(0))

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body, hostnames=hostnames)
    assert outs[1] == (7.0, [(1, 1)], True, True)


@PATHS
async def test_a_receive_posted_first_lets_the_send_go_without_announcement(
    server: RendezvousServer, hostnames: list[str] | None
) -> None:
    # Posting the first receive credits the sender, which then sends at once; the
    # second receive is posted only after the second send started: that one waits.
    async def body(g: ProcessGroup) -> Any:
        await aiodist.barrier(group=g)  # channels up both ways before the credit
        if g.rank == 1:
            first, second = torch.empty(NUMEL), torch.empty(NUMEL)
            posted = aiodist.irecv(first, 0, group=g)
            await aiodist.isend_object("posted", 0, group=g)  # after the credit
            await posted
            assert await aiodist.irecv_object(0, group=g) == "second started"
            await aiodist.recv(second, 0, group=g)
            return torch.equal(first, _payload(0)), torch.equal(second, _payload(1))
        assert await aiodist.irecv_object(1, group=g) == "posted"
        bulk = g.session.plane.bulk
        await aiodist.isend(_payload(0), 1, group=g)
        announced_first = bulk.announcements
        w = aiodist.isend(_payload(1), 1, group=g)
        await aiodist.isend_object("second started", 1, group=g)
        await w
        return announced_first, bulk.announcements, bulk.credits

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body, hostnames=hostnames)
    assert outs == [(0, 1, {}), (True, True)]


async def test_large_sends_keep_their_order_and_match_any_source(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> list[int] | None:
        if g.rank != 0:
            await aiodist.isend(_payload(g.rank) + 0, 0, group=g)
            await aiodist.isend(_payload(g.rank) * 2, 0, group=g)  # same key: after the first
            return None
        senders: list[int] = []
        for _ in range(4):
            t = torch.empty(NUMEL)
            src = await aiodist.recv(t, None, group=g)
            first = src not in senders
            assert torch.equal(t, _payload(src) * (1 if first else 2))
            senders.append(src)
        return sorted(senders)

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 3, body)
    assert outs[0] == [1, 1, 2, 2]


async def test_large_send_into_a_smaller_receive_fails_the_receive_only(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> Any:
        if g.rank == 0:
            await aiodist.isend(_payload(0), 1, group=g)  # completes: the receiver took it
            await aiodist.isend(torch.ones(3), 1, tag=1, group=g)
            return "sent"
        with pytest.raises(CollectiveMismatchError) as info:
            await aiodist.recv(torch.empty(NUMEL // 2), 0, group=g)
        after = torch.empty(3)
        await aiodist.recv(after, 0, tag=1, group=g)  # the channel still works
        return info.value.field, after.tolist()

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body)
    assert outs == ["sent", ("shape", [1.0, 1.0, 1.0])]


async def test_a_broken_group_fails_a_send_waiting_for_clear_to_send(
    server: RendezvousServer,
) -> None:
    # Rank 1 never posts the receive; a collective the ranks disagree on breaks the
    # group, and the announced send fails with the group's error instead of hanging,
    # while the receiver lets go of the announcement (it would never be cleared).
    async def body(g: ProcessGroup) -> tuple[str, str | int]:
        pending = aiodist.isend(_payload(0), 1, tag=9, group=g) if g.rank == 0 else None
        with pytest.raises(CollectiveMismatchError):
            await aiodist.all_reduce(torch.ones(4 + g.rank), group=g)
        if pending is None:
            return "receiver", len(g.session.plane.bulk.held)
        with pytest.raises(CollectiveMismatchError) as info:
            await pending
        return "sender", info.value.field

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [("sender", "shape"), ("receiver", 0)]


FAILING_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import anyio, torch
    import aiodist

    async def main() -> None:
        url, rank, victim = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        await aiodist.init_process_group(init_method=url, world_size=2, rank=rank,
                                         group_name="bulk", heartbeat_interval=0.1,
                                         heartbeat_timeout=2.0, timeout=60)
        out = {"rank": rank, "pid": os.getpid()}
        big = torch.ones(1 << 22)  # 16 MiB
        try:
            if victim == "receiver" and rank == 0:  # waits for a clear-to-send
                w = aiodist.isend(big, 1)
                await aiodist.isend_object("announced", 1)  # after the announcement
                await w
            elif victim == "receiver":  # dies holding the announcement
                await aiodist.irecv_object(0)
                print(json.dumps(out), flush=True)
                os._exit(17)
            elif rank == 0:  # the sender: dies once the receive is posted
                w = aiodist.isend(big, 1)
                await aiodist.irecv_object(1)
                print(json.dumps(out), flush=True)
                os._exit(17)
            else:  # posts the receive, clears the payload, waits for it
                await aiodist.isend_object("posting", 0)
                await aiodist.recv(torch.empty(1 << 22), 0)
            out["result"] = "completed"
        except aiodist.DistError as exc:
            out["result"] = [type(exc).__name__, getattr(exc, "rank", None)]
        await aiodist.destroy_process_group()
        print(json.dumps(out), flush=True)

    anyio.run(main)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("shm_on", ["1", "0"], ids=["shm", "sockets"])
@pytest.mark.parametrize(("victim", "survivor"), [("receiver", 0), ("sender", 1)])
async def test_rank_dying_mid_rendezvous_fails_the_other_side_with_its_rank(
    server: RendezvousServer, tmp_path: Path, victim: str, survivor: int, shm_on: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(FAILING_WORKER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        args = [sys.executable, str(script), url, str(rank), victim]
        result = await run(args, limit=90, env={"AIODIST_SHM": shm_on})
        lines = result.stdout.strip().splitlines()
        outs[rank] = json.loads(lines[-1]) if lines else {"stderr": result.stderr}
        outs[rank]["returncode"] = result.returncode

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for rank in range(2):
                tg.start_soon(one, rank)
    assert outs[1 - survivor]["returncode"] == 17, outs
    assert outs[survivor]["returncode"] == 0, outs
    assert outs[survivor]["result"] == ["RankFailedError", 1 - survivor], outs
    for out in outs.values():
        left = glob.glob(f"{shm.SHM_DIR}/{shm.segment_prefix(out['pid'])}*")
        assert not left, f"segments left behind: {left}"
