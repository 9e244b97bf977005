"""The Ascend C kernel on the CPU model: cache layouts read in place (strided BNSD views,
paged NHD / HND caches through the block table), group selection and threshold sets.

Every run checks, inside the model, that each K / V row the kernel reads is a row the
block table names for the work item's sequence (below its length, its KV head); the byte
counts are compared with an independent float64 computation of the kept sets.
"""

import numpy as np
import pytest
import torch

import topth_ops
from topth_ops import make_inputs
from topth_ops.backends.ascendc import A2_TARGET, kernel_tensors, run_cpu_model, split_plan
from topth_ops.paged import to_paged
from topth_ops.registry import get_backend


def _strided_caches(k, v, layout):
    """Views of k and v ([B, Hkv, S, D]) with other strides, the storage around them NaN:
    reading anything but the viewed rows poisons the result."""
    B, H, S, D = k.shape
    if layout == "slice_of_longer_cache":  # [B, H, Smax, D] cache, first S positions
        bk, bv = (torch.full((B, H, S + 37, D), float("nan"), dtype=k.dtype) for _ in range(2))
        bk[:, :, :S], bv[:, :, :S] = k, v
        return bk[:, :, :S], bv[:, :, :S]
    if layout == "bsnd":  # [B, S, H, D] cache viewed as BNSD: row stride H x D
        bk, bv = (torch.full((B, S, H, D), float("nan"), dtype=k.dtype) for _ in range(2))
        bk.copy_(k.transpose(1, 2)), bv.copy_(v.transpose(1, 2))
        return bk.transpose(1, 2), bv.transpose(1, 2)
    if layout == "padded_rows":  # rows of D inside rows of D + 5 (gap not a whole 32-byte block)
        bk, bv = (torch.full((B, H, S, D + 5), float("nan"), dtype=k.dtype) for _ in range(2))
        bk[..., :D], bv[..., :D] = k, v
        return bk[..., :D], bv[..., :D]
    if layout == "kv_interleaved":  # one [B, S, 2, H, D] tensor: K and V share a storage
        kv = torch.full((B, S, 2, H, D), float("nan"), dtype=k.dtype)
        kv[:, :, 0], kv[:, :, 1] = k.transpose(1, 2), v.transpose(1, 2)
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["slice_of_longer_cache", "bsnd", "padded_rows", "kv_interleaved"])
@pytest.mark.parametrize("dtype,D,placement,lens,cores", [
    (torch.float16, 64, "pre_softmax", [300, 77], 48),      # split-KV, DataCopy rows when dense
    (torch.bfloat16, 72, "post_softmax", [300, 0], 48),     # 144-byte rows, split-KV, post
    (torch.float32, 36, "pre_softmax", [5, 290], 2),        # 144-byte rows, unsplit
])
def test_strided_caches_are_read_in_place(layout, dtype, D, placement, lens, cores, caplog, small_int_case,
                                          check_against_oracle, expected_bytes, expected_fetch):
    """Non-contiguous caches whose rows are contiguous are read where they are (no
    .contiguous() copy, no warning): same results against the oracle and the same K / V
    bytes as the contiguous layout."""
    rng = np.random.default_rng(D)
    base = small_int_case(2, 6, 2, 300, D, lens, dtype, placement, rng, keep=0.3)
    k, v = _strided_caches(base.key_cache, base.value_cache, layout)
    assert not k.is_contiguous() and not v.is_contiguous()
    inputs = make_inputs(base.query, k, v, base.seq_lens, base.thresholds, scale=1.0, placement=placement,
                         return_stats=True)
    t = kernel_tensors(inputs)
    assert t["key_cache"] is inputs.key_cache and t["value_cache"] is inputs.value_cache
    out, stats = inputs.empty_outputs(fill=float("nan"))
    with caplog.at_level("WARNING"):
        rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, cores=cores, min_split_len=64))
    assert "copied" not in caplog.text
    check_against_oracle(inputs, out, stats)
    k_bytes, _v_bytes, _ = expected_bytes(inputs)
    fetched, _spans = expected_fetch(inputs, rep["tiling"])
    assert (rep["k_bytes"], rep["v_bytes"]) == (k_bytes, fetched * D * inputs.query.element_size())
    tl = rep["tiling"]
    assert (tl["kStrideBlk"], tl["kStrideH"], tl["kStrideSlot"]) == k.stride()[:3]
    assert (tl["vStrideBlk"], tl["vStrideH"], tl["vStrideSlot"]) == v.stride()[:3]
    if cores == 48:
        assert max(split_plan(tl, [int(n) for n in lens])[1]) > 1


