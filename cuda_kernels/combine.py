"""Combine stage: merge the splits of one (sequence, KV group) and finish the formulas.

pre_softmax / dense (paper eq. 3, section 3.2.1): online over the splits, M = max m_s,
c_s = exp(m_s - M), L = sum c_s l_s, R = sum c_s r_s, acc = sum c_s acc_s; E~ by SDC mode:
0, L - R (exact: the dense denominator), gamma (n - k~) exp(theta - M), or
sdc_table[set, h, row]; out = acc / (R + E~), kept weight R / (R + E~).
post_softmax: the splits hold absolute weights, out = sum acc_s, kept weight sum r_s.
beta = clamp(1 - kept weight, 0, 1); VMC adds beta * mu (section 3.2.2). Nothing kept gives
out = 0 (mu with VMC) and beta = 1, never 0/0; n = 0 gives zeros and zero stats; a head
whose l is NaN in some split (a NaN or +inf score) gives NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codes import SDC_EXACT, SDC_EXP_THRESHOLD, SDC_OFFLINE

from .attn_pre import NO_SPEC
from .selection import load_theta
from .tiles import clamped_len, row_index, set_index

COMBINE_NO_SPEC = NO_SPEC + ["st_sset", "st_shead", "st_srow", "stride_mb", "stride_mh", "stride_md",
                             "stride_kb", "stride_kh", "stride_db", "stride_dh", "stride_vb", "stride_vh",
                             "sdc_gamma"]


@triton.jit
def _scaled_exp(x, d):
    """x * exp(d) (0 and NaN kept), without exp(d) alone overflowing or turning subnormal when
    the product is in float32 range: there computed as sign(x) exp(log |x| + d); elsewhere the
    plain product."""
    near = (d > -87.0) & (d < 88.0)
    direct = x * tl.exp(tl.where(near, d, 0.0))
    ax = tl.abs(x)
    logd = tl.exp(tl.log(tl.where(ax > 0, ax, 1.0)) + d)
    logd = tl.where(x < 0, -logd, logd)
    return tl.where((x != 0) & (x == x), tl.where(near, direct, logd), x)


@triton.jit(do_not_specialize=COMBINE_NO_SPEC)
def combine_kernel(
    LENS, TH, TSET, SDC_TAB, VMEAN, OUT, ST_KEPT, ST_VROWS, ST_DROPPED,
    P_M, P_L, P_R, P_CNT, P_ACC, P_VROWS, P_VSUM, P_MK,
    stride_l, stride_ts, st_set, st_head, st_row, st_sset, st_shead, st_srow,
    stride_mb, stride_mh, stride_md,
    stride_ob, stride_oh, stride_od,
    stride_kb, stride_kh, stride_db, stride_dh, stride_vb, stride_vh,
    num_kv_heads, max_seq_len, max_row_id, num_sets, num_splits, sdc_gamma,
    G, G_PAD: tl.constexpr, D, D_PAD: tl.constexpr,
    POST: tl.constexpr, DENSE: tl.constexpr, SDC: tl.constexpr, VMC: tl.constexpr,
    COMPUTE_MEAN: tl.constexpr, STATS: tl.constexpr, GROUP: tl.constexpr, HAS_SETS: tl.constexpr,
    COUNT: tl.constexpr, UNION: tl.constexpr,
):
    """One program per (sequence, KV head). SDC: 0 none, 1 exact, 2 exp_threshold,
    3 offline. Stats (``STATS``) are written through their strides: kept [b, h] (stride_kb,
    stride_kh), dropped_mass [b, h] (stride_db, stride_dh), v_rows [b, kv head] (stride_vb,
    stride_vh)."""
    pid = tl.program_id(0)
    b = pid // num_kv_heads
    kvh = pid % num_kv_heads
    num_q_heads = num_kv_heads * G
    n = clamped_len(LENS, stride_l, b, max_seq_len)

    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    h = kvh * G + offs_g
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    head_base = (b * num_q_heads + h).to(tl.int64) * num_splits
    g_base = (b * num_kv_heads + kvh).to(tl.int64) * num_splits

    m_all = tl.full([G_PAD], float("-inf"), tl.float32)
    mk_all = tl.full([G_PAD], float("-inf"), tl.float32)  # pre_softmax, group: reference of R and acc
    l_all = tl.zeros([G_PAD], tl.float32)
    r_all = tl.zeros([G_PAD], tl.float32)
    cnt = tl.zeros([G_PAD], tl.int32)
    bad = tl.zeros([G_PAD], tl.int32) > 0
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    vrows = tl.sum(tl.zeros([G_PAD], tl.int32), axis=0)
    vsum = tl.zeros([D_PAD], tl.float32)
    for sp in range(0, num_splits):
        p_idx = head_base + sp
        l_s = tl.load(P_L + p_idx, mask=gmask, other=0.0)
        bad = bad | (l_s != l_s)
        acc_s = tl.load(P_ACC + p_idx[:, None] * D_PAD + offs_d[None, :], mask=gmask[:, None] & dmask[None, :],
                        other=0.0)
        if DENSE:
            r_s = l_s
        else:
            r_s = tl.load(P_R + p_idx, mask=gmask, other=0.0)
        if POST:
            r_all += r_s
            acc += acc_s
        else:
            m_s = tl.load(P_M + p_idx, mask=gmask, other=float("-inf"))
            m_new = tl.maximum(m_all, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            c_old = tl.exp(m_all - m_safe)
            c_s = tl.exp(m_s - m_safe)
            l_all = l_all * c_old + l_s * c_s
            if GROUP and not DENSE:  # R and acc relative to the splits' kept maxima (attn_pre.py)
                mk_s = tl.load(P_MK + p_idx, mask=gmask, other=float("-inf"))
                mk_new = tl.maximum(mk_all, mk_s)
                mk_safe = tl.where(mk_new == float("-inf"), 0.0, mk_new)
                c_old = tl.exp(mk_all - mk_safe)
                c_s = tl.exp(mk_s - mk_safe)
                mk_all = mk_new
            r_all = r_all * c_old + r_s * c_s
            acc = acc * c_old[:, None] + acc_s * c_s[:, None]
            m_all = m_new
        if COUNT:
            cnt += tl.load(P_CNT + p_idx, mask=gmask, other=0)
        if UNION:
            vrows += tl.load(P_VROWS + g_base + sp)
        if COMPUTE_MEAN:
            vsum += tl.load(P_VSUM + (g_base + sp) * D_PAD + offs_d, mask=dmask, other=0.0)
    if GROUP:
        cnt = tl.zeros([G_PAD], tl.int32) + vrows  # every head keeps the group's set

    if POST:
        out = acc
        w_kept = r_all
    else:
        m_big = tl.where(m_all == float("-inf"), 0.0, m_all)
        # the reference of R and acc: the kept maximum (group selection; m_big when nothing
        # was kept), else m_big. E~ below is defined relative to m_big and rescaled to it:
        # exp(m_big - mk_big) >= 1 (inf only when the product exceeds float32: the kept weights are
        # then 0).
        mk_big = m_big
        if GROUP and not DENSE:
            mk_big = tl.where(mk_all == float("-inf"), m_big, mk_all)
        if DENSE:
            any_kept = (tl.zeros([G_PAD], tl.int32) + n) > 0
        elif GROUP:
            any_kept = (tl.zeros([G_PAD], tl.int32) + vrows) > 0
        else:
            any_kept = r_all > 0  # the row maximum is kept whenever anything is: r >= 1
        e_est = tl.zeros([G_PAD], tl.float32)
        if SDC == SDC_EXACT:  # the dense denominator
            e_est = tl.maximum(_scaled_exp(l_all, m_big - mk_big) - r_all, 0.0)
        if SDC == SDC_EXP_THRESHOLD:
            s_idx = set_index(TSET, stride_ts, b, num_sets, HAS_SETS)
            theta = load_theta(TH, s_idx, st_set, st_head, st_row, row_index(n, max_row_id), kvh, h,
                               gmask, GROUP)
            n_drop = (n - cnt).to(tl.float32)
            e_est = tl.where((n_drop > 0) & (sdc_gamma != 0.0), _scaled_exp(sdc_gamma * n_drop, theta - mk_big), 0.0)
        if SDC == SDC_OFFLINE:  # per query head, like the thresholds' set and row id
            s_idx = set_index(TSET, stride_ts, b, num_sets, HAS_SETS)
            row = row_index(n, max_row_id)
            e_est = tl.load(SDC_TAB + s_idx.to(tl.int64) * st_sset + h.to(tl.int64) * st_shead
                            + row.to(tl.int64) * st_srow, mask=gmask, other=0.0)
            e_est = _scaled_exp(e_est, m_big - mk_big)
        denom = r_all + e_est
        # denom = 0 with rows kept: every kept score of the head is -inf (weight 0, not 0 / 0)
        any_kept = any_kept & (denom > 0.0)
        denom_safe = tl.where(any_kept, denom, 1.0)
        out = tl.where(any_kept[:, None], acc / denom_safe[:, None], 0.0)
        w_kept = tl.where(any_kept, r_all / denom_safe, 0.0)

    beta = 1.0 - w_kept
    beta = tl.where(beta != beta, beta, tl.minimum(tl.maximum(beta, 0.0), 1.0))  # NaN stays NaN
    if VMC:
        if COMPUTE_MEAN:
            mu = vsum / tl.maximum(n, 1).to(tl.float32)
        else:
            mu = tl.load(VMEAN + b.to(tl.int64) * stride_mb + kvh.to(tl.int64) * stride_mh + offs_d * stride_md,
                         mask=dmask, other=0.0)
        out = out + beta[:, None] * mu[None, :]
    out = tl.where(bad[:, None], float("nan"), out)
    empty = n == 0
    out = tl.where(empty, 0.0, out)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    if STATS:
        tl.store(ST_KEPT + b.to(tl.int64) * stride_kb + h * stride_kh, tl.where(empty, 0, cnt), mask=gmask)
        tl.store(ST_DROPPED + b.to(tl.int64) * stride_db + h * stride_dh, tl.where(empty, 0.0, beta), mask=gmask)
        tl.store(ST_VROWS + b.to(tl.int64) * stride_vb + kvh * stride_vh, tl.where(empty, 0, vrows))
