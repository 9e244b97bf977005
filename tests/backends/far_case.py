"""Inputs for the tests of a head whose kept rows all lie far below its own maximum (group
selection, pre_softmax; docs/semantics.md, "A head's kept rows far below its own maximum"),
shared by the backends' tests: the cases, the SDC variants to run them with, and the keyword
arguments of one call (the case itself is the conformance rule's, far_case)."""

import torch

from topth_ops.conformance.compare import TOLERANCES, exact_report, mismatch_report, to_numpy
from topth_ops.conformance.rules_selection import FAR_SHAPE, FAR_THETA as THETA, far_case, far_reproducer
from topth_ops.paged import to_paged

B, HKV, G, D, S = FAR_SHAPE

SDC = [("none", {}), ("exp_threshold", {"sdc_gamma": 0.0}), ("exp_threshold", {"sdc_gamma": 0.5}),
       ("exact", {}), ("offline", {"sdc_table": torch.zeros(HKV * G, 1)}),
       ("offline", {"sdc_table": torch.full((HKV * G, 1), 0.3)}),
       # near the smallest normal float32: rescaled by exp(m - m_K) it is a few hundred (gap 95)
       ("offline", {"sdc_table": torch.full((HKV * G, 1), 1.2e-38)})]


def split_case(dtype: torch.dtype):
    """Two query heads on one KV head, 64 positions seen as two halves (splits of 32): head 1's
    maximum (100, position 0) is dropped by the group; in the first half it keeps only a row
    200 below it (position 1), in the second half a row 1 below it (position 32). Exact SDC
    then weighs position 32 by e^-1 / (e^-1 + 1 + ...): a split's dropped sum must stay
    finite relative to its own maximum even where its kept rows lie 200 below it."""
    gen = torch.Generator().manual_seed(3)
    d = 16
    q = torch.zeros(1, 2, d)
    q[0, 0, 0] = 1.0
    q[0, 1, 1] = 1.0
    k = torch.zeros(1, 1, 64, d)
    k[0, 0, 0, 1] = 100.0
    k[0, 0, 1, 0], k[0, 0, 1, 1] = 200.0, -100.0
    k[0, 0, 32, 0], k[0, 0, 32, 1] = 200.0, 99.0
    v = torch.randn(1, 1, 64, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor([64]), torch.full((1, 1), THETA)


SPLIT_SDC = [("none", {}), ("exact", {}), ("exp_threshold", {"sdc_gamma": 0.5}),
             ("offline", {"sdc_table": torch.full((2, 1), 0.3)})]


def far_kwargs(q, k, v, lens, th, sdc, extra, vmc, paged):
    kw = dict(query=q, key_cache=k, value_cache=v, seq_lens=lens, thresholds=th, scale=1.0,
              placement="pre_softmax", selection="group", sdc=sdc, vmc=vmc, **extra)
    if paged:
        kc, vc, table = to_paged(k, v, lens, 32, kv_layout="NHD", generator=torch.Generator().manual_seed(1))
        kw.update(key_cache=kc, value_cache=vc, block_table=table, kv_layout="NHD")
    return kw


def check_against_oracle(out, stats, want, dtype, what: str = "") -> None:
    """out within the dtype's tolerance of the float64 oracle's, kept and v_rows equal,
    dropped_mass within the stats tolerance."""
    rep, _ = mismatch_report("out", to_numpy(out), want.out, **TOLERANCES[dtype])
    assert rep is None, f"{what}: {rep}"
    assert exact_report("kept", to_numpy(stats.kept), want.kept) is None, what
    assert exact_report("v_rows", to_numpy(stats.v_rows), want.v_rows, dims=("b", "g")) is None, what
    rep, _ = mismatch_report("dropped_mass", to_numpy(stats.dropped_mass), want.dropped_mass, **TOLERANCES["stats"])
    assert rep is None, f"{what}: {rep}"
