"""Length models: theta (or the offline SDC table) as a function of the row id beyond the
calibrated row ids, a line in a log feature of n fitted by weighted least squares.

Kept-count calibration (:mod:`topth_ops.calib_count`) fits one per (layer, head) on its
bucket values in log log(n / k) (:func:`fit_length_model`); the offline SDC table gets one
in log n (:func:`fit_table_model`). Threshold files store them
(:mod:`topth_ops.threshold_file`) and extend their tables with them when loaded. Why these
features: see :mod:`topth_ops.calib_count` and docs/model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .layer_k import DENSE

DEFAULT_FIT_OCTAVES = 3.0
MIN_FIT_POINTS = 3
FEATURES = ("log_n", "log_log_n_over_k")


@dataclass
class LengthModel:
    """theta as a function of the row id beyond the calibrated buckets.

    ``domain(theta)(n) = anchor_value + slope * (x(n) - x(anchor_n))`` with the feature
    x(n) = log log(n / k) (thresholds: the growth of theta slows down as rows get longer,
    measured in docs/model.md) or x(n) = log n (the offline SDC table).

    Attributes
    ----------
    domain : {"logit", "log_prob", "log"}
        The domain where the model is linear: theta itself (pre_softmax), log theta
        (post_softmax; capped at probability 1), or the log of a positive quantity without
        a cap (the offline SDC table).
    anchor_n : numpy.ndarray
        ``[num_layers, H]`` float64: row id (mean log n of the last bucket, as a real
        number) where the model starts; NaN for dense layers.
    anchor_value : numpy.ndarray
        ``[num_layers, H]``: the domain value there (the calibrated bucket value).
    slope : numpy.ndarray
        ``[num_layers, H]``: d domain(theta) / d x.
    feature : {"log_n", "log_log_n_over_k"}
    k : numpy.ndarray or None
        ``[num_layers]`` k per layer (0 = dense), needed by "log_log_n_over_k".
    """

    domain: str
    anchor_n: np.ndarray
    anchor_value: np.ndarray
    slope: np.ndarray
    feature: str = "log_n"
    k: Optional[np.ndarray] = None

    def x(self, n: np.ndarray) -> np.ndarray:
        """Feature ``[L, 1, len(n)]`` (or ``[1, 1, len(n)]``) of row ids ``n``."""
        n = np.asarray(n, dtype=np.float64).reshape(1, 1, -1)
        if self.feature == "log_n":
            return np.log(n)
        k = np.asarray(self.k, dtype=np.float64).reshape(-1, 1, 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.log(np.log(n / np.where(k > 0, k, np.nan)))

    def value(self, n: np.ndarray) -> np.ndarray:
        """Domain value ``[L, H, len(n)]`` at row ids ``n`` (any n >= anchor_n)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            if self.feature == "log_n":
                x0 = np.log(self.anchor_n)
            else:
                k = np.asarray(self.k, dtype=np.float64).reshape(-1, 1)
                x0 = np.log(np.log(self.anchor_n / np.where(k > 0, k, np.nan)))
            return self.anchor_value[..., None] + self.slope[..., None] * (self.x(n) - x0[..., None])

    def theta(self, n: np.ndarray) -> np.ndarray:
        """theta ``[L, H, len(n)]`` at row ids ``n``; log_prob domain is capped at 0
        (probability 1), "log" is not; NaN entries (dense layers) become -inf."""
        v = self.value(n)
        if self.domain == "log_prob":
            v = np.exp(np.minimum(v, 0.0))
        elif self.domain == "log":
            v = np.exp(v)
        return np.where(np.isnan(v), -np.inf, v)


