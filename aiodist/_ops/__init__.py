"""Layer ``_ops``: the operations on a group, on aiodist's data plane.

One call path. A public function reads its arguments, torch's or mmengine's
form, into a ``Call`` (``forms`` for tensors, ``object_forms`` for
objects, over ``requests``' canonical ``Request``);
``run`` does what every call
shares (group, slot, checks, outsider's answer, torch bridge, device staging,
``Work``) and starts the algorithm. The algorithms: ``reductions``,
``rooted``, ``movement`` (tensors), ``shared`` (through shared memory),
``objects`` and ``collect`` (objects, mmengine's helpers), ``tensor_groups``
(many tensors at once), ``groups`` (``new_group``). Their messages go through
one ``exchange``, whose first messages carry the one ``agreement`` (through
shared memory on a group of one host: ``board``); plans are ``schedules``'
(sans-IO), tensor helpers ``tensors``', reduce ops ``reduce_ops``', device
staging ``staging``'. Point-to-point (``p2p``, ``p2p_objects``) takes no place
in a group's order: ``run_p2p`` is its share of the call path (group, peer and
tag checks, the outsider's answer, the flight recorder).
Remote calls are a sibling layer, ``_rpc``.

May import: ``_group`` and the layers beneath it (``_plane`` down to ``_errors``);
not its sibling ``_rpc``. It reaches the torch bridge only through
``ProcessGroup.bridge``, never by import.
"""
