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
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from topth_ops.backends.torch_ref import reference_decode
from topth_ops.conformance.compare import TOLERANCES
from topth_ops.contract import DecodeInputs, DecodeStats

from .cases import Case
from .synth import CaseInputs, make_case_inputs

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
        """Counters of the last run (e.g. bytes moved); empty when the variant has none."""
        return {}

    def last_stats(self) -> Optional[DecodeStats]:
        """Statistics of the last run, for thresholded variants that return them."""
        return None


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
        out, stats = inputs.empty_outputs(fill=float("nan"))
        self._stats = stats
        return (lambda: self.backend.forward(inputs, out, stats)), (lambda: out)

    def counters(self):
        fn = getattr(self.backend, "bench_counters", None)
        return dict(fn()) if fn is not None else {}

    def last_stats(self):
        return getattr(self, "_stats", None)


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
    page of max_seq_len rows per sequence, no copy), CUDA-core decode kernel."""

    name = "flashinfer"
    use_tensor_cores = False

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
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND",
                                                          use_tensor_cores=self.use_tensor_cores)
        indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
        indices = torch.arange(B, dtype=torch.int32, device=dev)
        w.plan(indptr, indices, d.seq_lens.to(torch.int32), Hq, d.num_kv_heads, D, d.max_seq_len,
               q_data_type=d.dtype, kv_data_type=d.dtype, sm_scale=d.scale)
        holder = {}

        def fn():
            holder["out"] = w.run(d.query, (d.key_cache, d.value_cache))

        return fn, (lambda: holder["out"])


class FlashInferTCVariant(FlashInferVariant):
    """FlashInfer batch decode with ``use_tensor_cores=True`` (its prefill-style kernel,
    faster for large GQA groups)."""

    name = "flashinfer-tc"
    use_tensor_cores = True


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


class IfaVariant(Variant):
    """torch_npu ``npu_incre_flash_attention`` (Ascend's IncrementalFlashAttention) over the
    caches: BNSD, GQA, the case's scale and ``actual_seq_lengths``; the dense NPU baseline
    (issue 5's target is measured against it)."""

    name = "npu-ifa"

    def reasons(self, ci):
        d = ci.dense
        out = []
        try:
            import torch_npu  # noqa: F401
        except Exception as e:  # noqa: BLE001 - ImportError or a broken CANN install
            out.append(f"torch_npu not importable ({type(e).__name__})")
        if d.device.type != "npu":
            out.append("needs npu tensors")
        if d.dtype not in (torch.float16, torch.bfloat16):
            out.append("npu_incre_flash_attention takes float16 / bfloat16 only")
        return out

    def prepare(self, ci):
        import torch_npu

        d = ci.dense
        q = d.query.unsqueeze(2).contiguous()  # BNSD query [B, N, 1, D]
        lens = [int(x) for x in d.seq_lens.clamp(0, d.max_seq_len).cpu()]  # host list, read once
        holder = {}

        def fn():
            holder["out"] = torch_npu.npu_incre_flash_attention(
                q, d.key_cache, d.value_cache, num_heads=d.num_q_heads, num_key_value_heads=d.num_kv_heads,
                input_layout="BNSD", scale_value=d.scale, actual_seq_lengths=lens)

        return fn, (lambda: holder["out"][:, :, 0])


DENSE_VARIANTS = (TritonDenseVariant, IfaVariant, SdpaVariant, FlashInferVariant, FlashInferTCVariant,
                  FlashAttnVariant)
"""Dense baselines; the first one measured on a case is the reference for ``speedup_vs_dense``
(our Triton dense mode on CUDA, IFA on Ascend, else SDPA). ``speedup_vs_best_dense`` is
against the fastest of the others (:data:`OWN_DENSE` excluded): the dense kernel a user
would otherwise run."""

OWN_DENSE = ("triton-dense",)
"""Our own dense modes: reported, never the 'best dense' a target is measured against."""


def default_variants(backends: list[str]) -> list[Variant]:
    """Thresholded variants of ``backends`` plus every dense baseline."""
    return [BackendVariant(b) for b in backends] + [cls() for cls in DENSE_VARIANTS]


# --------------------------------------------------------------------------------------
# timing, bytes, checking
# --------------------------------------------------------------------------------------


L2_FLUSH_BYTES = 256 << 20
"""Buffer zeroed before each timed NPU run (Ascend 910B L2: 192 MB), as do_bench does on CUDA."""


def timing_method(device: torch.device) -> str:
    """How :func:`time_fn` times on ``device`` (recorded in every row)."""
    if device.type == "cuda":
        return "cuda (triton.testing.do_bench median, L2 flushed)"
    if device.type == "npu":
        return "npu (torch.npu.Event median after warm-up, L2 flushed)"
    return f"{device.type} wall clock median (NOT meaningful for GPU/NPU kernels)"


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize()


def time_fn(fn: Callable[[], None], device: torch.device, *, reps: int, budget_ms: float) -> float:
    """Median time of one call of ``fn``, in ms.

    Parameters
    ----------
    fn : callable
        Runs the variant once (asynchronously on an accelerator).
    device : torch.device
        cuda: ``triton.testing.do_bench`` (warm-up ``budget_ms / 4``, repetitions for
        ``budget_ms``, L2 flushed, median). npu: :func:`_time_npu` (device events, same
        scheme). cpu: wall clock of ``reps`` calls, median.
    reps : int
        Repetitions on the CPU; the least number of timed runs on npu.
    budget_ms : float
        Time budget of the timed runs on cuda and npu.
    """
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(5.0, budget_ms / 4), rep=budget_ms,
                                             return_mode="median"))
    if device.type == "npu":
        return _time_npu(fn, device, reps=reps, budget_ms=budget_ms)
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time_npu(fn: Callable[[], None], device: torch.device, *, reps: int, budget_ms: float,
              max_reps: int = 1000) -> float:
    """Median device time of ``fn`` on the current NPU stream, in ms (torch.npu.Event).

    Five calls estimate the time per call; warm-up continues to ``budget_ms / 4``; then
    ``n = clamp(budget_ms / estimate, reps, max_reps)`` runs are timed, each between its own
    pair of events, with :data:`L2_FLUSH_BYTES` zeroed before it (outside the events) so
    that no run finds the caches in L2. Events are read after one final synchronisation.
    """
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    synchronize(device)
    start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(int(budget_ms / 4 / est)):
        fn()
    n = int(min(max_reps, max(reps, budget_ms / est)))
    starts = [torch.npu.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.npu.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


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
        from .gpu import time_cuda_graph

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


def resolve_device(spec: Optional[str] = None) -> torch.device:
    """The benchmark device: ``spec`` ("cpu", "cuda[:i]", "npu[:i]") or, when None, cuda if
    available, else npu if torch_npu sees one, else cpu.

    Raises
    ------
    RuntimeError
        ``spec`` names npu and torch_npu is not importable or sees no NPU, or cuda without one.
    """
    if spec is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():
                return torch.device("npu")
        except Exception:  # noqa: BLE001 - no usable torch_npu: not an NPU machine
            pass
        return torch.device("cpu")
    if spec.split(":")[0] == "npu":
        try:
            import torch_npu  # noqa: F401 - registers the "npu" device type
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"--device npu needs torch_npu ({type(e).__name__}: {e})") from e
        if not torch.npu.is_available():
            raise RuntimeError("--device npu: torch_npu sees no Ascend NPU")
    elif spec.split(":")[0] == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return torch.device(spec)


