"""Shapes and inputs of the CPU decode benchmark (``topth-ops bench --device cpu``).

One cache per shape serves every kept fraction f, so that the kernel at each f, its dense
mode and the dense baselines are timed side by side on the same bytes. Per (sequence, KV
head) a unit direction u is drawn; the group's queries point along u (plus a small
per-head deviation, as in :mod:`topth_ops.bench.synth`) and every valid position gets a
*tier*: the top f_1 of positions tier 4, the next ones down to f_2 tier 3, and so on
(f = 0.05, 0.1, 0.3, 0.5); tier t adds ``t * TIER_GAIN * u`` to the key. Scores of one tier
sit far above those of the tier below for every head of the group, so the pre_softmax
threshold between tiers t and t - 1 keeps exactly the positions of tiers >= t, for every
head: the kept-union per KV group is known before any kernel runs. The gaps are verified
from the dtype-rounded inputs (:data:`MIN_GAP`), as the planted generator does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from topth_ops.contract import DecodeInputs, make_inputs

FRACTIONS = (0.05, 0.1, 0.3, 0.5)
"""Kept fractions timed per shape, plus the dense mode."""
TIER_GAIN = 20.0
MIN_GAP = 1.0
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True)
class CpuShape:
    """One benchmark shape: every sequence has ``seq_len`` valid positions."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    dtype: str

    @property
    def name(self) -> str:
        s = f"{self.seq_len // 1024}k" if self.seq_len % 1024 == 0 else str(self.seq_len)
        return f"b{self.batch}-h{self.num_q_heads}x{self.num_kv_heads}-d{self.head_dim}-s{s}-{self.dtype}"

    @property
    def cache_bytes(self) -> int:
        """Bytes of K plus V over the valid positions."""
        return 2 * self.batch * self.num_kv_heads * self.seq_len * self.head_dim * DTYPES[self.dtype].itemsize


def _grid(batches, heads, dims, lens, dtypes) -> list[CpuShape]:
    return [CpuShape(b, hq, hkv, d, s, dt) for dt in dtypes for s in lens for d in dims for hq, hkv in heads
            for b in batches]


CPU_SHAPE_SETS = {
    # B in {1, 8}, Hq32/Hkv8 and Hq9/Hkv3, d in {64, 128}, S in {2k, 8k, 32k}, bf16 and fp32
    "cpu": _grid((1, 8), ((32, 8), (9, 3)), (64, 128), (2048, 8192, 32768), ("bf16", "fp32")),
    # seconds: checks the runner (CI)
    "cpu-quick": _grid((1, 2), ((8, 2),), (64,), (640,), ("bf16", "fp32")),
}


@dataclass
class ShapeInputs:
    """Inputs of one shape.

    Attributes
    ----------
    sparse : dict
        f -> DecodeInputs (pre_softmax, thresholds between tiers, ``return_stats=True``).
    dense : DecodeInputs
        Thresholds -inf: the kernel's dense mode and the dense baselines' inputs.
    union : dict
        f -> ``[batch, num_kv_heads]`` int64, V rows each KV group keeps (known exactly).
    """

    shape: CpuShape
    sparse: dict
    dense: DecodeInputs
    union: dict


def _tier_counts(n: int) -> list[int]:
    """Positions per tier, tier 4 (top) first: round(f * n) nested."""
    tops = [min(n, round(f * n)) for f in FRACTIONS]
    return [tops[0]] + [tops[i] - tops[i - 1] for i in range(1, len(tops))]


def make_shape_inputs(shape: CpuShape, seed: int = 0) -> ShapeInputs:
    """Build the cache, queries and per-f thresholds of ``shape`` on the CPU.

    Raises
    ------
    ValueError
        Some tier's scores do not clear the tier below by :data:`MIN_GAP` for some head
        (the kept sets would not be known exactly); the message names the tier.
    """
    B, Hq, Hkv, D, S = shape.batch, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.seq_len
    G = Hq // Hkv
    dt = DTYPES[shape.dtype]
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(B, Hkv, D, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    dev = torch.randn(B, Hq, D, generator=gen)
    q = (4.0 * (u.repeat_interleave(G, dim=1) + 0.2 * dev / dev.norm(dim=-1, keepdim=True))).to(dt)
    tier = torch.zeros(B, Hkv, S, dtype=torch.int8)
    counts = _tier_counts(S)
    for b in range(B):
        order = torch.rand(Hkv, S, generator=gen).argsort(dim=-1)
        start = 0
        for t, c in zip(range(len(FRACTIONS), 0, -1), counts):
            tier[b].scatter_(1, order[:, start:start + c], t)
            start += c
    key = torch.empty(B, Hkv, S, D, dtype=dt)
    value = torch.empty(B, Hkv, S, D, dtype=dt)
    for b in range(B):  # one sequence at a time: float32 temporaries stay small
        kb = torch.randn(Hkv, S, D, generator=gen) + TIER_GAIN * tier[b].unsqueeze(-1).float() * u[b].unsqueeze(1)
        key[b] = kb.to(dt)
        value[b] = torch.randn(Hkv, S, D, generator=gen).to(dt)
    scale = 1.0 / math.sqrt(D)
    lens = torch.full((B,), S, dtype=torch.int32)
    # per head: lowest score of each tier and highest of the tier below, pooled over sequences
    low = torch.full((len(FRACTIONS) + 1, Hq), float("inf"))
    high = torch.full((len(FRACTIONS) + 1, Hq), float("-inf"))
    for b in range(B):
        for g in range(Hkv):
            heads = slice(g * G, (g + 1) * G)
            a = scale * (key[b, g].float() @ q[b, heads].float().T)  # [S, G]
            for t in range(len(FRACTIONS) + 1):
                m = tier[b, g] == t
                if m.any():
                    low[t, heads] = torch.minimum(low[t, heads], a[m].amin(0))
                    high[t, heads] = torch.maximum(high[t, heads], a[m].amax(0))
    sparse, union = {}, {}
    for i, f in enumerate(FRACTIONS):
        t = len(FRACTIONS) - i  # keep tiers >= t
        gap = low[t] - high[t - 1]
        if bool((gap < MIN_GAP).any()):
            h = int(gap.argmin())
            raise ValueError(f"shape {shape.name}: tier {t} (f={f}) clears the tier below by only {float(gap[h]):.3g} "
                             f"for query head {h} (need {MIN_GAP}); the kept set would not be known exactly")
        th = (0.5 * (low[t] + high[t - 1])).view(Hq, 1).contiguous()
        sparse[f] = make_inputs(q, key, value, lens, th, scale=scale, placement="pre_softmax", return_stats=True)
        union[f] = (tier >= t).sum(-1).to(torch.int64)
    dense = make_inputs(q, key, value, lens, torch.full((Hq, 1), float("-inf")), scale=scale,
                        placement="pre_softmax")
    return ShapeInputs(shape, sparse, dense, union)
