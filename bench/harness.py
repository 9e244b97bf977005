"""Kernel benchmark harness: every (variant, case) pair gives one measurement row.

Structure (kept deliberately flat so other backends plug in):

- a *case* (:class:`topth_ops.bench.cases.Case`) is data: shapes, dtype, placement,
  requested kept fraction;
- a *variant* (:class:`Variant`) is one thing to run on a case: the thresholded op of a
  registered backend (``BackendVariant``: every backend of the registry that can run the
  inputs, e.g. ``triton``, ``torch``, later ``ascendc`` / ``ascendc-cpu``), the dense mode
  of our Triton kernel, or a dense baseline (torch SDPA, FlashInfer, flash-attn);
- :func:`measure` runs one variant on one case: output check against the torch reference
  first (a wrong result is never timed), then the median time, the bytes that must move,
  GB/s, speedups and the 2/(1+f) bound. Unsupported pairs become rows with status
  "skipped" and the reasons.

A backend that counts its own memory traffic (e.g. the Ascend C CPU model's GM-to-UB
bytes) exposes ``bench_counters() -> dict`` on its Backend object; the harness calls it
after the checked run and stores the values in the row (``counted_bytes`` and ``counters``).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from topth_ops.backends.torch_ref import reference_decode
from topth_ops.conformance.compare import TOLERANCES
from topth_ops.contract import DecodeInputs

from .cases import Case
from .synth import CaseInputs, make_case_inputs



@dataclass
class Row:
    """One measurement: a variant on a case (CSV row). Times in ms, bandwidth in GB/s."""

    case: str
    variant: str
    kind: str  # "topth" (thresholded), "dense" (baseline), "copy" (device bandwidth)
    status: str  # "ok", "skipped", "wrong", "error"
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
    speedup_vs_best_dense: float = float("nan")
    bound: float = float("nan")  # 2 / (1 + f) with f = kept_union_frac
    counted_bytes: float = float("nan")  # from a backend's own counters, if any
    counters: str = ""


# --------------------------------------------------------------------------------------
# variants
# --------------------------------------------------------------------------------------


class Variant:
    """Something to run on a case. ``prepare`` returns a zero-argument function that runs
    it once and a function returning its last output ``[B, Hq, D]``."""

    name = ""
    kind = "dense"

    def reasons(self, ci: CaseInputs) -> list[str]:
        return []

    def prepare(self, ci: CaseInputs) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
        raise NotImplementedError

    def counters(self) -> dict:
        return {}


class BackendVariant(Variant):
    """The thresholded op of a registered backend, called through ``Backend.forward``
    (the direct path, no custom-op dispatch)."""

    kind = "topth"

    def __init__(self, backend_name: str):
        from topth_ops.registry import get_backend

        self.backend = get_backend(backend_name)
        self.name = backend_name

    def reasons(self, ci):
        return self.backend.not_supported_reasons(ci.inputs)

    def prepare(self, ci):
        inputs = ci.inputs
        out, stats = inputs.empty_outputs()
        return (lambda: self.backend.forward(inputs, out, stats)), (lambda: out)

    def counters(self):
        fn = getattr(self.backend, "bench_counters", None)
        return dict(fn()) if fn is not None else {}


class TritonDenseVariant(Variant):
    """Dense mode of our Triton kernel (no threshold): the in-house baseline."""

    name = "triton-dense"

    def reasons(self, ci):
        from topth_ops.registry import get_backend

        return get_backend("triton").not_supported_reasons(ci.dense)

    def prepare(self, ci):
        from topth_ops.cuda_kernels import decode_attn_fwd

        d = ci.dense
        out = torch.empty_like(d.query)
        fn = lambda: decode_attn_fwd(d.query, d.key_cache, d.value_cache, d.seq_lens, None, out,  # noqa: E731
                                     scale=d.scale, dense=True)
        return fn, (lambda: out)


class SdpaVariant(Variant):
    """torch.nn.functional.scaled_dot_product_attention over the caches (GQA via
    enable_gqa); ragged batches use a boolean mask over max_seq_len."""

    name = "sdpa"

    def prepare(self, ci):
        d = ci.dense
        q = d.query.unsqueeze(2)  # [B, Hq, 1, D]
        ragged = ci.case.ragged or int(d.seq_lens.min()) != d.max_seq_len
        mask = None
        if ragged:
            pos = torch.arange(d.max_seq_len, device=d.device)
            mask = (pos[None, :] < d.seq_lens[:, None].long())[:, None, None, :]
        holder = {}

        def fn():
            holder["out"] = torch.nn.functional.scaled_dot_product_attention(
                q, d.key_cache, d.value_cache, attn_mask=mask, scale=d.scale, enable_gqa=True)

        return fn, (lambda: holder["out"][:, :, 0])


class FlashInferVariant(Variant):
    """FlashInfer batch decode (paged wrapper; the BNSD cache is an HND paged cache with one
    page of max_seq_len rows per sequence, no copy)."""

    name = "flashinfer"

    def reasons(self, ci):
        try:
            import flashinfer  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means "not here"
            return [f"flashinfer not importable ({type(e).__name__})"]
        return [] if ci.dense.device.type == "cuda" else ["needs cuda"]

    def prepare(self, ci):
        import flashinfer

        d = ci.dense
        B, Hq, D = d.query.shape
        dev = d.device
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND")
        indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
        indices = torch.arange(B, dtype=torch.int32, device=dev)
        w.plan(indptr, indices, d.seq_lens.to(torch.int32), Hq, d.num_kv_heads, D, d.max_seq_len,
               q_data_type=d.dtype, kv_data_type=d.dtype, sm_scale=d.scale)
        holder = {}

        def fn():
            holder["out"] = w.run(d.query, (d.key_cache, d.value_cache))

        return fn, (lambda: holder["out"])


class FlashAttnVariant(Variant):
    """flash-attn ``flash_attn_with_kvcache`` (BSHD copy of the caches made once, untimed)."""

    name = "flash-attn"

    def reasons(self, ci):
        try:
            import flash_attn  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return [f"flash_attn not importable ({type(e).__name__})"]
        if ci.dense.device.type != "cuda":
            return ["needs cuda"]
        if ci.dense.dtype == torch.float32:
            return ["flash-attn has no float32 kernels"]
        return []

    def prepare(self, ci):
        from flash_attn import flash_attn_with_kvcache

        d = ci.dense
        k = d.key_cache.transpose(1, 2).contiguous()
        v = d.value_cache.transpose(1, 2).contiguous()
        q = d.query.unsqueeze(1)
        lens = d.seq_lens.to(torch.int32)
        holder = {}

        def fn():
            holder["out"] = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, softmax_scale=d.scale)

        return fn, (lambda: holder["out"][:, 0])


DENSE_VARIANTS = (TritonDenseVariant, SdpaVariant, FlashInferVariant, FlashAttnVariant)


def default_variants(backends: list[str]) -> list[Variant]:
    """Thresholded variants of ``backends`` plus every dense baseline."""
    return [BackendVariant(b) for b in backends] + [cls() for cls in DENSE_VARIANTS]


# --------------------------------------------------------------------------------------
# timing, bytes, checking
# --------------------------------------------------------------------------------------


def timing_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda (triton.testing.do_bench median, L2 flushed)"
    return f"{device.type} wall clock median (NOT meaningful for GPU/NPU kernels)"


def time_fn(fn: Callable[[], None], device: torch.device, *, reps: int, budget_ms: float) -> float:
    """Median time of ``fn`` in ms (on CUDA: triton.testing.do_bench with L2 flush)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(5.0, budget_ms / 4), rep=budget_ms,
                                             return_mode="median"))
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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


