"""Sans-IO: telling TLS from an aiodist frame by the first byte, and wording TLS failures."""

from __future__ import annotations

import pytest

from aiodist._wire.frame import encode_message
from aiodist._wire.messages import Heartbeat
from aiodist._wire.tls import explain_ssl_failure, first_byte_kind

# The start of a real TLS 1.2/1.3 ClientHello record: handshake (22), version 3.1.
CLIENT_HELLO_START = bytes([0x16, 0x03, 0x01, 0x02, 0x00])


def test_first_byte_tells_tls_from_an_aiodist_frame() -> None:
    frame = b"".join(encode_message(Heartbeat()))
    assert first_byte_kind(CLIENT_HELLO_START[0]) == "tls"
    assert first_byte_kind(frame[0]) == "aiodist"
    assert first_byte_kind(ord("G")) == "other"  # an HTTP GET


@pytest.mark.parametrize(
    ("reason", "verify", "expected"),
    [
        ("WRONG_VERSION_NUMBER", False, "answered in clear, not TLS"),
        ("RECORD_LAYER_FAILURE", False, "answered in clear, not TLS"),
        ("DECRYPTION_FAILED_OR_BAD_RECORD_MAC", False, "failed its integrity check"),
        ("SSLV3_ALERT_BAD_RECORD_MAC", False, "failed its integrity check"),
        ("TLSV1_ALERT_UNKNOWN_CA", False, "refused this process's TLS certificate"),
        ("CERTIFICATE_VERIFY_FAILED", True, "AIODIST_TLS_CA (--tls-ca) does not trust"),
        ("SOMETHING_ELSE", False, "TLS with the server at h:1 failed"),
    ],
)
def test_each_tls_failure_is_worded_naming_the_peer(
    reason: str, verify: bool, expected: str
) -> None:
    message = explain_ssl_failure("the server at h:1", reason, "detail", verify=verify)
    assert expected in message
    assert "the server at h:1" in message