def test_a_layout_the_kernel_cannot_read_is_refused_never_copied(small_int_case):
    """head_dim not the innermost dimension: the kernel reads caches in place only, so the
    call is refused with the reason (contract v0.2: never copied silently on a hot path)."""
    rng = np.random.default_rng(2)
    base = small_int_case(1, 4, 2, 100, 64, [90], torch.float16, "pre_softmax", rng)
    k = base.key_cache.transpose(2, 3).contiguous().transpose(2, 3)  # [B, H, S, D] view of [B, H, D, S]
    inputs = make_inputs(base.query, k, base.value_cache, base.seq_lens, base.thresholds, scale=1.0,
                         placement="pre_softmax", return_stats=True)
    reasons = get_backend("ascendc-cpu").input_reasons(inputs)
    assert len(reasons) == 1 and "key_cache" in reasons[0] and "never copies" in reasons[0]
    with pytest.raises(NotImplementedError, match="head_dim is not the innermost"):
        topth_ops.decode_attention(base.query, k, base.value_cache, base.seq_lens, base.thresholds,
                                   placement="pre_softmax", backend="ascendc-cpu")


def test_tiling_refuses_overlapping_rows(shape_dict, ascendc_cpu):
    shape = dict(shape_dict(1, 4, 1, 64, 64, 0, 0), k_strides=[64 * 63, 64 * 63, 63])
    with pytest.raises(ValueError, match=r"key_cache: slot \(position\) stride 63 is smaller than head_dim 64"):
        ascendc_cpu.compute_tiling(shape, A2_TARGET)


# ----------------------------------------------------------------------------- paged caches

