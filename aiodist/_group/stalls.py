"""Who a timed-out collective waited for: the server's view, for the ``DistTimeoutError``.

When a collective passes its group's timeout, the group asks the rendezvous
server (briefly) where every rank of the job is, from the positions their
heartbeats carry (``_server/where.py``), and names in the error the ranks
that had not entered the call and what they did last. Without an answer in
time the error says so and names nobody.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import anyio

from aiodist._control.status import describe_wait, positions_line
from aiodist._errors import DistError
from aiodist._wire.messages import StatusRequest

if TYPE_CHECKING:
    from aiodist._control.channel import ControlChannel

#: How long a timed-out collective waits for the server's view before failing.
ASK_TIMEOUT: Final = 1.0


async def where_others_are(conn: ControlChannel, job: str, group: str, seq: int) -> str:
    """A sentence on who call ``seq`` of ``group`` (of ``job``) waits for ('' if unknown).

    Asked of the rendezvous server over ``conn``, this rank's connection to it.
    """
    if conn.closed or not seq:
        return ""
    snap: Any = None
    with anyio.move_on_after(ASK_TIMEOUT):
        try:
            snap = await conn.request(lambda r: StatusRequest(r, job), timeout=ASK_TIMEOUT)
        except DistError:
            return ""
    if not isinstance(snap, dict):
        return ""
    state = next((j for j in snap.get("jobs", []) if j.get("name") == job), None)
    if state is None:
        return ""
    for call in state.get("waits", []):
        if call["group"] == group and call["seq"] == seq:
            return describe_wait(call)
    return positions_line(state)
