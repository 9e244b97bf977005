"""The suite must fail on wrong backends: each mutant breaks one rule of the contract in a
way a kernel could, and the rule that guards it must report a failure."""

import dataclasses

import pytest
import torch

from topth_ops.backends.torch_ref import TorchBackend, reference_decode
from topth_ops.conformance import rules_paged, run_rule
from topth_ops.value_sum import PagedValueSum


class Mutant(TorchBackend):
    """The reference with an input edit before and an output edit after."""

    def __init__(self, name, edit_inputs=None, edit_outputs=None):
        self.name = name
        self.edit_inputs = edit_inputs
        self.edit_outputs = edit_outputs

    def forward(self, inputs, out, stats):
        orig = inputs
        if self.edit_inputs:
            inputs = self.edit_inputs(inputs)
        res, st = reference_decode(inputs)
        if self.edit_outputs:
            self.edit_outputs(orig, res, st, out, stats)
            return
        out.copy_(res)
        for dst, src in zip(stats, st):
            dst.copy_(src)


def _replace(**changes):
    return lambda inp: dataclasses.replace(inp, **{k: f(inp) for k, f in changes.items()})


def _packed_as_rows(inp):
    """vLLM's AMX cache read as if its blocks held rows (HND)."""
    return "HND" if inp.kv_layout == "VLLM_AMX" else inp.kv_layout


def _v_packed_as_k(inp):
    """V regions unpacked with K's offsets (the two packings confused)."""
    if inp.kv_layout != "VLLM_AMX":
        return inp.value_cache
    from topth_ops import packed

    return packed.pack(packed.unpack(inp.value_cache, "value"), "key")


def _shift_columns(inp):
    th = inp.thresholds
    idx = torch.clamp(torch.arange(th.shape[1]) + 1, max=th.shape[1] - 1)
    return th[:, idx]


def _first_sequence_row(inp):
    n0 = int(inp.seq_lens[0].clamp(min=1, max=inp.max_row_id)) - 1
    return inp.thresholds[:, n0:n0 + 1].expand_as(inp.thresholds).contiguous()


def _whole_cache_mean(inp):
    if not inp.vmc or inp.value_mean is not None:
        return inp.value_mean
    return inp.value_cache.float().mean(dim=2)


def _skip_empty(orig, res, st, out, stats):
    live = orig.seq_lens > 0
    out[live] = res[live]
    for dst, src in zip(stats, st):
        dst[live] = src[live]


def _nan_when_nothing_kept(orig, res, st, out, stats):
    res = torch.where((st.kept == 0)[..., None] & (orig.seq_lens > 0)[:, None, None], float("nan"), res)
    out.copy_(res)
    for dst, src in zip(stats, st):
        dst.copy_(src)


def _v_rows_sum(orig, res, st, out, stats):
    out.copy_(res)
    stats.kept.copy_(st.kept)
    stats.dropped_mass.copy_(st.dropped_mass)
    g = orig.group_size
    stats.v_rows.copy_(st.kept.view(orig.batch, orig.num_kv_heads, g).sum(-1))


def _nan_to_zero(orig, res, st, out, stats):
    out.copy_(torch.nan_to_num(res, nan=0.0))
    for dst, src in zip(stats, st):
        dst.copy_(src)


def _assume_contiguous(inp):
    k = inp.key_cache
    return torch.as_strided(k, k.shape, k.new_empty(k.shape).stride(), k.storage_offset())


def _identity_table(inp):
    if not inp.paged:
        return inp.block_table
    bt = inp.block_table
    return torch.arange(bt.numel(), dtype=torch.int32).view(bt.shape) % inp.num_blocks


def _next_block(inp):
    if not inp.paged:
        return inp.block_table
    return torch.roll(inp.block_table, shifts=-1, dims=1)


def _whole_last_block_mean(inp):
    """VMC mean over every slot of the blocks a sequence uses (slots past n included)."""
    if not inp.vmc or inp.value_mean is not None or not inp.paged:
        return inp.value_mean
    from topth_ops.backends.torch_ref import dense_caches
    n = inp.seq_lens.long()
    bs = inp.block_size
    padded = (n + bs - 1) // bs * bs
    _, v = dense_caches(inp, padded)
    valid = torch.arange(v.shape[2])[None, :] < padded[:, None]
    return (v.float() * valid[:, None, :, None]).sum(2) / padded.clamp(min=1)[:, None, None]


def _wrong_layout_strides(inp):
    """Addresses the paged cache with the other layout's contiguous strides."""
    if not inp.paged:
        return inp.value_cache
    v = inp.value_cache
    return torch.as_strided(v, v.shape, v.transpose(1, 2).contiguous().transpose(1, 2).stride())


def _group_by_mean(inp):
    """Group selection done per head: each query head compares its own scores with the
    group's threshold (no maximum over the group), so heads keep different rows."""
    if inp.selection != "group":
        return inp.thresholds
    return inp.thresholds.repeat_interleave(inp.group_size, dim=-2)


