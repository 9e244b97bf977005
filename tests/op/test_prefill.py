"""Thresholded prefill: equal to the decode op row by row; top-k and dense against
explicit float64 computations."""

import math

import numpy as np
import pytest
import torch

from topth_ops import decode_attention
from topth_ops.prefill import RowRule, prefill_attention

B, HQ, HKV, S, D = 2, 9, 3, 37, 16


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=g) * 2
    k = torch.randn(B, HKV, S, D, generator=g) * 2
    v = torch.randn(B, HKV, S, D, generator=g)
    R = 30
    pre = torch.randn(HQ, R, generator=g) + 1.0
    pre[:, :3] = -torch.inf
    post = torch.rand(HQ, R, generator=g) * 0.08
    post[:, :3] = -torch.inf
    table = torch.rand(HQ, R, generator=g) * 3
    return q, k, v, pre, post, table


RULES = [
    ("pre_softmax", "none", False), ("pre_softmax", "none", True), ("pre_softmax", "exact", False),
    ("pre_softmax", "exp_threshold", True), ("pre_softmax", "offline", True), ("pre_softmax", "offline", False),
    ("post_softmax", "none", False), ("post_softmax", "none", True),
]


@pytest.mark.parametrize("placement,sdc,vmc", RULES)
def test_prefill_rows_equal_decode_op_steps(placement, sdc, vmc):
    q, k, v, pre, post, table = _inputs()
    th = pre if placement == "pre_softmax" else post
    rule = RowRule("table", placement=placement, sdc=sdc, thresholds=th,
                   sdc_table=table if sdc == "offline" else None, vmc=vmc)
    rows = torch.arange(1, S + 1).view(1, S).expand(B, S)
    out, st = prefill_attention(q, k, v, rows, rule, scale=D ** -0.5, return_stats=True, max_chunk_elems=HQ * S * 5)
    for i in range(S):
        n = i + 1
        kc, vc = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()
        o, s = decode_attention(q[:, :, i], kc, vc, torch.full((B,), n), th, placement=placement, sdc=sdc,
                                sdc_table=rule.sdc_table, vmc=vmc, return_stats=True)
        torch.testing.assert_close(out[:, :, i], o, rtol=1e-5, atol=1e-5)
        assert torch.equal(st.kept[:, :, i], s.kept)
        assert torch.equal(st.v_rows[:, :, i], s.v_rows)
        torch.testing.assert_close(st.dropped_mass[:, :, i], s.dropped_mass, rtol=1e-6, atol=1e-6)
    # something was actually dropped, and something kept
    assert 0 < int(st.kept[:, :, 10:].sum()) < int(rows[:, 10:].sum()) * HQ


@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
@pytest.mark.parametrize("selection", ["head", "group"])
def test_neg_inf_head_equals_decode_op(placement, selection):
    """A head whose every score is -inf (docs/semantics.md, "Edge cases"): 0 plus mu (VMC) for
    it, the other heads of its group as the decode op gives them, row by row."""
    q, k, v, pre, post, _ = _inputs(2)
    k[0, 0, :, 1] = k[0, 0, :, 1].abs() + 0.5
    q[0, 1, :, 1] = float("-inf")  # sequence 0, head 1 (group 0): every score -inf
    th = pre if placement == "pre_softmax" else post
    th = th[:HKV] if selection == "group" else th
    rule = RowRule("table", placement=placement, thresholds=th, vmc=True, selection=selection)
    rows = torch.arange(1, S + 1).view(1, S).expand(B, S)
    out, st = prefill_attention(q, k, v, rows, rule, scale=D ** -0.5, return_stats=True)
    for i in range(S):
        n = i + 1
        o, s = decode_attention(q[:, :, i], k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), torch.full((B,), n),
                                th, placement=placement, vmc=True, selection=selection, return_stats=True)
        torch.testing.assert_close(out[:, :, i], o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o[0, 1], v[0, 0, :n].mean(0), rtol=1e-5, atol=1e-5)  # beta = 1: mu
        assert torch.equal(st.kept[:, :, i], s.kept)


