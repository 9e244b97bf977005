"""The CPU model's own rules, and the hardware bug kinds that it must flag when
they are reintroduced into the kernel, its tiling or its launch (each test breaks one thing
on purpose and requires the model or the check to catch it):

1. Select's scratch block in the API-reserved top 8 KiB of UB (a tiling that plans over it);
2. split-KV planned over the cache capacity instead of the actual lengths;
3. the launch path (device guard, null stream, launch return code: topth_launch.h);
5. kept-set comparisons that depend on hardware Exp / Ln rounding (planted margins);
6. all-core SyncAll without batch scheduling under concurrent streams, hard SyncAll in a
   kernel that is not of mix type.
(4, the ReduceRepeat rename, and the CMake library / layout probe are build checks:
test_ascendc_cpu_build.py.)
"""

import numpy as np
import pytest
import torch

from topth_ops import make_inputs
from topth_ops.backends.ascendc import A2_TARGET, kernel_tensors, problem_shape, run_cpu_model, split_plan


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
    "select_scratch_overlap": ["Select at selftest.cpp", "scratch block at UB [188416, 188448)", "overwritten"],
    "hard_syncall_aiv_only": ["SyncAll<>() at selftest.cpp", "mix kernel type"],
    "syncall_concurrent_streams": ["SyncAll at selftest.cpp", "would deadlock", "batch schedule mode"],
    "cache_row_not_owned": ["DataCopy GM->UB at selftest.cpp", "not one of its valid rows", "sequence 0, KV head 0"],
    "block_table_past_used": ["GetValue at selftest.cpp", "block_table[0, 1]", "never read"],
}


def test_every_selftest_case_is_covered(ascendc_cpu, cube_selftests):
    assert set(ascendc_cpu.selftest_cases()) == set(SELFTEST_EXPECT) | {"ok"} | set(cube_selftests) | {"cube_ok"}


@pytest.mark.parametrize("case", sorted(SELFTEST_EXPECT))
def test_model_rejects_what_the_device_rejects(case, ascendc_cpu):
    with pytest.raises(ascendc_cpu.ModelError) as e:
        ascendc_cpu.selftest(case)
    for fragment in SELFTEST_EXPECT[case]:
        assert fragment in str(e.value), str(e.value)
    assert isinstance(e.value, RuntimeError)


def test_model_accepts_the_canonical_queue_pipeline(ascendc_cpu):
    ascendc_cpu.selftest("ok")


def test_short_gm_buffer_in_the_real_kernel_is_a_python_error_naming_it(small_int_case, ascendc_cpu):
    """Hand the kernel a value cache one byte shorter than its shape says: the model stops
    the launch where the kernel declares that GM tensor, naming the call and the buffer."""
    rng = np.random.default_rng(5)
    inputs = small_int_case(1, 4, 1, 64, 64, [64], torch.float16, "pre_softmax", rng, keep=1.0)
    out, stats = inputs.empty_outputs()
    t = kernel_tensors(inputs)

    def ptr(x):
        return (x.data_ptr(), x.numel() * x.element_size()) if x is not None else None

    args = {name: ptr(x) for name, x in t.items()}
    args["value_cache"] = (t["value_cache"].data_ptr(), t["value_cache"].numel() * 2 - 1)
    args.update(out=ptr(out), kept=ptr(stats.kept), v_rows=ptr(stats.v_rows), dropped_mass=ptr(stats.dropped_mass))
    with pytest.raises(ascendc_cpu.ModelError,
                       match=r"SetGlobalBuffer at topth_kernel\.h:\d+: declares 8192 bytes .*'value_cache', which has 8191"):
        ascendc_cpu.run(args, problem_shape(inputs), A2_TARGET)


# ----------------------------------------------------------------------------- 1. Select scratch

def test_a_plan_over_the_select_scratch_is_caught_by_the_model(small_int_case, check_against_oracle, ascendc_cpu):
    """G=20, head_dim 256, fp16 post_softmax: a tiling that does not keep the API's top
    8 KiB free plans 194912 bytes (32-row K tiles), and the model stops the launch at the
    first Select, whose scratch block would overwrite a buffer on the device. The real
    tiling keeps it free (16-row tiles, 186976 bytes) and the same call matches the oracle."""
    rng = np.random.default_rng(24)
    inputs = small_int_case(1, 20, 1, 1024, 256, [1000], torch.float16, "post_softmax", rng, keep=0.2)
    vec = dict(A2_TARGET, path="vector")  # the all-vector kernel's plan (the cube path's is smaller)
    bad = dict(vec, reserve_api_scratch=False)
    assert ascendc_cpu.compute_tiling(problem_shape(inputs), bad)["ubTotal"] > 188416
    out, stats = inputs.empty_outputs(fill=float("nan"))
    with pytest.raises(ascendc_cpu.ModelError, match=r"Select at topth_select\.h:\d+: writes the Ascend C API's 32-byte scratch"):
        run_cpu_model(inputs, out, stats, target=bad)
    rep = run_cpu_model(inputs, out, stats, target=vec)
    assert rep["tiling"]["ubTotal"] <= 188416 and rep["counters"]["select_scratch_writes"] > 0
    check_against_oracle(inputs, out, stats)


