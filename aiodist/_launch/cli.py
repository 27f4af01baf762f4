"""The ``aiodist`` command: ``serve``, ``status``, ``trace``, ``run``. The only module that prints.

Every ``serve`` flag can also come from an ``AIODIST_*`` environment variable
(``--token-file`` from ``AIODIST_TOKEN_FILE``, ...); a flag on the command line wins.
Without a token file, ``serve`` requires ``$AIODIST_TOKEN`` when it is set, the
token clients send: one exported token configures both ends.

The server's job events (``aiodist.events``) are logged as JSON lines, one
object per event, in either log format.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from aiodist import _settings
from aiodist._errors import first_of
from aiodist._launch.forkserver import START_METHODS
from aiodist._server.serve import DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT, version
from aiodist._wire.tls import VARIABLES as TLS_VARIABLES

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from aiodist._server.serve import RendezvousServer
    from aiodist._transport.tls import TlsConfig

logger = logging.getLogger("aiodist")

LOG_LEVELS = _settings.LOG_LEVELS
LOG_FORMATS = _settings.LOG_FORMATS

T = TypeVar("T")


def _env(name: str, default: Any) -> Any:
    """A flag's default: ``AIODIST_<name>``, checked (``ValueError`` names it), or ``default``."""
    value = _settings.by_name(f"AIODIST_{name}").read()
    return default if value is None else value


def _time(record: logging.LogRecord) -> str:
    return datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC).isoformat(
        timespec="milliseconds"
    )


def _event_line(record: logging.LogRecord) -> str | None:
    """A job event's record as its JSON line: the time, then the event's fields."""
    event = getattr(record, "aiodist_event", None)
    if not isinstance(event, dict):
        return None
    return json.dumps({"time": _time(record), **event})


class _JsonFormatter(logging.Formatter):
    """One JSON object per line, for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        if (line := _event_line(record)) is not None:
            return line
        out: dict[str, Any] = {
            "time": _time(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _TextFormatter(logging.Formatter):
    """Plain lines, but job events as JSON lines (for ``grep '"event"'`` and ``jq``)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = _event_line(record)
        return line if line is not None else super().format(record)


