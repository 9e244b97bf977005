"""The cube path of the Ascend C kernel on the CPU model (the cube design): a mix kernel
(KERNEL_TYPE_MIX_AIC_1_2) whose cube core computes Q.K^T tiles for its two vector cores.

* the model's cube core: the layouts of its ND2NZ copy, LoadData, Mmad and Fixpipe against
  numpy (the same pipeline the kernel's cube core runs), and each rule it enforces broken on
  purpose by a mini-kernel (L0 capacity and alignment, cube instructions on a vector core,
  Fixpipe before the Mmad it reads, cross-core flags: missing wait, unmatched set, reserved
  id, wrong kernel type, deadlock, counter overflow, overlapping copies of one MTE pipe
  without PipeBarrier, the soft SyncAll in a mix kernel);
* the real kernel broken on purpose (launch option ``fault``, a branch that is false on the
  device): the vector core reading its ring slot before the cube core's flag, the cube core
  overwriting a slot the vector cores have not freed, Fixpipe before Mmad completes, a
  misaligned L0B fractal, the query pad without its MTE2 barrier, and a tiling that plans
  more L0B than the device has;
* both paths forced on a set of shapes (float16 / bfloat16, pre / post_softmax, head / group
  selection, BNSD and paged caches, split and unsplit, group sizes 1 to 20) against the
  float64 oracle, and against each other (same kept sets, outputs within float32 rounding);
* which path the tiling takes, and why.

About 25 s on 2 shared cores.
"""

import numpy as np
import pytest
import torch

from topth_ops import make_inputs
from topth_ops.backends.ascendc import A2_TARGET, problem_shape, run_cpu_model


# ----------------------------------------------------------------------------- the model's cube core

