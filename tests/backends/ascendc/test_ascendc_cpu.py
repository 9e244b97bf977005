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

import numpy as np
import pytest
import torch

import topth_ops
from topth_ops import make_inputs
from topth_ops.backends.ascendc import A2_TARGET, problem_shape, run_cpu_model, split_plan, split_workspace_reads
from topth_ops.registry import get_backend, priority, select_backend


UB_LIMIT = 196608 - 8192  # Atlas A2's unified buffer less the 8 KiB the Ascend C API reserves


def test_extension_is_built(ascendc_cpu):
    """The package install must have built the CPU-model extension."""
    backend = get_backend("ascendc-cpu")
    assert backend.unavailable_reasons() == [], backend.unavailable_reasons()
    assert ascendc_cpu.TILE_W == 64
    assert backend.features == frozenset({"paged", "group_selection", "threshold_sets"})


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
def test_gm_to_ub_bytes_are_exact(B, Hq, Hkv, S, D, lens, dtype, placement, cores, small_int_case, expected_bytes,
                                  expected_fetch):
    rng = np.random.default_rng(B * 1000 + D)
    inputs = small_int_case(B, Hq, Hkv, S, D, lens, dtype, placement, rng)
    k_bytes, v_bytes, unions = expected_bytes(inputs)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    target = dict(A2_TARGET, cores=cores, min_split_len=64)
    rep = run_cpu_model(inputs, out, stats, target=target)
    fetched, spans = expected_fetch(inputs, rep["tiling"])
    row = D * inputs.query.element_size()
    assert rep["k_bytes"] == k_bytes
    assert rep["v_bytes"] == fetched * row >= v_bytes  # kept rows, and the rows between merged runs
    assert 0 < v_bytes < k_bytes  # the thresholds really drop rows
    np.testing.assert_array_equal(stats.v_rows.numpy(), unions)
    # nothing but the fetched V rows and the valid K rows is read from the caches
    assert rep["buffers"]["key_cache"]["gm_to_ub_bytes"] == k_bytes
    assert rep["buffers"]["value_cache"]["gm_to_ub_bytes"] == fetched * row
    # without merging: exactly the kept-union rows
    out2, stats2 = inputs.empty_outputs(fill=float("nan"))
    rep2 = run_cpu_model(inputs, out2, stats2, target=dict(target, merge_gap_bytes=0))
    assert rep2["v_bytes"] == v_bytes and torch.equal(stats2.v_rows, stats.v_rows)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    # workspace reads: the post_softmax scores (float32, every query head and valid position)
    # read back once, plus the split bookkeeping of the plan (0 when unsplit)
    scores = 4 * Hq * sum(lens) if placement == "post_softmax" else 0
    split = split_workspace_reads(rep["tiling"], lens)
    splits, pieces = split_plan(rep["tiling"], lens)
    assert (split == 0) == (max(pieces) <= 1)
    assert rep["buffers"]["workspace"]["gm_to_ub_bytes"] == scores + split
    if cores == 48:
        assert splits > 1 and max(pieces) > 1  # the flash-decoding path was exercised


def test_v_bytes_fall_with_the_kept_fraction(small_int_case, expected_bytes):
    rng = np.random.default_rng(7)
    got = []
    for keep in (0.1, 0.3, 0.6):
        inputs = small_int_case(1, 8, 2, 512, 128, [512], torch.float16, "pre_softmax", rng, keep=keep)
        out, stats = inputs.empty_outputs()
        rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, merge_gap_bytes=0))
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
def test_tiling_fits_a2_unified_buffer(dtype, head_dim, heads, placement, ascendc_cpu):
    shape = dict(batch=1, num_q_heads=heads[0], num_kv_heads=heads[1], max_seq_len=32768, head_dim=head_dim,
                 max_row_id=32768, dtype=dtype, placement=placement, sdc=0, vmc=1, scale=1.0, sdc_gamma=0.05)
    t = ascendc_cpu.compute_tiling(shape, A2_TARGET)
    assert t["ubTotal"] <= t["ubLimit"] == UB_LIMIT
    assert t["tileK"] >= 8 and t["tileV"] >= 8
    assert t["blockDim"] <= 48


@pytest.mark.parametrize("dtype,placement", [(torch.float32, "pre_softmax"), (torch.float32, "post_softmax"),
                                             (torch.bfloat16, "post_softmax")])
