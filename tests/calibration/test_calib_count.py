"""Kept-count calibration (topth_ops.calibration.count) against float64 brute force: the
bucket thresholds keep k per row on average, per head and per GQA group, and the length
model is fitted and applied as documented."""

import math

import numpy as np
import pytest
import torch

from topth_ops.calibration import CountAccumulator, bucket_edges
from topth_ops.thresholds import DENSE, LengthModel, fit_length_model

HQ, HKV = 4, 2


def _rows(seed, T, shift=True):
    """Logits of one causal sequence [1, HQ, T, T] (-inf above the diagonal) with a
    per-row level shift (rows differ in level, which is what biases algorithm 1)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(1, HQ, T, T, generator=g) * 2.0
    if shift:
        a = a + torch.randn(1, HQ, T, 1, generator=g) * 3.0
    a = a.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return a, torch.arange(1, T + 1).view(1, T)


def _values(a, placement, selection):
    x = a.double()
    if placement == "post_softmax":
        x = x - torch.logsumexp(x, -1, keepdim=True)
    if selection == "group":
        B, H, T, S = x.shape
        x = x.view(B, HKV, H // HKV, T, S).amax(2)
    return x[0].numpy()  # [H, T, S]


@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
@pytest.mark.parametrize("selection", ["head", "group"])
def test_bucket_thresholds_keep_k_on_average(placement, selection):
    T, ks = 96, [4, 8]
    seqs = [_rows(s, T) for s in range(3)]
    acc = CountAccumulator(2, HQ, HKV, T, ks, [placement], [selection], bins=4096)
    for a, n in seqs:
        for layer in range(2):
            for c0 in range(0, T, 17):  # chunks of rows, as the prefill path feeds them
                acc.record(layer, a[:, :, c0:c0 + 17], n[:, c0:c0 + 17])
    xs = [_values(a, placement, selection) for a, _ in seqs]  # [H, T, S] per sequence
    for k in ks:
        centres, vals, rows, usable = acc.bucket_thetas(placement, selection, 1, k)
        assert usable.sum() >= 5
        for b in np.flatnonzero(usable):
            lo, hi = acc.edges[b], acc.edges[b + 1]
            assert lo >= k  # every row of the bucket has n > k
            for h in range(vals.shape[0]):
                theta = vals[h, b]
                kept = [(x[h, n - 1, :n] > theta).sum() for x in xs for n in range(lo + 1, hi + 1)]
                assert rows[b] == len(kept)
                # exact up to the values within one bin width of theta (values inside the
                # bin are taken as uniform there)
                w = float(acc.range[(placement, selection)][1][h, 1])
                near = sum(((x[h, n - 1, :n] > theta - w) & (x[h, n - 1, :n] <= theta + w)).sum()
                           for x in xs for n in range(lo + 1, hi + 1))
                assert abs(np.sum(kept) - k * rows[b]) <= max(near, 1), (k, b, h, np.mean(kept))
                assert near <= 0.05 * k * rows[b] + 2  # and that window is narrow
            lo_n, hi_n = math.log(lo + 1), math.log(hi)
            assert lo_n - 1e-9 <= math.log(centres[b]) <= hi_n + 1e-9


def test_algorithm_1_over_keeps_where_the_count_estimator_does_not():
    """Rows with different levels: mean of the (k+1)-th largest logits keeps more than k
    on average (the drift of docs/model.md); the kept-count table keeps ~k."""
    from topth_ops.calibration import ThresholdAccumulator

    T, k = 128, 8
    seqs = [_rows(s, T) for s in range(4)]
    acc = CountAccumulator(1, HQ, HKV, T, [k], ["pre_softmax"], ["head"], bins=2048)
    mean = ThresholdAccumulator(1, HQ, T, [[k]], ["pre_softmax"])
    for a, n in seqs:
        acc.record(0, a, n)
        mean.record(0, a, n)
    th_count, counts, _ = acc.result("pre_softmax", "head", [k])
    th_mean = mean.result(0, "pre_softmax", 0.0).thresholds.numpy()
    kc, km = [], []
    for a, _ in seqs:
        x = _values(a, "pre_softmax", "head")
        for h in range(HQ):
            for n in range(2 * k, T + 1):
                kc.append((x[h, n - 1, :n] > th_count[0, h, n - 1]).sum())
                km.append((x[h, n - 1, :n] > th_mean[0, h, n - 1]).sum())
    assert np.mean(km) / k > 1.15  # algorithm 1's bias on rows of different levels
    assert abs(np.mean(kc) / k - 1) < 0.08
    assert counts.shape == (1, HQ, T) and counts[0, 0, k - 1] == 0 and counts[0, 0, T - 1] == 4


def test_result_layout_dense_rows_and_length_model():
    T = 64
    acc = CountAccumulator(3, HQ, HKV, T, [4], ["post_softmax"], ["head"])
    for s in range(2):
        a, n = _rows(s, T)
        for layer in range(3):
            acc.record(layer, a, n)
    th, counts, model = acc.result("post_softmax", "head", [DENSE, 4, 4], extend_to=256)
    assert th.shape == (3, HQ, 256)
    assert np.all(np.isneginf(th[0])) and np.all(np.isneginf(th[1:, :, :4])) and np.all(np.isfinite(th[1:, :, 4:]))
    assert np.all((th[1:, :, 4:] > 0) & (th[1:, :, 4:] <= 1))
    assert np.isnan(model.anchor_n[0]).all() and (model.anchor_n[1:] <= T).all()
    # beyond the anchor, theta follows the model exactly
    n = np.arange(100, 257)
    assert model.feature == "log_one_minus_k_over_n" and list(model.k) == [DENSE, 4, 4]
    np.testing.assert_allclose(np.log(th[2, 1, 99:]), model.anchor_value[2, 1] + model.slope[2, 1] *
                               (np.log(1 - 4 / n) - np.log(1 - 4 / model.anchor_n[2, 1])), rtol=1e-9)
    with pytest.raises(ValueError, match="no calibration row longer than k=64 in layer 1"):
        acc.result("post_softmax", "head", [DENSE, 64, 4])


def test_fit_length_model_recovers_a_log_linear_law():
    c = np.array([10, 14, 20, 28, 40, 57, 80, 113, 160, 226.0])
    v = 1.5 + 0.75 * np.log(c)
    an, av, sl = fit_length_model(c, v, np.full(c.size, 7), k=4, domain="logit", feature="log_n")
    assert sl == pytest.approx(0.75) and an == 226.0 and av == pytest.approx(v[-1])
    m = LengthModel("logit", np.array([[an]]), np.array([[av]]), np.array([[sl]]))
    assert m.theta(np.array([1000.0]))[0, 0, 0] == pytest.approx(1.5 + 0.75 * math.log(1000))
    # the default feature: log(1 - k / n), a law that levels off at its limit (here -2.0)
    z = -2.0 + 3.0 * np.log(1 - 4 / c)
    an, av, sl = fit_length_model(c, z, np.full(c.size, 7), k=4, domain="log_prob")
    assert sl == pytest.approx(3.0)
    m = LengthModel("log_prob", np.array([[an]]), np.array([[av]]), np.array([[sl]]), "log_one_minus_k_over_n",
                    np.array([4]))
    assert m.theta(np.array([5000.0]))[0, 0, 0] == pytest.approx(math.exp(-2.0 + 3.0 * math.log(1 - 4 / 5000)))
    assert m.theta(np.array([1e12]))[0, 0, 0] == pytest.approx(math.exp(-2.0))
    # -k / n, what files written earlier on 2026-12-01 hold
    u = -2.0 - 3.0 * 4 / c
    an, av, sl = fit_length_model(c, u, np.full(c.size, 7), k=4, domain="log_prob", feature="inverse_n_over_k")
    assert sl == pytest.approx(3.0)
    m = LengthModel("log_prob", np.array([[an]]), np.array([[av]]), np.array([[sl]]), "inverse_n_over_k", np.array([4]))
    assert m.theta(np.array([5000.0]))[0, 0, 0] == pytest.approx(math.exp(-2.0 - 12.0 / 5000))
    assert m.theta(np.array([1e12]))[0, 0, 0] == pytest.approx(math.exp(-2.0))
    # log log(n / k), what files written before 2026-12-01 hold
    w = -2.0 + 0.5 * np.log(np.log(c / 4))
    an, av, sl = fit_length_model(c, w, np.full(c.size, 7), k=4, domain="log_prob", feature="log_log_n_over_k")
    assert sl == pytest.approx(0.5)
    m = LengthModel("log_prob", np.array([[an]]), np.array([[av]]), np.array([[sl]]), "log_log_n_over_k", np.array([4]))
    assert m.theta(np.array([5000.0]))[0, 0, 0] == pytest.approx(math.exp(-2.0 + 0.5 * math.log(math.log(1250))))
    # fewer than two usable points: constant continuation
    assert fit_length_model(c[:1], v[:1], np.ones(1), 4, "logit")[2] == 0.0


def test_bucket_edges_hold_every_k():
    e = bucket_edges(1000, [16, 48, 96])
    assert e[0] == 0 and e[-1] == 1000 and np.all(np.diff(e) > 0)
    assert {16, 48, 96} <= set(e.tolist())


def test_row_thinning_keeps_rows_per_octave_and_the_estimate():
    """Above rows_per_octave row ids only every 2**j-th row is recorded; the bucket
    thresholds stay within the histogram resolution of the full-row ones."""
    T = 512
    a, n = _rows(7, T, shift=False)
    full = CountAccumulator(1, HQ, HKV, T, [8], ["post_softmax"], ["head"], rows_per_octave=0)
    thin = CountAccumulator(1, HQ, HKV, T, [8], ["post_softmax"], ["head"], rows_per_octave=64)
    full.record(0, a, n)
    thin.record(0, a, n)
    rec = thin.rows_per_id[0].numpy()
    assert rec[100] == 1 and rec[129] == 0 and rec[130] == 1 and rec[302] == 0 and rec[304] == 1
    assert rec[256:512].sum() == 64 and rec[128:256].sum() == 64 and full.rows_per_id[0, 9:].sum() == T - 8
    _, vf, _, uf = full.bucket_thetas("post_softmax", "head", 0, 8)
    _, vt, _, ut = thin.bucket_thetas("post_softmax", "head", 0, 8)
    assert np.array_equal(uf, ut)
    np.testing.assert_allclose(vt[:, uf], vf[:, uf], atol=0.25)  # log-probability units


def test_sdc_table_continues_as_its_last_octave_mean():
    """The offline SDC table beyond the calibrated row ids holds the sample-weighted mean of
    its last calibrated octave (rows n > k), whatever the trend inside: a fitted growth
    (even n^3 just above a large k, the regression that once gave +12,000% long-document
    perplexity) is not continued."""
    from topth_ops.thresholds import constant_table_model

    R, k = 1024, 256
    n = np.arange(1, R + 1, dtype=np.float64)
    steep = np.where(n > k, ((n - k) / 64.0) ** 3, 0.0)
    flat = np.where(n > 8, 0.5 * np.sqrt(n), 0.0)
    table = np.stack([steep, flat, np.zeros(R)]).reshape(1, 3, R)
    counts = np.ones_like(table, dtype=np.int64)
    counts[0, 1, 900:] = 0  # unsampled row ids carry no weight
    counts[0, 1, 600:700] = 3
    m = constant_table_model(table, counts, [k])
    ext = m.theta(np.array([1025.0, 4096.0, 1e6]))[0]
    last = n >= 512
    assert ext[0] == pytest.approx(np.full(3, steep[last].mean()))
    w = counts[0, 1] * ((n >= 899 / 2) & (n > k))
    assert ext[1] == pytest.approx(np.full(3, np.average(flat, weights=w)))
    assert np.all(ext[2] == 0)  # no dropped mass calibrated: no compensation
    dense = constant_table_model(table, counts, [0])
    assert np.all(dense.theta(np.array([2000.0])) == -np.inf)  # dense layer: extended as 0 by the SDC extension