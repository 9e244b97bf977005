"""Model studies (installed as ``topth_ops.bench.studies``): one-off measurements behind
the findings recorded in docs/model.md, docs/ascendc.md and docs/results/, e.g. k~/k of
calibrated thresholds on rows longer than the calibration samples, on other texts or in
other reference frames, and the kept sets of a backend on inputs planted with a wide
margin. Each is a script run as ``python -m topth_ops.bench.studies.<name> ...`` that loads
a model (or drives one backend), prints what it measured and keeps no state (except
``length_extrapolation_dense``, the dense-histogram half of ``length_extrapolation``); none is part
of the library's API or of the kernel benchmark. The kernel benchmark
(:mod:`topth_ops.bench`, ``topth-ops bench``) is different: it crosses every registered
backend and dense baseline with a fixed set of cases, checks each result against the torch
reference before timing it, and reports times, bytes and speedups against targets.
"""