@pytest.mark.parametrize("m,n,k", [(4, 64, 128), (20, 40, 72), (16, 7, 33), (33, 64, 256)])
def test_cube_pipeline_computes_a_times_b_transposed(m, n, k, ascendc_cpu):
    """ND2NZ -> LoadData -> Mmad -> Fixpipe as the kernel's cube core runs them gives
    A . B^T (float16 inputs exact in float32 products; float32 accumulation)."""
    rng = np.random.default_rng(m * n + k)
    a = rng.integers(-3, 4, size=(m, k)).astype(np.float16)
    b = rng.standard_normal((n, k)).astype(np.float16)
    got = np.array(ascendc_cpu.cube_gemm(m, n, k, a.view(np.uint16).ravel().tolist(), b.view(np.uint16).ravel().tolist()))
    n_pad = -(-n // 16) * 16
    got = got.reshape(m, n_pad)[:, :n]
    want = a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_one_row_is_read_as_gemv(ascendc_cpu):
    """m = 1 switches Mmad to GEMV mode on Atlas A2 (A read as one ND row, not Zz): a query
    of one row laid out as Zz fractals gives a wrong product, which is why the kernel always
    pads the group's query to 16 rows (zeros)."""
    rng = np.random.default_rng(1)
    a = rng.integers(1, 4, size=(1, 64)).astype(np.float16)
    b = rng.integers(1, 4, size=(16, 64)).astype(np.float16)
    got = np.array(ascendc_cpu.cube_gemm(1, 16, 64, a.view(np.uint16).ravel().tolist(), b.view(np.uint16).ravel().tolist()))
    assert not np.allclose(got[:16], (a.astype(np.float64) @ b.astype(np.float64).T)[0])


def test_every_cube_selftest_case_is_covered(ascendc_cpu, cube_selftests):
    names = set(ascendc_cpu.selftest_cases())
    assert set(cube_selftests) | {"cube_ok"} <= names


def test_model_rejects_what_the_cube_core_rejects(cube_selftest, cube_selftests, ascendc_cpu):
    # parametrized by the cube_selftest fixture: one test per case of cube_selftests (conftest.py)
    case = cube_selftest
    with pytest.raises(ascendc_cpu.ModelError) as e:
        ascendc_cpu.selftest(case)
    for fragment in cube_selftests[case]:
        assert fragment in str(e.value), str(e.value)


def test_model_accepts_a_correct_cube_to_vector_handover(ascendc_cpu):
    ascendc_cpu.selftest("cube_ok")


# ----------------------------------------------------------------------------- the kernel broken on purpose

def _ring_case(small_int_case, n=700, placement="pre_softmax"):
    rng = np.random.default_rng(7)
    return small_int_case(1, 8, 2, n, 64, [n], torch.float16, placement, rng, keep=0.2)


@pytest.mark.parametrize("fault,needles", [
    # the vector core reads its ring slot before the cube core's FLAG_SCORES_READY
    ("read_ring_before_flag", ["data hazard", "'score_ring'", "FIX (AIC)"]),
    # the cube core writes a slot again without waiting for FLAG_SLOT_FREE
    ("overwrite_ring_slot", ["data hazard", "'score_ring'", "FIX (AIC)"]),
    ("fixpipe_before_mmad", ["Fixpipe (L0C->GM) at topth_cube.h", "FIX (AIC) reads L0C", "M->FIX"]),
    ("l0b_misaligned", ["LoadData (L1->L0) at topth_cube.h", "not 512-byte aligned"]),
    ("no_mte2_barrier", ["DataCopy GM->L1 (ND2NZ) at topth_cube.h", "InitConstValue at topth_cube.h",
                         "PipeBarrier<PIPE_MTE2>()"]),
])
def test_the_model_catches_each_cube_path_bug_in_the_kernel(fault, needles, check_against_oracle, ascendc_cpu,
                                                            small_int_case):
    inputs = _ring_case(small_int_case)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    target = dict(A2_TARGET, cores=4, path="cube")  # 2 AI cores, 11 ring steps per item (ring of 4)
    with pytest.raises(ascendc_cpu.ModelError) as e:
        run_cpu_model(inputs, out, stats, target=target, launch={"fault": fault})
    for needle in needles:
        assert needle in str(e.value), str(e.value)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    run_cpu_model(inputs, out, stats, target=target)  # and without the bug: correct
    check_against_oracle(inputs, out, stats)


def test_a_tiling_that_plans_more_l0b_than_the_device_has_is_caught(small_int_case, check_against_oracle, ascendc_cpu):
    """head_dim 512: two 64-row K tiles need 128 KiB of L0B; the real tiling takes the
    all-vector path (saying why); a tiling told the device has 128 KiB plans them, and the
    model (Atlas A2: 64 KiB) stops the launch at the cube core's InitBuffer."""
    rng = np.random.default_rng(3)
    inputs = small_int_case(1, 2, 1, 96, 512, [96], torch.float16, "pre_softmax", rng)
    t = ascendc_cpu.compute_tiling(problem_shape(inputs), A2_TARGET)
    assert t["path"] == "vector" and "L0B needs 131072 of 65536 bytes" in t["pathReason"]
    out, stats = inputs.empty_outputs(fill=float("nan"))
    with pytest.raises(ascendc_cpu.ModelError, match=r"InitBuffer at topth_cube\.h:\d+: .*65536-byte L0B buffer"):
        run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, l0b_bytes=131072))
    run_cpu_model(inputs, out, stats)
    check_against_oracle(inputs, out, stats)


# ----------------------------------------------------------------------------- both paths forced

PATH_CASES = [
    # dtype, placement, selection, (Hq, Hkv), D, lens, S, cores, layout
    (torch.float16, "pre_softmax", "head", (8, 2), 64, [300, 137], 300, 8, "bnsd"),
    (torch.float16, "pre_softmax", "head", (4, 4), 128, [700], 700, 48, "bnsd"),        # G = 1, split
    (torch.bfloat16, "pre_softmax", "group", (20, 1), 80, [500, 65], 500, 48, "bnsd"),  # G = 20, split
    (torch.float16, "post_softmax", "head", (8, 2), 96, [333, 64], 340, 48, "bnsd"),   # split post
    (torch.bfloat16, "post_softmax", "head", (6, 3), 72, [129], 130, 4, "bnsd"),        # 144-byte rows
    (torch.float16, "pre_softmax", "head", (8, 2), 64, [200, 77], 224, 8, "NHD"),       # paged, bs 32
    (torch.bfloat16, "post_softmax", "head", (4, 1), 128, [300], 320, 48, "HND"),      # paged, split
]


