"""topth_ops.hf.calibrate.calibrate on a tiny random Llama against an independent float64
oracle of algorithm 1 (arXiv 2502.08363, section 3.1) and of the offline SDC table
(section 3.2.1).

The oracle runs the model dense with transformers' eager attention, takes each attention
layer's input hidden states and rotary (cos, sin) from a forward pre-hook, and recomputes
q, k and the logits a = q k^T / sqrt(head_dim) itself in float64 numpy (GQA: query head h
reads KV head h // (Hq / Hkv)). softmax(a) is checked against the probabilities eager
attention returns (output_attentions=True), so the oracle's layer, head, row and scale
wiring is pinned by transformers, not by topth_ops (the oracle is ``oracle_logits`` of
tests/hf/conftest.py). Calibration keeps every layer dense, so every layer's inputs are
the dense run's and every layer's thresholds must match.

This catches wiring bugs in the model integration (samples recorded into the wrong layer,
head or row id; pre- and post-softmax domains swapped; wrong k) that the accumulator's
own tests cannot see. About 2 s on CPU.
"""

import numpy as np
import pytest
import torch
import transformers  # noqa: F401 - the hf extra is part of the dev extra

from topth_ops.hf.calibrate import CalibrationText, calibrate
from topth_ops.thresholds import DENSE

L, HQ, HKV, D, HIDDEN, VOCAB = 3, 6, 2, 16, 96, 96
LENGTHS = [40, 40, 33, 40]  # row ids 34..40 get 3 samples, 1..33 get 4
TARGETS = [[3, 3, 3], [DENSE, 6, 2]]
ALPHA = 0.5


@pytest.fixture(scope="module")
def model(sharp_llama):
    return sharp_llama(layers=L, q_heads=HQ, kv_heads=HKV, head_dim=D, hidden=HIDDEN, vocab=VOCAB)


@pytest.fixture(scope="module")
def samples():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


@pytest.fixture(scope="module")
def oracle(model, samples, oracle_logits):
    return [oracle_logits(model, ids) for ids in samples]


def _thresholded_rows(oracle, layer_k):
    """(layer, head, row id n, logits of the row's n keys) of every row with n > k in a
    thresholded layer, over all samples."""
    for logits in oracle:
        T = logits.shape[-1]
        for layer, k in enumerate(layer_k):
            if k == DENSE:
                continue
            for h in range(HQ):
                for i in range(k, T):  # row id n = i + 1 > k
                    yield layer, h, i + 1, logits[layer, h, i, : i + 1]


def _algorithm_1(oracle, layer_k, placement, alpha):
    """theta[layer, h, n-1] = mean + alpha * population std over samples of the row's
    (k+1)-th largest logit / probability; -inf for n <= k and dense layers; counts."""
    R = max(LENGTHS)
    vals = {}
    for layer, h, n, a in _thresholded_rows(oracle, layer_k):
        x = a if placement == "pre_softmax" else np.exp(a - a.max()) / np.exp(a - a.max()).sum()
        vals.setdefault((layer, h, n), []).append(np.sort(x)[::-1][layer_k[layer]])
    theta = np.full((L, HQ, R), -np.inf)
    counts = np.zeros((L, HQ, R), dtype=np.int64)
    for (layer, h, n), v in vals.items():
        v = np.array(v)
        theta[layer, h, n - 1] = v.mean() + alpha * v.std()
        counts[layer, h, n - 1] = v.size
    return theta, counts


@pytest.fixture(scope="module")
def calibrated(model, samples):
    text = CalibrationText(samples=list(samples), description="random token ids")
    return calibrate(model, text, TARGETS, ["pre_softmax", "post_softmax"], alpha=ALPHA, model_name="tiny",
                     progress=False, estimator="mean")


