"""``aiodist run --replace-failed``: when a failed rank's process is replaced, and when not.

Rules the launcher keeps:

- A replacement only ever joins the job it replaces. None starts once that job
  has ended (every member gone), and one that has not joined it when it ends is
  stopped: the job went on without the rank it replaced and ended, so that rank
  is no failure of the run. Without this, a replacement arriving late would form
  a new job of its own under the old name and wait for members that never come.
- A replacement that exits before it joined the job is a start-up failure (a
  script or environment that fails the same way every time): the next
  replacement waits ``START_BACKOFF`` s, doubled after each start-up failure in
  a row, and after ``MAX_START_FAILURES`` in a row the launcher replaces no
  more: the run fails with that rank's code. A replacement that joined resets
  the count.
- What the job looks like comes from the server (``JobWatch``): read in this
  process when the launcher hosts it, else asked with a status request, as
  ``aiodist status --job`` does. A server that does not answer tells nothing:
  the replacement is neither counted as joined nor stopped.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from aiodist._control.connection import connect_control
from aiodist._errors import DistError
from aiodist._launch.status_job import find_job
from aiodist._server.state import JOB_STATUS_RANKS
from aiodist._wire.messages import StatusRequest

if TYPE_CHECKING:
    from aiodist._server.serve import RendezvousServer

MAX_START_FAILURES: Final = 3  # replacements in a row that die before joining
START_BACKOFF: Final = 1.0  # s before the replacement after a start-up failure; doubles
WATCH_INTERVAL: Final = 0.25  # s between looks at the job while a replacement is pending
ASK_TIMEOUT: Final = 5.0  # a status request to a server this launcher does not host


@dataclass(frozen=True, slots=True)
class JobLook:
    """The job as the server saw it: ended (its last member gone), and its members' pids.

    ``forming``: a job of that name is being formed again: only a replacement that
    came after the job ended (between two looks) makes one, waiting for members
    that never come; it counts as the job's end.
    """

    ended: bool = False
    pids: frozenset[int] = frozenset()
    forming: bool = False


def look_at(snap: dict[str, Any], job_id: str, since: float) -> JobLook:
    """What a status snapshot says of job ``job_id``, watched for ``since`` seconds.

    The job has ended when the server holds it no more and it finished within
    ``since`` s (an earlier run under the same ``--rdzv-id`` is not this one).
    """
    job = find_job(snap, job_id)
    if job is not None:
        pids = frozenset(int(m["pid"]) for m in job.get("members", []))
        return JobLook(pids=pids, forming=job.get("state") == "forming")
    ended = any(
        f.get("job") == job_id and float(f.get("ago", since)) < since
        for f in snap.get("finished", [])
    )
    return JobLook(ended=ended)


class JobWatch:
    """Looks at one job on its server: hosted here, or at ``address``."""

    def __init__(
        self,
        job_id: str,
        server: RendezvousServer | None,
        address: tuple[str, int],
        token: str | None,
    ) -> None:
        self.job_id = job_id
        self._server = server
        self._address = address
        self._token = token
        self._started = time.monotonic()

    async def look(self) -> JobLook:
        since = time.monotonic() - self._started
        if self._server is not None:
            state = self._server.state
            now = self._server.loop_time()
            snap = state.snapshot(now, job=self.job_id, max_members=JOB_STATUS_RANKS)
            return look_at(snap, self.job_id, since)
        with contextlib.suppress(OSError, DistError):
            conn = await connect_control(
                *self._address, timeout=ASK_TIMEOUT, retry_refused=False, token=self._token or ""
            )
            try:
                job_id = self.job_id
                snap = await conn.request(lambda r: StatusRequest(r, job_id), timeout=ASK_TIMEOUT)
            finally:
                conn.close()
            return look_at(snap, self.job_id, since)
        return JobLook()


def start_backoff(failures_in_a_row: int) -> float:
    """How long to wait before the next replacement after this many start-up failures."""
    return 0.0 if failures_in_a_row <= 0 else START_BACKOFF * 2 ** (failures_in_a_row - 1)
