"""Situations that used to wait in silence, in real processes: each must now end at once.

- processes of one job that disagree on ``world_size``;
- a process claiming a rank another one holds;
- a rank that leaves cleanly (``destroy_process_group``) while another waits on it;
- the rendezvous daemon killed (or frozen) under ranks that are idle or in a collective;
- Ctrl-C in a plain script blocked in an ``aiodist.sync`` call.

Every rank is a subprocess printing JSON lines with ``time.monotonic()`` stamps
(one clock for the whole machine on Linux), so the tests measure how long each
wait took; every operation's own timeout is far longer than the bound asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any, BinaryIO

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from aiodist import open_process_group
from tests.helpers.daemon import asyncio_only, serve
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from anyio.abc import Process

    from aiodist import RendezvousServer

pytestmark = pytest.mark.slow

# Far longer than any bound below: only the behaviour under test can end the waits.
OP_TIMEOUT = 600.0

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    import anyio
    import aiodist

    def report(**fields):
        print(json.dumps({"t": time.monotonic(), "pid": os.getpid(), **fields}), flush=True)

    def describe(exc):
        return {"type": type(exc).__name__, "rank": getattr(exc, "rank", None),
                "host": getattr(exc, "host", None), "pid": getattr(exc, "pid", None),
                "message": str(exc)}

    async def init(url, rank, world, **kwargs):
        if url == "env://":  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from the test
            await aiodist.init_process_group(timeout=OP_TIMEOUT, **kwargs)
        else:
            await aiodist.init_process_group(init_method=url, world_size=world, rank=rank,
                                             timeout=OP_TIMEOUT, **kwargs)

    async def join(url, rank, world):
        try:
            await init(url, rank, world, group_name="joins", hostname=os.environ["HOST_NAME"])
        except aiodist.DistError as exc:
            report(error=describe(exc))
            return
        report(joined=True)
        await aiodist.destroy_process_group()

    async def leave(url, rank, world):
        # Rank 0 waits on rank 1 (OP: recv or a collective); rank 1 leaves meanwhile.
        import torch
        op, warm = os.environ["OP"], os.environ["WARM"] == "1"
        await init(url, rank, world, group_name="leave", hostname=f"host-{rank}")
        store = aiodist.get_store()
        if warm:  # a data channel between the two ranks exists before the leave
            await aiodist.all_reduce(torch.ones(4))
        if rank == 1:
            await store.wait(["waiting"])
            report(leaving=True)
            await aiodist.destroy_process_group()
            return
        work = aiodist.irecv(torch.zeros(4), src=1) if op == "recv" else aiodist.barrier()
        await store.set("waiting", b"")
        try:
            await work
            report(completed=True)
        except aiodist.DistError as exc:
            report(error=describe(exc))
        start = time.monotonic()  # an operation that needs rank 1 now fails at once
        try:
            await aiodist.recv(torch.zeros(4), src=1)
        except aiodist.DistError as exc:
            report(later=describe(exc), waited=time.monotonic() - start)
        await aiodist.destroy_process_group()

    async def leave_unneeded(url, rank, world):
        # Rank 2 leaves while nobody waits on it: ranks 0 and 1 go on together.
        await init(url, rank, world, group_name="unneeded", hostname=f"host-{rank}")
        store = aiodist.get_store()
        if rank == 2:
            await store.set("bye", b"")
            await aiodist.destroy_process_group()
            return
        await store.wait(["bye"])
        try:
            await aiodist.irecv_object(src=2)  # it needs rank 2: fails once rank 2 is gone
            report(completed=True)
        except aiodist.DistError as exc:
            report(error=describe(exc))
        peer = 1 - rank
        await aiodist.isend_object({"from": rank}, dst=peer)
        got = await aiodist.irecv_object(src=peer)
        await store.set(f"after/{rank}", b"1")
        report(got=got, keys=await store.num_keys())
        await aiodist.destroy_process_group()

    async def server_gone(url, rank, world):
        # Ranks in IDLE do nothing; the others enter a barrier they never complete.
        idle = {int(r) for r in os.environ["IDLE"].split(",") if r}
        await init(url, rank, world, group_name="gone", heartbeat_interval=0.1,
                   heartbeat_timeout=float(os.environ["HB_TIMEOUT"]))
        await aiodist.barrier()  # every data channel is up
        group = aiodist.get_default_group()
        report(ready=True)
        if rank in idle:
            await group.session.trouble()  # what a rank idle in anyio.sleep misses
            # Its own watch on the server, or a peer's word that the group broke.
            report(noticed=describe(group.session.error or group.error))
            start = time.monotonic()
            try:
                await aiodist.barrier()
            except aiodist.DistError as exc:
                report(error=describe(exc), waited=time.monotonic() - start)
        else:
            try:
                await aiodist.barrier()
                report(completed=True)
            except aiodist.DistError as exc:
                report(error=describe(exc))
        await aiodist.destroy_process_group()

    async def main():
        mode, url, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        await globals()[mode](url, rank, world)

    OP_TIMEOUT = float(os.environ.get("OP_TIMEOUT", "600"))
    anyio.run(main)
    """
)

