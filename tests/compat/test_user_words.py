"""Errors name the calls the user made, and say what torch says (issue 33, items 8, 11).

Real server, real clients and sockets on 127.0.0.1 (``run_ranks``).
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
import aiodist.sync
from aiodist import CollectiveMismatchError
from aiodist._ops.groups import new_groups
from aiodist._ops.objects import all_gather_object
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from aiodist import ProcessGroup, RendezvousServer


async def test_new_group_called_by_its_members_only_names_new_group(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> Any:
        try:
            if g.rank in (0, 1):
                await new_groups([[0, 1]], parent=g)  # rank 2 never calls new_group
            else:
                await all_gather_object({"x": 1}, group=g)
        except CollectiveMismatchError as exc:
            return exc.field, str(exc)
        return None

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 3, body)
    # Before: "ranks disagree on the op of collective 'all_gather_object'" on every rank.
    for rank, out in enumerate(outs):
        assert out is not None, outs
        field, message = out
        assert field == "op", out
        assert "'new_group'" in message, (rank, message)
    assert "collective 'new_group'" in outs[0][1]
    assert "collective 'all_gather_object'" in outs[2][1]


async def test_scatter_without_src_scatters_from_rank_0_as_torch(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> list[float]:
        parts = [torch.full((2,), float(r)) for r in range(g.world_size)] if g.rank == 0 else None
        out = torch.zeros(2)
        await aiodist.scatter(out, parts, group=g)  # neither src nor group_src
        return out.tolist()

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 3, body)
    # Before: ArgumentError "Must specify src or group_src".
    assert outs == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


async def test_timeouts_and_refusals_carry_torchs_words(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> Any:
        if g.rank == 1:
            # Rank 1 never reaches the barrier: its group breaks when rank 0 gives up.
            with pytest.raises(aiodist.DistError):
                await aiodist.irecv_object(src=0, tag=5, group=g)
            return None
        with pytest.raises(ValueError, match="all_reduce does not support") as refused:
            aiodist.all_reduce(
                torch.ones(2, dtype=torch.complex64), op=aiodist.ReduceOp.MAX, group=g
            )
        with pytest.raises(aiodist.BarrierTimeoutError) as monitored:
            await g.monitored_barrier(timedelta(seconds=0.3))  # torch's method, awaited
        return str(monitored.value), str(refused.value)

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    monitored, refused = outs[0]
    # Before: "ranks [1] never arrived" and "op 'max' does not support complex tensors".
    assert "Rank 1 failed to pass monitoredBarrier" in monitored, monitored
    assert "ranks [1] never arrived" in monitored, monitored  # aiodist's words stay
    assert refused.startswith("all_reduce does not support"), refused
    assert "complex tensors" in refused, refused


async def test_group_timeout_says_timed_out_as_torch(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> str | None:
        g.timeout = 0.5
        if g.rank == 1:
            with pytest.raises(aiodist.DistTimeoutError):  # its group broke with rank 0's
                await aiodist.irecv_object(src=0, tag=6, group=g)
            return None
        with pytest.raises(aiodist.DistTimeoutError) as info:
            await aiodist.all_reduce(torch.ones(1), group=g)  # rank 1 never joins it
        return str(info.value)

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    message = outs[0]
    assert message is not None
    # torch's tests look for "Timed out", "closed" or "timeout": before, only "timed out".
    assert message.startswith("Timed out"), message
    assert "timeout" in message, message
    # torch's own tests match " (Timed out|closed|timeout) ": before, "s (timeout);" did not.
    assert re.search(r" (Timed out|closed|timeout) ", message), message
    assert "init_process_group or new_group" in message, message  # where it is set


def test_get_debug_level_is_torchs() -> None:
    import torch.distributed as dist

    assert aiodist.get_debug_level() == dist.get_debug_level()  # type: ignore[attr-defined]
    assert aiodist.sync.get_debug_level() == dist.get_debug_level()  # type: ignore[attr-defined]


def test_cli_help_and_status_json_speak_to_the_user(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from aiodist._launch.cli import main
    from tests.helpers.procs import free_port

    with pytest.raises(SystemExit):
        main(["--help"])
    # Before: "The only module that prints" (an internal docstring).
    assert "only module" not in capsys.readouterr().out
    port = free_port()
    assert main(["status", "--port", str(port), "--json"]) == 1
    out = capsys.readouterr()
    # Before: plain text only, on stderr.
    report = json.loads(out.out)
    assert report["server"] == f"127.0.0.1:{port}"
    assert "no rendezvous server answers" in report["error"]


async def test_a_groups_torch_methods_run_in_async_code(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> Any:
        t = torch.full((2,), float(g.rank + 1))
        work = g.allreduce([t], aiodist.ReduceOp.MAX)  # torch's method: started at once
        await work
        with pytest.raises(ValueError, match="one tensor"):
            g.allreduce([t, t])
        summed = torch.ones(1)
        await g.allreduce(summed)  # one tensor, the sum by default
        await g.monitored_barrier(timedelta(seconds=10))
        return t.tolist(), summed.item()

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 3, body)
    assert outs == [([3.0, 3.0], 3.0)] * 3


async def test_a_groups_allreduce_takes_torchs_options(server: RendezvousServer) -> None:
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)  # an instance, as torch's callers hold

    async def body(g: ProcessGroup) -> float:
        t = torch.full((1,), float(g.rank + 1))
        await g.allreduce(t, opts)
        return float(t.item())

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [1.0, 1.0]


async def test_a_group_that_is_not_one_is_refused_and_the_group_goes_on(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> Any:
        words = []
        for call in (
            lambda: aiodist.get_world_size("world"),  # type: ignore[arg-type]
            lambda: aiodist.all_reduce(torch.ones(1), group=[0, 1]),  # type: ignore[arg-type]
            lambda: aiodist.isend(torch.ones(1), dst=0, group=g.ranks),  # type: ignore[arg-type]
        ):
            with pytest.raises(TypeError) as refused:
                call()
            words.append(str(refused.value))
        t = torch.ones(1)
        await aiodist.all_reduce(t, group=g)  # the refused calls took no place in its order
        return words, t.item()

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    for words, total in outs:
        # Before: an AttributeError deep inside, or a bound method for a rank.
        assert all(w.startswith("group must be an aiodist process group") for w in words), words
        assert total == 2.0


def test_torchs_non_member_sentinel_before_init_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="NON_GROUP_MEMBER, but aiodist's default group is"):
        aiodist.get_rank(aiodist.GroupMember.NON_GROUP_MEMBER)  # type: ignore[arg-type]
