"""The parts of the launch paths that need no launcher: output, addresses, torchrun's env, names.

The launch paths themselves run as real processes in ``test_launch_paths.py``.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import socket
import threading
import time
from typing import Any

import anyio
import pytest

from aiodist._control.addresses import interface_address, is_local, reachable_host
from aiodist._control.rendezvous import connect_rendezvous, parse_init_method
from aiodist._control.torchrun import Torchrun, server_key, torchrun_env
from aiodist._errors import RendezvousError, RendezvousTimeout
from aiodist._launch.cli import _JsonFormatter, _TextFormatter, format_status, main
from aiodist._launch.output import Sink, pump
from aiodist._launch.placement import parse_endpoint
from aiodist._launch.run import LaunchSpec
from tests.helpers.procs import free_port

# --- output -------------------------------------------------------------------------------


class _Recorded(Sink):
    """A sink whose writes can be awaited."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.changed = asyncio.Event()

    def write(self, data: bytes) -> None:
        super().write(data)
        self.changed.set()

    @property
    def value(self) -> bytes:
        return self.stream.getvalue()  # type: ignore[attr-defined,no-any-return]

    async def wait_for(self, tail: bytes) -> None:
        with anyio.fail_after(5):
            while not self.value.endswith(tail):
                self.changed.clear()
                await self.changed.wait()


