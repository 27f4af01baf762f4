"""The daemon's dashboard: ``/`` on the metrics port, a page that polls ``/api/state``.

The HTTP side runs in the metrics endpoint's threads (``metrics.py``); it
reads the server only through ``Dashboard.sample``, which runs on the
server's loop (asked with ``call_soon_threadsafe``, bounded by a timeout),
and caches the answer for ``CACHE_SECONDS`` so that many open pages cost the
loop one sample per interval.

What ``/api/state?offset=O&limit=L`` carries: the server (version, uptime,
connections, how many jobs it holds), one page of its jobs (``PAGE_JOBS``
unless asked, at most ``PAGE_MAX``), each with its state, world size, members
joined, age, its data-plane traffic (``traffic``: the messages and bytes its
ranks sent each other, in all and per second, as their heartbeats report it)
and its history (``history``: ``[seconds ago, messages/s, bytes/s]`` per
``HISTORY_INTERVAL``, at most ``HISTORY_POINTS``, ``traffic.py``), its first
``RANKS_SHOWN`` ranks (host, pid, status, heartbeat age, current operation;
``rank`` null until the job assigns it) and the collectives some rank waits in;
the recent job events (created, formed, rank failed, finished), newest last;
how recent jobs ended. A page costs the loop what its jobs cost, however many
jobs the server holds.

Security: with a token, ``/api/state`` answers 401 and no job data unless the
request carries ``Authorization: Bearer <token>`` (compared in constant
time); the page asks for the token and keeps it in the tab's session storage.
Without a token, the job data is anyone's who reaches the port, as the jobs
themselves are anyone's who reaches the server (``aiodist status`` needs no
token either); ``/metrics`` holds counts, no job's name or host, and stays
open, as Prometheus exporters are. The page and its script are static
files: they render every value as text (``textContent``), never as HTML, and
a Content-Security-Policy allows only the daemon's own script. Requests are
bounded by the endpoint (``metrics.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hmac
import json
import threading
import time
import urllib.parse
from importlib import resources
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from aiodist._server.traffic import HISTORY_INTERVAL

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Iterable

    from aiodist._server.state import JobTable

T = TypeVar("T")
#: How long one sample of the server serves every page that polls.
CACHE_SECONDS: Final = 0.5
#: Job events the dashboard keeps (newest last).
EVENTS_KEPT: Final = 200
SAMPLE_TIMEOUT: Final = 5.0
# The most ranks listed per job (a job of 10,000 ranks would make a huge page).
RANKS_SHOWN: Final = 64
#: Jobs on one page of ``/api/state`` unless it asks (``?offset=&limit=``), and at most.
PAGE_JOBS: Final = 20
PAGE_MAX: Final = 100
#: Pages kept answered from the cache at once (one per (offset, limit) polled).
PAGES_CACHED: Final = 16
_STATIC: Final = {
    "/": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
_SECURITY_HEADERS: Final = [
    ("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
]


class Served(Protocol):
    """What the dashboard reads of the server that keeps it (``serve.RendezvousServer``)."""

    @property
    def state(self) -> JobTable: ...
    @property
    def token(self) -> str | None: ...
    @property
    def dashboard(self) -> Dashboard: ...
    def loop_time(self) -> float: ...


class Dashboard:
    """The loop's side: the recent job events, and pages of the job table (call on the loop)."""

    def __init__(self) -> None:
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENTS_KEPT)

    def note_events(self, events: Iterable[dict[str, Any]]) -> None:
        """Job events just recorded by the job table (``JobTable.take_events``)."""
        now = time.time()
        self.events.extend({"time": now, **e} for e in events)

    def sample(self, server: Served, offset: int, limit: int) -> dict[str, Any]:
        """One page of what the page shows (``limit`` jobs from the ``offset``-th), as plain data.

        Its cost grows with the page, not with the jobs the server holds.
        """
        state = server.state
        now = server.loop_time()
        snap = state.snapshot(now, offset=offset, limit=limit, max_members=RANKS_SHOWN)
        for job in snap["jobs"]:
            points = state.jobs[job["name"]].traffic.history(now)
            job["history"] = {"interval": HISTORY_INTERVAL, "points": points}
        snap["limit"] = limit
        snap["events"] = list(self.events)
        snap["token_required"] = server.token is not None
        return snap