def _path_inputs(small_int_case, dtype, placement, selection, heads, D, lens, S, layout):
    rng = np.random.default_rng(D + S + heads[0])
    base = small_int_case(len(lens), heads[0], heads[1], S, D, lens, dtype, placement, rng, keep=0.25)
    th = base.thresholds
    if selection == "group":  # one threshold per KV head: the first query head's of each group
        th = th[:: heads[0] // heads[1]].contiguous()
    k, v, kw = base.key_cache, base.value_cache, {}
    if layout != "bnsd":
        from topth_ops.paged import to_paged

        k, v, table = to_paged(k, v, base.seq_lens, 32, kv_layout=layout)
        kw = dict(block_table=table, kv_layout=layout)
    return make_inputs(base.query, k, v, base.seq_lens, th, scale=1.0, placement=placement, selection=selection,
                       return_stats=True, **kw)


@pytest.mark.parametrize("dtype,placement,selection,heads,D,lens,S,cores,layout", PATH_CASES)
def test_both_paths_match_the_oracle_and_each_other(dtype, placement, selection, heads, D, lens, S, cores, layout,
                                                    check_against_oracle, small_int_case):
    inputs = _path_inputs(small_int_case, dtype, placement, selection, heads, D, lens, S, layout)
    results = {}
    for path in ("vector", "cube"):
        out, stats = inputs.empty_outputs(fill=float("nan"))
        rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, cores=cores, min_split_len=64, path=path))
        assert rep["tiling"]["path"] == path and rep["cube_path"] == (path == "cube")
        assert rep["kernel_type"] == (5 if path == "cube" else 2)  # MIX_AIC_1_2 / MIX_AIV_1_0
        check_against_oracle(inputs, out, stats)
        results[path] = (out.float().clone(), stats, rep)
    (ov, sv, rv), (oc, sc, rc) = results["vector"], results["cube"]
    assert torch.equal(sv.kept, sc.kept) and torch.equal(sv.v_rows, sc.v_rows)
    torch.testing.assert_close(oc, ov, rtol=2e-2, atol=2e-2)  # each within the dtype tolerance of the oracle
    assert rc["k_bytes"] == rv["k_bytes"] and rc["counters_aiv"]["k_bytes"] == 0
    assert rc["counters"]["mmad_instr"] > 0 and rv["counters"]["mmad_instr"] == 0
    if rv["tiling"]["tileK"] == 64:  # the same selection tiles: the same V copies
        assert rc["v_bytes"] == rv["v_bytes"]


