"""The Ascend C kernel on the CPU model on a head whose kept rows all lie far below its own
maximum (group selection, pre_softmax; docs/semantics.md, "A head's kept rows far below its own
maximum"): the head's maximum sits on a row the group dropped, so exp(a - m) of its kept rows
is subnormal or 0 in float32, and the kernel must take its kept weights relative to the
maximum over its kept rows. Against the float64 oracle: the reproducer of docs/semantics.md,
far_case with gaps from 30 (no rescaling) to 200, every SDC variant (and a subnormal offline
table value), with and without VMC, BNSD and paged caches, float32 / float16 / bfloat16, both
paths (cube and all-vector), with and without split-KV (min_split_len forces splits); and
far_case.split_case (a split whose kept rows lie 200 below its own maximum, merged with one
whose kept row lies 1 below it).
"""

import pytest
import torch

from topth_ops import make_inputs
from topth_ops.backends.ascendc import A2_TARGET, run_cpu_model, split_plan, split_workspace_reads
from topth_ops.conformance.oracle import oracle_decode

from ..far_case import G, HKV, SDC, SPLIT_SDC, check_against_oracle as _check, far_case, far_kwargs, far_reproducer, split_case

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the shared variants, and a subnormal table value (ln |x| taken from its bits in the kernel)
FAR_SDC = SDC + [("offline", {"sdc_table": torch.full((HKV * G, 1), 1e-40)})]
# cores, min_split_len: no split; splits of >= 40 positions; as many splits as cores allow
SPLITS = {"whole": dict(cores=4), "split40": dict(min_split_len=40), "split1": dict(min_split_len=1)}


def _paths(dtype):
    return ["vector"] if dtype == torch.float32 else ["cube", "vector"]


def _run(kw, split, path):
    inputs = make_inputs(**kw, return_stats=True)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, path=path, **SPLITS[split]))
    assert rep["tiling"]["path"] == path
    return out, stats, rep


@pytest.mark.parametrize("x", [30.0, 87.0, 90.0, 104.0, 120.0, 149.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_semantics_reproducer(x, dtype):
    """docs/semantics.md: q0 = e0, q1 = e1, K rows [200 e0, x e1], V all ones, theta = 150:
    head 1 keeps only row 0 (score 0, x below its maximum) and returns 1."""
    kw = far_reproducer(dtype, x)
    want = oracle_decode(**kw)
    assert want.out.tolist() == [[[1.0] * 16] * 2]
    for path in _paths(dtype):
        out, stats, _ = _run(kw, "whole", path)
        _check(out, stats, want, dtype, path)


@pytest.mark.parametrize("gap,hot", [(30.0, 200.0), (87.0, 200.0), (95.0, 200.0), (140.0, 200.0), (200.0, 300.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_far_case(gap, hot, dtype):
    case = far_case(gap, dtype, hot=hot)
    for paged in (False, True):
        for sdc, extra in FAR_SDC:
            for vmc in (False, True):
                kw = far_kwargs(*case, sdc, extra, vmc, paged)
                want = oracle_decode(**kw)
                for split in SPLITS:
                    for path in _paths(dtype):
                        out, stats, _ = _run(kw, split, path)
                        _check(out, stats, want, dtype, (paged, sdc, extra, vmc, split, path))


def test_far_case_splits_used():
    """The split settings above really split far_case's sequences (300 and 283 positions;
    "whole" does not), and the combine reads exactly the split bookkeeping
    split_workspace_reads counts (with the pieces' kept maxima)."""
    kw = far_kwargs(*far_case(95.0, torch.float16), "exact", {}, False, paged=False)
    lens = kw["seq_lens"].tolist()
    for split, want in (("whole", [1, 1]), ("split40", [7, 7]), ("split1", [12, 12])):
        for path in ("cube", "vector"):
            _, _, rep = _run(kw, split, path)
            assert split_plan(rep["tiling"], lens)[1] == want, (split, path)
            assert (rep["sync_all_calls"] > 0) == (want[0] > 1)
            reads = split_workspace_reads(rep["tiling"], lens)
            assert rep["buffers"]["workspace"]["gm_to_ub_bytes"] == reads, (split, path)
            if want[0] > 1:  # M and the kept maxima of every piece, the pieces' records
                pw, rec = 4 * rep["tiling"]["pairWidth"], 4 * rep["tiling"]["partFloats"]
                assert reads == 2 * sum(p * (2 * pw + rec) for p in want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_dropped_sum(dtype):
    """far_case.split_case: two splits of 32 (min_split_len 32) and one split per 5 positions,
    the first split's kept rows 200 below its own maximum."""
    case = split_case(dtype)
    for sdc, extra in SPLIT_SDC:
        for vmc in (False, True):
            kw = far_kwargs(*case, sdc, extra, vmc, paged=False)
            want = oracle_decode(**kw)
            for target in (dict(cores=4), dict(min_split_len=32), dict(min_split_len=5)):
                for path in _paths(dtype):
                    inputs = make_inputs(**kw, return_stats=True)
                    out, stats = inputs.empty_outputs(fill=float("nan"))
                    run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, path=path, **target))
                    _check(out, stats, want, dtype, (sdc, extra, vmc, target, path))
