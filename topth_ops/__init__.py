"""topth-ops: Top-Theta thresholded sparse decode attention (arXiv 2502.08363).

Public API: :func:`decode_attention`, :class:`DecodeStats`, and the backend registry
(:func:`list_backends`, :func:`get_backend`, :func:`register_backend`, :class:`Backend`).
Importing this package needs no GPU, Triton or CANN: backends load their runtimes lazily.
"""

from .api import decode_attention
from .contract import DecodeInputs, DecodeStats, make_inputs
from .registry import (
    Backend,
    get_backend,
    list_backends,
    register_backend,
    select_backend,
    unregister_backend,
)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "DecodeInputs",
    "DecodeStats",
    "decode_attention",
    "get_backend",
    "list_backends",
    "make_inputs",
    "register_backend",
    "select_backend",
    "unregister_backend",
    "__version__",
]