# ----------------------------------------------------------------------------- 2. actual-length split

@pytest.mark.parametrize("path", ["vector", "cube"])
def test_split_kv_follows_the_actual_lengths_not_the_cache_capacity(path, check_against_oracle):
    """A 16k cache holding 2048 tokens (B=1, 2 KV heads, 48 vector cores, splits >= 128
    positions): the kernel splits the 2048 actual positions (16 pieces per KV head, 32 busy
    vector cores with equal K traffic; on the cube path 16 busy cube cores reading the K rows
    of their two vector cores' pieces), where a split of the capacity would leave 3 pieces
    doing all the work."""
    rng = np.random.default_rng(16)
    S, n = 16384, 2048
    q = torch.from_numpy(rng.integers(-1, 2, size=(1, 8, 64)).astype(np.float32)).half()
    k = torch.zeros(1, 2, S, 64, dtype=torch.float16)
    k[:, :, :n] = torch.from_numpy(rng.integers(-1, 2, size=(1, 2, n, 64)).astype(np.float32)).half()
    v = torch.randn(1, 2, S, 64).half()
    inputs = make_inputs(q, k, v, torch.tensor([n], dtype=torch.int32), torch.full((8, S), 2.5), scale=1.0,
                         placement="pre_softmax", return_stats=True)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    rep = run_cpu_model(inputs, out, stats, target=dict(A2_TARGET, min_split_len=128, path=path))
    splits, pieces = split_plan(rep["tiling"], [n])
    assert (splits, pieces) == (16, [16]) and rep["tiling"]["path"] == path
    per_block = [c["k_bytes"] for c in rep["per_block"]]
    busy = [b for b in per_block if b > 0]
    per_core = 128 * 64 * 2 * (2 if path == "cube" else 1)
    assert len(busy) == (2 * 16 if path == "vector" else 16) and max(busy) == min(busy) == per_core
    capacity_pieces = -(-n // (S // rep["tiling"]["splitCap"]))  # what a capacity split would give
    assert len(busy) > 2 * capacity_pieces
    check_against_oracle(inputs, out, stats)


# ----------------------------------------------------------------------------- 3. launch path

def test_the_launch_runs_on_the_tensors_device_and_restores_the_current_one(ascendc_cpu):
    r = ascendc_cpu.launch_selftest(1)
    assert r["error"] == "" and r["device_after"] == 0
    assert r["log"] == ["set_device 1", "stream 1 (current 1)", "launch on device 1 with a stream", "restore_device 0"]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(broken_guard=True), "could not make device 1 (the tensors' device) current"),
    (dict(null_stream=True), "current stream of device 1 is null; topth_decode_attn was not launched"),
    (dict(rc=507015), "failed with error code 507015"),
])
def test_a_failed_guard_a_null_stream_or_a_launch_error_raise_and_restore(kwargs, needle, ascendc_cpu):
    r = ascendc_cpu.launch_selftest(1, **kwargs)
    assert needle in r["error"]
    assert r["log"][-1] == "restore_device 0" and r["device_after"] == 0
    if "rc" not in kwargs:
        assert not any(e.startswith("launch") for e in r["log"])  # nothing launched


def test_the_npu_binding_launches_through_the_guarded_path():
    """The NPU binding is never compiled here: check that its only launch goes through
    topth::GuardedLaunch with the torch_npu runtime (device guard, stream, return code)."""
    from pathlib import Path

    src = (Path(__file__).resolve().parents[3] / "npu_kernels" / "npu" / "topth_npu_binding.cpp").read_text()
    assert src.count("ACLRT_LAUNCH_KERNEL(topth_decode_attn)") == 1
    assert src.count("ACLRT_LAUNCH_KERNEL(topth_decode_attn_cube)") == 1  # the cube path's mix kernel
    assert "topth::GuardedLaunch(rt, device" in src and "c10::DeviceGuard" in src
    for entry in ("ACLRT_LAUNCH_KERNEL(topth_decode_attn)", "ACLRT_LAUNCH_KERNEL(topth_decode_attn_cube)"):
        assert src.index("topth::GuardedLaunch(rt, device") < src.index(entry)
    cmake = (Path(__file__).resolve().parents[3] / "npu_kernels" / "npu" / "CMakeLists.txt").read_text()
    assert "kernel/topth_decode_attn_cube.cpp" in cmake


