"""Inputs and independent expectations for the tests of the Ascend C kernel on the CPU model
(tests/backends/ascendc/), as fixtures: ``ascendc_cpu`` (the compiled model) and
``small_int_case``, ``kept_sets``, ``expected_bytes``, ``expected_fetch``,
``check_against_oracle`` and ``shape_dict`` (each the function of that name); the cube
core's self-test cases and the errors they must raise (``cube_selftests``, and
``cube_selftest``: each case in turn), which test_ascendc_cpu_cube.py runs and
test_ascendc_cpu_model.py counts among every case the model has.

Scores here are exact small integers (q, k in {-1, 0, 1}, scale 1) and thresholds sit
halfway between score levels, so kept sets are unambiguous in every dtype and can be
computed independently in float64 (never from the kernel under test).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from topth_ops import make_inputs
from topth_ops.conformance.compare import TOLERANCES
from topth_ops.conformance.oracle import oracle_decode


# cube-core self-test mini-kernels of the CPU model -> fragments of the error each must raise
_CUBE_SELFTESTS = {
    "cube_op_on_aiv": ["LoadData (L1->L0) at selftest_cube.cpp", "cube-core instruction on a vector core"],
    "l0_overflow": ["TPipe::InitBuffer at selftest_cube.cpp", "65536-byte L0B buffer"],
    "l0_misaligned": ["LoadData (L1->L0) at selftest_cube.cpp", "L0B address 32 is not 512-byte aligned"],
    "fixpipe_before_mmad": ["FIX (AIC) reads L0C", "which M (AIC) wrote in Mmad at selftest_cube.cpp", "M->FIX"],
    "cross_wait_missing": ["data hazard", "'out'", "FIX (AIC)", "CrossCoreSetFlag"],
    "cross_flag_unmatched": ["CrossCoreSetFlag(3) that no CrossCoreWaitFlag on AIV0 took"],
    "cross_flag_reserved_id": ["CrossCoreSetFlag at selftest_cube.cpp", "flag id 12 outside [0, 10]"],
    "cross_flag_vector_kernel": ["CrossCoreSetFlag at selftest_cube.cpp", "mix kernel type with cube cores"],
    "cross_flag_deadlock": ["CrossCoreWaitFlag(4) at selftest_cube.cpp", "deadlock"],
    "cross_flag_counter_overflow": ["counter of flag 5 on block 0 AIV0 would exceed 15"],
    "mte2_overlap_no_barrier": ["MTE2 (AIC) writes L1", "which MTE2 (AIC) wrote in InitConstValue", "PipeBarrier<PIPE_MTE2>()"],
    "nd2nz_overlap": ["DataCopy GM->L1 (ND2NZ) at selftest_cube.cpp", "column blocks overlap"],
    "soft_syncall_mix_aiv_only": ["SyncAll<true>(gm, ub, n) at selftest_cube.cpp", "share one slot"],
}


def _model():
    from topth_ops.npu_kernels import _ascendc_cpu

    return _ascendc_cpu


def _small_int_case(B, Hq, Hkv, S, D, lens, dtype, placement, rng, keep=0.3, vmc=False):
    """Inputs whose scores are exact small integers (q, k in {-1, 0, 1}, scale 1) and
    thresholds halfway between score levels (one per head, all row ids), so that the kept
    sets are unambiguous in every dtype."""
    q = torch.from_numpy(rng.integers(-1, 2, size=(B, Hq, D)).astype(np.float32))
    k = torch.from_numpy(rng.integers(-1, 2, size=(B, Hkv, S, D)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((B, Hkv, S, D)).astype(np.float32))
    seq = torch.tensor(lens, dtype=torch.int32)
    qd, kd = q.double().numpy(), k.double().numpy()
    G = Hq // Hkv
    th = np.zeros((Hq, S), dtype=np.float64)
    for h in range(Hq):
        # a level so that about `keep` of the valid scores of the first non-empty sequence pass
        b0 = next(b for b in range(B) if lens[b] > 0)
        a = kd[b0, h // G, : lens[b0]] @ qd[b0, h]
        if placement == "pre_softmax":
            levels = np.unique(a)
            cut = np.quantile(a, 1 - keep)
            lv = levels[levels <= cut].max() if (levels <= cut).any() else levels.min() - 1
            th[h, :] = lv + 0.5
        else:
            logp = a - (a.max() + np.log(np.exp(a - a.max()).sum()))
            levels = np.unique(logp)
            cut = np.quantile(logp, 1 - keep)
            lo = levels[levels <= cut].max() if (levels <= cut).any() else levels.min() - 1
            th[h, :] = math.exp(lo + 0.5)  # ln(theta) halfway between log-probability levels
    thresholds = torch.from_numpy(th.astype(np.float32))
    return make_inputs(q.to(dtype), k.to(dtype), v.to(dtype), seq, thresholds, scale=1.0,
                       placement=placement, vmc=vmc, return_stats=True)


def _kept_sets(inputs):
    """Per (b, kv head): the float64 union of kept positions over the group's heads
    (head selection, 2-D thresholds, BNSD caches), as a list of lists of bool arrays."""
    q = inputs.query.double().numpy()
    k = inputs.key_cache.double().numpy()
    th = inputs.thresholds.double().numpy()
    lens = inputs.seq_lens.numpy()
    B, Hq, _D = q.shape
    Hkv, G = inputs.num_kv_heads, inputs.group_size
    out = []
    for b in range(B):
        n = int(lens[b])
        per = []
        for g in range(Hkv):
            union = np.zeros(n, dtype=bool)
            if n:
                row = min(n, th.shape[1]) - 1
                for h in range(g * G, (g + 1) * G):
                    a = inputs.scale * (k[b, g, :n] @ q[b, h])
                    if inputs.placement == "pre_softmax":
                        kept = a > th[h, row]
                    else:
                        lse = a.max() + np.log(np.exp(a - a.max()).sum())
                        kept = (a - lse) > (np.log(th[h, row]) if th[h, row] > 0 else -np.inf)
                    union |= kept
            per.append(union)
        out.append(per)
    return out


def _expected_bytes(inputs):
    """K and V bytes the kernel must copy GM -> UB, from the inputs in float64 (no kernel
    output used): K = sum_b n_b x num_kv_heads rows; V = the union of kept positions."""
    row_bytes = inputs.head_dim * inputs.query.element_size()
    sets = _kept_sets(inputs)
    lens = inputs.seq_lens.numpy()
    k_rows = int(sum(int(n) for n in lens)) * inputs.num_kv_heads
    unions = np.array([[int(u.sum()) for u in per] for per in sets], dtype=np.int64)
    return k_rows * row_bytes, int(unions.sum()) * row_bytes, unions


def _expected_fetch(inputs, tiling, kept=None):
    """V rows the kernel must copy and its copy spans, computed here from the float64 kept
    sets (not by the code under test): per selection tile (tileK positions in pre_softmax, 64
    in post_softmax) of each piece of the split plan, a run of kept positions is joined with the next one when the last byte of
    the one and the first byte of the other lie in the same tiling["mergeGapBytes"] GM
    granule inside one cache block. Returns (fetched rows, spans)."""
    from topth_ops.backends.ascendc import split_plan

    kept = kept if kept is not None else _kept_sets(inputs)
    lens = [int(n) for n in inputs.seq_lens.clamp(0, inputs.max_seq_len).tolist()]
    _u, pieces = split_plan(tiling, lens)
    e = inputs.query.element_size()
    bs, granule = tiling["blockSize"], tiling["mergeGapBytes"]
    strides = np.array([tiling["vStrideBlk"], tiling["vStrideH"], tiling["vStrideSlot"]], dtype=np.int64)
    table = inputs.block_table.numpy().astype(np.int64) if inputs.paged else None
    row_bytes = inputs.head_dim * e
    width = tiling["tileK"] if inputs.placement == "pre_softmax" else 64  # positions selected together
    fetched = spans = 0
    for b, n in enumerate(lens):
        step = -(-n // pieces[b]) if pieces[b] > 1 else max(n, 1)
        for g, union in enumerate(kept[b]):
            pos_all = np.arange(n)
            blk = table[b, pos_all // bs] if table is not None else np.full(n, b)
            start = (blk * strides[0] + g * strides[1] + (pos_all % bs) * strides[2]) * e  # byte offsets
            for c0 in range(0, n, step):
                for t0 in range(c0, min(n, c0 + step), width):
                    j = t0 + np.flatnonzero(union[t0:min(n, c0 + step, t0 + width)])
                    if j.size == 0:
                        continue
                    adjacent = np.diff(j) == 1
                    same_block = j[:-1] // bs == j[1:] // bs
                    same_granule = ((start[j[:-1]] + row_bytes - 1) // granule == start[j[1:]] // granule
                                    if granule else np.zeros(j.size - 1, dtype=bool))
                    join = adjacent | (same_block & same_granule)
                    spans += 1 + int((~join).sum())
                    fetched += int(j.size + (np.diff(j) - 1)[join].sum())
    return fetched, spans


def _check_against_oracle(inputs, out, stats):
    """Output within the dtype tolerance and stats exactly against the float64 oracle."""
    want = oracle_decode(inputs.query, inputs.key_cache, inputs.value_cache, inputs.seq_lens, inputs.thresholds,
                         scale=inputs.scale, placement=inputs.placement, sdc=inputs.sdc, sdc_gamma=inputs.sdc_gamma,
                         sdc_table=inputs.sdc_table, vmc=inputs.vmc, value_mean=inputs.value_mean,
                         block_table=inputs.block_table, kv_layout=inputs.kv_layout if inputs.paged else None,
                         selection=inputs.selection, threshold_set=inputs.threshold_set)
    tol = TOLERANCES[inputs.dtype]
    np.testing.assert_allclose(out.double().numpy(), want.out, atol=tol["atol"], rtol=tol["rtol"])
    np.testing.assert_array_equal(stats.kept.numpy(), want.kept)
    np.testing.assert_array_equal(stats.v_rows.numpy(), want.v_rows)
    np.testing.assert_allclose(stats.dropped_mass.double().numpy(), want.dropped_mass, atol=1e-5, rtol=1e-4)


def _shape_dict(B, Hq, Hkv, S, D, dtype, placement, vmc=0):
    """A problem-shape dict for compute_tiling (BNSD, contiguous, head selection)."""
    return dict(batch=B, num_q_heads=Hq, num_kv_heads=Hkv, max_seq_len=S, head_dim=D, max_row_id=S, dtype=dtype,
                placement=placement, sdc=0, vmc=vmc, scale=1.0, sdc_gamma=0.05)


@pytest.fixture(scope="session")
def ascendc_cpu():
    """The compiled CPU model of the Ascend C API (topth_ops.npu_kernels._ascendc_cpu)."""
    return _model()


@pytest.fixture(scope="session")
def small_int_case():
    return _small_int_case


@pytest.fixture(scope="session")
def kept_sets():
    return _kept_sets


@pytest.fixture(scope="session")
def expected_bytes():
    return _expected_bytes


@pytest.fixture(scope="session")
def expected_fetch():
    return _expected_fetch


@pytest.fixture(scope="session")
def check_against_oracle():
    return _check_against_oracle


@pytest.fixture(scope="session")
def shape_dict():
    return _shape_dict


@pytest.fixture(scope="session")
def cube_selftests():
    return _CUBE_SELFTESTS


@pytest.fixture(params=sorted(_CUBE_SELFTESTS))
def cube_selftest(request):
    return request.param
