"""Synthetic decode inputs whose kept V rows are known exactly ("planted").

The one input generator of the benchmark (every case set, every device). Per (sequence,
KV head) a unit direction u is drawn; the group's query heads point along u (plus a small
per-head deviation) and exactly ``round(f * n)`` random valid positions (or runs of
``Case.cluster`` consecutive positions) get ``c * u`` added to their key (the planted rows). Their scores sit far above the others for every
head of the group. Per query head and sequence length, the threshold is the midpoint of
the gap between the lowest planted and the highest other score (log-probability for
post_softmax, returned as a probability), pooled over the sequences of that length (each
length has its own row id, hence its own threshold column).

The gap is **verified**, from the same dtype-rounded inputs a kernel sees: if some head's
planted and other scores are not separated by at least :data:`MIN_GAP`,
:func:`make_case_inputs` raises. So every head keeps exactly the planted rows, the union
over the group is the planted set, and the kept-union count per (sequence, KV head) is
known before any kernel runs (:attr:`CaseInputs.planted_union`; the harness checks the
reference's ``stats.v_rows`` against it). The selection is unambiguous in every dtype, so
output checks against the reference are meaningful.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from topth_ops.contract import DecodeInputs, make_inputs
from topth_ops.paged import to_paged

from .cases import Case

PLANT_GAIN = 20.0
"""c: planted keys get ``c * u`` added (|q| is about 4, so planted scores are about
80 / sqrt(head_dim) above the others, which spread with a standard deviation of about
4 / sqrt(head_dim))."""

MIN_GAP = 1.0
"""Smallest accepted gap between the planted and the other scores of a head, in units
of the scaled score (natural-log units): far above any rounding difference between the
float32 scores computed here and a kernel's."""


@dataclass(frozen=True)
class CaseInputs:
    """Inputs of one case on one device.

    Attributes
    ----------
    case : Case
    inputs : DecodeInputs
        Thresholded call (``return_stats=True``) with the case's placement.
    dense : DecodeInputs
        Same tensors, thresholds -inf, pre_softmax, no SDC: plain attention. Always BNSD
        (the dense baselines' layout), also for paged cases.
    planted_union : torch.Tensor
        ``[batch, num_kv_heads]`` int64 on the CPU: the number of V rows every head of the
        group keeps (the planted rows), i.e. the exact kept-union per KV group.
    """

    case: Case
    inputs: DecodeInputs
    dense: DecodeInputs
    planted_union: torch.Tensor


def planted_count(kept_frac: float, n: int) -> int:
    """Rows planted among ``n`` valid positions: ``round(kept_frac * n)`` within [0, n]."""
    return min(n, max(0, round(kept_frac * n)))


