"""Telling a TLS client from a clear aiodist peer by its first byte, and wording TLS failures.

Sans-IO: a listener that serves one of the two peeks at the first byte of an
accepted connection and asks ``first_byte_kind``. A TLS connection opens with a
handshake record (content type 22, ``0x16``, then the version's ``0x03``); an
aiodist peer opens with a frame, whose magic starts with ``A`` (``frame.MAGIC``).
The other side's refusal is worded here too, so that the server, the ranks and
the CLI say the same thing.
"""

from __future__ import annotations

from typing import Final, Literal

from aiodist._wire.frame import MAGIC

#: A TLS record of the handshake type: what every ClientHello starts with.
TLS_HANDSHAKE_BYTE: Final = 0x16
#: The environment variables that configure TLS, in the order cert, key, CA.
VARIABLES: Final = ("AIODIST_TLS_CERT", "AIODIST_TLS_KEY", "AIODIST_TLS_CA")
#: The command-line flags that configure TLS, in the same order.
FLAGS: Final = ("--tls-cert", "--tls-key", "--tls-ca")

# What OpenSSL says when the bytes it read are not a TLS record (the peer spoke clear).
_NOT_TLS: Final = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"}
)
# What it says when a record failed its integrity check (changed in flight).
_TAMPERED: Final = frozenset({"DECRYPTION_FAILED_OR_BAD_RECORD_MAC", "BAD_RECORD_MAC"})


def first_byte_kind(first: int) -> Literal["tls", "aiodist", "other"]:
    """What a connection whose first byte is ``first`` speaks."""
    if first == TLS_HANDSHAKE_BYTE:
        return "tls"
    if first == MAGIC[0]:
        return "aiodist"
    return "other"


def speaks_tls_message(what: str) -> str:
    """What a TLS listener tells a clear client (``what``: "rendezvous server", ...)."""
    return (
        f"this {what} requires TLS and this client spoke clear TCP; set AIODIST_TLS_CERT, "
        "AIODIST_TLS_KEY and AIODIST_TLS_CA here (or pass --tls-cert/--tls-key/--tls-ca), "
        "with a certificate signed by the job's CA"
    )


def speaks_clear_message(what: str) -> str:
    """What a clear listener tells a client that began TLS."""
    return (
        f"this {what} speaks clear TCP and this client began TLS; start the {what} with "
        "--tls-cert/--tls-key/--tls-ca (AIODIST_TLS_* for an embedded one), or unset "
        "AIODIST_TLS_* on the client"
    )


def explain_ssl_failure(peer: str, reason: str | None, detail: str, *, verify: bool) -> str:
    """A TLS failure with ``peer`` (e.g. "the rendezvous server at 10.0.0.1:29500"), worded.

    Args:
        peer: Who the other side is, as the message should name it.
        reason: OpenSSL's reason code (``ssl.SSLError.reason``), if any.
        detail: The error's own text.
        verify: The failure is this side's check of the peer's certificate.
    """
    if verify:
        return (
            f"{peer} presented a certificate that AIODIST_TLS_CA (--tls-ca) does not trust "
            f"({detail}); give every process certificates signed by the job's one CA"
        )
    code = (reason or "").upper()
    if code in _NOT_TLS:
        return (
            f"{peer} answered in clear, not TLS: it was started without TLS. Start it with "
            "--tls-cert/--tls-key/--tls-ca (AIODIST_TLS_* for an embedded server or a rank), "
            "or unset AIODIST_TLS_* here"
        )
    if any(mark in code for mark in _TAMPERED):  # here, or the peer's alert saying so
        return (
            f"a TLS record between this process and {peer} failed its integrity check "
            f"({detail}): the connection was altered in flight, so it was closed"
        )
    if "ALERT" in code:
        return (
            f"{peer} refused this process's TLS certificate ({detail}): AIODIST_TLS_CERT "
            "(--tls-cert) must be signed by the CA that it trusts"
        )
    return f"TLS with {peer} failed ({detail})"
