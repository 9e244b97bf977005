"""The CPU decode-attention kernel of topth-ops (installed as ``topth_ops.cpu_kernels``).

``_topth_cpu`` is the compiled module (C++ through pybind11, built by the package install,
see setup.py and docs/cpu.md); the backend ``cpu`` (topth_ops/backends/cpu.py) loads it
lazily, so ``import topth_ops`` works without it.
"""

import functools


def extension():
    """The compiled module ``_topth_cpu``.

    Raises
    ------
    ImportError
        The package install did not build it (no C++ compiler, or an import of the
        source tree without an install).
    """
    from . import _topth_cpu

    return _topth_cpu


@functools.lru_cache(maxsize=None)
def extension_with(name: str):
    """The compiled module when it is built and has the function ``name`` (a build from
    older sources may lack it), else None: the caller runs its torch path."""
    try:
        mod = extension()
    except ImportError:
        return None
    return mod if hasattr(mod, name) else None
