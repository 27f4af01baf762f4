from __future__ import annotations

import signal
import zlib
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import pytest
import uvloop

from aiodist import RendezvousServer, serve_rendezvous

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


# Each unit test runs on both loops: on asyncio's under its debug mode (a call from
# another thread, a coroutine never awaited, a slow callback: each named where it
# began), and on uvloop as production runs it. Debug mode records a traceback for
# every handle and task; on both loops it made the unit tests 1.8x as costly.
LOOPS: Final = {
    "asyncio": ("asyncio", {"debug": True}),
    "uvloop": ("asyncio", {"loop_factory": uvloop.new_event_loop}),
}
# Folders whose tests start their ranks as processes of their own: a case there runs on
# one of the two loops (which one is fixed by its name), not on both.
ONE_LOOP_FOLDERS: Final = ("integration", "compat")


@pytest.fixture(params=[pytest.param(loop, id=name) for name, loop in LOOPS.items()])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return cast("tuple[str, dict[str, Any]]", request.param)


def pytest_configure(config: pytest.Config) -> None:
    # A background job of a non-interactive shell (``make test &``, a CI step, nohup)
    # starts with SIGINT ignored, and every process it starts inherits that: the tests
    # that press Ctrl-C on a rank would find it deaf (Python leaves an ignored SIGINT
    # ignored). The suite's processes take Ctrl-C as from a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)  # a mark, before marks and fixtures are parametrized
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each multi-process test on one loop, half of them on each.

    Unit tests run every case on asyncio's loop and on uvloop. In the integration
    and compatibility tests the ranks are processes of their own and the test's
    loop holds at most the rendezvous server, which the unit tests run on both
    loops: running each such case twice doubled their time (a third of the suite)
    for little. Each test function there gets one loop, picked by a hash of its
    name, so that both loops keep running a share of them; its id still names it.
    """
    if "anyio_backend" not in metafunc.fixturenames:
        return
    if metafunc.definition.path.parent.name not in ONE_LOOP_FOLDERS:
        return
    if any(
        "anyio_backend" in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize")
    ):
        return  # the test chose its loops itself
    fixturedefs = metafunc._arg2fixturedefs.get("anyio_backend", ())
    if fixturedefs and fixturedefs[-1].params is None:
        return  # its module overrides the fixture with one loop
    name = sorted(LOOPS)[zlib.crc32(metafunc.definition.nodeid.encode()) % len(LOOPS)]
    mark = pytest.mark.parametrize("anyio_backend", [pytest.param(LOOPS[name], id=name)])
    metafunc.definition.add_marker(mark)


@pytest.fixture
async def server() -> AsyncIterator[RendezvousServer]:
    async with anyio.create_task_group() as tg:
        yield await tg.start(serve_rendezvous, "127.0.0.1", 0)  # port 0: the OS picks
        tg.cancel_scope.cancel()


# The files that take longest, first: ``make test`` hands whole files to its
# workers in collection order, and a long file handed out last keeps one worker busy
# while the other has nothing left to do. After them the other files that start
# processes, and the unit tests (in-process, quick) last, to fill the gaps. Only the
# order changes.
LONG_FILES_FIRST: Final = (
    "test_daemon_away.py",
    "test_rpc_programs.py",
    "test_torch_backend.py",
    "test_fault_matrix.py",
    "test_faults.py",
    "test_dashboard.py",
    "test_elastic_examples.py",
    "test_bench_report.py",
    "test_gpu_check.py",
    "test_exits.py",
    "test_elastic_grow.py",
    "test_elastic_replace.py",
    "test_silent_waits.py",
    "test_rpc.py",
    "test_launch_paths.py",
    "test_daemon_restart.py",
    "test_integrity.py",
    "test_collectives.py",
    "test_shm.py",
    "test_integrity_listener.py",
    "test_multiprocess.py",
    "test_new_user.py",
    "test_docs.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}

    def order(item: pytest.Item) -> int:
        if item.path.name in rank:
            return rank[item.path.name]
        return len(rank) + ("unit" in item.path.parts)

    items.sort(key=order)  # stable: files stay whole
