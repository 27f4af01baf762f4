"""The token handshake, sans-IO: one object with a role, used by every end of every plane.

Both planes prove a shared token the same way (``auth.py`` has the proofs):
three messages, each side answering a nonce the *other* side just drew::

    challenger                       responder
    nonce_c                     ->                    challenge()
                                <-   nonce_r, proof_r answer(nonce_c)
    proof_c                     ->                    check_answer(nonce_r, proof_r)
                                                      check_proof(proof_c)

    proof_r = HMAC(token, responder label | binding | nonce_c | nonce_r)
    proof_c = HMAC(token, challenger label | binding | nonce_r | nonce_c)

The four ends, by role:

    end                                      role        its messages
    rendezvous server (_server/connection)   challenger  Challenge, Authenticated
    control client (_control/connection)     responder   Hello (after AuthStart)
    rank that connects (_plane/channel)      challenger  PeerHello, PeerAuth
    rank that accepts (_plane/channel)       responder   PeerAuth

A ``Binding`` names the labels and what else the proofs cover: nothing on
the control plane; the job and both ranks on the data plane (``peer_binding``),
so that a proof for one job, pair or direction cannot be replayed for another.

``TokenHandshake`` holds one end's nonces and state and knows nothing of the
messages that carry them: its caller puts what it returns on the wire, and
feeds it what arrives. It raises ``Refused`` (with a ``reason``) instead of
deciding what the refusal means; an empty nonce is how a side without a token
answers (``reason == "no token"``), so a token never silently downgrades.
Proofs are compared in constant time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, Literal

from aiodist._wire.auth import NONCE_BYTES, mac, new_nonce, verify


class Role(enum.Enum):
    """Which side of the exchange an end is: who draws the first nonce."""

    CHALLENGER = "challenger"
    RESPONDER = "responder"


class Refused(Exception):
    """The other side could not prove the token.

    ``reason``: ``"no token"`` (it answered with an empty nonce: it holds none),
    ``"mismatch"`` (its proof is wrong: another token), or ``"malformed"`` (its
    nonce is not one).
    """

    def __init__(self, reason: Literal["no token", "mismatch", "malformed"]) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Binding:
    """What a handshake's proofs are bound to: one label per role, then ``parts``."""

    challenger_label: bytes
    responder_label: bytes
    parts: tuple[bytes, ...] = ()


#: The control plane: client and server, nothing else bound (the server draws first).
CONTROL: Final = Binding(b"aiodist-control-server", b"aiodist-control-client")


def peer_binding(job: str, connector: int, acceptor: int) -> Binding:
    """The data plane: the job, the rank that connects and the rank that accepts."""
    return Binding(
        b"aiodist-peer-connect",
        b"aiodist-peer-accept",
        (job.encode(), str(connector).encode(), str(acceptor).encode()),
    )


def _is_nonce(value: object) -> bool:
    return type(value) is bytes and len(value) == NONCE_BYTES


class TokenHandshake:
    """One end of the token handshake (see the module docstring for the exchange).

    States: ``start`` -> ``challenged`` (the challenger drew its nonce) or
    ``answered`` (the responder sent its proof) -> ``done``; any refusal ->
    ``refused``. Calling a step out of turn is a bug (``AssertionError``).

    Example:
        >>> server = TokenHandshake(Role.CHALLENGER, token, CONTROL)
        >>> client = TokenHandshake(Role.RESPONDER, token, CONTROL)
        >>> nonce, proof = client.answer(server.challenge())
        >>> client.check_proof(server.check_answer(nonce, proof))
    """

    __slots__ = ("_binding", "_mine", "_theirs", "_token", "role", "state")

    def __init__(self, role: Role, token: str, binding: Binding) -> None:
        self.role = role
        self.state = "start"
        self._token = token
        self._binding = binding
        self._mine = b""
        self._theirs = b""

    @property
    def done(self) -> bool:
        """True once the other side proved the token (and, responder, was sent our proof)."""
        return self.state == "done"

    def challenge(self) -> bytes:
        """Challenger: draw the nonce that opens the exchange; send it."""
        assert self.role is Role.CHALLENGER
        assert self.state == "start"
        self._mine = new_nonce()
        self.state = "challenged"
        return self._mine

    def answer(self, nonce: object) -> tuple[bytes, bytes]:
        """Responder: answer the challenger's ``nonce``; send the nonce and proof returned.

        Raises:
            Refused: ``nonce`` is empty (the challenger holds no token) or not a nonce.
        """
        assert self.role is Role.RESPONDER
        assert self.state == "start"
        if not _is_nonce(nonce):
            self.state = "refused"
            raise Refused("no token" if nonce == b"" else "malformed")
        assert isinstance(nonce, bytes)
        self._theirs, self._mine = nonce, new_nonce()
        self.state = "answered"
        b = self._binding
        return self._mine, mac(self._token, b.responder_label, *b.parts, nonce, self._mine)

    def check_answer(self, nonce: object, proof: object) -> bytes:
        """Challenger: check the responder's answer; send the proof returned.

        Raises:
            Refused: The responder holds no token (an empty nonce) or another one.
        """
        assert self.role is Role.CHALLENGER
        assert self.state == "challenged"
        b = self._binding
        if not _is_nonce(nonce):
            self.state = "refused"
            raise Refused("no token" if nonce == b"" else "mismatch")
        assert isinstance(nonce, bytes)
        if not verify(mac(self._token, b.responder_label, *b.parts, self._mine, nonce), proof):
            self.state = "refused"
            raise Refused("mismatch")
        self._theirs = nonce
        self.state = "done"
        return mac(self._token, b.challenger_label, *b.parts, nonce, self._mine)

    def check_proof(self, proof: object) -> None:
        """Responder: check the challenger's proof; the handshake is done if it holds.

        Raises:
            Refused: The challenger's proof does not match the token.
        """
        assert self.role is Role.RESPONDER
        assert self.state == "answered"
        b = self._binding
        expected = mac(self._token, b.challenger_label, *b.parts, self._mine, self._theirs)
        if not verify(expected, proof):
            self.state = "refused"
            raise Refused("mismatch")
        self.state = "done"