def to_domain(theta: np.ndarray, domain: str) -> np.ndarray:
    """theta in a model domain: itself ("logit") or its log (float64; -inf for theta <= 0)."""
    if domain == "logit":
        return np.asarray(theta, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.log(np.maximum(np.asarray(theta, dtype=np.float64), 0.0))


def from_domain(v: np.ndarray, domain: str) -> np.ndarray:
    """Inverse of :func:`to_domain` for "logit" and "log_prob" (probabilities capped at 1)."""
    return v if domain == "logit" else np.exp(np.minimum(v, 0.0))


def _weighted_line(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float, float]:
    """Weighted least-squares line of y on x: weighted means (xm, ym) and slope (0 when
    the x values do not vary)."""
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    den = np.sum(w * (x - xm) ** 2)
    slope = float(np.sum(w * (x - xm) * (y - ym)) / den) if den > 0 else 0.0
    return xm, ym, slope


def fit_length_model(centres: np.ndarray, values: np.ndarray, rows: np.ndarray, k: int, domain: str,
                     fit_octaves: float = DEFAULT_FIT_OCTAVES, feature: str = "log_log_n_over_k"
                     ) -> tuple[float, float, float]:
    """Fit the log-linear length model of one (layer, head).

    Parameters
    ----------
    centres, values, rows : numpy.ndarray
        Per usable bucket (all rows n > k), in increasing order: mean log n ... as row id
        ``exp(mean log n)``, domain value of theta, and rows behind it.
    k : int
    domain : str
    fit_octaves : float
        Fit on the centres within this many octaves of the last one.
    feature : {"log_log_n_over_k", "log_n"}
        x of the model (see :class:`LengthModel`).

    Returns
    -------
    (anchor_n, anchor_value, slope) : tuple of float
        Anchor at the last bucket; slope 0 when fewer than 2 points are usable.
    """
    ok = np.isfinite(values) & (rows > 0)
    c, v, w = centres[ok], values[ok], rows[ok].astype(np.float64)
    if c.size == 0:
        return float("nan"), float("nan"), 0.0
    last = c[-1]
    sel = (c >= last / 2.0 ** fit_octaves) & (c > 2 * k)
    if sel.sum() < MIN_FIT_POINTS:
        sel = c > k
    slope = 0.0
    if sel.sum() >= 2:
        x = np.log(c[sel]) if feature == "log_n" else np.log(np.log(c[sel] / k))
        y, ww = v[sel], w[sel]
        slope = _weighted_line(x, y, ww)[2]
    return float(last), float(v[-1]), slope


def fit_table_model(table: np.ndarray, counts: np.ndarray, layer_k, domain: str = "log",
                    fit_octaves: float = DEFAULT_FIT_OCTAVES, max_slope: Optional[float] = None) -> LengthModel:
    """Log-linear model of a per-row-id table (e.g. the offline SDC table) for row ids
    beyond it: per (layer, head), weighted least squares (weights: ``counts``) of
    domain(value) on log n over the row ids of the last ``fit_octaves`` octaves with
    samples and value > 0; the model is the regression line (anchored at its weighted
    mean point). Dense layers get NaN (extended as 0 by the SDC extension).

    Parameters
    ----------
    table, counts : numpy.ndarray
        ``[L, H, R]`` values and samples per row id (column c = row id c + 1).
    layer_k : sequence of int
    domain : {"log", "logit"}
    max_slope : float, optional
        Upper bound of the fitted slope d domain(value) / d log n. The offline SDC table
        uses 1: its entries are sums of at most n - 1 dropped terms exp(a_j - m) <= 1, so
        they grow at most linearly in n; a steeper fit comes from the onset of dropping
        just above k (layers at a large k) and would extrapolate to a compensation that
        swamps every kept weight on long rows.
    """
    L, H, R = table.shape
    an, av, sl = np.full((L, H), np.nan), np.full((L, H), np.nan), np.zeros((L, H))
    n = np.arange(1, R + 1, dtype=np.float64)
    for layer, k in enumerate(layer_k):
        if k == DENSE:
            continue
        for h in range(H):
            v, w = table[layer, h], counts[layer, h].astype(np.float64)
            ok = (w > 0) & (n > k) & (v > 0 if domain == "log" else np.isfinite(v))
            if not ok.any():
                an[layer, h], av[layer, h] = float(R), (0.0 if domain == "logit" else -np.inf)
                continue
            last = n[ok][-1]
            sel = ok & (n >= last / 2.0 ** fit_octaves)
            if (sel & (n > 2 * k)).sum() >= MIN_FIT_POINTS:  # past the onset of dropping, as the threshold model
                sel &= n > 2 * k
            x, ww = np.log(n[sel]), w[sel]
            y = np.log(v[sel]) if domain == "log" else v[sel]
            xm, ym, sl[layer, h] = _weighted_line(x, y, ww)
            if max_slope is not None and sl[layer, h] > max_slope:
                sl[layer, h] = max_slope
            an[layer, h], av[layer, h] = math.exp(xm), ym
    return LengthModel(domain, an, av, sl)