@pytest.mark.parametrize("target", range(len(TARGETS)))
@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
def test_hf_calibration_matches_float64_algorithm_1_in_every_layer(calibrated, oracle, target, placement):
    ts = calibrated[(target, placement, "head")]
    expected, counts = _algorithm_1(oracle, TARGETS[target], placement, ALPHA)
    got = ts.thresholds.numpy().astype(np.float64)
    assert ts.layer_k == TARGETS[target] and ts.placement == placement and ts.alpha == ALPHA
    assert got.shape == expected.shape == (L, HQ, max(LENGTHS))
    assert np.array_equal(ts.counts.numpy(), counts)  # samples land in their own (layer, head, row id)
    assert np.array_equal(np.isneginf(got), np.isneginf(expected))
    fin = np.isfinite(expected)
    assert fin.sum() == HQ * sum(max(LENGTHS) - k for k in TARGETS[target] if k != DENSE)  # all n > k
    tol = dict(rtol=1e-4, atol=1e-4) if placement == "pre_softmax" else dict(rtol=1e-4, atol=1e-6)
    for layer in range(L):
        for h in range(HQ):
            m = fin[layer, h]
            np.testing.assert_allclose(got[layer, h, m], expected[layer, h, m], **tol,
                                       err_msg=f"{placement} target {target} layer {layer} head {h}")
    # the check is sharp: every two layers, heads or neighbouring row ids differ far
    # beyond the tolerance, so samples recorded in the wrong place cannot pass
    e, scale = np.where(fin, expected, np.nan), np.abs(expected[fin]).max()
    pairs = [(e[i], e[j]) for i in range(L) for j in range(i + 1, L)]
    pairs += [(e[:, i], e[:, j]) for i in range(HQ) for j in range(i + 1, HQ)]
    pairs += [(e[..., 1:], e[..., :-1])]
    for x, y in pairs:
        d = np.abs(x - y)
        if np.isfinite(d).any():
            assert np.nanmax(d) > 1e-2 * scale


def test_hf_offline_sdc_table_is_mean_dropped_mass(calibrated, oracle):
    """Section 3.2.1: sdc_table[layer, h, n-1] = mean over rows with row id n of
    sum_{a_j <= theta} exp(a_j - max a), at the file's own (float32) thresholds."""
    for target, layer_k in enumerate(TARGETS):
        ts = calibrated[(target, "pre_softmax", "head")]
        assert calibrated[(target, "post_softmax", "head")].sdc_table is None
        theta = ts.thresholds.numpy().astype(np.float64)
        sums = {}
        for layer, h, n, a in _thresholded_rows(oracle, layer_k):
            dropped = a <= theta[layer, h, n - 1]
            sums.setdefault((layer, h, n), []).append(np.exp(a - a.max())[dropped].sum())
        table = ts.sdc_table.numpy()
        expect = np.zeros_like(table, dtype=np.float64)
        for (layer, h, n), v in sums.items():
            expect[layer, h, n - 1] = np.mean(v)
        np.testing.assert_allclose(table, expect, rtol=1e-3, atol=1e-5, err_msg=f"target {target}")
        assert expect.max() > 0.1


def test_calibrated_thresholds_keep_about_k_on_the_calibration_rows(model, samples, oracle):
    """alpha = 0: theta is the mean (k+1)-th largest value, so on the calibration rows
    (dense activations) the kept count k~ = #{a_j > theta} averages about k (k~/k ~ 1)."""
    text = CalibrationText(samples=list(samples), description="random token ids")
    sets = calibrate(model, text, [[4, 4, 4]], ["pre_softmax", "post_softmax"], alpha=0.0, sdc_table=False,
                     progress=False, estimator="mean")
    for p in ("pre_softmax", "post_softmax"):
        theta = sets[(0, p, "head")].thresholds.numpy().astype(np.float64)
        ratios = []
        for logits in oracle:
            for layer in range(L):
                for h in range(HQ):
                    for i in range(4, logits.shape[-1]):
                        a = logits[layer, h, i, : i + 1]
                        x = a if p == "pre_softmax" else np.exp(a - a.max()) / np.exp(a - a.max()).sum()
                        ratios.append((x > theta[layer, h, i]).sum() / 4)
        assert 0.8 < np.mean(ratios) < 1.4, (p, np.mean(ratios))


@pytest.fixture(scope="module")
def counted(model, samples):
    text = CalibrationText(samples=list(samples), description="random token ids")
    return calibrate(model, text, TARGETS, ["pre_softmax", "post_softmax"], model_name="tiny", progress=False,
                     estimator="count", selections=("head", "group"), extend_to=320)