def _planted_positions(cluster: int, count: int, n: int, rows: int, device, gen) -> torch.Tensor:
    """``[rows, count]`` distinct positions in [0, n): uniformly random, or (``cluster`` > 0)
    whole runs of ``cluster`` consecutive positions at random multiples of ``cluster``, the
    last run cut so that exactly ``count`` positions are planted."""
    if cluster <= 1:
        return torch.rand(rows, n, device=device, generator=gen).topk(count, dim=-1).indices
    runs = -(-count // cluster)
    chunks = torch.rand(rows, n // cluster, device=device, generator=gen).topk(runs, dim=-1).indices
    pos = (chunks.unsqueeze(-1) * cluster + torch.arange(cluster, device=device)).flatten(1)
    return pos[:, :count]


def case_lengths(case: Case) -> list[int]:
    """Sequence lengths of ``case``: all ``seq_len``, or for ``ragged`` cases distinct
    lengths from ``seq_len`` down towards ``seq_len / 2`` (each >= 1)."""
    if not case.ragged:
        return [case.seq_len] * case.batch
    lo = max(1, case.seq_len // 2)
    step = max(1, (case.seq_len - lo) // max(1, case.batch))
    return [max(1, case.seq_len - i * step) for i in range(case.batch)]


def make_case_inputs(case: Case, device: torch.device, seed: int = 0) -> CaseInputs:
    """Build the tensors, thresholds and planted kept sets of ``case`` on ``device``.

    Random numbers are drawn on ``device`` when torch has a generator for it (cpu, cuda)
    and otherwise (e.g. npu) on the CPU, where the inputs are built and then copied.

    Parameters
    ----------
    case : Case
    device : torch.device
    seed : int

    Returns
    -------
    CaseInputs

    Raises
    ------
    ValueError
        The planted scores of some head do not clear the others by :data:`MIN_GAP`
        (the kept set would not be known exactly); the message names the head and length.
    """
    B, S, Hq, Hkv, D = case.batch, case.seq_len, case.num_q_heads, case.num_kv_heads, case.head_dim
    G = Hq // Hkv
    dt = case.torch_dtype
    build = device if device.type in ("cpu", "cuda") else torch.device("cpu")
    gen = torch.Generator(device=build).manual_seed(seed)
    lens = case_lengths(case)

    u = torch.randn(B, Hkv, D, device=build, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    dev_q = torch.randn(B, Hq, D, device=build, generator=gen)
    dev_q = dev_q / dev_q.norm(dim=-1, keepdim=True)
    q = 4.0 * (u.repeat_interleave(G, dim=1) + 0.2 * dev_q)

    key = torch.randn(B, Hkv, S, D, device=build, generator=gen)
    plant = torch.zeros(B, Hkv, S, dtype=torch.bool, device=build)
    for b, n in enumerate(lens):
        count = planted_count(case.kept_frac, n)
        if count > 0:
            idx = _planted_positions(case.cluster, count, n, Hkv, build, gen)
            plant[b].scatter_(1, idx, True)
            key[b] += PLANT_GAIN * plant[b].unsqueeze(-1) * u[b].unsqueeze(1)
    value = torch.randn(B, Hkv, S, D, device=build, generator=gen)
    q, key, value = q.to(dt), key.to(dt), value.to(dt)
    scale = 1.0 / math.sqrt(D)
    th = _thresholds(case, q, key, plant, lens, scale)
    planted_union = plant.sum(-1).to(torch.int64).cpu()

    q, key, value, th = (x.to(device) for x in (q, key, value, th))
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    paged = {}
    if case.block_size:
        kp, vp, table = to_paged(key, value, lens_t, case.block_size, kv_layout=case.kv_layout,
                                 generator=torch.Generator().manual_seed(seed))
        paged = dict(key_cache=kp, value_cache=vp, block_table=table, kv_layout=case.kv_layout)
    inputs = make_inputs(q, paged.pop("key_cache", key), paged.pop("value_cache", value), lens_t, th,
                         scale=scale, placement=case.placement, return_stats=True, **paged)
    dense_th = torch.full((Hq, 1), float("-inf"), dtype=torch.float32, device=device)
    dense = make_inputs(q, key, value, lens_t, dense_th, scale=scale, placement="pre_softmax")
    return CaseInputs(case, inputs, dense, planted_union)


def _thresholds(case: Case, q, key, plant, lens, scale) -> torch.Tensor:
    """``[Hq, seq_len]`` float32 thresholds: per head and row id n - 1, the midpoint of the
    gap between the planted and the other scores of the sequences of length n (pre_softmax:
    logits; post_softmax: log-probabilities, returned as probabilities). Columns of lengths
    no sequence has keep nothing. Scores are float32 products of the dtype-rounded inputs."""
    Hq, Hkv = q.shape[1], key.shape[1]
    G = Hq // Hkv
    pre = case.placement == "pre_softmax"
    th = torch.full((Hq, case.seq_len), float("inf") if pre else 2.0, dtype=torch.float32, device=q.device)
    by_len: dict[int, list[int]] = {}
    for b, n in enumerate(lens):
        by_len.setdefault(n, []).append(b)
    for n, bs in by_len.items():
        if planted_count(case.kept_frac, n) == n:  # keep everything
            th[:, n - 1] = float("-inf") if pre else 0.0
            continue
        lo = torch.full((Hq,), float("-inf"), device=q.device)  # highest other score
        hi = torch.full((Hq,), float("inf"), device=q.device)  # lowest planted score
        for b in bs:
            for g in range(Hkv):
                heads = slice(g * G, (g + 1) * G)
                a = scale * (key[b, g, :n].float() @ q[b, heads].float().T)  # [n, G]
                if not pre:
                    a = a - torch.logsumexp(a, dim=0)
                m = plant[b, g, :n].unsqueeze(1)
                lo[heads] = torch.maximum(lo[heads], a.masked_fill(m, float("-inf")).amax(0))
                hi[heads] = torch.minimum(hi[heads], a.masked_fill(~m, float("inf")).amin(0))
        bad = (hi - lo < MIN_GAP).nonzero().flatten().tolist()
        if bad:
            h = bad[0]
            raise ValueError(
                f"case {case.name!r}: the planted scores of query head {h} (sequence length {n}) do not clear "
                f"the others by {MIN_GAP}: lowest planted {float(hi[h]):.4g}, highest other {float(lo[h]):.4g}; "
                f"the kept set would not be known exactly (change the shape or kept_frac)")
        t = torch.where(torch.isinf(hi), lo + MIN_GAP, 0.5 * (lo + hi))  # no planted row: above the rest
        th[:, n - 1] = t if pre else t.exp()
    return th
