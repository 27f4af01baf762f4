"""The ``aiodist`` command: ``serve``, ``status`` and ``run``. The only module that prints."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import anyio

from aiodist._server.serve import DEFAULT_PORT

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["main"]

logger = logging.getLogger("aiodist")


def _env(name: str, default: str) -> str:
    return os.environ.get(f"AIODIST_{name}", default)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiodist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the rendezvous server in the foreground")
    serve.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to bind")
    serve.add_argument("--port", type=int, default=int(_env("PORT", str(DEFAULT_PORT))))
    serve.add_argument("--log-level", default=_env("LOG_LEVEL", "info"))

    status = sub.add_parser("status", help="show the jobs a rendezvous server holds")
    status.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    status.add_argument("--port", type=int, default=int(_env("PORT", str(DEFAULT_PORT))))
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--timeout", type=float, default=5.0)

    run = sub.add_parser("run", help="start N local ranks of a script (like torchrun)")
    run.add_argument("-n", "--nproc-per-node", type=int, default=1, dest="nproc")
    run.add_argument("--master-addr", default="127.0.0.1")
    run.add_argument("--master-port", type=int, default=0, help="0: pick a free port")
    run.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    run.add_argument("--log-level", default=_env("LOG_LEVEL", "warning"))
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aiodist`` and ``python -m aiodist``; returns the exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper() if hasattr(args, "log_level") else "WARNING",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        return _run_async(_serve(args.host, args.port))
    if args.command == "status":
        return _run_async(_status(args.host, args.port, as_json=args.json, timeout=args.timeout))
    from aiodist._launch import launch

    return _run_async(
        launch(
            [sys.executable, args.script, *args.args],
            nproc=args.nproc,
            master_addr=args.master_addr,
            master_port=args.master_port,
            prefix=not args.no_prefix,
        )
    )


def _run_async(coro: Any) -> int:
    try:
        import uvloop

        return int(anyio.run(lambda: coro, backend_options={"loop_factory": uvloop.new_event_loop}))
    except ImportError:  # pragma: no cover - uvloop is a dependency, but optional at runtime
        return int(anyio.run(lambda: coro))


async def _serve(host: str, port: int) -> int:
    from aiodist._server.serve import serve_rendezvous

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_rendezvous, host, port)
        print(
            f"aiodist rendezvous server listening on {server.address[0]}:{server.address[1]}",
            flush=True,
        )
        await stop.wait()
        logger.info("shutting down")
        tg.cancel_scope.cancel()
    return 0


async def _status(host: str, port: int, *, as_json: bool, timeout: float) -> int:
    from aiodist._control import connect_control
    from aiodist._errors import DistError
    from aiodist._wire.messages import StatusRequest

    try:
        conn = await connect_control(host, port, timeout=timeout, retry_refused=False)
    except (OSError, DistError) as exc:
        print(
            f"aiodist status: no rendezvous server answers at {host}:{port} ({exc})",
            file=sys.stderr,
        )
        return 1
    try:
        snap = await conn.request(StatusRequest, timeout=timeout)
    finally:
        conn.close()
    if as_json:
        print(json.dumps(snap, indent=2, sort_keys=True))
        return 0
    print(f"server {host}:{port}  up {snap['uptime']:.0f} s  connections {snap['connections']}")
    if not snap["jobs"]:
        print("no jobs")
    for job in snap["jobs"]:
        print(f"\njob {job['name']!r}: {job['state']}, {job['joined']}/{job['world_size']} joined")
        print(f"  {'rank':>4}  {'local':>5}  {'host':<20} {'pid':>8}  {'status':<8} heartbeat")
        for m in job["members"]:
            print(
                f"  {m['rank']:>4}  {m['local_rank']:>5}  {m['host']:<20} {m['pid']:>8}  "
                f"{m['status']:<8} {m['heartbeat_age']:.1f} s ago"
            )
        for f in job["failures"]:
            print(f"  FAILED rank {f['rank']} ({f['host']}, pid {f['pid']}): {f['reason']}")
    return 0
