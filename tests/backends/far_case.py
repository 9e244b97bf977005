"""Inputs for the tests of a head whose kept rows all lie far below its own maximum (group
selection, pre_softmax; docs/semantics.md, "The formulas", step 5), shared by the backends'
tests: the case, the SDC variants to run it with, and the keyword arguments of one call."""

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
       ("offline", {"sdc_table": torch.full((HKV * G, 1), 0.3)})]


def far_kwargs(q, k, v, lens, th, sdc, extra, vmc, paged):
    kw = dict(query=q, key_cache=k, value_cache=v, seq_lens=lens, thresholds=th, scale=1.0,
              placement="pre_softmax", selection="group", sdc=sdc, vmc=vmc, **extra)
    if paged:
        kc, vc, table = to_paged(k, v, lens, 32, kv_layout="NHD", generator=torch.Generator().manual_seed(1))
        kw.update(key_cache=kc, value_cache=vc, block_table=table, kv_layout="NHD")
    return kw
