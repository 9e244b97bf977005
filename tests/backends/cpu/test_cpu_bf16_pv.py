"""P.V of bfloat16 caches on every SIMD level of this machine, on kept lists long enough
for the strided visit order (>= 256 kept rows, at most 3/4 of the range: the weights of a
block are gathered) and on odd and even kept counts, for head blocks of 1-4 heads and head
dims that are and are not multiples of 32. Float64 oracle, the contract's bfloat16
tolerance; the rows past each length are NaN, so a read past a sequence's length would show
(a pairwise variant that dropped an odd last row failed here, 10 of 48 cases, and passed
the 120-example rows fuzz)."""

import pytest
import torch

from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance.cases import Shape, paged_case, random_case
from topth_ops.conformance.compare import TOLERANCES, exact_report, mismatch_report, to_numpy

from .env_run import run_with_env

LEVELS = cpu_backend.cpu_module().simd_levels()
CASES = [  # (q heads, kv heads, head_dim, lengths, keep range, layout)
    (3, 1, 64, (1201, 700, 3), (0.3, 0.35), "BNSD"),
    (8, 2, 128, (1031, 257), (0.5, 0.6), "BNSD"),
    (5, 1, 256, (999,), (0.6, 0.7), "HND"),
    (4, 4, 32, (1500, 1), (0.2, 0.25), "NHD"),
    (2, 2, 96, (1100, 511), (0.4, 0.45), "BNSD"),
    (9, 3, 64, (800, 801), (1.0, 1.0), "BNSD"),
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case_idx", range(len(CASES)))
@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
def test_bf16_pv_long_scattered_lists(level, case_idx, placement):
    hq, hkv, d, lens, keep, layout = CASES[case_idx]
    shape = Shape(lens, hq, hkv, d, max(lens))
    case = random_case("pv", shape, torch.bfloat16, placement=placement, vmc=case_idx % 2 == 0, keep_range=keep,
                       seed=1000 + case_idx)
    kw = paged_case(case, 32, layout, seed=case_idx).kwargs if layout != "BNSD" else case.kwargs
    out, stats, counters = run_with_env(kw, {cpu_backend.ENV_SIMD: level})
    assert counters["simd"] == level
    want = case.oracle()
    rep, _ = mismatch_report("out", to_numpy(out), want.out, **TOLERANCES[torch.bfloat16])
    assert rep is None, rep
    assert exact_report("v_rows", to_numpy(stats.v_rows), want.v_rows) is None
    kept = want.v_rows.max()
    assert kept >= 1
