"""Sans-IO tests of the flight recorder, its dumps and traces, and the heartbeat's ``where``."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import tempfile
from typing import TYPE_CHECKING, Any

import pytest
import torch

from aiodist._control.status import describe_wait
from aiodist._errors import DistTimeoutError
from aiodist._group import dumps
from aiodist._group.dumps import dump_path, write_dump
from aiodist._group.recorder import FORMAT, Recorder, capacity_from_env
from aiodist._group.tracefile import trace_events
from aiodist._group.work import Work
from aiodist._wire.bounds import MAX_OP_NAME_CHARS, MAX_WHERE, FieldError
from aiodist._wire.headers import decode_message, message_header
from aiodist._wire.messages import Heartbeat
from tests.helpers.daemon import asyncio_only

if TYPE_CHECKING:
    from pathlib import Path

T = torch.ones(4)


def op(rec: Recorder, loop: asyncio.AbstractEventLoop, name: str, seq: int) -> Work[Any]:
    work: Work[Any] = Work.pending(loop, f"{name}#{seq}")
    rec.record(work, name, "g", seq, -1, T.dtype, T.shape, 0)
    return work


@asyncio_only
async def test_ring_keeps_the_last_operations_in_order() -> None:
    loop = asyncio.get_running_loop()
    rec = Recorder(0, "job", capacity=16)
    for seq in range(1, 50):
        op(rec, loop, "all_reduce", seq).set_result(None)
    entries = rec.entries()
    assert [e.seq for e in entries] == list(range(34, 50))
    assert all(e.state == "done" and e.nbytes == 16 for e in entries)
    assert rec.oldest() is None
    last = rec.last_ended()
    assert last is not None
    assert last.seq == 49


@asyncio_only
async def test_running_operation_outlives_the_ring_and_is_the_oldest() -> None:
    loop = asyncio.get_running_loop()
    rec = Recorder(3, "job", capacity=16)
    stuck = op(rec, loop, "barrier", 1)
    for seq in range(2, 40):
        op(rec, loop, "all_reduce", seq).set_result(None)
    oldest = rec.oldest()
    assert oldest is not None
    assert (oldest.name, oldest.seq, oldest.state) == ("barrier", 1, "pending")
    assert rec.entries()[0].seq == 1  # kept aside, listed first
    current, last = rec.where()
    assert current[:3] == ["g", 1, "barrier"]
    assert current[3] >= 0.0
    assert last[:3] == ["g", 39, "all_reduce"]  # the collective that ended last
    stuck.set_exception(DistTimeoutError("barrier#1 timed out"))
    assert rec.oldest() is None
    dump = dumps.dump(rec, "test")
    failed = [o for o in dump["operations"] if o["state"] == "failed"]
    assert [o["seq"] for o in failed] == [1]
    assert failed[0]["error"] == "DistTimeoutError: barrier#1 timed out"


@asyncio_only
async def test_dump_file_has_the_documented_fields(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    rec = Recorder(2, "my/job", capacity=16)
    op(rec, loop, "broadcast", 1).set_result(None)
    op(rec, loop, "all_reduce", 2)
    path = write_dump(rec, tmp_path, "SIGUSR1")
    assert path == dump_path(tmp_path, "my/job", 2)
    assert path.name == "aiodist-dump-my_job-rank2.json"
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT
    assert (data["job"], data["rank"], data["reason"], data["recorded"]) == (
        "my/job",
        2,
        "SIGUSR1",
        2,
    )
    first, second = data["operations"]
    assert set(first) == {
        "id", "name", "group", "seq", "peer", "bytes", "dtype", "shape",
        "enqueued", "started", "ended", "seconds", "state", "error",
    }  # fmt: skip
    assert (first["dtype"], first["shape"], first["bytes"]) == ("float32", [4], 16)
    assert first["state"] == "done"
    assert first["ended"] >= first["started"] >= first["enqueued"] > 1e9
    assert (second["state"], second["ended"]) == ("pending", None)
    assert write_dump(rec, tmp_path / "missing", "x") is None  # no directory: no file


@asyncio_only
async def test_dumps_on_request_are_one_per_interval_the_latest_request_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AIODIST_DUMP_DIR", str(tmp_path))
    rec = Recorder(0, "flood", capacity=16)
    op(rec, asyncio.get_running_loop(), "all_reduce", 1).set_result(None)
    path = dump_path(tmp_path, "flood", 0)
    with caplog.at_level("WARNING", logger="aiodist._group.dumps"):
        for request in range(100):  # a flood of requests: one dump now, one for the rest
            dumps.request_dump(rec, "aiodist status --dump", request)
        async with asyncio.timeout(30):
            while not path.exists() or json.loads(path.read_text())["request"] != 99:  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # a file is written in a thread: nothing to await
    written = [r for r in caplog.records if "flight recorder of rank 0" in r.getMessage()]
    assert len(written) == 2, written
    data = json.loads(path.read_text())
    assert (data["reason"], data["operations"][0]["name"]) == (
        "aiodist status --dump",
        "all_reduce",
    )


def test_dump_dir_is_private_and_refuses_one_others_can_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("AIODIST_DUMP_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = dumps.dump_dir()
    assert made == tmp_path / f"aiodist-dumps-{os.getuid()}"
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(0o777)  # as if another user made it for us
    assert dumps.dump_dir() is None
    assert "only this user may use" in caplog.text
    made.rmdir()
    made.symlink_to(tmp_path)  # a link is refused, whatever it points to
    assert dumps.dump_dir() is None
    monkeypatch.setenv("AIODIST_DUMP_DIR", str(tmp_path))
    assert dumps.dump_dir() == tmp_path


def test_dump_replaces_a_link_at_its_name_never_writing_through_it(tmp_path: Path) -> None:
    rec = Recorder(1, "linked", capacity=16)
    target = tmp_path / "target"
    target.write_text("precious")
    dump_path(tmp_path, "linked", 1).symlink_to(target)
    path = write_dump(rec, tmp_path, "SIGUSR1")
    assert path is not None
    assert not path.is_symlink()
    assert json.loads(path.read_text())["rank"] == 1
    assert target.read_text() == "precious"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@asyncio_only
async def test_trace_puts_overlapping_operations_on_separate_lanes() -> None:
    loop = asyncio.get_running_loop()
    rec = Recorder(1, "job", capacity=16)
    before = op(rec, loop, "barrier", 1)  # running when the trace starts
    rec.start_trace("unused")
    a, b = op(rec, loop, "all_reduce", 2), op(rec, loop, "all_reduce", 3)
    oldest = rec.oldest()
    assert oldest is not None
    assert oldest.seq == 1
    before.set_result(None)
    a.set_result(None)
    oldest = rec.oldest()
    assert oldest is not None
    assert oldest.seq == 3
    b.set_result(None)
    assert rec.oldest() is None
    events = trace_events(rec)["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["barrier #1", "all_reduce #2", "all_reduce #3"]
    assert len({e["tid"] for e in slices}) == 3  # they overlap: never on one row
    assert {e["pid"] for e in events} == {1}
    assert slices[1]["args"]["seq"] == 2
    assert slices[1]["args"]["bytes"] == 16


def test_recorder_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_RECORDER_SIZE", "0")
    assert capacity_from_env() == 0
    monkeypatch.setenv("AIODIST_RECORDER_SIZE", "3")
    assert capacity_from_env() == 16
    monkeypatch.setenv("AIODIST_RECORDER_SIZE", "many")
    with pytest.raises(ValueError, match="AIODIST_RECORDER_SIZE"):
        capacity_from_env()


# --- Heartbeat.where on the wire -----------------------------------------------------------


def test_heartbeat_where_round_trips() -> None:
    where = [
        [0, ["g", 7, "all_reduce", 1.5], None, [0, 0]],
        [3, None, ["g", 6, "barrier", 2], [12, 2**40]],
    ]
    msg = decode_message(Heartbeat.KIND, message_header(Heartbeat(where)))
    assert msg == Heartbeat(where)
    assert decode_message(Heartbeat.KIND, [[]]) == Heartbeat()


@pytest.mark.parametrize(
    "where",
    [
        [[0, ["g", 7, "all_reduce"], None, [0, 0]]],  # an op of three fields
        [[0, ["g", -1, "all_reduce", 1.0], None, [0, 0]]],  # a negative sequence number
        [[0, ["g", 7, "x" * (MAX_OP_NAME_CHARS + 1), 1.0], None, [0, 0]]],  # a name too long
        [[0, ["g", 7, "all_reduce", float("nan")], None, [0, 0]]],  # NaN seconds
        [[0, ["g", 7, "all_reduce", 1.0], None, [0, 0], "extra"]],  # an entry of five
        [[0, ["g", 7, "all_reduce", 1.0], None]],  # no counts of what it sent
        [[-1, None, None, [0, 0]]],  # a negative channel
        [[0, None, None, [0, 0]]] * (MAX_WHERE + 1),  # too many entries
        [[True, None, None, [0, 0]]],  # a bool where a channel belongs
        [[0, None, None, [-1, 0]]],  # a negative count of messages
        [[0, None, None, [0, 2**64]]],  # bytes beyond 64 bits
        [[0, None, None, [0, 1.5]]],  # a float where a count belongs
        [[0, None, None, [False, 0]]],  # a bool where a count belongs
        [[0, None, None, [0, 0, 0]]],  # three counts
        [[0, None, None, None]],  # no list of counts
    ],
)
def test_heartbeat_where_out_of_bounds_is_refused(where: list[Any]) -> None:
    with pytest.raises(FieldError, match=r"Heartbeat\.where"):
        decode_message(Heartbeat.KIND, [where])


def test_describe_wait_names_who_is_missing() -> None:
    call = {
        "group": "default",
        "seq": 1042,
        "name": "all_reduce",
        "waiting": [{"rank": 0, "for": 12.3}, {"rank": 1, "for": 12.0}, {"rank": 3, "for": 9.1}],
        "not_entered": [
            {"rank": 2, "op": None, "last": {"name": "barrier", "seq": 1041, "ago": 14.0}}
        ],
    }
    assert describe_wait(call) == (
        "all_reduce #1042 on group 'default': ranks 0, 1, 3 waiting 12.3 s; "
        "rank 2 not entered (last: barrier #1041, done 14.0 s ago)"
    )


# --- make bench's recorder section ----------------------------------------------------------


def test_recorder_cost_is_the_median_of_the_pairs_ratios() -> None:
    from benchmarks.bench_recorder import costs

    blocks = [["on", 1.1], ["off", 1.0], ["off", 1.0], ["on", 1.1]]  # +10 %
    blocks += [["on", 2.0], ["off", 2.0], ["off", 2.0], ["on", 2.0]]  # +0 %
    blocks += [["on", 3.3], ["off", 3.0], ["off", 3.0], ["on", 3.0]]  # +5 %
    c = costs(blocks)
    assert c["pairs"] == 3
    assert c["cost_median"] == pytest.approx(0.05)
    assert (c["cost_min"], c["cost_max"]) == (pytest.approx(0.0), pytest.approx(0.1))


@pytest.mark.slow
@asyncio_only
async def test_recorder_bench_runs_two_ranks_and_judges_the_goal() -> None:
    import anyio

    from benchmarks import bench_recorder

    with anyio.fail_after(120):
        data = await anyio.to_thread.run_sync(lambda: bench_recorder.bench(1, 20))
    assert set(data["costs"]) == {"all_reduce 4 B", "p2p_round_trip 8 B"}
    for blocks in data["blocks"].values():
        assert [mode for mode, _ in blocks] == ["on", "off", "off", "on"]
        assert all(t > 0 for _, t in blocks)
    goals = bench_recorder.goal_list(data)
    assert [g.target for g in goals] == ["<= 0.02", "<= 0.02"]
    assert "flight recorder cost" in bench_recorder.render(data)
