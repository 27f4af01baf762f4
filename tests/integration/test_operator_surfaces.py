"""What operators read and reach: `aiodist status`, dumps, the metrics port and dashboard.

Each of these takes input that another party controls (a client's host name or
failure reason, a status request, an HTTP connection) and must neither hurt the
operator's terminal nor cost a job or the daemon more than a small bound.
"""

from __future__ import annotations

import os
import sys
import textwrap
from typing import TYPE_CHECKING

import anyio
import pytest

from aiodist import DistError
from aiodist.testing import run_ranks
from tests.helpers.daemon import run_cli
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from aiodist import RendezvousServer

pytestmark = pytest.mark.slow

ESCAPE = "\x1b[2J\x1b]0;owned\x07"

FAILING_RANK = textwrap.dedent(
    """
    import sys
    import aiodist.sync as dist
    dist.init_process_group(init_method=sys.argv[1], world_size=2, rank=int(sys.argv[2]),
                            group_name="hostile", heartbeat_timeout=5.0)
    if dist.get_rank() == 1:
        raise RuntimeError(sys.argv[3])
    try:
        dist.barrier()
    except dist.DistError:
        print("told", flush=True)
    sys.stdin.read()  # stays in the job (its failure on record) until the test is done
    """
)


async def test_status_escapes_a_failure_reason_that_holds_control_characters(
    server: RendezvousServer,
) -> None:
    url = f"tcp://127.0.0.1:{server.address[1]}"
    env = {**os.environ, "AIODIST_TORCH_GROUP": "0"}
    argv = [sys.executable, "-c", FAILING_RANK, url]
    with anyio.fail_after(90):
        async with await open_process([*argv, "0", ""], env=env) as survivor:
            await anyio.run_process([*argv, "1", f"boom {ESCAPE}"], check=False, env=env)
            assert survivor.stdout is not None
            assert b"told" in await survivor.stdout.receive()
            done = await run_cli("status", "--port", str(server.address[1]))
            survivor.kill()
    assert done.returncode == 0, done.stderr
    assert "FAILED rank 1" in done.stdout, done.stdout
    assert "boom" in done.stdout
    assert "\x1b" not in done.stdout
    assert "\x07" not in done.stdout
    assert "\\x1b[2J" in done.stdout


async def test_a_host_name_with_control_characters_is_refused_at_join(
    server: RendezvousServer,
) -> None:
    async def body(_g: object) -> None:
        raise AssertionError("joined")

    with anyio.fail_after(30), pytest.RaisesGroup(DistError, flatten_subgroups=True) as info:
        await run_ranks(server.address, 1, body, hostnames=[f"node{ESCAPE}"])
    (error,) = info.value.exceptions
    assert "Join.host" in str(error)
    assert "printable" in str(error)
