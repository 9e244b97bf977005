"""Triton split-KV kernels for Top-Theta thresholded decode attention (arXiv 2502.08363).

Layout of the work (docs/triton.md has the full design):

- grid ``(batch * num_kv_heads, num_splits)``: one program per (sequence, KV head, split).
  A program handles all ``G = num_q_heads // num_kv_heads`` query heads of its KV group,
  padded to ``G_PAD >= 16`` rows so that the scores are one ``tl.dot`` of
  ``[G_PAD, D_PAD] x [D_PAD, BLOCK_N]``: every K row is read once per group.
- the valid positions ``[0, n)`` of a sequence are cut into ``num_splits`` chunks of whole
  ``BLOCK_N`` tiles (chunk length chosen on the device from n, so a short sequence does
  not spread over empty splits); each split writes fp32 partials that
  :func:`_decode_combine_kernel` merges by log-sum-exp (flash-decoding).
- V-row skipping: a V row is loaded only when some query head of the group keeps it
  (row mask of the load; masked-off rows issue no memory traffic) and a tile in which no
  head keeps anything skips the V load and the second ``tl.dot`` entirely.

Kernels
-------
``_decode_attn_kernel``
    pre_softmax in one pass (theta known up front; paper section 3.1, eq. 3), SDC
    partial sums (section 3.2.1), and the dense mode (``DENSE``: no threshold, the
    in-house baseline).
``_decode_scores_kernel``
    post_softmax pass 1: reads K, writes the fp32 scores a_j and the split LSEs.
``_decode_post_select_kernel``
    post_softmax pass 2: full-row LSE from all splits, keeps a_j - LSE > ln(theta) and
    reads only kept V rows.
``_decode_combine_kernel``
    merges the splits; SDC, VMC (section 3.2.2), NaN / empty rules and the statistics.

All arithmetic after the loads is fp32; a_j = scale * <q, k_j> is the fp32 result of
the dot product (q is never pre-scaled in its own dtype). The probability-times-V
product uses a two-term split of the fp32 weights into the input dtype (``PV_SPLIT``),
so the weights keep about 16 significant bits although the tensor cores see 16-bit
operands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from topth_ops.backends.triton_backend import interpreter_enabled  # one parser of TRITON_INTERPRET

# Numbering of placements / SDC modes shared by the launcher and the kernels.
_SDC_CODES = {"none": 0, "exact": 1, "exp_threshold": 2, "offline": 3}

MAX_SPLITS = 64  # upper bound of num_splits; the split loops are padded to this size

# Shape-like integer arguments are not specialised on their values (== 1, divisible by 16):
# that would multiply the compiled variants for no gain. Strides and head_dim still are
# (alignment enables vector loads).
# Mode flags of the combine step and the computed-mean switch are runtime ints for the same
# reason (they cost a branch, not a recompile).
_SHAPE_ARGS = ["num_kv_heads", "max_seq_len", "num_splits", "G"]
_NO_SPEC_MAIN = _SHAPE_ARGS + ["max_row_id", "stride_th", "COMPUTE_MEAN"]
_NO_SPEC_SCORES = _SHAPE_ARGS
_NO_SPEC_COMBINE = _SHAPE_ARGS + ["max_row_id", "stride_th", "stride_sh", "POST", "SDC", "VMC",
                                  "COMPUTE_MEAN", "STATS"]




# --------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------


@triton.jit
def _clamped_len(LENS, b, max_seq_len):
    """n = clamp(seq_lens[b], 0, max_seq_len): the host cannot check the values on a GPU
    without a sync, so the kernel never trusts them beyond the cache."""
    n = tl.load(LENS + b).to(tl.int32)
    n = tl.maximum(n, 0)
    return tl.minimum(n, max_seq_len)


@triton.jit
def _split_range(n, pid_s, num_splits, BLOCK_N: tl.constexpr):
    """[start, end) of split pid_s: ceil(n / num_splits) rounded up to whole tiles."""
    per = tl.cdiv(n, num_splits)
    chunk = tl.cdiv(per, BLOCK_N) * BLOCK_N
    start = pid_s * chunk
    end = tl.minimum(start + chunk, n)
    return start, end


@triton.jit
def _scores_tile(q, K_base, offs_n, nmask, offs_d, dmask, stride_kn, stride_kd, scale,
                 EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """a = scale * q k^T for one tile: [G_PAD, BLOCK_N] fp32 (fp32 accumulation)."""
    k_ptrs = K_base + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    if EVEN_D:
        k = tl.load(k_ptrs, mask=nmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC, out_dtype=tl.float32)
    return s * scale


@triton.jit
def _load_v_tile(V_base, offs_n, rmask, offs_d, dmask, stride_vn, stride_vd,
                 EVEN_D: tl.constexpr):
    """V rows of one tile where ``rmask`` (row mask: masked rows are never read)."""
    v_ptrs = V_base + offs_n.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    if EVEN_D:
        v = tl.load(v_ptrs, mask=rmask[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs, mask=rmask[:, None] & dmask[None, :], other=0.0)
    return v


@triton.jit
def _pv(p, v, PV_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr):
    """p @ v with fp32 p: [G_PAD, BLOCK_N] x [BLOCK_N, D_PAD] -> fp32.

    With PV_SPLIT (16-bit inputs) p = hi + lo, both in v's dtype, two tensor-core dots:
    the weights keep ~16 significant bits instead of 8 (bf16) or 11 (fp16)."""
    if PV_SPLIT:
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        acc = tl.dot(p_hi, v, out_dtype=tl.float32)
        acc = tl.dot(p_lo, v, acc, out_dtype=tl.float32)
    else:
        acc = tl.dot(p, v.to(tl.float32), input_precision=DOT_PREC, out_dtype=tl.float32)
    return acc


# --------------------------------------------------------------------------------------
# pre_softmax (one pass) and dense mode
# --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=_NO_SPEC_MAIN)
def _decode_attn_kernel(
    Q, K, V, LENS, TH,
    P_M, P_R, P_E, P_CNT, P_BAD, P_ACC, P_VROWS, P_VSUM,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_th, stride_tr,
    num_kv_heads, max_seq_len, max_row_id, num_splits, scale,
    G, G_PAD: tl.constexpr, D, D_PAD: tl.constexpr, EVEN_D: tl.constexpr,
    COMPUTE_MEAN,
    BLOCK_N: tl.constexpr, DENSE: tl.constexpr, PV_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    TILE_SKIP: tl.constexpr,
):
    """One (sequence b, KV head, split): online max m, kept sum R = sum_kept exp(a - m),
    dropped sum E (sdc="exact"), kept count, poisoned flag, acc = sum_kept exp(a - m) v
    and the union count of kept V rows. Paper section 3.1 (eq. 3) and 3.2.1.

    Partials (fp32 unless noted), index p = (b * Hq + h) * num_splits + split:
    P_M, P_R, P_E [p]; P_CNT [p] int32; P_BAD [p] int32; P_ACC [p, D_PAD];
    P_VROWS [(b * Hkv + kvh) * num_splits + split] int32; P_VSUM [same, D_PAD].
    """
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    num_q_heads = num_kv_heads * G

    n = _clamped_len(LENS, b, max_seq_len)
    start, end = _split_range(n, pid_s, num_splits, BLOCK_N)

    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    h = kvh * G + offs_g
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D

    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if DENSE:
        theta = tl.full([G_PAD], float("-inf"), tl.float32)
    else:
        row = tl.minimum(tl.maximum(n, 1), max_row_id) - 1
        # padded heads get theta = +inf: they keep nothing and never widen the V union
        theta = tl.load(TH + h * stride_th + row * stride_tr, mask=gmask, other=float("inf"))

    K_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    V_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    r_sum = tl.zeros([G_PAD], tl.float32)
    e_sum = tl.zeros([G_PAD], tl.float32)
    cnt = tl.zeros([G_PAD], tl.int32)
    bad = tl.zeros([G_PAD], tl.int32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    vsum = tl.zeros([D_PAD], tl.float32)
    vrows = tl.sum(tl.zeros([BLOCK_N], tl.int32), axis=0)

    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        s = _scores_tile(q, K_base, offs_n, nmask, offs_d, dmask, stride_kn, stride_kd, scale,
                         EVEN_D, DOT_PREC)
        valid = gmask[:, None] & nmask[None, :]
        # NaN / +inf scores poison the head (GPU max ignores NaN, so track it explicitly);
        # they are then removed from the softmax bookkeeping of the other rows.
        nonfinite = valid & ((s != s) | (s == float("inf")))
        bad = tl.maximum(bad, tl.max(nonfinite.to(tl.int32), axis=1))
        s = tl.where(valid & ~nonfinite, s, float("-inf"))
        if DENSE:
            kept = valid
        else:
            kept = s > theta[:, None]  # strict; -inf (invalid, padded) never kept
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        pk = tl.where(kept, p, 0.0)
        r_sum = r_sum * alpha + tl.sum(pk, axis=1)
        e_sum = e_sum * alpha + tl.sum(p - pk, axis=1)  # used by sdc="exact" only
        cnt += tl.sum(kept.to(tl.int32), axis=1)
        union = tl.max(kept.to(tl.int32), axis=0) > 0  # [BLOCK_N]: kept by some head
        vrows += tl.sum(union.to(tl.int32), axis=0)
        rmask = union | (nmask & (COMPUTE_MEAN != 0))  # the V mean needs every valid row
        acc = acc * alpha[:, None]
        if TILE_SKIP:
            if tl.max(rmask.to(tl.int32), axis=0) > 0:
                v = _load_v_tile(V_base, offs_n, rmask, offs_d, dmask, stride_vn, stride_vd, EVEN_D)
                acc += _pv(pk, v, PV_SPLIT, DOT_PREC)
                if COMPUTE_MEAN != 0:
                    vsum += tl.sum(v.to(tl.float32), axis=0)
        else:
            v = _load_v_tile(V_base, offs_n, rmask, offs_d, dmask, stride_vn, stride_vd, EVEN_D)
            acc += _pv(pk, v, PV_SPLIT, DOT_PREC)
            if COMPUTE_MEAN != 0:
                vsum += tl.sum(v.to(tl.float32), axis=0)
        m = m_new

    p_idx = ((b * num_q_heads + h).to(tl.int64)) * num_splits + pid_s
    tl.store(P_M + p_idx, m, mask=gmask)
    tl.store(P_R + p_idx, r_sum, mask=gmask)
    tl.store(P_E + p_idx, e_sum, mask=gmask)
    tl.store(P_CNT + p_idx, cnt, mask=gmask)
    tl.store(P_BAD + p_idx, bad, mask=gmask)
    tl.store(P_ACC + p_idx[:, None] * D_PAD + offs_d[None, :], acc, mask=gmask[:, None])
    g_idx = (b * num_kv_heads + kvh).to(tl.int64) * num_splits + pid_s
    tl.store(P_VROWS + g_idx, vrows)
    if COMPUTE_MEAN != 0:
        tl.store(P_VSUM + g_idx * D_PAD + offs_d, vsum)


# --------------------------------------------------------------------------------------
# post_softmax: pass 1 (scores + split LSE) and pass 2 (select, read kept V rows)
# --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=_NO_SPEC_SCORES)
def _decode_scores_kernel(
    Q, K, LENS, SCORES, P_LSE, P_BAD,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    num_kv_heads, max_seq_len, num_splits, scale,
    G, G_PAD: tl.constexpr, D, D_PAD: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """post_softmax pass 1: a_j = scale * <q, k_j> (fp32) into SCORES [B, Hq, max_seq_len]
    for the valid j of this split, and the split's LSE = m + ln(sum exp(a - m)) (-inf for an
    empty split) and poisoned flag into P_LSE / P_BAD [(b * Hq + h) * num_splits + split]."""
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    num_q_heads = num_kv_heads * G

    n = _clamped_len(LENS, b, max_seq_len)
    start, end = _split_range(n, pid_s, num_splits, BLOCK_N)

    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    h = kvh * G + offs_g
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    K_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    S_base = SCORES + (b * num_q_heads + h).to(tl.int64) * max_seq_len

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    bad = tl.zeros([G_PAD], tl.int32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        s = _scores_tile(q, K_base, offs_n, nmask, offs_d, dmask, stride_kn, stride_kd, scale,
                         EVEN_D, DOT_PREC)
        valid = gmask[:, None] & nmask[None, :]
        nonfinite = valid & ((s != s) | (s == float("inf")))
        bad = tl.maximum(bad, tl.max(nonfinite.to(tl.int32), axis=1))
        s = tl.where(valid & ~nonfinite, s, float("-inf"))
        tl.store(S_base[:, None] + offs_n[None, :], s, mask=valid)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_sum = l_sum * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        m = m_new
    lse = tl.where(l_sum > 0, m + tl.log(l_sum), float("-inf"))
    p_idx = (b * num_q_heads + h).to(tl.int64) * num_splits + pid_s
    tl.store(P_LSE + p_idx, lse, mask=gmask)
    tl.store(P_BAD + p_idx, bad, mask=gmask)


@triton.jit(do_not_specialize=_NO_SPEC_MAIN)
def _decode_post_select_kernel(
    V, LENS, TH, SCORES, P_LSE,
    P_R, P_CNT, P_ACC, P_VROWS, P_VSUM,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_th, stride_tr,
    num_kv_heads, max_seq_len, max_row_id, num_splits,
    G, G_PAD: tl.constexpr, D, D_PAD: tl.constexpr, EVEN_D: tl.constexpr,
    COMPUTE_MEAN,
    BLOCK_N: tl.constexpr, NS_PAD: tl.constexpr,
    PV_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, TILE_SKIP: tl.constexpr,
):
    """post_softmax pass 2: LSE of the whole row from every split's LSE, then keep
    a_j - LSE > ln(theta) (s_j > theta in the log domain; ln(theta) = -inf for theta <= 0,
    NaN keeps nothing) and accumulate w_j v_j, w_j = exp(a_j - LSE), over kept rows only.
    Writes P_R (sum of kept w), P_CNT, P_ACC, P_VROWS, P_VSUM like the pre_softmax kernel."""
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    num_q_heads = num_kv_heads * G

    n = _clamped_len(LENS, b, max_seq_len)
    start, end = _split_range(n, pid_s, num_splits, BLOCK_N)

    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    h = kvh * G + offs_g
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D

    # full-row LSE = logsumexp over the splits' LSEs
    offs_s = tl.arange(0, NS_PAD)
    head_base = (b * num_q_heads + h).to(tl.int64) * num_splits
    lse_s = tl.load(P_LSE + head_base[:, None] + offs_s[None, :],
                    mask=gmask[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"))
    lse_max = tl.max(lse_s, axis=1)
    lse_max_safe = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    lse = lse_max_safe + tl.log(tl.sum(tl.exp(lse_s - lse_max_safe[:, None]), axis=1))

    row = tl.minimum(tl.maximum(n, 1), max_row_id) - 1
    theta = tl.load(TH + h * stride_th + row * stride_tr, mask=gmask, other=float("nan"))
    log_theta = tl.where(theta > 0, tl.log(tl.where(theta > 0, theta, 1.0)), float("-inf"))
    log_theta = tl.where(theta != theta, theta, log_theta)  # NaN theta keeps nothing

    V_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    S_base = SCORES + (b * num_q_heads + h).to(tl.int64) * max_seq_len

    w_sum = tl.zeros([G_PAD], tl.float32)
    cnt = tl.zeros([G_PAD], tl.int32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    vsum = tl.zeros([D_PAD], tl.float32)
    vrows = tl.sum(tl.zeros([BLOCK_N], tl.int32), axis=0)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        valid = gmask[:, None] & nmask[None, :]
        s = tl.load(S_base[:, None] + offs_n[None, :], mask=valid, other=float("-inf"))
        log_s = s - lse[:, None]
        kept = valid & (log_s > log_theta[:, None])
        w = tl.where(kept, tl.exp(log_s), 0.0)
        w_sum += tl.sum(w, axis=1)
        cnt += tl.sum(kept.to(tl.int32), axis=1)
        union = tl.max(kept.to(tl.int32), axis=0) > 0
        vrows += tl.sum(union.to(tl.int32), axis=0)
        rmask = union | (nmask & (COMPUTE_MEAN != 0))
        if TILE_SKIP:
            if tl.max(rmask.to(tl.int32), axis=0) > 0:
                v = _load_v_tile(V_base, offs_n, rmask, offs_d, dmask, stride_vn, stride_vd, EVEN_D)
                acc += _pv(w, v, PV_SPLIT, DOT_PREC)
                if COMPUTE_MEAN != 0:
                    vsum += tl.sum(v.to(tl.float32), axis=0)
        else:
            v = _load_v_tile(V_base, offs_n, rmask, offs_d, dmask, stride_vn, stride_vd, EVEN_D)
            acc += _pv(w, v, PV_SPLIT, DOT_PREC)
            if COMPUTE_MEAN != 0:
                vsum += tl.sum(v.to(tl.float32), axis=0)

    p_idx = head_base + pid_s
    tl.store(P_R + p_idx, w_sum, mask=gmask)
    tl.store(P_CNT + p_idx, cnt, mask=gmask)
    tl.store(P_ACC + p_idx[:, None] * D_PAD + offs_d[None, :], acc, mask=gmask[:, None])
    g_idx = (b * num_kv_heads + kvh).to(tl.int64) * num_splits + pid_s
    tl.store(P_VROWS + g_idx, vrows)
    if COMPUTE_MEAN != 0:
        tl.store(P_VSUM + g_idx * D_PAD + offs_d, vsum)


# --------------------------------------------------------------------------------------
# combine
# --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=_NO_SPEC_COMBINE)
def _decode_combine_kernel(
    LENS, TH, SDC_TAB, VMEAN, OUT,
    P_M, P_R, P_E, P_CNT, P_BAD, P_ACC, P_VROWS, P_VSUM,
    ST_KEPT, ST_VROWS, ST_DROPPED,
    stride_th, stride_tr, stride_sh, stride_sr,
    stride_mb, stride_mh, stride_md,
    stride_ob, stride_oh, stride_od,
    num_kv_heads, max_seq_len, max_row_id, num_splits, sdc_gamma,
    G, G_PAD: tl.constexpr, D, D_PAD: tl.constexpr, EVEN_D: tl.constexpr,
    POST, SDC, VMC, COMPUTE_MEAN, STATS,
    NS_PAD: tl.constexpr,
):
    """Merge the splits of one (sequence, KV group) and finish the formulas.

    pre_softmax: M = max_s m_s, c_s = exp(m_s - M), R = sum c_s R_s, acc = sum c_s acc_s,
    E~ by SDC mode (0 / sum c_s E_s / gamma (n - k~) exp(theta - M) / sdc_table[h, row]),
    out = acc / (R + E~), sum of kept weights R / (R + E~) (paper eq. 3, section 3.2.1).
    post_softmax: the splits hold absolute weights already, out = sum acc_s.
    beta = clamp(1 - sum w, 0, 1); VMC adds beta * mu (section 3.2.2). Nothing kept gives
    out = 0 (mu with VMC); n = 0 gives out = 0 and zero stats; a poisoned head gives NaN.
    """
    pid = tl.program_id(0)
    b = pid // num_kv_heads
    kvh = pid % num_kv_heads
    num_q_heads = num_kv_heads * G
    n = _clamped_len(LENS, b, max_seq_len)

    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    h = kvh * G + offs_g
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    offs_s = tl.arange(0, NS_PAD)
    smask = offs_s < num_splits
    head_base = (b * num_q_heads + h).to(tl.int64) * num_splits
    idx2 = head_base[:, None] + offs_s[None, :]
    mask2 = gmask[:, None] & smask[None, :]

    cnt = tl.sum(tl.load(P_CNT + idx2, mask=mask2, other=0), axis=1)
    bad = tl.max(tl.load(P_BAD + idx2, mask=mask2, other=0), axis=1) > 0
    if POST != 0:
        m_big = tl.zeros([G_PAD], tl.float32)
    else:
        m_s = tl.load(P_M + idx2, mask=mask2, other=float("-inf"))
        m_big = tl.max(m_s, axis=1)
        m_big = tl.where(m_big == float("-inf"), 0.0, m_big)

    r_tot = tl.zeros([G_PAD], tl.float32)
    e_tot = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for s in range(0, num_splits):
        p_idx = head_base + s
        r_s = tl.load(P_R + p_idx, mask=gmask, other=0.0)
        acc_s = tl.load(P_ACC + p_idx[:, None] * D_PAD + offs_d[None, :], mask=gmask[:, None], other=0.0)
        if POST != 0:
            r_tot += r_s
            acc += acc_s
        else:
            c = tl.exp(tl.load(P_M + p_idx, mask=gmask, other=float("-inf")) - m_big)
            r_tot += c * r_s
            acc += c[:, None] * acc_s
            e_tot += c * tl.load(P_E + p_idx, mask=gmask, other=0.0)

    row = tl.minimum(tl.maximum(n, 1), max_row_id) - 1
    if POST != 0:
        out = acc
        w_kept = r_tot
    else:
        e_est = tl.zeros([G_PAD], tl.float32)  # sdc="none"
        if SDC == 1:  # exact
            e_est = e_tot
        if SDC == 2:  # exp_threshold
            theta = tl.load(TH + h * stride_th + row * stride_tr, mask=gmask, other=0.0)
            n_drop = (n - cnt).to(tl.float32)
            e_est = tl.where(n_drop > 0, sdc_gamma * n_drop * tl.exp(theta - m_big), 0.0)
        if SDC == 3:  # offline
            e_est = tl.load(SDC_TAB + h * stride_sh + row * stride_sr, mask=gmask, other=0.0)
        denom = r_tot + e_est
        any_kept = cnt > 0
        denom_safe = tl.where(any_kept, denom, 1.0)
        out = tl.where(any_kept[:, None], acc / denom_safe[:, None], 0.0)
        w_kept = tl.where(any_kept, r_tot / denom_safe, 0.0)

    beta = 1.0 - w_kept
    beta = tl.where(beta != beta, beta, tl.minimum(tl.maximum(beta, 0.0), 1.0))  # NaN stays NaN
    if VMC != 0:
        if COMPUTE_MEAN != 0:
            g_base = (b * num_kv_heads + kvh).to(tl.int64) * num_splits
            vsum = tl.zeros([D_PAD], tl.float32)
            for s in range(0, num_splits):
                vsum += tl.load(P_VSUM + (g_base + s) * D_PAD + offs_d)
            mu = vsum / tl.maximum(n, 1).to(tl.float32)
        else:
            mu = tl.load(VMEAN + b.to(tl.int64) * stride_mb + kvh * stride_mh + offs_d * stride_md,
                         mask=dmask, other=0.0)
        out = out + beta[:, None] * mu[None, :]
    out = tl.where(bad[:, None], float("nan"), out)
    empty = n == 0
    out = tl.where(empty, 0.0, out)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    if STATS != 0:
        tl.store(ST_KEPT + b * num_q_heads + h, tl.where(empty, 0, cnt), mask=gmask)
        tl.store(ST_DROPPED + b * num_q_heads + h, tl.where(empty, 0.0, beta), mask=gmask)
        g_base2 = (b * num_kv_heads + kvh).to(tl.int64) * num_splits
        vr = tl.sum(tl.load(P_VROWS + g_base2 + offs_s, mask=smask, other=0), axis=0)
        tl.store(ST_VROWS + b * num_kv_heads + kvh, tl.where(empty, 0, vr))


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and split count of one call (see :func:`choose_config`).

    Attributes
    ----------
    block_n : int
        KV positions per tile (power of two, >= 16).
    num_splits : int
        Splits of the KV sequence (flash-decoding); partials are merged by LSE.
    num_warps, num_stages : int
        Triton launch parameters of the main kernels.
    tile_skip : bool
        Skip the V load and dot of a tile that no head of the group keeps.
    """

    block_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2
    tile_skip: bool = True


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: few programs, each serial in Python


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int,
                      num_sms: int, *, min_tokens_per_split: int = 512, max_splits: int = MAX_SPLITS) -> int:
    """Split count from the sequence length and the batch x kv-heads parallelism.

    Enough programs to fill ``2 * num_sms`` slots (batch x kv-heads programs before
    splitting), while each split keeps at least ``min_tokens_per_split`` positions of the
    longest possible sequence. The host cannot read seq_lens without a sync, so it plans
    for ``max_seq_len``; a shorter sequence uses fewer splits (the chunk length is chosen
    on the device from n, the unused splits exit at once).

    Returns
    -------
    int
        In ``[1, max_splits]``.
    """
    parallel = max(batch * num_kv_heads, 1)
    want = math.ceil(2 * num_sms / parallel)
    by_len = max(1, max_seq_len // max(min_tokens_per_split, block_n))
    return int(max(1, min(want, by_len, max_splits)))


def gpu_block_n(head_dim: int) -> int:
    """KV positions per tile on a GPU: 64, or 32 for head_dim > 128 (shared memory)."""
    return 64 if head_dim <= 128 else 32


def choose_config(batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                  device: torch.device) -> LaunchConfig:
    """Default :class:`LaunchConfig` for a call (GPU: :func:`gpu_block_n`; interpreter: 32)."""
    if interpreter_enabled() or device.type != "cuda":
        block_n = 32
    else:
        block_n = gpu_block_n(head_dim)
    ns = choose_num_splits(batch, num_kv_heads, max_seq_len, block_n, _num_sms(device))
    return LaunchConfig(block_n=block_n, num_splits=ns)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def decode_attn_fwd(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    thresholds: Optional[torch.Tensor],
    out: torch.Tensor,
    *,
    scale: float,
    placement: str = "pre_softmax",
    sdc: str = "none",
    sdc_gamma: float = 0.05,
    sdc_table: Optional[torch.Tensor] = None,
    vmc: bool = False,
    value_mean: Optional[torch.Tensor] = None,
    stats: Optional[tuple] = None,
    dense: bool = False,
    config: Optional[LaunchConfig] = None,
) -> torch.Tensor:
    """Launch the thresholded (or dense) split-KV decode kernels; writes ``out`` in place.

    Inputs are assumed validated by :func:`topth_ops.contract.make_inputs` (shapes,
    dtypes, devices); seq_lens values are clamped into [0, max_seq_len] on the device.

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, D]`` float16 / bfloat16 / float32.
    key_cache, value_cache : torch.Tensor
        ``[B, Hkv, S, D]`` (BNSD, any strides), query dtype.
    seq_lens : torch.Tensor
        ``[B]`` int32 / int64.
    thresholds : torch.Tensor or None
        ``[Hq, R]`` float32 (logits for pre_softmax, probabilities for post_softmax);
        ignored (may be None) with ``dense=True``.
    out : torch.Tensor
        ``[B, Hq, D]``, query dtype: every element is written.
    scale : float
        Softmax scale (a_j = scale * <q, k_j>).
    placement, sdc, sdc_gamma, sdc_table, vmc, value_mean
        As :func:`topth_ops.decode_attention` (paper sections 3.1-3.2).
    stats : tuple of torch.Tensor, optional
        ``(kept [B, Hq] int32, v_rows [B, Hkv] int32, dropped_mass [B, Hq] float32)``,
        written when given.
    dense : bool
        Dense mode of the same kernel: every valid position kept, no threshold and no
        SDC / VMC (plain scaled dot-product attention over the n valid positions).
    config : LaunchConfig, optional
        Tile size / split count override (default :func:`choose_config`).

    Returns
    -------
    torch.Tensor
        ``out``.
    """
    B, Hq, D = query.shape
    Hkv, S = key_cache.shape[1], key_cache.shape[2]
    G = Hq // Hkv
    dev = query.device
    cfg = config or choose_config(B, Hkv, S, D, dev)
    ns = int(cfg.num_splits)
    block_n = int(cfg.block_n)
    G_PAD = max(16, _next_pow2(G))
    D_PAD = max(16, _next_pow2(D))
    if not 1 <= ns <= MAX_SPLITS:
        raise ValueError(f"config.num_splits must be in [1, {MAX_SPLITS}], got {ns}")
    NS_PAD = MAX_SPLITS
    f32 = torch.float32
    pv_split = query.dtype in (torch.float16, torch.bfloat16)
    # fp32 inputs: exact fp32 dot (no TF32); 16-bit inputs: the precision flag is unused
    dot_prec = "ieee" if query.dtype == torch.float32 else "tf32"
    post = (placement == "post_softmax") and not dense
    if dense:
        sdc, vmc, stats = "none", False, None
    compute_mean = bool(vmc and value_mean is None)
    # a tile can only be skipped when rows can be dropped (with a computed V mean every
    # valid row is read anyway and the branch is always taken)
    tile_skip = bool(cfg.tile_skip) and not dense
    if thresholds is None:
        thresholds = torch.full((Hq, 1), float("-inf"), dtype=f32, device=dev)

    P_M = torch.empty((B * Hq * ns,), dtype=f32, device=dev)
    P_R = torch.empty_like(P_M)
    P_E = torch.empty_like(P_M)
    P_CNT = torch.empty((B * Hq * ns,), dtype=torch.int32, device=dev)
    P_BAD = torch.empty_like(P_CNT)
    P_ACC = torch.empty((B * Hq * ns, D_PAD), dtype=f32, device=dev)
    P_VROWS = torch.empty((B * Hkv * ns,), dtype=torch.int32, device=dev)
    P_VSUM = torch.empty((B * Hkv * ns, D_PAD), dtype=f32, device=dev) if compute_mean else P_M

    grid = (B * Hkv, ns)
    common = dict(G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, EVEN_D=(D == D_PAD), BLOCK_N=block_n, DOT_PREC=dot_prec,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not post:
        _decode_attn_kernel[grid](
            query, key_cache, value_cache, seq_lens, thresholds,
            P_M, P_R, P_E, P_CNT, P_BAD, P_ACC, P_VROWS, P_VSUM,
            *query.stride(), *key_cache.stride(), *value_cache.stride(), *thresholds.stride(),
            Hkv, S, thresholds.shape[1], ns, float(scale),
            COMPUTE_MEAN=int(compute_mean), DENSE=bool(dense),
            PV_SPLIT=pv_split, TILE_SKIP=tile_skip, **common,
        )
    else:
        scores = torch.empty((B * Hq * S,), dtype=f32, device=dev)
        P_LSE = P_M
        _decode_scores_kernel[grid](
            query, key_cache, seq_lens, scores, P_LSE, P_BAD,
            *query.stride(), *key_cache.stride(),
            Hkv, S, ns, float(scale), **common,
        )
        _decode_post_select_kernel[grid](
            value_cache, seq_lens, thresholds, scores, P_LSE,
            P_R, P_CNT, P_ACC, P_VROWS, P_VSUM,
            *value_cache.stride(), *thresholds.stride(),
            Hkv, S, thresholds.shape[1], ns,
            COMPUTE_MEAN=int(compute_mean), NS_PAD=NS_PAD, PV_SPLIT=pv_split,
            TILE_SKIP=tile_skip, **common,
        )

    table = sdc_table if sdc_table is not None else thresholds
    vmean = value_mean if value_mean is not None else P_ACC.view(B, Hq * ns, D_PAD)
    if stats is not None:
        st_kept, st_vrows, st_dropped = stats
    else:
        st_kept = st_vrows = P_CNT
        st_dropped = P_R
    _decode_combine_kernel[(B * Hkv,)](
        seq_lens, thresholds, table, vmean, out,
        P_M, P_R, P_E, P_CNT, P_BAD, P_ACC, P_VROWS, P_VSUM,
        st_kept, st_vrows, st_dropped,
        *thresholds.stride(), *table.stride(), *vmean.stride(), *out.stride(),
        Hkv, S, thresholds.shape[1], ns, float(sdc_gamma),
        POST=int(post), SDC=_SDC_CODES[sdc], VMC=int(vmc), COMPUTE_MEAN=int(compute_mean),
        STATS=int(stats is not None),
        G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, EVEN_D=(D == D_PAD), NS_PAD=NS_PAD, num_warps=4,
    )
    return out
