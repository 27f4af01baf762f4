"""Layer ``_server``: the rendezvous server.

Owns the sans-IO job table (``state``: membership, ranks, deadlines, liveness;
``store``: the key-value store and barriers; ``jobs``: its records), its asyncio
shell (``serve``), the connections it keeps and the job table's I/O (``hub``),
one client connection (``connection``, which sees its server only as
``ServerSide``) and its Prometheus metrics (``metrics``). It speaks msgpack
only, never unpickles, never imports torch.

May import: ``_errors``, ``_wire``.
"""