def test_the_cube_path_v_traffic_is_the_kept_union_and_the_ring_carries_the_scores(small_int_case, expected_bytes,
                                                                                   expected_fetch,
                                                                                   check_against_oracle):
    """K bytes = every valid row once per KV group (on the cube cores); V bytes = the fetch
    plan of the float64 kept sets; the ring: one G x 64 float32 tile written by Fixpipe
    and its valid columns read back by the vector core per ring step of each item."""
    rng = np.random.default_rng(12)
    inputs = small_int_case(2, 8, 2, 400, 128, [400, 129], torch.float16, "pre_softmax", rng, keep=0.15)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, cores=8))
    assert rep["tiling"]["path"] == "cube"
    k_bytes, _v, _u = expected_bytes(inputs)
    fetched, _spans = expected_fetch(inputs, rep["tiling"])
    assert rep["k_bytes"] == rep["counters_aic"]["k_bytes"] == k_bytes
    assert rep["v_bytes"] == rep["counters_aiv"]["v_bytes"] == fetched * 128 * 2
    tiles = 2 * (-(-400 // 64) + -(-129 // 64))  # per KV head
    G = 4
    ring = rep["buffers"]["score_ring"]
    assert rep["counters_aic"]["fix_requests"] == tiles
    assert ring["ub_to_gm_bytes"] == 2 * G * ((6 * 64 + 16) + (2 * 64 + 16)) * 4  # Fixpipe's nSize: rows rounded to 16
    assert ring["gm_to_ub_bytes"] == 4 * G * (400 + 129) * 2
    assert rep["buffers"]["workspace"]["gm_to_ub_bytes"] == 0
    check_against_oracle(inputs, out, stats)


# ----------------------------------------------------------------------------- which path runs

@pytest.mark.parametrize("shape,target,path,why", [
    (dict(dtype=0, head_dim=128, num_q_heads=32, num_kv_heads=8), {}, "cube", ""),
    (dict(dtype=1, head_dim=256, num_q_heads=8, num_kv_heads=8), {}, "cube", ""),               # G = 1
    (dict(dtype=2, head_dim=128, num_q_heads=32, num_kv_heads=8), {}, "vector", "float32"),
    (dict(dtype=0, head_dim=512, num_q_heads=4, num_kv_heads=1), {}, "vector", "L0B needs"),
    (dict(dtype=0, head_dim=128, num_q_heads=32, num_kv_heads=8), {"path": "vector"}, "vector", "asked for"),
    (dict(dtype=0, head_dim=128, num_q_heads=32, num_kv_heads=8), {"cores": 1}, "vector", "no AI core"),
    (dict(dtype=0, head_dim=64, num_q_heads=64, num_kv_heads=1), {}, "vector", "unified-buffer plan"),
])
def test_which_path_the_tiling_takes_and_why(shape, target, path, why, ascendc_cpu):
    s = dict(batch=1, max_seq_len=4096, max_row_id=4096, placement=0, sdc=0, vmc=1, scale=1.0, sdc_gamma=0.05, **shape)
    t = ascendc_cpu.compute_tiling(s, dict(A2_TARGET, **target))
    assert t["path"] == path and why in t["pathReason"] and (t["pathReason"] == "") == (path == "cube")
    if path == "cube":
        assert t["aivCount"] == 2 * t["blockDim"] <= 48 and t["ringSlots"] == 4 and t["tileK"] == 64


def test_forcing_the_cube_path_where_it_cannot_run_is_refused(ascendc_cpu):
    s = dict(batch=1, num_q_heads=4, num_kv_heads=1, max_seq_len=512, head_dim=128, max_row_id=512, dtype=2,
             placement=0, sdc=0, vmc=0, scale=1.0, sdc_gamma=0.05)
    with pytest.raises(ValueError, match="the cube path cannot run: float32 inputs"):
        ascendc_cpu.compute_tiling(s, dict(A2_TARGET, path="cube"))


def test_the_path_knob(monkeypatch, small_int_case, check_against_oracle):
    """TOPTH_ASCENDC_PATH chooses the kernel of both Ascend backends (auto / vector / cube);
    anything else makes the backend unavailable with a reason naming the variable."""
    from topth_ops.registry import get_backend

    backend = get_backend("ascendc-cpu")
    rng = np.random.default_rng(2)
    inputs = small_int_case(1, 4, 1, 130, 64, [130], torch.float16, "pre_softmax", rng)
    for path in ("vector", "cube"):
        monkeypatch.setenv("TOPTH_ASCENDC_PATH", path)
        out, stats = inputs.empty_outputs(fill=float("nan"))
        backend.forward(inputs, out, stats)
        assert backend.last_report["tiling"]["path"] == path and backend.bench_counters()["path"] == path
        check_against_oracle(inputs, out, stats)
    monkeypatch.setenv("TOPTH_ASCENDC_PATH", "gpu")
    reasons = backend.unavailable_reasons()
    assert len(reasons) == 1 and reasons[0].startswith("TOPTH_ASCENDC_PATH must be one of auto, vector, cube")
