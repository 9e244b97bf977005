"""Per-pipe counters of the Ascend C kernel on the CPU model (backend ``ascendc-cpu``), as
reported by ``topth-ops bench --backends ascendc-cpu --cases bytes``, and the gates CI
applies to them (tests/test_ascendc_cpu_counters.py).

The model counts, per vector core and summed over cores (``Backend.bench_counters`` keys
``pipe_*``): MTE2 / MTE3 copy instructions and bytes (K and V apart), vector instructions
and their 256-byte repeats, scalar reads and writes of the unified buffer, barriers and
flag pairs, cube instructions. The backend also declares what its plan implies (``plan_*``:
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


def format_pipe_table(rows) -> str:
    """The counters of the rows whose backend reports pipe counters (empty string when none
    does): per call and per selection tile (tileK positions in pre_softmax, 64 in
    post_softmax), with the gates' verdict."""
    out = []
    for r in rows:
        if not r.counters:
            continue
        c = json.loads(r.counters)
        if "pipe_vec_instr" not in c or "plan_score_tiles" not in c:
            continue
        t = max(1, c["plan_score_tiles"])
        gates = pipe_gates(c)
        out.append(f"{r.case:<30} {c['plan_score_tiles']:>6} {c['pipe_mte2_requests']:>8} {c['pipe_v_requests']:>7} "
                   f"{c['plan_v_spans']:>7} {c['pipe_vec_instr'] / t:>9.1f} {c['pipe_vec_repeats'] / t:>9.1f} "
                   f"{c['pipe_scalar_ub_reads'] / t:>8.2f} {c['pipe_barriers'] / t:>8.1f} {c['pipe_flags'] / t:>6.1f} "
                   f"{c['pipe_cube_instr']:>5}  {'ok' if not gates else 'GATE: ' + '; '.join(gates)}")
    if not out:
        return ""
    head = (f"{'case':<30} {'tiles':>6} {'MTE2 req':>8} {'V req':>7} {'V spans':>7} {'vec/tile':>9} "
            f"{'rep/tile':>9} {'sUBr/t':>8} {'bar/t':>8} {'flg/t':>6} {'cube':>5}  gates")
    return "\n".join(["Pipe counters of the CPU model (per selection tile where '/t'; counts, not times)", head,
                      "-" * len(head)] + out)
