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

The offline SDC table (section 3.2.1) needs the final thresholds, so it is a second pass
over the calibration text: :class:`SdcAccumulator` records, per row, the dropped
exponent mass E = sum_{a_j <= theta} exp(a_j - m) at the calibrated theta and keeps its
mean per (layer, head, row id). A single-pass estimate would have to use thresholds that
are still moving (the paper's reference code does that); the second pass costs one more
forward pass per sample and gives the exact mean at the final theta.

This module has no dependency on transformers: the model integration feeds it scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

PLACEMENTS = ("pre_softmax", "post_softmax")
DENSE = 0  # layer k value meaning "not thresholded" (every row dense)

LayerK = list[int]  # k per layer; DENSE (0) keeps the layer dense


def parse_layer_k(spec: Optional[str], k: int, num_layers: int) -> LayerK:
    """Build the per-layer k map from a default k and an override string.

    Parameters
    ----------
    spec : str or None
        Comma-separated ``layer:value`` pairs, e.g. ``"0:256,1:256"`` or
        ``"0:dense,1:dense"``; value ``dense`` (or 0) keeps that layer dense. Negative
        layer indices count from the end. None or "" means no override.
    k : int
        The k of every layer not named in ``spec``; must be >= 1.
    num_layers : int
        Number of attention layers of the model.

    Returns
    -------
    list of int
        ``num_layers`` values; :data:`DENSE` (0) marks a dense layer.

    Raises
    ------
    ValueError
        k < 1, a malformed pair, a layer index out of range, a value < 0, or a layer
        named twice (also as ``-1`` and ``num_layers - 1``).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    out = [k] * num_layers
    seen: dict[int, str] = {}
    for layer, val, part in layer_k_overrides(spec):
        if not -num_layers <= layer < num_layers:
            raise ValueError(f"--layer-k layer must lie in [0, {num_layers - 1}], got {layer} in {part!r}")
        idx = layer % num_layers
        if idx in seen:
            raise ValueError(f"--layer-k names layer {idx} twice ({seen[idx]!r} and {part!r})")
        seen[idx] = part
        out[idx] = val
    return out


def base_k(layer_k: Sequence[int]) -> int:
    """The k of a layer-k map: its most common non-dense value (the others are
    ``--layer-k`` overrides); 0 when every layer is dense."""
    ks = [k for k in layer_k if k != DENSE]
    return max(set(ks), key=ks.count) if ks else 0


def layer_k_overrides(spec: Optional[str]) -> list[tuple[int, int, str]]:
    """Parse the syntax of a ``--layer-k`` string without knowing the model.

    Parameters
    ----------
    spec : str or None
        See :func:`parse_layer_k`.

    Returns
    -------
    list of (layer, value, text)
        Layer index as written (may be negative), k value (:data:`DENSE` for "dense" or
        0) and the entry's text, in order.

    Raises
    ------
    ValueError
        A malformed pair, a non-integer layer or value, a value < 0, or a layer index
        written twice.
    """
    out: list[tuple[int, int, str]] = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        if ":" not in part:
            raise ValueError(f"--layer-k entries must look like LAYER:K or LAYER:dense, got {part!r}")
        layer_s, val_s = (x.strip() for x in part.split(":", 1))
        try:
            layer = int(layer_s)
        except ValueError:
            raise ValueError(f"--layer-k layer must be an integer, got {layer_s!r} in {part!r}") from None
        if val_s.lower() == "dense":
            val = DENSE
        else:
            try:
                val = int(val_s)
            except ValueError:
                raise ValueError(
                    f"--layer-k value must be an integer >= 1, or 0 / 'dense', got {val_s!r} in {part!r}"
                ) from None
            if val < 0:
                raise ValueError(f"--layer-k value must be >= 1, or 0 / 'dense', got {val} in {part!r}")
        if any(layer == prev for prev, _, _ in out):
            raise ValueError(f"--layer-k names layer {layer} twice in {spec!r}")
        out.append((layer, val, part))
    return out


def format_layer_k(layer_k: Sequence[int]) -> str:
    """Compact text form of a layer-k map, e.g. ``"0-1:dense, 2-29:16"``."""
    parts, start = [], 0
    for i in range(1, len(layer_k) + 1):
        if i == len(layer_k) or layer_k[i] != layer_k[start]:
            val = "dense" if layer_k[start] == DENSE else str(layer_k[start])
            rng = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            parts.append(f"{rng}:{val}")
            start = i
    return ", ".join(parts)


def fill_unsampled(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Fill row ids without samples from the nearest sampled row id.

    Parameters
    ----------
    values : numpy.ndarray
        ``[..., R]``, column c holds row id c + 1.
    counts : numpy.ndarray
        ``[..., R]`` sample counts (integers); 0 marks an unsampled row id.

    Returns
    -------
    numpy.ndarray
        Copy of ``values`` where every unsampled column takes the value of the nearest
        sampled column of the same leading index (ties: the smaller row id; before the
        first sampled row id the first, after the last the last). Vectors with no sample
        at all are returned unchanged.
    """
    out = np.array(values, copy=True)
    R = out.shape[-1]
    flat_v = out.reshape(-1, R)
    flat_c = np.asarray(counts).reshape(-1, R)
    cols = np.arange(R)
    for i in range(flat_v.shape[0]):
        sampled = np.flatnonzero(flat_c[i] > 0)
        if sampled.size == 0 or sampled.size == R:
            continue
        right = np.searchsorted(sampled, cols, side="left")  # first sampled >= col
        right_c = np.clip(right, 0, sampled.size - 1)
        left_c = np.clip(right - 1, 0, sampled.size - 1)
        r_pos, l_pos = sampled[right_c], sampled[left_c]
        d_right = np.where(r_pos >= cols, r_pos - cols, np.iinfo(np.int64).max)
        d_left = np.where(l_pos <= cols, cols - l_pos, np.iinfo(np.int64).max)
        src = np.where(d_left <= d_right, l_pos, r_pos)  # ties -> the smaller row id
        flat_v[i] = flat_v[i][src]
    return out


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
        Algorithm 1 (this module) or kept-count (:mod:`topth_ops.calib_count`).
    length_model, sdc_length_model : topth_ops.calib_count.LengthModel or None
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
        n = row_ids.to(torch.int64)
        if int(n.max()) > self.max_row_id:
            raise ValueError(
                f"calibration row id {int(n.max())} exceeds the accumulator's max_row_id "
                f"{self.max_row_id}"
            )
        kk = min(max(ks) + 1, S)
        top = torch.topk(scores, kk, dim=-1).values  # [B, H, C, kk], descending
        if "post_softmax" in self.placements and (m is None or log_z is None):
            m = scores.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            log_z = torch.log(torch.exp(scores - m).sum(-1, keepdim=True))
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
                raise ValueError(
                    f"no calibration row longer than k={k} in layer {layer} (k per layer comes "
                    f"from k and the --layer-k overrides): use longer calibration samples, a "
                    f"smaller k, or another --layer-k (e.g. {layer}:dense)"
                )
        sampled_any = np.flatnonzero(cnt.reshape(-1, cnt.shape[-1]).sum(0) > 0)
        R = int(sampled_any[-1]) + 1 if sampled_any.size else 1
        theta = (mean + alpha * std)[..., :R]
        if placement == "post_softmax" and alpha < 0 and bool((theta[cnt[..., :R] > 0] < 0).any()):
            raise ValueError(
                f"alpha={alpha} makes some post_softmax thresholds (probabilities) negative "
                f"(mean + alpha * std < 0); use a smaller |alpha| (--alpha), or alpha >= 0"
            )
        theta = fill_unsampled(theta, cnt[..., :R])
        theta = _dense_rows(theta, layer_k, -np.inf)
        return CalibrationResult(
            thresholds=torch.from_numpy(theta.astype(np.float32)),
            counts=torch.from_numpy(cnt[..., :R].astype(np.int64)),
            layer_k=list(layer_k),
            placement=placement,
            alpha=float(alpha),
        )


def _dense_rows(values: np.ndarray, layer_k: Sequence[int], fill: float) -> np.ndarray:
    """Set columns of row ids n <= k (and whole dense layers) to ``fill``."""
    out = np.array(values, copy=True)
    R = out.shape[-1]
    for layer, k in enumerate(layer_k):
        if k == DENSE:
            out[layer] = fill
        else:
            out[layer, :, : min(k, R)] = fill
    return out


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
    calibrated row ids), the SDC table gets one too (:func:`topth_ops.calib_count.
    fit_table_model`, log domain) and is extended the same way.
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
        B, H, C, S = scores.shape
        n = row_ids.to(torch.int64)
        valid = scores != float("-inf")  # -inf marks positions that are not valid keys
        m = scores.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
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
        from .calib_count import fit_table_model

        for r, sums, counts in zip(self.results, self.sums, self.counts):
            cnt = counts.numpy()
            mean = sums.numpy() / np.maximum(cnt, 1)
            table = fill_unsampled(mean, cnt)
            table = _dense_rows(table, r.layer_k, 0.0).astype(np.float32)
            R, Rc = r.thresholds.shape[-1], table.shape[-1]
            if R > Rc:
                model = fit_table_model(table.astype(np.float64), cnt, r.layer_k, "log")
                ext = model.theta(np.arange(Rc + 1, R + 1, dtype=np.float64)).astype(np.float32)
                table = np.concatenate([table, np.where(np.isinf(ext), 0.0, ext).astype(np.float32)], axis=-1)
                r.sdc_length_model = model
            r.sdc_table = torch.from_numpy(table)
        return self.results
