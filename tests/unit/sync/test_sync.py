"""The blocking facade ``aiodist.sync``: parity with the async API, the generator, the loop thread.

Multi-process use of the facade (N ranks of plain code) is in test_sync_mp.py.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
import threading
import typing
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

import aiodist
import aiodist.sync as dist
from aiodist._sync import portal
from aiodist._tools import gen_sync
from aiodist._tools.gen_sync import ASYNC_ONLY, TWINS, Kind, classify, render
from aiodist._tools.imports import GenerateError
from tests.helpers.procs import free_port

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture(autouse=True)
def _no_loop_thread_left() -> Iterator[None]:
    assert not portal.is_running(), "a previous test left the loop thread running"
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        portal.stop()


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """The facade initialised as a real one-rank job (rank 0 embeds the server)."""
    dist.init_process_group(
        init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0, timeout=30
    )
    yield
    dist.destroy_process_group()


# --- parity with the async API (in the spirit of trio's test_exports.py) ---------------------


def _operations() -> list[str]:
    return [
        name
        for name in aiodist.__all__
        if name not in ASYNC_ONLY
        and callable(obj := getattr(aiodist, name))
        and not inspect.isclass(obj)
        and (
            inspect.iscoroutinefunction(obj)
            or str(inspect.signature(obj).return_annotation).startswith("Work[")
        )
    ]


def test_every_async_name_has_its_sync_twin() -> None:
    assert sorted(dist.__all__) == sorted(n for n in aiodist.__all__ if n not in ASYNC_ONLY)
    for name in ASYNC_ONLY:
        assert not hasattr(dist, name), name
    operations = set(_operations())
    assert {"all_reduce", "all_gather_object", "send", "init_process_group"} <= operations
    for name in aiodist.__all__:
        if name in ASYNC_ONLY or name in operations or name in TWINS:
            continue
        assert getattr(dist, name) is getattr(aiodist, name), f"{name} is not re-exported"
    for name in TWINS:  # a hand-written blocking twin, with the same parameters
        twin, original = getattr(dist, name), getattr(aiodist, name)
        assert twin is not original
        assert list(inspect.signature(twin).parameters) == list(
            inspect.signature(original).parameters
        )


@pytest.mark.parametrize("name", _operations())
def test_sync_twin_has_the_same_parameters(name: str) -> None:
    async_fn, sync_fn = getattr(aiodist, name), getattr(dist, name)
    assert sync_fn is not async_fn
    assert not inspect.iscoroutinefunction(sync_fn)
    theirs = inspect.signature(async_fn)
    ours = inspect.signature(sync_fn)
    works = not inspect.iscoroutinefunction(async_fn)
    params = list(ours.parameters.values())
    if name in gen_sync.HANDLES:  # torch's requests: the running Work, at once
        assert "async_op" not in ours.parameters
        assert str(ours.return_annotation) == str(theirs.return_annotation)
        works = False
    if works:
        async_op = ours.parameters["async_op"]
        assert async_op.default is False
        if "async_op" in theirs.parameters:
            # torch.distributed's own flag, where torch has it: the same parameter.
            assert async_op.kind is theirs.parameters["async_op"].kind
        else:
            assert async_op.kind is inspect.Parameter.KEYWORD_ONLY
            params.remove(async_op)
        overloads = typing.get_overloads(sync_fn)
        assert len(overloads) == 2
        literals = [str(inspect.signature(o).parameters["async_op"].annotation) for o in overloads]
        assert literals == ["Literal[False]", "Literal[True]"]
        result = str(theirs.return_annotation).removeprefix("Work[").removesuffix("]")
        assert str(inspect.signature(overloads[0]).return_annotation) == result
        assert str(inspect.signature(overloads[1]).return_annotation) == f"Work[{result}]"
    elif name not in gen_sync.TWINS:  # a twin may hand back torch's objects (its docstring)
        assert ours.return_annotation == theirs.return_annotation
    assert [(p.name, p.kind, p.default, p.annotation) for p in params] == [
        (p.name, p.kind, p.default, p.annotation) for p in theirs.parameters.values()
    ]
    assert sync_fn.__doc__ is not None
    assert f"Blocking twin of ``aiodist.{name}``" in sync_fn.__doc__
    summary = inspect.getdoc(async_fn)
    assert summary is not None
    assert sync_fn.__doc__.startswith(summary.splitlines()[0])


def test_classify_covers_each_kind() -> None:
    assert classify("all_reduce", aiodist.all_reduce) == Kind.OPERATION
    assert classify("send", aiodist.send) == Kind.BLOCKING
    assert classify("get_rank", aiodist.get_rank) == Kind.REEXPORT
    assert classify("Work", aiodist.Work) == Kind.REEXPORT
    assert classify("open_process_group", aiodist.open_process_group) == Kind.ASYNC_ONLY


# --- the generator -------------------------------------------------------------------------


def test_gen_sync_check_passes_on_the_committed_facade() -> None:
    assert gen_sync.main(["--check"]) == 0


def test_gen_sync_check_fails_when_the_facade_is_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dist.__file__ is not None
    stale = tmp_path / "sync.py"
    current = Path(dist.__file__).read_text()
    stale.write_text(current.replace("def all_reduce(", "def all_reduce_old("))
    assert gen_sync.main(["--check", "--output", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert gen_sync.main(["--check", "--output", str(tmp_path / "missing.py")]) == 1
    # Writing brings it up to date.
    assert gen_sync.main(["--output", str(stale)]) == 0
    assert stale.read_text() == current
    assert gen_sync.main(["--check", "--output", str(stale)]) == 0


FAKE_API = '''
"""A stand-in async API with an operation that has just landed."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiodist import ProcessGroup, Work

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["ProcessGroup", "Work", "echo", "make_group"]