class _Rank:
    """One rank's output stream, fed by the test, pumped into a shared sink."""

    def __init__(self, sink: Sink, prefix: bytes, partial_delay: float = 0.01) -> None:
        self.reader = asyncio.StreamReader()
        self.task = asyncio.ensure_future(pump(self.reader, sink, prefix, partial_delay))

    async def write(self, data: bytes) -> None:
        self.reader.feed_data(data)
        for _ in range(5):  # let the pump take it (it reads whatever is buffered)
            await asyncio.sleep(0)

    async def close(self) -> None:
        self.reader.feed_eof()
        await self.task


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_pump_shows_a_partial_line_soon_and_never_mixes_two_ranks_on_a_line() -> None:
    sink = _Recorded()
    a, b = _Rank(sink, b"[a] "), _Rank(sink, b"[b] ")
    await a.write(b"\r 10%")
    await sink.wait_for(b"\r[a]  10%")  # shown before the line ends, prefixed
    await a.write(b"\r 20%")
    await sink.wait_for(b"\r[a]  20%")  # a redrawn bar keeps its prefix
    await b.write(b"hello\nwor")  # a's bar is unfinished: ended before b writes
    await b.write(b"ld\n")
    await a.write(b"\r100%\n")
    await a.write(b"tail without newline")
    await a.close()
    await b.close()
    assert sink.value == (
        b"\r[a]  10%\r[a]  20%\n"
        b"[b] hello\n[b] world\n"
        b"\r[a] 100%\n"
        b"[a] tail without newline\n"  # kept whole at the end
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_pump_drops_torchs_own_rank_prefix_where_it_puts_its_own() -> None:
    # torch.distributed's excepthook prefixes each traceback line with "[rankN]: ".
    sink = _Recorded()
    rank = _Rank(sink, b"[rank 1] ")
    await rank.write(b"[rank1]: Traceback (most recent call last):\n[rank1]:   File x\n\n")
    await rank.write(b"[rank12]: ValueError: boom\n[rank1]:no space\n")
    await rank.close()
    unprefixed = _Recorded()
    plain = _Rank(unprefixed, b"")
    await plain.write(b"[rank1]: kept without a prefix of ours\n")
    await plain.close()
    # Before: "[rank 1] [rank1]: Traceback ...".
    assert sink.value == (
        b"[rank 1] Traceback (most recent call last):\n[rank 1]   File x\n\n"
        b"[rank 1] ValueError: boom\n[rank 1] no space\n"
    )
    assert unprefixed.value == b"[rank1]: kept without a prefix of ours\n"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_pump_keeps_a_line_whole_when_its_newline_comes_in_a_write_of_its_own() -> None:
    # An unbuffered rank's print() writes the text, then the newline; another rank's
    # line between the two must not split it.
    sink = _Recorded()
    a, b = _Rank(sink, b"[a] ", partial_delay=30.0), _Rank(sink, b"[b] ")
    await a.write(b"hel")
    await b.write(b"one\n")
    await sink.wait_for(b"[b] one\n")
    await a.write(b"lo")
    await a.write(b"\n")
    await sink.wait_for(b"[a] hello\n")
    await a.close()
    await b.close()
    assert sink.value == b"[b] one\n[a] hello\n"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_pump_does_not_end_twice_a_line_that_another_rank_ended() -> None:
    sink = _Recorded()
    a, b = _Rank(sink, b"[a] "), _Rank(sink, b"[b] ")
    await a.write(b"\r 50%")
    await sink.wait_for(b"[a]  50%")
    await b.write(b"x\n")  # ends a's line first
    await sink.wait_for(b"[b] x\n")
    await a.write(b"\n")  # a ends the line it thinks is open: already done
    await a.write(b"next\n")
    await a.close()
    await b.close()
    assert sink.value == b"\r[a]  50%\n[b] x\n[a] next\n"  # no empty line


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_pump_into_a_closed_reader_discards_and_keeps_draining() -> None:
    class Closed(io.BytesIO):
        def write(self, data: Any) -> int:
            raise BrokenPipeError

    rank = _Rank(Sink(Closed()), b"")
    await rank.write(b"x" * 100_000 + b"\n")
    await rank.close()  # no error, and the rank's pipe was drained


# --- addresses ----------------------------------------------------------------------------


def test_interface_address_of_loopback_and_of_an_unknown_interface() -> None:
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(RendezvousError, match=r"AIODIST_SOCKET_IFNAME='nosuch0'.*lo"):
        interface_address("nosuch0")


def test_reachable_host_order_explicit_host_then_interface() -> None:
    both = {"AIODIST_HOST": "10.9.9.9", "AIODIST_SOCKET_IFNAME": "lo"}
    assert reachable_host(None, both) == "10.9.9.9"
    assert reachable_host(None, {"AIODIST_SOCKET_IFNAME": "lo"}) == "127.0.0.1"


def test_reachable_host_without_a_way_to_find_one_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    with pytest.raises(RendezvousError, match="set AIODIST_SOCKET_IFNAME=<interface>"):
        reachable_host("127.0.0.1", {})


def test_is_local() -> None:
    assert is_local("127.0.0.1")
    assert is_local("localhost")
    assert not is_local("192.0.2.123")  # TEST-NET-1: an address no host of ours has


# --- torchrun's environment ---------------------------------------------------------------

TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def test_env_init_under_torchrun_agrees_through_torchruns_store() -> None:
    spec = parse_init_method("env://", environ=TORCHRUN_ENV)
    assert spec.scheme == "torchrun"
    assert (spec.host, spec.port, spec.rank, spec.world_size) == ("node0", 29500, 1, 4)
    assert (spec.generation, spec.single_host) == (2, False)
    assert spec.torchrun == Torchrun("abc", 2, use_agent_store=True)
    assert server_key(spec.torchrun) == "aiodist/abc/2/server"  # a key per restart


def test_env_init_without_torchrun_connects_to_master_addr() -> None:
    env = {k: v for k, v in TORCHRUN_ENV.items() if not k.startswith("TORCHELASTIC_RUN")}
    spec = parse_init_method("env://", environ=env)
    assert (spec.scheme, spec.host, spec.port, spec.generation) == ("tcp", "node0", 29500, 2)


def test_torchrun_env_without_agent_store_and_bad_restart_count() -> None:
    run = torchrun_env({"TORCHELASTIC_RUN_ID": "", "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert run == Torchrun("none", 0, use_agent_store=False)
    with pytest.raises(RendezvousError, match="TORCHELASTIC_RESTART_COUNT='x'"):
        torchrun_env({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "x"})


# --- aiodist run's names and flags --------------------------------------------------------


def test_job_names_are_fresh_per_launch_unless_given() -> None:
    one = LaunchSpec(["x"], nproc=2)
    assert one.job_name(("h", 1)) != one.job_name(("h", 1))
    assert LaunchSpec(["x"], nproc=2, job_id="mine").job_name(("h", 1)) == "mine"
    nodes = LaunchSpec(["x"], nproc=2, nnodes=2, master_port=7)
    assert nodes.job_name(("h", 7)) == "run-7"  # every node derives the same


@pytest.mark.parametrize(
    ("endpoint", "parsed"), [("h:1", ("h", 1)), ("[::1]:29400", ("::1", 29400))]
)
def test_parse_endpoint(endpoint: str, parsed: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint) == parsed


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    import aiodist

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"aiodist {aiodist.__version__}"


def test_standalone_with_another_server_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--standalone", "--rdzv-endpoint", "h:1", "x.py"]) == 2
    assert "--standalone runs one node" in capsys.readouterr().err


# --- the daemon's log and status ----------------------------------------------------------


@pytest.mark.parametrize("formatter", [_TextFormatter(), _JsonFormatter()], ids=["text", "json"])
def test_job_events_are_logged_as_json_lines_in_either_format(formatter: logging.Formatter) -> None:
    event = {"event": "job_formed", "job": "j", "generation": 1, "seconds": 0.5}
    record = logging.LogRecord("aiodist.events", logging.INFO, "", 0, json.dumps(event), (), None)
    record.aiodist_event = event
    line = json.loads(formatter.format(record))
    assert line.pop("time").endswith("+00:00")
    assert line == event


def test_format_status_shows_generations_and_recently_finished_jobs() -> None:
    job = {
        "name": "train",
        "generation": 2,
        "world_size": 2,
        "joined": 2,
        "state": "running",
        "age": 5.0,
        "keys": 0,
        "members": [],
        "failures": [],
    }
    finished = {
        "job": "old",
        "generation": 0,
        "state": "not_formed",
        "seconds": 30.0,
        "ago": 90.0,
        "reason": "did not form: 1 of 2 members joined in time",
    }
    snap = {"version": "1", "uptime": 1.0, "connections": 1, "jobs": [job], "finished": [finished]}
    text = format_status("h:1", snap)
    assert "job 'train' (generation 2): running, 2/2 joined" in text
    assert (
        "  job 'old': not_formed after 30.0 s, 1m30s ago "
        "(did not form: 1 of 2 members joined in time)" in text.splitlines()
    )


# --- agreeing on the server through torchrun's store (a real TCPStore, in this process) ------


def _torchrun_env(rank: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "store-test",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


@pytest.fixture
def agent_store() -> Any:
    """torchrun's agent store: a TCPStore server this test hosts, as the agent does."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_torchrun_rank_zero_publishes_its_server_and_rank_one_finds_it(
    agent_store: Any,
) -> None:
    envs = [_torchrun_env(rank, agent_store.port) for rank in (0, 1)]
    specs = [parse_init_method("env://", environ=env) for env in envs]
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(20):
            conn0, server = await connect_rendezvous(specs[0], tg, timeout=10, environ=envs[0])
            assert server is not None
            assert server.address[0] == "127.0.0.1"  # every rank on this host: loopback
            published = agent_store.get("aiodist/store-test/3/server").decode()
            assert published == f"127.0.0.1:{server.address[1]}"
            conn1, none = await connect_rendezvous(specs[1], None, timeout=10, environ=envs[1])
            assert none is None
            await server.wait_until(lambda s: s.num_connections == 1)  # one per process
        conn0.close()
        conn1.close()
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_torchrun_rank_waiting_for_a_server_never_published_times_out(
    agent_store: Any,
) -> None:
    env = _torchrun_env(1, agent_store.port)
    spec = parse_init_method("env://", environ=env)
    started = time.monotonic()
    with pytest.raises(RendezvousTimeout) as info, anyio.fail_after(20):
        await connect_rendezvous(spec, None, timeout=1.0, environ=env)
    assert time.monotonic() - started < 5
    assert "rank 0 of torchrun run 'store-test' (restart 3) published no aiodist server" in str(
        info.value
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_torchrun_rank_cancelled_while_waiting_for_the_server_returns_at_once(
    agent_store: Any,
) -> None:
    env = _torchrun_env(1, agent_store.port)
    spec = parse_init_method("env://", environ=env)
    started = time.monotonic()
    with anyio.move_on_after(0.5) as scope:
        await connect_rendezvous(spec, None, timeout=600, environ=env)
    assert scope.cancelled_caught
    assert time.monotonic() - started < 2  # not the store's 600 s wait
    # Nor does its thread wait on: it ends, and lets go of the store (a wait left in
    # it would outlive the test and complain when the store goes away).
    for thread in threading.enumerate():
        if thread.name == "aiodist-torchrun-store":
            thread.join(5)
            assert not thread.is_alive()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_torchrun_store_that_does_not_listen_is_a_rendezvous_error() -> None:
    env = _torchrun_env(1, free_port())
    spec = parse_init_method("env://", environ=env)
    started = time.monotonic()
    with (
        pytest.raises(RendezvousError, match="cannot reach torchrun's store at MASTER_ADDR"),
        anyio.fail_after(20),
    ):
        await connect_rendezvous(spec, None, timeout=1.0, environ=env)
    assert time.monotonic() - started < 10


# --- the fork server handed to a launcher forked warm -------------------------------------


@pytest.mark.parametrize("stale", ["{fd}:{ppid}", "{fd}:1", "{fd}", "9999:{pid}", "x:y"])
def test_a_spare_server_variable_not_naming_a_child_and_its_socket_is_ignored_and_taken(
    monkeypatch: pytest.MonkeyPatch, stale: str
) -> None:
    """Copied into another process's environment, ``_AIODIST_FORK_SERVER`` names no
    server of that process: it is dropped, and no descriptor of the process is taken."""
    import os

    from aiodist._launch import forkserver

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        value = stale.format(fd=a.fileno(), pid=os.getpid(), ppid=os.getppid())
        monkeypatch.setenv(forkserver._SPARE_ENV, value)
        assert forkserver._spare_server() is None
        assert forkserver._SPARE_ENV not in os.environ
        a.send(b"still ours")  # not closed by the refusal
        assert b.recv(16) == b"still ours"


async def test_daemon_runs_full_collections_on_its_own_clock_and_gives_the_thresholds_back() -> (
    None
):
    from aiodist._launch.daemon import collect_on_a_clock

    before = gc.get_threshold()
    collected = asyncio.Event()
    full = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(info)
            if len(full) >= 2:
                collected.set()

    gc.callbacks.append(watch)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect_on_a_clock, 0.01)
            with anyio.fail_after(10):
                await collected.wait()
            young, middle, old = gc.get_threshold()
            assert (young, middle) == before[:2]  # the young generations as before
            assert old >= 1 << 30  # Python starts no full collection of its own
            tg.cancel_scope.cancel()
        assert gc.get_threshold() == before
    finally:
        gc.callbacks.remove(watch)
