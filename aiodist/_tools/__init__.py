"""Developer tools: they write or check parts of the package; nothing imports them.

``gen_sync`` writes ``aiodist/sync.py`` from the async API (``imports`` finds
its annotations' names); ``layers`` checks the import graph against the
layers (``make lint`` runs both).

May import: anything.
"""
