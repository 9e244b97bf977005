"""The Triton kernels (Triton's interpreter here, the GPU where there is one) on -inf scores
(docs/semantics.md, "Edge cases"): a head whose every score is -inf returns 0 (mu with VMC)
and leaves the other heads of its group exact; -inf rows are never kept. Against the float64
oracle, one and three KV splits, BNSD and a paged NHD cache."""

import pytest
import torch

from topth_ops.backends.triton.launch import LaunchConfig
from topth_ops.conformance.oracle import oracle_decode

from ..neg_inf_case import neg_inf_calls, overflow_calls


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_neg_inf(launch, check, splits):
    for _what, kw in [*neg_inf_calls(torch.float32, (None, "NHD")), *overflow_calls(torch.float32)]:
        check(launch(kw, LaunchConfig(block_n=32, num_splits=splits)), oracle_decode(**kw), torch.float32)