def _configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiodist",
        description="aiodist's command line: run a rendezvous server (serve), ask one how "
        "its jobs are doing (status), or start the ranks of a job (run).",
    )
    parser.add_argument("--version", action="version", version=f"aiodist {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the rendezvous server in the foreground",
        description="Run the rendezvous server in the foreground until SIGTERM or SIGINT. "
        "Each flag defaults to its AIODIST_* environment variable (--port: AIODIST_PORT).",
    )
    serve.add_argument(
        "--host", default=_env("HOST", "127.0.0.1"), help="address to bind (AIODIST_HOST)"
    )
    serve.add_argument("--port", type=int, default=_env("PORT", DEFAULT_PORT))
    serve.add_argument(
        "--token-file",
        default=_env("TOKEN_FILE", None),
        help="require clients to prove this file's token (AIODIST_TOKEN_FILE; without it, "
        "the token is $AIODIST_TOKEN, if set)",
    )
    _add_tls(serve, "require mutual TLS of every client: this server's certificate")
    serve.add_argument(
        "--metrics-port", type=int, default=_env("METRICS_PORT", None), help="Prometheus port"
    )
    serve.add_argument("--metrics-host", default=_env("METRICS_HOST", None), help="default: --host")
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=_env("SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT),
        help="seconds to let clients take the closing notice",
    )
    serve.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, default=_env("LOG_LEVEL", "info")
    )
    serve.add_argument("--log-format", choices=LOG_FORMATS, default=_env("LOG_FORMAT", "text"))
    serve.add_argument(
        "--state-dir",
        default=_env("STATE_DIR", None),
        help="keep the jobs' state here (a log and snapshots) so that a restart keeps them "
        "(AIODIST_STATE_DIR)",
    )

    status = sub.add_parser("status", help="show the jobs a rendezvous server holds")
    status.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    status.add_argument("--port", type=int, default=_env("PORT", DEFAULT_PORT))
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--timeout", type=float, default=5.0)
    status.add_argument(
        "--token-file", default=None, help="the server's token (default: $AIODIST_TOKEN)"
    )
    _add_tls(status, "talk to a TLS server: this client's certificate")
    status.add_argument(
        "--job", default=None, help="one job: what each rank is doing, who the others wait for"
    )
    status.add_argument(
        "--dump",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="with --job: have every rank write its flight recorder into its dump directory "
        "(AIODIST_DUMP_DIR, else a private one of its user's), then collect them into one "
        "file there; DIR is where this host sees that directory (default: this user's own, "
        "which is the ranks' on this host)",
    )

    trace = sub.add_parser("trace", help="timelines: merge the ranks' trace files")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    merge = trace_sub.add_parser(
        "merge",
        help="merge DIR's aiodist-trace-*.json (AIODIST_TRACE=DIR) into one trace-event file",
    )
    merge.add_argument("directory", metavar="DIR")
    merge.add_argument("-o", "--output", required=True, help="the merged file (Perfetto, chrome)")

    run = sub.add_parser(
        "run",
        help="start the ranks of a script on this node (like torchrun)",
        description="Start N ranks of a script with torchrun's environment, prefix their "
        "output with the rank, and stop them all when one fails (or start them all again, "
        "with --max-restarts). Flags are torchrun's, with - or _.",
    )
    run.add_argument(
        "-n", "--nproc-per-node", "--nproc_per_node", type=int, default=1, dest="nproc"
    )
    run.add_argument(
        "--nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="nodes, one launcher each; MIN:MAX makes the job elastic, as with torchrun: it "
        "forms with MIN nodes' ranks, and nodes up to MAX join it later (next free ranks)",
    )
    run.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        help="without --rdzv-endpoint, node 0 hosts the server",
    )
    run.add_argument(
        "--master-addr",
        "--master_addr",
        default="",
        help="the address node 0 hosts the server on (default: 127.0.0.1 for one node, else "
        "this host's address found from AIODIST_SOCKET_IFNAME or its name)",
    )
    run.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=0,
        help="the server's port (0: node 0 picks a free one and prints it)",
    )
    run.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default="",
        metavar="HOST:PORT",
        help="join the rendezvous server (an `aiodist serve` daemon) there; when nothing "
        "listens there and HOST is this host's, host one there",
    )
    run.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        "--job-id",
        default="",
        dest="job_id",
        help="the job's name on the server (default: a fresh one per launch; "
        "with --nnodes > 1, run-<port>)",
    )
    run.add_argument(
        "--standalone",
        action="store_true",
        help="one node with a server of its own on a free local port (the default)",
    )
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="when a rank fails, stop the others and start them all again, up to this "
        "many times (each start is a new generation of the job)",
    )
    run.add_argument(
        "--replace-failed",
        "--replace_failed",
        action="store_true",
        help="when a rank fails, start a replacement that joins the running (elastic) job "
        "with the next free rank; the other ranks are not stopped",
    )
    run.add_argument(
        "--max-replacements",
        "--max_replacements",
        type=int,
        default=16,
        help="with --replace-failed, how many replacements to start at most",
    )
    run.add_argument(
        "--token-file",
        default=None,
        help="the server requires this file's token; the ranks get it (default: $AIODIST_TOKEN)",
    )
    _add_tls(run, "mutual TLS for the server and between ranks: each rank's certificate")
    run.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    run.add_argument(
        "--start-method",
        "--start_method",
        choices=START_METHODS,
        default=START_METHODS[0],
        help="forkserver: fork each Python rank from one interpreter that imported torch "
        "once (a fresh interpreter for any other command); spawn: a fresh "
        "interpreter for every rank, as torchrun starts scripts",
    )
    run.add_argument("-m", "--module", action="store_true", help="run script as a module")
    run.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, default=_env("LOG_LEVEL", "warning")
    )
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _add_tls(parser: argparse.ArgumentParser, cert_help: str) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca``, each defaulting to its ``AIODIST_TLS_*``."""
    parser.add_argument(
        "--tls-cert", default=_env("TLS_CERT", None), help=f"{cert_help} (AIODIST_TLS_CERT)"
    )
    parser.add_argument(
        "--tls-key", default=_env("TLS_KEY", None), help="its private key (AIODIST_TLS_KEY)"
    )
    parser.add_argument(
        "--tls-ca",
        default=_env("TLS_CA", None),
        help="the job's CA, which must sign the other side's certificate (AIODIST_TLS_CA)",
    )


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    """The TLS flags, checked. Raises ``ValueError`` naming the flag that is wrong."""
    from aiodist._transport.tls import config_from

    cert, key, ca = (f"--{v[8:].lower().replace('_', '-')} ({v})" for v in TLS_VARIABLES)
    return config_from(args.tls_cert, args.tls_key, args.tls_ca, names=(cert, key, ca))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aiodist`` and ``python -m aiodist``; returns the exit code."""
    try:  # the flags' defaults from AIODIST_* variables, each checked (_settings)
        parser = _parser()
    except ValueError as exc:
        print(f"aiodist: {exc}", file=sys.stderr, flush=True)
        return 2
    args = parser.parse_args(argv)
    _configure_logging(
        args.log_level if hasattr(args, "log_level") else "warning",
        getattr(args, "log_format", "text"),
    )
    _settings.warn_unknown()
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        return _status(args)
    if args.command == "trace":
        return _trace(args)
    return _run(args)


