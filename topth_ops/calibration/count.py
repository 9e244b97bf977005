"""Kept-count calibration: thresholds whose mean kept count is k, per row-length bucket.

Algorithm 1 of the paper (section 3.1; :class:`topth_ops.calibration.ThresholdAccumulator`)
takes theta = mean + alpha * std of the per-row (k+1)-th largest values, which is not the
theta whose *expected kept count* is k: a row's count above theta, c(theta), is not linear
in theta and rows differ in level, so E[c(mean theta_row)] != k (Jensen). This module finds,
per (layer, head, row-length bucket b), the theta_b with

    (1 / R_b) * sum_{rows r in b} #{ j : x_rj > theta_b } = k

from a bounded-memory histogram of every value x_rj of the bucket's rows (``bins`` bins on
a per-(layer, head) range set by the first chunk a layer sees, with margins; values outside
are clamped into the end bins). The count above a bin edge is exact; inside a bin the values
are taken as uniform (linear interpolation). x is the logit a (pre_softmax) or the
log-probability a - LSE (post_softmax, compared in the log domain as the op does). With
``selection="group"`` x is the maximum over the GQA group's query heads, and k is the number
of V rows the group keeps (docs/semantics.md).

Buckets are geometric in the row id n (ratio ``2 ** (1 / buckets_per_octave)``) and every
target k is an edge, so a bucket above k holds only rows with n > k. Between bucket centres
(the mean log n of their rows) theta is interpolated linearly in log n, in the domain above;
below the first centre the first value is used. A fixed theta would keep ever more keys on
longer rows, so beyond the last centre theta follows a per-(layer, head) length model
(:class:`topth_ops.thresholds.LengthModel`),

    domain(theta)(n) = anchor_value + slope * (log(1 - k / n) - log(1 - k / anchor_n)),

anchored at the last bucket, its slope fitted by weighted least squares (weights: rows per
bucket) on the bucket centres of the last ``fit_octaves`` octaves (at least
``MIN_FIT_POINTS`` centres above 2k, else all above k). For n >> k the law levels off like
-k / n (the kept count at a fixed theta levels off, because far keys rarely pass it); for
rows just above k it falls like log log(n / k), so the steep rise of theta there is not
carried far beyond the samples. Measurements and the laws compared: docs/model.md,
"Rows 2-8 x beyond the calibration samples".
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..contract import PLACEMENTS, SELECTIONS
from ..thresholds.layer_k import DENSE, LayerK
from ..thresholds.length_model import (
    DEFAULT_FIT_OCTAVES,
    DOMAINS,
    THRESHOLD_FEATURE,
    LengthModel,
    fit_length_model,
    from_domain,
)
from .hist_fast import add_rows
from .mean import CalibrationResult
from .rows import no_long_rows_error, row_log_z, to_host

DEFAULT_BINS = 512
DEFAULT_BUCKETS_PER_OCTAVE = 4
DEFAULT_ROWS_PER_OCTAVE = 128
MAX_BINS = 1 << 20
LOG_PROB_FLOOR = -60.0  # log-probabilities below this are clamped (never near a threshold)


def bucket_edges(max_row_id: int, ks: Sequence[int], per_octave: int = DEFAULT_BUCKETS_PER_OCTAVE) -> np.ndarray:
    """Row-id bucket edges: geometric (ratio 2 ** (1 / per_octave), rounded to integers)
    from 1 to ``max_row_id``, with every k of ``ks`` added as an edge.

    Returns
    -------
    numpy.ndarray
        int64, strictly increasing, first 0, last >= max_row_id; bucket i is
        ``(edges[i], edges[i + 1]]``.
    """
    e = {0, int(max_row_id)}
    x = 1.0
    while x < max_row_id:
        e.add(int(round(x)))
        x *= 2.0 ** (1.0 / per_octave)
    e.update(int(k) for k in ks if 0 < k < max_row_id)
    return np.array(sorted(e), dtype=np.int64)


class CountAccumulator:
    """Bounded-memory histograms for kept-count calibration, several k at once.

    Parameters
    ----------
    num_layers, num_q_heads, num_kv_heads : int
        Model shape (GQA: query head h belongs to group h // (num_q_heads / num_kv_heads)).
    max_row_id : int
        Longest calibration row.
    ks : sequence of int
        Every k (of any layer of any target) that will be calibrated: each is a bucket
        edge, so a bucket above k holds only rows with n > k.
    placements : sequence of str
        "pre_softmax" (histograms of logits) and/or "post_softmax" (log-probabilities).
    selections : sequence of str
        "head" (per query head) and/or "group" (group maximum, per KV head).
    bins : int
        Histogram bins per (layer, head, bucket), 8 to ``MAX_BINS`` (bin indices are
        computed in float32).
    buckets_per_octave : int
    rows_per_octave : int
        Rows recorded per octave of row ids and sequence (a power of two; 0 = every row);
        see :meth:`record`.

    Notes
    -----
    Memory: int64 ``num_layers x H x buckets x bins`` per (placement, selection), e.g.
    30 layers x 9 heads x ~40 buckets (1024 row ids) x 512 bins x 8 B = 44 MB.
    """

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, max_row_id: int,
                 ks: Sequence[int], placements: Sequence[str] = PLACEMENTS,
                 selections: Sequence[str] = ("head",), bins: int = DEFAULT_BINS,
                 buckets_per_octave: int = DEFAULT_BUCKETS_PER_OCTAVE,
                 rows_per_octave: int = DEFAULT_ROWS_PER_OCTAVE):
        if max_row_id < 1:
            raise ValueError(f"max_row_id must be >= 1, got {max_row_id}")
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        for p in placements:
            if p not in PLACEMENTS:
                raise ValueError(f"placement must be one of {PLACEMENTS}, got {p!r}")
        for s in selections:
            if s not in SELECTIONS:
                raise ValueError(f"selection must be one of {SELECTIONS}, got {s!r}")
        if not 8 <= bins <= MAX_BINS:
            raise ValueError(f"bins must be in [8, {MAX_BINS}], got {bins}")
        self.L, self.Hq, self.Hkv, self.max_row_id = num_layers, num_q_heads, num_kv_heads, max_row_id
        self.placements, self.selections = tuple(placements), tuple(selections)
        self.bins = bins
        if rows_per_octave > 0 and rows_per_octave & (rows_per_octave - 1):
            raise ValueError(f"rows_per_octave must be 0 or a power of two, got {rows_per_octave}")
        self.rows_per_octave = int(rows_per_octave)
        self._log2_rpo = int(rows_per_octave).bit_length() - 1 if rows_per_octave > 0 else 0
        self.min_k = max(1, min(ks)) if len(ks) else 1
        self.edges = bucket_edges(max_row_id, ks, buckets_per_octave)
        self.NB = len(self.edges) - 1
        self._edges_t = torch.from_numpy(self.edges)
        self.hist: dict = {}
        self.range: dict = {}  # (placement, selection) -> [L, H, 2] float64 (lo, width), NaN until set
        for p in self.placements:
            for s in self.selections:
                H = self.heads(s)
                self.hist[(p, s)] = torch.zeros((num_layers, H, self.NB, bins), dtype=torch.int64)
                self.range[(p, s)] = torch.full((num_layers, H, 2), float("nan"), dtype=torch.float64)
        self.rows = torch.zeros((num_layers, self.NB), dtype=torch.int64)
        self.log_n = torch.zeros((num_layers, self.NB), dtype=torch.float64)  # sum of log n per bucket
        self.rows_per_id = torch.zeros((num_layers, max_row_id + 1), dtype=torch.int64)

    def heads(self, selection: str) -> int:
        return self.Hq if selection == "head" else self.Hkv

    def record(self, layer: int, scores: torch.Tensor, row_ids: torch.Tensor,
               m: Optional[torch.Tensor] = None, log_z: Optional[torch.Tensor] = None) -> None:
        """Add the rows of one chunk of one layer.

        Parameters
        ----------
        layer : int
        scores : torch.Tensor
            ``[B, num_q_heads, C, S]`` float32 logits a (scale applied), -inf at keys that
            are not valid for the row.
        row_ids : torch.Tensor
            ``[B, C]`` int64 n per row (0 = padding).
        m, log_z : torch.Tensor, optional
            ``[B, num_q_heads, C, 1]`` row max and log sum exp(a - m) (post_softmax),
            computed here when omitted.

        Notes
        -----
        Rows are thinned deterministically above ``rows_per_octave`` row ids: a row is
        recorded when n is a multiple of ``2 ** max(0, floor(log2 n) - log2(rows_per_octave))``,
        so each octave of row ids contributes ``rows_per_octave`` rows per sequence (all
        rows below). The cost of a row grows with n, so this bounds the cost per sequence
        at ~``rows_per_octave * max n`` values per head instead of ``max n ** 2 / 2``.

        Raises
        ------
        ValueError
            A row id exceeds ``max_row_id``.
        """
        B, H, C, S = scores.shape
        n = row_ids.detach().cpu().to(torch.int64)
        if int(n.max()) > self.max_row_id:
            raise ValueError(f"calibration row id {int(n.max())} exceeds the accumulator's max_row_id "
                             f"{self.max_row_id}")
        keep = (n > self.min_k) & (n % self.row_stride(n) == 0)  # rows n <= every k are dense
        if not bool(keep.any()):
            return
        bi, ci = keep.nonzero(as_tuple=True)
        nl = n[bi, ci]
        dev_b, dev_c = bi.to(scores.device), ci.to(scores.device)  # only the recorded rows leave the device
        b_idx = (torch.bucketize(nl, self._edges_t, right=False) - 1).clamp(0, self.NB - 1)
        self.rows[layer].index_add_(0, b_idx, torch.ones_like(nl))
        self.log_n[layer].index_add_(0, b_idx, torch.log(nl.to(torch.float64)))
        self.rows_per_id[layer].index_add_(0, nl, torch.ones_like(nl))
        x_all, = to_host(scores[dev_b, :, dev_c, :])  # [R, H, S]
        if "post_softmax" in self.placements:
            if m is None or log_z is None:
                m_row, log_z_row = row_log_z(x_all)
                lse = m_row + log_z_row
            else:
                lse, = to_host((m + log_z)[dev_b, :, dev_c, :])
        G = self.Hq // self.Hkv
        R = x_all.shape[0]
        # every set in one compiled pass (hist_fast) once the layer's ranges are set
        if add_rows(self, layer, x_all, lse if "post_softmax" in self.placements else None, b_idx):
            return
        for p in self.placements:
            x = x_all if p == "pre_softmax" else x_all - lse
            for s in self.selections:
                xs = x if s == "head" else x.view(R, self.Hkv, G, S).amax(2)
                self._add(p, s, layer, xs, b_idx)

    def row_stride(self, n: torch.Tensor) -> torch.Tensor:
        """Recording stride of rows with row id n (see :meth:`record`)."""
        if self.rows_per_octave <= 0:
            return torch.ones_like(n)
        e = torch.floor(torch.log2(n.clamp(min=1).to(torch.float64))).to(torch.int64) - self._log2_rpo
        return torch.pow(2, e.clamp(min=0))

    def _add(self, p: str, s: str, layer: int, x: torch.Tensor, b_idx: torch.Tensor) -> None:
        R, H, S = x.shape
        rng = self.range[(p, s)][layer]
        if bool(torch.isnan(rng[:, 0]).any()):
            self._set_range(p, rng, x)
        lo = rng[:, 0].to(torch.float32).view(1, H, 1)
        inv_w = (1.0 / rng[:, 1]).to(torch.float32).view(1, H, 1)
        # count into the buckets these rows touch only (a chunk or a decode row covers few)
        used, b_local = torch.unique(b_idx, return_inverse=True)
        U = used.numel()
        size = H * U * self.bins
        idx = (x - lo).mul_(inv_w).floor_().clamp_(0, self.bins - 1).to(torch.int64)
        slot = (torch.arange(H).view(1, H, 1) * U + b_local.view(R, 1, 1)) * self.bins
        flat = torch.where(torch.isfinite(x), idx.add_(slot), size)  # invalid keys -> a dump slot
        counts = torch.bincount(flat.view(-1), minlength=size + 1)[:size].view(H, U, self.bins)
        self.hist[(p, s)][layer][:, used] += counts

    def _set_range(self, p: str, rng: torch.Tensor, x: torch.Tensor) -> None:
        """Per-head histogram range from the first rows a layer sees: their finite values'
        span with half a span of margin each side (log-probabilities: at most 0, at
        least LOG_PROB_FLOOR)."""
        fin = torch.isfinite(x)
        big = torch.finfo(torch.float32).max
        lo = torch.where(fin, x, big).amin(dim=(0, 2)).to(torch.float64)
        hi = torch.where(fin, x, -big).amax(dim=(0, 2)).to(torch.float64)
        none = lo > hi
        lo, hi = torch.where(none, -1.0, lo), torch.where(none, 1.0, hi)
        # at least 1e-3, and wide enough that the float32 range edges differ (huge logits)
        span = torch.maximum((hi - lo).clamp(min=1e-3), 1e-5 * torch.maximum(lo.abs(), hi.abs()))
        lo, hi = lo - 0.5 * span, hi + 0.5 * span
        if p == "post_softmax":
            lo, hi = lo.clamp(min=LOG_PROB_FLOOR), hi.clamp(max=0.0)
            hi = torch.maximum(hi, lo + 1e-3)
        rng[:, 0] = lo
        rng[:, 1] = (hi - lo) / self.bins

    # ------------------------------------------------------------------ finalize

    def bucket_thetas(self, placement: str, selection: str, layer: int, k: int) -> tuple:
        """Per-bucket solutions of one layer for target k.

        Returns
        -------
        (centres, values, rows, usable) : numpy arrays over buckets
            Centre row id exp(mean log n), domain value of theta (NaN where unusable),
            rows per bucket, and whether the bucket holds only rows n > k with rows > 0.
        """
        hist = self.hist[(placement, selection)][layer].numpy()  # [H, NB, bins]
        rng = self.range[(placement, selection)][layer].numpy()
        rows = self.rows[layer].numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            centres = np.exp(self.log_n[layer].numpy() / rows)
        usable = (self.edges[:-1] >= k) & (rows > 0)
        H = hist.shape[0]
        vals = np.full((H, self.NB), np.nan)
        ub = np.flatnonzero(usable)
        if not ub.size:
            return centres, vals, rows, usable
        h_u = hist[:, ub]  # [H, U, bins]
        # above[h, u, i] = values >= edge i (edge i = lo + i * width), i = 0..bins
        above = np.concatenate([np.cumsum(h_u[..., ::-1], axis=-1)[..., ::-1],
                                np.zeros(h_u.shape[:-1] + (1,), dtype=h_u.dtype)], axis=-1)
        target = (k * rows[ub]).astype(np.float64)[None, :]  # [1, U]
        # largest edge index i with above[i] >= target (above is non-increasing along i)
        i = (above >= target[..., None]).sum(-1) - 1  # [H, U]
        ic = np.clip(i, 0, self.bins - 1)
        inside = np.take_along_axis(h_u, ic[..., None], -1)[..., 0].astype(np.float64)
        nxt = np.take_along_axis(above, (ic + 1)[..., None], -1)[..., 0]
        frac = np.divide(target - nxt, inside, out=np.zeros_like(inside), where=inside > 0)
        lo, w = rng[:, :1], rng[:, 1:]
        v = lo + (i + 1 - frac) * w
        v = np.where(i < 0, lo, v)  # fewer than k values per row even at the lowest edge
        vals[:, ub] = np.where(i >= self.bins, lo + self.bins * w, v)
        return centres, vals, rows, usable

    def result(self, placement: str, selection: str, layer_k: LayerK, extend_to: Optional[int] = None,
               fit_octaves: float = DEFAULT_FIT_OCTAVES) -> tuple[np.ndarray, np.ndarray, LengthModel]:
        """Thresholds of one target.

        Parameters
        ----------
        placement, selection : str
        layer_k : list of int
            k per layer (:data:`~topth_ops.thresholds.DENSE` = dense layer).
        extend_to : int, optional
            Table length (row ids); default the longest calibration row. Row ids beyond
            the last bucket centre follow the length model.
        fit_octaves : float

        Returns
        -------
        thresholds : numpy.ndarray
            ``[num_layers, H, extend_to]`` float64; -inf for n <= k and dense layers.
        counts : numpy.ndarray
            ``[num_layers, H, max_row_id]`` int64: calibration rows behind each row id
            (rows of that row id, the same for every head; 0 for n <= k).
        model : LengthModel

        Raises
        ------
        ValueError
            A thresholded layer has no calibration row longer than its k.
        """
        R = int(extend_to or self.max_row_id)
        domain = DOMAINS[placement]
        H = self.heads(selection)
        theta = np.full((self.L, H, R), -np.inf)
        counts = np.zeros((self.L, H, self.max_row_id), dtype=np.int64)
        anc_n = np.full((self.L, H), np.nan)
        anc_v = np.full((self.L, H), np.nan)
        slope = np.zeros((self.L, H))
        n_all = np.arange(1, R + 1, dtype=np.float64)
        for layer, k in enumerate(layer_k):
            if k == DENSE:
                continue
            centres, vals, rows, usable = self.bucket_thetas(placement, selection, layer, k)
            if not usable.any():
                raise no_long_rows_error(k, layer)
            c = centres[usable]
            per_id = self.rows_per_id[layer].numpy()[1:]
            counts[layer, :, k:] = per_id[k:]
            for h in range(H):
                v = vals[h, usable]
                an, av, sl = fit_length_model(c, v, rows[usable], k, domain, fit_octaves)
                anc_n[layer, h], anc_v[layer, h], slope[layer, h] = an, av, sl
                ok = np.isfinite(v)
                xs, ys = np.log(c[ok]), v[ok]
                nn = n_all[k:]
                inside = np.interp(np.log(nn), xs, ys)  # clamps below the first centre
                theta[layer, h, k:] = from_domain(inside, domain)  # beyond the anchor: replaced below
        model = LengthModel(domain, anc_n, anc_v, slope, THRESHOLD_FEATURE, np.array(layer_k, dtype=np.int64))
        # beyond the anchors the table is exactly the model (what loading re-creates)
        n_beyond = np.arange(1, R + 1, dtype=np.float64)
        m = model.theta(n_beyond)
        beyond_mask = n_beyond[None, None, :] > np.nan_to_num(anc_n, nan=np.inf)[..., None]
        theta = np.where(beyond_mask, m, theta)
        return theta, counts, model

    def results(self, targets: Sequence[LayerK], extend_to: Optional[int] = None,
                calibrated_rows: Optional[int] = None) -> dict:
        """Thresholds of every target, placement and selection recorded.

        Parameters
        ----------
        targets : sequence of list of int
            Layer-k maps (one per target k).
        extend_to : int, optional
            Table length (see :meth:`result`).
        calibrated_rows : int, optional
            Keep the per-row-id counts up to this row id (the longest row recorded, when
            the accumulator was sized for longer rows, e.g. an engine's context length):
            a file's calibrated row ids are its counts' length.

        Returns
        -------
        dict
            ``{(target index, placement, selection): CalibrationResult}``.

        Raises
        ------
        ValueError
            As :meth:`result`.
        """
        out = {}
        for i, layer_k in enumerate(targets):
            for p in self.placements:
                for sel in self.selections:
                    th, counts, lm = self.result(p, sel, layer_k, extend_to=extend_to)
                    if calibrated_rows is not None:
                        counts = counts[..., :calibrated_rows]
                    out[(i, p, sel)] = CalibrationResult(
                        thresholds=torch.from_numpy(th.astype("float32")), counts=torch.from_numpy(counts),
                        layer_k=list(layer_k), placement=p, alpha=None, selection=sel, estimator="count",
                        length_model=lm)
        return out
