"""The store torchrun's agent hosts, hosted by ``aiodist run``: torch's own init finds it.

A torch script's ``torch.distributed.init_process_group()`` (``env://``, any
backend: gloo, nccl, aiodist, none) opens a ``TCPStore`` at
``MASTER_ADDR:MASTER_PORT``; under torchrun
(``TORCHELASTIC_USE_AGENT_STORE=True``) every rank is a client of the store
torchrun's agent hosts. ``aiodist run`` does the same: its ranks get
``MASTER_ADDR``/``MASTER_PORT`` of a store hosted here and find aiodist's own
server at ``AIODIST_SERVER`` instead. Without it, rank 0's TCPStore wanted
the port aiodist's server held (``EADDRINUSE``).

The socket is bound and listening before the ranks start, so no port is
guessed and none can be taken meanwhile; torch is imported and the store
starts serving on it in a thread (about a second, while the ranks import
torch themselves), and ranks that connect sooner wait in the socket's
backlog. A launcher that cannot import torch hosts nothing: its ranks cannot
call torch either. One store per start of the ranks (``--max-restarts``
starts them again with a new one, as torchrun does).
"""

from __future__ import annotations

import logging
import socket
import threading
from datetime import timedelta
from typing import Any, Final

__all__ = ["AgentStore"]

logger = logging.getLogger(__name__)

#: torch's own default for its stores' operations.
STORE_TIMEOUT: Final = timedelta(minutes=30)


class AgentStore:
    """A torch ``TCPStore`` server on ``host``, for the ranks of one start.

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
        self._store: Any = None
        self._thread = threading.Thread(target=self._serve, name="aiodist-agent-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]

            store = TCPStore(
                self.address[0],
                self.address[1],
                None,
                True,
                STORE_TIMEOUT,
                wait_for_workers=False,
                master_listen_fd=sock.fileno(),
            )
        except Exception as exc:  # no torch here (or no distributed build): nothing to host
            logger.warning(
                "not hosting torch's store for the ranks (%s): a torch script's own "
                "init_process_group() cannot find one at MASTER_ADDR:MASTER_PORT",
                exc,
            )
            return
        sock.detach()  # the store's server owns the descriptor now
        self._sock = None
        self._store = store

    def close(self) -> None:
        """Stop serving (after the ranks of its start ended)."""
        self._thread.join(timeout=30)
        self._store = None  # the store's server stops with its last reference
        if self._sock is not None:
            self._sock.close()
            self._sock = None
