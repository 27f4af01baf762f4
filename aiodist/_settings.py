"""Every ``AIODIST_*`` environment variable: declared once, read and checked here.

Each setting is one declaration (``Setting``): its name, how its text is read
(a number in a range, a whole number, a switch, a choice, text), its default,
and what the reference page says of it. Everything else is derived from
that one table:

- ``Setting.read`` is the only way the library reads a variable: a value that
  is not what the setting takes raises ``ValueError`` naming the variable, the
  value and what is allowed (``AIODIST_HEARTBEAT_TIMEOUT='abc' is not a number
  of seconds; set a number > 0, default 10.0``), never a bare conversion error.
- ``warn_unknown`` logs, once per process, each ``AIODIST_*`` variable that is
  no setting, with the closest one's name: a typo (``AIODIST_TOKNE``) would
  otherwise be ignored in silence (a job without its token runs unauthenticated).
- ``docs/reference/environment.md``'s tables are ``tables()``'s text
  (``python -m aiodist._tools.gen_settings`` writes them; a test checks them).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

logger = logging.getLogger("aiodist")

T = TypeVar("T")

_SWITCH: Final = {"1": True, "true": True, "yes": True, "on": True}
_SWITCH_OFF: Final = {"0": False, "false": False, "no": False, "off": False}


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """One ``AIODIST_*`` variable: how its text is read, its default, its documentation.

    Attributes:
        name: The variable (``AIODIST_...``).
        parse: Text (not blank) to value; raises ``ValueError`` with what
            is allowed (the message is completed with the name and the value).
        default: The value when the variable is unset or empty.
        doc: What it does, for the reference page ("" keeps it off the ranks' table).
        shown: The default as the reference page shows it.
        flag: The ``aiodist serve`` flag it is the default of, if any.
        serve_default: That flag's default as the daemon's table shows it.
    """

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str = ""
    shown: str = "unset"
    flag: str = ""
    serve_default: str = ""

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text as it is, None when unset (for a setting that parses it itself)."""
        return (os.environ if environ is None else environ).get(self.name)

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in ``environ`` (default ``os.environ``), checked.

        Raises:
            ValueError: The variable holds what this setting does not take.
        """
        raw = (os.environ if environ is None else environ).get(self.name, "")
        if not raw.strip():
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            unset = "" if self.default is None else f" (unset: {self.default})"
            raise ValueError(f"{self.name}={raw!r} is not {exc}{unset}") from None


def _number(low: float, *, above: bool = False, high: float = math.inf) -> Callable[[str], float]:
    bound = f"> {low:g}" if above else f">= {low:g}"
    if high < math.inf:
        bound += f" and <= {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value > low if above else value >= low) or not value <= high:  # NaN too
            raise ValueError(f"a number of seconds; set a number {bound}")
        return value

    return parse


def _whole(low: int, high: int | None = None, what: str = "a whole number") -> Callable[[str], int]:
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{what}; set a whole number {bound}") from None
        if value < low or (high is not None and value > high):
            raise ValueError(f"{what} {bound}; set one {bound}")
        return value

    return parse


def _switch(text: str) -> bool:
    text = text.strip().lower()
    value = _SWITCH.get(text, _SWITCH_OFF.get(text))
    if value is None:
        raise ValueError("a switch; set 1 (on) or 0 (off)")
    return value


def _choice(*choices: str) -> Callable[[str], str | None]:
    def parse(text: str) -> str | None:
        if text.strip().lower() not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        return text.strip().lower()

    return parse


def _text(text: str) -> str | None:
    return text.strip()


def _secret(text: str) -> str | None:
    return text  # as it is: a token is compared byte for byte


def _endpoint(text: str) -> str | None:
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdecimal() or not 0 < int(port) < 65536:
        raise ValueError("HOST:PORT with a port in 1..65535")
    return text


_PORT: Final = _whole(0, 65535, "a port")
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
LOG_FORMATS: Final = ("text", "json")


def _port_or_none(text: str) -> int | None:
    return _PORT(text)


_DOCS_SECURITY: Final = "../operations/security.md"

TOKEN: Final = Setting(
    "AIODIST_TOKEN",
    _secret,
    None,
    "the job's token: ranks prove it to the server and to each other, and a server this "
    "process embeds or `aiodist run` hosts requires it "
    f"([Security]({_DOCS_SECURITY}))",
    shown="none",
)

TLS_CERT: Final = Setting(
    "AIODIST_TLS_CERT",
    _text,
    None,
    "this process's TLS certificate (PEM): with `AIODIST_TLS_KEY` and `AIODIST_TLS_CA`, "
    "the server's connections and the ranks' TCP data plane use mutual TLS "
    f"([Security]({_DOCS_SECURITY}#encryption-mutual-tls))",
    flag="--tls-cert",
    serve_default="none: clear TCP (also for `aiodist status` and `aiodist run`)",
)

TLS_KEY: Final = Setting(
    "AIODIST_TLS_KEY",
    _text,
    None,
    "its private key (PEM)",
    flag="--tls-key",
    serve_default="none",
)

TLS_CA: Final = Setting(
    "AIODIST_TLS_CA",
    _text,
    None,
    "the job's CA (PEM): the other side's certificate must be signed by it",
    flag="--tls-ca",
    serve_default="none",
)

JOB_ID: Final = Setting(
    "AIODIST_JOB_ID",
    _text,
    None,
    "the default `group_name`: the job's name on a shared server",
    shown="set by `aiodist run`",
)

EMBED: Final = Setting(
    "AIODIST_EMBED",
    _switch,
    False,
    "`1`: this process may start the server embedded in itself on `tcp://` and `env://`, "
    "as rank 0 does",
)

MAX_WORLD_SIZE: Final = Setting(
    "AIODIST_MAX_WORLD_SIZE",
    _whole(0),
    0,
    "make the job elastic up to this many ranks alive: it forms with `WORLD_SIZE` ranks "
    "and admits later joiners with the next free rank "
    "([Growing](../guide/elastic.md#growing-ranks-that-join-a-running-job)); "
    "`max_world_size=` wins; `aiodist run --nnodes MIN:MAX` and `--replace-failed` set it",
    shown="unset (`0`)",
)

HEARTBEAT_INTERVAL: Final = Setting(
    "AIODIST_HEARTBEAT_INTERVAL",
    _number(0, above=True),
    1.0,
    "seconds between a rank's heartbeats",
    shown="`1.0`",
)

HEARTBEAT_TIMEOUT: Final = Setting(
    "AIODIST_HEARTBEAT_TIMEOUT",
    _number(0, above=True),
    10.0,
    "seconds of silence after which a rank is declared failed (and a rank counts its "
    "server as gone)",
    shown="`10.0`",
)

HOST: Final = Setting(
    "AIODIST_HOST",
    _text,
    None,
    "the address a server that other hosts must reach listens on "
    "([Many hosts](../guide/launching.md#many-hosts)); for the daemon, `--host`",
    flag="--host",
    serve_default="`127.0.0.1`",
)

SOCKET_IFNAME: Final = Setting(
    "AIODIST_SOCKET_IFNAME",
    _text,
    None,
    "the network interface whose IPv4 address that server listens on, as "
    "`GLOO_SOCKET_IFNAME` names one for gloo",
)

UDS: Final = Setting(
    "AIODIST_UDS",
    _switch,
    True,
    "`0`: ranks that reach their server over loopback listen on TCP instead of a Unix socket",
    shown="`1`",
)

SHM: Final = Setting(
    "AIODIST_SHM",
    _switch,
    True,
    "`0`: no shared memory between ranks of one host: no ring for large payloads, no "
    "board for small collectives (set it on every rank)",
    shown="`1`",
)

TRANSPORT: Final = Setting(
    "AIODIST_TRANSPORT",
    _text,
    None,
    "the transports a rank listens on, in order (`crc,tcp`): built-in (`tcp`, `uds`, "
    "`shm`, `tls`; with `AIODIST_TLS_*` set, `tcp` means `tls`) or "
    "[registered](../guide/transports.md)",
)

SHARED_CONTROL: Final = Setting(
    "AIODIST_SHARED_CONTROL",
    _switch,
    True,
    "`0`: each member of a process gets a control connection of its own instead of a "
    "channel on a shared one",
    shown="`1`",
)

SPIN_US: Final = Setting(
    "AIODIST_SPIN_US",
    _whole(0, what="a whole number of microseconds"),
    200,
    "microseconds a task awaiting a `Work` keeps its loop polling before it sleeps; `0` "
    "turns polling off",
    shown="`200`",
)

METRICS_SHM: Final = Setting(
    "AIODIST_METRICS_SHM",
    _switch,
    True,
    "`0`: metric syncs between ranks of one host go over the data plane instead of a "
    "shared-memory board",
    shown="`1`",
)

SERVER_GRACE: Final = Setting(
    "AIODIST_SERVER_GRACE",
    _number(0, high=86400),
    60.0,
    "seconds a rank whose server may come back (a daemon) reconnects to it before "
    "breaking its groups; `0`: break at once "
    "([Restarting the daemon](../operations/daemon.md#restarting-the-daemon))",
    shown="`60`",
)

CHECK_SIGNATURES: Final = Setting(
    "AIODIST_CHECK_SIGNATURES",
    _switch,
    False,
    '`1`: each collective a torch backend carries (`backend="gloo"`, `"nccl"`) first '
    "agrees on its signature (op, dtype, shape, reduction, root) with its peers over "
    "aiodist's data plane, so that a mismatch fails cleanly on every rank instead of "
    "hanging or aborting in torch; `TORCH_DISTRIBUTED_DEBUG=DETAIL` turns it on too "
    "([GPUs](../guide/gpus.md))",
)

TORCH_GROUP: Final = Setting(
    "AIODIST_TORCH_GROUP",
    _switch,
    True,
    "`0`: `init_process_group()` with no backend leaves torch.distributed alone instead "
    "of bringing up its default group on the [`aiodist` backend](../guide/torch-backend.md) "
    "(`cpu:aiodist,cuda:nccl`) as torch does",
    shown="`1`",
)

TORCH_PARTS: Final = Setting(
    "AIODIST_TORCH_PARTS",
    _text,
    None,
    "the [device parts](../guide/torch-backend.md#cuda-tensors-the-nccl-part) of the "
    "`aiodist` backend: `DEVICE:BACKEND` pairs whose tensors torch's calls send to that "
    "torch backend, built over the group's members and again when they change; "
    "`cpu:gloo` makes gloo stand in for NCCL on CPU",
    shown="`cuda:nccl` where CUDA and NCCL are there, else none",
)

SERVER: Final = Setting(
    "AIODIST_SERVER",
    _endpoint,
    None,
    "`HOST:PORT` of the job's rendezvous server: `env://` connects there, while "
    "`MASTER_ADDR:MASTER_PORT` is torch's store that `aiodist run` hosts, as torchrun's "
    "agent does",
    shown="set by `aiodist run` on one node",
)

RPC_THREADS: Final = Setting(
    "AIODIST_RPC_THREADS",
    _whole(1, what="a number of threads"),
    16,
    "threads a rank runs plain functions of [remote calls](../guide/rpc.md) in",
    shown="`16`",
)

RECORDER_SIZE: Final = Setting(
    "AIODIST_RECORDER_SIZE",
    _whole(0, what="a number of operations"),
    2048,
    "operations a rank's [flight recorder](../guide/observability.md) keeps; `0` turns it off",
    shown="`2048`",
)

DUMP_DIR: Final = Setting(
    "AIODIST_DUMP_DIR",
    _text,
    None,
    "where a rank writes its flight recorder when a group breaks (only when set), on "
    "`SIGUSR1` and when `aiodist status --dump` asks (when unset: `aiodist-dumps-<uid>`, "
    "mode 0700, in the temporary directory; made, mode 0700, if it is not there); where "
    "`aiodist status --dump` looks for them",
)

TRACE: Final = Setting(
    "AIODIST_TRACE",
    _text,
    None,
    "a directory: each rank writes its [timeline](../guide/observability.md#a-timeline) "
    "there as trace-event JSON when it leaves the job",
)

PORT: Final = Setting("AIODIST_PORT", _PORT, 29500, flag="--port", serve_default="`29500`")

TOKEN_FILE: Final = Setting(
    "AIODIST_TOKEN_FILE",
    _text,
    None,
    flag="--token-file",
    serve_default="none (then `AIODIST_TOKEN`, if set)",
)

METRICS_PORT: Final = Setting(
    "AIODIST_METRICS_PORT",
    _port_or_none,
    None,
    flag="--metrics-port",
    serve_default="none: no metrics endpoint",
)

METRICS_HOST: Final = Setting(
    "AIODIST_METRICS_HOST", _text, None, flag="--metrics-host", serve_default="`--host`"
)

LOG_LEVEL: Final = Setting(
    "AIODIST_LOG_LEVEL",
    _choice(*LOG_LEVELS),
    None,
    flag="--log-level",
    serve_default="`info`",
)

LOG_FORMAT: Final = Setting(
    "AIODIST_LOG_FORMAT",
    _choice(*LOG_FORMATS),
    None,
    flag="--log-format",
    serve_default="`text` (or `json`)",
)

SHUTDOWN_TIMEOUT: Final = Setting(
    "AIODIST_SHUTDOWN_TIMEOUT",
    _number(0),
    5.0,
    flag="--shutdown-timeout",
    serve_default="`5` seconds",
)

STATE_DIR: Final = Setting(
    "AIODIST_STATE_DIR",
    _text,
    None,
    flag="--state-dir",
    serve_default="none: jobs live in memory only",
)

#: The settings, in the order the reference page lists them.
SETTINGS: Final[tuple[Setting[Any], ...]] = (
    TOKEN,
    TLS_CERT,
    TLS_KEY,
    TLS_CA,
    JOB_ID,
    EMBED,
    MAX_WORLD_SIZE,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    HOST,
    SOCKET_IFNAME,
    UDS,
    SHM,
    TRANSPORT,
    SHARED_CONTROL,
    SPIN_US,
    METRICS_SHM,
    SERVER_GRACE,
    CHECK_SIGNATURES,
    TORCH_GROUP,
    TORCH_PARTS,
    SERVER,
    RPC_THREADS,
    RECORDER_SIZE,
    DUMP_DIR,
    TRACE,
    PORT,
    TOKEN_FILE,
    METRICS_PORT,
    METRICS_HOST,
    LOG_LEVEL,
    LOG_FORMAT,
    SHUTDOWN_TIMEOUT,
    STATE_DIR,
)

_BY_NAME: Final = {s.name: s for s in SETTINGS}


def by_name(name: str) -> Setting[Any]:
    """The setting called ``name`` (``AIODIST_...``). Raises ``KeyError`` for no setting."""
    return _BY_NAME[name]


_warned_in = 0  # the pid that warned (a forked child warns again, for its own environment)


def warn_unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """Log each ``AIODIST_*`` variable that is no setting, with the closest name; once.

    Returns the unknown names (also when they were logged before).
    """
    global _warned_in
    env = os.environ if environ is None else environ
    unknown = sorted(n for n in env if n.startswith("AIODIST_") and n not in _BY_NAME)
    if environ is None and _warned_in == os.getpid():
        return unknown
    if environ is None:
        _warned_in = os.getpid()
    for name in unknown:
        close = difflib.get_close_matches(name, _BY_NAME, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        logger.warning(
            "%s is not an aiodist setting%s; it is ignored (the settings: "
            "docs/reference/environment.md)",
            name,
            hint,
        )
    return unknown


def tables() -> tuple[str, str]:
    """The reference page's two tables: the ranks' settings, the daemon's flags."""
    ranks = ["| variable | default | what it does |", "| --- | --- | --- |"]
    ranks += [f"| `{s.name}` | {s.shown} | {s.doc} |" for s in SETTINGS if s.doc]
    serve = ["| variable | flag | default |", "| --- | --- | --- |"]
    serve += [f"| `{s.name}` | `{s.flag}` | {s.serve_default} |" for s in SETTINGS if s.flag]
    return "\n".join(ranks), "\n".join(serve)
