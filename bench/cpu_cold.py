"""Cold-cache CPU decode benchmark over the KV layouts serving engines use.

Decode inside a model reads each layer's KV cache once per step, from DRAM. This benchmark
times that: every timed call reads a different per-layer cache, and the layers rotate over
more bytes than the last-level cache holds (sized from the machine), so no call finds its
cache in LLC. Variants are interleaved: each round times every variant's rotation once, in a
new random order, and a row is the median over rounds (these machines' speed drifts over
minutes, which sequential timing would attribute to whichever variant ran then). Each
variant reports ms per layer, GB/s of K + V actually read, and that as a
percentage of a read-bandwidth probe (a sum over a 1 GiB tensor) taken in the same run with
the same thread count.

Layouts of the same data (``topth_ops.decode_attention`` backend ``cpu``):

- ``BNSD``: contiguous ``[batch, kv_heads, seq, head_dim]``;
- ``NHD<bs>``, ``HND<bs>``: paged caches (:func:`topth_ops.paged.to_paged`), blocks in
  random order;
- ``vllm<bs>``: vLLM CPU_ATTN's own cache ``[num_blocks, kv_heads, block_size, 2 * head_dim]``
  (a K region then a V region per block and head) as vLLM's own writer
  ``cpu_attn_reshape_and_cache`` fills it: with its AMX ISA (bfloat16) each region is packed
  for tiles, read as ``kv_layout="VLLM_AMX"``; with its vector ISA K is stored transposed per
  block, read as an HND view with strides (slot 1, dim block_size). Without vLLM's CPU build:
  the same packing by :func:`topth_ops.paged.to_paged` (bfloat16), or K transposed per block
  (other dtypes).

Variants: ``dense`` (every V row read), ``f=0.1`` (group selection, one threshold per KV head
at the 90th percentile of the group-maximum scores, or log-probabilities with
``--placement post_softmax``, the default and recommended placement: about 10% of the V rows
read; the measured fraction is reported), ``f=0.3`` (the same at the 70th percentile),
``sdpa`` (torch's ``scaled_dot_product_attention`` with
``enable_gqa`` on BNSD), ``vllm-kernel`` (vLLM's ``cpu_attention_with_kv_cache`` on its own
layout, block 128, written by its own ``cpu_attn_reshape_and_cache``) when vLLM's CPU build
imports, and ``K read``: a plain read of the layer's K bytes as this layout stores them (torch
float32 sums over the cache's K regions, in address order: one contiguous region per block
and KV head where they are split by V regions, as in vLLM's cache). It is what the machine
itself gives for the bytes of the K pass in that layout (docs/cpu.md, "Where it stands").

Every layout and variant of the ``cpu`` kernel is checked once against the torch reference
(output within the dtype tolerance, V rows exact) before anything is timed.

Usage: ``python -m topth_ops.bench.cpu_cold [--shapes smollm2,llama8b] [--threads 1,2]
[--placement post_softmax|pre_softmax] [--json OUT]``. Record the printed machine line with
every result (the tables recorded until 2026-12-06 timed pre_softmax).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from topth_ops import decode_attention

from .cold_layouts import k_regions, layer_caches
from .cpu import vllm_decode, within_tolerance
from .machine import Machine, machine, mem_available

SHAPES = {
    # name: (batch, q heads, kv heads, head_dim, seq_len, dtype)
    "smollm2": (8, 9, 3, 64, 8192, torch.bfloat16),
    "llama8b": (8, 32, 8, 128, 8192, torch.bfloat16),
    "llama8b-fp32-b1": (1, 32, 8, 128, 32768, torch.float32),
    "gemma3-global": (4, 4, 1, 256, 16384, torch.bfloat16),  # Gemma 3 270M's global layers, serving workload (b)
}
LAYOUTS = ("BNSD", "NHD16", "NHD32", "NHD48", "HND128", "HND256", "vllm128")
PROBE_BYTES = 1 << 30
MAX_POOL_BYTES = 6 << 30
"""Upper bound of the rotated caches of one layout (memory of these 24 GiB machines); every
layout is resident at once (interleaved timing), so run_shape refuses a run that would need
more than 70% of the machine's memory."""


@dataclass
class Row:
    shape: str
    layout: str
    variant: str
    threads: int
    layers: int
    ms_per_layer: float = float("nan")
    gb_read: float = float("nan")
    gbps: float = float("nan")
    pct_probe: float = float("nan")
    v_rows_frac: float = 1.0
    probe_gbps: float = float("nan")
    note: str = ""
    times_ms: list = field(default_factory=list)


