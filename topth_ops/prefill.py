"""Thresholded attention over many query rows at once (prefill, teacher forcing).

Each query row is treated exactly like one decode step of :func:`topth_ops.decode_attention`
(docs/semantics.md; paper sections 3.1-3.2) with its own row id n = the number of keys it
may attend to: theta = thresholds[h, min(n, max_row_id) - 1], the same placement, SDC
and VMC formulas, and mu = the mean of the row's n valid V rows. Running a sequence token
by token through the decode op therefore gives the same outputs as one call here (this
is tested). It is the PyTorch reference form (float32 math), processed in chunks of rows
so that memory stays at ``O(max_chunk_elems)`` and never holds a whole attention matrix.

Besides Top-Theta (a thresholds table) it implements dense attention and exact top-k per
row (the paper's comparison): keep the k largest logits of each row with n > k; the
threshold is the row's (k+1)-th largest logit, compared with the same strict ``>``.

Differences from the decode op, on purpose: a V row that no head keeps is not zeroed
before the product (a NaN there would reach the output through 0 * NaN; decode zeroes
it), because per-row unions would cost a [rows, S, D] tensor. Real model activations are
finite, and rows with a NaN or +inf score still give NaN as in the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from .contract import DEFAULT_SDC_GAMMA, PLACEMENTS, SDC_MODES

RULE_KINDS = ("dense", "table", "topk")

#: Score values per row chunk (``rows = max(1, MAX_CHUNK_ELEMS // (B * num_q_heads * S))``).
MAX_CHUNK_ELEMS = 1 << 22


@dataclass(frozen=True)
class RowRule:
    """How every attention row is thresholded.

    Attributes
    ----------
    kind : {"dense", "table", "topk"}
        dense: keep every valid key. table: Top-Theta, theta from ``thresholds``.
        topk: keep the k largest logits of rows with n > k.
    placement : {"pre_softmax", "post_softmax"}
        For "table" the domain of the thresholds. For "topk" the kept set is the same;
        the placement only picks the weights (pre: softmax over the kept logits (+ SDC);
        post: the dense probabilities of the kept keys).
    sdc : {"none", "exact", "exp_threshold", "offline"}
        Softmax-denominator compensation, pre_softmax only ("offline": table only).
    sdc_gamma : float
    thresholds : torch.Tensor, optional
        ``[H, max_row_id]`` float32 (kind "table"), or ``[num_sets, H, max_row_id]``
        threshold sets picked per sequence by ``threshold_set`` of
        :func:`prefill_attention`; H = num_q_heads (selection "head") or num_kv_heads
        ("group").
    sdc_table : torch.Tensor, optional
        ``[num_q_heads, max_row_id]`` (or ``[num_sets, num_q_heads, max_row_id]``)
        float32 (sdc "offline"); per query head also with group selection.
    k : int
        Top-k size (kind "topk"), >= 1.
    vmc : bool
        V-mean compensation.
    selection : {"head", "group"}
        "group" (kind "table"): one threshold per KV head, compared with the maximum over
        the group's query heads of the logits (pre_softmax) or log-probabilities
        (post_softmax); every head of the group keeps that set (op contract v0.2).
    """

    kind: str
    placement: str = "post_softmax"
    sdc: str = "none"
    sdc_gamma: float = DEFAULT_SDC_GAMMA
    thresholds: Optional[torch.Tensor] = None
    sdc_table: Optional[torch.Tensor] = None
    k: int = 0
    vmc: bool = False
    selection: str = "head"

    def __post_init__(self):
        if self.kind not in RULE_KINDS:
            raise ValueError(f"kind must be one of {RULE_KINDS}, got {self.kind!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.sdc not in SDC_MODES:
            raise ValueError(f"sdc must be one of {SDC_MODES}, got {self.sdc!r}")
        if self.placement == "post_softmax" and self.sdc != "none":
            raise ValueError(f"sdc must be 'none' with post_softmax, got {self.sdc!r}")
        if self.kind == "table" and self.thresholds is None:
            raise ValueError("kind='table' needs thresholds [num_q_heads, max_row_id]")
        if self.sdc == "offline" and (self.kind != "table" or self.sdc_table is None):
            raise ValueError("sdc='offline' needs kind='table' and an sdc_table")
        if self.kind == "topk" and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"kind='topk' needs k >= 1, got {self.k!r}")
        if self.selection not in ("head", "group"):
            raise ValueError(f"selection must be 'head' or 'group', got {self.selection!r}")
        if self.selection == "group" and self.kind != "table":
            raise ValueError("selection='group' needs kind='table' (calibrated group thresholds)")
        if self.thresholds is not None and self.thresholds.dim() not in (2, 3):
            raise ValueError(f"thresholds must be 2-D [H, max_row_id] or 3-D [num_sets, H, max_row_id], "
                             f"got {list(self.thresholds.shape)}")
        if self.sdc_table is not None and self.thresholds is not None and \
                self.sdc_table.dim() != self.thresholds.dim():
            raise ValueError("sdc_table must have as many dimensions as thresholds (3-D with threshold sets)")


class RowStats(NamedTuple):
    """Per-row statistics, the decode op's :class:`~topth_ops.DecodeStats` for each row.

    kept ``[B, num_q_heads, T]`` int32, v_rows ``[B, num_kv_heads, T]`` int32 (union over
    the GQA group), dropped_mass ``[B, num_q_heads, T]`` float32 (beta).
    """

    kept: torch.Tensor
    v_rows: torch.Tensor
    dropped_mass: torch.Tensor


ScoreHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    row_ids: torch.Tensor,
    rule: RowRule,
    *,
    scale: float,
    key_valid: Optional[torch.Tensor] = None,
    return_stats: bool = False,
    score_hook: Optional[ScoreHook] = None,
    max_chunk_elems: int = MAX_CHUNK_ELEMS,
    threshold_set: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[RowStats]]:
    """Thresholded attention for T query rows against S keys (BNSD layout).

    Parameters
    ----------
    query : torch.Tensor
        ``[B, num_q_heads, T, head_dim]``, RoPE applied.
    key, value : torch.Tensor
        ``[B, num_kv_heads, S, head_dim]``. GQA: query head h uses KV head
        ``h // (num_q_heads // num_kv_heads)``.
    row_ids : torch.Tensor
        ``[B, T]`` int64: n, the number of valid keys of each row (0..S). Without
        ``key_valid`` the valid keys of a row are positions ``j < n`` (a causal prefix).
    rule : RowRule
    scale : float
        Softmax scale (logits a = scale * <q, k>).
    key_valid : torch.Tensor, optional
        ``[B, T, S]`` bool: the valid keys of each row when they are not a prefix
        (padding); ``row_ids`` must equal ``key_valid.sum(-1)``.
    return_stats : bool
        Also return :class:`RowStats`.
    score_hook : callable, optional
        Called per chunk as ``hook(scores, row_ids, m, log_z)`` with the logits
        ``[B, num_q_heads, C, S_c]`` (-inf at invalid keys), ``[B, C]`` row ids, and the
        row max / log-sum-exp ``[B, num_q_heads, C, 1]`` (calibration uses it).
    max_chunk_elems : int
        Upper bound on the elements of one chunk's score tensor.
    threshold_set : torch.Tensor, optional
        ``[B]`` int: the threshold set of each sequence; required iff ``rule.thresholds``
        is 3-D (values in [0, num_sets), ValueError otherwise).

    Returns
    -------
    out : torch.Tensor
        ``[B, num_q_heads, T, head_dim]`` in the query dtype.
    stats : RowStats or None
    """
    B, Hq, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    G = Hq // Hkv
    f32 = torch.float32
    dev = query.device
    n_all = row_ids.to(device=dev, dtype=torch.int64)
    if n_all.shape != (B, T):
        raise ValueError(f"row_ids must have shape [{B}, {T}], got {list(n_all.shape)}")
    tables = _per_sequence_tables(rule, threshold_set, B, dev)
    if T == 0:
        out = query.new_zeros((B, Hq, 0, D))
        return out, (RowStats(*(torch.zeros((B, h, 0), dtype=dt, device=dev) for h, dt in
                                ((Hq, torch.int32), (Hkv, torch.int32), (Hq, f32))))
                     if return_stats else None)
    k32, v32 = key.to(f32), value.to(f32)
    vcum = torch.cumsum(v32, dim=2) if (rule.vmc and key_valid is None) else None
    out = torch.empty((B, Hq, T, D), dtype=query.dtype, device=dev)
    if return_stats:
        st_kept = torch.empty((B, Hq, T), dtype=torch.int32, device=dev)
        st_vrows = torch.empty((B, Hkv, T), dtype=torch.int32, device=dev)
        st_beta = torch.empty((B, Hq, T), dtype=f32, device=dev)
    rows_per_chunk = max(1, max_chunk_elems // max(1, B * Hq * S))
    for r0 in range(0, T, rows_per_chunk):
        r1 = min(T, r0 + rows_per_chunk)
        C = r1 - r0
        n = n_all[:, r0:r1]  # [B, C]
        if key_valid is None:
            Sc = max(1, int(n.max()))  # keys beyond the longest row of the chunk are never valid
            pos = torch.arange(Sc, device=dev)
            valid = pos.view(1, 1, 1, Sc) < n.view(B, 1, C, 1)  # [B, 1, C, Sc]
        else:
            # only the key columns some row of the chunk may attend (a sliding window's band)
            any_valid = key_valid[:, r0:r1].any(1).any(0)
            cols = torch.nonzero(any_valid)
            k0, Sc = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, 1)
            valid = key_valid[:, r0:r1, k0:Sc].unsqueeze(1)
            Sc -= k0
        if key_valid is None:
            k0 = 0
        kc, vc = k32[:, :, k0:k0 + Sc], v32[:, :, k0:k0 + Sc]
        q = query[:, :, r0:r1].to(f32).reshape(B, Hkv, G * C, D)
        # Same operation order as the reference decode backend (bit-compatible results):
        # a = (q . k) * scale, -inf at invalid keys, m = row max, e = exp(a - m).
        a = torch.matmul(q, kc.transpose(-1, -2)).view(B, Hq, C, Sc)
        a.mul_(scale)
        a.masked_fill_(~valid, float("-inf"))
        m = a.amax(-1, keepdim=True)
        m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        t = a - m_safe  # exp(-inf) = 0 at invalid keys
        e = torch.exp(t)
        Z = e.sum(-1, keepdim=True)
        if score_hook is not None:
            score_hook(a, n, m_safe, torch.log(Z))
        n4 = n.view(B, 1, C, 1)
        if rule.kind == "dense":
            kept = valid.expand(B, Hq, C, Sc)
            w = e.div_(Z)
        else:
            if rule.kind == "table":
                theta = _lookup(tables[0], n)  # [B, H', C, 1]; H' = Hkv with group selection
            else:
                kk = min(rule.k + 1, Sc)
                kth = torch.topk(a, kk, dim=-1).values[..., kk - 1:kk]
                theta = torch.where(n4 > rule.k, kth, float("-inf"))
            # -inf at invalid keys is never > theta, so 'kept' needs no validity mask.
            if rule.placement == "pre_softmax" or rule.kind == "topk":
                x, x_theta = a, theta
            else:
                # log of s_j, compared in the log domain; -inf where a_j = -inf (also in a head
                # whose every score is -inf: Z = 0, where t - ln Z would be NaN in the group max)
                x = torch.where(a == float("-inf"), float("-inf"), t.sub_(torch.log(Z)))
                x_theta = torch.where(theta > 0, torch.log(theta), float("-inf"))
                x_theta = torch.where(torch.isnan(theta), theta, x_theta)
            if rule.selection == "group":
                # the group's maximum against the group's threshold; every head keeps that set
                kept_g = x.view(B, Hkv, G, C, Sc).amax(2) > x_theta  # [B, Hkv, C, Sc]
                kept = kept_g.unsqueeze(2).expand(B, Hkv, G, C, Sc).reshape(B, Hq, C, Sc)
                theta = theta.repeat_interleave(G, dim=1)  # theta_g for every head h of g
            else:
                kept = x > x_theta
            if rule.placement == "pre_softmax":
                if rule.sdc == "exact":
                    E = torch.where(kept, 0.0, e).sum(-1, keepdim=True)
                w = e.masked_fill_(~kept, 0.0)
                Rk = w.sum(-1, keepdim=True)
                if rule.sdc == "none":
                    E = torch.zeros_like(Rk)
                elif rule.sdc == "exp_threshold":
                    dropped = (n4 - kept.sum(-1, keepdim=True)).to(f32)
                    E = rule.sdc_gamma * dropped * torch.exp(theta - m_safe)
                    # 0 when nothing is dropped or gamma is 0 (never 0 x inf = NaN)
                    E = torch.where((dropped > 0) & (rule.sdc_gamma != 0), E, torch.zeros_like(E))
                elif rule.sdc == "offline":
                    E = _lookup(tables[1], n)
                denom = Rk + E
                # nothing kept and no compensation: w is all zero (never 0 / 0 = NaN)
                w.div_(torch.where(denom == 0, torch.ones_like(denom), denom))
            else:
                w = e.masked_fill_(~kept, 0.0).div_(torch.where(Z == 0, torch.ones_like(Z), Z))  # Z = 0: all -inf
        beta = (1.0 - w.sum(-1)).clamp(0.0, 1.0)  # [B, Hq, C]
        o = torch.matmul(w.reshape(B, Hkv, G * C, Sc), vc).view(B, Hq, C, D)
        if rule.vmc:
            if vcum is not None:
                idx = (n.clamp(min=1) - 1).view(B, 1, C, 1).expand(B, Hkv, C, D)
                mu = torch.gather(vcum, 2, idx) / n.clamp(min=1).to(f32).view(B, 1, C, 1)
            else:
                mu = torch.einsum("bcs,bksd->bkcd", valid[:, 0].to(f32), vc)
                mu = mu / n.clamp(min=1).to(f32).view(B, 1, C, 1)
            o = (o.view(B, Hkv, G, C, D) + beta.view(B, Hkv, G, C, 1) * mu.view(B, Hkv, 1, C, D))
            o = o.view(B, Hq, C, D)
        poisoned = torch.isnan(m) | (m == float("inf"))
        o = torch.where(poisoned, float("nan"), o)
        empty = (n == 0).view(B, 1, C)
        o = torch.where(empty.unsqueeze(-1), 0.0, o)
        out[:, :, r0:r1] = o.to(query.dtype)
        if return_stats:
            st_kept[:, :, r0:r1] = kept.sum(-1).to(torch.int32)
            st_vrows[:, :, r0:r1] = kept.reshape(B, Hkv, G, C, Sc).any(dim=2).sum(-1).to(torch.int32)
            st_beta[:, :, r0:r1] = torch.where(empty, 0.0, beta)
    stats = RowStats(st_kept, st_vrows, st_beta) if return_stats else None
    return out, stats


def _per_sequence_tables(rule: RowRule, threshold_set: Optional[torch.Tensor], B: int, dev):
    """(thresholds, sdc_table) as ``[B, H, max_row_id]`` per sequence (None when absent),
    picking each sequence's threshold set from 3-D tables."""
    if rule.kind != "table":
        if threshold_set is not None:
            raise ValueError("threshold_set needs kind='table' with 3-D thresholds")
        return None, None
    three = rule.thresholds.dim() == 3
    if three != (threshold_set is not None):
        raise ValueError("threshold_set [batch] is required with 3-D thresholds [num_sets, H, max_row_id] "
                         "and not allowed with 2-D thresholds")
    out = []
    for t in (rule.thresholds, rule.sdc_table):
        if t is None:
            out.append(None)
        elif three:
            idx = threshold_set.to(device=t.device, dtype=torch.int64).reshape(-1)
            if idx.numel() != B:
                raise ValueError(f"threshold_set must have {B} entries (one per sequence), got {idx.numel()}")
            if bool(((idx < 0) | (idx >= t.shape[0])).any()):
                raise ValueError(f"threshold_set values must lie in [0, {t.shape[0]}), got {idx.tolist()}")
            out.append(t.index_select(0, idx).to(dev))
        else:
            out.append(t.to(dev).unsqueeze(0).expand(B, *t.shape))
    return tuple(out)


def _lookup(table: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``table[b, h, min(n, R) - 1]`` for row ids ``n`` ``[B, C]``: ``[B, H, C, 1]``."""
    B, H, R = table.shape
    col = (n.clamp(min=1, max=R) - 1).view(B, 1, -1).expand(B, H, n.shape[1])
    return torch.gather(table, 2, col).unsqueeze(-1)


def kept_count_dense(row_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, num_heads, T]`` int32: the kept count of dense rows (= n)."""
    B, T = row_ids.shape
    return row_ids.to(torch.int32).view(B, 1, T).expand(B, num_heads, T)
