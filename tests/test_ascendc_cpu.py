"""The Ascend C kernel on the CPU model of the Ascend C API (backend ``ascendc-cpu``).

What is checked here, beyond the conformance suite (tests/conformance, which runs every
rule against ascendc-cpu as against any backend):

* exact GM -> UB byte counts, computed independently from the inputs: K bytes = every
  valid K row once per KV group; V bytes = |union over the group's heads of the kept
  positions| x row bytes (no V row outside that union is ever copied);
* the unified buffer: the model's measured peak equals the host tiling's plan and fits
  Atlas A2's 192 KiB for head_dim up to 256; shapes that cannot fit are refused with the
  reason before any launch;
* the model itself: every rule it enforces (bounds, alignment, queue discipline, pipe
  synchronisation, races) raises an error naming the faulty call, and a deliberately
  bad copy in the real kernel launch surfaces as a Python error naming the buffer;
* results against the independent float64 oracle, including the split-KV path
  (flash-decoding across vector cores, combined by log-sum-exp).

The extension is built by the package install; if it is missing these tests fail (they
never skip: the model needs no hardware).
"""

import math

import numpy as np
import pytest
import torch

import topth_ops
from topth_ops import make_inputs
from topth_ops.backends.ascendc import A2_TARGET, problem_shape, run_cpu_model, split_workspace_reads
from topth_ops.conformance.compare import TOLERANCES
from topth_ops.conformance.oracle import oracle_decode
from topth_ops.registry import get_backend, priority, select_backend


def _model():
    from topth_ops.npu_kernels import _ascendc_cpu

    return _ascendc_cpu


def test_extension_is_built():
    """The package install must have built the CPU-model extension."""
    backend = get_backend("ascendc-cpu")
    assert backend.unavailable_reasons() == [], backend.unavailable_reasons()
    assert _model().TILE_W == 64


# ----------------------------------------------------------------------------- helpers

