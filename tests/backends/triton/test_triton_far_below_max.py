"""The Triton kernels (Triton's interpreter here, the GPU where there is one) on a head whose
kept rows all lie far below its own maximum (group selection, pre_softmax; docs/semantics.md,
"A head's kept rows far below its own maximum"), against the float64 oracle: every SDC
variant, with and without VMC, one and several KV splits, with and without the tile skip."""

import pytest
import torch

from topth_ops.backends.triton.launch import LaunchConfig
from topth_ops.conformance.oracle import oracle_decode

from ..far_case import SDC, SPLIT_SDC, far_case, far_kwargs, split_case


@pytest.mark.parametrize("gap", [30.0, 95.0, 140.0])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("skip", [False, True])
def test_far_below_max(launch, check, gap, splits, skip):
    dtype = torch.float32
    for sdc, extra in SDC:
        for vmc in (False, True):
            kw = far_kwargs(*far_case(gap, dtype), sdc, extra, vmc, paged=False)
            check(launch(kw, LaunchConfig(block_n=32, num_splits=splits, tile_skip=skip)), oracle_decode(**kw), dtype)


@pytest.mark.parametrize("splits", [1, 2])
def test_split_dropped_sum(launch, check, splits):
    """far_case.split_case: a split whose kept rows lie 200 below its own maximum."""
    for sdc, extra in SPLIT_SDC:
        for vmc in (False, True):
            kw = far_kwargs(*split_case(torch.float32), sdc, extra, vmc, paged=False)
            check(launch(kw, LaunchConfig(block_n=32, num_splits=splits)), oracle_decode(**kw), torch.float32)
