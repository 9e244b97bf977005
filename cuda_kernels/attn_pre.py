"""pre_softmax in one pass, and the dense mode: ``pre_kernel``.

One program per (sequence b, KV head, split): all ``G`` query heads of the group at once
(``G_PAD`` >= 16 rows of one tensor-core product), so a K row
and a V row are read once per group. theta is known before the pass (paper section 3.1),
so scores, selection and the V product happen in the same loop.

Skewed software pipeline (docs/triton.md) when the kept rows depend on the scores: iteration i ends by issuing the predicated V
load of its own kept rows (the group-union row mask; rows no head keeps are never read)
into registers, and multiplies p v of tile i only in iteration i + 1, after the scores of
tile i + 1: the kept V rows are in flight while the next K tile is waited for and its
scores computed, instead of sitting on the critical path behind them. K is
software-pipelined by Triton (``num_stages``, cp.async). The V load is a predicated
register load, not a cp.async: its mask depends on a tensor-core result of the previous
iteration, which Triton's pipeliner cannot schedule (trying makes it give up on K too).

Partials per split (fp32 unless noted), written for :mod:`.combine`:
m (running max), l = sum_valid exp(a - m) (also the NaN detector: a NaN or +inf score
makes it NaN), r = sum_kept exp(a - m), acc = sum_kept exp(a - m) v, kept counts per head
(``COUNT``), union counts per group (``UNION``), sum of valid V rows (``COMPUTE_MEAN``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .selection import keep_mask, load_theta
from .tiles import dot_pv, dot_qk, load_rows, program_tile, row_index, row_offsets, set_index

# Shape-like ints and small-tensor strides are not specialised on their values; cache
# strides are (alignment and a unit dim stride enable vector loads).
NO_SPEC = ["num_kv_heads", "max_seq_len", "block_size", "block_shift", "num_blocks", "max_row_id", "num_sets",
           "num_splits", "G", "stride_l", "stride_ts", "stride_btb", "stride_bti",
           "st_set", "st_head", "st_row"]


@triton.jit(do_not_specialize=NO_SPEC)
def pre_kernel(
    Q, K, V, LENS, TH, TSET, BT,
    P_M, P_L, P_R, P_CNT, P_ACC, P_VROWS, P_VSUM, P_MK,
    stride_qb, stride_qh, stride_qd,
    sk_blk, sk_head, sk_slot, sk_dim,
    sv_blk, sv_head, sv_slot, sv_dim,
    stride_l, stride_ts, stride_btb, stride_bti,
    st_set, st_head, st_row,
    num_kv_heads, max_seq_len, block_size, block_shift, num_blocks, max_row_id, num_sets, num_splits, scale,
    G, G_PAD: tl.constexpr, D, D_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DENSE: tl.constexpr, GROUP: tl.constexpr, PAGING: tl.constexpr, HAS_SETS: tl.constexpr,
    COUNT: tl.constexpr, UNION: tl.constexpr, COMPUTE_MEAN: tl.constexpr,
    TILE_SKIP: tl.constexpr, V_EARLY: tl.constexpr, DOT_PREC: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Partials index: p = (b * Hq + h) * num_splits + split for per-head values
    (P_M, P_L, P_R, P_CNT, P_MK [p], P_ACC [p, D_PAD]); (b * Hkv + kv head) * num_splits + split
    for per-group values (P_VROWS int32, P_VSUM [., D_PAD]).

    L is relative to the split's maximum m (P_M). With group selection R and ACC are relative
    to the maximum over the split's kept rows mk (P_MK, -inf when none): a head may keep only
    rows far below its own maximum, whose exp(a - m) underflow (docs/semantics.md, "A head's
    kept rows far below its own maximum").
    Otherwise R and ACC are relative to m (the maximum row is kept whenever anything is)."""
    pid_s, b, kvh, n, start, end, offs_g, gmask, h, offs_d, dmask = program_tile(
        LENS, stride_l, num_kv_heads, max_seq_len, num_splits, G, D, G_PAD, D_PAD, BLOCK_N)
    num_q_heads = num_kv_heads * G
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if not DENSE:
        s_idx = set_index(TSET, stride_ts, b, num_sets, HAS_SETS)
        theta = load_theta(TH, s_idx, st_set, st_head, st_row, row_index(n, max_row_id), kvh, h,
                           gmask, GROUP)
    K_head = K + kvh.to(tl.int64) * sk_head
    V_head = V + kvh.to(tl.int64) * sv_head
    PDT = V.dtype.element_ty

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    mk = tl.full([G_PAD], float("-inf"), tl.float32)  # group selection: max over kept rows
    l_sum = tl.zeros([G_PAD], tl.float32)
    r_sum = tl.zeros([G_PAD], tl.float32)
    cnt = tl.zeros([G_PAD], tl.int32)
    vrows = tl.sum(tl.zeros([BLOCK_N], tl.int32), axis=0)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    vsum = tl.zeros([D_PAD], tl.float32)
    # the previous tile: its weights, kept-row mask, V row offsets and (skewed) V rows
    p_prev = tl.zeros([G_PAD, BLOCK_N], PDT)
    rm_prev = tl.zeros([BLOCK_N], tl.int32) > 0
    voff_prev = tl.zeros([BLOCK_N], tl.int64)
    v_next = tl.zeros([BLOCK_N, D_PAD], PDT)

    for start_n in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        if TILE_SKIP:
            if tl.max(rm_prev.to(tl.int32), axis=0) > 0:
                v = load_rows(V_head, voff_prev, rm_prev, offs_d, dmask, sv_dim, EVEN_D)
                acc += dot_pv(p_prev, v, DOT_PREC)
                if COMPUTE_MEAN:
                    vsum += tl.sum(v.to(tl.float32), axis=0)
        elif V_EARLY:
            # the row mask does not depend on the scores: Triton pipelines this as cp.async
            v = load_rows(V_head, voff_prev, rm_prev, offs_d, dmask, sv_dim, EVEN_D)
        else:
            v = v_next  # loaded at the end of the previous iteration

        offs_n = start_n + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        koff, voff = row_offsets(BT, stride_btb, stride_bti, b, offs_n, nmask, start_n, block_size, block_shift,
                                 num_blocks, sk_blk, sk_slot, sv_blk, sv_slot, PAGING)
        k = load_rows(K_head, koff, nmask, offs_d, dmask, sk_dim, EVEN_D)
        s = dot_qk(q, k, DOT_PREC) * scale
        valid = gmask[:, None] & nmask[None, :]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        if GROUP and not DENSE:
            # acc and r_sum relative to the kept maximum mk; one exp per score: kept ones
            # relative to mk, dropped ones to m; l (relative to m) gets the kept sum times
            # exp(mk - m) <= 1
            kept, union = keep_mask(s, valid, theta, GROUP)
            mk_new = tl.maximum(mk, tl.max(tl.where(kept, s, float("-inf")), axis=1))
            mk_safe = tl.where(mk_new == float("-inf"), 0.0, mk_new)
            alpha_k = tl.exp(mk - mk_safe)
            e = tl.exp(s - tl.where(kept, mk_safe[:, None], m_safe[:, None]))  # NaN at a NaN / +inf score
            pk = tl.where(kept, e, 0.0)
            rk = tl.sum(pk, axis=1)
            l_sum = l_sum * alpha + tl.sum(e - pk, axis=1) + tl.where(rk > 0, tl.exp(mk_safe - m_safe) * rk, 0.0)
            mk = mk_new
            if not TILE_SKIP:
                acc += dot_pv(p_prev, v, DOT_PREC)
                if COMPUTE_MEAN:
                    vsum += tl.sum(v.to(tl.float32), axis=0)
            acc = acc * alpha_k[:, None]
            r_sum = r_sum * alpha_k + rk
            if COUNT:
                cnt += tl.sum(kept.to(tl.int32), axis=1)
        else:
            p = tl.exp(s - m_safe[:, None])  # NaN where a score is NaN (and at a +inf score)

            if not TILE_SKIP:
                acc += dot_pv(p_prev, v, DOT_PREC)
                if COMPUTE_MEAN:
                    vsum += tl.sum(v.to(tl.float32), axis=0)
            acc = acc * alpha[:, None]
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if DENSE:
                pk = p
                union = nmask
            else:
                kept, union = keep_mask(s, valid, theta, GROUP)
                pk = tl.where(kept, p, 0.0)
                r_sum = r_sum * alpha + tl.sum(pk, axis=1)
                if COUNT:
                    cnt += tl.sum(kept.to(tl.int32), axis=1)
        if UNION:
            vrows += tl.sum(union.to(tl.int32), axis=0)
        if COMPUTE_MEAN:
            rm_prev = nmask  # the V mean needs every valid row
        else:
            rm_prev = union
        p_prev = pk.to(PDT)
        voff_prev = voff
        m = m_new
        if not TILE_SKIP and not V_EARLY:
            # issue this tile's kept V rows now; they are multiplied in the next iteration
            v_next = load_rows(V_head, voff_prev, rm_prev, offs_d, dmask, sv_dim, EVEN_D)

    # the last tile's V rows
    if TILE_SKIP or V_EARLY:
        v = load_rows(V_head, voff_prev, rm_prev, offs_d, dmask, sv_dim, EVEN_D)
    else:
        v = v_next
    acc += dot_pv(p_prev, v, DOT_PREC)
    if COMPUTE_MEAN:
        vsum += tl.sum(v.to(tl.float32), axis=0)

    p_idx = ((b * num_q_heads + h).to(tl.int64)) * num_splits + pid_s
    tl.store(P_M + p_idx, m, mask=gmask)
    tl.store(P_L + p_idx, l_sum, mask=gmask)
    if not DENSE:
        tl.store(P_R + p_idx, r_sum, mask=gmask)
        if GROUP:
            tl.store(P_MK + p_idx, mk, mask=gmask)
    if COUNT:
        tl.store(P_CNT + p_idx, cnt, mask=gmask)
    tl.store(P_ACC + p_idx[:, None] * D_PAD + offs_d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    g_idx = (b * num_kv_heads + kvh).to(tl.int64) * num_splits + pid_s
    if UNION:
        tl.store(P_VROWS + g_idx, vrows)
    if COMPUTE_MEAN:
        tl.store(P_VSUM + g_idx * D_PAD + offs_d, vsum, mask=dmask)