class DashboardApp:
    """The WSGI side, run by the endpoint's threads: the page, its files, ``/api/state``."""

    def __init__(
        self,
        server: Served,
        loop: asyncio.AbstractEventLoop,
        metrics: Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]],
    ) -> None:
        self._server = server
        self._loop = loop
        self._metrics = metrics
        self._token = server.token.encode() if server.token is not None else None
        self._lock = threading.Lock()
        self._cached: dict[tuple[int, int], tuple[float, bytes]] = {}
        self._files = {
            path: (resources.files("aiodist._server").joinpath("static", name).read_bytes(), kind)
            for path, (name, kind) in _STATIC.items()
        }

    def __call__(self, environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return self._metrics(environ, start)
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _answer(start, "405 Method Not Allowed", b"GET only\n", "text/plain")
        if path in self._files:
            body, kind = self._files[path]
            return _answer(start, "200 OK", body, kind)
        if path == "/api/state":
            if not self._authorized(environ):
                body = b'{"error": "this server requires its token", "token_required": true}'
                return _answer(start, "401 Unauthorized", body, "application/json")
            page = _page(environ.get("QUERY_STRING", ""))
            if page is None:
                body = f"offset and limit must be integers, limit 1 to {PAGE_MAX}\n".encode()
                return _answer(start, "400 Bad Request", body, "text/plain")
            data = self._state(*page)
            if data is None:
                return _answer(start, "503 Service Unavailable", b"{}", "application/json")
            return _answer(start, "200 OK", data, "application/json")
        return _answer(start, "404 Not Found", b"not found\n", "text/plain")

    def _authorized(self, environ: dict[str, Any]) -> bool:
        if self._token is None:
            return True
        given = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(value.strip().encode(), self._token)

    def _state(self, offset: int, limit: int) -> bytes | None:
        with self._lock:  # one sample of a page per interval, whoever asks
            at, body = self._cached.get((offset, limit), (0.0, b""))
            if time.monotonic() - at < CACHE_SECONDS and body:
                return body
            server = self._server
            try:
                data = on_loop(self._loop, lambda: server.dashboard.sample(server, offset, limit))
            except (RuntimeError, concurrent.futures.TimeoutError):
                return None
            body = json.dumps(data, default=str).encode()
            if len(self._cached) >= PAGES_CACHED:
                self._cached.clear()
            self._cached[offset, limit] = (time.monotonic(), body)
            return body


def on_loop(loop: asyncio.AbstractEventLoop, take: Callable[[], T]) -> T:
    """``take()`` run on the server's ``loop`` for an endpoint thread: RuntimeError if the loop
    is closed, ``concurrent.futures.TimeoutError`` if it is stuck past ``SAMPLE_TIMEOUT``."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(take())
        except Exception as exc:  # pragma: no cover - reported to the HTTP thread
            future.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return future.result(timeout=SAMPLE_TIMEOUT)


def _page(query: str) -> tuple[int, int] | None:
    """``(offset, limit)`` from ``/api/state``'s query; None if either is malformed."""
    try:
        args = urllib.parse.parse_qs(query, max_num_fields=4)
        offset = int(args.get("offset", ["0"])[0])
        limit = int(args.get("limit", [str(PAGE_JOBS)])[0])
    except ValueError:
        return None
    if offset < 0 or not 1 <= limit <= PAGE_MAX:
        return None
    return offset, limit


def _answer(start: Callable[..., Any], status: str, body: bytes, kind: str) -> list[bytes]:
    headers = [("Content-Type", kind), ("Content-Length", str(len(body))), *_SECURITY_HEADERS]
    start(status, headers)
    return [body]