def _trace(args: argparse.Namespace) -> int:
    from aiodist._launch.trace import merge_traces

    try:
        out, ranks = merge_traces(args.directory, args.output)
    except (OSError, ValueError) as exc:
        return _fail("trace merge", str(exc))
    from aiodist._errors import counted

    print(f"merged {counted(ranks, 'rank')}' traces into {out}")
    return 0


def run_async(func: Callable[[], Awaitable[T]]) -> T:
    """``anyio.run(func)`` on asyncio, with uvloop's loop factory where uvloop is installed.

    The command's loop, and ``aiodist.sync``'s loop thread (``_sync/portal.py``).
    """
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return anyio.run(func)
    return anyio.run(func, backend_options={"loop_factory": uvloop.new_event_loop})


def _fail(command: str, message: str, code: int = 1) -> int:
    print(f"aiodist {command}: {message}", file=sys.stderr, flush=True)
    return code


def _token(args: argparse.Namespace) -> str | None:
    """The token in ``--token-file``, if given. Raises ``ValueError`` for a bad file."""
    if not args.token_file:
        return None
    from aiodist._launch.daemon import read_token_file

    return read_token_file(args.token_file)


def _serve_token(args: argparse.Namespace) -> tuple[str | None, str]:
    """The server's token and where it came from: ``--token-file``, else ``$AIODIST_TOKEN``.

    The same variable clients read, so one exported token serves both ends.
    Raises ``ValueError`` for a bad file.
    """
    if args.token_file:
        return _token(args), f"from the token file {args.token_file}"
    return _settings.TOKEN.read(), "from AIODIST_TOKEN"


def _serve(args: argparse.Namespace) -> int:
    from aiodist._launch.daemon import run_daemon
    from aiodist._server.durable import StateDirError

    try:
        token, token_source = _serve_token(args)
        tls = _tls(args)
    except ValueError as exc:
        return _fail("serve", str(exc), 2)

    def on_ready(server: RendezvousServer, metrics: str | None) -> None:
        host, port = server.address
        line: dict[str, Any] = {"event": "listening", "host": host, "port": port}
        text = f"aiodist rendezvous server listening on {host}:{port}"
        if metrics is not None:
            line["metrics"] = f"{metrics}/metrics"
            text += f", metrics on {line['metrics']}"
        if token is not None:
            text += ", token required"
        if tls is not None:
            text += ", mutual TLS required"
        line["token_required"] = token is not None
        line["tls"] = tls is not None
        print(json.dumps(line) if args.log_format == "json" else text, flush=True)

    try:
        return int(
            run_async(
                lambda: run_daemon(
                    args.host,
                    args.port,
                    token=token,
                    token_source=token_source,
                    metrics_host=args.metrics_host,
                    metrics_port=args.metrics_port,
                    shutdown_timeout=args.shutdown_timeout,
                    on_ready=on_ready,
                    state_dir=args.state_dir,
                    tls=tls,
                )
            )
        )
    except StateDirError as exc:
        return _fail("serve", str(exc))
    except (OSError, BaseExceptionGroup) as exc:
        if (error := first_of(exc, OSError)) is None:
            raise
        hint = ""
        if error.errno == errno.EADDRINUSE:
            # The usual culprit: a tcp:// job started while no daemon ran, whose rank 0
            # hosts its server embedded on this port until the job ends.
            hint = (
                f"; `aiodist status --port {args.port}` says whether an aiodist server holds "
                "it (a tcp:// job's rank 0 hosts one there when no daemon listens)"
            )
        return _fail("serve", f"cannot listen: {error}{hint}")


