"""Kernel benchmark harness (installed as ``topth_ops.bench``)."""
