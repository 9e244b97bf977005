"""Synthetic decode inputs that hit a requested kept fraction by construction.

Per (sequence, KV head) a unit direction u is drawn; the group's query heads point along
u (plus a small per-head deviation) and exactly ``round(f * n)`` random positions get
``c * u`` added to their key ("planted" rows). The planted scores sit far above the rest,
so a threshold taken at the (1 - f) quantile of each head's scores (pooled over the
sequences that share its row id) falls in a wide gap: every head keeps the planted rows
and nothing else, the union over the group is the same set, and the selection is
unambiguous in every dtype (so the output check against the reference is meaningful).
The achieved fractions are measured from the reference's statistics, not assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from topth_ops.contract import DecodeInputs, make_inputs

from .cases import Case

PLANT_GAIN = 20.0  # c: planted keys get c * u added


@dataclass(frozen=True)
class CaseInputs:
    """Inputs of one case on one device.

    Attributes
    ----------
    case : Case
    inputs : DecodeInputs
        Thresholded call (``return_stats=True``) with the case's placement.
    dense : DecodeInputs
        Same tensors, thresholds -inf, pre_softmax, no SDC: plain attention.
    """

    case: Case
    inputs: DecodeInputs
    dense: DecodeInputs


def _lengths(case: Case, gen: torch.Generator) -> list[int]:
    if not case.ragged:
        return [case.seq_len] * case.batch
    lo = max(1, case.seq_len // 2)
    # distinct lengths (each has its own threshold column), the longest is seq_len
    step = max(1, (case.seq_len - lo) // max(1, case.batch))
    lens = [case.seq_len - i * step for i in range(case.batch)]
    return [max(1, x) for x in lens]


def make_case_inputs(case: Case, device: torch.device, seed: int = 0) -> CaseInputs:
    """Build the tensors and thresholds of ``case`` on ``device``.

    Parameters
    ----------
    case : Case
    device : torch.device
    seed : int

    Returns
    -------
    CaseInputs
    """
    B, S, Hq, Hkv, D = case.batch, case.seq_len, case.num_q_heads, case.num_kv_heads, case.head_dim
    G = Hq // Hkv
    dt = case.torch_dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    lens = _lengths(case, cpu_gen)

    u = torch.randn(B, Hkv, D, device=device, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    dev_q = torch.randn(B, Hq, D, device=device, generator=gen)
    dev_q = dev_q / dev_q.norm(dim=-1, keepdim=True)
    q = 4.0 * (u.repeat_interleave(G, dim=1) + 0.2 * dev_q)

    key = torch.randn(B, Hkv, S, D, device=device, generator=gen)
    for b, n in enumerate(lens):
        count = min(n, round(case.kept_frac * n))
        if 0 < count < n:
            idx = torch.rand(Hkv, n, device=device, generator=gen).topk(count, dim=-1).indices
            plant = torch.zeros(Hkv, S, dtype=torch.bool, device=device)
            plant.scatter_(1, idx, True)
            key[b] += PLANT_GAIN * plant.unsqueeze(-1) * u[b].unsqueeze(1)
    value = torch.randn(B, Hkv, S, D, device=device, generator=gen)
    q, key, value = q.to(dt), key.to(dt), value.to(dt)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(D)
    th = _thresholds(case, q, key, lens, scale)
    inputs = make_inputs(q, key, value, lens_t, th, scale=scale, placement=case.placement,
                         return_stats=True)
    dense_th = torch.full((Hq, 1), float("-inf"), dtype=torch.float32, device=device)
    dense = make_inputs(q, key, value, lens_t, dense_th, scale=scale, placement="pre_softmax")
    return CaseInputs(case, inputs, dense)


def _thresholds(case: Case, q, key, lens, scale) -> torch.Tensor:
    """[Hq, S] float32: per head and row id, the midpoint between the k-th and (k+1)-th
    largest score (pre_softmax) or log-probability (post_softmax, returned as a
    probability) pooled over the sequences of that length, k = their planted rows."""
    Hq, Hkv = q.shape[1], key.shape[1]
    G = Hq // Hkv
    dev = q.device
    pre = case.placement == "pre_softmax"
    unused = float("inf") if pre else 2.0
    th = torch.full((Hq, case.seq_len), unused, dtype=torch.float32, device=dev)
    if case.kept_frac >= 1.0:
        th.fill_(float("-inf") if pre else 0.0)
        return th
    by_len: dict[int, list[int]] = {}
    for b, n in enumerate(lens):
        by_len.setdefault(n, []).append(b)
    for n, bs in by_len.items():
        count = min(n, round(case.kept_frac * n))
        vals = []
        for b in bs:
            k32 = key[b, :, :n].float().repeat_interleave(G, dim=0)  # [Hq, n, D]
            a = scale * torch.einsum("hnd,hd->hn", k32, q[b].float())
            vals.append(a if pre else torch.log_softmax(a, dim=-1))
        v = torch.cat(vals, dim=1)  # [Hq, len(bs) * n]
        k_tot = count * len(bs)
        if k_tot == 0:
            t = v.amax(dim=1) + 1.0
        elif k_tot >= v.shape[1]:
            t = v.amin(dim=1) - 1.0
        else:
            top = v.topk(k_tot + 1, dim=1).values
            t = 0.5 * (top[:, k_tot - 1] + top[:, k_tot])
        th[:, n - 1] = t if pre else t.exp()
    return th