def _status(args: argparse.Namespace) -> int:
    try:
        token = _token(args)
        tls = _tls(args)
    except ValueError as exc:
        return _fail("status", str(exc), 2)
    return int(run_async(lambda: _status_async(args, token, tls)))


async def _status_async(
    args: argparse.Namespace, token: str | None, tls: TlsConfig | None = None
) -> int:
    from aiodist._control.connection import connect_control
    from aiodist._errors import AuthenticationError, DistError
    from aiodist._wire.messages import StatusRequest
    from aiodist._wire.text import printable_data

    where = f"{args.host}:{args.port}"

    def fail(message: str) -> int:
        if args.json:  # a script reading --json gets JSON, failure or not
            print(json.dumps({"server": where, "error": message}, indent=2, sort_keys=True))
        return _fail("status", message)

    try:
        conn = await connect_control(
            args.host,
            args.port,
            timeout=args.timeout,
            retry_refused=False,
            token=token,
            tls_config=tls,
        )
    except AuthenticationError as exc:  # refused us, or could not prove our token
        return fail(str(exc))
    except (OSError, DistError) as exc:
        return fail(f"no rendezvous server answers at {where} ({exc})")
    try:
        if args.dump is not None:
            from aiodist._launch.status_job import collect_dumps

            if args.job is None:
                return _fail("status", "--dump needs --job", 2)
            try:
                path, missing = await collect_dumps(conn, args.job, args.dump, args.timeout)
            except (ValueError, DistError) as exc:
                return _fail("status", str(exc))
            print(f"flight recorders of job {args.job!r} collected in {path}")
            if missing:
                print(f"ranks {', '.join(map(str, missing))} wrote none in time", file=sys.stderr)
                return 1
            return 0
        # Every string of it shown as printable text: host names and failure reasons come
        # from clients, and a terminal acts on escape sequences.
        job_name = args.job or ""
        asked = await conn.request(lambda r: StatusRequest(r, job_name), timeout=args.timeout)
        snap = printable_data(asked)
    except AuthenticationError as exc:
        return fail(f"the server at {where} refused us: {exc}")
    except DistError as exc:
        return fail(f"the server at {where} did not report its status ({exc})")
    finally:
        conn.close()
    if args.job is not None:
        from aiodist._launch.status_job import find_job, format_job

        job = find_job(snap, args.job)
        if job is None:
            return _fail("status", f"the server at {where} holds no job {args.job!r}")
        if args.json:
            print(json.dumps({"server": where, "job": job}, indent=2, sort_keys=True))
        else:
            print(format_job(job))
        return 0
    if args.json:
        print(json.dumps({"server": where, **snap}, indent=2, sort_keys=True))
    else:
        print(format_status(where, snap))
    return 0


