"""Layer ``_wire``: the wire protocol, sans-IO. Bytes in, messages out; no sockets here.

Owns the frame prefix and ``FrameDecoder`` (``frame``), the message kinds and
one frozen dataclass per message (``messages``) with their typed headers
(``headers``) and the range of every value a client sends (``bounds``), the
data plane's match keys and their kinds (``keys``), the object codec
(``codec``: msgpack, else pickle), the token handshake's proofs (``auth``) and
what a connection may cost before its handshake (``preauth``).

May import: ``aiodist._errors``. Never asyncio, socket or torch at import time.
"""
