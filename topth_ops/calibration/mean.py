"""Threshold calibration (paper section 3.1, algorithm 1) in bounded memory.

For a target k, every calibration row of length n > k contributes one sample per
(layer, query head, row id n): the (k+1)-th largest value of the row, taken either from
the pre-softmax logits a or from the post-softmax probabilities s. That sample is the
lower-interpolated (n-k)/n quantile of the row, so a strict ``>`` against it keeps
exactly k elements (without ties). The calibrated threshold is

    theta[layer, head, n] = mean + alpha * std      (population std, ddof = 0)

over the samples with row id n. Rows with n <= k stay dense (theta = -inf). Row ids with
no sample take the value of the nearest calibrated row id (ties: the smaller one); row
ids beyond the largest calibrated one reuse the last value, which is what the op's
``min(n, max_row_id) - 1`` indexing does, so files end at the largest calibrated row id.

Memory is bounded: the accumulators keep, per (target k, placement, layer, head, row id),
a sample count, a running mean and a running sum of squared deviations (Welford / Chan
merge, float64), never attention matrices. Several targets k and both placements are
recorded from the same forward passes (one ``topk`` per row chunk), which is the
bounded-memory form of the paper's multi-k calibration (appendix D).

The offline SDC table (section 3.2.1) is a second pass over the calibration text,
:class:`topth_ops.calibration.sdc.SdcAccumulator`; the layer-k maps live in
:mod:`topth_ops.thresholds.layer_k`.

This module has no dependency on transformers: the model integration feeds it scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..contract import PLACEMENTS
from ..thresholds.layer_k import DENSE, LayerK
from ..thresholds.tables import dense_rows, fill_unsampled
from .rows import no_long_rows_error, row_log_z, to_host


class _Welford:
    """Per-slot count / mean / M2 in float64, merged batch-wise (Chan et al.)."""

    def __init__(self, shape: tuple[int, ...]):
        self.count = torch.zeros(shape, dtype=torch.int64)
        self.mean = torch.zeros(shape, dtype=torch.float64)
        self.m2 = torch.zeros(shape, dtype=torch.float64)

    def add(self, index: tuple[int, ...], slots: torch.Tensor, x: torch.Tensor) -> None:
        """Add samples ``x`` (1-D) at flat slot indices ``slots`` of ``self[index]``."""
        cnt, mean, m2 = self.count[index].view(-1), self.mean[index].view(-1), self.m2[index].view(-1)
        x = x.to(torch.float64)
        size = cnt.numel()
        n_b = torch.bincount(slots, minlength=size).to(torch.float64)
        sum_b = torch.zeros(size, dtype=torch.float64).index_add_(0, slots, x)
        mean_b = sum_b / n_b.clamp(min=1)
        m2_b = torch.zeros(size, dtype=torch.float64).index_add_(0, slots, (x - mean_b[slots]) ** 2)
        n_a = cnt.to(torch.float64)
        n = n_a + n_b
        n_safe = n.clamp(min=1)
        delta = mean_b - mean
        mean.add_(torch.where(n_b > 0, delta * n_b / n_safe, 0.0))
        m2.add_(torch.where(n_b > 0, m2_b + delta * delta * n_a * n_b / n_safe, 0.0))
        cnt.add_(n_b.to(torch.int64))


@dataclass
class CalibrationResult:
    """Calibrated thresholds of one target (one layer-k map, one placement).

    Attributes
    ----------
    thresholds : torch.Tensor
        ``[num_layers, num_q_heads, max_row_id]`` float32; column c is row id c + 1.
    counts : torch.Tensor
        ``[num_layers, num_q_heads, max_row_id]`` int64 samples per row id.
    layer_k : list of int
        k per layer (:data:`DENSE` = 0 for dense layers).
    placement : str
    alpha : float
    sdc_table : torch.Tensor or None
        ``[num_layers, num_q_heads, max_row_id]`` float32 (pre_softmax only, second pass).
    selection : {"head", "group"}
        With "group", thresholds are ``[num_layers, num_kv_heads, max_row_id]``.
    estimator : {"mean", "count"}
        Algorithm 1 (this module) or kept-count (:mod:`topth_ops.calibration.count`).
    length_model, sdc_length_model : topth_ops.thresholds.length_model.LengthModel or None
        Where the table continues beyond the calibrated row ids (``counts.shape[-1]``).
    """

    thresholds: torch.Tensor
    counts: torch.Tensor
    layer_k: LayerK
    placement: str
    alpha: Optional[float]
    sdc_table: Optional[torch.Tensor] = None
    selection: str = "head"
    estimator: str = "mean"
    length_model: Optional[object] = None
    sdc_length_model: Optional[object] = None


class ThresholdAccumulator:
    """Bounded-memory statistics for algorithm 1, for several targets at once.

    Parameters
    ----------
    num_layers, num_q_heads : int
        Model shape.
    max_row_id : int
        Largest row id (calibration row length) that can be recorded.
    targets : sequence of list of int
        One layer-k map per target (see :func:`parse_layer_k`).
    placements : sequence of str
        Value domains to record: ``"pre_softmax"`` (logits a) and/or ``"post_softmax"``
        (probabilities s).

    Notes
    -----
    Memory: 2 float64 + 1 int64 arrays of ``num_layers x num_q_heads x max_row_id`` per
    (target, placement), e.g. 30 x 9 x 2048 x 24 B = 13 MB.
    """

    def __init__(self, num_layers: int, num_q_heads: int, max_row_id: int,
                 targets: Sequence[LayerK], placements: Sequence[str] = PLACEMENTS):
        if max_row_id < 1:
            raise ValueError(f"max_row_id must be >= 1, got {max_row_id}")
        for p in placements:
            if p not in PLACEMENTS:
                raise ValueError(f"placement must be one of {PLACEMENTS}, got {p!r}")
        for t in targets:
            if len(t) != num_layers:
                raise ValueError(f"each layer-k map must have {num_layers} entries, got {len(t)}")
        self.num_layers, self.num_q_heads, self.max_row_id = num_layers, num_q_heads, max_row_id
        self.targets = [list(t) for t in targets]
        self.placements = tuple(placements)
        shape = (len(self.targets), num_layers, num_q_heads, max_row_id)
        self.stats = {p: _Welford(shape) for p in self.placements}

    def record(self, layer: int, scores: torch.Tensor, row_ids: torch.Tensor,
               m: Optional[torch.Tensor] = None, log_z: Optional[torch.Tensor] = None) -> None:
        """Record the calibration samples of a chunk of attention rows of one layer.

        Parameters
        ----------
        layer : int
        scores : torch.Tensor
            ``[B, num_q_heads, C, S]`` float32 pre-softmax logits a (scale applied),
            -inf at positions that are not valid keys of the row.
        row_ids : torch.Tensor
            ``[B, C]`` int64: n, the number of valid keys of each row (0 = padding row).
        m, log_z : torch.Tensor, optional
            ``[B, num_q_heads, C, 1]``: row max and log of sum exp(a - m); needed for the
            post_softmax domain, computed here when omitted.

        Raises
        ------
        ValueError
            A row id in ``row_ids`` exceeds ``max_row_id`` (the accumulator has no slot
            for it; size it with the longest calibration sample).
        """
        B, H, C, S = scores.shape
        ks = sorted({t[layer] for t in self.targets if t[layer] != DENSE})
        if not ks:
            return
        n = row_ids.detach().cpu().to(torch.int64)
        if int(n.max()) > self.max_row_id:
            raise ValueError(
                f"calibration row id {int(n.max())} exceeds the accumulator's max_row_id "
                f"{self.max_row_id}"
            )
        kk = min(max(ks) + 1, S)
        top = torch.topk(scores, kk, dim=-1).values  # [B, H, C, kk], descending
        if "post_softmax" in self.placements and (m is None or log_z is None):
            m, log_z = row_log_z(scores)
        top, m, log_z = to_host(top, m, log_z)  # only the kk largest values of a row leave its device
        heads = torch.arange(H).view(1, H, 1)
        for ti, t in enumerate(self.targets):
            k = t[layer]
            if k == DENSE:
                continue
            sel = (n > k) & (k < kk)  # [B, C]; n > k implies k + 1 <= n <= S
            if not bool(sel.any()):
                continue
            x_pre = top[..., k]  # [B, H, C]: the (k+1)-th largest logit
            sel3 = sel.unsqueeze(1).expand(B, H, C)
            slots = (heads * self.max_row_id + (n.unsqueeze(1) - 1)).expand(B, H, C)[sel3]
            for p in self.placements:
                if p == "pre_softmax":
                    x = x_pre[sel3]
                else:
                    x = torch.exp(x_pre - m[..., 0] - log_z[..., 0])[sel3]
                self.stats[p].add((ti, layer), slots, x)

    def result(self, target: int, placement: str, alpha: float) -> CalibrationResult:
        """Finalize one target: mean + alpha * std, fill unsampled row ids, dense rows.

        Parameters
        ----------
        target : int
            Index into ``targets``.
        placement : str
            A recorded placement.
        alpha : float
            Standard deviations added to the mean (paper: ``calib_add_sigma``).

        Returns
        -------
        CalibrationResult
            Arrays trimmed to the largest calibrated row id over all layers.

        Raises
        ------
        ValueError
            No calibration row was longer than k in some thresholded layer; alpha is not
            finite; or a negative alpha gives negative post_softmax thresholds.
        """
        if not math.isfinite(alpha):
            raise ValueError(f"alpha must be finite, got {alpha!r}")
        layer_k = self.targets[target]
        st = self.stats[placement]
        cnt = st.count[target].numpy()
        mean = st.mean[target].numpy()
        std = np.sqrt(np.maximum(st.m2[target].numpy() / np.maximum(cnt, 1), 0.0))
        for layer, k in enumerate(layer_k):
            if k != DENSE and cnt[layer].sum() == 0:
                raise no_long_rows_error(k, layer)
        sampled_any = np.flatnonzero(cnt.reshape(-1, cnt.shape[-1]).sum(0) > 0)
        R = int(sampled_any[-1]) + 1 if sampled_any.size else 1
        theta = (mean + alpha * std)[..., :R]
        if placement == "post_softmax" and alpha < 0 and bool((theta[cnt[..., :R] > 0] < 0).any()):
            raise ValueError(
                f"alpha={alpha} makes some post_softmax thresholds (probabilities) negative "
                f"(mean + alpha * std < 0); use a smaller |alpha| (--alpha), or alpha >= 0"
            )
        theta = fill_unsampled(theta, cnt[..., :R])
        theta = dense_rows(theta, layer_k, -np.inf)
        return CalibrationResult(
            thresholds=torch.from_numpy(theta.astype(np.float32)),
            counts=torch.from_numpy(cnt[..., :R].astype(np.int64)),
            layer_k=list(layer_k),
            placement=placement,
            alpha=float(alpha),
        )