def small_int_case(B, Hq, Hkv, S, D, lens, dtype, placement, rng, keep=0.3, vmc=False):
    """Inputs whose scores are exact small integers (q, k in {-1, 0, 1}, scale 1) and
    thresholds halfway between score levels, so that the kept sets are unambiguous in
    every dtype and the expected sets can be computed independently in float64."""
    q = torch.from_numpy(rng.integers(-1, 2, size=(B, Hq, D)).astype(np.float32))
    k = torch.from_numpy(rng.integers(-1, 2, size=(B, Hkv, S, D)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((B, Hkv, S, D)).astype(np.float32))
    seq = torch.tensor(lens, dtype=torch.int32)
    qd, kd = q.double().numpy(), k.double().numpy()
    G = Hq // Hkv
    th = np.zeros((Hq, S), dtype=np.float64)
    for h in range(Hq):
        # one threshold per head for all row ids: a level so that about `keep` of the
        # valid scores of the first non-empty sequence pass
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
    inputs = make_inputs(q.to(dtype), k.to(dtype), v.to(dtype), seq, thresholds, scale=1.0,
                         placement=placement, vmc=vmc, return_stats=True)
    return inputs


def expected_bytes(inputs):
    """K and V bytes the kernel must copy GM -> UB, from the inputs in float64 (no kernel
    output used): K = sum_b n_b x num_kv_heads rows; V = the union of kept positions."""
    q = inputs.query.double().numpy()
    k = inputs.key_cache.double().numpy()
    th = inputs.thresholds.double().numpy()
    lens = inputs.seq_lens.numpy()
    B, Hq, D = q.shape
    Hkv, G = inputs.num_kv_heads, inputs.group_size
    row_bytes = D * inputs.query.element_size()
    k_rows = v_rows = 0
    unions = np.zeros((B, Hkv), dtype=np.int64)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        row = min(n, th.shape[1]) - 1
        for g in range(Hkv):
            k_rows += n
            union = np.zeros(n, dtype=bool)
            for h in range(g * G, (g + 1) * G):
                a = inputs.scale * (k[b, g, :n] @ q[b, h])
                if inputs.placement == "pre_softmax":
                    kept = a > th[h, row]
                else:
                    lse = a.max() + np.log(np.exp(a - a.max()).sum())
                    kept = (a - lse) > (np.log(th[h, row]) if th[h, row] > 0 else -np.inf)
                union |= kept
            unions[b, g] = union.sum()
            v_rows += int(union.sum())
    return k_rows * row_bytes, v_rows * row_bytes, unions


# ----------------------------------------------------------------------------- byte counts

BYTE_CASES = [
    # B, Hq, Hkv, S, D, lens, dtype, placement, cores (cores small -> no split; 48 -> splits)
    (2, 8, 2, 160, 64, [150, 37], torch.float16, "pre_softmax", 8),
    (3, 9, 3, 200, 80, [200, 0, 63], torch.bfloat16, "post_softmax", 48),
    (1, 4, 1, 1500, 128, [1400], torch.float32, "pre_softmax", 48),
    (1, 4, 1, 1500, 96, [1111], torch.float16, "post_softmax", 48),
    (2, 16, 2, 130, 256, [129, 130], torch.float16, "pre_softmax", 4),
    # rows of 144 bytes (not a whole number of 32-byte blocks): DataCopyPad, padded in UB
    (2, 6, 3, 300, 72, [300, 211], torch.float16, "post_softmax", 48),
]


@pytest.mark.parametrize("B,Hq,Hkv,S,D,lens,dtype,placement,cores", BYTE_CASES)
def test_gm_to_ub_bytes_are_exact(B, Hq, Hkv, S, D, lens, dtype, placement, cores):
    rng = np.random.default_rng(B * 1000 + D)
    inputs = small_int_case(B, Hq, Hkv, S, D, lens, dtype, placement, rng)
    k_bytes, v_bytes, unions = expected_bytes(inputs)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    target = dict(A2_TARGET, cores=cores, min_split_len=64)
    rep = run_cpu_model(inputs, out, stats, target=target)
    assert rep["k_bytes"] == k_bytes
    assert rep["v_bytes"] == v_bytes
    assert 0 < v_bytes < k_bytes  # the thresholds really drop rows
    np.testing.assert_array_equal(stats.v_rows.numpy(), unions)
    # nothing but the kept V rows and the valid K rows is read from the caches
    assert rep["buffers"]["key_cache"]["gm_to_ub_bytes"] == k_bytes
    assert rep["buffers"]["value_cache"]["gm_to_ub_bytes"] == v_bytes
    # workspace reads: the post_softmax scores (float32, every query head and valid position)
    # read back once, plus the split bookkeeping of the plan (0 when unsplit)
    scores = 4 * Hq * sum(lens) if placement == "post_softmax" else 0
    split = split_workspace_reads(rep["tiling"], lens)
    assert (split == 0) == (rep["tiling"]["splitNum"] == 1)
    assert rep["buffers"]["workspace"]["gm_to_ub_bytes"] == scores + split
    if cores == 48:
        assert rep["tiling"]["splitNum"] > 1  # the flash-decoding path was exercised


def test_v_bytes_fall_with_the_kept_fraction():
    rng = np.random.default_rng(7)
    got = []
    for keep in (0.1, 0.3, 0.6):
        inputs = small_int_case(1, 8, 2, 512, 128, [512], torch.float16, "pre_softmax", rng, keep=keep)
        out, stats = inputs.empty_outputs()
        rep = run_cpu_model(inputs, out, stats)
        k_bytes, v_bytes, _ = expected_bytes(inputs)
        assert (rep["k_bytes"], rep["v_bytes"]) == (k_bytes, v_bytes)
        got.append(rep["v_bytes"])
    assert got[0] < got[1] < got[2] < 512 * 2 * 128 * 2


def test_dense_reads_every_valid_v_row_once_and_nothing_past_n():
    rng = np.random.default_rng(3)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    k = torch.randn(2, 2, 96, 64, dtype=torch.float16)
    v = torch.randn(2, 2, 96, 64, dtype=torch.float16)
    k[:, :, 90:] = float("nan")  # tails beyond n: never read
    v[:, :, 90:] = float("nan")
    lens = torch.tensor([90, 5], dtype=torch.int32)
    th = torch.full((4, 96), float("-inf"))
    inputs = make_inputs(q, k, v, lens, th, return_stats=True, placement="pre_softmax")
    out, stats = inputs.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(inputs, out, stats)
    assert rep["k_bytes"] == rep["v_bytes"] == (90 + 5) * 2 * 64 * 2
    assert torch.isfinite(out).all()
    del rng


# ----------------------------------------------------------------------------- unified buffer

@pytest.mark.parametrize("dtype", [0, 1, 2])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads", [(1, 1), (9, 3), (32, 2), (32, 8)])
@pytest.mark.parametrize("placement", [0, 1])
def test_tiling_fits_a2_unified_buffer(dtype, head_dim, heads, placement):
    shape = dict(batch=1, num_q_heads=heads[0], num_kv_heads=heads[1], max_seq_len=32768, head_dim=head_dim,
                 max_row_id=32768, dtype=dtype, placement=placement, sdc=0, vmc=1, scale=1.0, sdc_gamma=0.05)
    t = _model().compute_tiling(shape, A2_TARGET)
    assert t["ubTotal"] <= 196608
    assert t["tileK"] >= 8 and t["tileV"] >= 8
    assert t["blockDim"] <= 48


@pytest.mark.parametrize("dtype,placement", [(torch.float32, "pre_softmax"), (torch.float32, "post_softmax"),
                                             (torch.bfloat16, "post_softmax")])
def test_head_dim_256_runs_within_the_unified_buffer(dtype, placement):
    """The largest conformance shape class (32 q / 2 kv heads, head_dim 256) on the model,
    which fails any InitBuffer past 192 KiB; the measured peak equals the host plan."""
    rng = np.random.default_rng(11)
    inputs = small_int_case(1, 32, 2, 300, 256, [300], dtype, placement, rng)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(inputs, out, stats)
    assert rep["ub_peak"] == rep["tiling"]["ubTotal"] <= rep["ub_capacity"] == 196608
    assert torch.isfinite(out).all()


def test_shapes_that_do_not_fit_are_refused_with_the_reason():
    q = torch.zeros(1, 128, 256)
    k = torch.zeros(1, 1, 16, 256)
    inputs = make_inputs(q, k, k, torch.tensor([16]), torch.zeros(128, 16))
    backend = get_backend("ascendc-cpu")
    reasons = backend.input_reasons(inputs)
    assert len(reasons) == 1 and "unified buffer" in reasons[0] and "196608" in reasons[0]
    with pytest.raises(NotImplementedError, match="unified buffer"):
        topth_ops.decode_attention(q, k, k, torch.tensor([16]), torch.zeros(128, 16), backend="ascendc-cpu")
    with pytest.raises(ValueError, match="does not fit the unified buffer"):
        _model().compute_tiling(problem_shape(inputs), A2_TARGET)


def test_a_smaller_unified_buffer_gets_smaller_tiles():
    shape = dict(batch=1, num_q_heads=8, num_kv_heads=1, max_seq_len=4096, head_dim=128, max_row_id=4096,
                 dtype=0, placement=0, sdc=0, vmc=0, scale=1.0, sdc_gamma=0.05)
    big = _model().compute_tiling(shape, A2_TARGET)
    small = _model().compute_tiling(shape, dict(A2_TARGET, ub_bytes=64 * 1024))
    assert small["tileK"] < big["tileK"] and small["ubTotal"] <= 64 * 1024


# ----------------------------------------------------------------------------- the model's rules

SELFTEST_EXPECT = {
    "gm_out_of_bounds": ["DataCopy GM->UB at selftest.cpp", "'value_cache'", "out of bounds"],
    "ub_misaligned": ["DataCopy GM->UB at selftest.cpp", "not 32-byte aligned"],
    "length_misaligned": ["DataCopy GM->UB at selftest.cpp", "not a positive multiple of 32 bytes"],
    "ub_overflow": ["TPipe::InitBuffer at selftest.cpp", "196608-byte unified buffer"],
    "alloc_exhausted": ["TQue::AllocTensor at selftest.cpp", "missing FreeTensor"],
    "deque_empty": ["TQue::DeQue at selftest.cpp", "is empty"],
    "free_enqueued": ["TQue::FreeTensor at selftest.cpp", "still enqueued"],
    "enque_over_depth": ["TQue::EnQue at selftest.cpp", "its depth"],
    "leak": ["kernel returned with buffer", "still allocated"],
    "use_after_free": ["Exp at selftest.cpp", "used after FreeTensor"],
    "hazard_mte2_v": ["V reads", "MTE2 wrote in DataCopy GM->UB at selftest.cpp", "MTE2->V"],
    "hazard_v_v": ["V reads", "PipeBarrier<PIPE_V>"],
    "hazard_v_s": ["S reads", "V->S"],
    "waitflag_unset": ["WaitFlag at selftest.cpp", "never set"],
    "scalar_read_written_gm": ["GlobalTensor::GetValue at selftest.cpp", "stale"],
    "cross_block_race": ["race on GM", "'out'", "no SyncAll"],
    "readonly_write": ["DataCopy UB->GM at selftest.cpp", "read-only input"],
    "syncall_hang": ["SyncAll at selftest.cpp", "hang"],
}


def test_every_selftest_case_is_covered():
    assert set(_model().selftest_cases()) == set(SELFTEST_EXPECT) | {"ok"}


@pytest.mark.parametrize("case", sorted(SELFTEST_EXPECT))
def test_model_rejects_what_the_device_rejects(case):
    with pytest.raises(_model().ModelError) as e:
        _model().selftest(case)
    for fragment in SELFTEST_EXPECT[case]:
        assert fragment in str(e.value), str(e.value)
    assert isinstance(e.value, RuntimeError)


def test_model_accepts_the_canonical_queue_pipeline():
    _model().selftest("ok")


def test_short_gm_buffer_in_the_real_kernel_is_a_python_error_naming_it():
    """Hand the kernel a value cache one byte shorter than its shape says: the model stops
    the launch where the kernel declares that GM tensor, naming the call and the buffer."""
    rng = np.random.default_rng(5)
    inputs = small_int_case(1, 4, 1, 64, 64, [64], torch.float16, "pre_softmax", rng, keep=1.0)
    out, stats = inputs.empty_outputs()
    from topth_ops.backends.ascendc import kernel_tensors

    t = kernel_tensors(inputs)

    def ptr(x):
        return (x.data_ptr(), x.numel() * x.element_size()) if x is not None else None

    args = {name: ptr(x) for name, x in t.items()}
    args["value_cache"] = (t["value_cache"].data_ptr(), t["value_cache"].numel() * 2 - 1)
    args.update(out=ptr(out), kept=ptr(stats.kept), v_rows=ptr(stats.v_rows), dropped_mass=ptr(stats.dropped_mass))
    with pytest.raises(_model().ModelError,
                       match=r"SetGlobalBuffer at topth_decode_attn\.cpp:\d+: declares 8192 bytes .*'value_cache', which has 8191"):
        _model().run(args, problem_shape(inputs), A2_TARGET)


# ----------------------------------------------------------------------------- float64 oracle

def _check_against_oracle(inputs, out, stats):
    want = oracle_decode(inputs.query, inputs.key_cache, inputs.value_cache, inputs.seq_lens, inputs.thresholds,
                         scale=inputs.scale, placement=inputs.placement, sdc=inputs.sdc, sdc_gamma=inputs.sdc_gamma,
                         sdc_table=inputs.sdc_table, vmc=inputs.vmc, value_mean=inputs.value_mean)
    tol = TOLERANCES[inputs.dtype]
    np.testing.assert_allclose(out.double().numpy(), want.out, atol=tol["atol"], rtol=tol["rtol"])
    np.testing.assert_array_equal(stats.kept.numpy(), want.kept)
    np.testing.assert_array_equal(stats.v_rows.numpy(), want.v_rows)
    np.testing.assert_allclose(stats.dropped_mass.double().numpy(), want.dropped_mass, atol=1e-5, rtol=1e-4)


ORACLE_CASES = [
    # placement, sdc, vmc, dtype, head_dim, (Hq, Hkv), lens, S, cores
    ("pre_softmax", "exp_threshold", True, torch.float16, 80, (9, 3), [97, 0, 33], 100, 48),
    ("pre_softmax", "exact", False, torch.bfloat16, 64, (8, 2), [700], 760, 48),
    ("pre_softmax", "offline", True, torch.float32, 96, (4, 4), [5, 64], 70, 4),
    ("post_softmax", "none", True, torch.float16, 128, (10, 2), [777, 1], 800, 48),
    ("pre_softmax", "exact", True, torch.float32, 36, (4, 2), [250, 3], 260, 48),  # 144-byte rows
    ("post_softmax", "none", False, torch.bfloat16, 72, (3, 1), [129], 140, 2),
]


@pytest.mark.parametrize("placement,sdc,vmc,dtype,D,heads,lens,S,cores", ORACLE_CASES)
def test_matches_the_float64_oracle(placement, sdc, vmc, dtype, D, heads, lens, S, cores):
    rng = np.random.default_rng(D + S)
    inputs = small_int_case(len(lens), heads[0], heads[1], S, D, lens, dtype, placement, rng, keep=0.25)
    table = torch.rand(heads[0], S) * 3 if sdc == "offline" else None
    vm = torch.randn(len(lens), heads[1], D) if (vmc and sdc == "offline") else None
    inputs = make_inputs(inputs.query, inputs.key_cache, inputs.value_cache, inputs.seq_lens, inputs.thresholds,
                         scale=1.0, placement=placement, sdc=sdc, sdc_table=table, vmc=vmc, value_mean=vm,
                         return_stats=True)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, cores=cores, min_split_len=32))
    _check_against_oracle(inputs, out, stats)
    if cores == 48:
        assert rep["tiling"]["splitNum"] > 1