def test_head_dim_256_runs_within_the_unified_buffer(dtype, placement, small_int_case):
    """The largest conformance shape class (32 q / 2 kv heads, head_dim 256) on the model,
    which fails any InitBuffer past 192 KiB; the measured peak equals the host plan."""
    rng = np.random.default_rng(11)
    inputs = small_int_case(1, 32, 2, 300, 256, [300], dtype, placement, rng)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(inputs, out, stats)
    assert rep["ub_peak"] == rep["tiling"]["ubTotal"] <= UB_LIMIT and rep["ub_capacity"] == 196608
    assert torch.isfinite(out).all()


def test_shapes_that_do_not_fit_are_refused_with_the_reason(ascendc_cpu):
    q = torch.zeros(1, 128, 256)
    k = torch.zeros(1, 1, 16, 256)
    inputs = make_inputs(q, k, k, torch.tensor([16]), torch.zeros(128, 16))
    backend = get_backend("ascendc-cpu")
    reasons = backend.input_reasons(inputs)
    assert len(reasons) == 1 and "unified buffer" in reasons[0] and "196608 less the 8192" in reasons[0]
    with pytest.raises(NotImplementedError, match="unified buffer"):
        topth_ops.decode_attention(q, k, k, torch.tensor([16]), torch.zeros(128, 16), backend="ascendc-cpu")
    with pytest.raises(ValueError, match="does not fit the unified buffer"):
        ascendc_cpu.compute_tiling(problem_shape(inputs), A2_TARGET)


def test_splitting_never_refuses_a_shape_that_runs_unsplit(ascendc_cpu, shape_dict):
    """The split bookkeeping (combine record, per-split maxima, SyncAll area) costs unified
    buffer: the tiling must fall back to fewer splits, down to none, before refusing.
    Reviewer's repros: G=48, D=128 fp32 post_softmax refused from max_seq_len 513 on;
    G=40 fp16 post at 4096."""
    checked = 0
    for G in (1, 8, 24, 32, 40, 45, 48, 52, 57):
        for D in (64, 128, 256):
            for dtype in (0, 2):
                for placement in (0, 1):
                    for S in (513, 2048, 32768):
                        shape = shape_dict(1, G, 1, S, D, dtype, placement, vmc=1)
                        try:
                            ascendc_cpu.compute_tiling(shape, dict(A2_TARGET, cores=1))
                        except ValueError:
                            continue  # the group does not fit one core even unsplit
                        t = ascendc_cpu.compute_tiling(shape, A2_TARGET)
                        assert t["ubTotal"] <= UB_LIMIT
                        checked += 1
    assert checked > 200
    # fewer splits, not necessarily none: 36 heads of 128 fp16 post_softmax at 32k keep a split
    # (the all-vector kernel; the cube path's plan is smaller)
    vec = dict(A2_TARGET, path="vector")
    t = ascendc_cpu.compute_tiling(shape_dict(1, 36, 1, 32768, 128, 0, 1, vmc=1), vec)
    big = ascendc_cpu.compute_tiling(shape_dict(1, 36, 1, 32768, 128, 0, 1, vmc=1), dict(vec, ub_bytes=1 << 20))
    assert 1 < t["splitCap"] < big["splitCap"]


def test_ub_heavy_plans_of_issue_14_fit_below_the_api_reserve_or_are_refused(shape_dict, ascendc_cpu):
    """The plans the issue found above 188416 bytes (G=24/d256 fp16 post ~196448, G=48/d128
    fp32 post ~192704, G=36, G=40): each now either fits below the API's reserved 8 KiB
    (smaller tiles, fewer splits) or is refused naming the reserve; never planned over it."""
    outcomes = {}
    for G, D, dtype in ((24, 256, 0), (48, 128, 2), (36, 128, 0), (40, 128, 0), (36, 128, 2), (40, 128, 2)):
        shape = shape_dict(1, G, 1, 32768, D, dtype, 1, vmc=1)
        try:
            t = ascendc_cpu.compute_tiling(shape, A2_TARGET)
        except ValueError as e:
            assert "196608 less the 8192 bytes the Ascend C API reserves" in str(e)
            outcomes[(G, D, dtype)] = "refused"
            continue
        assert t["ubTotal"] <= UB_LIMIT
        outcomes[(G, D, dtype)] = (t["tileK"], t["tileV"], t["splitCap"])
    assert outcomes[(48, 128, 2)] == "refused" and outcomes[(24, 256, 0)] != "refused"


