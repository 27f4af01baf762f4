"""torch.distributed.rpc programs, run on torch and on aiodist.rpc (test_rpc_programs)."""
