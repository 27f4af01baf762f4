"""Internals of ``aiodist.metrics``: local accumulation, the fused buffer, results."""