def test_a_group_too_large_for_one_core_is_refused_naming_the_group(ascendc_cpu, shape_dict):
    """MQA 71:1 at head_dim 128 fp16 (a group's query, accumulators and score tiles exceed
    one vector core's unified buffer even unsplit): refused, and the reason says so."""
    with pytest.raises(ValueError) as e:
        ascendc_cpu.compute_tiling(shape_dict(1, 71, 1, 4096, 128, 0, 0), A2_TARGET)
    msg = str(e.value)
    assert "no split of the KV sequence" in msg and "group size 71" in msg and "196608" in msg


def test_a_smaller_unified_buffer_gets_smaller_tiles(ascendc_cpu):
    shape = dict(batch=1, num_q_heads=8, num_kv_heads=1, max_seq_len=4096, head_dim=128, max_row_id=4096,
                 dtype=0, placement=0, sdc=0, vmc=0, scale=1.0, sdc_gamma=0.05)
    vec = dict(A2_TARGET, path="vector")  # the cube path's K tile is always 64 positions
    big = ascendc_cpu.compute_tiling(shape, vec)
    small = ascendc_cpu.compute_tiling(shape, dict(vec, ub_bytes=64 * 1024))
    assert small["tileK"] < big["tileK"] and small["ubTotal"] <= 64 * 1024
    cube = ascendc_cpu.compute_tiling(shape, dict(A2_TARGET, ub_bytes=48 * 1024))
    assert cube["path"] == "cube" and cube["tileV"] < big["tileV"] and cube["ubTotal"] <= 48 * 1024


# ----------------------------------------------------------------------------- float64 oracle

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
def test_matches_the_float64_oracle(placement, sdc, vmc, dtype, D, heads, lens, S, cores, small_int_case,
                                    check_against_oracle):
    rng = np.random.default_rng(D + S)
    inputs = small_int_case(len(lens), heads[0], heads[1], S, D, lens, dtype, placement, rng, keep=0.25)
    table = torch.rand(heads[0], S) * 3 if sdc == "offline" else None
    vm = torch.randn(len(lens), heads[1], D) if (vmc and sdc == "offline") else None
    inputs = make_inputs(inputs.query, inputs.key_cache, inputs.value_cache, inputs.seq_lens, inputs.thresholds,
                         scale=1.0, placement=placement, sdc=sdc, sdc_table=table, vmc=vmc, value_mean=vm,
                         return_stats=True)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, cores=cores, min_split_len=32))
    check_against_oracle(inputs, out, stats)
    if cores == 48:
        assert max(split_plan(rep["tiling"], lens)[1]) > 1


def test_result_does_not_depend_on_the_core_count(small_int_case):
    """Splitting the sequence over 1, 5 or 48 vector cores changes the summation order
    only: stats identical, outputs within float32 rounding."""
    rng = np.random.default_rng(21)
    inputs = small_int_case(1, 8, 1, 2048, 64, [2000], torch.float32, "post_softmax", rng, keep=0.2)
    results = []
    for cores in (1, 5, 48):
        out, stats = inputs.empty_outputs(fill=float("nan"))
        rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, cores=cores, min_split_len=64))
        results.append((out.clone(), stats, split_plan(rep["tiling"], [2000])[0]))
    assert [r[2] for r in results] == [1, 5, 31]
    for out, stats, _ in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=2e-6, rtol=1e-5)
        assert torch.equal(stats.kept, results[0][1].kept) and torch.equal(stats.v_rows, results[0][1].v_rows)


# ----------------------------------------------------------------------------- registry

def test_selection_never_picks_the_model_automatically():
    q = torch.randn(1, 2, 64)
    k = torch.randn(1, 1, 8, 64)
    inputs = make_inputs(q, k, k, torch.tensor([8]), torch.zeros(2, 8))
    # the CPU order's first available backend (the cpu kernel when built, else torch)
    assert select_backend(inputs).name in ("cpu", "torch")
    assert "ascendc-cpu" not in priority("cpu")
    assert priority("npu")[0] == "ascendc"
    out = topth_ops.decode_attention(q, k, k, torch.tensor([8]), torch.zeros(2, 8), backend="ascendc-cpu")
    torch.testing.assert_close(out, topth_ops.decode_attention(q, k, k, torch.tensor([8]), torch.zeros(2, 8)))


def test_npu_backend_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    reasons = get_backend("ascendc").unavailable_reasons()
    assert any("ASCEND_HOME_PATH" in r for r in reasons)
    assert any("_ascendc_npu is not built" in r and "pip install --no-build-isolation -e ." in r for r in reasons)


# ----------------------------------------------------------------------------- extreme finite scores

