"""Running the parts of ``gpu_check``: each a command with its own timeout, none stopping the rest.

A part is one command (a pytest run, an ``aiodist run`` job, a benchmark). It
runs in a session of its own with its output in a file (no pipe to fill up),
and every process it starts inherits a marker in its environment. When the
part ends, or overruns its timeout, its process group gets SIGTERM, then
SIGKILL, and then every process still carrying the marker is killed too:
ranks that ``aiodist run`` put in sessions of their own, daemons a test left
behind. Whatever happens, the GPU is free again before the next part starts.

Only the standard library: the parts need torch, the runner does not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "MARKER",
    "Part",
    "PartResult",
    "run_part",
    "run_parts",
]

#: The environment variable every process of a part inherits (its value names the part).
MARKER = "AIODIST_GPU_CHECK_PART"
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
MIN_TIMEOUT = 10.0  # a part given less than this is skipped, not started
TAIL_CHARS = 3000  # the end of a part's output kept in the summary
LOG_BYTES = 1 << 20  # the most of one part's output kept in the log file


@dataclass(frozen=True, slots=True)
class Part:
    """One command of the check, and how to read what it printed or wrote.

    ``parse(output, result)`` gets the command's output and ``result`` (the
    file it was told to write, or None) and returns the part's figures; it
    may raise, which fails the part. ``fallback`` is run instead when the
    command stops at a usage or internal error (exit code 3 or 4): pytest's
    answer to options this machine's plugins do not know.
    """

    name: str
    title: str
    argv: tuple[str, ...]
    timeout: float
    parse: Callable[[str, Path | None], dict[str, Any]] | None = None
    result: Path | None = None
    fallback: tuple[str, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    skip: str = ""  # why this part is not run here ("" runs it)


@dataclass(slots=True)
class PartResult:
    """What one part did: ``status`` is passed, failed, timeout, skipped or pending."""

    name: str
    title: str
    status: str = "pending"
    returncode: int | None = None
    seconds: float = 0.0
    timeout_s: float = 0.0
    command: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    leftovers: list[str] = field(default_factory=list)
    output_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("passed", "skipped")


def run_part(
    part: Part,
    timeout: float | None = None,
    *,
    cwd: Path | None = None,
    log: IO[bytes] | None = None,
) -> PartResult:
    """Run ``part`` to its end or its timeout (``timeout`` overrides ``part.timeout``)."""
    limit = part.timeout if timeout is None else min(timeout, part.timeout)
    out = PartResult(part.name, part.title, command=list(part.argv), timeout_s=round(limit, 1))
    if part.skip:
        out.status, out.note = "skipped", part.skip
        return out
    started = time.monotonic()
    rc, text, leftovers = _attempt(part.argv, limit, part.env, cwd, log, part.name)
    if rc in (3, 4) and part.fallback is not None:
        first = _first_error(text)
        left = limit - (time.monotonic() - started)
        out.note = f"{first}; ran again without the project's options: {' '.join(part.fallback)}"
        out.command = list(part.fallback)
        rc, text, more = _attempt(part.fallback, left, part.env, cwd, log, part.name)
        leftovers += more
    out.seconds = round(time.monotonic() - started, 2)
    out.returncode = rc
    out.leftovers = leftovers
    out.output_tail = text[-TAIL_CHARS:]
    out.status = "timeout" if rc is None else "passed" if rc == 0 else "failed"
    if rc is None:
        out.note = _join(out.note, f"stopped after its {limit:.0f} s timeout")
    elif rc != 0:
        out.note = _join(out.note, f"exit code {rc}: {_first_error(text)}")
    if part.parse is not None:
        try:
            out.figures = part.parse(text, part.result)
        except Exception as exc:  # a part that printed nothing readable has failed
            if out.status == "passed":
                out.status = "failed"
            out.note = _join(out.note, f"could not read its results: {type(exc).__name__}: {exc}")
    return out


def run_parts(
    parts: Sequence[Part],
    budget: float,
    *,
    cwd: Path | None = None,
    log: IO[bytes] | None = None,
    progress: Callable[[list[PartResult]], None] | None = None,
    min_timeout: float = MIN_TIMEOUT,
) -> list[PartResult]:
    """Run ``parts`` in order within ``budget`` seconds in all, each whatever the others did.

    A part gets its own timeout or what is left of the budget, whichever is
    less; one that would get less than ``min_timeout`` is skipped.
    ``progress(results)`` is called before the first part and after each one,
    with the parts not yet run as ``pending``.
    """
    deadline = time.monotonic() + budget
    results = [PartResult(p.name, p.title, command=list(p.argv)) for p in parts]
    if progress is not None:
        progress(results)
    for i, part in enumerate(parts):
        left = deadline - time.monotonic()
        if not part.skip and left < min_timeout:
            results[i].status = "skipped"
            results[i].note = f"out of time: {max(left, 0):.0f} s of the {budget:.0f} s budget left"
        else:
            results[i] = run_part(part, left, cwd=cwd, log=log)
        if progress is not None:
            progress(results)
    return results


# --- one command -------------------------------------------------------------------------


def _attempt(
    argv: Sequence[str],
    timeout: float,
    extra_env: Mapping[str, str],
    cwd: Path | None,
    log: IO[bytes] | None,
    name: str,
) -> tuple[int | None, str, list[str]]:
    """Run ``argv``; return its exit code (None: timed out), its output and the strays killed."""
    marker = f"{name}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    env = {**os.environ, **extra_env, MARKER: marker, "PYTHONUNBUFFERED": "1"}
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-check-{marker.replace(':', '-')}.out"
    rc: int | None = None
    try:
        with open(path, "wb") as sink:
            try:
                proc = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                return 127, f"could not start {argv[0]}: {exc}\n", []
            try:
                rc = proc.wait(timeout=max(timeout, 0.1))
            except subprocess.TimeoutExpired:
                rc = None
            except BaseException:  # interrupted: leave nothing of the part running
                _stop_group(proc)
                sweep(marker)
                raise
            _stop_group(proc)
        strays = sweep(marker)
        raw = path.read_bytes()
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    if log is not None:
        _log(log, name, argv, rc, raw)
    return rc, raw.decode("utf-8", "replace"), strays


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the part's process group (its leader may be gone), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, STOP_GRACE)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
        if not _group_alive(proc.pid, wait if sig == signal.SIGTERM else 1.0):
            break
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _group_alive(pgid: int, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


def sweep(marker: str, wait: float = STOP_GRACE) -> list[str]:
    """Kill every process whose environment carries ``marker``; return them as ``pid cmdline``."""
    needle = f"{MARKER}={marker}\0".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:  # gone already, or not ours to read
            continue
        pid = int(entry.name)
        found[pid] = f"{pid} {cmdline[:200]}"
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    for pid in found:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return list(found.values())


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie holds no GPU memory; its parent reaps it


def _log(log: IO[bytes], name: str, argv: Sequence[str], rc: int | None, raw: bytes) -> None:
    if len(raw) > LOG_BYTES:  # keep the start (what went wrong first) and the end
        head, tail = raw[: LOG_BYTES // 4], raw[-(LOG_BYTES - LOG_BYTES // 4) :]
        raw = head + f"\n[... {len(raw) - LOG_BYTES} bytes left out ...]\n".encode() + tail
    ended = "timed out" if rc is None else f"exit code {rc}"
    log.write(f"\n===== {name}: {' '.join(argv)} ({ended}) =====\n".encode())
    log.write(raw)
    log.flush()


def _first_error(text: str) -> str:
    """The line of ``text`` most likely to say what went wrong, shortened."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    keys = ("Error", "error:", "ERROR", "FAILED", "Traceback", "Unknown", "failed")
    for line in lines:
        if any(k in line for k in keys) and not line.startswith("Traceback"):
            return line[:300]
    return (lines[-1] if lines else "no output")[:300]


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b
