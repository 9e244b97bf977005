"""Triton kernels of topth-ops (installed as ``topth_ops.cuda_kernels``): kernels only.

Importing a module of this package imports Triton; with ``TRITON_INTERPRET=1`` set
*before* that import the kernels run in Triton's CPU interpreter on CPU tensors. The host
side (heuristics, the launcher, occupancy) is :mod:`topth_ops.backends.triton`; the static
compile report is :mod:`topth_ops.bench.compile_report`. See docs/triton.md.

Modules, by stage: :mod:`.tiles` (lengths, split ranges, block-table addressing, tile
loads, the two products), :mod:`.selection` (thresholds, kept masks), :mod:`.attn_pre`
(pre_softmax and dense, one pass), :mod:`.attn_post` (post_softmax, candidate list and
selection), :mod:`.combine` (split merge, SDC, VMC, statistics).
"""
