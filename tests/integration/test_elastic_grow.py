"""Elastic jobs that grow: processes join a running job, regroup, receive the state.

The rendezvous server runs in the test's loop; each rank is a subprocess running
``grow_worker.py``, which prints one JSON report. The newcomer is started once
the job has formed (an event of the server, not a sleep).
"""

from __future__ import annotations

import functools
import json
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from aiodist import serve_rendezvous
from tests.helpers import HELPERS
from tests.helpers.procs import run

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from aiodist import RendezvousServer

pytestmark = pytest.mark.slow

WORKER = HELPERS / "grow_worker.py"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the ranks are subprocesses: the test's loop only hosts the server


async def _run(
    server: RendezvousServer, members: int, late: list[str], hi: int, target: int
) -> list[dict[str, Any]]:
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    outs: list[dict[str, Any]] = []

    async def one(role: str) -> None:
        argv = [sys.executable, str(WORKER), url, role, str(members), str(hi), str(target)]
        result = await run(argv, limit=45)
        lines = [ln for ln in result.stdout.splitlines() if ln.startswith("{")]
        assert lines, result.stderr[-3000:]
        out: dict[str, Any] = json.loads(lines[-1])
        out["returncode"] = result.returncode
        out["stderr"] = result.stderr[-3000:]
        outs.append(out)

    def formed(s: RendezvousServer) -> bool:
        job = s.state.jobs.get("grow")
        return job is not None and job.complete

    def grown_to(s: RendezvousServer, n: int) -> bool:
        job = s.state.jobs.get("grow")
        return job is not None and job.world_size >= n

    with anyio.fail_after(45):  # run_process kills its process when cancelled
        async with anyio.create_task_group() as tg:
            for _ in range(members):
                tg.start_soon(one, "member")
            await server.wait_until(formed)
            admitted = 0
            for role in late:  # one by one: each admitted before the next starts
                if role == "stranger":
                    await one(role)  # refused: it never joins
                    continue
                admitted += 1
                tg.start_soon(one, role)
                await server.wait_until(lambda s, n=members + admitted: grown_to(s, n))
    return outs


async def test_newcomer_joins_running_3_rank_job_and_takes_part_in_next_collective(
    server: RendezvousServer,
) -> None:
    outs = await _run(server, 3, ["newcomer"], hi=4, target=4)
    for out in outs:
        assert out["returncode"] == 0, out["stderr"]
    newcomer = next(o for o in outs if o["role"] == "newcomer")
    members = [o for o in outs if o["role"] == "member"]
    # Admitted with the next free rank, which get_rank() answers until it regrouped (the
    # job's rank space its world size; collectives on it wait for regroup); its first
    # view is epoch 1: the three members and itself, itself joined.
    assert newcomer["job_rank"] == 3
    assert newcomer["world_at_start"] == 4
    assert newcomer["first_view"] == [1, [0, 1, 2, 3], [3]]
    assert sorted(o["job_rank"] for o in members) == [0, 1, 2]
    for out in members:
        assert out["first_view"] == [0, [0, 1, 2], []]
        assert out["regroups"] == [[1, [0, 1, 2, 3]]]
    # One group of four, the same on every rank, renumbered in job-rank order.
    for out in outs:
        assert out["group"] == [0, 1, 2, 3]
        assert out["world"] == 4
        assert out["rank"] == out["job_rank"]
    # The members stepped as three before the join (sum 1+2+3), then as four (1+2+3+4).
    rank0 = next(o for o in members if o["rank"] == 0)
    before = [s for s in rank0["steps"] if s[1] == 3]
    after = [s for s in rank0["steps"] if s[1] == 4]
    assert before, "the newcomer joined before the members stepped"
    assert all(s[2] == 6.0 for s in before)
    assert len(after) == 11  # the first step as four, and ten more
    assert all(s[2] == 10.0 for s in after)
    # The newcomer received rank 0's state by broadcast, and took part in every step after.
    step_at_join, w_at_join = newcomer["received"]
    assert step_at_join == len(before)
    assert w_at_join == [6.0 * len(before)] * 3
    assert newcomer["steps"] == after
    # Every rank ends with the same state.
    assert len({json.dumps([o["w"], o["step"]]) for o in outs}) == 1


async def test_newcomer_dying_while_joining_leaves_survivors_in_one_group(
    server: RendezvousServer,
) -> None:
    # The newcomer asks for its view after the death: it still regroups over its join's.
    outs = await _run(server, 3, ["dying", "late-newcomer"], hi=5, target=4)
    dying = next(o for o in outs if o["role"] == "dying")
    assert dying["returncode"] == -9
    alive = [o for o in outs if o["role"] != "dying"]
    for out in alive:
        assert out["returncode"] == 0, out["stderr"]
    # Whatever epoch each survivor saw first, they ended in the same group of four,
    # without the rank that died, and stepped together to the same state.
    groups = {json.dumps(o["group"]) for o in alive}
    assert len(groups) == 1, groups
    (group,) = [o["group"] for o in alive[:1]]
    assert dying["job_rank"] not in group
    assert len(group) == 4
    assert len({json.dumps([o["w"], o["step"]]) for o in alive}) == 1
    for out in alive:
        assert all(s[2] == {3: 6.0, 4: 10.0}[s[1]] for s in out["steps"])


TOKEN = "grow-secret"


@pytest.fixture
async def token_server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RendezvousServer]:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)  # the workers inherit it
    async with anyio.create_task_group() as tg:
        yield await tg.start(functools.partial(serve_rendezvous, token=TOKEN))
        tg.cancel_scope.cancel()


async def test_process_without_the_token_cannot_join_a_formed_elastic_job(
    token_server: RendezvousServer,
) -> None:
    outs = await _run(token_server, 3, ["stranger", "newcomer"], hi=4, target=4)
    stranger = next(o for o in outs if o["role"] == "stranger")
    assert stranger["refused"] == "AuthenticationError"
    # The job went on, and the newcomer that proved the token joined it as rank 3.
    for out in outs:
        assert out["returncode"] == 0, out["stderr"]
        if out["role"] != "stranger":
            assert out["group"] == [0, 1, 2, 3]
