"""Per-pipe counters of the Ascend C kernel on the CPU model (backend ``ascendc-cpu``), as
reported by ``topth-ops bench --backends ascendc-cpu --cases bytes``, the gates CI applies to
them (tests/backends/ascendc/test_ascendc_cpu_counters.py), and the per-tile cycle estimate derived from them
(docs/ascendc.md, "Cycle estimate").

The model counts, per core and summed over cores (``Backend.bench_counters`` keys
``pipe_*``; ``pipe_aic_*`` for the cube cores of the cube path): MTE2 / MTE3 copy
instructions and bytes (K and V apart), vector instructions and their 256-byte repeats,
scalar reads and writes of the unified buffer, barriers and flag pairs, cube instructions
(Mmad and its 16 x 16 x 16 fractal products, LoadData and its L1 -> L0 bytes, Fixpipe and
its bytes), cross-core flags. The backend also declares what its plan implies (``plan_*``:
score tiles, work items, V copy spans and copy instructions, from the kept sets selected
again in float32). The gates:

* **no per-element scalar scan**: scalar UB reads <= 2 per selection tile (the union mask's two
  words) + 12 G + 8 per work item (thresholds, finalisation);
* **V rows copied per run, not per row**: V copy instructions == the plan's (one per span
  of kept rows, cut only at V-batch and cache-block boundaries);
* scalar UB writes <= 2 per score tile + 6 G + 4 per work item.
"""

from __future__ import annotations

import json

# Cost assumptions of the cycle estimate (Atlas A2 / 910B; assumptions, not measurements;
# docs/ascendc.md lists them): bytes per cycle of HBM per vector core when all 48 stream
# (1.6 TB/s / 1.8 GHz / 48), fixed cycles per copy instruction (MTE2 / MTE3 / FIX), cycles per
# vector repeat, per vector instruction issued, per PipeBarrier, per cube fractal product
# (16 x 16 x 16 fp16 MACs per cycle), L1 -> L0 bytes per cycle, cycles per cross-core flag.
ASSUMPTIONS = dict(hbm_bytes_per_cycle=18.5, copy_cycles=50, repeat_cycles=1, issue_cycles=2, barrier_cycles=16,
                   fractal_cycles=1, mte1_bytes_per_cycle=64, fix_bytes_per_cycle=64, cross_flag_cycles=20)


def pipe_gates(c: dict) -> list[str]:
    """Violated gates for one call's counters (``bench_counters()``); empty when all hold or
    when the counters are not the Ascend C model's."""
    if "pipe_scalar_ub_reads" not in c or "plan_score_tiles" not in c:
        return []
    tiles, items, G = c["plan_score_tiles"], c["plan_work_items"], c["plan_group"]
    bad = []
    reads_cap = 2 * tiles + (12 * G + 8) * items
    if c["pipe_scalar_ub_reads"] > reads_cap:
        bad.append(f"scalar UB reads {c['pipe_scalar_ub_reads']} > {reads_cap} (2 per score tile + 12G+8 per item): "
                   f"a per-element scalar scan?")
    writes_cap = 2 * tiles + (6 * G + 4) * items
    if c["pipe_scalar_ub_writes"] > writes_cap:
        bad.append(f"scalar UB writes {c['pipe_scalar_ub_writes']} > {writes_cap} (2 per score tile + 6G+4 per item)")
    if c["pipe_v_requests"] != c["plan_v_copies"]:
        bad.append(f"V copy instructions {c['pipe_v_requests']} != {c['plan_v_copies']} planned "
                   f"({c['plan_v_spans']} spans of kept rows): rows copied one by one?")
    return bad


