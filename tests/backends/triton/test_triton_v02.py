"""Contract v0.2 in the Triton kernels: paged KV (NHD / HND, block sizes that divide the
tile and ones that do not), group selection, threshold sets, every head_dim that is a
multiple of 16 up to 256, the post_softmax candidate list (its compaction and overflow
paths), one query head per KV head and large groups.

Expected values: the float64 oracle (topth_ops.conformance.oracle), and for paged inputs
also bitwise equality with the contiguous path of the same kernels (the contract: on the
same data, results and stats equal the contiguous path). Runs in Triton's CPU
interpreter without a GPU (float32 / float16).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from topth_ops.conformance.cases import Shape, paged_case, random_case
from topth_ops.conformance.oracle import oracle_decode

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def cfg(ns, block_n=32, **kw):
    from topth_ops.backends.triton.launch import LaunchConfig

    return LaunchConfig(block_n=block_n, num_splits=ns, **kw)


def same(a, b):
    """Bitwise equality of two results (out and every stat)."""
    assert torch.equal(a[0].nan_to_num(7.0), b[0].nan_to_num(7.0))
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("layout,block_size", [("NHD", 16), ("HND", 32), ("NHD", 64), ("HND", 128),
                                               ("NHD", 1), ("HND", 24), ("NHD", 48)])
def test_paged_equals_contiguous(layout, block_size, launch, check):
    """Paged caches (shuffled blocks, partial last blocks, NaN in unused blocks and slots,
    garbage in unused table slots) give exactly the contiguous result; block sizes that do
    not divide the tile (1, 24, 48 with 32-position tiles) are addressed per row."""
    shape = Shape((97, 0, 33, 64), 8, 2, 64, 100)
    placement = "post_softmax" if block_size in (32, 1, 48) else "pre_softmax"
    case = random_case("paged", shape, torch.float32, placement=placement,
                       sdc="exact" if placement == "pre_softmax" else "none", vmc=True, seed=block_size)
    config = cfg(2, post_capacity=64)  # the default capacity depends on max_seq_len, which paging changes
    base = launch(case.kwargs, config)
    check(base, case.oracle(), torch.float32)
    pcase = paged_case(case, block_size, layout, seed=block_size + 1)
    paged = launch(pcase.kwargs, config)
    same(paged, base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("placement,sdc,vmc,vmean", [("pre_softmax", "none", False, False),
                                                     ("pre_softmax", "exp_threshold", True, False),
                                                     ("pre_softmax", "offline", True, True),
                                                     ("post_softmax", "none", True, False)])
def test_group_selection_and_sets(placement, sdc, vmc, vmean, dtype, check, launch):
    """selection="group" (one theta per KV head against the group maximum) with three
    threshold sets picked per sequence (sdc_table per query head and set), paged HND."""
    shape = Shape((70, 9, 0, 100), 9, 3, 64, 100)
    case = random_case("group", shape, dtype, placement=placement, sdc=sdc, vmc=vmc, value_mean=vmean,
                       selection="group", num_sets=3, seed=11)
    ref = case.oracle()
    kept = ref.kept.reshape(4, 3, 3)
    assert (kept == kept[:, :, :1]).all() and 0 < ref.kept.sum() < 3 * 9 * 179  # one set per group
    check(launch(case.kwargs, cfg(3)), ref, dtype)
    check(launch(paged_case(case, 16, "HND", seed=12).kwargs, cfg(1)), ref, dtype)


@pytest.mark.parametrize("selection", ["head", "group"])
def test_threshold_sets_head_selection_and_vmc_mean(selection, check, launch):
    """3-D thresholds with per-sequence sets, computed V mean, NHD pages of 16."""
    shape = Shape((40, 64, 17), 4, 2, 64, 64)
    case = random_case("sets", shape, torch.float32, placement="post_softmax", vmc=True, selection=selection,
                       num_sets=2, seed=13)
    check(launch(paged_case(case, 16, "NHD", seed=14).kwargs, cfg(2)), case.oracle(), torch.float32)


@pytest.mark.parametrize("D", [16, 48, 112, 176, 240])
def test_head_dims_multiple_of_16(D, check, launch):
    """head_dim 16 ... 256 in steps of 16: padded to a power of two with masked columns."""
    shape = Shape((40, 11), 4, 2, D, 40)
    case = random_case("hd", shape, torch.float16, placement="pre_softmax", sdc="exact", vmc=True, seed=D)
    check(launch(case.kwargs, cfg(2)), case.oracle(), torch.float16)


@pytest.mark.parametrize("selection", ["head", "group"])
def test_post_candidate_overflow(selection, launch, check):
    """post_softmax: a capacity smaller than the candidates of a split makes that split
    recompute its scores from K; results equal the uncapped run (and the oracle)."""
    shape = Shape((128, 70), 8, 2, 64, 128)
    case = random_case("cap", shape, torch.float32, placement="post_softmax", vmc=True, selection=selection,
                       keep_range=(0.3, 0.6), seed=17)
    ref = case.oracle()
    big = launch(case.kwargs, cfg(2, post_capacity=64))
    small = launch(case.kwargs, cfg(2, post_capacity=32))  # 30-60% kept: >= 32 of 64 candidates
    check(big, ref, torch.float32)
    check(small, ref, torch.float32)
    np.testing.assert_allclose(small[0].cpu().numpy(), big[0].cpu().numpy(), atol=1e-6)
    # theta <= 0 keeps every finite score: every position is a candidate
    kw = dict(case.kwargs, thresholds=torch.zeros_like(case.kwargs["thresholds"]))
    check(launch(kw, cfg(2, post_capacity=32)), oracle_decode(**kw), torch.float32)


@pytest.mark.parametrize("selection", ["head", "group"])
def test_post_candidate_compaction(selection, check, launch):
    """One long split, a capacity of 32 candidates (compaction every 16 positions): the
    early positions of the split are candidates until the running LSE rules them out, and
    compaction must drop exactly those (a kept one lost would change the result)."""
    shape = Shape((300, 150), 8, 2, 64, 300)
    case = random_case("compact", shape, torch.float32, placement="post_softmax", selection=selection,
                       keep_range=(0.05, 0.15), seed=24)
    ref = case.oracle()
    assert 0 < ref.kept.sum()
    check(launch(case.kwargs, cfg(1, block_n=16, post_capacity=32)), ref, torch.float32)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (64, 1)])
def test_mha_and_large_group(hq, hkv, check, launch):
    """G = 1 (a 16-row head tile with 15 padded rows) and G = 64 (a 64-row tile, 8 warps)."""
    shape = Shape((50, 7), hq, hkv, 64, 50)
    for placement in ("pre_softmax", "post_softmax"):
        case = random_case("g", shape, torch.float16, placement=placement, vmc=True, seed=hq)
        check(launch(case.kwargs, cfg(2)), case.oracle(), torch.float16)


def test_tile_skip_and_stages_same_result(launch, check):
    """The tile-skip variant (V load in a branch) equals the skewed pipeline bitwise."""
    shape = Shape((100, 37), 8, 2, 64, 100)
    case = random_case("skip", shape, torch.float32, placement="pre_softmax", sdc="exp_threshold",
                       keep_range=(0.02, 0.1), seed=19)
    a = launch(case.kwargs, cfg(3, block_n=16))
    b = launch(case.kwargs, cfg(3, block_n=16, tile_skip=True))
    check(a, case.oracle(), torch.float32)
    same(a, b)


def test_backend_features_and_reasons(dev):
    """The backend declares paged / group / threshold sets, accepts every multiple of 16
    up to 256 and refuses other head dims with a reason."""
    import topth_ops
    from topth_ops.contract import make_inputs

    b = topth_ops.get_backend("triton")
    assert b.features == {"paged", "group_selection", "threshold_sets"}

    def reasons(D):
        q = torch.zeros(1, 2, D, device=dev)
        k = torch.zeros(3, 16, 1, D, device=dev)
        inp = make_inputs(q, k, k, torch.tensor([20], device=dev), torch.zeros(1, 1, 4, device=dev),
                          block_table=torch.tensor([[2, 0]], dtype=torch.int32, device=dev),
                          selection="group", threshold_set=torch.tensor([0], device=dev))
        return b.not_supported_reasons(inp)

    assert reasons(240) == [] and reasons(16) == []
    assert any("head_dim 72" in r for r in reasons(72))
    assert any("head_dim 272" in r for r in reasons(272))
