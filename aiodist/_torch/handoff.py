"""torch's calls on the aiodist backend that were handed to aiodist's loop and not started yet.

A call takes its place in its group's order when it starts on the loop. Code
that takes a sequence number on its own thread (``aiodist.metrics``' fast
path, as ``aiodist.sync``'s ``portal.quiet`` allows) must wait its turn while
a call of torch's is on its way: otherwise ranks could number the two in
different orders. Importing this module does not import torch.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_unstarted = 0


def handed() -> None:
    """A call was handed to the loop (before ``call_soon_threadsafe``)."""
    global _unstarted
    with _lock:
        _unstarted += 1


def started() -> None:
    """A call handed to the loop started there (or failed to)."""
    global _unstarted
    with _lock:
        _unstarted -= 1


def quiet() -> bool:
    """True when every call of torch's handed to the loop has started."""
    return _unstarted == 0
