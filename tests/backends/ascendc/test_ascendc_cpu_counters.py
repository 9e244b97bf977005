"""Pipe counters of the Ascend C kernel on the CPU model and the gates on them
(bench/ascendc_counters.py): no per-element scalar scan of the score tiles, and V
rows copied one instruction per run of kept rows, not one per row.

The counts are the model's (instruction by instruction); the bounds come from the plan the
backend declares (score tiles, work items, copy spans), which the byte tests check against
float64 kept sets independently. About 5 s on 2 cores.
"""

import numpy as np
import pytest
import torch

from topth_ops import make_inputs
from topth_ops.bench.ascendc_counters import pipe_gates
from topth_ops.registry import get_backend


def _windows_case(n=4096, window=16, every=128, dtype=torch.float16, placement="pre_softmax", paged_bs=None):
    """Scores of +5 in windows of `window` positions every `every` positions, -5 elsewhere
    (one-hot query): the kept rows form long runs."""
    D = 64
    q = torch.zeros(1, 4, D)
    q[:, :, 0] = 1.0
    k = torch.randn(1, 1, n, D) * 0.01
    score = torch.full((n,), -5.0)
    for s in range(0, n, every):
        score[s:s + window] = 5.0
    k[0, 0, :, 0] = score
    v = torch.randn(1, 1, n, D)
    th = torch.zeros(4, n) if placement == "pre_softmax" else torch.full((4, n), 1e-6)
    kw = dict(scale=1.0, placement=placement, return_stats=True)
    if paged_bs:
        from topth_ops.paged import to_paged

        kp, vp, table = to_paged(k.to(dtype), v.to(dtype), torch.tensor([n]), paged_bs, kv_layout="HND")
        return make_inputs(q.to(dtype), kp, vp, torch.tensor([n]), th, block_table=table, kv_layout="HND", **kw)
    return make_inputs(q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor([n]), th, **kw)


def _run(inputs):
    backend = get_backend("ascendc-cpu")
    out, stats = inputs.empty_outputs(fill=float("nan"))
    backend.forward(inputs, out, stats)
    return backend.bench_counters(), backend.last_report, stats


@pytest.mark.parametrize("placement,paged_bs", [("pre_softmax", None), ("post_softmax", None), ("pre_softmax", 32)])
def test_runs_of_kept_rows_are_one_copy_and_no_tile_is_scanned_per_position(placement, paged_bs, expected_fetch):
    inputs = _windows_case(placement=placement, paged_bs=paged_bs)
    c, rep, stats = _run(inputs)
    assert pipe_gates(c) == []
    kept = int(stats.v_rows.sum())
    assert kept == 32 * 16 and c["plan_kept_rows"] == kept
    # one instruction per run (cut at V batches and cache blocks), computed independently too
    fetched, spans = expected_fetch(inputs, rep["tiling"], kept=[[np.arange(4096) % 128 < 16]])
    assert spans == c["plan_v_spans"] == 32 and fetched == kept
    assert c["pipe_v_requests"] == c["plan_v_copies"] <= 32 * (2 if paged_bs else 1) * 2
    # the gates would catch per-row copies and a per-position scalar scan here
    assert pipe_gates(dict(c, pipe_v_requests=kept)) != []
    assert pipe_gates(dict(c, pipe_scalar_ub_reads=c["pipe_scalar_ub_reads"] + 64 * c["plan_score_tiles"])) != []
    # and the kernel's own scalar reads stay near 2 per selection tile
    assert c["pipe_scalar_ub_reads"] <= 2 * c["plan_score_tiles"] + 200


def test_the_gates_hold_on_scattered_rows_and_report_counters_per_pipe(small_int_case):
    rng = np.random.default_rng(3)

    inputs = small_int_case(2, 8, 2, 700, 64, [700, 333], torch.bfloat16, "post_softmax", rng, keep=0.1)
    c, rep, _ = _run(inputs)
    assert pipe_gates(c) == []
    for key in ("mte2_bytes", "mte2_requests", "k_bytes", "v_bytes", "v_requests", "mte3_bytes", "vec_instr",
                "vec_repeats", "scalar_ub_reads", "scalar_ub_writes", "barriers", "flags", "cube_instr"):
        assert key in rep["counters"]
        assert sum(b[key] for b in rep["per_block"]) == rep["counters"][key]
    assert rep["counters"]["k_bytes"] == rep["k_bytes"] and rep["counters"]["v_bytes"] == rep["v_bytes"]
    # bfloat16: the cube path; its K bytes are the cube cores', its cube instructions counted
    assert rep["tiling"]["path"] == "cube" and rep["counters"]["cube_instr"] > 0
    assert rep["counters_aic"]["k_bytes"] == rep["k_bytes"] and rep["counters_aiv"]["k_bytes"] == 0
    assert rep["counters_aiv"]["cube_instr"] == 0 and rep["counters_aic"]["vec_instr"] == 0


def test_l2_caching_is_turned_off_for_caches_larger_than_the_l2():
    """IFA's rule: K and V together >= 1.2 x the L2 cache are streamed with
    SetL2CacheHint(CACHE_MODE_DISABLE) (tiling flag l2CacheOff)."""
    from topth_ops.backends.ascendc import A2_TARGET, problem_shape
    from topth_ops.npu_kernels import _ascendc_cpu

    inputs = _windows_case(n=1024)
    kv = 2 * inputs.key_cache.numel() * inputs.key_cache.element_size()
    on = _ascendc_cpu.compute_tiling(problem_shape(inputs), dict(A2_TARGET, l2_bytes=int(kv / 1.2) + 64))
    off = _ascendc_cpu.compute_tiling(problem_shape(inputs), dict(A2_TARGET, l2_bytes=int(kv / 1.2) - 64))
    assert (on["l2CacheOff"], off["l2CacheOff"]) == (0, 1)
    assert _ascendc_cpu.compute_tiling(problem_shape(inputs), A2_TARGET)["l2CacheOff"] == 0  # 192 MB
