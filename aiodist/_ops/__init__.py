"""Layer ``_ops``: the operations on a group, on aiodist's data plane.

Owns what the collectives share (``common``: group resolution, signatures, the
hand-off to a group's torch bridge), the sans-IO algorithm plans
(``schedules``), reduce ops (``reduce_ops``), the tensor collectives
(``reductions``, ``rooted``, ``movement``, ``shared`` for shared memory,
``tensor_groups``, ``outputs``), the object collectives (``objects``),
point-to-point (``p2p``), ``new_group`` (``groups``) and remote calls (``rpc``
and its ``rpc_*`` parts; ``aiodist.rpc`` is their public face).

May import: every layer below: ``_errors`` up to ``_group``. It reaches the torch
bridge only through ``ProcessGroup.bridge``, never by import.
"""
