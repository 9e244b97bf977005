"""Kernel benchmark harness: every (variant, case) pair gives one measurement row.

Structure (kept deliberately flat so other backends plug in):

- a *case* (:class:`topth_ops.bench.cases.Case`) is data: shapes, dtype, placement,
  requested kept fraction;
- a *variant* (:class:`Variant`) is one thing to run on a case: the thresholded op of a
  registered backend (``BackendVariant``: every backend of the registry that can run the
  inputs, e.g. ``triton``, ``torch``, ``ascendc``, ``ascendc-cpu``), the dense mode of our
  Triton kernel, or a dense baseline (torch_npu's IncrementalFlashAttention, torch SDPA,
  FlashInfer, flash-attn);
- :func:`measure` runs one variant on one case: output (and stats, and counted bytes)
  checked against the torch reference first (a wrong result is never timed), then the
  median time, the bytes that must move,
  GB/s, speedups and the 2/(1+f) bound. Unsupported pairs become rows with status
  "skipped" and the reasons.

Devices: cuda (``triton.testing.do_bench``), npu (``torch.npu.Event``; torch_npu) and cpu
(wall clock, meaningless for accelerator kernels). Inputs come from one generator
(:mod:`topth_ops.bench.synth`) whose kept-union per KV group is known exactly.

A backend that counts its own memory traffic (the Ascend C CPU model's GM-to-UB bytes)
exposes ``bench_counters() -> dict`` on its Backend object, read after the checked run.
Its ``k_bytes``, ``v_bytes`` and ``workspace_gm_to_ub_bytes`` go into the row next to the
bytes expected from the inputs and the reference's statistics (:func:`expected_traffic`);
any difference makes the row ``wrong-bytes`` (see :func:`check_bytes`).

Modules by role: :mod:`~topth_ops.bench.rows` (the CSV row), :mod:`~topth_ops.bench.variants`
(what runs), :mod:`~topth_ops.bench.timing` (timers, devices), :mod:`~topth_ops.bench.traffic`
(bytes), :mod:`~topth_ops.bench.report` (CSV, tables, targets, plot); this module checks,
measures and runs the cases. Import each name from the module that defines it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from topth_ops.backends.torch_ref import reference_decode
from topth_ops.conformance.compare import TOLERANCES
from topth_ops.contract import DecodeStats

from .cases import Case
from .rows import Row
from .synth import CaseInputs, make_case_inputs
from .timing import _empty_cache, device_name, synchronize, time_cuda_graph, time_fn, timing_method
from .traffic import check_bytes, expected_traffic, must_move_bytes
from .variants import DENSE_VARIANTS, OWN_DENSE, Variant


def max_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """Max abs error and whether ``out`` is within the conformance suite's tolerance for the
    dtype (|d| <= atol + rtol |ref|, topth_ops.conformance.compare.TOLERANCES)."""
    o, r = out.float(), ref.float()
    tol = TOLERANCES[ref.dtype]
    diff = (o - r).abs()
    ok = bool(((diff <= tol["atol"] + tol["rtol"] * r.abs()) | (o.isnan() & r.isnan())).all())
    err = float(torch.nan_to_num(diff, nan=float("inf")).max()) if diff.numel() else 0.0
    return err, ok


def stats_differences(got: DecodeStats, ref: DecodeStats) -> list[str]:
    """What differs between a variant's statistics and the reference's: ``kept`` and
    ``v_rows`` exactly, ``dropped_mass`` within the conformance suite's stats tolerance."""
    out = []
    for name in ("kept", "v_rows"):
        g, r = getattr(got, name).cpu(), getattr(ref, name).cpu()
        if not torch.equal(g.to(r.dtype), r):
            out.append(f"{name} differs at {int((g.to(r.dtype) != r).sum())} entries")
    tol = TOLERANCES["stats"]
    g, r = got.dropped_mass.float().cpu(), ref.dropped_mass.float().cpu()
    if not torch.allclose(g, r, atol=tol["atol"], rtol=tol["rtol"]):
        out.append(f"dropped_mass differs by up to {float((g - r).abs().nan_to_num(float('inf')).max()):.3g}")
    return out


