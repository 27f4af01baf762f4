"""Layer ``_plane``: the data plane, rank to rank.

Owns a session's peers and their lazy channels (``peers``), a channel's
receiving end (``link``), sans-IO MPI-style matching of posted receives
against arriving messages (``matching``), large point-to-point payloads that
wait for their receive (``bulk``) and the Unix-socket listener a process's
members share (``listener``). Matching lives here, not in ``_group``, because
the links match every frame as it arrives.

May import: ``_errors``, ``_wire``, ``_transport``, ``_server``, ``_control``.
"""
