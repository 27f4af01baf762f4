"""Layer ``_sync``: what the blocking facade ``aiodist.sync`` runs on.

Owns the background event-loop thread and its doors from plain code
(``portal``) and the few hand-written blocking twins (``blocking``, such as
the blocking store). ``aiodist/sync.py`` itself is generated.

May import: ``_launch``, ``_metrics`` and every layer beneath them.
"""
