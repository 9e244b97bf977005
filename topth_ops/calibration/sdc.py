"""Offline SDC table: second calibration pass (paper section 3.2.1).

The offline SDC table (section 3.2.1) needs the final thresholds, so it is a second pass
over the calibration text: :class:`SdcAccumulator` records, per row, the dropped
exponent mass E = sum_{a_j <= theta} exp(a_j - m) at the calibrated theta and keeps its
mean per (layer, head, row id). A single-pass estimate would have to use thresholds that
are still moving (the paper's reference code does that); the second pass costs one more
forward pass per sample and gives the exact mean at the final theta.

This module has no dependency on transformers: the model integration feeds it scores.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..thresholds.layer_k import DENSE
from ..thresholds.length_model import constant_table_model
from ..thresholds.tables import dense_rows, fill_unsampled
from .mean import CalibrationResult
from .rows import row_max, to_host


class SdcAccumulator:
    """Second calibration pass: mean dropped exponent mass at the calibrated thresholds.

    Parameters
    ----------
    results : sequence of CalibrationResult
        pre_softmax results whose offline SDC table is wanted (per-head or group
        selection).
    num_q_heads : int, optional
        Query heads of the model (default: the heads of the first per-head result; needed
        when every result has group selection).

    Notes
    -----
    For each row with n > k and each query head h: E = sum over valid j that are not kept
    of exp(a_hj - m_h), m_h = max over valid j (the E~ of the ``offline`` sdc mode, paper
    section 3.2.1). Kept is ``a_hj > theta_h`` (per head) or ``max_{h' in g} a_h'j >
    theta_g`` (group g of h, op contract v0.2); the table stays per query head. It holds
    the mean of E per (layer, head, row id) over the calibrated row ids
    (``counts.shape[-1]``); rows n <= k hold 0; unsampled row ids take the nearest
    sampled one. When a result has a length model (its table extends beyond the
    calibrated row ids), the SDC table is continued too: its mean over the last calibrated
    octave, held constant (:func:`topth_ops.thresholds.length_model.constant_table_model`).
    """

    def __init__(self, results: Sequence[CalibrationResult], num_q_heads: Optional[int] = None):
        for r in results:
            if r.placement != "pre_softmax":
                raise ValueError("the offline SDC table applies to pre_softmax thresholds only")
        if num_q_heads is None:
            heads = [r.thresholds.shape[1] for r in results if r.selection == "head"]
            if not heads:
                raise ValueError("num_q_heads is needed when every result has group selection")
            num_q_heads = heads[0]
        self.Hq = num_q_heads
        self.results = list(results)
        shapes = [(r.thresholds.shape[0], num_q_heads, r.counts.shape[-1]) for r in results]
        self.sums = [torch.zeros(sh, dtype=torch.float64) for sh in shapes]
        self.counts = [torch.zeros(sh, dtype=torch.int64) for sh in shapes]

    def record(self, layer: int, scores: torch.Tensor, row_ids: torch.Tensor) -> None:
        """Record one chunk of rows: add each row's dropped exponent mass E at its layer's
        calibrated thresholds (paper section 3.2.1).

        Parameters
        ----------
        layer : int
            Attention layer of the chunk; layers that are dense in a result are skipped.
        scores : torch.Tensor
            ``[B, num_q_heads, C, S]`` float32 pre-softmax logits a (scale applied),
            -inf at positions that are not valid keys of the row.
        row_ids : torch.Tensor
            ``[B, C]`` int64: n, the number of valid keys of each row (0 = padding row).
            Rows with n <= k add nothing; rows beyond a result's calibrated row ids are
            skipped for that result.
        """
        scores, row_ids = to_host(scores, row_ids)
        B, H, C, S = scores.shape
        n = row_ids.to(torch.int64)
        valid = scores != float("-inf")  # -inf marks positions that are not valid keys
        m = row_max(scores)
        e = torch.where(valid, torch.exp(scores - m), 0.0)
        heads = torch.arange(H).view(1, H, 1)
        gmax = None
        for r, sums, counts in zip(self.results, self.sums, self.counts):
            k = r.layer_k[layer]
            if k == DENSE:
                continue
            R, Rc = r.thresholds.shape[-1], counts.shape[-1]
            sel = n > k
            if not bool(sel.any()):
                continue
            col = (n.clamp(min=1, max=R) - 1)  # [B, C]
            theta = r.thresholds[layer][:, col].permute(1, 0, 2).unsqueeze(-1)  # [B, H', C, 1]
            if r.selection == "group":
                Hkv = theta.shape[1]
                if gmax is None:
                    gmax = scores.view(B, Hkv, H // Hkv, C, S).amax(2)
                kept = (gmax > theta).unsqueeze(2).expand(B, Hkv, H // Hkv, C, S).reshape(B, H, C, S)
            else:
                kept = scores > theta
            dropped = valid & ~kept
            E = (e * dropped).sum(-1)  # [B, H, C]
            sel3 = sel.unsqueeze(1).expand(B, H, C)
            own = (n <= Rc).unsqueeze(1).expand(B, H, C)
            keep = sel3 & own
            slots = (heads * Rc + col.clamp(max=Rc - 1).unsqueeze(1)).expand(B, H, C)[keep]
            sums[layer].view(-1).index_add_(0, slots, E[keep].to(torch.float64))
            counts[layer].view(-1).index_add_(0, slots, torch.ones_like(slots))

    def finalize(self) -> list[CalibrationResult]:
        """Attach ``sdc_table`` (and, with a length model, ``sdc_length_model``) to each
        result and return them."""
        for r, sums, counts in zip(self.results, self.sums, self.counts):
            cnt = counts.numpy()
            mean = sums.numpy() / np.maximum(cnt, 1)
            table = fill_unsampled(mean, cnt)
            table = dense_rows(table, r.layer_k, 0.0).astype(np.float32)
            R, Rc = r.thresholds.shape[-1], table.shape[-1]
            if R > Rc:
                model = constant_table_model(table.astype(np.float64), cnt, r.layer_k)
                ext = model.theta(np.arange(Rc + 1, R + 1, dtype=np.float64)).astype(np.float32)
                table = np.concatenate([table, np.where(np.isinf(ext), 0.0, ext).astype(np.float32)], axis=-1)
                r.sdc_length_model = model
            r.sdc_table = torch.from_numpy(table)
        return self.results
