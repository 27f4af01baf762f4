"""Challenge-response proofs of a shared token: HMAC-SHA256 over fresh nonces.

Neither plane ever sends the token. Each side proves it knows the token by
answering a nonce the *other* side just drew, so a recorded handshake is
useless later: its proof answers a nonce that will never be drawn again.

Control plane (client C, server S; the server requires a token)::

    S -> C  Challenge(nonce_s)                 sent as soon as C connects
    C -> S  AuthStart()                        C asks, in case S would not send one
    C -> S  Hello(nonce_c, client_proof)       HMAC(token, "client" | nonce_s | nonce_c)
    S -> C  Authenticated(server_proof)        HMAC(token, "server" | nonce_c | nonce_s)

C pipelines its requests right after ``Hello``; S reads nothing else first,
and C accepts no reply before a valid ``Authenticated``. The handshake is
mutual: a C that holds a token always sends ``AuthStart``, and a server that
requires none answers ``Challenge(b"")``, which C takes as "no proof will
come" and refuses at once (a token never downgrades to an open server). A C
without a token sends nothing of this: to it, a non-empty ``Challenge`` says
that a token is required.

Data plane (connector C of rank c, acceptor A of rank a, job J)::

    C -> A  PeerHello [J, c, pid, member, nonce_c]
    A -> C  PeerAuth  [nonce_a, HMAC(token, "accept" | J | c | a | nonce_c | nonce_a)]
    C -> A  PeerAuth  [b"", HMAC(token, "connect" | J | c | a | nonce_a | nonce_c)]

Both proofs name the job and both ranks, so a proof for one job, pair or
direction cannot be replayed for another. An A without a token answers a
nonce with ``PeerAuth [b"", b""]``: C refuses it. An A with a token refuses
a ``PeerHello`` without a nonce, or a wrong proof, and then connects to the
rank that hello claimed to be: the genuine rank proves the token (the hello
came from a stranger) or is refused in turn. Proofs are compared with
``hmac.compare_digest`` (constant time).

Both exchanges are one three-message handshake with the roles swapped (the
server and the connecting rank draw the first nonce): ``handshake.py`` runs
it, for all four ends; the functions below name each end's proof.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final

NONCE_BYTES: Final = 32


def new_nonce() -> bytes:
    """A fresh random nonce, drawn from the OS's CSPRNG."""
    return secrets.token_bytes(NONCE_BYTES)


def mac(token: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``token``, each part length-prefixed."""
    digest = hmac.new(token.encode(), digestmod=hashlib.sha256)
    for part in parts:
        # Length-prefixed: no two different part lists feed the same bytes to the MAC.
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return digest.digest()


def client_proof(token: str, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The control client's answer to the server's challenge."""
    return mac(token, b"aiodist-control-client", server_nonce, client_nonce)


def server_proof(token: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The server's answer to the client's nonce."""
    return mac(token, b"aiodist-control-server", client_nonce, server_nonce)


def _pair(job: str, connector: int, acceptor: int) -> tuple[bytes, bytes, bytes]:
    return job.encode(), str(connector).encode(), str(acceptor).encode()


def accept_proof(
    token: str, job: str, connector: int, acceptor: int, connect_nonce: bytes, accept_nonce: bytes
) -> bytes:
    """The accepting rank's proof, over the connector's nonce."""
    return mac(
        token, b"aiodist-peer-accept", *_pair(job, connector, acceptor), connect_nonce, accept_nonce
    )


def connect_proof(
    token: str, job: str, connector: int, acceptor: int, accept_nonce: bytes, connect_nonce: bytes
) -> bytes:
    """The connecting rank's proof, over the acceptor's nonce."""
    return mac(
        token,
        b"aiodist-peer-connect",
        *_pair(job, connector, acceptor),
        accept_nonce,
        connect_nonce,
    )


def verify(expected: bytes, received: object) -> bool:
    """Compare a received proof with the expected one in constant time."""
    return isinstance(received, bytes) and hmac.compare_digest(expected, received)