SYNC_WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import aiodist.sync as dist

    def blocked(frame):
        # The main thread waits on a lock inside aiodist's blocking call (no Python runs);
        # for "wait", inside Work.wait itself, not in the barrier's submission before it
        # (a Ctrl-C there interrupts a blocking call, which closes the group at once).
        frames = []
        while frame is not None:
            frames.append((frame.f_code.co_filename, frame.f_code.co_name))
            frame = frame.f_back
        if not frames or not frames[0][0].endswith("threading.py"):
            return False
        if op == "wait":
            return any(f.endswith("work.py") and name == "wait" for f, name in frames)
        return any("aiodist" in f for f, _ in frames)

    def announce():
        main = threading.main_thread().ident
        while not blocked(sys._current_frames().get(main)):
            time.sleep(0.001)  # a state to see, not an event to wait for
        print(json.dumps({"blocking": op, "pid": os.getpid()}), flush=True)
        if op.endswith("elsewhere"):  # the kernel may hand SIGINT to any thread
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    url, op = sys.argv[1], sys.argv[2]
    if op == "recv":
        import torch
        tensor = torch.zeros(1)
    dist.init_process_group(init_method=url, world_size=2, rank=0, group_name="ctrl-c",
                            timeout=600)
    threading.Thread(target=announce, daemon=True).start()
    try:
        if op.startswith("barrier"):
            dist.barrier()  # rank 1 never comes (a Work-returning operation)
        elif op == "torch-elsewhere":
            import torch.distributed
            torch.distributed.barrier()  # torch's call, on the aiodist backend
        elif op == "wait":
            dist.barrier(async_op=True).wait()  # the same, through its handle
        else:
            dist.recv(tensor, src=1)  # rank 1 never sends (a plain coroutine)
    except KeyboardInterrupt:
        print(json.dumps({"interrupted": time.monotonic(),
                          "initialized": dist.is_initialized()}), flush=True)
        raise
    """
)


class Rank:
    """A worker process and its JSON lines."""

    def __init__(self, proc: Process, stderr: Path) -> None:
        self.proc = proc
        self.stderr = stderr
        assert proc.stdout is not None
        self._out = BufferedByteReceiveStream(proc.stdout)

    async def line(self) -> dict[str, Any]:
        try:
            raw = await self._out.receive_until(b"\n", 1 << 20)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            raise AssertionError(f"the worker printed no more: {self.stderr.read_text()}") from None
        out: dict[str, Any] = json.loads(raw)
        return out


def _create(path: Path) -> BinaryIO:
    return path.open("wb")  # a local file: opening it does not block the loop


@contextlib.asynccontextmanager
async def spawn(
    tmp_path: Path, script: str, args: list[str], env: dict[str, str] | None = None
) -> AsyncIterator[Rank]:
    """Run ``script`` with ``args``; kill it on the way out if it is still running."""
    path = tmp_path / "worker.py"
    if not path.exists():
        path.write_text(script)
    stderr = tmp_path / f"stderr-{args[0]}-{args[2]}-{time.monotonic_ns()}.txt"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    with _create(stderr) as err:
        proc = await open_process(
            [sys.executable, str(path), *args], env={**full_env, **(env or {})}, stderr=err
        )
    try:
        yield Rank(proc, stderr)
    finally:
        if proc.returncode is None:
            proc.kill()
        with anyio.CancelScope(shield=True):
            await proc.wait()
        await proc.aclose()


def _url(server: RendezvousServer) -> str:
    return f"tcp://{server.address[0]}:{server.address[1]}"


# --- world_size disagreement --------------------------------------------------------


async def test_world_size_disagreement_fails_every_waiting_process_within_seconds(
    server: RendezvousServer, tmp_path: Path
) -> None:
    url = _url(server)
    with anyio.fail_after(60):
        async with spawn(tmp_path, WORKER, ["join", url, "0", "2"], {"HOST_NAME": "h2"}) as a:
            await server.wait_for_members("joins", 1)  # a waits for a job of 2 to form
            started = time.monotonic()
            async with spawn(tmp_path, WORKER, ["join", url, "1", "3"], {"HOST_NAME": "h3"}) as b:
                out_b = await b.line()
                assert await b.proc.wait() == 0
            out_a = await a.line()
            assert await a.proc.wait() == 0
    for out in (out_a, out_b):
        assert out["error"]["type"] == "RendezvousError", out
        message = out["error"]["message"]
        assert "world_size" in message
        assert "joined with 2" in message
        assert f"pid {out_b['pid']} on host h3 with 3" in message
        assert "Start every rank with the same world size" in message
        print(f"world sizes 2 and 3: refused after {out['t'] - started:.3f} s")
        assert out["t"] - started < 5.0  # not the 600 s join timeout
    assert out_a["error"]["message"] == out_b["error"]["message"]  # the same error for all
    assert server.state.jobs == {}  # the job that could not form is dropped


# --- rank taken -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "formed"),
    [("explicit", False), ("env", False), ("explicit", True), ("env", True)],
)
async def test_rank_taken_refused_at_once_naming_rank_and_host(
    server: RendezvousServer, tmp_path: Path, given: str, formed: bool
) -> None:
    # The holder of rank 1 is a member in this process, on host "holder-host"; the
    # claimant a process told rank 1 by argument or by RANK (env://).
    world = 2 if formed else 3
    host, port = server.address
    if given == "env":
        args = ["join", "env://", "-1", "-1"]
        env = {"RANK": "1", "WORLD_SIZE": str(world), "MASTER_ADDR": host}
        env["MASTER_PORT"] = str(port)
    else:
        args, env = ["join", _url(server), "1", str(world)], {}
    env["HOST_NAME"] = "claimant-host"
    holders = [0, 1] if formed else [1]

    async def member(rank: int) -> None:
        async with open_process_group(
            _url(server), world_size=world, rank=rank, group_name="joins", hostname=f"h{rank}"
        ):
            await anyio.sleep_forever()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for rank in holders:
                tg.start_soon(member, rank)
            await server.wait_for_members("joins", len(holders))
            started = time.monotonic()
            async with spawn(tmp_path, WORKER, args, env) as claimant:
                out = await claimant.line()
                assert await claimant.proc.wait() == 0
            job = server.state.jobs["joins"]
            assert len(job.members) == len(holders)  # the holders go on
            assert job.complete is formed
            assert job.failures == []
            tg.cancel_scope.cancel()
    error = out["error"]
    assert error["type"] == "RendezvousError"
    assert (
        f"rank 1 of job 'joins' is already taken by pid {os.getpid()} on host h1"
        in error["message"]
    )
    assert "give every process its own rank" in error["message"]
    print(f"rank taken ({given}, formed={formed}): refused after {out['t'] - started:.3f} s")
    assert out["t"] - started < 5.0


# --- a rank that leaves cleanly ------------------------------------------------------


@pytest.mark.parametrize("warm", [True, False], ids=["channel-open", "no-channel"])
@pytest.mark.parametrize("op", ["recv", "barrier"])
async def test_rank_leaving_fails_the_rank_waiting_on_it_at_once_saying_it_left(
    server: RendezvousServer, tmp_path: Path, op: str, warm: bool
) -> None:
    url = _url(server)
    env = {"OP": op, "WARM": "1" if warm else "0"}
    with anyio.fail_after(60):
        async with (
            spawn(tmp_path, WORKER, ["leave", url, "0", "2"], env) as waiter,
            spawn(tmp_path, WORKER, ["leave", url, "1", "2"], env) as leaver,
        ):
            # (The heartbeat timeout is the default 10 s; the operations' timeout 600 s.)
            left = await leaver.line()
            assert await leaver.proc.wait() == 0
            failed, later = await waiter.line(), await waiter.line()
            assert await waiter.proc.wait() == 0
    error = failed["error"]
    assert error["type"] == "RankFailedError", failed
    assert (error["rank"], error["host"], error["pid"]) == (1, "host-1", left["pid"])
    message = error["message"]
    assert message.startswith(
        f"rank 1 (host host-1, pid {left['pid']}) left the job "
        "(destroy_process_group, or its program ended) "
        "while this operation waited on it"
    )
    for fact in ("rank 1", "host-1", str(left["pid"]), "left the job", "destroy_process_group"):
        assert message.count(fact) == 1, message  # each fact once
    print(f"{op}, warm={warm}: failed {failed['t'] - left['t']:.3f} s after the leave")
    assert failed["t"] - left["t"] < 1.5  # at once: not the heartbeat timeout, nor the op's
    assert later["later"]["type"] == "RankFailedError"
    assert later["later"]["rank"] == 1
    assert later["waited"] < 0.5
    assert server.state.stats.failures == 0  # leaving is no failure


async def test_rank_leaving_while_nobody_waits_breaks_nothing_for_the_others(
    server: RendezvousServer, tmp_path: Path
) -> None:
    url = _url(server)
    with anyio.fail_after(60):
        async with (
            spawn(tmp_path, WORKER, ["leave_unneeded", url, "0", "3"]) as r0,
            spawn(tmp_path, WORKER, ["leave_unneeded", url, "1", "3"]) as r1,
            spawn(tmp_path, WORKER, ["leave_unneeded", url, "2", "3"]) as r2,
        ):
            assert await r2.proc.wait() == 0
            outs = [[await r.line(), await r.line()] for r in (r0, r1)]
            assert [await r.proc.wait() for r in (r0, r1)] == [0, 0]
    for rank, (needed, after) in enumerate(outs):
        assert needed["error"]["type"] == "RankFailedError", needed
        assert needed["error"]["rank"] == 2
        assert "left the job" in needed["error"]["message"]
        assert after["got"] == {"from": 1 - rank}  # point-to-point between the others works
        assert after["keys"] >= 2  # so does the store
    assert server.state.stats.failures == 0


# --- the daemon killed or frozen -------------------------------------------------------


@asyncio_only
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("idle", ["0,1,2", "2"], ids=["all-idle", "two-in-a-barrier"])
async def test_daemon_killed_every_rank_learns_within_the_heartbeat_timeout(
    tmp_path: Path, how: str, idle: str
) -> None:
    # Not shorter: init_process_group stalls a rank's loop about 0.3 s of CPU on an idle
    # machine (torch's group coming up), 1.7 s on a loaded one, past a 1.5 s timeout.
    hb_timeout = 3.0
    # A daemon may come back: ranks would wait for it. With no grace, they break at once.
    env = {"IDLE": idle, "HB_TIMEOUT": str(hb_timeout), "AIODIST_SERVER_GRACE": "0"}
    async with serve("--port", "0") as daemon:
        url = f"tcp://{daemon.host}:{daemon.port}"
        try:
            with anyio.fail_after(60):
                async with (
                    spawn(tmp_path, WORKER, ["server_gone", url, "0", "3"], env) as r0,
                    spawn(tmp_path, WORKER, ["server_gone", url, "1", "3"], env) as r1,
                    spawn(tmp_path, WORKER, ["server_gone", url, "2", "3"], env) as r2,
                ):
                    ranks = [r0, r1, r2]
                    for r in ranks:
                        assert (await r.line())["ready"]
                    killed = time.monotonic()
                    daemon.proc.send_signal(getattr(signal, how))
                    outs = [[await r.line()] for r in ranks]
                    for rank, r in enumerate(ranks):
                        if str(rank) in idle.split(","):
                            outs[rank].append(await r.line())
                        assert await r.proc.wait() == 0
        finally:
            with contextlib.suppress(ProcessLookupError):  # reaped already
                daemon.proc.kill()  # a frozen daemon never exits by itself
            with anyio.CancelScope(shield=True):
                await daemon.proc.wait()
    address = f"rendezvous server at {daemon.host}:{daemon.port}"
    for rank, (first, *rest) in enumerate(outs):
        error = first.get("noticed") or first.get("error")
        assert error is not None, first
        # The rank's own detection (idle ranks all detect it themselves), or a peer's word.
        assert error["type"] == "GroupBrokenError", first
        assert address in error["message"]
        assert "can no longer learn that other ranks failed" in error["message"]
        print(f"{how}, idle {idle}: rank {rank} knew after {first['t'] - killed:.3f} s")
        assert first["t"] - killed < hb_timeout + 1.0, (rank, first["t"] - killed)
        if rest:  # an idle rank: its next operation fails at once
            assert rest[0]["error"]["type"] == "GroupBrokenError"
            assert address in rest[0]["error"]["message"]
            assert rest[0]["waited"] < 0.5
        if how == "SIGKILL" and "noticed" in first:
            assert "lost the connection" in error["message"]


# --- Ctrl-C in a blocking call ----------------------------------------------------------


@asyncio_only
@pytest.mark.parametrize("op", ["barrier", "barrier-elsewhere", "torch-elsewhere", "recv", "wait"])
async def test_ctrl_c_in_a_blocking_call_raises_keyboard_interrupt_at_once(
    server: RendezvousServer, tmp_path: Path, op: str
) -> None:
    from aiodist import RankFailedError, irecv_object

    url = _url(server)
    path = tmp_path / "sync_worker.py"
    path.write_text(SYNC_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    step = "starting rank 0"  # named in the failure, should a step hang
    try:
        with anyio.fail_after(60):
            async with await open_process(
                [sys.executable, str(path), url, op], env=env, stderr=None
            ) as proc:
                try:
                    step = "forming the job"
                    async with open_process_group(
                        url, world_size=2, rank=1, group_name="ctrl-c", timeout=OP_TIMEOUT
                    ) as g:
                        # Rank 1 waits for an object rank 0 never sends; rank 0 blocks on rank 1.
                        waiting = irecv_object(src=0, group=g)
                        assert proc.stdout is not None
                        out = BufferedByteReceiveStream(proc.stdout)
                        step = "rank 0 announcing that it blocks"
                        blocking = json.loads(await out.receive_until(b"\n", 1 << 16))
                        sent = time.monotonic()
                        if not op.endswith("elsewhere"):  # there, its own thread signals
                            proc.send_signal(signal.SIGINT)
                        step = "rank 0 reporting the KeyboardInterrupt"
                        report = json.loads(await out.receive_until(b"\n", 1 << 16))
                        step = "rank 0 exiting"
                        code = await proc.wait()
                        exited = time.monotonic()
                        step = "rank 1 hearing that rank 0 left"
                        with pytest.raises(RankFailedError) as info:
                            await waiting
                        step = "rank 1 leaving"
                finally:
                    if proc.returncode is None:
                        proc.kill()
                        with anyio.CancelScope(shield=True):
                            await proc.wait()
    except TimeoutError:
        raise AssertionError(f"hung {step}") from None
    assert code == -signal.SIGINT  # KeyboardInterrupt, uncaught: Python exits by SIGINT
    print(f"Ctrl-C in {op}: KeyboardInterrupt after {report['interrupted'] - sent:.3f} s, ", end="")
    print(f"exited after {exited - sent:.3f} s")
    # At once, not after an operation's timeout or the close grace of 30 s (the bounds
    # leave room for a loaded machine; the printed figures are what a quiet one gives).
    assert report["interrupted"] - sent < 5.0
    assert exited - sent < 10.0
    # The group was closed at once; an interrupted Work.wait() (aiodist's or torch's) closes it
    # at exit.
    assert report["initialized"] is (op in ("wait", "torch-elsewhere"))
    assert info.value.rank == 0  # the peer is told that rank 0 left, at once
    assert info.value.pid == blocking["pid"]
    assert "left the job" in str(info.value)
    assert server.state.stats.failures == 0
