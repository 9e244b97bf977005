"""Independent float64 oracle of the op contract (docs/semantics.md).

Plain numpy, one (sequence, query head) at a time, written straight from the formulas of
the paper (sections 3.1-3.2) and sharing no code with any backend. It is slow on purpose:
clarity over speed. Inputs are the tensors exactly as a backend receives them (already
rounded to their dtype); everything here is computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class OracleResult:
    """Expected result of one call.

    Attributes
    ----------
    out : np.ndarray
        ``[batch, num_q_heads, head_dim]`` float64.
    kept : np.ndarray
        ``[batch, num_q_heads]`` int64.
    v_rows : np.ndarray
        ``[batch, num_kv_heads]`` int64.
    dropped_mass : np.ndarray
        ``[batch, num_q_heads]`` float64.
    nonfinite : np.ndarray
        ``[batch, num_q_heads]`` bool: heads with a NaN or +inf score, whose output is all
        NaN and whose stats are unspecified.
    margin : np.ndarray
        ``[batch, num_q_heads]`` float64: the smallest distance between a valid score and
        the threshold, in score units for pre_softmax and in log-probability units
        (a_j - LSE vs ln(theta)) for post_softmax; inf when nothing is compared.
    """

    out: np.ndarray
    kept: np.ndarray
    v_rows: np.ndarray
    dropped_mass: np.ndarray
    nonfinite: np.ndarray
    margin: np.ndarray


def _f64(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    if t is None:
        return None
    return t.detach().to("cpu", torch.float64).numpy()


def _sequence_kv(k: np.ndarray, v: np.ndarray, b: int, g: int, n: int, block_table, kv_layout):
    """Keys and values ``[n, head_dim]`` of sequence b, KV head g, assembled position by
    position (paged: block ``block_table[b, j // block_size]``, slot ``j % block_size``)."""
    if block_table is None:
        return k[b, g, :n], v[b, g, :n]
    bs = k.shape[1] if kv_layout == "NHD" else k.shape[2]
    D = k.shape[-1]
    keys, vals = [], []
    for j in range(n):
        blk, slot = int(block_table[b, j // bs]), j % bs
        if kv_layout == "NHD":
            keys.append(k[blk, slot, g]), vals.append(v[blk, slot, g])
        elif kv_layout == "HND":
            keys.append(k[blk, g, slot]), vals.append(v[blk, g, slot])
        else:  # VLLM_AMX: the region of (blk, g) in memory order, element (slot, d) at its packed offset
            kr, vr = k[blk, g].reshape(-1), v[blk, g].reshape(-1)
            keys.append([kr[(slot // 16) * D * 16 + (d // 2) * 32 + (slot % 16) * 2 + d % 2] for d in range(D)])
            vals.append([vr[(d // 16) * bs * 16 + (slot // 2) * 32 + (d % 16) * 2 + slot % 2] for d in range(D)])
    return np.array(keys), np.array(vals)


def keep_values(a: np.ndarray, placement: str) -> np.ndarray:
    """What the threshold is compared with (docs/semantics.md, "The formulas", steps 2-3).

    Parameters
    ----------
    a : numpy.ndarray
        float64 ``[n]``, n >= 1: one head's scores over its valid positions.
    placement : {"pre_softmax", "post_softmax"}

    Returns
    -------
    numpy.ndarray
        float64 ``[n]``: the logits ``a`` (pre_softmax) or the log-probabilities log s_j
        (post_softmax, compared with ln theta; exact enough in float64): -inf where a_j is
        -inf (every entry when every score is -inf), NaN throughout when a score is NaN or
        +inf.
    """
    if placement == "pre_softmax":
        return a
    m = a.max()
    if np.isneginf(m):
        return np.full_like(a, -np.inf)
    # a - m - ln(sum exp(a - m)): finite for every finite score, also where exp(a - m)
    # underflows (theta <= 0 keeps every finite score)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (a - m) - np.log(np.exp(a - m).sum())


def _keep_mask(x: np.ndarray, theta: float, placement: str) -> tuple[np.ndarray, float]:
    """Kept positions (strict ``>``) and the margin |x - cut| over the finite x."""
    if placement == "post_softmax":
        if np.isnan(theta):
            return np.zeros(x.shape, dtype=bool), np.inf
        if theta <= 0:
            return x > -np.inf, np.inf  # every finite score, also where exp underflows
        cut = np.log(theta)
    else:
        cut = theta
    keep = x > cut
    finite = np.isfinite(x)
    margin = np.min(np.abs(x[finite] - cut)) if finite.any() and np.isfinite(cut) else np.inf
    return keep, margin


def oracle_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    thresholds: torch.Tensor,
    *,
    scale: Optional[float] = None,
    placement: str = "post_softmax",
    sdc: str = "none",
    sdc_gamma: float = 0.05,
    sdc_table: Optional[torch.Tensor] = None,
    vmc: bool = False,
    value_mean: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: Optional[str] = None,
    selection: str = "head",
    threshold_set: Optional[torch.Tensor] = None,
) -> OracleResult:
    """Float64 thresholded decode attention; arguments as :func:`topth_ops.decode_attention`.

    Inputs must be valid (in-range lengths, table entries and set indices).

    Returns
    -------
    OracleResult
        With ``selection="group"``, ``margin`` is the distance of the group maximum from
        the threshold, and ``nonfinite`` marks every head of a group in which some head
        has a NaN or +inf score (the other heads' outputs are unspecified then).
    """
    q, k, v = _f64(query), _f64(key_cache), _f64(value_cache)
    th, table, vmean = _f64(thresholds), _f64(sdc_table), _f64(value_mean)
    if th.ndim == 2:  # one set
        th = th[None]
        table = None if table is None else table[None]
    sets = (np.zeros(len(seq_lens), dtype=np.int64) if threshold_set is None
            else threshold_set.detach().cpu().numpy().astype(np.int64))
    bt = None if block_table is None else block_table.detach().cpu().numpy().astype(np.int64)
    layout = kv_layout or ("NHD" if bt is not None else "BNSD")
    lens = seq_lens.detach().cpu().numpy().astype(np.int64)
    B, Hq, D = q.shape
    Hkv = k.shape[2] if layout == "NHD" else k.shape[1]
    R = th.shape[2]
    group = Hq // Hkv
    if scale is None:
        scale = 1.0 / np.sqrt(D)

    out = np.zeros((B, Hq, D))
    kept_count = np.zeros((B, Hq), dtype=np.int64)
    v_rows = np.zeros((B, Hkv), dtype=np.int64)
    dropped = np.zeros((B, Hq))
    nonfinite = np.zeros((B, Hq), dtype=bool)
    margin = np.full((B, Hq), np.inf)

    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue  # semantics 6: out = 0, stats 0
        row, s = min(n, R) - 1, sets[b]
        for g in range(Hkv):
            keys, vals = _sequence_kv(k, v, b, g, n, bt, layout)
            heads = range(g * group, (g + 1) * group)
            with np.errstate(invalid="ignore", over="ignore"):
                a_all = {h: scale * (keys @ q[b, h]) for h in heads}  # semantics 1
            bad = {h for h in heads if np.isnan(a_all[h]).any() or np.isposinf(a_all[h]).any()}
            for h in bad:
                out[b, h] = np.nan
            if selection == "group":
                if bad:  # the group's selection is unspecified
                    nonfinite[b, list(heads)] = True
                    out[b, [h for h in heads if h not in bad]] = np.nan
                    continue
                x = np.max([keep_values(a_all[h], placement) for h in heads], axis=0)
                keep_g, marg = _keep_mask(x, th[s, g, row], placement)
            union = np.zeros(n, dtype=bool)
            for h in heads:
                if h in bad:
                    nonfinite[b, h] = True
                    continue
                a = a_all[h]
                if selection == "group":
                    keep, margin[b, h] = keep_g, marg
                    theta = th[s, g, row]
                else:
                    theta = th[s, h, row]
                    keep, margin[b, h] = _keep_mask(keep_values(a, placement), theta, placement)
                m = a.max()
                if np.isneginf(m):  # every score -inf: no weight anywhere
                    e, m = np.zeros(n), 0.0
                else:
                    e = np.exp(a - m)
                if placement == "pre_softmax":
                    R_sum = e[keep].sum()
                    if sdc == "none":
                        E = 0.0
                    elif sdc == "exact":
                        E = e[~keep].sum()
                    elif sdc == "exp_threshold":
                        n_drop = n - int(keep.sum())
                        # 0 whenever gamma is 0 (also where exp(theta - m) overflows); an
                        # overflow otherwise makes E +inf and every weight 0, as in float32
                        with np.errstate(over="ignore"):
                            E = sdc_gamma * n_drop * np.exp(theta - m) if n_drop > 0 and sdc_gamma != 0 else 0.0
                    else:
                        E = table[s, h, row]
                    # R + E = 0: every kept score is -inf (weight 0, semantics "Edge cases")
                    w = e[keep] / (R_sum + E) if keep.any() and R_sum + E != 0 else np.zeros(int(keep.sum()))
                else:
                    w = e[keep] / e.sum() if e.sum() != 0 else np.zeros(int(keep.sum()))
                beta = min(max(1.0 - w.sum(), 0.0), 1.0)  # semantics 4
                o = w @ vals[keep] if keep.any() else np.zeros(D)
                if vmc:
                    mu = vmean[b, g] if vmean is not None else vals.mean(axis=0)
                    # IEEE products, as the kernels compute them: beta 0 with an infinite mean
                    # (a non-finite V row in the sequence) gives NaN
                    with np.errstate(invalid="ignore"):
                        o = o + beta * mu
                out[b, h] = o
                kept_count[b, h] = int(keep.sum())
                dropped[b, h] = beta
                union |= keep
            v_rows[b, g] = int(union.sum())
    return OracleResult(out, kept_count, v_rows, dropped, nonfinite, margin)