def _age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def format_status(where: str, snap: dict[str, Any]) -> str:
    """The human-readable ``aiodist status`` report of a server's snapshot."""
    lines = [
        f"aiodist {snap.get('version') or '?'} at {where}: up {_age(snap['uptime'])}, "
        f"{snap['connections']} connections, {snap.get('jobs_total', len(snap['jobs']))} jobs"
    ]
    if not snap["jobs"]:
        lines.append("no jobs")
    for job in snap["jobs"]:
        lines.append("")
        generation = f" (generation {job['generation']})" if job.get("generation") else ""
        lines.append(
            f"job {job['name']!r}{generation}: {job['state']}, {job['joined']}/"
            f"{job['world_size']} joined, age {_age(job['age'])}, {job['keys']} keys"
        )
        hosts = [m["host"] for m in job["members"]]
        host_width = max([len("HOST"), *(len(h) for h in hosts)])
        lines.append(
            f"  {'RANK':>4}  {'LOCAL':>5}  {'HOST':<{host_width}}  {'PID':>8}  {'STATUS':<7}  "
            "HEARTBEAT"
        )
        for m in job["members"]:
            rank = "?" if m["rank"] is None else m["rank"]
            local = "?" if m["local_rank"] < 0 else m["local_rank"]
            lines.append(
                f"  {rank:>4}  {local:>5}  {m['host']:<{host_width}}  {m['pid']:>8}  "
                f"{m['status']:<7}  {_age(m['heartbeat_age'])} ago"
            )
        if job.get("ranks_hidden"):
            lines.append(f"  ... and {job['ranks_hidden']} more ranks (aiodist status --job)")
        lines.extend(
            f"  FAILED rank {f['rank']} ({f['host']}, pid {f['pid']}): {f['reason']}"
            for f in job["failures"]
        )
    if (hidden := snap.get("jobs_total", 0) - len(snap["jobs"])) > 0:
        lines += ["", f"... and {hidden} more jobs (aiodist status --job NAME shows one)"]
    if finished := snap.get("finished"):
        lines += ["", "recently finished:"]
        for f in finished:
            generation = f" (generation {f['generation']})" if f["generation"] else ""
            lines.append(
                f"  job {f['job']!r}{generation}: {f['state']} after {_age(f['seconds'])}, "
                f"{_age(f['ago'])} ago" + (f" ({f['reason']})" if f.get("reason") else "")
            )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from aiodist._errors import DistError
    from aiodist._launch.run import LaunchSpec, launch

    cmd = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
    try:
        lo, _, hi = args.nnodes.partition(":")
        nnodes, max_nnodes = int(lo), int(hi) if hi else 0
    except ValueError:
        return _fail("run", f"--nnodes must be N or MIN:MAX, got {args.nnodes!r}", 2)
    if args.standalone and (nnodes != 1 or max_nnodes or args.rdzv_endpoint or args.master_addr):
        return _fail(
            "run",
            "--standalone runs one node with a server of its own: leave out --nnodes, "
            "--rdzv-endpoint and --master-addr",
            2,
        )
    try:
        tls = _tls(args)
        spec = LaunchSpec(
            cmd,
            nproc=args.nproc,
            nnodes=nnodes,
            max_nnodes=max_nnodes,
            replace_failed=args.replace_failed,
            max_replacements=args.max_replacements,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            rdzv_endpoint=args.rdzv_endpoint,
            job_id=args.job_id,
            max_restarts=args.max_restarts,
            token=_token(args),
            prefix=not args.no_prefix,
            start_method=args.start_method,
        )
    except ValueError as exc:
        return _fail("run", str(exc), 2)
    if tls is not None:  # the ranks and the server this launcher may host read them
        os.environ.update(zip(TLS_VARIABLES, (tls.cert, tls.key, tls.ca), strict=True))

    def on_server(address: tuple[str, int]) -> None:
        if spec.nnodes > 1:
            print(
                f"aiodist run: rendezvous server for {spec.nnodes} nodes on "
                f"{address[0]}:{address[1]}; start the other nodes with --master-addr "
                f"{address[0]} --master-port {address[1]}",
                file=sys.stderr,
                flush=True,
            )

    try:
        result = run_async(lambda: launch(spec, on_server=on_server))
    except DistError as exc:
        return _fail("run", str(exc))
    except (OSError, BaseExceptionGroup) as exc:
        if (error := first_of(exc, OSError)) is None:
            if (
                isinstance(exc, BaseExceptionGroup)
                and (dist := first_of(exc, DistError)) is not None
            ):
                return _fail("run", str(dist))
            raise
        return _fail("run", f"cannot start: {error}")
    if result.summary:
        print(result.summary, file=sys.stderr, flush=True)
    return int(result.exit_code)
