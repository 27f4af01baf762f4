"""Layer ``_rpc``: remote calls and remote references (``aiodist.rpc``'s internals).

One ``Agent`` per session (``agent``) makes calls (``calls``) and serves them
(``serve``, on threads of ``threads``), keeps the objects RRefs name
(``rref``), and runs ``rpc.shutdown`` (``shutdown``); ``wire`` has the
messages. Remote calls ride the session's data plane directly, on match keys
of their own (``MatchKind.RPC``): they are no collective of any group and
share nothing with ``_ops``.

May import: ``_group`` and the layers below it (``_plane``, ``_control``,
``_transport``, ``_wire``, ``_errors``). A sibling of ``_ops``, not above it:
neither imports the other.
"""
