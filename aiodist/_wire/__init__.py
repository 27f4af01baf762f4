"""Layer ``_wire``: the wire protocol, sans-IO. Bytes in, messages out; no sockets here.

Owns the frame prefix and ``FrameDecoder`` (``frame``), the message kinds and
one frozen dataclass per message (``messages``) with their typed headers
(``headers``), the object codec (``codec``: msgpack, else pickle) and the
token handshake's proofs (``auth``).

May import: ``aiodist._errors``. Never asyncio, socket or torch at import time.
"""
