"""Layer ``_group``: sessions and process groups.

Owns the ``Work`` handle (``work``), operations in flight and their deadlines
(``inflight``), process groups (``group``, with the ``Bridge`` protocol through
which torch's side of a group is reached from below), a rank's membership in a
job (``session``), joining one (``join``) and the default group with the
queries every script makes (``world``).

May import: ``_errors``, ``_wire``, ``_transport``, ``_server``, ``_control``, ``_plane``.
"""
