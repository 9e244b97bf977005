"""Inputs for the tests of a head whose kept rows all lie far below its own maximum (group
selection, pre_softmax; docs/semantics.md, "A head's kept rows far below its own maximum"),
shared by the backends' tests: the cases, the SDC variants to run them with, and the keyword
arguments of one call."""

import torch

from topth_ops.paged import to_paged

B, HKV, G, D, S = 2, 2, 3, 32, 300
THETA = 150.0


def far_case(gap: float, dtype: torch.dtype, seed: int = 0):
    """Head 0 of each group scores 200 on about 20 rows (the kept rows: group maximum > 150);
    heads 1 and 2 score about `gap` on a few rows that the group drops (their own maxima),
    and within a few units of 0 on the kept rows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, HKV * G, D)
    for g in range(HKV):
        for h in range(G):
            q[:, g * G + h, h] = 1.0
    k = 0.5 * torch.randn(B, HKV, S, D, generator=gen)
    k[..., :G] = 0.0
    hot = torch.randperm(S, generator=gen)[:20]
    far = torch.randperm(S, generator=gen)[:4]
    far = far[~torch.isin(far, hot)]
    k[:, :, hot, 0] = 200.0
    k[:, :, hot, 1:G] = torch.randn(B, HKV, len(hot), G - 1, generator=gen)
    k[:, :, far, 1] = gap
    k[:, :, far, 2] = gap + 1.0
    v = torch.randn(B, HKV, S, D, generator=gen)
    lens = torch.tensor([S, S - 17])
    th = torch.full((HKV, 1), THETA)
    return q.to(dtype), k.to(dtype), v.to(dtype), lens, th


SDC = [("none", {}), ("exp_threshold", {"sdc_gamma": 0.0}), ("exp_threshold", {"sdc_gamma": 0.5}),
       ("exact", {}), ("offline", {"sdc_table": torch.zeros(HKV * G, 1)}),
       ("offline", {"sdc_table": torch.full((HKV * G, 1), 0.3)}),
       # near the smallest normal float32: rescaled by exp(m - m_K) it is a few hundred (gap 95)
       ("offline", {"sdc_table": torch.full((HKV * G, 1), 1.2e-38)})]


def split_case(dtype: torch.dtype):
    """Two query heads on one KV head, 64 positions seen as two halves (splits of 32): head 1's
    maximum (100, position 0) is dropped by the group; in the first half it keeps only a row
    200 below it (position 1), in the second half a row 1 below it (position 32). Exact SDC
    then weighs position 32 by e^-1 / (e^-1 + 1 + ...): a split's dropped sum must stay
    finite relative to its own maximum even where its kept rows lie 200 below it."""
    gen = torch.Generator().manual_seed(3)
    d = 16
    q = torch.zeros(1, 2, d)
    q[0, 0, 0] = 1.0
    q[0, 1, 1] = 1.0
    k = torch.zeros(1, 1, 64, d)
    k[0, 0, 0, 1] = 100.0
    k[0, 0, 1, 0], k[0, 0, 1, 1] = 200.0, -100.0
    k[0, 0, 32, 0], k[0, 0, 32, 1] = 200.0, 99.0
    v = torch.randn(1, 1, 64, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor([64]), torch.full((1, 1), THETA)


SPLIT_SDC = [("none", {}), ("exact", {}), ("exp_threshold", {"sdc_gamma": 0.5}),
             ("offline", {"sdc_table": torch.full((2, 1), 0.3)})]


def far_kwargs(q, k, v, lens, th, sdc, extra, vmc, paged):
    kw = dict(query=q, key_cache=k, value_cache=v, seq_lens=lens, thresholds=th, scale=1.0,
              placement="pre_softmax", selection="group", sdc=sdc, vmc=vmc, **extra)
    if paged:
        kc, vc, table = to_paged(k, v, lens, 32, kv_layout="NHD", generator=torch.Generator().manual_seed(1))
        kw.update(key_cache=kc, value_cache=vc, block_table=table, kv_layout="NHD")
    return kw
