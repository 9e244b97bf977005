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
) -> OracleResult:
    """Float64 thresholded decode attention; arguments as :func:`topth_ops.decode_attention`.

    Returns
    -------
    OracleResult
    """
    q, k, v = _f64(query), _f64(key_cache), _f64(value_cache)
    th, table, vmean = _f64(thresholds), _f64(sdc_table), _f64(value_mean)
    lens = seq_lens.detach().cpu().numpy().astype(np.int64)
    B, Hq, D = q.shape
    Hkv, R = k.shape[1], th.shape[1]
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
        row = min(n, R) - 1
        union = [np.zeros(n, dtype=bool) for _ in range(Hkv)]
        for h in range(Hq):
            g = h // group
            keys, vals = k[b, g, :n], v[b, g, :n]
            theta = th[h, row]
            with np.errstate(invalid="ignore", over="ignore"):
                a = scale * (keys @ q[b, h])  # semantics 1
            if np.isnan(a).any() or np.isposinf(a).any():
                nonfinite[b, h] = True
                out[b, h] = np.nan
                continue
            m = a.max()
            if np.isneginf(m):  # every score -inf: no weight anywhere
                e = np.zeros(n)
                m = 0.0
            else:
                e = np.exp(a - m)
            if placement == "pre_softmax":
                keep = a > theta  # semantics 2, strict
                finite = np.isfinite(a)
                if finite.any() and np.isfinite(theta):
                    margin[b, h] = np.min(np.abs(a[finite] - theta))
                R_sum = e[keep].sum()
                if sdc == "none":
                    E = 0.0
                elif sdc == "exact":
                    E = e[~keep].sum()
                elif sdc == "exp_threshold":
                    n_drop = n - int(keep.sum())
                    E = sdc_gamma * n_drop * np.exp(theta - m) if n_drop > 0 else 0.0
                else:
                    E = table[h, row]
                w = e[keep] / (R_sum + E) if keep.any() else np.zeros(0)
            else:
                Z = e.sum()
                with np.errstate(divide="ignore", invalid="ignore"):
                    log_s = np.log(e) - np.log(Z)  # log s_j, exact enough in float64
                if np.isnan(theta):
                    keep = np.zeros(n, dtype=bool)
                elif theta <= 0:
                    keep = e > 0  # every finite score
                else:
                    keep = log_s > np.log(theta)
                    finite = np.isfinite(log_s)
                    if finite.any() and np.isfinite(theta):
                        margin[b, h] = np.min(np.abs(log_s[finite] - np.log(theta)))
                w = e[keep] / Z
            beta = min(max(1.0 - w.sum(), 0.0), 1.0)  # semantics 4
            o = w @ vals[keep] if keep.any() else np.zeros(D)
            if vmc:
                mu = vmean[b, g] if vmean is not None else vals.mean(axis=0)
                o = o + beta * mu
            out[b, h] = o
            kept_count[b, h] = int(keep.sum())
            dropped[b, h] = beta
            union[g] |= keep
        for g in range(Hkv):
            v_rows[b, g] = int(union[g].sum())
    return OracleResult(out, kept_count, v_rows, dropped, nonfinite, margin)
