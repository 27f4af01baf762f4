"""Layer ``_ops``: the operations on a group, on aiodist's data plane.

Owns what the collectives share (``common``: group resolution, signatures, the
hand-off to a group's torch bridge), the sans-IO algorithm plans
(``schedules``), reduce ops (``reduce_ops``), the tensor collectives
(``reductions``, ``rooted``, ``movement``, ``shared`` for shared memory,
``tensor_groups``, ``outputs``), the object collectives (``objects``),
point-to-point (``p2p``) and ``new_group`` (``groups``). Remote calls are a
sibling layer, ``_rpc``.

May import: ``_group`` and the layers beneath it (``_plane`` down to ``_errors``);
not its sibling ``_rpc``. It reaches the torch bridge only through
``ProcessGroup.bridge``, never by import.
"""
