"""Mutual TLS: its configuration, its contexts, a listener that refuses clear peers.

**Configuration.** Three files, all or none: this process's certificate, its
private key, and the job's CA (``AIODIST_TLS_CERT``, ``AIODIST_TLS_KEY``,
``AIODIST_TLS_CA``; ``--tls-cert``, ``--tls-key``, ``--tls-ca`` on the CLI).
Both ends present a certificate that the job's CA signed and require one from
the other (``CERT_REQUIRED`` both ways), TLS 1.2 at least. Host names are not
checked: ranks and servers are reached by numeric address, and a certificate
per address would have to be made for every host a job may land on; what a
peer proves is that the job's CA signed its certificate (Dask makes the same
choice). A bad configuration (some variables only, a file missing or
unreadable, a key that does not match its certificate) is a ``ValueError``
naming the variable or flag, raised when the process starts using it.

**Listening.** ``TlsServer`` accepts connections itself and peeks at the first
byte of each (``MSG_PEEK``, within the pre-authentication deadline) before
the TLS handshake: a clear aiodist peer is sent one clear error frame that
says what to set, then closed; a TLS ClientHello is handed to the loop with
the server context (the handshake bounded by what is left of the deadline).
Before the handshake a connection costs the listener one descriptor and no
reads; during it, what OpenSSL reads of a handshake (within its own limits on
handshake messages). At most ``max_pending`` wait at once: newcomers beyond
that are closed (not the oldest shed, as ``admission.py`` does after TLS).

**The data plane's transport** (``scheme`` ``tls``): ``listen``/``connect`` as
``tcp.py``'s, addresses ``tls://HOST:PORT``. A rank configured for TLS
publishes only these (never ``tcp://``) and dials nothing else over TCP
(``_plane/routes.py``): no downgrade by construction. Received payloads are
decrypted by the loop's SSL object straight into the memory the channel's
``get_buffer`` returns (a tensor's, for a matched receive).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from aiodist._errors import ProtocolError
from aiodist._transport.admission import Admission, SocketListener
from aiodist._transport.stream import StreamChannel
from aiodist._transport.tcp import LISTEN_BACKLOG, _tune, dial, parse
from aiodist._wire.preauth import LogBudget
from aiodist._wire.tls import FLAGS, VARIABLES, explain_ssl_failure, first_byte_kind

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from aiodist._transport.base import FrameSink
    from aiodist._wire.preauth import PreAuthLimits

logger = logging.getLogger(__name__)

scheme: Final = "tls"
#: Seconds a closed connection's refusal may linger while its unread input is drained.
REFUSAL_LINGER: Final = 1.0


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """The three files of mutual TLS: this process's certificate and key, the job's CA."""

    cert: str
    key: str
    ca: str

    def server_context(self) -> ssl.SSLContext:
        """The context a listener wraps accepted connections in."""
        return _context(self, server_side=True)

    def client_context(self) -> ssl.SSLContext:
        """The context a connecting side wraps its connections in."""
        return _context(self, server_side=False)


def config_from(
    cert: str | None, key: str | None, ca: str | None, *, names: tuple[str, str, str] = FLAGS
) -> TlsConfig | None:
    """Check the three paths (all or none) and return them, or None when none is given.

    ``names`` says what to call them in errors (the flags, or the variables).

    Raises:
        ValueError: Only some given; a file missing or unreadable; a key that
            does not match its certificate; a CA file with no certificate.
    """
    given = (cert or "", key or "", ca or "")
    if not any(given):
        return None
    missing = [n for n, v in zip(names, given, strict=True) if not v]
    if missing:
        raise ValueError(
            f"TLS needs all three of {', '.join(names)}; {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing"
        )
    for name, path in zip(names, given, strict=True):
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise ValueError(f"{name}={path!r} cannot be read: {exc.strerror or exc}") from None
    config = TlsConfig(*given)
    _context(config, server_side=True)  # the checks that need OpenSSL
    return config


def from_env(environ: Mapping[str, str] | None = None) -> TlsConfig | None:
    """The TLS configuration of ``AIODIST_TLS_*`` (None when none is set); see ``config_from``."""
    env = os.environ if environ is None else environ
    cert, key, ca = (env.get(name, "").strip() for name in VARIABLES)
    return config_from(cert, key, ca, names=VARIABLES)


@functools.lru_cache(maxsize=16)
def _context(config: TlsConfig, *, server_side: bool) -> ssl.SSLContext:
    cert_name, key_name, ca_name = VARIABLES
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # numeric addresses: the CA's signature is the proof
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: each side requires the other's
    try:
        ctx.load_cert_chain(config.cert, config.key)
    except ssl.SSLError as exc:
        what = (
            f"{key_name} ({config.key}) does not match {cert_name} ({config.cert})"
            if "MISMATCH" in str(exc.reason or exc).upper()
            else f"{cert_name} ({config.cert}) or {key_name} ({config.key}) is not a PEM "
            "certificate and its private key"
        )
        raise ValueError(f"{what}: {exc}") from None
    try:
        ctx.load_verify_locations(cafile=config.ca)
    except ssl.SSLError as exc:
        raise ValueError(f"{ca_name} ({config.ca}) holds no PEM CA certificate: {exc}") from None
    return ctx


def describe_ssl_error(exc: ssl.SSLError, peer: str) -> str:
    """``exc`` (from a handshake or a read) worded for ``peer`` (who the other side is)."""
    verify = isinstance(exc, ssl.SSLCertVerificationError)
    detail = getattr(exc, "verify_message", None) if verify else None
    return explain_ssl_failure(peer, exc.reason, str(detail or exc.reason or exc), verify=verify)


# --- listening: peek, then TLS ------------------------------------------------------------


class TlsServer:
    """Accepts on a bound socket, refuses clear peers, and hands TLS ones to the loop.

    ``refusal`` is what a clear aiodist peer is sent (one encoded error frame);
    ``protocol_factory`` makes the protocol of each TLS connection.
    """

    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        context: ssl.SSLContext,
        *,
        refusal: bytes,
        deadline: float,
        max_pending: int,
        what: str,
    ) -> None:
        self._sock = sock
        self._factory = protocol_factory
        self._context = context
        self._refusal = refusal
        self._deadline = deadline
        self._max_pending = max_pending
        self._what = what
        self._loop = asyncio.get_running_loop()
        self._log = LogBudget()
        self._pending: set[asyncio.Task[None]] = set()
        self._accepting = self._loop.create_task(self._accept())
        self.refused = 0  # connections closed before or during their TLS handshake

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return (self._sock,)

    def close(self) -> None:
        """Stop accepting and drop the connections still before their handshake."""
        self._accepting.cancel()
        for task in list(self._pending):
            task.cancel()
        self._sock.close()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._accepting, *self._pending, return_exceptions=True)

    async def _accept(self) -> None:
        loop = self._loop
        while True:
            try:
                conn, addr = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and the like: try again in a moment
                logger.warning("accepting on the %s's TLS listener failed: %s", self._what, exc)
                await asyncio.sleep(0.1)
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "a client"
            if len(self._pending) >= self._max_pending:
                self.refused += 1
                self._note("too many", peer, f"{self._max_pending} connections wait already")
                conn.close()
                continue
            task = loop.create_task(self._admit(conn, peer))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _admit(self, conn: socket.socket, peer: str) -> None:
        loop = self._loop
        handed = False
        try:
            start = loop.time()
            async with asyncio.timeout(self._deadline):
                first = await _peek(loop, conn)
            if first is None:
                return  # closed before saying anything
            if first_byte_kind(first) != "tls":
                self.refused += 1
                self._note("clear client", peer, "it spoke clear TCP, not TLS")
                await self._refuse_clear(conn)
                return
            left = max(0.1, self._deadline - (loop.time() - start))
            handed = True  # the loop owns the socket now, and closes it on failure
            await loop.connect_accepted_socket(
                self._factory, conn, ssl=self._context, ssl_handshake_timeout=left
            )
        except TimeoutError:
            handed = False  # the loop may not have closed it yet
            self.refused += 1
            self._note("deadline", peer, f"no TLS handshake within {self._deadline:g} s")
        except ssl.SSLError as exc:
            handed = False
            self.refused += 1
            self._note("tls", peer, describe_ssl_error(exc, "the client"))
        except OSError as exc:
            handed = False
            self._note("tls", peer, f"it left during the TLS handshake ({exc!r})")
        finally:
            if not handed:
                conn.close()

    async def _refuse_clear(self, conn: socket.socket) -> None:
        # Read what it sent (so that closing sends no reset that could discard our
        # answer), answer, and wait for it to hang up, briefly.
        with contextlib.suppress(OSError):
            _drain(conn)
            conn.send(self._refusal)
            conn.shutdown(socket.SHUT_WR)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REFUSAL_LINGER):
                    while await _peek(self._loop, conn) is not None:
                        _drain(conn)

    def _note(self, reason: str, peer: str, why: str) -> None:
        full, summary = self._log.note(self._loop.time(), reason)
        if summary is not None:
            logger.warning("%s", summary)
        if full:
            logger.warning("the %s refused a connection from %s: %s", self._what, peer, why)


async def _peek(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> int | None:
    """The first unread byte of ``conn`` (left unread), or None at end of stream."""
    while True:
        try:
            data = conn.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            pass
        else:
            return data[0] if data else None
        readable: asyncio.Future[None] = loop.create_future()
        fd = conn.fileno()
        loop.add_reader(fd, _wake, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)


def _wake(readable: asyncio.Future[None]) -> None:
    if not readable.done():
        readable.set_result(None)


def _drain(conn: socket.socket) -> None:
    while True:
        try:
            if not conn.recv(64 * 1024):
                return
        except (BlockingIOError, InterruptedError):
            return


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: the OS picks), non-blocking."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


# --- the data plane's transport ----------------------------------------------------------


class TlsChannel(StreamChannel):
    """A ``StreamChannel`` over TLS: a TLS failure is reported as a ``ProtocolError`` naming
    the peer (a record altered in flight, a certificate refused after the handshake)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # The SSL layer copies (encrypts) a write at once: the payload may be reused when
        # nothing of it waits in that layer. Its high-water mark pauses when the size is
        # >= high, so 0 would pause with nothing pending, and nothing would resume it.
        assert self._transport is not None
        self._transport.set_write_buffer_limits(high=1, low=0)

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, ssl.SSLError):
            exc = ProtocolError(describe_ssl_error(exc, f"the data-plane peer at {self.peer}"))
            logger.warning("%s", exc)
        super().connection_lost(exc)


