"""group_vs_head: same-k ratios and equal-perplexity pairs (within 0.1 points)."""

import pytest

from topth_ops.hf.report import group_vs_head


def _r(variant, k, ppl, vrows):
    return dict(variant=variant, k=k, ppl_rel_change=ppl, v_rows_frac=vrows)


def test_group_vs_head_pairs_and_same_k():
    recs = [_r("topth-post-vmc", 16, -0.0027, 0.248), _r("topth-post-vmc", 32, 0.0030, 0.404),
            _r("topth-post-vmc", 64, 0.0024, 0.672), _r("topth-post-vmc-group", 32, 0.0030, 0.270),
            _r("topth-pre-offline-vmc", 32, 0.0030, 0.9)]
    (c,) = group_vs_head(recs)
    assert c["k"] == 32 and c["same_k"]["ratio"] == pytest.approx(0.404 / 0.270)
    assert [(p["k"], round(p["ratio"], 2)) for p in c["pairs"]] == [(32, 1.5), (64, 2.49)]  # 16 is 0.57 points away
    assert group_vs_head([_r("topth-post-vmc-group", 16, 0.0, 0.1)])[0]["same_k"] is None
