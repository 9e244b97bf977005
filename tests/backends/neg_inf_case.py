"""Inputs for the backends' tests of -inf scores (docs/semantics.md, "Edge cases": a score of
-inf has weight 0 and is never kept; a head whose every score is -inf returns 0, or mu with
VMC, and changes nothing for the other heads of its group): the conformance rule's cases
(neg_inf_scores), in BNSD or paged caches."""

import torch

from topth_ops.conformance.rules import NEG_INF_VARIANTS, neg_inf_case, overflow_case
from topth_ops.paged import to_paged


def neg_inf_calls(dtype: torch.dtype, layouts=(None,)):
    """Yields (what, decode_attention keyword arguments) for every (placement, sdc) variant,
    both selections, and each layout of ``layouts`` (None: BNSD; "NHD" / "HND": paged, block
    size 32, blocks in random order)."""
    for i, (placement, sdc) in enumerate(NEG_INF_VARIANTS):
        for selection in ("head", "group"):
            case = neg_inf_case(dtype, placement, sdc, selection, vmc=i % 2 == 0, seed=100 + i)
            for layout in layouts:
                kw = dict(case.kwargs)
                if layout is not None:
                    kc, vc, table = to_paged(kw["key_cache"], kw["value_cache"], kw["seq_lens"], 32, kv_layout=layout,
                                             generator=torch.Generator().manual_seed(i))
                    kw.update(key_cache=kc, value_cache=vc, block_table=table, kv_layout=layout)
                yield (placement, sdc, selection, layout), kw


def overflow_calls(dtype: torch.dtype):
    """Yields (what, keyword arguments) of the rule's float32-overflow case (a kept row that
    scores -inf in one head of the group), with and without VMC and with exact SDC."""
    for sdc, vmc in (("none", False), ("none", True), ("exact", False), ("exp_threshold", True)):
        yield ("overflow", sdc, vmc), overflow_case(dtype, sdc, vmc).kwargs