FLT_MAX = float(torch.finfo(torch.float32).max)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [1, 8])
@pytest.mark.parametrize("placement,sdc", [("pre_softmax", "none"), ("pre_softmax", "exact"),
                                           ("pre_softmax", "exp_threshold"), ("post_softmax", "none")])
@pytest.mark.parametrize("rows,theta", [
    ([-3.2e38] * 4, float("-inf")),                              # every score below the old -3e38 floor
    ([-3.2e38, -3.3e38, -FLT_MAX, -3.2e38], float("-inf")),      # max -3.2e38, others far below
    ([-FLT_MAX, float("-inf"), -FLT_MAX, float("-inf")], float("-inf")),  # max exactly -FLT_MAX
    ([-3.2e38, -3.3e38, -3.1e38, -3.35e38], -3.25e38),           # a finite threshold among them
])
def test_scores_below_minus_3e38_match_the_float64_oracle(dtype, head_dim, placement, sdc, rows, theta,
                                                          check_against_oracle):
    """Every finite score is a score: a running maximum floored above -FLT_MAX would turn
    scores below the floor into zero weights (reviewer's repro: out 0, dropped_mass 1)."""
    if placement == "post_softmax" and theta != float("-inf"):
        theta = 0.3  # a probability: keeps the (tied) maxima only
    q = torch.zeros(1, 2, head_dim)
    q[:, :, 0] = 1.0  # one-hot: a_j = k_j[0] exactly
    k = torch.zeros(1, 1, 6, head_dim)
    k[0, 0, :4, 0] = torch.tensor(rows)
    k[0, 0, 4:, 0] = float("nan")  # beyond n: never read
    v = torch.arange(6 * head_dim, dtype=torch.float32).view(1, 1, 6, head_dim) % 7
    inputs = make_inputs(q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor([4]), torch.full((2, 6), theta),
                         scale=1.0, placement=placement, sdc=sdc, return_stats=True)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    run_cpu_model(inputs, out, stats)
    check_against_oracle(inputs, out, stats)


def test_reviewer_repro_scores_of_minus_3_2e38():
    q, k = torch.ones(1, 1, 1), torch.full((1, 1, 4, 1), -3.2e38)
    v = torch.arange(4.0).view(1, 1, 4, 1)
    out, stats = topth_ops.decode_attention(q, k, v, torch.tensor([4]), torch.full((1, 4), float("-inf")),
                                            scale=1.0, return_stats=True, backend="ascendc-cpu")
    assert out.item() == 1.5 and stats.dropped_mass.item() == 0.0 and stats.kept.item() == 4


# ----------------------------------------------------------------------------- environment knobs

@pytest.mark.parametrize("var,value", [
    ("TOPTH_ASCENDC_CPU_CORES", "abc"), ("TOPTH_ASCENDC_CPU_CORES", "-1"), ("TOPTH_ASCENDC_CPU_CORES", "0"),
    ("TOPTH_ASCENDC_CPU_CORES", "4.5"), ("TOPTH_ASCENDC_CPU_UB_BYTES", "100001"),
    ("TOPTH_ASCENDC_CPU_UB_BYTES", "512"), ("TOPTH_ASCENDC_CPU_MIN_SPLIT_LEN", "0"),
])
def test_invalid_knobs_are_named_before_any_launch(monkeypatch, var, value):
    """A bad TOPTH_ASCENDC_CPU_* value is an error naming the variable and the expected
    value, not a raw ModelError at launch, a pybind11 cast error or a 'tiling refuses the
    shape' reason."""
    monkeypatch.setenv(var, value)
    q, k = torch.randn(1, 2, 64), torch.randn(1, 1, 8, 64)
    backend = get_backend("ascendc-cpu")
    reasons = backend.unavailable_reasons()
    assert len(reasons) == 1 and reasons[0].startswith(f"{var} must be an integer in ["), reasons
    assert repr(value) in reasons[0] and "tiling" not in reasons[0]
    with pytest.raises(NotImplementedError, match=f"{var} must be an integer"):
        topth_ops.decode_attention(q, k, k, torch.tensor([8]), torch.zeros(2, 8), backend="ascendc-cpu")
    inputs = make_inputs(q, k, k, torch.tensor([8]), torch.zeros(2, 8))
    out = torch.empty(1, 2, 64)
    with pytest.raises(ValueError, match=f"{var} must be an integer"):
        run_cpu_model(inputs, out)