def test_exp_threshold_gamma_zero_far_threshold_equals_decode_op():
    """sdc="exp_threshold" with sdc_gamma = 0 and theta - m past float32's exp range: E~ = 0
    (never 0 x inf = NaN), as in the decode op; head 1 of the group scores -inf everywhere."""
    S4 = 4
    q, k = torch.zeros(1, 2, S4, D), torch.zeros(1, 1, S4, D)
    v = torch.randn(1, 1, S4, D, generator=torch.Generator().manual_seed(0))
    q[0, 0, :, 0] = 1.0
    k[0, 0, ::2, 0] = 100.0  # head 0 scores 100 on rows 0 and 2 (kept with theta 90), 0 elsewhere
    k[0, 0, :, 1] = 1.0
    q[0, 1, :, 1] = float("-inf")  # head 1: every score -inf
    th = torch.full((1, S4), 90.0)
    rule = RowRule("table", placement="pre_softmax", sdc="exp_threshold", sdc_gamma=0.0, thresholds=th, vmc=True,
                   selection="group")
    out, st = prefill_attention(q, k, v, torch.arange(1, S4 + 1).view(1, S4), rule, scale=1.0, return_stats=True)
    for i in range(S4):
        o, s = decode_attention(q[:, :, i], k[:, :, :i + 1].contiguous(), v[:, :, :i + 1].contiguous(),
                                torch.tensor([i + 1]), th, scale=1.0, placement="pre_softmax", sdc="exp_threshold",
                                sdc_gamma=0.0, vmc=True, selection="group", return_stats=True)
        torch.testing.assert_close(out[:, :, i], o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(st.dropped_mass[:, :, i], s.dropped_mass, rtol=1e-6, atol=1e-6)


def test_topk_rule_matches_explicit_sort():
    q, k, v, *_ = _inputs(1)
    K = 5
    rows = torch.arange(1, S + 1).view(1, S).expand(B, S)
    for placement, vmc in (("pre_softmax", False), ("post_softmax", True)):
        rule = RowRule("topk", placement=placement, k=K, vmc=vmc)
        out, st = prefill_attention(q, k, v, rows, rule, scale=D ** -0.5, return_stats=True)
        qd, kd, vd = q.double().numpy(), k.double().numpy(), v.double().numpy()
        for b in range(B):
            for h in range(HQ):
                kv = h // (HQ // HKV)
                for i in range(S):
                    n = i + 1
                    a = kd[b, kv, :n] @ qd[b, h, i] / math.sqrt(D)
                    keep = np.argsort(-a)[: min(K, n)]  # explicit sort
                    p = np.exp(a - a.max())
                    if placement == "pre_softmax":
                        w = np.zeros(n)
                        w[keep] = p[keep] / p[keep].sum()
                    else:
                        w = np.zeros(n)
                        w[keep] = p[keep] / p.sum()
                    o = w @ vd[b, kv, :n]
                    if vmc:
                        o = o + (1 - w.sum()) * vd[b, kv, :n].mean(0)
                    np.testing.assert_allclose(out[b, h, i].double().numpy(), o, rtol=1e-5, atol=1e-5)
                    assert int(st.kept[b, h, i]) == min(K, n)


def test_dense_rule_is_softmax_attention():
    q, k, v, *_ = _inputs(2)
    rows = torch.arange(1, S + 1).view(1, S).expand(B, S)
    out, st = prefill_attention(q, k, v, rows, RowRule("dense"), scale=D ** -0.5, return_stats=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1), is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(st.v_rows, rows.view(B, 1, S).expand(B, HKV, S).to(torch.int32))


def test_padded_rows_equal_unpadded_rows():
    """Left padding: the valid keys of a row are not a prefix; with key_valid each row
    equals the same row computed without padding."""
    q, k, v, pre, post, _ = _inputs(3)
    pad = 6
    rule = RowRule("table", placement="post_softmax", thresholds=post, vmc=True)
    T = S - pad
    valid = torch.zeros(1, S, S, dtype=torch.bool)
    for i in range(pad, S):
        valid[0, i, pad:i + 1] = True
    n = valid.sum(-1)
    out, st = prefill_attention(q[:1], k[:1], v[:1], n, rule, scale=D ** -0.5, key_valid=valid, return_stats=True)
    ref, rst = prefill_attention(q[:1, :, pad:], k[:1, :, pad:], v[:1, :, pad:], torch.arange(1, T + 1).view(1, T),
                                 rule, scale=D ** -0.5, return_stats=True)
    torch.testing.assert_close(out[:, :, pad:], ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(st.kept[:, :, pad:], rst.kept)
    assert torch.all(out[:, :, :pad] == 0) and torch.all(st.kept[:, :, :pad] == 0)  # n = 0 rows


def test_rule_validation():
    with pytest.raises(ValueError, match="sdc must be 'none' with post_softmax"):
        RowRule("table", placement="post_softmax", sdc="exact", thresholds=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="needs k >= 1"):
        RowRule("topk", k=0)
    with pytest.raises(ValueError, match="needs thresholds"):
        RowRule("table")


@pytest.mark.parametrize("placement,sdc,vmc", [RULES[i] for i in (0, 2, 3, 4, 7)])
@pytest.mark.parametrize("selection,sets", [("group", False), ("head", True), ("group", True)])
def test_group_selection_and_threshold_sets_equal_decode_op_steps(placement, sdc, vmc, selection, sets):
    """selection='group' (one threshold per KV head against the group maximum) and 3-D
    threshold sets with a per-sequence threshold_set: each prefill row equals the decode
    op (op contract v0.2) at that row id, outputs and statistics."""
    q, k, v, pre, post, table = _inputs(3)
    th = pre if placement == "pre_softmax" else post
    H = HQ if selection == "head" else HKV
    th = th[:H] if selection == "head" else th[::3].contiguous()  # per KV head
    if sets:  # 3 sets; sequence 0 reads set 2, sequence 1 set 0
        th = torch.stack([th, th * 0.5 if placement == "post_softmax" else th - 1.0, th.flip(-1).clamp(min=-1e30)])
        th[..., :3] = -torch.inf
        table = torch.stack([table, table * 2, table * 0.5])
    ts = torch.tensor([2, 0]) if sets else None
    rule = RowRule("table", placement=placement, sdc=sdc, thresholds=th,
                   sdc_table=table if sdc == "offline" else None, vmc=vmc, selection=selection)
    rows = torch.arange(1, S + 1).view(1, S).expand(B, S)
    out, st = prefill_attention(q, k, v, rows, rule, scale=D ** -0.5, return_stats=True,
                                max_chunk_elems=HQ * S * 5, threshold_set=ts)
    for i in range(S):
        n = i + 1
        kc, vc = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()
        o, s = decode_attention(q[:, :, i], kc, vc, torch.full((B,), n), th, placement=placement, sdc=sdc,
                                sdc_table=rule.sdc_table, vmc=vmc, return_stats=True, selection=selection,
                                threshold_set=ts)
        torch.testing.assert_close(out[:, :, i], o, rtol=1e-5, atol=1e-5)
        assert torch.equal(st.kept[:, :, i], s.kept), i
        assert torch.equal(st.v_rows[:, :, i], s.v_rows)
        torch.testing.assert_close(st.dropped_mass[:, :, i], s.dropped_mass, rtol=1e-6, atol=1e-6)
    if selection == "group":  # every head of a group keeps the group's set; V rows = that count
        kept = st.kept.view(B, HKV, HQ // HKV, S)
        assert torch.equal(kept.amin(2), kept.amax(2)) and torch.equal(kept[:, :, 0], st.v_rows)
    assert 0 < int(st.kept[:, :, 10:].sum()) < int(rows[:, 10:].sum()) * HQ


def test_threshold_set_errors():
    q, k, v, pre, post, table = _inputs()
    rows = torch.arange(1, S + 1).view(1, S).expand(B, S)
    rule3 = RowRule("table", placement="post_softmax", thresholds=torch.stack([post, post]))
    with pytest.raises(ValueError, match="threshold_set .* is required with 3-D"):
        prefill_attention(q, k, v, rows, rule3, scale=1.0)
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\)"):
        prefill_attention(q, k, v, rows, rule3, scale=1.0, threshold_set=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="not allowed with 2-D"):
        prefill_attention(q, k, v, rows, RowRule("table", thresholds=post), scale=1.0, threshold_set=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="selection='group' needs kind='table'"):
        RowRule("topk", k=3, selection="group")
