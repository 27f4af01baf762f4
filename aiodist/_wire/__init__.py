"""Sans-IO wire protocol: framing, messages and the object codec. No sockets here."""
