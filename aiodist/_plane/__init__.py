"""Layer ``_plane``: the data plane, rank to rank.

Owns a sans-IO core and its asyncio glue, as h11's ``Connection`` and its
users: each peer's state and the receives waiting on the plane (``core``:
events in, actions out), one channel's handshake and frames (``channel``),
a receive and what settles it (``receives``), MPI-style matching of posted
receives against arriving messages (``matching``) and large point-to-point
payloads that wait for their receive (``bulk``), all sans-IO; which
transports a rank listens on and which one reaches each peer (``routes``);
the asyncio glue that listens, connects, writes and closes (``peers``) and
the Unix-socket listener a process's members share (``listener``). Matching
lives here, not in ``_group``, because each channel matches every frame as
it arrives.

May import: ``_errors``, ``_wire``, ``_transport``, ``_server``, ``_control``.
"""