def echo(value: int, *, tag: int = 0) -> Work[int]:
    """Return ``value`` through a Work handle.

    Example:
        >>> await fakeapi.echo(3)
    """
    return Work.completed(value + tag)


async def make_group(
    ranks: Sequence[int] | None = None, timeout: float | None = None, backend: str | None = None
) -> ProcessGroup:
    """Make a group of ``ranks``."""
    import threading

    return (list(ranks or []), threading.current_thread().name)  # type: ignore[return-value]
'''


def test_generator_picks_up_a_new_async_operation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fakeapi.py").write_text(FAKE_API)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fakeapi  # type: ignore[import-not-found]

    text = render(fakeapi, path=tmp_path / "fakesync.py")
    assert "    from collections.abc import Sequence\n" in text  # under TYPE_CHECKING
    assert "def make_group(\n    ranks: Sequence[int] | None = None," in text
    (tmp_path / "fakesync.py").write_text(text)
    monkeypatch.delitem(sys.modules, "fakesync", raising=False)
    import fakesync  # type: ignore[import-not-found]

    assert fakesync.__all__ == ["ProcessGroup", "Work", "echo", "make_group"]
    assert inspect.signature(fakesync.make_group) == inspect.signature(fakeapi.make_group)
    assert fakesync.make_group([0, 1]) == ([0, 1], portal.THREAD_NAME)  # ran on the loop
    assert not portal.is_running()  # nothing initialised: the loop thread stopped again
    assert fakesync.echo(3, tag=1) == 4
    work = fakesync.echo(3, async_op=True)
    assert isinstance(work, aiodist.Work)
    assert work.wait() == 3


def test_generator_refuses_a_default_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = textwrap.dedent(
        '''
        from __future__ import annotations
        from aiodist import Work
        __all__ = ["Work", "op"]
        _SENTINEL = object()
        def op(x: object = _SENTINEL) -> Work[None]:
            """Do nothing."""
            return Work.completed(None)
        '''
    )
    (tmp_path / "badapi.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    import badapi  # type: ignore[import-not-found]

    with pytest.raises(GenerateError, match=r"default of 'x'.*not a literal"):
        render(badapi, fmt=False)


# --- the non-distributed fallback ----------------------------------------------------------


def test_facade_without_init_answers_as_one_process_without_a_thread() -> None:
    assert (dist.get_rank(), dist.get_world_size(), dist.get_dist_info()) == (0, 1, (0, 1))
    assert dist.is_main_process()
    assert not dist.is_distributed()
    assert not dist.is_initialized()
    assert dist.get_backend() is None
    assert dist.get_local_rank() == 0
    assert dist.get_local_size() == 1
    t = torch.arange(3.0)
    assert dist.all_reduce(t) is t
    torch.testing.assert_close(t, torch.arange(3.0))
    assert dist.all_gather(t)[0] is t
    assert dist.gather(t)[0] is t
    assert dist.broadcast(t) is t
    assert dist.barrier() is None
    assert dist.all_gather_object({"a": 1}) == [{"a": 1}]
    assert dist.gather_object("x") == ["x"]
    data = ["a", 2]
    assert dist.broadcast_object_list(data) is data
    assert dist.collect_results([1, 2, 3], 2) == [1, 2]
    seed = dist.sync_random_seed()
    assert isinstance(seed, int)
    assert 0 <= seed < 2**31
    d = {"loss": torch.tensor(2.0)}
    assert dist.all_reduce_dict(d, op="mean") is d
    assert d["loss"].item() == 2.0
    work = dist.all_reduce(t, async_op=True)
    assert work.is_completed()
    assert work.wait() is t
    assert dist.master_only(lambda: "ran")() == "ran"
    assert portal.loop_thread() is None  # nothing above needed the loop thread


def test_facade_send_without_init_fails_clearly_and_stops_the_thread() -> None:
    with pytest.raises(RuntimeError, match="call init_process_group"):
        dist.send(torch.ones(1), dst=0)
    assert not portal.is_running()
    dist.destroy_process_group()  # a no-op when not initialised
    assert not portal.is_running()


# --- the loop thread -----------------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_facade_runs_operations_on_one_named_loop_thread() -> None:
    thread = portal.loop_thread()
    assert thread is not None
    assert thread.name == "aiodist-loop"
    assert thread.daemon
    assert dist.is_initialized()
    assert dist.get_world_size() == 1
    assert dist.get_rank() == 0
    t = torch.ones(2)
    assert dist.all_reduce(t) is t
    work = dist.all_gather_object("x", async_op=True)
    assert work.wait(timeout=10) == ["x"]
    assert work.is_completed()
    assert dist.all_reduce_dict({"a": torch.ones(1)})["a"].item() == 1.0
    dist.barrier()
    assert portal.loop_thread() is thread


def test_destroy_stops_the_loop_thread_and_init_works_again() -> None:
    for _ in range(2):
        dist.init_process_group(
            init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0, timeout=30
        )
        thread = portal.loop_thread()
        assert thread is not None
        assert thread.is_alive()
        assert dist.all_gather_object(1) == [1]
        dist.destroy_process_group()
        assert not thread.is_alive()
        assert portal.loop_thread() is None
        assert not dist.is_initialized()


@pytest.mark.usefixtures("world_of_one")
def test_blocking_calls_on_the_loop_thread_raise_instead_of_deadlocking() -> None:
    work = dist.all_reduce(torch.ones(1), async_op=True)
    work.wait(timeout=10)

    def on_loop() -> list[str]:
        assert threading.current_thread().name == "aiodist-loop"
        errors = []
        for call in (
            dist.barrier,
            lambda: dist.all_reduce(torch.ones(1), async_op=True),
            dist.destroy_process_group,
            work.wait,  # done, but on the loop thread it raises all the same
        ):
            try:
                call()
            except RuntimeError as exc:
                errors.append(str(exc))
        assert dist.get_rank() == 0  # queries never block
        return errors

    errors = portal.run_sync(on_loop)
    assert len(errors) == 4
    assert "aiodist.sync.barrier() blocks" in errors[0]
    assert "await aiodist.barrier(...)" in errors[0]
    assert "aiodist.sync.all_reduce()" in errors[1]
    assert "destroy_process_group" in errors[2]
    assert "Work.wait() on the event loop's thread would deadlock" in errors[3]
    assert dist.is_initialized()  # nothing was torn down


async def test_facade_refuses_a_group_initialised_on_another_loop() -> None:
    await aiodist.init_process_group(
        init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0, timeout=30
    )
    try:
        with pytest.raises(RuntimeError, match="belongs to another event loop"):
            dist.all_gather_object(1)
        with pytest.raises(RuntimeError, match="belongs to another event loop"):
            dist.send(torch.ones(1), dst=0)
        assert not portal.is_running()
        assert dist.get_world_size() == 1
        assert dist.is_initialized()
    finally:
        await aiodist.destroy_process_group()
