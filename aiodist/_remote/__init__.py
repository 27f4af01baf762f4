"""Layer ``_remote``: master-worker mode, rank 0 driving tensors the other ranks hold.

Owns what the master tells a worker (``orders``), the worker that carries it
out (``worker``), the master's side, its remote tensors, streams and events
(``master``), and joining a job in this mode (``start``).

May import: ``_launch`` and the layers beneath it (it joins the job as
``init_process_group`` does, and talks over ``_ops``' object messages); not
``_sync`` or the public face.
"""
