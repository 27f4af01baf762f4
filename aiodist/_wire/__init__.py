"""Layer ``_wire``: the wire protocol, sans-IO. Bytes in, messages out; no sockets here.

Owns the frame prefix and ``FrameDecoder`` (``frame``), the message kinds and
one frozen dataclass per message (``messages``) with their typed headers
(``headers``), the data plane's match keys and their kinds (``keys``), the
object codec (``codec``: msgpack, else pickle), the token handshake's proofs
(``auth``) and what a connection may cost before it proved itself (``preauth``).

May import: ``aiodist._errors``. Never asyncio, socket or torch at import time.
"""
