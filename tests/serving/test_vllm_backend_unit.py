"""TopthAttentionImpl on a hand-built mixed batch (decodes + a fresh prompt + a chunked
prefill), with tensor-parallel slicing, against the float64 oracle. No engine is
started: the per-process runtime is replaced by one built here."""

import math
import types

import numpy as np
import pytest
import torch

from topth_ops.conformance.oracle import oracle_decode
from topth_ops.vllm import backend as B
from topth_ops.vllm.runtime import Runtime
from topth_ops.vllm.paged_ops import gather_sequence
from topth_ops.vllm.settings import VllmTopthSettings
from topth_ops.vllm.stats import ServingStats

from .slots import PagedSlots

pytestmark = pytest.mark.vllm


LAYER = 2


class Engine(PagedSlots):
    """Allocates blocks and slot mappings for sequences the way vLLM does."""

    def __init__(self, impl, nb=24, bs=8, H=2, D=16, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.impl, self.bs, self.H, self.D = impl, bs, H, D
        phys = torch.randn(nb, bs, H, 2 * D, generator=self.g) * 50  # stale garbage
        self.kv_cache = phys.permute(0, 2, 1, 3)  # vLLM's logical view of an LBNHC cache
        PagedSlots.__init__(self, torch.randperm(nb, generator=self.g).tolist(), bs)
        self.layer = types.SimpleNamespace(layer_name=f"model.layers.{LAYER}.self_attn.attn")

    def kv(self, T):
        return (torch.randn(T, self.H, self.D, generator=self.g), torch.randn(T, self.H, self.D, generator=self.g))

    def step(self, plan, Hq):
        """plan: list of (seq, new tokens), decodes first. Writes K/V, runs forward."""
        slots, qsl = [], [0]
        for seq, T in plan:
            slots += self.slots(seq, T)
            qsl.append(qsl[-1] + T)
        N = qsl[-1]
        k, v = self.kv(N)
        q = torch.randn(N, Hq, self.D, generator=self.g)
        self.impl.do_kv_cache_update(self.layer, k, v, self.kv_cache, torch.tensor(slots))
        width = max(len(self.table[s]) for s, _ in plan) + 2
        bt = torch.tensor([self.table[s] + [-1] * (width - len(self.table[s])) for s, _ in plan], dtype=torch.int32)
        lens = torch.tensor([self.lens[s] for s, _ in plan], dtype=torch.int32)
        nd = sum(1 for _, T in plan if T == 1)
        md = B.TopthAttentionMetadata(
            num_actual_tokens=N, max_seq_len=int(lens.max()), num_decodes=nd, num_decode_tokens=nd,
            num_prefills=len(plan) - nd, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32), seq_lens=lens, seq_lens_cpu=lens,
            block_table=bt, slot_mapping=torch.tensor(slots))
        out = torch.full((N, Hq * self.D), float("nan"))
        self.impl.forward(self.layer, q, k, v, self.kv_cache, md, out)
        return q, out.view(N, Hq, self.D), bt, lens, qsl


def _impl(monkeypatch, ts, settings, tp_rank, tp_size, Hq, Hkv, D):
    stats = ServingStats(settings.mode, None, 0.0)
    rt = Runtime(settings, ts, tp_rank, tp_size, stats, "tiny")
    monkeypatch.setattr(B, "runtime", lambda: rt)
    return B.TopthAttentionImpl(Hq // tp_size, D, 1 / math.sqrt(D), Hkv // tp_size, kv_cache_dtype="auto"), stats


@pytest.mark.parametrize("tp_rank,tp_size,vmc,dense_layer", [(0, 1, True, False), (1, 2, True, False),
                                                             (0, 1, False, False), (0, 1, True, True)])
def test_mixed_batch_matches_oracle(monkeypatch, tp_rank, tp_size, vmc, dense_layer, make_cfg, make_threshold_set,
                                    causal_reference):
    Hq, Hkv, D = 8, 4, 16
    cfg = make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D)
    ts = make_threshold_set(cfg, rows=64, k=4, seed=1)
    if dense_layer:
        ts.layer_k[LAYER] = 0
        ts.thresholds[LAYER] = float("-inf")
    settings = VllmTopthSettings(metrics_every=1, mode="topth", thresholds="unused", vmc=vmc)
    impl, stats = _impl(monkeypatch, ts, settings, tp_rank, tp_size, Hq, Hkv, D)
    Hl, Hkl = Hq // tp_size, Hkv // tp_size
    eng = Engine(impl, H=Hkl, D=D)
    eng.step([("A", 30), ("B", 12)], Hl)                 # two prompts
    eng.step([("A", 1), ("B", 1), ("C", 16)], Hl)        # decodes + C's first chunk
    q, out, bt, lens, qsl = eng.step([("A", 1), ("B", 1), ("D", 9), ("C", 5)], Hl)  # + chunk 2 of C
    assert not torch.isnan(out).any()
    # decodes: the float64 oracle on the same paged cache, with this rank's threshold rows
    k_cache, v_cache = eng.kv_cache.transpose(1, 2)[..., :D], eng.kv_cache.transpose(1, 2)[..., D:]
    th = ts.thresholds[LAYER, tp_rank * Hl:(tp_rank + 1) * Hl]
    want = oracle_decode(q[:2], k_cache, v_cache, lens[:2], th, scale=1 / math.sqrt(D), placement="post_softmax",
                         vmc=vmc and not dense_layer, block_table=bt[:2], kv_layout="NHD")
    np.testing.assert_allclose(out[:2].double().numpy(), want.out, rtol=2e-5, atol=2e-5)
    assert want.margin.min() > 1e-6  # no threshold comparison close enough to flip in float32
    # prefills (D fresh, C chunk after 16 cached positions): dense causal attention
    for i, (lo, hi) in enumerate([(qsl[2], qsl[3]), (qsl[3], qsl[4])]):
        n = int(lens[2 + i])
        kk = gather_sequence(k_cache, bt[2 + i], n).double().numpy()
        vv = gather_sequence(v_cache, bt[2 + i], n).double().numpy()
        ref = causal_reference(q[lo:hi].double().numpy(), kk, vv, n - (hi - lo), 1 / math.sqrt(D))
        np.testing.assert_allclose(out[lo:hi].double().numpy(), ref, rtol=2e-5, atol=2e-5)
    # statistics: the rows the oracle keeps, vs seq_len per sequence and KV head
    rep = stats.report()
    last = rep["last_steps"][-1]
    assert last["v_rows_read"] == int(want.v_rows.sum())
    assert last["v_rows_dense"] == int(lens[:2].sum()) * Hkl
    if dense_layer:
        assert last["v_rows_read"] == last["v_rows_dense"]
    else:
        assert last["v_rows_read"] < last["v_rows_dense"]
    assert rep["decode_steps"] == 2
    assert rep["prefill_tokens_dense"] == 30 + 12 + 16 + 14