def _set_zero(inp):
    if inp.threshold_set is None:
        return inp.threshold_set
    return torch.zeros_like(inp.threshold_set)


def _contiguous_storage(name):
    def edit(inp):
        t = getattr(inp, name)
        if t is None or t.is_contiguous():
            return t
        return torch.as_strided(t, t.shape, t.new_empty(t.shape).stride(), t.storage_offset())
    return edit


def _clamp_tiny_thresholds(inp):
    """What the Triton kernels did: theta clamped up to 1e-38 before its logarithm."""
    th = inp.thresholds
    return torch.where((th > 0) & (th < 1e-38), torch.tensor(1e-38), th)


def _flush_subnormal_thresholds(inp):
    """A kernel under flush-to-zero: subnormal thresholds read as +-0."""
    th = inp.thresholds
    return torch.where(th.abs() < torch.finfo(torch.float32).tiny, th * 0.0, th)


def _zero_when_kept_far_below_max(orig, res, st, out, stats):
    """What the AVX2 level did before the kept reference: with group selection and pre_softmax,
    a head whose kept rows all lie 87 or more below its own maximum (kept weights exp(a - m)
    all 0 in float32) returned 0."""
    out.copy_(res)
    for dst, src in zip(stats, st):
        dst.copy_(src)
    if orig.selection != "group" or orig.placement != "pre_softmax":
        return
    from topth_ops.backends.torch_ref import dense_caches, per_sequence_rows

    n = orig.clamped_lengths()
    k, _ = dense_caches(orig, n)
    G = orig.group_size
    kh = k.float().repeat_interleave(G, dim=1)  # [B, Hq, S, D]
    a = orig.scale * torch.einsum("bhd,bhsd->bhs", orig.query.float(), kh)
    valid = torch.arange(a.shape[-1])[None, None, :] < n[:, None, None]
    a = torch.where(valid, a, float("-inf"))
    theta = per_sequence_rows(orig, orig.thresholds_3d(), n)  # [B, Hkv]
    group_max = a.view(a.shape[0], orig.num_kv_heads, G, -1).amax(dim=2)
    kept = (group_max > theta[..., None]).repeat_interleave(G, dim=1)  # [B, Hq, S]
    m = a.amax(-1)
    mk = torch.where(kept, a, float("-inf")).amax(-1)
    far = kept.any(-1) & (m - mk > 87.0)
    out[far] = 0


MUTANTS = [
    # (mutant, rule that must catch it)
    (Mutant("ge-instead-of-gt", _replace(thresholds=lambda i: torch.nextafter(
        i.thresholds, torch.tensor(float("-inf"))))), "strict_tie"),
    (Mutant("reads-cache-tail", _replace(value_mean=_whole_cache_mean)), "nan_cache_tail"),
    (Mutant("ignores-sdc", _replace(sdc=lambda i: "none", sdc_table=lambda i: None)), "sdc_exact"),
    (Mutant("ignores-sdc-offline", _replace(sdc=lambda i: "none", sdc_table=lambda i: None)), "sdc_offline"),
    (Mutant("ignores-sdc-gamma", _replace(sdc_gamma=lambda i: 0.05)), "sdc_exp_threshold"),
    (Mutant("row-id-off-by-one", _replace(thresholds=_shift_columns)), "row_id_lookup"),
    (Mutant("row-id-off-by-one-post", _replace(thresholds=_shift_columns)), "post_softmax"),
    (Mutant("skips-empty-rows", edit_outputs=_skip_empty), "poisoned_outputs"),
    (Mutant("skips-empty-rows-2", edit_outputs=_skip_empty), "empty_sequence"),
    (Mutant("nan-when-nothing-kept", edit_outputs=_nan_when_nothing_kept), "nothing_kept"),
    (Mutant("ignores-value-mean", _replace(value_mean=lambda i: None)), "vmc_value_mean"),
    (Mutant("no-vmc", _replace(vmc=lambda i: False, value_mean=lambda i: None)), "vmc_computed_mean"),
    (Mutant("v-rows-summed-not-union", edit_outputs=_v_rows_sum), "pre_softmax"),
    (Mutant("swallows-nan", edit_outputs=_nan_to_zero), "nan_propagation"),
    (Mutant("batch-coupled-row-id", _replace(thresholds=_first_sequence_row)), "batch_independence"),
    (Mutant("assumes-contiguous-cache", _replace(key_cache=_assume_contiguous)), "strided_inputs"),
    (Mutant("post-as-pre", _replace(placement=lambda i: "pre_softmax")), "dense_equivalence"),
    # paged caches, group selection, threshold sets, strides of small tensors, unchecked values
    (Mutant("ignores-block-table", _replace(block_table=_identity_table)), "paged_equivalence"),
    (Mutant("block-index-off-by-one", _replace(block_table=_next_block)), "paged_equivalence"),
    (Mutant("vmc-reads-whole-last-block", _replace(value_mean=_whole_last_block_mean)), "paged_unused_blocks"),
    (Mutant("wrong-layout-strides", _replace(value_cache=_wrong_layout_strides)), "paged_equivalence"),
    (Mutant("group-without-group-max", _replace(thresholds=_group_by_mean,
                                                selection=lambda i: "head")), "group_selection"),
    (Mutant("ignores-threshold-set", _replace(threshold_set=_set_zero)), "threshold_sets"),
    (Mutant("seq-lens-stride-ignored", _replace(seq_lens=_contiguous_storage("seq_lens"))), "strided_small_inputs"),
    (Mutant("thresholds-stride-ignored", _replace(thresholds=_contiguous_storage("thresholds"))),
     "strided_small_inputs"),
    (Mutant("block-table-stride-ignored", _replace(block_table=_contiguous_storage("block_table"))),
     "strided_small_inputs"),
    (Mutant("clamps-tiny-thresholds", _replace(thresholds=_clamp_tiny_thresholds)), "threshold_edges"),
    (Mutant("flushes-subnormal-thresholds", _replace(thresholds=_flush_subnormal_thresholds)), "threshold_edges"),
    (Mutant("lengths-wrap-to-int32", _replace(seq_lens=lambda i: i.seq_lens.to(torch.int32))), "unchecked_values"),
    (Mutant("kept-weights-from-own-max", edit_outputs=_zero_when_kept_far_below_max), "group_far_below_max"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("mutant,rule", MUTANTS, ids=[m.name for m, _ in MUTANTS])
def test_rule_catches_mutant(mutant, rule, dtype):
    result = run_rule(mutant, rule, dtype, device=torch.device("cpu"), shape_set="quick")
    assert result.status == "fail", f"{rule} did not catch {mutant.name}: {result.report()}"
    assert not any("CaseGenerationError" in f for f in result.failures), result.report()


# vLLM's AMX cache holds bfloat16 only: its mutants run in bfloat16
PACKED_MUTANTS = [Mutant("reads-vllm-amx-as-rows", _replace(kv_layout=_packed_as_rows)),
                  Mutant("vllm-amx-v-as-k", _replace(value_cache=_v_packed_as_k))]


@pytest.mark.parametrize("mutant", PACKED_MUTANTS, ids=[m.name for m in PACKED_MUTANTS])
def test_packed_layout_rule_catches_mutant(mutant):
    result = run_rule(mutant, "vllm_amx_layout", torch.bfloat16, device=torch.device("cpu"), shape_set="quick")
    assert result.status == "fail", f"vllm_amx_layout did not catch {mutant.name}: {result.report()}"


# ------------------------------------------------------------------ broken V-sum helpers
# paged_reused_blocks runs the maintained per-block V sum (topth_ops.value_sum.PagedValueSum)
# in the loop; each helper below keeps its sums the way an integration could get wrong.

class _ProductUpdate(PagedValueSum):
    """Removes a slot's old row as old_row x counted: 0 x NaN of never-written or reused
    memory poisons the block's sum."""

    def _old_term(self, rows, counted):
        return rows.float() * counted.float()

    def update(self, value_cache, value, slot_mapping):
        slots = slot_mapping.to(torch.int64)
        ok = slots >= 0
        blk, off = slots[ok] // self.block_size, slots[ok] % self.block_size
        new = value[ok].to(value_cache.dtype).float()
        starts = blk[off == 0]
        self.sum[starts] = 0.0
        self.fill[starts] = 0
        counted = (off < self.fill[blk])[:, None, None]
        rows = value_cache[blk, off] if self.kv_layout == "NHD" else value_cache[blk, :, off]
        self.sum.index_add_(0, blk, new - self._old_term(rows, counted))
        self.fill.scatter_reduce_(0, blk, off + 1, reduce="amax")


class _SubtractRewrite(_ProductUpdate):
    """Subtracts a rewritten slot's old row (masked, not multiplied): an old NaN row that
    was counted stays in the sum."""

    def _old_term(self, rows, counted):
        return torch.where(counted, rows.float(), 0.0)


class _TrustingMean(PagedValueSum):
    """Trusts the sums whatever the block's fill: rows written past n are averaged in."""

    def mean(self, block_table, seq_lens, value_cache=None):
        return super().mean(block_table, seq_lens)


@pytest.mark.parametrize("helper", [_ProductUpdate, _SubtractRewrite, _TrustingMean],
                         ids=["product-update", "subtract-rewrite", "trusting-mean"])
def test_paged_reused_blocks_catches_broken_value_sums(helper, monkeypatch):
    monkeypatch.setattr(rules_paged, "PagedValueSum", helper)
    result = run_rule(TorchBackend(), "paged_reused_blocks", torch.float32, device=torch.device("cpu"),
                      shape_set="quick")
    assert result.status == "fail", f"paged_reused_blocks did not catch {helper.__name__}: {result.report()}"
