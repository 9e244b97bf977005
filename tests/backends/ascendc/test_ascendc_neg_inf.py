"""The Ascend C kernel on the CPU model on -inf scores (docs/semantics.md, "Edge cases"): a
head whose every score is -inf returns 0 (mu with VMC) and leaves the other heads of its group
exact; -inf rows are never kept. Against the float64 oracle, both paths (cube and all-vector),
whole rows and split-KV (min_split_len forces splits), BNSD and a paged NHD cache."""

import pytest
import torch

from topth_ops import make_inputs
from topth_ops.backends.ascendc import A2_TARGET, run_cpu_model
from topth_ops.backends.ascendc_host import kept_union_masks
from topth_ops.conformance.oracle import oracle_decode

from ..far_case import check_against_oracle as _check
from ..neg_inf_case import neg_inf_calls, overflow_calls

SPLITS = (dict(cores=4), dict(min_split_len=40), dict(min_split_len=32), dict(min_split_len=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_neg_inf(dtype):
    paths = ["vector"] if dtype == torch.float32 else ["cube", "vector"]
    calls = list(neg_inf_calls(dtype, (None, "NHD")))
    if dtype == torch.float32:  # float16 products cannot overflow float32
        calls += list(overflow_calls(dtype))
    for what, kw in calls:
        want = oracle_decode(**kw)
        for split in SPLITS:
            for path in paths:
                inputs = make_inputs(**kw, return_stats=True)
                out, stats = inputs.empty_outputs(fill=float("nan"))
                rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, path=path, **split))
                assert rep["tiling"]["path"] == path
                _check(out, stats, want, dtype, (what, split, path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kept_union_masks(dtype):
    """The host's kept-union selection (the declared V-row counts of benchmarks) equals the
    oracle's union per (sequence, KV head) on the same -inf cases."""
    for what, kw in neg_inf_calls(dtype):
        want = oracle_decode(**kw)
        masks = kept_union_masks(make_inputs(**kw))
        got = [[int(m.sum()) for m in row] for row in masks]
        assert got == want.v_rows.tolist(), what
