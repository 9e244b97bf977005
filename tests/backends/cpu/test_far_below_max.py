"""Group selection, pre_softmax: a head whose kept rows all lie far below its own maximum
(docs/semantics.md, "The formulas", step 5). The head's maximum sits on a row the group
dropped, so exp(a - m) of its kept rows is subnormal or 0 in float32; the weights must be
taken relative to the maximum over the kept rows. The torch reference and the ``cpu`` kernel
(every SIMD level here, with and without split-KV, BNSD and paged) against the float64
oracle, for every SDC variant, with and without VMC, and gaps from 30 (no rescaling) to 140.
"""

import pytest
import torch

from topth_ops import decode_attention
from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance.compare import TOLERANCES, exact_report, mismatch_report, to_numpy
from topth_ops.conformance.oracle import oracle_decode
from topth_ops.paged import to_paged

from .env_run import run_with_env

LEVELS = cpu_backend.cpu_module().simd_levels()
B, HKV, G, D, S = 2, 2, 3, 32, 300
THETA = 150.0


def far_case(gap: float, dtype: torch.dtype, seed: int = 0):
    """Head 0 of each group scores 200 on about 20 rows (the kept rows: group maximum > 150);
    heads 1 and 2 score about `gap` on a few rows that the group drops (their own maxima),
    and within a few units of 0 on the kept rows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, HKV * G, D)
    for g in range(HKV):
        for h in range(G):
            q[:, g * G + h, h] = 1.0
    k = 0.5 * torch.randn(B, HKV, S, D, generator=gen)
    k[..., :G] = 0.0
    hot = torch.randperm(S, generator=gen)[:20]
    far = torch.randperm(S, generator=gen)[:4]
    far = far[~torch.isin(far, hot)]
    k[:, :, hot, 0] = 200.0
    k[:, :, hot, 1:G] = torch.randn(B, HKV, len(hot), G - 1, generator=gen)
    k[:, :, far, 1] = gap
    k[:, :, far, 2] = gap + 1.0
    v = torch.randn(B, HKV, S, D, generator=gen)
    lens = torch.tensor([S, S - 17])
    th = torch.full((HKV, 1), THETA)
    return q.to(dtype), k.to(dtype), v.to(dtype), lens, th


SDC = [("none", {}), ("exp_threshold", {"sdc_gamma": 0.0}), ("exp_threshold", {"sdc_gamma": 0.5}),
       ("exact", {}), ("offline", {"sdc_table": torch.zeros(HKV * G, 1)}),
       ("offline", {"sdc_table": torch.full((HKV * G, 1), 0.3)})]


def _check(out, stats, want, dtype):
    tol = TOLERANCES[dtype]
    rep, _ = mismatch_report("out", to_numpy(out), want.out, **tol)
    assert rep is None, rep
    assert exact_report("kept", to_numpy(stats.kept), want.kept) is None
    rep, _ = mismatch_report("dropped_mass", to_numpy(stats.dropped_mass), want.dropped_mass, **TOLERANCES["stats"])
    assert rep is None, rep


def _kwargs(q, k, v, lens, th, sdc, extra, vmc, paged):
    kw = dict(query=q, key_cache=k, value_cache=v, seq_lens=lens, thresholds=th, scale=1.0,
              placement="pre_softmax", selection="group", sdc=sdc, vmc=vmc, **extra)
    if paged:
        kc, vc, table = to_paged(k, v, lens, 32, kv_layout="NHD", generator=torch.Generator().manual_seed(1))
        kw.update(key_cache=kc, value_cache=vc, block_table=table, kv_layout="NHD")
    return kw


@pytest.mark.parametrize("gap", [30.0, 95.0, 140.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_reference(gap, dtype):
    q, k, v, lens, th = far_case(gap, dtype)
    for sdc, extra in SDC:
        for vmc in (False, True):
            kw = _kwargs(q, k, v, lens, th, sdc, extra, vmc, paged=False)
            want = oracle_decode(**{n: x for n, x in kw.items() if n not in ("query", "key_cache", "value_cache",
                                                                              "seq_lens", "thresholds")},
                                 query=q, key_cache=k, value_cache=v, seq_lens=lens, thresholds=th)
            out, stats = decode_attention(**kw, backend="torch", return_stats=True)
            _check(out, stats, want, dtype)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("gap", [30.0, 95.0, 140.0])
def test_cpu_levels_and_splits(level, gap):
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, lens, th = far_case(gap, dtype)
        for paged in (False, True):
            for sdc, extra in SDC:
                for vmc in (False, True):
                    kw = _kwargs(q, k, v, lens, th, sdc, extra, vmc, paged)
                    want = oracle_decode(**kw)
                    for split in ("", "1", "40"):
                        out, stats, _ = run_with_env(kw, {"TOPTH_CPU_SIMD": level, "TOPTH_CPU_SPLIT_LEN": split})
                        _check(out, stats, want, dtype)