def _required(config: TlsConfig | None, doing: str) -> TlsConfig:
    if config is None:
        raise ConnectionError(
            f"{doing} needs TLS, and AIODIST_TLS_CERT, AIODIST_TLS_KEY and AIODIST_TLS_CA "
            "are not set in this process; set them on every rank"
        )
    return config


async def listen(
    host: str,
    sink_factory: Callable[[], FrameSink],
    *,
    preauth: PreAuthLimits | None = None,
    config: TlsConfig | None = None,
) -> SocketListener:
    """Listen with TLS on ``host`` (numeric) at a port the OS picks.

    ``config`` defaults to ``$AIODIST_TLS_*``.

    ``preauth`` bounds a connection before the data plane's handshake (see
    ``admission.py``), and its deadline the TLS handshake before that.
    """
    config = _required(config or from_env(), "listening on a tls:// address")
    admission = Admission(preauth)
    sock = bind(host, 0)
    _tune(sock)
    server = TlsServer(
        sock,
        lambda: TlsChannel(sink_factory(), admission),
        config.server_context(),
        refusal=b"",
        deadline=admission.limits.deadline,
        max_pending=admission.limits.max_pending,
        what="data-plane listener",
    )
    bound_host, port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if sock.family == socket.AF_INET6 else bound_host
    return SocketListener(f"tls://{shown}:{port}", server, admission)


async def connect(address: str, sink: FrameSink, *, config: TlsConfig | None = None) -> TlsChannel:
    """Connect with TLS to a ``tls://`` address another rank published.

    Raises:
        ConnectionError: This process has no TLS configuration, or the TLS
            handshake failed (the message says why and names the peer).
    """
    config = _required(config or from_env(), f"connecting to {address}")
    host, port = parse(address.replace("tls://", "tcp://", 1))
    try:
        return await dial(
            host,
            port,
            lambda: TlsChannel(sink),
            ssl=config.client_context(),
            server_hostname=host,
            ssl_handshake_timeout=DEFAULT_HANDSHAKE_TIMEOUT,
        )
    except ssl.SSLError as exc:
        raise ConnectionError(describe_ssl_error(exc, f"the rank at {address}")) from exc


#: Seconds a connecting side gives the TLS handshake.
DEFAULT_HANDSHAKE_TIMEOUT: Final = 10.0
