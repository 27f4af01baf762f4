"""Layer ``_server``: the rendezvous server.

Owns the sans-IO job table (``state``: membership, ranks, deadlines, liveness;
``store``: the key-value store and barriers; ``jobs``: its records), its asyncio
shell (``serve``), one client connection (``connection``) and its Prometheus
metrics (``metrics``). It speaks msgpack only, never unpickles, never imports
torch.

May import: ``_errors``, ``_wire``.
"""