def test_dense_mode_keeps_every_row(monkeypatch, causal_reference):
    Hq, Hkv, D = 4, 2, 16
    settings = VllmTopthSettings(metrics_every=1, mode="dense")
    impl, stats = _impl(monkeypatch, None, settings, 0, 1, Hq, Hkv, D)
    eng = Engine(impl, H=Hkv, D=D)
    eng.step([("A", 20)], Hq)
    q, out, bt, lens, _ = eng.step([("A", 1)], Hq)
    k_cache, v_cache = eng.kv_cache.transpose(1, 2)[..., :D], eng.kv_cache.transpose(1, 2)[..., D:]
    kk = gather_sequence(k_cache, bt[0], 21).double().numpy()
    vv = gather_sequence(v_cache, bt[0], 21).double().numpy()
    ref = causal_reference(q.double().numpy(), kk, vv, 20, 1 / math.sqrt(D))
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=2e-5, atol=2e-5)
    last = stats.report()["last_steps"][-1]
    assert last["v_rows_read"] == last["v_rows_dense"] == 21 * Hkv


def test_unsupported_features_fail_at_construction(monkeypatch):
    _impl(monkeypatch, None, VllmTopthSettings(metrics_every=1, mode="dense"), 0, 1, 4, 2, 16)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        B.TopthAttentionImpl(4, 16, 0.25, 2, sliding_window=128)
    with pytest.raises(NotImplementedError, match="KV cache dtype fp8"):
        B.TopthAttentionImpl(4, 16, 0.25, 2, kv_cache_dtype="fp8")


def _group_set(make_threshold_set, cfg, seed=3):
    """A group-selection file: one threshold per (layer, KV head, row id)."""
    from dataclasses import replace

    ts = make_threshold_set(cfg, rows=64, k=4, seed=seed)
    Hkv = cfg.num_key_value_heads
    return replace(ts, thresholds=ts.thresholds[:, :Hkv].contiguous(), counts=ts.counts[:, :Hkv].contiguous(),
                   selection="group")


@pytest.mark.parametrize("tp_rank,tp_size,Hkv", [(0, 1, 4), (1, 2, 4), (0, 2, 4), (3, 4, 2)])
def test_group_selection_file_matches_oracle(monkeypatch, tp_rank, tp_size, Hkv, make_cfg, make_threshold_set):
    """A `--selection group` file: each rank uses its own KV heads' thresholds, compared with
    the group maximum (expected values from the float64 oracle with selection="group").
    tp_size 4 with 2 KV heads: vLLM replicates each KV head on two ranks."""
    Hq, D = 8, 16
    cfg = make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D)
    ts = _group_set(make_threshold_set, cfg)
    settings = VllmTopthSettings(metrics_every=1, mode="topth", thresholds="unused", vmc=True)
    Hl, Hkl = Hq // tp_size, max(1, Hkv // tp_size)
    stats = ServingStats(settings.mode, None, 0.0)
    monkeypatch.setattr(B, "runtime", lambda: Runtime(settings, ts, tp_rank, tp_size, stats, "tiny"))
    impl = B.TopthAttentionImpl(Hl, D, 1 / math.sqrt(D), Hkl, kv_cache_dtype="auto")
    eng = Engine(impl, H=Hkl, D=D)
    eng.step([("A", 30), ("B", 12)], Hl)
    q, out, bt, lens, _ = eng.step([("A", 1), ("B", 1)], Hl)
    k_cache, v_cache = eng.kv_cache.transpose(1, 2)[..., :D], eng.kv_cache.transpose(1, 2)[..., D:]
    kv_lo = tp_rank * Hkv // tp_size  # the KV heads this rank holds (vLLM's split / replication)
    th = ts.thresholds[LAYER, kv_lo:kv_lo + Hkl]
    want = oracle_decode(q, k_cache, v_cache, lens, th, scale=1 / math.sqrt(D), placement="post_softmax",
                         vmc=True, block_table=bt, kv_layout="NHD", selection="group")
    assert want.margin.min() > 1e-6
    assert 0 < int(want.v_rows.sum()) < int(lens.sum()) * Hkl  # some rows dropped, some kept
    np.testing.assert_allclose(out.double().numpy(), want.out, rtol=2e-5, atol=2e-5)
    assert stats.report()["last_steps"][-1]["v_rows_read"] == int(want.v_rows.sum())
