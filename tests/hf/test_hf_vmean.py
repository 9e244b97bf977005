"""Running V sums of the transformers integration (topth_ops/hf/vmean.py) and the row ids
read from the mask (topth_ops/hf/cache_view.py): the per-step fast paths against float64
references computed from the cache itself."""

import pytest
import torch

from topth_ops.hf.cache_view import rows_from_mask
from topth_ops.hf.vmean import ValueSums


def _mean64(v: torch.Tensor, lens) -> torch.Tensor:
    return torch.stack([v[b, :, :k].double().mean(1) if k else torch.zeros(v.shape[1], v.shape[3], dtype=torch.float64)
                        for b, k in enumerate(lens)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_follow_uneven_growth_against_the_cache_mean(dtype):
    """Sequences that grow by one row, by none, or jump (rebuild) all give the mean of their
    valid rows; a returned mean is a new tensor that later steps do not change."""
    g = torch.Generator().manual_seed(1)
    v = torch.randn(3, 2, 12, 8, generator=g).to(dtype)
    sums = ValueSums()
    steps = [[4, 4, 4], [5, 5, 5], [6, 5, 6], [6, 6, 7], [7, 7, 8], [1, 2, 3], [2, 3, 4]]
    returned = []
    for lens in steps:
        mu = sums.mean(0, v, torch.tensor(lens))
        assert mu.dtype == torch.float32 and mu.shape == (3, 2, 8)
        torch.testing.assert_close(mu.double(), _mean64(v, lens), rtol=1e-5, atol=1e-5)
        returned.append((mu, mu.clone()))
    for mu, copy in returned:
        assert torch.equal(mu, copy)
    assert sums.rebuilds == 2  # the first step and the shrink to [1, 2, 3]
    assert sums.layers[0][1] == (2, 3, 4)


def test_sums_do_not_add_a_row_that_did_not_arrive():
    """A sequence that did not grow keeps its sum even when the row past its end holds inf."""
    v = torch.zeros(2, 1, 6, 4)
    v[:, :, :3] = 1.0
    v[0, :, 3] = float("inf")
    sums = ValueSums()
    sums.mean(0, v, torch.tensor([3, 3]))
    mu = sums.mean(0, v, torch.tensor([3, 4]))
    assert torch.isfinite(mu).all()
    torch.testing.assert_close(mu.double(), _mean64(v, [3, 4]))


def test_index_edits_carry_the_counts():
    g = torch.Generator().manual_seed(2)
    v = torch.randn(3, 2, 10, 4, generator=g)
    sums = ValueSums()
    sums.mean(0, v, torch.tensor([3, 5, 7]))
    sums.edited("reorder_cache", torch.tensor([2, 2, 0]))
    assert sums.layers[0][1] == (7, 7, 3)
    v2 = v[torch.tensor([2, 2, 0])]
    mu = sums.mean(0, v2, torch.tensor([8, 7, 4]))
    torch.testing.assert_close(mu.double(), _mean64(v2, [8, 7, 4]), rtol=1e-6, atol=1e-6)
    sums.edited("batch_repeat_interleave", 2)
    assert sums.layers[0][1] == (8, 8, 7, 7, 4, 4)
    assert sums.rebuilds == 1


@pytest.mark.parametrize("additive", [False, True])
def test_all_valid_mask_gives_every_key(additive):
    """A decode mask with every key valid (dynamic cache) gives row id S and no key mask,
    for boolean and additive float masks, for B and T from the call."""
    mask = torch.ones(1, 1, 2, 9, dtype=torch.bool)
    if additive:
        mask = torch.zeros(1, 1, 2, 9, dtype=torch.float16)
    n, valid = rows_from_mask(mask, 3, 2, 9, "cpu")
    assert valid is None and n.dtype == torch.int64 and n.tolist() == [[9, 9]] * 3
    # one masked key anywhere leaves the fast path
    if additive:
        mask[..., 4] = torch.finfo(torch.float16).min
    else:
        mask[..., 4] = False
    n, valid = rows_from_mask(mask, 3, 2, 9, "cpu")
    assert n.tolist() == [[8, 8]] * 3 and valid is not None and not bool(valid[..., 4].any())


def test_rebuild_ignores_nan_and_inf_rows_past_each_sequence_end():
    """The rebuild of the sums (first step, after a crop) reads rows 0..n-1 only: NaN / inf
    that a longer sequence of the batch, or earlier use of the cache, left past n change nothing."""
    from topth_ops.vmean import valid_value_mean

    g = torch.Generator().manual_seed(3)
    v = torch.randn(3, 2, 9, 4, generator=g)
    v[0, :, 5:] = float("nan")
    v[1, 1, 7] = float("inf")
    lens = [5, 7, 9]
    v[2, 0, 8] = 1.0
    mu = valid_value_mean(v, torch.tensor(lens))
    torch.testing.assert_close(mu.double(), _mean64(v, lens), rtol=1e-6, atol=1e-6)
    sums = ValueSums()
    torch.testing.assert_close(sums.mean(0, v, torch.tensor(lens)).double(), _mean64(v, lens), rtol=1e-6, atol=1e-6)
