"""Bytes of a decode step: what a kernel must move (all valid K rows, the kept-union V
rows, q and out), the GM -> UB traffic expected from the inputs, and the comparison with
the bytes a backend counts itself (``bench_counters``)."""

from __future__ import annotations

import torch

from topth_ops.contract import DecodeInputs

from .rows import Row

def must_move_bytes(inputs: DecodeInputs, v_rows_total: int) -> int:
    """Bytes a decode kernel must move: all valid K rows, the kept-union V rows, q and out.

    Parameters
    ----------
    inputs : DecodeInputs
    v_rows_total : int
        Sum over (sequence, KV head) of the V rows read (``DecodeStats.v_rows``), or of the
        valid rows for a dense kernel.
    """
    es = inputs.query.element_size()
    n = inputs.seq_lens.to(torch.int64).clamp(0, inputs.max_seq_len)
    k_rows = int(n.sum()) * inputs.num_kv_heads
    qo = 2 * inputs.batch * inputs.num_q_heads * inputs.head_dim * es
    return (k_rows + int(v_rows_total)) * inputs.head_dim * es + qo


def expected_traffic(inputs: DecodeInputs, v_rows_total: int, counters: dict) -> dict:
    """GM -> UB bytes a Top-Theta decode kernel should read, from the inputs alone.

    Parameters
    ----------
    inputs : DecodeInputs
    v_rows_total : int
        Kept-union V rows summed over (sequence, KV head): ``stats.v_rows`` of the torch
        reference.
    counters : dict
        The backend's ``bench_counters()``; only ``workspace_split_gm_to_ub_bytes`` (the
        split bookkeeping its split plan implies) and ``v_merged_gap_bytes`` (V rows its
        copy plan fetches between merged runs), declared by the backend, are used.

    Returns
    -------
    dict
        ``k_bytes``: every valid K row once per KV group, ``sum_b n_b * num_kv_heads *
        head_dim * dtype bytes``; ``v_bytes``: ``v_rows_total * head_dim * dtype bytes``
        (docs/triton.md, docs/ascendc.md: "Memory traffic");
        ``workspace_gm_to_ub_bytes``: post_softmax reads back the float32 scores it wrote,
        4 bytes per query head and valid position (0 for pre_softmax), plus the declared
        split bookkeeping.
    """
    row = inputs.head_dim * inputs.query.element_size()
    valid = int(inputs.seq_lens.to(torch.int64).clamp(0, inputs.max_seq_len).sum())
    scores = 4 * inputs.num_q_heads * valid if inputs.placement == "post_softmax" else 0
    return {
        "k_bytes": valid * inputs.num_kv_heads * row,
        # + rows a backend declares it fetches between runs of kept rows (a copy plan that
        # merges runs sharing a DRAM granule; the Ascend C kernel)
        "v_bytes": int(v_rows_total) * row + int(counters.get("v_merged_gap_bytes", 0)),
        "workspace_gm_to_ub_bytes": scores + int(counters.get("workspace_split_gm_to_ub_bytes", 0)),
    }


_BYTE_FIELDS = (("K", "k_bytes", "k_bytes"), ("V", "v_bytes", "v_bytes"),
                ("workspace", "workspace_gm_to_ub_bytes", "ws_bytes"))


def check_bytes(row: "Row", counters: dict, expected: dict) -> bool:
    """Put the counted and expected bytes into ``row`` and set ``row.bytes_check``.

    Only the counts the backend reports are compared (K, V, workspace). Returns True when
    every reported count equals its expectation exactly (``bytes_check = "exact"``);
    otherwise ``bytes_check`` is ``"MISMATCH: "`` followed by each differing count.
    """
    bad = []
    compared = False
    for label, key, field_name in _BYTE_FIELDS:
        if key not in counters:
            continue
        got, want = int(counters[key]), int(expected[key])
        setattr(row, field_name, got)
        setattr(row, field_name + "_expected", want)
        compared = True
        if got != want:
            bad.append(f"{label} {got} counted vs {want} expected ({got - want:+d})")
    if compared:
        row.bytes_check = "exact" if not bad else "MISMATCH: " + "; ".join(bad)
    return not bad
