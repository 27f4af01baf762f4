"""A stranger without the token, as a process: it holds N connections to a server.

    python -m tests.helpers.stranger HOST PORT N [--source ADDR] [--send HEX] [--once]

Opens ``N`` TCP connections (from ``--source`` when given: another loopback
address stands for another host), sends ``--send`` on each once connected, and
reads and drops whatever comes back. Each connection the server closes is
opened again at once, so the server faces ``N`` connections however fast it
closes them; with ``--once`` it is not, and the stranger exits once the server
closed them all. It prints ``{"ready": N}`` once all ``N`` are connected (or
tried), and at its end (SIGTERM, stdin closing, or ``--once`` done) one JSON
line of counts: ``opened``, ``closed_by_server``, ``failed`` (a connect
refused or reset), ``received`` (bytes).
"""

from __future__ import annotations

import argparse
import errno
import json
import resource
import selectors
import signal
import socket
import sys
import threading
from typing import Any


def _raise_nofile(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, needed + 64)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("n", type=int)
    parser.add_argument("--source", default="")
    parser.add_argument("--send", default="", help="hex bytes sent on each connection")
    parser.add_argument("--once", action="store_true", help="do not reopen closed connections")
    args = parser.parse_args(argv)
    _raise_nofile(args.n + 64)
    payload = bytes.fromhex(args.send)
    sel = selectors.DefaultSelector()
    counts = {"opened": 0, "closed_by_server": 0, "failed": 0, "received": 0}
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    # stdin closing (the test ending) stops it too: no stranger outlives its test.
    def stop_at_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=stop_at_eof, daemon=True).start()

    def open_one() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        if args.source:
            sock.bind((args.source, 0))
        err = sock.connect_ex((args.host, args.port))
        if err not in (0, errno.EINPROGRESS):
            counts["failed"] += 1
            sock.close()
            return
        counts["opened"] += 1
        sel.register(sock, selectors.EVENT_WRITE, "connecting")

    def lost(sock: socket.socket, by_server: bool) -> None:
        sel.unregister(sock)
        sock.close()
        counts["closed_by_server" if by_server else "failed"] += 1
        if not args.once and not stop.is_set():
            open_one()

    for _ in range(args.n):
        open_one()
    print(json.dumps({"ready": args.n}), flush=True)
    while not stop.is_set() and (sel.get_map() or not args.once):
        for key, _ in sel.select(timeout=0.1):
            sock: Any = key.fileobj
            if key.data == "connecting":
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    lost(sock, by_server=False)
                    continue
                if payload:
                    try:
                        sock.send(payload)
                    except OSError:
                        lost(sock, by_server=True)
                        continue
                sel.modify(sock, selectors.EVENT_READ, "open")
                continue
            try:
                data = sock.recv(65536)
            except OSError:
                lost(sock, by_server=True)
                continue
            if not data:
                lost(sock, by_server=True)
            else:
                counts["received"] += len(data)
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
