"""The float64 oracle against hand-worked examples (math module only), so the oracle that
judges every backend is itself checked independently."""

import math

import numpy as np
import torch

from topth_ops.conformance.oracle import oracle_decode


def _one_head(scores, values, theta, **kw):
    """Build a 1-head call whose scores are exactly ``scores`` (q = e_0, k_j0 = a_j, scale 1)."""
    n, D = len(scores), 2
    q = torch.zeros(1, 1, D, dtype=torch.float64)
    q[0, 0, 0] = 1.0
    k = torch.zeros(1, 1, n + 1, D, dtype=torch.float64)
    k[0, 0, :n, 0] = torch.tensor(scores, dtype=torch.float64)
    k[0, 0, n] = float("nan")  # tail
    v = torch.zeros(1, 1, n + 1, D, dtype=torch.float64)
    v[0, 0, :n, 0] = torch.tensor(values, dtype=torch.float64)
    v[0, 0, n] = float("nan")
    th = torch.tensor([[theta] * (n + 1)], dtype=torch.float32)
    return oracle_decode(q, k, v, torch.tensor([n]), th, scale=1.0, **kw)


def test_pre_softmax_by_hand():
    a, vals = [0.0, 1.0, 2.0], [10.0, 20.0, 30.0]
    r = _one_head(a, vals, 0.5, placement="pre_softmax")
    e1, e2 = math.exp(1 - 2), math.exp(0)
    want = (e1 * 20 + e2 * 30) / (e1 + e2)
    assert math.isclose(r.out[0, 0, 0], want, rel_tol=1e-12)
    assert r.kept[0, 0] == 2 and r.v_rows[0, 0] == 2
    assert math.isclose(r.dropped_mass[0, 0], 0.0, abs_tol=1e-12)


def test_sdc_variants_by_hand():
    a, vals = [0.0, 1.0, 2.0], [10.0, 20.0, 30.0]
    e0, e1, e2 = math.exp(-2), math.exp(-1), 1.0
    R = e1 + e2
    for sdc, E in (("exact", e0), ("exp_threshold", 0.2 * 1 * math.exp(0.5 - 2))):
        r = _one_head(a, vals, 0.5, placement="pre_softmax", sdc=sdc, sdc_gamma=0.2)
        want = (e1 * 20 + e2 * 30) / (R + E)
        assert math.isclose(r.out[0, 0, 0], want, rel_tol=1e-12)
        assert math.isclose(r.dropped_mass[0, 0], 1 - R / (R + E), rel_tol=1e-9)


def test_post_softmax_vmc_by_hand():
    a, vals = [0.0, 1.0, 2.0], [10.0, 20.0, 30.0]
    Z = math.exp(0) + math.exp(1) + math.exp(2)
    s = [math.exp(x) / Z for x in a]
    r = _one_head(a, vals, 0.2, placement="post_softmax", vmc=True)
    kept_w = [w for w in s if w > 0.2]
    beta = 1 - sum(kept_w)
    want = s[1] * 20 + s[2] * 30 + beta * 20.0  # mean of the values is 20
    assert len(kept_w) == 2
    assert math.isclose(r.out[0, 0, 0], want, rel_tol=1e-12)


def test_strict_tie_and_nothing_kept():
    r = _one_head([1.0, 2.0], [5.0, 7.0], 2.0, placement="pre_softmax")
    assert r.kept[0, 0] == 0 and r.out[0, 0, 0] == 0.0 and r.dropped_mass[0, 0] == 1.0


def test_nan_score_poisons_head_only():
    r = _one_head([1.0, float("nan")], [5.0, 7.0], 0.0, placement="pre_softmax")
    assert r.nonfinite[0, 0] and np.isnan(r.out[0, 0]).all()


def test_empty_sequence_is_zero():
    q = torch.randn(1, 2, 4)
    k = torch.full((1, 1, 3, 4), float("nan"))
    r = oracle_decode(q, k, k, torch.tensor([0]), torch.zeros(2, 3), vmc=True)
    assert (r.out == 0).all() and (r.kept == 0).all() and (r.v_rows == 0).all()


def test_all_neg_inf_head_in_a_group_by_hand():
    """Group selection: head 1 scores -inf everywhere (docs/semantics.md, "Edge cases"): weight 0
    on the rows its group keeps, so with VMC it returns mu with dropped_mass 1 (also with
    exp_threshold, gamma 0 and theta - m far past float64's exp range: E~ = 0, never 0 x inf);
    head 0, scores [3, 2, 0, 0], keeps rows 0-1."""
    D, n = 2, 4
    q = torch.zeros(1, 2, D, dtype=torch.float64)
    q[0, 0, 0] = 1.0
    q[0, 1, 1] = float("-inf")
    k = torch.zeros(1, 1, n, D, dtype=torch.float64)
    k[0, 0, :, 0] = torch.tensor([3.0, 2.0, 0.0, 0.0], dtype=torch.float64)
    k[0, 0, :, 1] = 1.0
    v = torch.zeros(1, 1, n, D, dtype=torch.float64)
    v[0, 0, :, 0] = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    mu = 25.0
    e = np.exp(np.array([0.0, -1.0, -3.0, -3.0]))
    for placement, theta in (("pre_softmax", 1.0), ("post_softmax", 0.1)):
        r = oracle_decode(q, k, v, torch.tensor([n]), torch.tensor([[theta]]), scale=1.0, placement=placement,
                          selection="group", vmc=True)
        assert r.kept.tolist() == [[2, 2]] and r.v_rows.tolist() == [[2]], placement
        assert r.out[0, 1, 0] == mu and r.dropped_mass[0, 1] == 1.0, placement
        w = e[:2] / (e.sum() if placement == "post_softmax" else e[:2].sum())
        assert math.isclose(r.out[0, 0, 0], w[0] * 10 + w[1] * 20 + (1 - w.sum()) * mu, rel_tol=1e-12), placement
    # scale 400: head 0 scores [1200, 800, 0, 0], theta 800 keeps row 0; head 1's exp(theta - m)
    # (m taken as 0) overflows float64
    r = oracle_decode(q, k, v, torch.tensor([n]), torch.tensor([[800.0]]), scale=400.0, placement="pre_softmax",
                      selection="group", vmc=True, sdc="exp_threshold", sdc_gamma=0.0)
    assert r.kept.tolist() == [[1, 1]]
    assert r.out[0, 1, 0] == mu and r.dropped_mass[0, 1] == 1.0
    assert r.out[0, 0, 0] == 10.0 and r.dropped_mass[0, 0] == 0.0
