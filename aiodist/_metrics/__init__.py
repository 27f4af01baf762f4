"""Layer ``_metrics``: the internals of ``aiodist.metrics``.

Owns local accumulation and the fused buffer's layout (``state``), the fused
reduction on the data plane (``fused``), the same-host shared-memory board
(``board``, ``slots``, ``record``) and what a sync resolves to (``results``).

May import: ``_ops`` and the layers beneath it (``_group`` down to ``_errors``);
not its siblings ``_torch`` and ``_rpc``, nor ``_launch``.
"""
