"""Calls handed to aiodist's loop from other threads that have not started there yet.

A call takes its place in its group's order when it starts on the loop. Code
that takes a sequence number on its own thread (``aiodist.metrics``' fast
path) must wait its turn while such a call is on its way: otherwise ranks
could number the two in different orders. ``aiodist.sync``'s ``start_soon``
and torch's calls on the aiodist backend hand their calls over here.
Importing this module does not import torch.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

_lock = threading.Lock()
_unstarted = 0


def _count(step: int) -> None:
    global _unstarted
    with _lock:
        _unstarted += step


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    """``loop.call_soon_threadsafe(fn)``, counted as on its way until ``fn`` has returned.

    Raises:
        RuntimeError: The loop is closed; nothing was handed over.
    """

    def run() -> None:
        try:
            fn()
        finally:
            _count(-1)

    _count(1)
    try:
        loop.call_soon_threadsafe(run)
    except BaseException:
        _count(-1)  # the loop is gone: nothing was handed over
        raise


def quiet() -> bool:
    """True when every call handed to the loop has started."""
    return _unstarted == 0
