"""Triton kernels of topth-ops (installed as ``topth_ops.cuda_kernels``).

Importing this package imports Triton; with ``TRITON_INTERPRET=1`` set *before* that
import the kernels run in Triton's CPU interpreter on CPU tensors. See docs/triton.md.
"""

from .decode_attn import (
    LaunchConfig,
    choose_config,
    choose_num_splits,
    decode_attn_fwd,
    interpreter_enabled,
)

__all__ = ["LaunchConfig", "choose_config", "choose_num_splits", "decode_attn_fwd", "interpreter_enabled"]
