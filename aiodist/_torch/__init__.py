"""Layer ``_torch``: the bridge to torch.distributed (gloo, NCCL).

Owns bringing torch's groups up and down through the job's own store
(``bridge``, ``store``) and each tensor collective as torch.distributed
issues it (``ops``), from one ordered thread per group (``bridge``).
Importing the bridge does not import torch.

May import: ``_ops`` and the layers beneath it (``_group`` down to ``_errors``);
not its siblings ``_rpc`` and ``_metrics``.
"""
