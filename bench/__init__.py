"""Kernel benchmark harness (installed as ``topth_ops.bench``); the one-off model studies
live in :mod:`topth_ops.bench.studies`."""
