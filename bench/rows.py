"""One benchmark measurement row (:class:`Row`, a CSV row) and the statuses that fail a run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

FAILED_STATUSES = ("wrong", "wrong-bytes", "error")
"""Row statuses that make ``topth-ops bench`` exit 1."""


@dataclass
class Row:
    """One measurement: a variant on a case (CSV row). Times in ms, bandwidth in GB/s."""

    case: str
    variant: str
    kind: str  # "topth" (thresholded), "dense" (baseline), "copy" (device bandwidth)
    status: str  # "ok", "skipped", "wrong" (output/stats), "wrong-bytes" (counted bytes), "error"
    reason: str = ""
    device: str = ""
    timing: str = ""
    dtype: str = ""
    placement: str = ""
    batch: int = 0
    seq_len: int = 0
    num_q_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    kept_frac: float = float("nan")  # requested
    kept_union_frac: float = float("nan")  # achieved: V rows read / valid rows, per group
    kept_head_frac: float = float("nan")  # achieved: kept / valid, per query head
    max_abs_err: float = float("nan")
    time_ms: float = float("nan")
    bytes: int = 0  # bytes that must move: all valid K, kept-union V rows, q, out
    gbps: float = float("nan")
    dense_variant: str = ""
    speedup_vs_dense: float = float("nan")
    speedup_vs_best_dense: float = float("nan")  # vs the fastest external dense baseline (not our own)
    time_graph_ms: float = float("nan")  # cuda: the same call replayed from a CUDA graph
    speedup_graph_vs_best_dense: float = float("nan")
    best_dense_variant: str = ""
    bound: float = float("nan")  # 2 / (1 + f) with f = kept_union_frac
    # GM -> UB bytes counted by the backend (``bench_counters``) and expected from the inputs;
    # empty when the backend does not count
    k_bytes: Optional[int] = None
    k_bytes_expected: Optional[int] = None
    v_bytes: Optional[int] = None
    v_bytes_expected: Optional[int] = None
    ws_bytes: Optional[int] = None
    ws_bytes_expected: Optional[int] = None
    bytes_check: str = ""  # "" (no counters), "exact", or "MISMATCH: ..." naming the counts
    counters: str = ""  # every counter, JSON