def test_result_does_not_depend_on_the_core_count():
    """Splitting the sequence over 1, 5 or 48 vector cores changes the summation order
    only: stats identical, outputs within float32 rounding."""
    rng = np.random.default_rng(21)
    inputs = small_int_case(1, 8, 1, 2048, 64, [2000], torch.float32, "post_softmax", rng, keep=0.2)
    results = []
    for cores in (1, 5, 48):
        out, stats = inputs.empty_outputs(fill=float("nan"))
        rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, cores=cores, min_split_len=64))
        results.append((out.clone(), stats, rep["tiling"]["splitNum"]))
    assert [r[2] for r in results] == [1, 5, 32]
    for out, stats, _ in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=2e-6, rtol=1e-5)
        assert torch.equal(stats.kept, results[0][1].kept) and torch.equal(stats.v_rows, results[0][1].v_rows)


# ----------------------------------------------------------------------------- registry

def test_selection_never_picks_the_model_automatically():
    q = torch.randn(1, 2, 64)
    k = torch.randn(1, 1, 8, 64)
    inputs = make_inputs(q, k, k, torch.tensor([8]), torch.zeros(2, 8))
    assert select_backend(inputs).name == "torch"
    assert "ascendc-cpu" not in priority("cpu")
    assert priority("npu")[0] == "ascendc"
    out = topth_ops.decode_attention(q, k, k, torch.tensor([8]), torch.zeros(2, 8), backend="ascendc-cpu")
    torch.testing.assert_close(out, topth_ops.decode_attention(q, k, k, torch.tensor([8]), torch.zeros(2, 8)))


def test_npu_backend_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    reasons = get_backend("ascendc").unavailable_reasons()
    assert any("ASCEND_HOME_PATH" in r for r in reasons)
    assert any("_ascendc_npu" in r for r in reasons)