def _paged(inputs, block_size, layout, seed=0, spare=3):
    """The same call with paged caches (shuffled blocks, NaN in unused blocks and slots,
    -1 in unused table slots)."""
    need = sum(-(-int(n) // block_size) for n in inputs.seq_lens.tolist())
    k, v, table = to_paged(inputs.key_cache, inputs.value_cache, inputs.seq_lens, block_size, kv_layout=layout,
                           num_blocks=need + spare, generator=torch.Generator().manual_seed(seed), fill=float("nan"))
    table[table < 0] = -1
    return make_inputs(inputs.query, k, v, inputs.seq_lens, inputs.thresholds, scale=inputs.scale,
                       placement=inputs.placement, sdc=inputs.sdc, vmc=inputs.vmc, return_stats=True,
                       block_table=table, kv_layout=layout)


@pytest.mark.parametrize("block_size,layout,dtype,placement,D,cores", [
    (16, "NHD", torch.float16, "pre_softmax", 64, 48),
    (32, "HND", torch.bfloat16, "post_softmax", 72, 48),   # 144-byte rows: DataCopyPad
    (64, "NHD", torch.float32, "post_softmax", 64, 4),
    (128, "HND", torch.float16, "pre_softmax", 128, 48),
    (24, "NHD", torch.float16, "pre_softmax", 64, 48),     # a block size that divides no tile
    (1, "HND", torch.float32, "pre_softmax", 32, 2),
])
def test_paged_caches_read_only_owned_rows_with_exact_bytes(block_size, layout, dtype, placement, D, cores,
                                                            small_int_case, expected_bytes, expected_fetch,
                                                            check_against_oracle, kept_sets):
    """Paged NHD / HND through the block table: the model checked every K / V row read
    (a block the table names for the sequence, a slot below its length); the K and V bytes
    equal the contiguous call's and the independent float64 expectation."""
    rng = np.random.default_rng(block_size + D)
    base = small_int_case(3, 8, 2, 300, D, [300, 131, 0], dtype, placement, rng, keep=0.3)
    k_bytes, v_bytes, unions = expected_bytes(base)
    paged = _paged(base, block_size, layout, seed=block_size)
    target = dict(A2_TARGET, cores=cores, min_split_len=64)
    out, stats = paged.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(paged, out, stats, target=target)
    fetched, _spans = expected_fetch(paged, rep["tiling"], kept=kept_sets(base))
    assert (rep["k_bytes"], rep["v_bytes"]) == (k_bytes, fetched * D * base.query.element_size())
    assert v_bytes <= rep["v_bytes"]
    np.testing.assert_array_equal(stats.v_rows.numpy(), unions)
    check_against_oracle(paged, out, stats)
    out_c, stats_c = base.empty_outputs(fill=float("nan"))
    run_cpu_model(base, out_c, stats_c, target=target)
    torch.testing.assert_close(out, out_c, rtol=1e-5, atol=1e-6 if dtype == torch.float32 else 1e-3)
    assert torch.equal(stats.kept, stats_c.kept) and torch.equal(stats.v_rows, stats_c.v_rows)
    assert rep["tiling"]["paged"] == 1 and rep["tiling"]["blockSize"] == block_size


def test_the_row_check_flags_a_read_past_the_length(small_int_case, ascendc_cpu):
    """The model's row ownership is real: told that each sequence is one position shorter
    than the lengths the kernel reads, it stops the launch at the first read of that row."""
    rng = np.random.default_rng(4)
    base = small_int_case(2, 4, 2, 64, 64, [40, 17], torch.float16, "pre_softmax", rng, keep=1.0)
    paged = _paged(base, 16, "NHD")
    out, stats = paged.empty_outputs()
    with pytest.raises(ascendc_cpu.ModelError, match="not one of its valid rows|block_table"):
        run_cpu_model(paged, out, stats, launch={"owned_length_delta": -1})
    run_cpu_model(paged, out, stats)  # the same call with the true lengths passes


def test_group_selection_and_threshold_sets_match_the_oracle(small_int_case, check_against_oracle):
    """selection='group' with 3-D thresholds and per-sequence sets (BNSD and paged HND), with
    exp_threshold SDC (theta of the group per head): every head of a group keeps the group's
    rows; stats and outputs against the float64 oracle."""
    rng = np.random.default_rng(12)
    base = small_int_case(3, 8, 2, 200, 64, [200, 77, 5], torch.float32, "pre_softmax", rng, keep=0.3)
    # [2 sets, 2 KV heads, 200], half-integers: exact against the integer scores' group maxima
    th = torch.stack([base.thresholds[::4], base.thresholds[1::4] + 1.0])
    sets = torch.tensor([1, 0, 1], dtype=torch.int64)
    for paged in (False, True):
        kw = dict(scale=1.0, placement="pre_softmax", sdc="exp_threshold", vmc=True, return_stats=True,
                  selection="group", threshold_set=sets)
        if paged:
            p = _paged(base, 32, "HND")
            inputs = make_inputs(p.query, p.key_cache, p.value_cache, p.seq_lens, th, block_table=p.block_table,
                                 kv_layout="HND", **kw)
        else:
            inputs = make_inputs(base.query, base.key_cache, base.value_cache, base.seq_lens, th, **kw)
        out, stats = inputs.empty_outputs(fill=float("nan"))
        rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, min_split_len=32))
        check_against_oracle(inputs, out, stats)
        assert (stats.kept.view(3, 2, 4) == stats.v_rows.view(3, 2, 1)).all()  # one kept set per group
        assert rep["tiling"]["selection"] == 1 and rep["tiling"]["numSets"] == 2
