"""The timing both ends of the control plane agree on: stalls, and the re-attach window.

A rank and its rendezvous server each judge the other from the same numbers:
a gap of more than ``STALL_GAP`` s between two inputs means a loop stood still
(the server's sweep runs every second, a rank heartbeats as often), and for
``STALL_WINDOW`` s after it a lost connection is most likely reconnecting; a
member away from a server that came back is waited for ``reattach_window``
(its peers wait as long for the server's verdict on it).
"""

from __future__ import annotations

from typing import Final

MIN_REATTACH_WINDOW: Final = 5.0
# Two inputs this far apart mean the loop stood still (the sweep runs every second).
STALL_GAP: Final = 3.0
STALL_WINDOW: Final = 1.0


def reattach_window(heartbeat_timeout: float) -> float:
    """How long a member away is waited for, by the server that came back and by its peers,
    before it is declared failed."""
    return max(MIN_REATTACH_WINDOW, 2 * heartbeat_timeout)
