"""The store torchrun's agent hosts, hosted by ``aiodist run``: torch's own init finds it.

A torch script's ``torch.distributed.init_process_group()`` (``env://``, any
backend: gloo, nccl, aiodist, none) opens a ``TCPStore`` at
``MASTER_ADDR:MASTER_PORT``; under torchrun
(``TORCHELASTIC_USE_AGENT_STORE=True``) every rank is a client of the store
torchrun's agent hosts. ``aiodist run`` does the same: its ranks get
``MASTER_ADDR``/``MASTER_PORT`` of a store hosted for them and find aiodist's
own server at ``AIODIST_SERVER`` instead. Without it, rank 0's TCPStore wanted
the port aiodist's server held (``EADDRINUSE``).

The socket is bound and listening before the ranks start, so no port is
guessed and none can be taken meanwhile. The store itself is served on it by
a small process of its own (``python -c``, handed the socket), started when
the first rank connects (the connection waits in the socket's backlog while
it imports torch), so a job whose ranks never open torch's store pays
nothing. The launcher stays free of torch (its exit would tear torch down,
seconds on a busy machine), and stopping the store is ending that process, at
once; it also ends when the launcher does (its stdin closes). A machine
without torch hosts nothing: its ranks cannot call torch either. One store
per start of the ranks (``--max-restarts`` starts them again with a new one,
as torchrun does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
from typing import Final

logger = logging.getLogger(__name__)

#: The store's process: serve on the inherited socket until stdin closes.
_SERVE: Final = """
import datetime, sys
from torch.distributed import TCPStore
fd = int(sys.argv[1])
store = TCPStore(sys.argv[2], int(sys.argv[3]), None, True, datetime.timedelta(minutes=30),
                 wait_for_workers=False, master_listen_fd=fd)
sys.stdin.read()
"""


class AgentStore:
    """A torch ``TCPStore`` server on ``host``, for the ranks of one start.

    Its process starts when the first rank connects (``serve_on_demand``): a job
    whose ranks never open torch's own store (aiodist's calls, torch's group that
    aiodist brings up) never pays for it.

    Args:
        host: Where it listens (the launcher's host, as the ranks reach it).
    """

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock: socket.socket | None = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, 0))
            self._sock.listen(1024)
        except BaseException:
            self._sock.close()
            raise
        self.address: tuple[str, int] = (host, int(self._sock.getsockname()[1]))
        self._proc: subprocess.Popen[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def serve_on_demand(self) -> None:
        """Start the store's process once a connection waits (on this event loop)."""
        assert self._sock is not None
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._start)

    def _start(self) -> None:
        """A rank connects: serve the store from now on (the connection waits meanwhile)."""
        sock = self._sock
        if self._loop is None or sock is None:
            return
        self._loop.remove_reader(sock.fileno())
        self._loop = None
        fd = sock.fileno()
        argv = [sys.executable, "-c", _SERVE, str(fd), *map(str, self.address)]
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                pass_fds=(fd,),
                start_new_session=True,  # a terminal's Ctrl-C is the launcher's to handle
            )
        except OSError as exc:  # no process could be started: the ranks find no store
            logger.warning(
                "not hosting torch's store for the ranks (%s): a torch script's own "
                "init_process_group() cannot find one at MASTER_ADDR:MASTER_PORT",
                exc,
            )

    def close(self) -> None:
        """Stop serving (after the ranks of its start ended); on the launcher's loop."""
        sock, self._sock = self._sock, None
        if sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(sock.fileno())
                self._loop = None
            sock.close()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        proc.wait()
