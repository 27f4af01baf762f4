"""Collective operations on tensors and on Python objects, over the data plane."""
