"""post_softmax in two passes, without a round trip of every score.

``s_j > theta`` is decided in the log domain as ``a_j - LSE > ln(theta)``, which needs the
LSE of the whole row (paper section 3.1, docs/semantics.md step 3).

Pass 1 (``post_scores_kernel``) reads K once, keeps the per-split max m and sum l, and
writes a compact **candidate list** per (sequence, KV head, split): the positions, and
their G scores, that can still be kept. The filter is exact in one direction: LSE of the
whole row >= LSE of the part of the split seen so far (adding terms only raises it), so
``a_j - LSE_run <= ln(theta) - slack`` proves that j is dropped; anything else is a
candidate. When the list fills up, it is compacted in place against the current running
LSE (:func:`_compact`): what survives has a probability above theta / e^slack within the
prefix seen, so at most ``G e^slack / theta`` entries, however long the split. Memory is
``capacity x (G + 1) x 4`` bytes per split (the launcher's ``post_capacity``, a constant),
not ``4 x Hq x S`` per sequence.

Pass 2 (``post_select_kernel``) combines every split's (m, l) into the row LSE, decides
each candidate exactly and reads only kept V rows, with the same skewed pipeline as the
pre_softmax kernel. A split whose candidates overflowed the capacity recomputes its scores
from K instead (correct, slower; the launcher sizes the capacity so that this is rare).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attn_pre import NO_SPEC
from .selection import keep_mask, load_theta, log_cut
from .tiles import dot_pv, dot_qk, load_rows, program_tile, row_index, row_offsets, set_index

SLACK = tl.constexpr(0.015625)  # ln-domain margin of the pass-1 filter (fp32 rounding of the running LSE)

POST_NO_SPEC = NO_SPEC + ["CAP"]


@triton.jit
def _cut(TH, TSET, stride_ts, st_set, st_head, st_row, b, n, kvh, h, gmask, num_sets, max_row_id,
         GROUP: tl.constexpr, HAS_SETS: tl.constexpr):
    s_idx = set_index(TSET, stride_ts, b, num_sets, HAS_SETS)
    theta = load_theta(TH, s_idx, st_set, st_head, st_row, row_index(n, max_row_id), kvh, h, gmask, GROUP)
    return log_cut(theta)


@triton.jit
def _compact(C_POS, C_S, c_base, count, lse_run, cut, offs_g, gmask, G, BLOCK_N: tl.constexpr,
             GROUP: tl.constexpr):
    """Drop, in place, the stored candidates that the running LSE now proves dropped
    (a - LSE_run <= cut); returns the new count. The survivors of any prefix are at most
    G e^slack / theta (their probabilities within the prefix exceed theta / e^slack), so the
    list stays bounded however long the split. Barriers order this program's own global
    stores and loads (each slot moves down only: dst <= src)."""
    tl.debug_barrier()
    n_keep = count * 0
    for t in range(0, count, BLOCK_N):
        slots = t + tl.arange(0, BLOCK_N)
        smask = slots < count
        c_idx = c_base + slots.to(tl.int64)
        pos = tl.load(C_POS + c_idx, mask=smask, other=0)
        valid = gmask[:, None] & smask[None, :]
        sc = tl.load(C_S + c_idx[None, :] * G + offs_g[:, None], mask=valid, other=float("-inf"))
        _, keep = keep_mask(sc - lse_run[:, None], valid, cut, GROUP)
        keep = keep & smask
        dst = c_base + (n_keep + tl.cumsum(keep.to(tl.int32), axis=0) - 1).to(tl.int64)
        tl.debug_barrier()  # every load of this tile before any store into it
        tl.store(C_POS + dst, pos, mask=keep)
        tl.store(C_S + dst[None, :] * G + offs_g[:, None], sc, mask=keep[None, :] & gmask[:, None])
        n_keep += tl.sum(keep.to(tl.int32), axis=0)
    tl.debug_barrier()
    return n_keep


@triton.jit(do_not_specialize=POST_NO_SPEC)
def post_scores_kernel(
    Q, K, V, LENS, TH, TSET, BT,
    P_M, P_L, P_VSUM, C_POS, C_S, C_CNT,
    stride_qb, stride_qh, stride_qd,
    sk_blk, sk_head, sk_slot, sk_dim,
    sv_blk, sv_head, sv_slot, sv_dim,
    stride_l, stride_ts, stride_btb, stride_bti,
    st_set, st_head, st_row,
    num_kv_heads, max_seq_len, block_size, block_shift, num_blocks, max_row_id, num_sets, num_splits, scale, CAP,
    G, G_PAD: tl.constexpr, D, D_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, PAGING: tl.constexpr, HAS_SETS: tl.constexpr, COMPUTE_MEAN: tl.constexpr,
    DOT_PREC: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Pass 1. Writes P_M, P_L [(b * Hq + h) * num_splits + split]; per group and split
    g = (b * Hkv + kv head) * num_splits + split: C_CNT[g] (candidates found, may exceed
    CAP), C_POS[g * CAP + i] (positions) and C_S[(g * CAP + i) * G + head] (fp32 scores)
    for i < min(C_CNT[g], CAP); P_VSUM[g, :] with ``COMPUTE_MEAN``."""
    pid_s, b, kvh, n, start, end, offs_g, gmask, h, offs_d, dmask = program_tile(
        LENS, stride_l, num_kv_heads, max_seq_len, num_splits, G, D, G_PAD, D_PAD, BLOCK_N)
    num_q_heads = num_kv_heads * G
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    cut = _cut(TH, TSET, stride_ts, st_set, st_head, st_row, b, n, kvh, h, gmask, num_sets, max_row_id,
               GROUP, HAS_SETS)
    K_head = K + kvh.to(tl.int64) * sk_head
    V_head = V + kvh.to(tl.int64) * sv_head
    g_idx = (b * num_kv_heads + kvh).to(tl.int64) * num_splits + pid_s
    c_base = g_idx * CAP

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    count = tl.sum(tl.zeros([BLOCK_N], tl.int32), axis=0)
    over = count * 0
    vsum = tl.zeros([D_PAD], tl.float32)
    # chunks of CAP / 2 positions: the list never holds more than CAP entries; between
    # chunks (outside the pipelined tile loop) it is compacted when half full
    chunk = tl.maximum(CAP // 2 // BLOCK_N, 1) * BLOCK_N
    for c0 in range(start, end, chunk):
        c1 = tl.minimum(c0 + chunk, end)
        for start_n in tl.range(c0, c1, BLOCK_N, num_stages=NUM_STAGES):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            nmask = offs_n < c1
            koff, voff = row_offsets(BT, stride_btb, stride_bti, b, offs_n, nmask, start_n, block_size,
                                     block_shift, num_blocks, sk_blk, sk_slot, sv_blk, sv_slot, PAGING)
            k = load_rows(K_head, koff, nmask, offs_d, dmask, sk_dim, EVEN_D)
            s = dot_qk(q, k, DOT_PREC) * scale
            valid = gmask[:, None] & nmask[None, :]
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_sum = l_sum * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m = m_new
            # LSE of what this split has seen so far <= LSE of the whole row
            lse_run = m_safe + tl.log(l_sum)
            _, cand = keep_mask(s - lse_run[:, None], valid, cut - SLACK, GROUP)
            cand = cand & nmask
            slot = count + tl.cumsum(cand.to(tl.int32), axis=0) - 1
            ok = cand & (slot < CAP)
            c_idx = c_base + slot.to(tl.int64)
            tl.store(C_POS + c_idx, offs_n, mask=ok)
            tl.store(C_S + c_idx[None, :] * G + offs_g[:, None], s, mask=ok[None, :] & gmask[:, None])
            count += tl.sum(cand.to(tl.int32), axis=0)
            if COMPUTE_MEAN:
                v = load_rows(V_head, voff, nmask, offs_d, dmask, sv_dim, EVEN_D)
                vsum += tl.sum(v.to(tl.float32), axis=0)
        over = tl.maximum(over, (count > CAP).to(tl.int32))  # candidates lost: pass 2 recomputes this split
        if count > CAP - chunk:
            m_c = tl.where(m == float("-inf"), 0.0, m)
            count = _compact(C_POS, C_S, c_base, tl.minimum(count, CAP), m_c + tl.log(l_sum), cut - SLACK,
                             offs_g, gmask, G, BLOCK_N, GROUP)

    p_idx = (b * num_q_heads + h).to(tl.int64) * num_splits + pid_s
    tl.store(P_M + p_idx, m, mask=gmask)
    tl.store(P_L + p_idx, l_sum, mask=gmask)
    tl.store(C_CNT + g_idx, tl.where(over > 0, CAP + 1, count))
    if COMPUTE_MEAN:
        tl.store(P_VSUM + g_idx * D_PAD + offs_d, vsum, mask=dmask)


@triton.jit
def _select_tile(s, valid, lse, cut, w_prev, v, acc, w_sum, cnt, vrows,
                 GROUP: tl.constexpr, COUNT: tl.constexpr, UNION: tl.constexpr, DOT_PREC: tl.constexpr):
    """Keep a - LSE > ln(theta) in this tile, weights w = exp(a - LSE) at kept positions;
    multiply the previous tile's weights by its V rows ``v`` (loaded one step early)."""
    x = s - lse[:, None]
    kept, union = keep_mask(x, valid, cut, GROUP)
    w = tl.where(kept, tl.exp(x), 0.0)
    acc += dot_pv(w_prev, v, DOT_PREC)
    w_sum += tl.sum(w, axis=1)
    if COUNT:
        cnt += tl.sum(kept.to(tl.int32), axis=1)
    if UNION:
        vrows += tl.sum(union.to(tl.int32), axis=0)
    return w.to(v.dtype), union, acc, w_sum, cnt, vrows


@triton.jit(do_not_specialize=POST_NO_SPEC)
def post_select_kernel(
    Q, K, V, LENS, TH, TSET, BT,
    P_M, P_L, P_R, P_CNT, P_ACC, P_VROWS, C_POS, C_S, C_CNT,
    stride_qb, stride_qh, stride_qd,
    sk_blk, sk_head, sk_slot, sk_dim,
    sv_blk, sv_head, sv_slot, sv_dim,
    stride_l, stride_ts, stride_btb, stride_bti,
    st_set, st_head, st_row,
    num_kv_heads, max_seq_len, block_size, block_shift, num_blocks, max_row_id, num_sets, num_splits, scale, CAP,
    G, G_PAD: tl.constexpr, D, D_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, PAGING: tl.constexpr, GATHER_PAGING: tl.constexpr, HAS_SETS: tl.constexpr,
    COUNT: tl.constexpr, UNION: tl.constexpr, DOT_PREC: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Pass 2. Writes P_R (sum of kept weights), P_CNT, P_ACC (sum of kept w v) per head
    and split, P_VROWS per group and split (indices as in pass 1)."""
    pid_s, b, kvh, n, start, end, offs_g, gmask, h, offs_d, dmask = program_tile(
        LENS, stride_l, num_kv_heads, max_seq_len, num_splits, G, D, G_PAD, D_PAD, BLOCK_N)
    num_q_heads = num_kv_heads * G
    cut = _cut(TH, TSET, stride_ts, st_set, st_head, st_row, b, n, kvh, h, gmask, num_sets, max_row_id,
               GROUP, HAS_SETS)
    K_head = K + kvh.to(tl.int64) * sk_head
    V_head = V + kvh.to(tl.int64) * sv_head
    PDT = V.dtype.element_ty

    # LSE of the whole row from every split's (m, l); NaN for a poisoned head
    head_base = (b * num_q_heads + h).to(tl.int64) * num_splits
    m_all = tl.full([G_PAD], float("-inf"), tl.float32)
    l_all = tl.zeros([G_PAD], tl.float32)
    for sp in range(0, num_splits):
        m_s = tl.load(P_M + head_base + sp, mask=gmask, other=float("-inf"))
        l_s = tl.load(P_L + head_base + sp, mask=gmask, other=0.0)
        m_new = tl.maximum(m_all, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_all = l_all * tl.exp(m_all - m_safe) + l_s * tl.exp(m_s - m_safe)
        m_all = m_new
    # +inf where every score is -inf (l = 0): each a - LSE of the head is then -inf (weight 0,
    # never kept) instead of -inf - -inf = NaN
    lse = tl.where(l_all == 0.0, float("inf"), tl.where(m_all == float("-inf"), 0.0, m_all) + tl.log(l_all))

    g_idx = (b * num_kv_heads + kvh).to(tl.int64) * num_splits + pid_s
    c_base = g_idx * CAP
    count = tl.load(C_CNT + g_idx)

    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    w_sum = tl.zeros([G_PAD], tl.float32)
    cnt = tl.zeros([G_PAD], tl.int32)
    vrows = tl.sum(tl.zeros([BLOCK_N], tl.int32), axis=0)
    w_prev = tl.zeros([G_PAD, BLOCK_N], PDT)
    rm_prev = tl.zeros([BLOCK_N], tl.int32) > 0
    voff_prev = tl.zeros([BLOCK_N], tl.int64)
    if count <= CAP:
        # the candidate list: dense tiles of positions that may be kept
        for t in tl.range(0, count, BLOCK_N, num_stages=NUM_STAGES):
            v = load_rows(V_head, voff_prev, rm_prev, offs_d, dmask, sv_dim, EVEN_D)
            slots = t + tl.arange(0, BLOCK_N)
            smask = slots < count
            c_idx = c_base + slots.to(tl.int64)
            pos = tl.load(C_POS + c_idx, mask=smask, other=0)
            _, voff = row_offsets(BT, stride_btb, stride_bti, b, pos, smask, t, block_size, block_shift,
                                  num_blocks, sk_blk, sk_slot, sv_blk, sv_slot, GATHER_PAGING)
            valid = gmask[:, None] & smask[None, :]
            s = tl.load(C_S + c_idx[None, :] * G + offs_g[:, None], mask=valid, other=float("-inf"))
            w_prev, rm_prev, acc, w_sum, cnt, vrows = _select_tile(
                s, valid, lse, cut, w_prev, v, acc, w_sum, cnt, vrows, GROUP, COUNT, UNION, DOT_PREC)
            voff_prev = voff
    else:
        # overflow: recompute this split's scores from K
        q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        for start_n in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
            v = load_rows(V_head, voff_prev, rm_prev, offs_d, dmask, sv_dim, EVEN_D)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            koff, voff = row_offsets(BT, stride_btb, stride_bti, b, offs_n, nmask, start_n, block_size,
                                     block_shift, num_blocks, sk_blk, sk_slot, sv_blk, sv_slot, PAGING)
            k = load_rows(K_head, koff, nmask, offs_d, dmask, sk_dim, EVEN_D)
            valid = gmask[:, None] & nmask[None, :]
            s = tl.where(valid, dot_qk(q, k, DOT_PREC) * scale, float("-inf"))
            w_prev, rm_prev, acc, w_sum, cnt, vrows = _select_tile(
                s, valid, lse, cut, w_prev, v, acc, w_sum, cnt, vrows, GROUP, COUNT, UNION, DOT_PREC)
            voff_prev = voff
    v = load_rows(V_head, voff_prev, rm_prev, offs_d, dmask, sv_dim, EVEN_D)
    acc += dot_pv(w_prev, v, DOT_PREC)

    p_idx = head_base + pid_s
    tl.store(P_R + p_idx, w_sum, mask=gmask)
    if COUNT:
        tl.store(P_CNT + p_idx, cnt, mask=gmask)
    tl.store(P_ACC + p_idx[:, None] * D_PAD + offs_d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    if UNION:
        tl.store(P_VROWS + g_idx, vrows)