# --------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------


@dataclass
class CaseReference:
    out: torch.Tensor
    stats: DecodeStats
    dense_out: torch.Tensor
    v_rows_total: int
    valid_rows_total: int
    kept_total: int
    kept_union_frac: float
    kept_head_frac: float


def reference_for(ci: CaseInputs) -> CaseReference:
    """Torch-reference outputs, statistics and achieved fractions of one case.

    Raises
    ------
    RuntimeError
        The reference's kept-union per KV group (``stats.v_rows``) differs from the planted
        one: the generator's promise or the reference is broken.
    """
    out, st = reference_decode(ci.inputs)
    if not torch.equal(st.v_rows.cpu().to(torch.int64), ci.planted_union):
        raise RuntimeError(f"case {ci.case.name}: the reference keeps {st.v_rows.cpu().tolist()} V rows per "
                           f"(sequence, KV head), the inputs planted {ci.planted_union.tolist()}")
    dense_out, _ = reference_decode(ci.dense)
    n = ci.inputs.seq_lens.to(torch.int64).clamp(0, ci.inputs.max_seq_len)
    valid = int(n.sum())
    v_rows = int(st.v_rows.sum())
    kept = int(st.kept.sum())
    return CaseReference(
        out=out, stats=st, dense_out=dense_out, v_rows_total=v_rows,
        valid_rows_total=valid * ci.inputs.num_kv_heads, kept_total=kept,
        kept_union_frac=v_rows / max(1, valid * ci.inputs.num_kv_heads),
        kept_head_frac=kept / max(1, valid * ci.inputs.num_q_heads),
    )


def _base_row(case: Case, variant: Variant, device: torch.device) -> Row:
    return Row(case=case.name, variant=variant.name, kind=variant.kind, status="ok",
               device=device_name(device), timing=timing_method(device), dtype=case.dtype,
               placement=case.placement if variant.kind == "topth" else "dense",
               batch=case.batch, seq_len=case.seq_len, num_q_heads=case.num_q_heads,
               num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, kept_frac=case.kept_frac)


def measure(variant: Variant, ci: CaseInputs, ref: CaseReference, device: torch.device, *,
            reps: int, budget_ms: float) -> Row:
    """Check then time one variant on one case (see the module docstring).

    The first run is checked: output against the reference (dtype tolerance), statistics
    (thresholded variants that return them) and, when the variant counts bytes, the
    counted bytes against :func:`expected_traffic`. A row that fails a check ("wrong",
    "wrong-bytes") is not timed.
    """
    row = _base_row(ci.case, variant, device)
    row.kept_union_frac = ref.kept_union_frac if variant.kind == "topth" else 1.0
    row.kept_head_frac = ref.kept_head_frac if variant.kind == "topth" else 1.0
    reasons = variant.reasons(ci)
    if reasons:
        row.status, row.reason = "skipped", "; ".join(reasons)
        return row
    try:
        fn, get_out = variant.prepare(ci)
        fn()
        synchronize(device)
        expected = ref.out if variant.kind == "topth" else ref.dense_out
        row.max_abs_err, ok = max_error(get_out(), expected)
        problems = [] if ok else [f"output differs from the torch reference (max abs err {row.max_abs_err:.3g})"]
        stats = variant.last_stats()
        if stats is not None:
            problems += [f"stats: {d}" for d in stats_differences(stats, ref.stats)]
        counters = variant.counters()
        bytes_ok = True
        if counters:
            row.counters = json.dumps(counters, sort_keys=True)
            bytes_ok = check_bytes(row, counters, expected_traffic(ci.inputs, ref.v_rows_total, counters))
        if problems:
            row.status, row.reason = "wrong", "; ".join(problems)
            return row
        if not bytes_ok:
            row.status, row.reason = "wrong-bytes", row.bytes_check
            return row
        row.time_ms = time_fn(fn, device, reps=reps, budget_ms=budget_ms)
    except Exception as e:  # noqa: BLE001 - a failing variant must not stop the benchmark
        row.status, row.reason = "error", f"{type(e).__name__}: {e}"[:300]
        return row
    if device.type == "cuda":
        row.time_graph_ms, why = time_cuda_graph(fn, budget_ms=budget_ms)
        if why:
            row.reason = (row.reason + "; " if row.reason else "") + f"no CUDA graph timing: {why}"
    v_rows = ref.v_rows_total if variant.kind == "topth" else ref.valid_rows_total
    row.bytes = must_move_bytes(ci.inputs, v_rows)
    row.gbps = row.bytes / (row.time_ms * 1e-3) / 1e9
    row.bound = 2.0 / (1.0 + row.kept_union_frac)
    return row