def cycle_estimate(c: dict, a: dict = ASSUMPTIONS) -> dict:
    """Cycles per selection tile of one vector core from a call's counters (an estimate under
    the :data:`ASSUMPTIONS`, not a measurement).

    ``vector``: repeats + issue + barriers of the vector unit; ``aiv_mte2``: copy overheads of
    the vector core's MTE2 (V runs, score tiles); ``cube``: the busiest pipe of the cube core
    for the two tiles it computes per ring step (MTE2 copy overheads, L1 -> L0 bytes, fractal
    products, Fixpipe bytes; 0 on the all-vector path); ``hbm``: this tile's share of the
    memory traffic (every byte moved GM <-> on-chip, all vector cores streaming); ``bound``:
    the largest, since the pipes overlap (double buffers, the score ring, the V prefetch);
    ``dense_ifa``: a dense kernel reading K and V of the tile once (IFA's design: HBM-bound,
    plus one copy overhead); ``speedup``: dense_ifa / bound.
    """
    t = max(1, c["plan_score_tiles"])
    vec = (a["repeat_cycles"] * c["pipe_vec_repeats"] + a["issue_cycles"] * c["pipe_vec_instr"]
           + a["barrier_cycles"] * c["pipe_barriers_aiv"]) / t
    aiv_copies = c["pipe_mte2_requests"] - c["pipe_aic_mte2_requests"] + c["pipe_mte3_requests"]
    aiv_mte2 = (a["copy_cycles"] * aiv_copies + a["cross_flag_cycles"] * c["pipe_cross_sets_aiv"]) / t
    cube = 0.0
    if c["pipe_aic_mte2_requests"]:
        cube = 2 * max(a["copy_cycles"] * c["pipe_aic_mte2_requests"], c["pipe_mte1_bytes"] / a["mte1_bytes_per_cycle"],
                       a["fractal_cycles"] * c["pipe_mmad_fractals"],
                       c["pipe_fix_bytes"] / a["fix_bytes_per_cycle"] + a["copy_cycles"] * c["pipe_fix_requests"]) / t
    moved = c["pipe_mte2_bytes"] + c["pipe_mte3_bytes"] + c["pipe_fix_bytes"]
    hbm = moved / a["hbm_bytes_per_cycle"] / t
    row = c["plan_row_bytes"]
    dense = (2 * 64 * row) / a["hbm_bytes_per_cycle"] + 2 * a["copy_cycles"]
    bound = max(vec, aiv_mte2, cube, hbm)
    return dict(vector=vec, aiv_mte2=aiv_mte2, cube=cube, hbm=hbm, bound=bound, dense_ifa=dense, speedup=dense / bound)


def format_pipe_table(rows) -> str:
    """The counters of the rows whose backend reports pipe counters (empty string when none
    does): per call and per selection tile (tileK positions in pre_softmax, 64 in
    post_softmax), the gates' verdict, and the cycle estimate per tile."""
    out, est = [], []
    for r in rows:
        if not r.counters:
            continue
        c = json.loads(r.counters)
        if "pipe_vec_instr" not in c or "plan_score_tiles" not in c:
            continue
        t = max(1, c["plan_score_tiles"])
        gates = pipe_gates(c)
        path = "cube" if c.get("pipe_mmad_instr", 0) else "vector"
        out.append(f"{r.case:<30} {path:>6} {c['plan_score_tiles']:>6} {c['pipe_mte2_requests']:>8} "
                   f"{c['pipe_v_requests']:>7} {c['plan_v_spans']:>7} {c['pipe_vec_instr'] / t:>9.1f} "
                   f"{c['pipe_vec_repeats'] / t:>9.1f} {c['pipe_scalar_ub_reads'] / t:>8.2f} "
                   f"{c['pipe_barriers_aiv'] / t:>8.1f} {c['pipe_flags'] / t:>6.1f} "
                   f"{c.get('pipe_mmad_fractals', 0) / t:>7.1f}  {'ok' if not gates else 'GATE: ' + '; '.join(gates)}")
        if "plan_row_bytes" in c:
            e = cycle_estimate(c)
            est.append(f"{r.case:<30} {path:>6} {e['vector']:>8.0f} {e['aiv_mte2']:>8.0f} {e['cube']:>8.0f} "
                       f"{e['hbm']:>8.0f} {e['bound']:>8.0f} {e['dense_ifa']:>9.0f} {e['speedup']:>8.2f}")
    if not out:
        return ""
    head = (f"{'case':<30} {'path':>6} {'tiles':>6} {'MTE2 req':>8} {'V req':>7} {'V spans':>7} {'vec/tile':>9} "
            f"{'rep/tile':>9} {'sUBr/t':>8} {'bar/t':>8} {'flg/t':>6} {'frac/t':>7}  gates")
    lines = ["Pipe counters of the CPU model (per selection tile where '/t'; counts, not times)", head,
             "-" * len(head)] + out
    if est:
        h2 = (f"{'case':<30} {'path':>6} {'vector':>8} {'AIV MTE2':>8} {'cube':>8} {'HBM':>8} {'bound':>8} "
              f"{'dense IFA':>9} {'speedup':>8}")
        lines += ["", "Cycle estimate per selection tile from these counts (assumptions: bench/ascendc_counters.py "
                  "ASSUMPTIONS, docs/ascendc.md; an estimate, not a measurement)", h2, "-" * len(h2)] + est
    return "\n".join(lines)
