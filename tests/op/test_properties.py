"""Property-based tests (hypothesis): the torch reference vs the float64 oracle over random
shapes, lengths, GQA ratios, thresholds and options, plus metamorphic properties that need
no oracle at all."""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import topth_ops
from topth_ops.conformance.cases import MIN_GUARD, Shape, random_case
from topth_ops.conformance.compare import TOLERANCES, exact_report, mismatch_report, to_numpy

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def calls(draw):
    num_kv = draw(st.integers(1, 4))
    group = draw(st.integers(1, 5))
    head_dim = draw(st.sampled_from([1, 8, 33, 64, 80]))
    max_seq = draw(st.integers(1, 300))
    lens = draw(st.lists(st.integers(0, max_seq), min_size=1, max_size=4))
    placement = draw(st.sampled_from(["pre_softmax", "post_softmax"]))
    sdc = "none" if placement == "post_softmax" else draw(
        st.sampled_from(["none", "exact", "exp_threshold", "offline"]))
    vmc = draw(st.booleans())
    shape = Shape(tuple(lens), num_kv * group, num_kv, head_dim, max_seq)
    return dict(
        shape=shape,
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        placement=placement,
        sdc=sdc,
        sdc_gamma=draw(st.sampled_from([0.0, 0.05, 1.0])) if sdc == "exp_threshold" else 0.05,
        vmc=vmc,
        value_mean=vmc and draw(st.booleans()),
        scale=draw(st.sampled_from([None, 0.05, 1.0])),
        max_row_id=draw(st.integers(1, max_seq)),
        keep_lo=draw(st.floats(0.0, 0.9)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@SETTINGS
@given(calls())
def test_reference_matches_oracle(c):
    case = random_case(
        "prop", c["shape"], c["dtype"], placement=c["placement"], sdc=c["sdc"],
        sdc_gamma=c["sdc_gamma"], vmc=c["vmc"], value_mean=c["value_mean"], scale=c["scale"],
        max_row_id=c["max_row_id"], keep_range=(c["keep_lo"], min(1.0, c["keep_lo"] + 0.1)),
        seed=c["seed"])
    want = case.oracle()
    assert np.all(want.margin >= MIN_GUARD)
    out, stats = topth_ops.decode_attention(**case.kwargs, return_stats=True, backend="torch")
    rep, _ = mismatch_report("out", to_numpy(out), want.out, **TOLERANCES[c["dtype"]])
    assert rep is None, rep
    assert exact_report("kept", to_numpy(stats.kept), want.kept) is None
    assert exact_report("v_rows", to_numpy(stats.v_rows), want.v_rows) is None
    rep, _ = mismatch_report("dropped", to_numpy(stats.dropped_mass), want.dropped_mass,
                             **TOLERANCES["stats"])
    assert rep is None, rep


@SETTINGS
@given(calls(), st.floats(0.0, 3.0))
def test_raising_thresholds_never_keeps_more(c, delta):
    """kept(theta + delta) is a subset of kept(theta): counts and V rows can only shrink."""
    case = random_case("mono", c["shape"], torch.float32, placement="pre_softmax", seed=c["seed"])
    kw = case.kwargs
    _, st_lo = topth_ops.decode_attention(**kw, return_stats=True)
    kw = dict(kw, thresholds=kw["thresholds"] + delta)
    _, st_hi = topth_ops.decode_attention(**kw, return_stats=True)
    assert torch.all(st_hi.kept <= st_lo.kept)
    assert torch.all(st_hi.v_rows <= st_lo.v_rows)
    # union over a group is at least its largest member and at most the sequence length
    g = c["shape"].num_q_heads // c["shape"].num_kv_heads
    per_group_max = st_lo.kept.view(len(c["shape"].seq_lens), -1, g).amax(-1)
    assert torch.all(st_lo.v_rows >= per_group_max)
    assert torch.all(st_lo.v_rows <= kw["seq_lens"].view(-1, 1))


@SETTINGS
@given(calls())
def test_sdc_exact_with_vmc_reconstructs_dense_weights_sum(c):
    """With exact SDC the kept weights plus beta sum to one: sum w + beta == 1 (section 3.2)."""
    case = random_case("sum", c["shape"], torch.float32, placement="pre_softmax", sdc="exact",
                       vmc=True, seed=c["seed"])
    kw = case.kwargs
    ones = torch.ones_like(kw["value_cache"])
    out, st = topth_ops.decode_attention(**dict(kw, value_cache=ones), return_stats=True)
    live = kw["seq_lens"] > 0
    # V = 1 everywhere: out = sum w + beta * 1 = 1 for every live head
    torch.testing.assert_close(out[live], torch.ones_like(out[live]), atol=1e-5, rtol=0)
