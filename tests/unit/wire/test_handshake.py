"""Sans-IO tests of the token handshake: one object, both roles, both planes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiodist._wire import auth
from aiodist._wire.handshake import (
    CONTROL,
    Refused,
    Role,
    TokenHandshake,
    peer_binding,
)

TOKEN = "s3cret"


def _pair(
    binding: object, challenger_token: str = TOKEN, responder_token: str = TOKEN
) -> tuple[TokenHandshake, TokenHandshake]:
    assert binding is CONTROL or not isinstance(binding, str)
    return (
        TokenHandshake(Role.CHALLENGER, challenger_token, binding),  # type: ignore[arg-type]
        TokenHandshake(Role.RESPONDER, responder_token, binding),  # type: ignore[arg-type]
    )


def test_control_handshake_proofs_are_the_control_planes_own() -> None:
    # The server challenges, the client answers: the proofs are auth's client/server ones.
    server, client = _pair(CONTROL)
    server_nonce = server.challenge()
    client_nonce, client_proof = client.answer(server_nonce)
    assert client_proof == auth.client_proof(TOKEN, server_nonce, client_nonce)
    server_proof = server.check_answer(client_nonce, client_proof)
    assert server_proof == auth.server_proof(TOKEN, client_nonce, server_nonce)
    client.check_proof(server_proof)
    assert server.done
    assert client.done


def test_peer_handshake_proofs_bind_the_job_and_both_ranks() -> None:
    connector, acceptor = _pair(peer_binding("job", 3, 5))
    nonce_c = connector.challenge()
    nonce_a, accept = acceptor.answer(nonce_c)
    assert accept == auth.accept_proof(TOKEN, "job", 3, 5, nonce_c, nonce_a)
    connect = connector.check_answer(nonce_a, accept)
    assert connect == auth.connect_proof(TOKEN, "job", 3, 5, nonce_a, nonce_c)
    acceptor.check_proof(connect)
    assert connector.done
    assert acceptor.done


@pytest.mark.parametrize(
    ("challenger", "responder"),
    [
        (peer_binding("job", 0, 1), peer_binding("job", 0, 2)),  # another acceptor
        (peer_binding("job", 0, 1), peer_binding("job", 1, 0)),  # the other direction
        (peer_binding("job", 0, 1), peer_binding("other", 0, 1)),  # another job
        (CONTROL, peer_binding("job", 0, 1)),  # another plane
    ],
)
def test_a_proof_for_another_binding_is_refused(challenger: object, responder: object) -> None:
    x = TokenHandshake(Role.CHALLENGER, TOKEN, challenger)  # type: ignore[arg-type]
    y = TokenHandshake(Role.RESPONDER, TOKEN, responder)  # type: ignore[arg-type]
    nonce, proof = y.answer(x.challenge())
    with pytest.raises(Refused) as info:
        x.check_answer(nonce, proof)
    assert info.value.reason == "mismatch"
    assert x.state == "refused"


def test_another_token_is_refused_on_both_sides() -> None:
    x, y = _pair(CONTROL, responder_token="other")
    nonce, proof = y.answer(x.challenge())
    with pytest.raises(Refused, match="mismatch"):
        x.check_answer(nonce, proof)
    # And the responder refuses a proof of its nonce made with another token.
    x, y = _pair(CONTROL)
    server_nonce = x.challenge()
    nonce, _ = y.answer(server_nonce)
    with pytest.raises(Refused, match="mismatch"):
        y.check_proof(auth.server_proof("other", nonce, server_nonce))
    assert y.state == "refused"


def test_an_empty_nonce_says_the_other_side_holds_no_token() -> None:
    x, y = _pair(CONTROL)
    x.challenge()
    with pytest.raises(Refused) as info:
        x.check_answer(b"", b"")
    assert info.value.reason == "no token"
    with pytest.raises(Refused) as info:
        y.answer(b"")
    assert info.value.reason == "no token"


def test_a_replayed_answer_does_not_prove_a_new_challenge() -> None:
    x, y = _pair(CONTROL)
    nonce, proof = y.answer(x.challenge())
    x.check_answer(nonce, proof)
    again = TokenHandshake(Role.CHALLENGER, TOKEN, CONTROL)
    again.challenge()  # a fresh nonce: the recorded answer proves another one
    with pytest.raises(Refused, match="mismatch"):
        again.check_answer(nonce, proof)


@given(nonce=st.one_of(st.none(), st.integers(), st.text(), st.binary()), proof=st.binary())
def test_whatever_comes_is_a_refusal_or_a_proof(nonce: object, proof: bytes) -> None:
    x = TokenHandshake(Role.CHALLENGER, TOKEN, CONTROL)
    x.challenge()
    with pytest.raises(Refused):
        x.check_answer(nonce, proof)
    y = TokenHandshake(Role.RESPONDER, TOKEN, CONTROL)
    if type(nonce) is bytes and len(nonce) == auth.NONCE_BYTES:
        y.answer(nonce)
        with pytest.raises(Refused):
            y.check_proof(proof)
    else:
        with pytest.raises(Refused):
            y.answer(nonce)
