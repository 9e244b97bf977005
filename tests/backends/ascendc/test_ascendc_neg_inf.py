"""The Ascend C kernel on the CPU model on -inf scores (docs/semantics.md, "Edge cases"): a
head whose every score is -inf returns 0 (mu with VMC) and leaves the other heads of its group
exact; -inf rows are never kept. Against the float64 oracle, both paths (cube and all-vector),
whole rows and split-KV (min_split_len forces splits), BNSD and a paged NHD cache."""

import pytest
import torch

from topth_ops import make_inputs
from topth_ops.backends.ascendc import A2_TARGET, run_cpu_model
from topth_ops.conformance.oracle import oracle_decode

from ..far_case import check_against_oracle as _check
from ..neg_inf_case import neg_inf_calls

SPLITS = (dict(cores=4), dict(min_split_len=40), dict(min_split_len=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_neg_inf(dtype):
    paths = ["vector"] if dtype == torch.float32 else ["cube", "vector"]
    for what, kw in neg_inf_calls(dtype, (None, "NHD")):
        want = oracle_decode(**kw)
        for split in SPLITS:
            for path in paths:
                inputs = make_inputs(**kw, return_stats=True)
                out, stats = inputs.empty_outputs(fill=float("nan"))
                rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, path=path, **split))
                assert rep["tiling"]["path"] == path
                _check(out, stats, want, dtype, (what, split, path))
