"""Layer ``_wire``: the wire protocol, sans-IO. Bytes in, messages out; no sockets here.

Owns the frame prefix and ``FrameDecoder`` (``frame``), one declaration per
message: its kind, fields and their bounds (``messages``), the registry,
headers and checks derived from a declaration (``headers``), the ranges a
field may hold (``bounds``), the
data plane's match keys and their kinds (``keys``), the object codec
(``codec``: msgpack, else pickle), the token handshake's proofs (``auth``) and
what a connection may cost before its handshake (``preauth``).

May import: ``aiodist._errors``. Never asyncio, socket or torch at import time.
"""