# ----------------------------------------------------------------------------- 5. margins

def test_planted_margins_keep_kept_counts_exact_under_hardware_like_rounding():
    """The NPU check's kept-set cases (bench/studies/npu_margin.py, run by bench/npu_check.sh:
    planted rows >= 1 nat above the rest, thresholds mid-gap, per head and per group,
    threshold sets, BNSD / paged NHD / HND) keep their kept sets exactly when the model's
    Exp / Ln are off by 1e-3 relative, far more than a device's rounding; so kept and
    v_rows are safe to compare exactly on hardware. (One shape here; the NPU runs three.)"""
    from topth_ops.bench.studies.npu_margin import SHAPES, run

    cases, failures = run("ascendc-cpu", torch.device("cpu"), launch={"transcendental_error": 1e-3},
                          shapes=SHAPES[:1], check_out=False)
    assert cases == 12 and failures == []


def test_thin_guard_bands_are_not_safe_for_exact_kept_comparisons(small_int_case):
    """The bug kind: a log-probability 3e-4 above ln(theta) (inside what a 2e-4 guard band
    allows) is kept on the CPU model's exact Exp / Ln but not with 1e-3 relative error on
    them, so an NPU check must not compare kept exactly on such inputs (bench/npu_check.sh
    uses planted margins instead)."""
    rng = np.random.default_rng(5)
    inputs = small_int_case(1, 4, 1, 128, 64, [128], torch.float32, "post_softmax", rng)
    q, k = inputs.query.double().numpy()[0], inputs.key_cache.double().numpy()[0, 0]
    th = torch.empty(4, 128)
    for h in range(4):
        a = k @ q[h]
        logp = a - (a.max() + np.log(np.exp(a - a.max()).sum()))
        th[h] = float(np.exp(np.sort(logp)[-5] - 3e-4))  # the 5th largest is kept by 3e-4
    thin = make_inputs(inputs.query, inputs.key_cache, inputs.value_cache, inputs.seq_lens, th, scale=1.0,
                       placement="post_softmax", return_stats=True)
    out, exact = thin.empty_outputs()
    run_cpu_model(thin, out, exact)
    assert (exact.kept >= 5).all()
    out, jittered = thin.empty_outputs()
    run_cpu_model(thin, out, jittered, launch={"transcendental_error": 1e-3})
    assert not torch.equal(exact.kept, jittered.kept)


# ----------------------------------------------------------------------------- 6. all-core sync

def _split_case(small_int_case):
    rng = np.random.default_rng(6)
    return small_int_case(1, 4, 1, 1024, 64, [1000], torch.float32, "post_softmax", rng, keep=0.2)


def test_hard_syncall_in_batch_mode_survives_concurrent_streams(check_against_oracle, small_int_case):
    """Another stream holds half the cores: the kernel (mix type, hard SyncAll, batch
    schedule mode) still starts all its blocks together and completes."""
    inputs = _split_case(small_int_case)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    target = dict(A2_TARGET, cores=8, min_split_len=64)
    rep = run_cpu_model(inputs, out, stats, target=target, launch={"resident_blocks": 4})
    assert rep["block_dim"] == 8 and rep["sync_all_calls"] == 2 and rep["batch_mode"]
    assert rep["kernel_type"] == 2  # KERNEL_TYPE_MIX_AIV_1_0
    check_against_oracle(inputs, out, stats)


@pytest.mark.parametrize("sync", ["hard", "soft"])
def test_syncall_without_batch_mode_deadlocks_under_concurrent_streams(sync, check_against_oracle, ascendc_cpu,
                                                                       small_int_case):
    """The bug kind: a toolchain without __schedmode__ (normal schedule mode): with another
    stream holding cores, the blocks that started wait in SyncAll for blocks that cannot
    start, soft and hard SyncAll alike; without concurrent streams both run correctly."""
    inputs = _split_case(small_int_case)
    target = dict(A2_TARGET, cores=8, min_split_len=64, sync=sync)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    with pytest.raises(ascendc_cpu.ModelError, match="would deadlock"):
        run_cpu_model(inputs, out, stats, target=target, launch={"resident_blocks": 4, "sched_mode_normal": True})
    rep = run_cpu_model(inputs, out, stats, target=target, launch={"sched_mode_normal": True})
    assert rep["sync_all_calls"] == 2 and (rep["tiling"]["ubSync"] > 0) == (sync == "soft")
    check_against_oracle(inputs, out, stats)
