"""The Ascend split (topth_ops.vllm.ascend_backend) on the CPU, against a stand-in of
vLLM-Ascend's attention module (vLLM-Ascend needs CANN and an NPU). The stand-in keeps the
structure of vLLM-Ascend's ``AscendAttentionBackendImpl``: ``forward`` writes the new K/V
into a ``(key_cache, value_cache)`` pair of NHD caches (``reshape_and_cache``), then calls
``forward_impl``, here a float64 paged reference over its host-side metadata. Decode rows
are compared with the float64 oracle on the rows each sequence wrote."""

import enum
import math
import sys
import types

import numpy as np
import pytest
import torch

from topth_ops.conformance.oracle import oracle_decode
from topth_ops.vllm.runtime import Runtime
from topth_ops.vllm.settings import VllmTopthSettings
from topth_ops.vllm.stats import ServingStats

from .slots import PagedBatches

pytestmark = pytest.mark.vllm
SP = pytest.importorskip("topth_ops.vllm.split")
from topth_ops.vllm import ascend_backend as AB  # noqa: E402
from topth_ops.vllm import platforms  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402

LAYER = 1


class AscendAttentionState(enum.Enum):
    PrefillNoCache = 0
    PrefillCacheHit = 1
    DecodeOnly = 2
    ChunkedPrefill = 3


class AscendAttentionBackendImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks=None, **kwargs):
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, float(scale), num_kv_heads
        self.sliding_window, self.alibi_slopes, self.attn_type, self.sinks = sliding_window, alibi_slopes, attn_type, sinks
        self.kv_cache_dtype = kv_cache_dtype
        self.platform_tokens = 0

    def reshape_and_cache(self, query, key, value, kv_cache, md, output):
        kc, vc = kv_cache
        bs = kc.shape[1]
        for t, s in enumerate(md.slot_mapping[:md.num_actual_tokens].tolist()):
            kc[s // bs, s % bs], vc[s // bs, s % bs] = key[t], value[t]
        return query, key, value, output

    def forward_impl(self, query, key, value, kv_cache, md, output):
        kc, vc = kv_cache
        bs, G = kc.shape[1], self.num_heads // self.num_kv_heads
        out = output.view(-1, self.num_heads, self.head_size)
        ends = md.actual_seq_lengths_q
        for i, n in enumerate(md.seq_lens_list):
            lo, hi = (ends[i - 1] if i else 0), ends[i]
            pos = torch.arange(n)
            blk = md.block_tables[i].long()[pos // bs]
            k, v = kc[blk, pos % bs].double(), vc[blk, pos % bs].double()
            for t in range(lo, hi):
                m = n - (hi - t) + 1
                for h in range(self.num_heads):
                    a = k[:m, h // G] @ query[t, h].double() * self.scale
                    out[t, h] = (torch.softmax(a, 0) @ v[:m, h // G]).to(out.dtype)
            self.platform_tokens += hi - lo
        return output

    def forward(self, layer, query, key, value, kv_cache, md, output=None, output_scale=None, output_block_scale=None):
        if md is None:
            return output.fill_(0)
        query, key, value, output = self.reshape_and_cache(query, key, value, kv_cache, md, output)
        return self.forward_impl(query, key, value, kv_cache, md, output)


class AscendAttentionMetadataBuilder:
    _cudagraph_support = AttentionCGSupport.ALWAYS  # as vLLM-Ascend declares (full ACL graphs)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        return cls._cudagraph_support


class AscendAttentionBackend:
    @staticmethod
    def get_builder_cls():
        return AscendAttentionMetadataBuilder

    @staticmethod
    def get_name():
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return AscendAttentionBackendImpl


@pytest.fixture
def ascend(monkeypatch):
    mod = types.ModuleType(AB.BACKEND_PATH)
    mod.AscendAttentionBackend, mod.AscendAttentionBackendImpl = AscendAttentionBackend, AscendAttentionBackendImpl
    mod.AscendAttentionState = AscendAttentionState
    monkeypatch.setitem(sys.modules, AB.BACKEND_PATH, mod)
    monkeypatch.setattr(AB, "_CLASS", None)
    from topth_ops.vllm import dispatch

    return dispatch.ASCEND_ATTN  # the class path the wrapped platform returns


class Engine(PagedBatches):
    def __init__(self, impl, Hq, Hkv, D, nb=16, bs=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.impl = impl
        self.kv_cache = tuple(torch.randn(nb, bs, Hkv, D, generator=g) * 50 for _ in range(2))  # stale garbage
        PagedBatches.__init__(self, torch.randperm(nb, generator=g).tolist(), bs, g, Hq, Hkv, D)
        self.layer = types.SimpleNamespace(layer_name=f"model.layers.{LAYER}.self_attn.attn")

    def step(self, plan, state):
        q, k, v, sm, qsl = self.tokens(plan)
        ends, N = qsl[1:], qsl[-1]
        cm = self.common_metadata(plan, qsl, sm)
        nd = sum(1 for _, T in plan if T == 1)
        md = types.SimpleNamespace(  # vLLM-Ascend's fields: seq_lens on the host, q offsets as a list of ends
            attn_state=state, num_decodes=nd, num_decode_tokens=nd, num_actual_tokens=N, seq_lens=cm.seq_lens,
            seq_lens_list=cm.seq_lens.tolist(), actual_seq_lengths_q=ends, block_tables=cm.block_table_tensor,
            slot_mapping=sm)
        out = torch.full((N, self.Hq * self.D), float("nan"))
        self.impl.forward(self.layer, q, k, v, self.kv_cache, md, out)
        return q, out.view(N, self.Hq, self.D), cm.seq_lens


def _impl(monkeypatch, cls, ts, settings, Hq, Hkv, D):
    stats = ServingStats(settings.mode, None, 0.0)
    monkeypatch.setattr(SP, "runtime", lambda: Runtime(settings, ts, 0, 1, stats, "tiny"))
    return cls.get_impl_cls()(Hq, D, 1 / math.sqrt(D), Hkv, None, None, "auto"), stats


@pytest.mark.parametrize("vmc", [False, True])
def test_decode_only_steps_use_the_op_and_others_the_platform(monkeypatch, ascend, vmc, make_cfg,
                                                             make_threshold_set):
    Hq, Hkv, D = 4, 2, 32
    ts = make_threshold_set(make_cfg(layers=3, heads=Hq, kv_heads=Hkv, head_dim=D), rows=128, k=4, seed=3)
    impl, stats = _impl(monkeypatch, ascend, ts, VllmTopthSettings(metrics_every=1, mode="topth", thresholds="unused", vmc=vmc),
                        Hq, Hkv, D)
    eng = Engine(impl, Hq, Hkv, D)
    eng.step([("A", 40), ("B", 9)], AscendAttentionState.PrefillNoCache)
    q, out, lens = eng.step([("A", 1), ("B", 1), ("C", 12)], AscendAttentionState.ChunkedPrefill)
    assert impl.platform_tokens == 49 + 14  # a mixed step: the platform serves every row, decodes included
    for b, seq in enumerate(["A", "B"]):  # dense: the oracle with every threshold at -inf
        kk, vv = eng.rows[seq]
        want = oracle_decode(q[b:b + 1], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], lens[b:b + 1],
                             torch.full((Hq, 128), float("-inf")), scale=1 / math.sqrt(D), placement="post_softmax")
        np.testing.assert_allclose(out[b:b + 1].double().numpy(), want.out, rtol=2e-5, atol=2e-5)
    q, out, lens = eng.step([("A", 1), ("B", 1)], AscendAttentionState.DecodeOnly)
    assert impl.platform_tokens == 49 + 14 and impl.rule.thresholded
    for b, seq in enumerate(["A", "B"]):
        kk, vv = eng.rows[seq]
        want = oracle_decode(q[b:b + 1], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], lens[b:b + 1],
                             ts.thresholds[LAYER], scale=1 / math.sqrt(D), placement="post_softmax", vmc=vmc)
        np.testing.assert_allclose(out[b:b + 1].double().numpy(), want.out, rtol=2e-5, atol=2e-5)
        assert int(want.v_rows.sum()) < Hkv * int(lens[b])
    rep = stats.report()["last_steps"][-1]
    assert rep["v_rows_read"] < rep["v_rows_dense"] == Hkv * int(lens.sum())


def test_platform_wrap_returns_the_split_only_when_active(monkeypatch):
    from topth_ops.vllm import settings

    class Platform:
        picked = platforms.ASCEND_PLATFORM

        @classmethod
        def get_attn_backend_cls(cls, *args, **kwargs):
            return cls.picked

    platforms._wrap_ascend(Platform)
    platforms._wrap_ascend(Platform)  # idempotent
    monkeypatch.setattr(settings, "is_active", lambda **kw: False)
    assert Platform.get_attn_backend_cls(None, None) == platforms.ASCEND_PLATFORM
    monkeypatch.setattr(settings, "is_active", lambda **kw: True)
    assert Platform.get_attn_backend_cls(None, None) == platforms.ASCEND_BACKEND == "topth_ops.vllm.dispatch.ASCEND_ATTN"
    Platform.picked = "vllm_ascend.attention.mla_v1.AscendMLABackend"
    with pytest.raises(NotImplementedError, match="AscendMLABackend"):
        Platform.get_attn_backend_cls(None, None)


def test_context_parallel_impl_is_refused(monkeypatch, ascend):
    class Other(AscendAttentionBackendImpl):
        pass

    monkeypatch.setattr(AscendAttentionBackend, "get_impl_cls", staticmethod(lambda: Other))
    monkeypatch.setattr(AB, "_CLASS", None)
    with pytest.raises(NotImplementedError, match="Other"):
        AB.split_backend()


def test_builder_declares_no_full_graph(ascend):
    """vLLM-Ascend's builder declares full (ACL) graphs; the split's decode rows read host-side
    threshold sets and statistics per step, so its builder must refuse them."""
    B = ascend.get_builder_cls()
    assert issubclass(B, AscendAttentionMetadataBuilder) and B is not AscendAttentionMetadataBuilder
    assert B.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER
