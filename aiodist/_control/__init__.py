"""Layer ``_control``: a rank's connection to the rendezvous server.

Owns the control connection (``connection``), a member's channel on it
(``channel``), the table that lets a process's members share one connection
(``shared``), the job's key-value store as a client sees it (``store``), and
turning an ``init_method`` into a connection, starting an embedded server when
none listens (``rendezvous``), agreeing on that server through torchrun's
store under torchrun (``torchrun``: torch is imported there only, lazily),
and finding an address of this host that other hosts reach (``addresses``).

May import: ``_errors``, ``_wire``, ``_transport``, ``_server`` (to embed one).
"""