def device_name(device: torch.device) -> str:
    """Human-readable device name (GPU / NPU model, or the device type)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device.index or 0)
    return device.type


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "npu":
        torch.npu.empty_cache()


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
    """The main table: one line per row (status, union fraction, time, GB/s, speedups,
    bound, max abs error, reason); on CUDA also the CUDA-graph time and the speedup over
    the best external dense baseline from graph times."""
    graphs = any(r.time_graph_ms == r.time_graph_ms for r in rows)
    gh = f" {'graph_ms':>9} {'x best g':>8}" if graphs else ""
    head = (f"{'case':<30} {'variant':<13} {'status':<11} {'f_union':>7} {'time_ms':>9} {'GB/s':>8} "
            f"{'x dense':>7} {'x best':>7}{gh} {'bound':>6} {'err':>8}  reason")
    lines = [head, "-" * len(head)]
    for r in rows:
        g = (f" {_fmt(r.time_graph_ms, '9.4f')} {_fmt(r.speedup_graph_vs_best_dense, '8.2f')}" if graphs else "")
        lines.append(
            f"{r.case:<30} {r.variant:<13} {r.status:<11} {_fmt(r.kept_union_frac, '7.3f')} "
            f"{_fmt(r.time_ms, '9.4f')} {_fmt(r.gbps, '8.1f')} {_fmt(r.speedup_vs_dense, '7.2f')} "
            f"{_fmt(r.speedup_vs_best_dense, '7.2f')}{g} {_fmt(r.bound, '6.2f')} "
            f"{_fmt(r.max_abs_err, '8.2g')}  {r.reason}"
        )
    if rows and any(r.best_dense_variant for r in rows):
        lines.append("x best: vs the fastest dense baseline other than our own dense mode "
                     "(FlashInfer with / without tensor cores, flash-attn, SDPA, IFA: whichever ran)")
    return "\n".join(lines)


def format_bytes_table(rows: list[Row]) -> str:
    """Counted vs expected GM -> UB bytes of the rows whose backend counts them (empty
    string when none does): K, V (and V as a fraction of all valid V rows, against the
    requested f), workspace, the traffic bound (K + V_dense) / (K + V) from the counted
    bytes, and the check."""
    counted = [r for r in rows if r.bytes_check]
    if not counted:
        return ""
    n = lambda x: "-" if x is None else str(x)  # noqa: E731
    head = (f"{'case':<30} {'variant':<12} {'f':>5} {'K bytes':>10} {'K exp.':>10} {'V bytes':>10} "
            f"{'V exp.':>10} {'V/Vdense':>8} {'ws bytes':>9} {'ws exp.':>9} {'bound':>6}  check")
    lines = ["GM -> UB bytes counted by the backend vs expected from the inputs and the reference's v_rows",
             head, "-" * len(head)]
    for r in counted:
        vfrac = bound = float("nan")
        if r.v_bytes is not None and r.k_bytes_expected:
            vfrac = r.v_bytes / r.k_bytes_expected  # V_dense = every valid V row = the K rows
            if r.k_bytes is not None:
                bound = 2 * r.k_bytes_expected / (r.k_bytes + r.v_bytes)
        lines.append(f"{r.case:<30} {r.variant:<12} {r.kept_frac:>5.2f} {n(r.k_bytes):>10} {n(r.k_bytes_expected):>10} "
                     f"{n(r.v_bytes):>10} {n(r.v_bytes_expected):>10} {_fmt(vfrac, '8.3f')} {n(r.ws_bytes):>9} "
                     f"{n(r.ws_bytes_expected):>9} {_fmt(bound, '6.2f')}  {r.bytes_check}")
    return "\n".join(lines)


def check_targets(rows: list[Row]) -> list[tuple[str, bool, str]]:
    """The speed targets, evaluated on the rows present. Issue 13 (``h200`` set): Triton
    dense mode >= 85% of copy bandwidth; pre_softmax f=0.1 >= 1.6x and f=0.3 >= 1.4x over
    the **best external dense baseline** (FlashInfer with / without tensor cores,
    flash-attn, SDPA: the fastest that ran), from CUDA-graph times where both sides have
    one (launch overhead excluded, as in a serving engine), else from plain times. Issue 5
    (``npu`` set): ``ascendc`` at f=0.1, 32k, batch 1, fp16 pre_softmax >= 1.5x vs dense
    IFA. Returns (target, passed, detail) for each target with data."""
    out = []
    copy = next((r for r in rows if r.kind == "copy" and r.status == "ok"), None)
    get = lambda case, var: next((r for r in rows if r.case == case and r.variant == var and r.status == "ok"), None)  # noqa: E731
    dense = get("h200-pre-f0.1", "triton-dense")
    if copy is not None and dense is not None:
        t = dense.time_graph_ms if dense.time_graph_ms == dense.time_graph_ms else dense.time_ms
        gbps = dense.bytes / (t * 1e-3) / 1e9
        frac = gbps / copy.gbps
        out.append(("dense mode >= 85% of copy bandwidth", frac >= 0.85,
                    f"{gbps:.0f} GB/s vs copy {copy.gbps:.0f} GB/s = {100 * frac:.1f}%"))
    for case, need in (("h200-pre-f0.1", 1.6), ("h200-pre-f0.3", 1.4)):
        r = get(case, "triton")
        if r is None:
            continue
        graph = r.speedup_graph_vs_best_dense == r.speedup_graph_vs_best_dense
        x = r.speedup_graph_vs_best_dense if graph else r.speedup_vs_best_dense
        out.append((f"{case}: triton >= {need}x vs the best dense baseline ({r.best_dense_variant or '-'})",
                    x >= need, f"{x:.2f}x ({'CUDA graphs' if graph else 'plain launches'}; plain "
                    f"{r.speedup_vs_best_dense:.2f}x; vs own dense mode {r.speedup_vs_dense:.2f}x; bound "
                    f"{r.bound:.2f}x at f_union {r.kept_union_frac:.3f})"))
    r = get("npu-b1-pre-f0.1", "ascendc")
    if r is not None:
        out.append((f"npu-b1-pre-f0.1: ascendc >= 1.5x vs {r.dense_variant or 'dense'}", r.speedup_vs_dense >= 1.5,
                    f"{r.speedup_vs_dense:.2f}x (bound {r.bound:.2f}x, f_union {r.kept_union_frac:.3f}, "
                    f"vs best dense {r.speedup_vs_best_dense:.2f}x)"))
    return out


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot(rows: list[Row], path, *, title: str) -> bool:
    """PNG: speedup vs the dense baseline against the kept-union fraction, with the
    2/(1+f) bound; achieved GB/s per variant; and, when a backend counts bytes, counted V
    bytes / dense V bytes against f. Returns False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if r.status == "ok"]
    counted = [r for r in rows if r.v_bytes is not None and r.k_bytes_expected]
    fig, axes = plt.subplots(1, 3 if counted else 2, figsize=(19 if counted else 13, 4.8))
    ax1, ax2 = axes[0], axes[1]
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
    _legend(ax1)
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
    _legend(ax2)
    if counted:
        ax3 = axes[2]
        for variant in sorted({r.variant for r in counted}):
            for placement, marker in (("pre_softmax", "o"), ("post_softmax", "s")):
                pts = sorted((r.kept_union_frac, r.v_bytes / r.k_bytes_expected) for r in counted
                             if r.variant == variant and r.placement == placement)
                if pts:
                    ax3.plot(*zip(*pts), marker=marker, linestyle="", label=f"{variant} {placement}")
        ax3.plot([0, 1], [0, 1], "k--", lw=1, label="V bytes = f x dense V bytes")
        ax3.set_xlabel("kept V-row fraction f (union over the KV group, reference stats)")
        ax3.set_ylabel("counted V bytes / dense V bytes")
        ax3.grid(alpha=0.3)
        _legend(ax3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
