"""Benchmarks: aiodist against torch.distributed, measured in the same run."""