def _layer_count(per_layer: int, llc: int) -> int:
    return max(3, min(MAX_POOL_BYTES // max(per_layer, 1), 2 * llc // max(per_layer, 1) + 2))


def thresholds(q: torch.Tensor, k: torch.Tensor, scale: float, placement: str):
    """The variants' thresholds, from one layer, for group selection (one per KV head).

    Parameters
    ----------
    q : torch.Tensor
        [batch, q_heads, head_dim], the query.
    k : torch.Tensor
        [batch, kv_heads, seq, head_dim] (BNSD), the layer's keys; q_heads a multiple of kv_heads.
    scale : float
        The softmax scale.
    placement : str
        ``"pre_softmax"`` (thresholds on scores) or ``"post_softmax"`` (on probabilities).

    Returns
    -------
    dense : torch.Tensor
        [kv_heads, 1] float32: -inf (pre_softmax) or 0 (post_softmax), every V row read.
    theta : dict
        {0.1: ..., 0.3: ...}, [kv_heads, 1] float32 each: the threshold at the 90th (70th)
        percentile of the group-maximum scores, or of the group-maximum log-probabilities
        a - logsumexp(a) of each row returned as a probability (post_softmax), over every
        sequence (:func:`gap_threshold`): about 10% (30%) of each group's V rows kept.

    Raises
    ------
    ValueError
        ``placement`` is neither of the two.
    """
    if placement not in ("pre_softmax", "post_softmax"):
        raise ValueError(f"placement must be 'pre_softmax' or 'post_softmax', got {placement!r}")
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    a = torch.einsum("bkgd,bksd->bkgs", q.float().view(B, Hkv, Hq // Hkv, D), k.float()) * scale
    if placement == "post_softmax":
        a = a - torch.logsumexp(a, dim=-1, keepdim=True)
    gmax = a.amax(2).permute(1, 0, 2).reshape(Hkv, -1)
    theta = {f: gap_threshold(gmax, 1.0 - f) for f in (0.1, 0.3)}
    if placement == "post_softmax":
        return torch.zeros(Hkv, 1), {f: t.exp() for f, t in theta.items()}
    return torch.full((Hkv, 1), float("-inf")), theta


def gap_threshold(scores: torch.Tensor, q: float) -> torch.Tensor:
    """Per row of ``scores`` [H, N], a threshold near its ``q`` quantile that no score lies
    close to: the midpoint of the widest gap between sorted neighbours within N / 256 ranks
    (at most 64) of the quantile, the window doubled while every score in it is tied. The kernel's float32 scores differ from torch's in the last bits
    (another summation order); a threshold equal to a score would make the check of kept V
    rows fail on rounding, not on a wrong answer. Returns [H, 1] float32."""
    s, _ = scores.float().sort(dim=1)
    n = s.shape[1]
    i = int(round(q * (n - 1)))
    out = s[:, i:i + 1].clone()
    for h in range(s.shape[0]):
        window = min(64, max(1, n // 256))
        while True:  # widened while every score near the quantile is tied
            lo, hi = max(0, i - window), min(n - 1, i + window)
            if hi <= lo:
                break
            gaps = s[h, lo + 1:hi + 1] - s[h, lo:hi]
            j = int(gaps.argmax()) + lo
            if gaps[j - lo] > 0 or (lo == 0 and hi == n - 1):
                out[h, 0] = (s[h, j] + s[h, j + 1]) / 2
                break
            window *= 2
    return out.contiguous()


def _time_rotation(calls: list[Callable[[], None]]) -> float:
    """ms per call of one rotation: each layer's function once, in order."""
    t = time.perf_counter()
    for fn in calls:
        fn()
    return (time.perf_counter() - t) * 1e3 / len(calls)


def _vllm_calls(layers, q, lens, scale):
    """vLLM's own CPU attention over its own cache (block 128), one per layer; (calls, note)."""
    try:
        built = [vllm_decode(q, k, v, lens, scale) for k, v in layers]
    except ImportError as e:  # vLLM's CPU build absent or broken: say why
        return None, f"vLLM's CPU build not importable ({type(e).__name__})"
    return [fn for fn, _out, _isa in built], f"isa {built[0][2]}"


def _check(out, st, refs: dict, variant: str, layout: str, layer0, q, lens, th, scale, placement) -> None:
    """Before timing: the kernel's output on layer 0 in ``layout`` equals the torch reference
    on BNSD (dtype tolerance), and its V rows equal the reference's exactly.

    Raises
    ------
    RuntimeError
        A layout or variant computes something else (the timing would be meaningless).
    """
    if variant not in refs:
        refs[variant] = decode_attention(q, layer0[0], layer0[1], lens, th, scale=scale, placement=placement,
                                         selection="group", backend="torch", return_stats=True)
    ref, ref_st = refs[variant]
    ok, err = within_tolerance(out, ref)
    if not ok or not torch.equal(st.v_rows, ref_st.v_rows):
        raise RuntimeError(f"{layout} {variant}: the cpu kernel differs from the torch reference "
                           f"(max abs err {err:.3g}, V rows {int(st.v_rows.sum())} vs "
                           f"{int(ref_st.v_rows.sum())})")


def run_shape(name: str, threads: list[int], mach: Machine, rounds: int, layouts=LAYOUTS,
              seed: int = 0, placement: str = "post_softmax") -> list[Row]:
    """Every layout and variant of one shape, timed interleaved with the read probe: each round
    runs every variant's rotation over the layers once and the probe once, in a new random
    order (this machine's speed drifts over minutes; a row is the median over rounds, its
    percentage is of the probe's median in the same rounds). ``placement``: of the ``cpu``
    kernel's variants (their thresholds: :func:`thresholds`)."""
    B, Hq, Hkv, D, S, dt = SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    per_layer = 2 * B * Hkv * S * D * dt.itemsize
    L = _layer_count(per_layer, mach.llc_bytes)
    layers = [(torch.randn(B, Hkv, S, D, generator=gen).to(dt), torch.randn(B, Hkv, S, D, generator=gen).to(dt))
              for _ in range(L)]
    q = torch.randn(B, Hq, D, generator=gen).to(dt)
    lens = torch.full((B,), S, dtype=torch.int64)
    scale = 1.0 / math.sqrt(D)
    dense_th, theta = thresholds(q, layers[0][0], scale, placement)
    refs: dict = {}
    kv_bytes = per_layer
    # every layout resident, + the BNSD layers, vLLM's copy (one at a time, rebuilt per thread
    # count) and its writer's transposed copy of one layer
    need = per_layer * (L * (len(layouts) + 2) + 1) + PROBE_BYTES
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    if avail and need > 0.7 * avail:
        raise MemoryError(f"{name}: the interleaved timing keeps every layout's {L} layers resident, "
                          f"{need / 2**30:.1f} GiB of {avail / 2**30:.1f} GiB; pass fewer --layouts")
    timed = []  # (layout, variant, bytes read, V-row fraction, calls, note)
    for i, layout in enumerate(layouts):
        # what is still to be allocated: this and the later layouts' caches (BNSD reuses the
        # layers), vLLM's copy, its writer's transposed layer and the read probe
        rest = (per_layer * L * (sum(x != "BNSD" for x in layouts[i:]) + 1) + per_layer + PROBE_BYTES)
        left = mem_available()
        if left is not None and left < rest:
            raise MemoryError(f"{name}: building {', '.join(layouts[i:])} needs about {rest / 2**30:.1f} GiB more "
                              f"({L} layers of {per_layer / 2**20:.0f} MiB each, vLLM's copy, the probe), "
                              f"{left / 2**30:.1f} GiB is available; pass fewer --layouts or run this shape alone")
        caches = [layer_caches(layout, k, v, lens, gen) for k, v in layers]
        for variant, th in (("dense", dense_th), ("f=0.1", theta[0.1]), ("f=0.3", theta[0.3])):
            out, st = decode_attention(q, caches[0][0], caches[0][1], lens, th, scale=scale, placement=placement,
                                       selection="group", backend="cpu", return_stats=True, **caches[0][2])
            _check(out, st, refs, variant, layout, layers[0], q, lens, th, scale, placement)
            frac = float(st.v_rows.double().sum()) / (B * Hkv * S)
            read = B * Hkv * S * D * dt.itemsize * (1 + frac)
            calls = [lambda c=c, t=th: decode_attention(q, c[0], c[1], lens, t, scale=scale, placement=placement,
                                                        selection="group", backend="cpu", **c[2]) for c in caches]
            timed.append((layout, variant, read, frac, calls, ""))
        regions = [k_regions(c[0]) for c in caches]
        if all(r is not None for r in regions):
            timed.append((layout, "K read", regions[0].numel() * 4, 0.0, [r.sum for r in regions], "plain read of K"))
    sdpa = [lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, scale=scale, enable_gqa=True) for k, v in layers]
    timed.append(("BNSD", "sdpa", kv_bytes, 1.0, sdpa, ""))
    rows = []
    order = random.Random(seed)
    probe_t = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
    for n in threads:
        torch.set_num_threads(n)
        here = calls = None  # the previous thread count's copy of vLLM's caches, freed first
        here = list(timed)
        calls, note = _vllm_calls(layers, q, lens, scale)  # vLLM's metadata records the thread count
        if calls is None:
            rows.append(Row(name, "vllm128", "vllm-kernel", n, L, note=note))
        else:
            here.append(("vllm128", "vllm-kernel", kv_bytes, 1.0, calls, note))
        here.append(("-", "read probe", PROBE_BYTES, 1.0, [probe_t.sum], "float32 sum"))  # last
        for item in here:
            item[4][0]()  # warm-up call (code, allocations)
        times: dict = {i: [] for i in range(len(here))}
        for _ in range(rounds):
            for i in order.sample(range(len(here)), len(here)):
                times[i].append(_time_rotation(here[i][4]))
        probe = PROBE_BYTES / (statistics.median(times[len(here) - 1]) * 1e-3) / 1e9
        for i, (layout, variant, read, frac, _calls, note) in enumerate(here):
            r = _row(name, layout, variant, n, 1 if variant == "read probe" else L, times[i], read, probe, frac)
            r.note = note
            rows.append(r)
    return rows


def _row(shape, layout, variant, threads, layers, times, read_bytes, probe, frac) -> Row:
    ms = statistics.median(times)
    gbps = read_bytes / (ms * 1e-3) / 1e9
    return Row(shape, layout, variant, threads, layers, ms, read_bytes / 1e9, gbps, 100.0 * gbps / probe, frac,
               probe, times_ms=[round(t, 4) for t in times])


def format_rows(rows: list[Row]) -> str:
    lines = ["| shape | layout | variant | threads | ms/layer | GB/s | % of probe | V rows read |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if math.isnan(r.ms_per_layer):
            lines.append(f"| {r.shape} | {r.layout} | {r.variant} | {r.threads} | - | - | - | {r.note} |")
            continue
        lines.append(f"| {r.shape} | {r.layout} | {r.variant} | {r.threads} | {r.ms_per_layer:.2f} | {r.gbps:.1f} | "
                     f"{r.pct_probe:.0f}% | {r.v_rows_frac:.3f} |")
    probes = {r.threads: r.gbps for r in rows if r.variant == "read probe"}
    lines.append("read probe (1 GiB float32 sum, median of the same rounds): " +
                 ", ".join(f"{n} thread(s) {g:.1f} GB/s" for n, g in probes.items()))
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description="Cold-cache CPU decode benchmark over KV layouts (docs/cpu.md)")
    ap.add_argument("--shapes", default="smollm2,llama8b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds; each times every variant's rotation over the layers once, in random order (median)")
    ap.add_argument("--placement", default="post_softmax", choices=("post_softmax", "pre_softmax"),
                    help="placement of the cpu kernel's variants (default: post_softmax, the recommended one)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: unknown shape {s!r}; known: {', '.join(SHAPES)}")
    layouts = [x for x in args.layouts.split(",") if x]
    for x in layouts:
        if x not in LAYOUTS:
            ap.error(f"--layouts: unknown layout {x!r}; known: {', '.join(LAYOUTS)}")
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads must be a comma list of ints >= 1, got {args.threads!r}")
    if not threads or min(threads) < 1:
        ap.error(f"--threads must be a comma list of ints >= 1, got {args.threads!r}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    mach = machine()
    print(f"machine: {mach.model}; flags {' '.join(mach.flags)}; {mach.cores} cores; LLC {mach.llc_bytes >> 20} MiB; "
          f"placement {args.placement}", flush=True)
    rows = []
    for s in shapes:
        rows += run_shape(s, threads, mach, args.rounds, layouts, placement=args.placement)
        gc.collect()  # the shape's caches, before the next shape allocates its own
        print(format_rows([r for r in rows if r.shape == s]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": asdict(mach), "placement": args.placement, "rows": [asdict(r) for r in rows]}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