def max_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """Max abs error and whether ``out`` is within the conformance suite's tolerance for the
    dtype (|d| <= atol + rtol |ref|, topth_ops.conformance.compare.TOLERANCES)."""
    o, r = out.float(), ref.float()
    tol = TOLERANCES[ref.dtype]
    diff = (o - r).abs()
    ok = bool(((diff <= tol["atol"] + tol["rtol"] * r.abs()) | (o.isnan() & r.isnan())).all())
    err = float(torch.nan_to_num(diff, nan=float("inf")).max()) if diff.numel() else 0.0
    return err, ok


# --------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------


@dataclass
class CaseReference:
    out: torch.Tensor
    dense_out: torch.Tensor
    v_rows_total: int
    valid_rows_total: int
    kept_total: int
    kept_union_frac: float
    kept_head_frac: float


def reference_for(ci: CaseInputs) -> CaseReference:
    """Torch-reference outputs and the achieved fractions of one case."""
    out, st = reference_decode(ci.inputs)
    dense_out, _ = reference_decode(ci.dense)
    n = ci.inputs.seq_lens.to(torch.int64).clamp(0, ci.inputs.max_seq_len)
    valid = int(n.sum())
    v_rows = int(st.v_rows.sum())
    kept = int(st.kept.sum())
    return CaseReference(
        out=out, dense_out=dense_out, v_rows_total=v_rows,
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
    """Check then time one variant on one case (see the module docstring)."""
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
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        expected = ref.out if variant.kind == "topth" else ref.dense_out
        row.max_abs_err, ok = max_error(get_out(), expected)
        counters = variant.counters()
        if counters:
            row.counters = json.dumps(counters, sort_keys=True)
            row.counted_bytes = float(counters.get("bytes", counters.get("gm_to_ub_bytes", float("nan"))))
        if not ok:
            row.status = "wrong"
            row.reason = f"output differs from the torch reference (max abs err {row.max_abs_err:.3g})"
            return row
        row.time_ms = time_fn(fn, device, reps=reps, budget_ms=budget_ms)
    except Exception as e:  # noqa: BLE001 - a failing variant must not stop the benchmark
        row.status, row.reason = "error", f"{type(e).__name__}: {e}"[:300]
        return row
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
    """Speedups vs the dense variants measured on the same case (in place)."""
    by_case: dict[str, list[Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, []).append(r)
    for group in by_case.values():
        dense = {r.variant: r.time_ms for r in group if r.kind == "dense" and r.status == "ok"}
        if not dense:
            continue
        own = "triton-dense" if "triton-dense" in dense else ("sdpa" if "sdpa" in dense else min(dense, key=dense.get))
        best = min(dense.values())
        for r in group:
            if r.status == "ok" and r.kind in ("topth", "dense"):
                r.dense_variant = own
                r.speedup_vs_dense = dense[own] / r.time_ms
                r.speedup_vs_best_dense = best / r.time_ms


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def run_cases(cases: list[Case], variants: list[Variant], device: torch.device, *, reps: int = 5,
              budget_ms: float = 200.0, copy_bytes: int = 0, progress: Optional[Callable] = None,
              seed: int = 0, rows: Optional[list] = None) -> list[Row]:
    """Run every variant on every case; returns the rows (speedups filled in).

    Rows are appended to ``rows`` when given, so a caller keeps the finished rows if the
    run is interrupted (then call :func:`fill_speedups` on them)."""
    rows = [] if rows is None else rows
    if copy_bytes:
        rows.append(copy_bandwidth(device, copy_bytes, budget_ms))
    for case in cases:
        ci = make_case_inputs(case, device, seed=seed)
        ref = reference_for(ci)
        for variant in variants:
            row = measure(variant, ci, ref, device, reps=reps, budget_ms=budget_ms)
            rows.append(row)
            if progress is not None:
                progress(row)
        del ci, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    fill_speedups(rows)
    return rows


# --------------------------------------------------------------------------------------
# reports
# --------------------------------------------------------------------------------------


def write_csv(rows: list[Row], path) -> None:
    names = list(asdict(rows[0]).keys()) if rows else [f.name for f in Row.__dataclass_fields__.values()]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=names)
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def _fmt(x, spec):
    if isinstance(x, float) and math.isnan(x):
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width or 1))
    return format(x, spec)


