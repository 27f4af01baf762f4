"""The job table's event log, sans-IO: what happened to jobs, as plain records.

The job table records an event at each turn of a job's life; the asyncio
shell takes them (``take``) and logs each as one JSON line, so an operator
can follow every job on a shared daemon:

- ``job_created``: the first member of a job (or of a new generation) joined.
- ``generation_restarted``: a job started again under the same name with a
  later generation (a launcher's restart), with how the previous one ended.
- ``rank_joined``: a member joined (the rank it asked for, or null).
- ``job_formed``: every member joined; ranks are assigned.
- ``rank_failed``: a member of a formed job failed, and why.
- ``job_finished``: its last member is gone: ``succeeded`` (every member
  left), ``failed`` (a member failed) or ``not_formed`` (it never formed);
  the first failure names the ranks that had left before it (``after_leaves``),
  since a program's ``sys.exit(n)`` looks like a clean leave to the server.

Every event names the job and its generation; durations are seconds
(``seconds``: since the job was created; ``ran``: since it formed). The log
remembers how the last ``HISTORY`` jobs ended, for ``aiodist status`` and for
the next generation's ``generation_restarted``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from aiodist._server.jobs import Job, Member

HISTORY: Final = 64  # finished jobs remembered


def _seconds(value: float) -> float:
    return round(value, 3)


class JobLog:
    """Events not yet taken by the shell, and how recent jobs ended."""

    def __init__(self) -> None:
        self._pending: list[dict[str, Any]] = []
        # Job name -> how its latest generation ended, oldest first.
        self.finished: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def take(self) -> list[dict[str, Any]]:
        """The events recorded since the last call, oldest first."""
        events, self._pending = self._pending, []
        return events

    def _add(self, event: str, job: Job, **fields: Any) -> None:
        self._pending.append(
            {"event": event, "job": job.name, "generation": job.generation, **fields}
        )

    def record(self, event: str, job: Job, **fields: Any) -> None:
        """Record an event of ``job`` that has no method of its own (``reattach.py``'s)."""
        self._add(event, job, **fields)

    def job_created(self, job: Job, previous: Job | None) -> None:
        self._add("job_created", job, world_size=job.world_size)
        if job.generation == 0 and previous is None:
            return
        before: dict[str, Any] = {}
        if previous is not None:  # still running: the new generation replaces it
            before = {"previous_generation": previous.generation, "previous_state": "replaced"}
        elif (ended := self.finished.get(job.name)) is not None:
            before = {
                "previous_generation": ended["generation"],
                "previous_state": ended["state"],
                "previous_seconds": ended["seconds"],
            }
        self._add("generation_restarted", job, **before)

    def rank_joined(self, member: Member) -> None:
        job = member.job
        self._add(
            "rank_joined",
            job,
            rank=member.requested_rank if member.requested_rank >= 0 else None,
            host=member.host,
            pid=member.pid,
            joined=len(job.members),
            world_size=job.world_size,
        )

    def job_formed(self, job: Job, now: float) -> None:
        hosts = len({m.host for m in job.by_rank})
        self._add(
            "job_formed",
            job,
            world_size=job.world_size,
            hosts=hosts,
            seconds=_seconds(now - job.created_at),
        )

    def rank_failed(self, member: Member, reason: str, now: float) -> None:
        job = member.job
        ran = None if job.formed_at is None else _seconds(now - job.formed_at)
        self._add(
            "rank_failed",
            job,
            rank=member.rank,
            host=member.host,
            pid=member.pid,
            reason=reason,
            ran=ran,
        )

    def job_finished(self, job: Job, now: float) -> None:
        if job.failures or (job.formed_at is not None and job.end_reason):
            state = "failed"  # a rank failed, or the job was cut off
        elif job.formed_at is not None:
            state = "succeeded"
        else:
            state = "not_formed"
        record: dict[str, Any] = {
            "job": job.name,
            "generation": job.generation,
            "state": state,
            "world_size": job.world_size,
            "seconds": _seconds(now - job.created_at),
            "ran": None if job.formed_at is None else _seconds(now - job.formed_at),
            "failures": len(job.failures),
        }
        if job.end_reason:
            record["reason"] = job.end_reason
        if job.failures:  # the first to fail: the others may have failed because of it
            rank, _, _, why = job.failures[0]
            record["first_failure"] = {"rank": rank, "reason": why}
            if job.left_before_failure:  # a leave may have caused it (sys.exit(n) leaves)
                record["first_failure"]["after_leaves"] = list(job.left_before_failure)
        self._pending.append({"event": "job_finished", **record})
        self.finished.pop(job.name, None)
        self.finished[job.name] = {**record, "ended_at": now}
        while len(self.finished) > HISTORY:
            self.finished.popitem(last=False)

    def recent(self, now: float) -> list[dict[str, Any]]:
        """How recent jobs ended, newest first, with how long ago (``ago``)."""
        out = []
        for record in reversed(self.finished.values()):
            entry = {k: v for k, v in record.items() if k != "ended_at"}
            entry["ago"] = now - record["ended_at"]
            out.append(entry)
        return out
