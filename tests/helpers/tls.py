"""Certificates for the TLS tests, made with ``trustme``: a job's CA, and a stranger's.

``make_tls(dir)`` writes the files a process needs (its certificate, its key,
the CA) and returns them as the three ``AIODIST_TLS_*`` variables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trustme

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["TLS_VARIABLES", "make_tls", "tls_env"]

TLS_VARIABLES = ("AIODIST_TLS_CERT", "AIODIST_TLS_KEY", "AIODIST_TLS_CA")


def make_tls(directory: Path, name: str = "job", ca: trustme.CA | None = None) -> dict[str, str]:
    """A certificate signed by ``ca`` (a new CA if None), written under ``directory``.

    Returns the ``AIODIST_TLS_*`` variables naming the files.
    """
    ca = ca or trustme.CA()
    directory.mkdir(parents=True, exist_ok=True)
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_file = (directory / f"{name}-{part}.pem" for part in ("cert", "key", "ca"))
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    return dict(zip(TLS_VARIABLES, (str(cert), str(key), str(ca_file)), strict=True))


def tls_env(files: dict[str, str]) -> dict[str, str]:
    """``files`` as a copy, for a subprocess's environment."""
    return dict(files)
