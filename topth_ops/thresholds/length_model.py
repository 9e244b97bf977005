"""Length models: theta (or the offline SDC table) as a function of the row id beyond the
calibrated row ids, a line in a feature of n.

Kept-count calibration (:mod:`topth_ops.calibration.count`) fits one per (layer, head) by
weighted least squares on its bucket values in log(1 - k / n) (:func:`fit_length_model`);
the offline SDC table is held constant, slope 0 (:func:`constant_table_model`). Every
feature of :data:`FEATURES` loads with its own law, so files fitted with other laws keep
them. Threshold files store the models and extend their tables with them when loaded
(docs/thresholds.md); why these laws: docs/model.md, "Rows 2-8 x beyond the calibration
samples".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .layer_k import DENSE

DEFAULT_FIT_OCTAVES = 3.0
MIN_FIT_POINTS = 3
FEATURES = ("log_n", "log_log_n_over_k", "inverse_n_over_k", "log_one_minus_k_over_n")
THRESHOLD_FEATURE = "log_one_minus_k_over_n"  # what calibration fits (docs/model.md, "Rows 2-8 x beyond")
DOMAINS = {"pre_softmax": "logit", "post_softmax": "log_prob"}  # a threshold model's domain per placement


def feature_of(n: np.ndarray, feature: str, k=None) -> np.ndarray:
    """x(n) of a length-model feature (float64; NaN where k <= 0, i.e. dense layers).

    Parameters
    ----------
    n : array_like
        Row ids (> k for the k features).
    feature : {"log_n", "log_log_n_over_k", "inverse_n_over_k", "log_one_minus_k_over_n"}
        log n; log log(n / k); -k / n (a saturating law: theta approaches a limit, its
        rise halving with every doubling of n); or log(1 - k / n), the log of the quantile
        level that keeping k of n keys asks for: like log log(n / k) for rows just longer
        than k (both fall to -inf as n -> k, so the fast rise of theta there extrapolates
        gently) and like -k / n for n >> k (log(1 - k / n) = -k / n - (k / n)^2 / 2 - ...).
    k : array_like, optional
        k, broadcast against ``n``; needed by the three k features.

    Returns
    -------
    numpy.ndarray
        x(n), float64, ``n`` and ``k`` broadcast.

    Raises
    ------
    ValueError
        An unknown feature, or a k feature without ``k``.
    """
    n = np.asarray(n, dtype=np.float64)
    if feature == "log_n":
        return np.log(n)
    if feature not in FEATURES:
        raise ValueError(f"feature must be one of {FEATURES}, got {feature!r}")
    if k is None:
        raise ValueError(f"feature {feature!r} needs k")
    k = np.asarray(k, dtype=np.float64)
    kk = np.where(k > 0, k, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        if feature == "log_log_n_over_k":
            return np.log(np.log(n / kk))
        if feature == "log_one_minus_k_over_n":
            return np.log1p(-kk / n)
        return -kk / n


@dataclass
class LengthModel:
    """theta as a function of the row id beyond the calibrated buckets.

    ``domain(theta)(n) = anchor_value + slope * (x(n) - x(anchor_n))`` with the feature
    x(n) = log(1 - k / n) (what calibration fits for thresholds: theta rises ever more slowly
    towards a limit as rows get longer, because far keys rarely pass it), or another feature
    of :data:`FEATURES` (-k / n, log log(n / k), log n) that a file records.

    Attributes
    ----------
    domain : {"logit", "log_prob", "log"}
        The domain where the model is linear: theta itself (pre_softmax), log theta
        (post_softmax; capped at probability 1), or the log of a positive quantity without
        a cap (the offline SDC table).
    anchor_n : numpy.ndarray
        ``[num_layers, H]`` float64: row id (mean log n of the last bucket, as a real
        number; the offline SDC table: its last row id) where the model starts; NaN for
        dense layers.
    anchor_value : numpy.ndarray
        ``[num_layers, H]``: the domain value there (the calibrated bucket value).
    slope : numpy.ndarray
        ``[num_layers, H]``: d domain(theta) / d x.
    feature : {"log_n", "log_log_n_over_k", "inverse_n_over_k", "log_one_minus_k_over_n"}
    k : numpy.ndarray or None
        ``[num_layers]`` k per layer (0 = dense), needed by the three k features.
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
        k = None if self.k is None else np.asarray(self.k, dtype=np.float64).reshape(-1, 1, 1)
        return feature_of(n, self.feature, k)

    def value(self, n: np.ndarray) -> np.ndarray:
        """Domain value ``[L, H, len(n)]`` at row ids ``n`` (any n >= anchor_n)."""
        k = None if self.k is None else np.asarray(self.k, dtype=np.float64).reshape(-1, 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            x0 = feature_of(self.anchor_n, self.feature, k)
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
                     fit_octaves: float = DEFAULT_FIT_OCTAVES, feature: str = THRESHOLD_FEATURE
                     ) -> tuple[float, float, float]:
    """Fit the length model of one (layer, head): a line of the domain value in x(n).

    Parameters
    ----------
    centres, values, rows : numpy.ndarray
        Per usable bucket (all rows n > k), in increasing order: mean log n ... as row id
        ``exp(mean log n)``, domain value of theta, and rows behind it.
    k : int
    domain : str
    fit_octaves : float
        Fit on the centres within this many octaves of the last one.
    feature : {"log_one_minus_k_over_n", "inverse_n_over_k", "log_log_n_over_k", "log_n"}
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
        x = feature_of(c[sel], feature, k)
        y, ww = v[sel], w[sel]
        slope = _weighted_line(x, y, ww)[2]
    return float(last), float(v[-1]), slope


def constant_table_model(table: np.ndarray, counts: np.ndarray, layer_k, octaves: float = 1.0) -> LengthModel:
    """Constant continuation of a per-row-id table (the offline SDC table) beyond its last
    row id: per (layer, head), the sample-weighted mean of the table over the row ids of its
    last ``octaves`` octaves with samples (rows n > k), held for every longer row.

    Why constant: compensating rows beyond the calibration samples by more dropped mass
    than the calibrated layers saw shrinks every kept weight, so the later layers'
    activations drift and their kept counts and perplexity with them (docs/model.md,
    "Rows 2-8 x beyond the calibration samples").

    Parameters
    ----------
    table, counts : numpy.ndarray
        ``[L, H, R]`` values and samples per row id (column c = row id c + 1).
    layer_k : sequence of int
        k per layer (:data:`~topth_ops.thresholds.layer_k.DENSE` layers get NaN: extended as 0).
    octaves : float
        Width of the averaging window below the last sampled row id, in octaves.

    Returns
    -------
    LengthModel
        domain "log", feature "log_n", slope 0, anchored at row id R; a head without
        samples above k gets -inf (extended as 0).
    """
    L, H, R = table.shape
    an, av = np.full((L, H), np.nan), np.full((L, H), np.nan)
    n = np.arange(1, R + 1, dtype=np.float64)
    for layer, k in enumerate(layer_k):
        if k == DENSE:
            continue
        for h in range(H):
            w = counts[layer, h].astype(np.float64)
            ok = (w > 0) & (n > k)
            an[layer, h] = float(R)
            if not ok.any():
                av[layer, h] = -np.inf
                continue
            sel = ok & (n >= n[ok][-1] / 2.0 ** octaves)
            mean = float(np.average(table[layer, h, sel], weights=w[sel]))
            av[layer, h] = math.log(mean) if mean > 0 else -np.inf
    return LengthModel("log", an, av, np.zeros((L, H)))