def copy_bandwidth(device: torch.device, nbytes: int, budget_ms: float) -> Row:
    """Device copy bandwidth: ``dst.copy_(src)`` of ``nbytes``; bytes = read + write."""
    row = Row(case="device-copy", variant="torch-copy", kind="copy", status="ok",
              device=device_name(device), timing=timing_method(device))
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    row.time_ms = time_fn(lambda: dst.copy_(src), device, reps=5, budget_ms=budget_ms)
    row.bytes = 2 * src.numel() * src.element_size()
    row.gbps = row.bytes / (row.time_ms * 1e-3) / 1e9
    return row


def fill_speedups(rows: list[Row]) -> None:
    """Speedups vs the dense variants measured on the same case (in place): vs the first
    of :data:`DENSE_VARIANTS` measured there (``dense_variant``), and vs the fastest."""
    order = [cls.name for cls in DENSE_VARIANTS]
    by_case: dict[str, list[Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, []).append(r)
    for group in by_case.values():
        dense = {r.variant: r.time_ms for r in group if r.kind == "dense" and r.status == "ok"}
        if not dense:
            continue
        own = min(dense, key=lambda v: (order.index(v) if v in order else len(order), dense[v]))
        others = {v: t for v, t in dense.items() if v not in OWN_DENSE} or dense
        best_name = min(others, key=others.get)
        graphs = {r.variant: r.time_graph_ms for r in group if r.kind == "dense" and r.status == "ok"
                  and r.variant not in OWN_DENSE and r.time_graph_ms == r.time_graph_ms}
        for r in group:
            if r.status == "ok" and r.kind in ("topth", "dense"):
                r.dense_variant = own
                r.best_dense_variant = best_name
                r.speedup_vs_dense = dense[own] / r.time_ms
                r.speedup_vs_best_dense = others[best_name] / r.time_ms
                if graphs and r.time_graph_ms == r.time_graph_ms:
                    r.speedup_graph_vs_best_dense = min(graphs.values()) / r.time_graph_ms


def run_cases(cases: list[Case], variants: list[Variant], device: torch.device, *, reps: int = 5,
              budget_ms: float = 200.0, copy_bytes: int = 0, progress: Optional[Callable] = None,
              seed: int = 0, rows: Optional[list] = None) -> list[Row]:
    """Run every variant on every case; returns the rows (speedups filled in).

    A case whose inputs or reference cannot be built gives one "error" row per variant.
    Rows are appended to ``rows`` when given, so a caller keeps the finished rows if the
    run is interrupted (then call :func:`fill_speedups` on them)."""
    rows = [] if rows is None else rows
    if copy_bytes:
        rows.append(copy_bandwidth(device, copy_bytes, budget_ms))
    for case in cases:
        try:
            ci = make_case_inputs(case, device, seed=seed)
            ref = reference_for(ci)
        except Exception as e:  # noqa: BLE001 - report it on the case's rows, go on
            for variant in variants:
                row = _base_row(case, variant, device)
                row.status, row.reason = "error", f"case setup: {type(e).__name__}: {e}"[:300]
                rows.append(row)
                if progress is not None:
                    progress(row)
            continue
        for variant in variants:
            row = measure(variant, ci, ref, device, reps=reps, budget_ms=budget_ms)
            rows.append(row)
            if progress is not None:
                progress(row)
        del ci, ref
        _empty_cache(device)
    fill_speedups(rows)
    return rows

