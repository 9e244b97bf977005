"""Triton kernels of topth-ops (installed as ``topth_ops.cuda_kernels``).

Importing this package imports Triton; with ``TRITON_INTERPRET=1`` set *before* that
import the kernels run in Triton's CPU interpreter on CPU tensors. See docs/triton.md.

Modules, by stage: :mod:`.tiles` (lengths, split ranges, block-table addressing, tile
loads, the two products), :mod:`.selection` (thresholds, kept masks), :mod:`.attn_pre`
(pre_softmax and dense, one pass), :mod:`.attn_post` (post_softmax, candidate list and
selection), :mod:`.combine` (split merge, SDC, VMC, statistics), :mod:`.launch`
(heuristics, launcher), :mod:`.occupancy` (occupancy and wave arithmetic),
:mod:`.report` (static performance report of the sm_90 compilation).
"""

from .launch import (
    LaunchConfig,
    choose_config,
    choose_num_splits,
    decode_attn_fwd,
    gpu_tiles,
    group_pad,
    interpreter_enabled,
)

__all__ = ["LaunchConfig", "choose_config", "choose_num_splits", "decode_attn_fwd", "gpu_tiles", "group_pad",
           "interpreter_enabled"]
