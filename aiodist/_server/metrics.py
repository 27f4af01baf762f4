"""Prometheus metrics of a rendezvous server, served by ``prometheus_client``.

The HTTP endpoint runs in ``prometheus_client``'s own thread. A scrape must not
read the job table while the event loop changes it, so the collector asks the
loop for one consistent sample (``RendezvousServer.metrics_sample``) and waits
for it, as the dashboard does (``dashboard.on_loop``, bounded by ``SAMPLE_TIMEOUT``);
a loop that cannot answer in time yields an empty scrape rather than a stuck HTTP thread.

A server with TLS serves its metrics port over the same mutual TLS (HTTPS, its
certificate, a client's required), as its rendezvous port: the dashboard's
page sends the job's token there and reads the jobs, their hosts and pids.
A clear request is answered with one clear ``400`` that says so, and closed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any, Final
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from aiodist._server.dashboard import DashboardApp, on_loop

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Iterator
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

    from aiodist._server.serve import RendezvousServer

logger = logging.getLogger(__name__)

#: Requests the endpoint serves at once (scrapes, dashboard pages and their polls).
MAX_REQUESTS: Final = 32
#: Seconds a request may take in all (arriving, answered) before its connection is cut.
REQUEST_TIMEOUT: Final = 10.0
#: What a clear HTTP request to a TLS metrics port gets: why, and what to use instead.
_CLEAR_REFUSED: Final = (
    b"this aiodist metrics port requires TLS and this client spoke clear HTTP; use https:// "
    b"with a certificate signed by the job's CA (curl --cacert CA --cert CERT --key KEY)\n"
)
_CLEAR_ANSWER: Final = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    + f"Content-Length: {len(_CLEAR_REFUSED)}\r\n\r\n".encode()
    + _CLEAR_REFUSED
)
_TLS_HANDSHAKE: Final = 0x16  # the first byte of a TLS record that opens a handshake

# (sample key, metric name without _total, help) for every counter.
_COUNTERS: Final = (
    ("joins", "aiodist_joins", "Join requests accepted."),
    ("jobs_formed", "aiodist_jobs_formed", "Jobs that reached their world size."),
    ("failures", "aiodist_rank_failures", "Members declared failed (dropped or silent)."),
    ("store_ops", "aiodist_store_operations", "Key-value store operations."),
    ("messages", "aiodist_messages_received", "Control messages received."),
    ("bytes_received", "aiodist_received_bytes", "Bytes received from clients."),
    ("bytes_sent", "aiodist_sent_bytes", "Bytes sent to clients."),
    ("auth_failures", "aiodist_authentication_failures", "Connections refused for their token."),
    ("reattached", "aiodist_reattached_members", "Members taken back after they reconnected."),
    ("restored_jobs", "aiodist_restored_jobs", "Jobs taken back from the state directory."),
    (
        "preauth_closed",
        "aiodist_preauth_closed_connections",
        "Connections closed before their handshake was done: shed, late or over the byte budget.",
    ),
)


class _ServerCollector(Collector):
    def __init__(self, server: RendezvousServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop

    def _sample(self) -> dict[str, Any] | None:
        try:
            return on_loop(self._loop, self._server.metrics_sample)
        except (RuntimeError, concurrent.futures.TimeoutError) as exc:  # loop closed or stuck
            logger.warning("metrics scrape got no sample from the server: %r", exc)
            return None

    def collect(self) -> Iterator[Metric]:
        sample = self._sample()
        if sample is None:
            return
        yield InfoMetricFamily(
            "aiodist_server", "The server's version.", {"version": sample["version"]}
        )
        yield GaugeMetricFamily(
            "aiodist_uptime_seconds", "Seconds since the server started.", sample["uptime"]
        )
        yield GaugeMetricFamily(
            "aiodist_connections", "Open control connections.", sample["connections"]
        )
        jobs = GaugeMetricFamily(
            "aiodist_jobs", "Jobs the server holds, by state.", labels=["state"]
        )
        for state, count in sorted(sample["jobs"].items()):
            jobs.add_metric([state], count)
        yield jobs
        yield GaugeMetricFamily(
            "aiodist_members", "Members joined to the jobs the server holds.", sample["members"]
        )
        yield GaugeMetricFamily(
            "aiodist_preauth_connections",
            "Connections waiting for their handshake to be done.",
            sample["preauth_pending"],
        )
        for key, name, help_text in _COUNTERS:
            yield CounterMetricFamily(name, help_text, sample[key])


class MetricsEndpoint:
    """A running metrics endpoint; ``close()`` stops it.

    Attributes:
        address: ``(host, port)`` it listens on.
        url: ``http://host:port``, or ``https://`` where it requires TLS.
    """

    def __init__(self, httpd: WSGIServer, thread: threading.Thread, *, tls: bool) -> None:
        self._httpd = httpd
        self._thread = thread
        host, port = httpd.server_address[:2]
        self.address = (str(host), int(port))
        self.url = f"{'https' if tls else 'http'}://{self.address[0]}:{self.address[1]}"

    def close(self) -> None:
        """Stop serving and join the thread (blocks up to the server's poll interval)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def start_metrics(
    server: RendezvousServer,
    loop: asyncio.AbstractEventLoop,
    host: str,
    port: int,
    *,
    request_timeout: float = REQUEST_TIMEOUT,
) -> MetricsEndpoint:
    """Serve ``server``'s metrics at ``http://host:port/metrics`` from a thread.

    With ``server.tls``, at ``https://``: the port requires the server's mutual TLS.
    Besides the server's own metrics, the process's (``process_*``: memory,
    CPU, open files) are exported, as Prometheus exporters usually do.
    ``request_timeout`` bounds each request as a whole (see ``_BoundedServer``).

    Raises:
        OSError: The address cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ServerCollector(server, loop))
    ProcessCollector(registry=registry)
    app = DashboardApp(server, loop, make_wsgi_app(registry))
    httpd = make_server(host, port, app, _BoundedServer, handler_class=_Handler)
    assert isinstance(httpd, _BoundedServer)
    httpd.request_timeout = request_timeout
    if server.tls is not None:
        httpd.tls_context = server.tls.server_context()
    thread = threading.Thread(target=httpd.serve_forever, name="aiodist-metrics", daemon=True)
    thread.start()
    endpoint = MetricsEndpoint(httpd, thread, tls=server.tls is not None)
    logger.info("metrics on %s/metrics, dashboard on %s/", endpoint.url, endpoint.url)
    return endpoint


class _Handler(WSGIRequestHandler):
    """Quiet; tells its server once the request is read (it is no longer a slow-loris suspect)."""

    server: _BoundedServer
    timeout = REQUEST_TIMEOUT  # per read; the server holds each request to the same in all

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.request_read(self.connection)
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _BoundedServer(ThreadingWSGIServer):
    """A thread per request, at most ``MAX_REQUESTS`` at once, each within ``request_timeout``.

    A request (reading it, answering it) that takes longer than ``request_timeout``
    in all has its connection cut: a client sending a byte now and then cannot keep
    a slot. When every slot is taken, a new connection takes the slot of the one
    that has waited longest for its request to arrive (a client with a request to
    make sends it at once); with none of those, it is closed unanswered.
    """

    daemon_threads = True
    request_timeout = REQUEST_TIMEOUT
    tls_context: ssl.SSLContext | None = None  # the server's mutual TLS (None: clear HTTP)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        self._active = 0  # requests with a thread (cut ones included, until their thread ends)
        self._reading: dict[socket.socket, float] = {}  # not read yet -> since (monotonic)
        super().__init__(*args, **kwargs)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        if self.tls_context is not None:  # its handshake is made in the request's thread
            sock = self.tls_context.wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False
            )
        return sock, address

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if self._active >= MAX_REQUESTS:
                waiting = min(self._reading, key=self._reading.__getitem__, default=None)
                # Cut ones still count until their thread ends: never more than twice the bound.
                if waiting is None or self._active >= 2 * MAX_REQUESTS:
                    self.shutdown_request(request)
                    return
                del self._reading[waiting]
                _cut(waiting)
            self._active += 1
            self._reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        deadline = threading.Timer(self.request_timeout, _cut, (request,))
        deadline.daemon = True
        deadline.start()
        try:
            if isinstance(request, ssl.SSLSocket) and not self._handshake(request):
                self.shutdown_request(request)
            else:
                super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._done(request)

    def _handshake(self, request: ssl.SSLSocket) -> bool:
        """The TLS handshake (within the request's deadline); a clear client is told why not."""
        request.settimeout(self.request_timeout)
        try:
            # The plain socket's calls: the TLS socket's own would take the bytes as TLS.
            first = socket.socket.recv(request, 1, socket.MSG_PEEK)
            if first and first[0] != _TLS_HANDSHAKE:
                socket.socket.sendall(request, _CLEAR_ANSWER)
                return False
            request.do_handshake()
        except OSError as exc:  # refused certificate, not TLS, cut at the deadline
            logger.debug("metrics connection closed before its TLS handshake: %s", exc)
            return False
        return True

    def request_read(self, request: socket.socket) -> None:
        with self._lock:
            self._reading.pop(request, None)

    def _done(self, request: socket.socket) -> None:
        with self._lock:
            self._active -= 1
            self._reading.pop(request, None)


def _cut(sock: socket.socket) -> None:
    # Ends whatever its thread waits for on it (a read, a write): the thread then finishes.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
