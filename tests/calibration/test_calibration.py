"""Calibration (algorithm 1) against a brute-force float64 numpy computation."""

import math

import numpy as np
import pytest
import torch

from topth_ops.calibration import SdcAccumulator, ThresholdAccumulator
from topth_ops.prefill import RowRule, prefill_attention
from topth_ops.thresholds import DENSE, fill_unsampled, format_layer_k, parse_layer_k

L, HQ, HKV, D = 3, 4, 2, 8


def _random_sequences(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in lengths:
        q = torch.randn(L, 1, HQ, T, D, generator=g) * 1.5
        k = torch.randn(L, 1, HKV, T, D, generator=g) * 1.5
        v = torch.randn(L, 1, HKV, T, D, generator=g)
        out.append((q, k, v))
    return out


def _brute_force(seqs, layer_k, alpha, placement):
    """Algorithm 1 written directly: per row the lower (n-k)/n quantile of the row's values
    (logits or softmax probabilities, float64), mean + alpha * population std per row id,
    nearest-row fill (ties: smaller), rows n <= k and dense layers -inf."""
    samples = {}
    maxlen = max(q.shape[3] for q, _, _ in seqs)
    for q, k, _ in seqs:
        T = q.shape[3]
        for layer in range(L):
            kk = layer_k[layer]
            if kk == DENSE:
                continue
            qq = q[layer, 0].double().numpy()
            kx = np.repeat(k[layer, 0].double().numpy(), HQ // HKV, axis=0)
            for h in range(HQ):
                for i in range(T):
                    n = i + 1
                    if n <= kk:
                        continue
                    a = qq[h, i] @ kx[h, :n].T / math.sqrt(D)
                    x = a if placement == "pre_softmax" else np.exp(a - a.max()) / np.exp(a - a.max()).sum()
                    samples.setdefault((layer, h, n), []).append(np.quantile(x, (n - kk) / n, method="lower"))
    R = max(n for (_, _, n) in samples)
    theta = np.full((L, HQ, R), -np.inf)
    for layer in range(L):
        kk = layer_k[layer]
        if kk == DENSE:
            continue
        for h in range(HQ):
            have = sorted(n for (l2, h2, n) in samples if l2 == layer and h2 == h)
            for n in range(kk + 1, R + 1):
                src = min(have, key=lambda m: (abs(m - n), m))  # nearest, ties -> smaller
                v = np.array(samples[(layer, h, src)])
                theta[layer, h, n - 1] = v.mean() + alpha * v.std()
    return theta, samples, maxlen


def _calibrate(seqs, targets, placements, chunk=64):
    maxlen = max(q.shape[3] for q, _, _ in seqs)
    acc = ThresholdAccumulator(L, HQ, maxlen, targets, placements)
    for q, k, v in seqs:
        T = q.shape[3]
        rows = torch.arange(1, T + 1).view(1, T)
        for layer in range(L):
            prefill_attention(q[layer], k[layer], v[layer], rows, RowRule("dense"), scale=D ** -0.5,
                              score_hook=lambda a, n, m, lz, layer=layer: acc.record(layer, a, n, m, lz),
                              max_chunk_elems=chunk * HQ * T)
    return acc


@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
@pytest.mark.parametrize("alpha", [0.0, 0.7])
def test_thresholds_match_brute_force_algorithm_1(placement, alpha):
    seqs = _random_sequences(0, [40, 23, 40, 31])  # row ids 24..31 and 32..40 get fewer samples
    layer_k = [DENSE, 3, 7]
    acc = _calibrate(seqs, [layer_k], [placement], chunk=5)
    res = acc.result(0, placement, alpha)
    expected, samples, _ = _brute_force(seqs, layer_k, alpha, placement)
    got = res.thresholds.numpy()
    assert got.shape == expected.shape
    assert np.array_equal(np.isinf(got), np.isinf(expected))
    fin = np.isfinite(expected)
    np.testing.assert_allclose(got[fin], expected[fin], rtol=2e-5, atol=1e-6 if placement == "post_softmax" else 1e-5)
    # counts are the number of samples per row id
    for (layer, h, n), v in samples.items():
        assert int(res.counts[layer, h, n - 1]) == len(v)
    assert int(res.counts[0].sum()) == 0


def test_multi_k_and_both_placements_from_one_pass_equal_single_runs():
    seqs = _random_sequences(1, [30, 30])
    t1, t2 = [2, 2, 2], [DENSE, 5, 9]
    both = _calibrate(seqs, [t1, t2], ["pre_softmax", "post_softmax"])
    for ti, t in enumerate((t1, t2)):
        for p in ("pre_softmax", "post_softmax"):
            single = _calibrate(seqs, [t], [p])
            torch.testing.assert_close(both.result(ti, p, 0.3).thresholds, single.result(0, p, 0.3).thresholds,
                                       rtol=0, atol=0)


def test_one_sample_threshold_keeps_exactly_k_on_the_calibration_rows():
    """With one sample per row id and alpha = 0, theta is the row's (k+1)-th largest value,
    so a strict '>' keeps exactly k (no ties in random data) in both placements."""
    seqs = _random_sequences(2, [48])
    q, k, v = seqs[0]
    layer_k = [4, 4, 4]
    acc = _calibrate(seqs, [layer_k], ["pre_softmax", "post_softmax"])
    rows = torch.arange(1, 49).view(1, 48)
    for p in ("pre_softmax", "post_softmax"):
        th = acc.result(0, p, 0.0).thresholds
        for layer in range(L):
            _, st = prefill_attention(q[layer], k[layer], v[layer], rows, RowRule("table", placement=p, thresholds=th[layer]),
                                      scale=D ** -0.5, return_stats=True)
            expect = torch.minimum(rows, torch.tensor(4)).view(1, 1, 48).expand(1, HQ, 48)
            assert torch.equal(st.kept, expect.to(torch.int32)), p


def test_welford_is_accurate_with_a_large_offset():
    acc = ThresholdAccumulator(1, 1, 3, [[1]], ["pre_softmax"])
    rng = np.random.default_rng(0)
    vals = 1e3 + rng.standard_normal(500) * 1e-2
    for v in vals:  # each call: one row id 3 whose 2nd-largest logit is v
        scores = torch.tensor([[[[1e7, v, -1e9]]]], dtype=torch.float64).float()
        acc.record(0, scores, torch.tensor([[3]]))
    res = acc.result(0, "pre_softmax", 1.0)
    f32 = np.float32(vals).astype(np.float64)
    assert res.thresholds[0, 0, 2].item() == pytest.approx(f32.mean() + f32.std(), rel=1e-7)


def test_no_row_longer_than_k_is_an_error():
    seqs = _random_sequences(3, [6])
    acc = _calibrate(seqs, [[8, 8, 8]], ["pre_softmax"])
    with pytest.raises(ValueError, match="no calibration row longer than k=8 in layer 0"):
        acc.result(0, "pre_softmax", 0.0)


def test_fill_unsampled_nearest_ties_smaller_and_ends():
    vals = np.array([[0, 10, 0, 0, 40, 0, 0, 0, 80, 0]], dtype=float)
    cnt = (vals != 0).astype(int)
    got = fill_unsampled(vals, cnt)[0]
    #            n=1  2   3   4   5   6   7   8   9  10
    assert list(got) == [10, 10, 10, 40, 40, 40, 40, 80, 80, 80]
    # n=7 is 2 away from both n=5 and n=9: the smaller row id wins; n=2 below: same
    v2 = np.array([[5.0, 0, 7.0]])
    assert list(fill_unsampled(v2, (v2 != 0).astype(int))[0]) == [5.0, 5.0, 7.0]


def test_parse_layer_k():
    assert parse_layer_k("0:dense,1:256", 16, 4) == [DENSE, 256, 16, 16]
    with pytest.raises(ValueError, match="names layer 0 twice"):
        parse_layer_k("0:16,0:dense", 16, 4)
    with pytest.raises(ValueError, match="names layer 3 twice"):
        parse_layer_k("3:16,-1:8", 16, 4)
    assert parse_layer_k("-1:dense", 8, 3) == [8, 8, DENSE]
    assert parse_layer_k(None, 4, 2) == [4, 4]
    assert format_layer_k([0, 0, 16, 16, 16]) == "0-1:dense, 2-4:16"
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        parse_layer_k(None, 0, 3)
    with pytest.raises(ValueError, match="layer must lie in"):
        parse_layer_k("5:16", 16, 3)
    with pytest.raises(ValueError, match="LAYER:K"):
        parse_layer_k("5", 16, 3)


def test_offline_sdc_table_is_mean_dropped_mass_at_calibrated_theta():
    seqs = _random_sequences(4, [20, 20, 14])
    layer_k = [DENSE, 3, 3]
    acc = _calibrate(seqs, [layer_k], ["pre_softmax"])
    res = acc.result(0, "pre_softmax", 0.5)
    sdc = SdcAccumulator([res])
    for q, k, v in seqs:
        T = q.shape[3]
        rows = torch.arange(1, T + 1).view(1, T)
        for layer in range(L):
            prefill_attention(q[layer], k[layer], v[layer], rows, RowRule("dense"), scale=D ** -0.5,
                              score_hook=lambda a, n, m, lz, layer=layer: sdc.record(layer, a, n))
    table = sdc.finalize()[0].sdc_table.numpy()
    th = res.thresholds.numpy().astype(np.float64)
    sums = {}
    for q, k, _ in seqs:
        T = q.shape[3]
        for layer in (1, 2):
            qq = q[layer, 0].double().numpy()
            kx = np.repeat(k[layer, 0].double().numpy(), HQ // HKV, axis=0)
            for h in range(HQ):
                for i in range(3, T):
                    n = i + 1
                    a = qq[h, i] @ kx[h, :n].T / math.sqrt(D)
                    E = np.exp(a - a.max())[a <= th[layer, h, n - 1]].sum()
                    sums.setdefault((layer, h, n), []).append(E)
    for (layer, h, n), v in sums.items():
        assert table[layer, h, n - 1] == pytest.approx(np.mean(v), rel=1e-4, abs=1e-6)
    assert np.all(table[0] == 0) and np.all(table[1:, :, :3] == 0)