def test_valid_knobs_are_used(monkeypatch, small_int_case, check_against_oracle):
    monkeypatch.setenv("TOPTH_ASCENDC_CPU_CORES", " 3 ")
    monkeypatch.setenv("TOPTH_ASCENDC_CPU_UB_BYTES", "131072")
    monkeypatch.setenv("TOPTH_ASCENDC_CPU_MIN_SPLIT_LEN", "64")
    rng = np.random.default_rng(9)
    inputs = small_int_case(1, 4, 1, 384, 64, [384], torch.float32, "pre_softmax", rng)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(inputs, out, stats)
    assert rep["block_dim"] == 3 and rep["ub_capacity"] == 131072 and rep["tiling"]["minSplitLen"] == 64
    assert split_plan(rep["tiling"], [384]) == (3, [3])
    check_against_oracle(inputs, out, stats)


def test_an_invalid_target_dict_is_named():
    inputs = make_inputs(torch.randn(1, 2, 64), torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64),
                         torch.tensor([8]), torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"target\['cores'\] must be an integer in \[1, 1024\]"):
        run_cpu_model(inputs, torch.empty(1, 2, 64), target=dict(A2_TARGET, cores=-1))
    with pytest.raises(ValueError, match=r"target\['ub_bytes'\] must be .* multiple of 32"):
        run_cpu_model(inputs, torch.empty(1, 2, 64), target=dict(A2_TARGET, ub_bytes=100001))


# ----------------------------------------------------------------------------- head_dim limits

@pytest.mark.parametrize("dtype,limit", [(0, 2032), (1, 2032), (2, 2040)])
def test_head_dim_limit_text_is_exact_per_dtype(dtype, limit, ascendc_cpu, shape_dict):
    """The vector repeat stride bounds head_dim at 2040 for float32 and 2032 for 16-bit
    dtypes (rows padded to 32 bytes); the message states the limit of the call's dtype.
    A huge unified buffer isolates this limit from the unified-buffer one."""
    big = dict(A2_TARGET, ub_bytes=1 << 24)
    ascendc_cpu.compute_tiling(shape_dict(1, 1, 1, 64, limit, dtype, 0), big)
    name = {0: "float16", 1: "bfloat16", 2: "float32"}[dtype]
    for D in (limit + 1, 2040 if dtype != 2 else 2041):
        with pytest.raises(ValueError, match=rf"head_dim {D} is too large for {name}: .*\({name}: head_dim <= {limit}\)"):
            ascendc_cpu.compute_tiling(shape_dict(1, 1, 1, 64, D, dtype, 0), big)


def test_info_shows_the_head_dim_limit_of_the_ascend_backends(ascendc_cpu, shape_dict):
    from topth_ops.info import backend_rows, format_info

    rows = {r["name"]: r for r in backend_rows()}
    for name in ("ascendc", "ascendc-cpu"):
        assert rows[name]["head_dims"] == "UB-bound: <=1056"
        assert "unified buffer" in rows[name]["description"]
    assert rows["torch"]["head_dims"] == "any"
    assert "UB-bound: <=1056" in format_info()
    # the limit quoted is real: head_dim 1056 at group size 1 fits A2 (less the API's 8 KiB)
    # in every dtype / placement with vmc, 1057 not in all of them
    for dtype in (0, 1, 2):
        for placement in (0, 1):
            ascendc_cpu.compute_tiling(shape_dict(1, 1, 1, 4096, 1056, dtype, placement, vmc=1), A2_TARGET)
    with pytest.raises(ValueError, match="unified buffer"):
        ascendc_cpu.compute_tiling(shape_dict(1, 1, 1, 4096, 1057, 0, 0, vmc=1), A2_TARGET)
    with pytest.raises(ValueError, match="unified buffer"):
        ascendc_cpu.compute_tiling(shape_dict(1, 52 + 1, 1, 4096, 128, 0, 1, vmc=1), A2_TARGET)
    assert ascendc_cpu.compute_tiling(shape_dict(1, 52, 1, 4096, 128, 0, 1, vmc=1), A2_TARGET)["path"] == "cube"
    # the all-vector kernel alone stops at 43 there (docs/ascendc.md, "Limits")
    vec = dict(A2_TARGET, path="vector")
    ascendc_cpu.compute_tiling(shape_dict(1, 43, 1, 4096, 128, 0, 1, vmc=1), vec)
    with pytest.raises(ValueError, match="unified buffer"):
        ascendc_cpu.compute_tiling(shape_dict(1, 44, 1, 4096, 128, 0, 1, vmc=1), vec)
