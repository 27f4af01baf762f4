"""Layer ``_launch``: starting and ending a job.

Owns, in a rank: ``init_process_group``, ``init_dist`` and
``destroy_process_group`` (``init``), and launchers' environments (torchrun,
Slurm, MPI: ``launchers``, ``slurm_hostlist``). Around ranks: ``aiodist run``
(``run``; where its server is: ``placement``; its ranks' output: ``output``),
the daemon's entry (``daemon``) and the ``aiodist`` command (``cli``, the only
module that prints). ``cli``, ``daemon``, ``run``, ``placement`` and
``output`` never import torch.

May import: ``_torch``, ``_rpc`` and the layers beneath them (``_ops`` down to
``_errors``); not ``_metrics``.
"""
