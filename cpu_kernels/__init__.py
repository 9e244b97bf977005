"""The CPU decode-attention kernel of topth-ops (installed as ``topth_ops.cpu_kernels``).

``_topth_cpu`` is the compiled module (C++ through pybind11, built by the package install,
see setup.py and docs/cpu.md); the backend ``cpu`` (topth_ops/backends/cpu.py) loads it
lazily, so ``import topth_ops`` works without it.
"""