def format_table(rows: list[Row]) -> str:
    head = (f"{'case':<28} {'variant':<13} {'status':<7} {'f_union':>7} {'time_ms':>9} {'GB/s':>8} "
            f"{'x dense':>7} {'x best':>7} {'bound':>6} {'err':>8}  reason")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.case:<28} {r.variant:<13} {r.status:<7} {_fmt(r.kept_union_frac, '7.3f')} "
            f"{_fmt(r.time_ms, '9.4f')} {_fmt(r.gbps, '8.1f')} {_fmt(r.speedup_vs_dense, '7.2f')} "
            f"{_fmt(r.speedup_vs_best_dense, '7.2f')} {_fmt(r.bound, '6.2f')} "
            f"{_fmt(r.max_abs_err, '8.2g')}  {r.reason}"
        )
    return "\n".join(lines)


def check_targets(rows: list[Row]) -> list[tuple[str, bool, str]]:
    """The H200 targets of issue 4, evaluated on rows of the ``h200`` case set:
    dense mode >= 85% of copy bandwidth; pre_softmax f=0.1 >= 1.6x and f=0.3 >= 1.4x vs
    the dense mode. Returns (target, passed, detail) for each target with data."""
    out = []
    copy = next((r for r in rows if r.kind == "copy" and r.status == "ok"), None)
    get = lambda case, var: next((r for r in rows if r.case == case and r.variant == var and r.status == "ok"), None)  # noqa: E731
    dense = get("h200-pre-f0.1", "triton-dense")
    if copy is not None and dense is not None:
        frac = dense.gbps / copy.gbps
        out.append(("dense mode >= 85% of copy bandwidth", frac >= 0.85,
                    f"{dense.gbps:.0f} GB/s vs copy {copy.gbps:.0f} GB/s = {100 * frac:.1f}%"))
    for case, need in (("h200-pre-f0.1", 1.6), ("h200-pre-f0.3", 1.4)):
        r = get(case, "triton")
        if r is not None:
            out.append((f"{case}: >= {need}x vs dense", r.speedup_vs_dense >= need,
                        f"{r.speedup_vs_dense:.2f}x (bound {r.bound:.2f}x, f_union {r.kept_union_frac:.3f}, "
                        f"vs best dense {r.speedup_vs_best_dense:.2f}x)"))
    return out


