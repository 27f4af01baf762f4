"""``LingeringTask``: the end of ``asyncio.run`` lets it finish instead of cancelling it."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from aiodist._group import lingering
from aiodist._group.lingering import LingeringTask, linger

LOOPS = [
    pytest.param(asyncio.new_event_loop, id="asyncio"),
    pytest.param(uvloop.new_event_loop, id="uvloop"),
]


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_lingering_task_finishes_its_work_when_asyncio_run_ends(loop_factory: object) -> None:
    events: list[str] = []
    stop = asyncio.Event()

    async def holder() -> None:
        try:
            await stop.wait()  # what on_shutdown sets: the task ends its own way
            await asyncio.sleep(0.01)  # and may still await while the loop shuts down
            events.append("left")
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    async def plain() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            events.append("plain cancelled")
            raise

    def on_shutdown() -> None:
        events.append("shutdown")
        stop.set()

    tasks: list[asyncio.Task[None]] = []

    async def main() -> None:
        tasks.extend([linger(holder(), on_shutdown=on_shutdown), asyncio.ensure_future(plain())])
        await asyncio.sleep(0)  # both wait now; main returns without awaiting them

    with asyncio.Runner(loop_factory=loop_factory) as runner:  # type: ignore[arg-type]
        runner.run(main())
    assert sorted(events) == ["left", "plain cancelled", "shutdown"]


def test_lingering_task_is_cancelled_as_usual_while_its_loop_runs() -> None:
    shutdowns: list[None] = []

    async def main() -> bool:
        task = linger(asyncio.Event().wait(), on_shutdown=lambda: shutdowns.append(None))
        await asyncio.sleep(0)
        assert task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert asyncio.run(main())
    assert shutdowns == []  # a cancel from code on the loop is not the loop's end


def test_lingering_task_still_running_long_after_the_shutdown_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lingering, "SHUTDOWN_LIMIT", 0.05)
    ends: list[str] = []

    async def stuck() -> None:
        try:
            await asyncio.Event().wait()  # nothing will ever set it
        except asyncio.CancelledError as exc:
            ends.append(str(exc))
            raise

    async def main() -> LingeringTask[None]:
        task = linger(stuck())
        await asyncio.sleep(0)
        return task

    task = asyncio.run(main())
    assert task.cancelled()
    assert ends == ["still running long after its event loop began to shut down"]