@pytest.mark.parametrize("selection", ["head", "group"])
@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
def test_hf_kept_count_thresholds_keep_k_per_row_id_on_the_oracle(counted, oracle, placement, selection):
    """Kept-count estimator (topth_ops.calibration.count) through the model integration: at every
    row id of a bucket that holds one row id, the oracle's rows keep k on average (per
    query head, or per GQA group against the maximum over the group's heads), in every
    layer. Wrong layer, head, group or domain wiring misses this by far."""
    from topth_ops.calibration import bucket_edges

    G = HQ // HKV
    for target, layer_k in enumerate(TARGETS):
        ts = counted[(target, placement, selection)]
        H = HQ if selection == "head" else HKV
        assert ts.thresholds.shape == (L, H, 320) and ts.counts.shape == (L, H, max(LENGTHS))
        assert ts.estimator == "count" and ts.length_model is not None
        theta = ts.thresholds.numpy().astype(np.float64)
        ks = sorted({k for t in TARGETS for k in t if k != DENSE})
        edges = bucket_edges(max(LENGTHS), ks)
        single = [int(edges[i + 1]) for i in range(len(edges) - 1) if edges[i + 1] - edges[i] == 1]
        checked = 0
        for layer, k in enumerate(layer_k):
            if k == DENSE:
                assert np.all(np.isneginf(theta[layer]))
                continue
            for n in single:
                if n <= k:
                    continue
                for g in range(H):
                    kept = []
                    for logits in oracle:
                        if logits.shape[-1] < n:
                            continue
                        a = logits[layer, :, n - 1, :n]  # [HQ, n]
                        x = a if placement == "pre_softmax" else a - np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True)) - a.max(-1, keepdims=True)
                        x = x[g] if selection == "head" else x[g * G:(g + 1) * G].max(0)
                        t = theta[layer, g, n - 1]
                        kept.append((x > (t if placement == "pre_softmax" else np.log(t))).sum())
                    assert abs(np.sum(kept) - k * len(kept)) <= max(1, 0.1 * k * len(kept)), (layer, g, n, kept)
                    checked += 1
        assert checked >= 10


def test_hf_group_offline_sdc_table_uses_the_group_kept_set(counted, oracle):
    """Group selection: E~_h = mean over rows of sum over keys the GROUP drops of
    exp(a_hj - max a_h), per query head (op contract v0.2)."""
    G = HQ // HKV
    layer_k = TARGETS[1]
    ts = counted[(1, "pre_softmax", "group")]
    theta = ts.thresholds.numpy().astype(np.float64)
    Rc = ts.calibrated_row_ids
    sums = {}
    for logits in oracle:
        T = logits.shape[-1]
        for layer, k in enumerate(layer_k):
            if k == DENSE:
                continue
            for i in range(k, T):
                n = i + 1
                a = logits[layer, :, i, :n]
                for grp in range(HKV):
                    kept = a[grp * G:(grp + 1) * G].max(0) > theta[layer, grp, n - 1]
                    for h in range(grp * G, (grp + 1) * G):
                        sums.setdefault((layer, h, n), []).append(np.exp(a[h] - a[h].max())[~kept].sum())
    table = ts.sdc_table.numpy()
    assert table.shape == (L, HQ, 320)
    assert len(sums) == HQ * (max(LENGTHS) - 6 + max(LENGTHS) - 2)
    for (layer, h, n), v in sums.items():
        np.testing.assert_allclose(table[layer, h, n - 1], np.mean(v), rtol=1e-3, atol=1e-5)
    # beyond the calibrated row ids the table holds its last-octave mean (positive, finite)
    assert ts.sdc_length_model is not None and np.all(np.isfinite(table[1:, :, Rc:])) and np.all(table[1:, :, Rc:] > 0)


@pytest.mark.parametrize("extend_to", [max(LENGTHS) - 1, 0, -5, 2 ** 21, 320.0, True])
def test_calibrate_refuses_extend_to_out_of_range(model, samples, extend_to):
    # it used to be raised to the longest sample silently (-5 gave a file without a length model)
    text = CalibrationText(samples=list(samples), description="random token ids")
    with pytest.raises(ValueError, match=rf"extend_to must be an integer from the longest calibration sample "
                                         rf"\({max(LENGTHS)} tokens\) to 1048576, got {extend_to!r}"):
        calibrate(model, text, TARGETS, ["post_softmax"], model_name="tiny", progress=False, estimator="count",
                  extend_to=extend_to)