def plot(rows: list[Row], path, *, title: str) -> bool:
    """PNG: speedup vs the dense baseline against the kept-union fraction, with the
    2/(1+f) bound, and achieved GB/s per variant. Returns False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if r.status == "ok"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for variant in sorted({r.variant for r in ok if r.kind == "topth"}):
        for placement, marker in (("pre_softmax", "o"), ("post_softmax", "s")):
            pts = sorted((r.kept_union_frac, r.speedup_vs_dense) for r in ok
                         if r.variant == variant and r.placement == placement and not math.isnan(r.speedup_vs_dense))
            if pts:
                ax1.plot(*zip(*pts), marker=marker, linestyle="", label=f"{variant} {placement}")
    fs = [i / 100 for i in range(1, 101)]
    ax1.plot(fs, [2 / (1 + f) for f in fs], "k--", lw=1, label="bound 2/(1+f)")
    ax1.set_xlabel("kept V-row fraction f (union over the KV group)")
    ax1.set_ylabel("speedup vs dense baseline")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    cases = [c for c in dict.fromkeys(r.case for r in ok if r.kind != "copy")]
    variants = sorted({r.variant for r in ok if r.kind != "copy"})
    width = 0.8 / max(1, len(variants))
    for i, var in enumerate(variants):
        ys = [next((r.gbps for r in ok if r.case == c and r.variant == var), 0.0) for c in cases]
        ax2.bar([j + i * width for j in range(len(cases))], ys, width, label=var)
    copy = next((r for r in ok if r.kind == "copy"), None)
    if copy is not None:
        ax2.axhline(copy.gbps, color="k", ls="--", lw=1, label="device copy")
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax2.set_xticklabels(cases, rotation=60, ha="right", fontsize=6)
    ax2.set_ylabel("GB/s (bytes that must move / time)")
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
