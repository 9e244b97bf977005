"""The CUDA split backends (topth_ops.vllm.gpu_backend) on the CPU: vLLM's FlashAttention
and Triton attention classes subclassed, the batch split between the op (decode rows of
thresholded layers, read in place from the platform's cache layout) and the platform's own
forward (everything else). The platform's CUDA kernels cannot run here: its forward and
cache write are replaced by a float64 paged reference that reads the metadata it is
given, so a wrong split (offsets, lengths, block table) gives wrong rows. Every row is
compared with a float64 oracle on the rows each sequence wrote."""

import math
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
pytest.importorskip("vllm.model_executor.layers.attention")
GB = pytest.importorskip("topth_ops.vllm.gpu_backend")
SP = pytest.importorskip("topth_ops.vllm.split")
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402

LAYER = 1
NAMES = sorted(GB.PLATFORM_BACKENDS)


def _reference_forward(self, layer, query, key, value, kv_cache, md, output, *args):
    """The platform's attention, as a float64 reference over the paged cache through ``md``."""
    kc, vc, _ = GB.hnd_views(kv_cache, self.head_size)
    G = self.num_heads // self.num_kv_heads
    qsl, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    out = output.view(-1, self.num_heads, self.head_size)
    bs = kc.shape[2]
    for i, n in enumerate(lens):
        lo, hi = qsl[i], qsl[i + 1]
        pos = torch.arange(n)
        blk = md.block_table[i].long()[pos // bs]
        k = kc[blk, :, pos % bs].double()  # [n, Hkv, D]
        v = vc[blk, :, pos % bs].double()
        for t in range(lo, hi):
            m = n - (hi - t) + 1  # causal: this token sees positions [0, m)
            for h in range(self.num_heads):
                a = k[:m, h // G] @ query[t, h].double() * self.scale
                out[t, h] = (torch.softmax(a, 0) @ v[:m, h // G]).to(out.dtype)
    layer.platform_tokens = getattr(layer, "platform_tokens", 0) + sum(b - a for a, b in zip(qsl[:-1], qsl[1:]))
    return output


def _reference_write(self, layer, key, value, kv_cache, slot_mapping):
    kc, vc, _ = GB.hnd_views(kv_cache, self.head_size)
    bs = kc.shape[2]
    for t, s in enumerate(slot_mapping.tolist()):
        kc[s // bs, :, s % bs] = key[t]
        vc[s // bs, :, s % bs] = value[t]


@pytest.fixture(params=NAMES)
def backend(request, monkeypatch):
    cls = GB.split_backend(request.param)
    base = cls.__mro__[1]
    monkeypatch.setattr(base.get_impl_cls(), "forward", _reference_forward)
    monkeypatch.setattr(base.get_impl_cls(), "do_kv_cache_update", _reference_write)
    return cls


def _impl(monkeypatch, backend, ts, settings, Hq, Hkv, D, sliding_window=None):
    stats = ServingStats(settings.mode, None, 0.0)
    rt = Runtime(settings, ts, 0, 1, stats, "tiny")
    monkeypatch.setattr(SP, "runtime", lambda: rt)
    return backend.get_impl_cls()(Hq, D, 1 / math.sqrt(D), Hkv, None, sliding_window, "auto"), stats


class Engine(PagedBatches):
    def __init__(self, impl, Hq, Hkv, D, nb=16, bs=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.impl, self.bs = impl, bs
        self.kv_cache = torch.randn(nb, Hkv, bs, 2 * D, generator=g) * 50  # stale garbage
        PagedBatches.__init__(self, torch.randperm(nb, generator=g).tolist(), bs, g, Hq, Hkv, D)
        self.layer = types.SimpleNamespace(layer_name=f"model.layers.{LAYER}.self_attn.attn")

    def step(self, plan):
        q, k, v, sm, qsl = self.tokens(plan)
        self.impl.do_kv_cache_update(self.layer, k, v, self.kv_cache, sm)
        cm = self.common_metadata(plan, qsl, sm)

        def build(c):  # the fields the platform's forward reads
            return types.SimpleNamespace(query_start_loc=c.query_start_loc, seq_lens=c.seq_lens,
                                         block_table=c.block_table_tensor, num_actual_tokens=c.num_actual_tokens)

        md = SP.split_metadata(build, cm, self.bs)
        out = torch.full((qsl[-1], self.Hq * self.D), float("nan"))
        self.impl.forward(self.layer, q, k, v, self.kv_cache, md, out)
        return q, out.view(-1, self.Hq, self.D), cm.seq_lens, qsl


@pytest.mark.parametrize("vmc", [False, True])
def test_mixed_batch_on_the_platform_cache(monkeypatch, backend, vmc, make_cfg, make_threshold_set, causal_reference):
    Hq, Hkv, D = 4, 2, 32
    ts = make_threshold_set(make_cfg(layers=3, heads=Hq, kv_heads=Hkv, head_dim=D), rows=128, k=4, seed=2)
    impl, stats = _impl(monkeypatch, backend, ts, VllmTopthSettings(mode="topth", thresholds="unused", vmc=vmc),
                        Hq, Hkv, D)
    eng = Engine(impl, Hq, Hkv, D)
    eng.step([("A", 40), ("B", 9)])
    eng.step([("A", 1), ("B", 1), ("C", 20)])
    q, out, lens, qsl = eng.step([("A", 1), ("B", 1), ("D", 7), ("C", 13)])
    scale = 1 / math.sqrt(D)
    assert impl.rule.thresholded and not torch.isnan(out).any()
    for b, seq in enumerate(["A", "B"]):  # decode rows: the op, against the float64 oracle
        kk, vv = eng.rows[seq]
        want = oracle_decode(q[b:b + 1], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], lens[b:b + 1],
                             ts.thresholds[LAYER], scale=scale, placement="post_softmax", vmc=vmc)
        np.testing.assert_allclose(out[b:b + 1].double().numpy(), want.out, rtol=2e-5, atol=2e-5)
        assert int(want.v_rows.sum()) < Hkv * int(lens[b])
    for i, seq in enumerate(["D", "C"], start=2):  # prefill rows: the platform, with the re-based metadata
        lo, hi = qsl[i], qsl[i + 1]
        kk, vv = (t.double().numpy() for t in eng.rows[seq])
        ref = causal_reference(q[lo:hi].double().numpy(), kk, vv, int(lens[i]) - (hi - lo), scale)
        np.testing.assert_allclose(out[lo:hi].double().numpy(), ref, rtol=2e-5, atol=2e-5)
    assert eng.layer.platform_tokens == 49 + 20 + 20  # step 1 whole, steps 2-3 the prefill part (decodes: the op)
    assert stats.report()["prefill_tokens_dense"] == 49 + 20 + 20


def test_sliding_window_layer_is_served_by_the_platform(monkeypatch, backend, make_cfg, make_threshold_set):
    Hq, Hkv, D = 4, 2, 32
    ts = make_threshold_set(make_cfg(layers=3, heads=Hq, kv_heads=Hkv, head_dim=D), rows=128, k=4)
    impl, _ = _impl(monkeypatch, backend, ts, VllmTopthSettings(mode="topth", thresholds="unused"), Hq, Hkv, D,
                    sliding_window=16)
    eng = Engine(impl, Hq, Hkv, D)
    eng.step([("A", 30)])
    eng.step([("A", 1)])
    assert not impl.rule.thresholded and "sliding window 16" in impl._platform
    assert eng.layer.platform_tokens == 31


@pytest.mark.parametrize("name", NAMES)
def test_split_classes_keep_the_platform(name):
    cls = GB.split_backend(name)
    base = cls.__mro__[1]
    assert cls is GB.split_backend(name) and cls.get_name() == base.get_name() == name
    assert issubclass(cls.get_impl_cls(), (SP.SplitImpl, base.get_impl_cls()))
    assert issubclass(cls.get_impl_cls(), base.get_impl_cls())
    assert issubclass(cls.get_builder_cls(), base.get_builder_cls())
    assert cls.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.NEVER
    with pytest.raises(KeyError):
        GB.split_backend("FLASHINFER")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("active", [True, False])
def test_dispatch_answers_with_the_split_only_when_active(monkeypatch, name, active):
    from topth_ops.vllm import dispatch, settings

    monkeypatch.setattr(settings, "is_active", lambda **kw: active)
    cls = getattr(dispatch, name)
    assert (cls is GB.split_backend(name)) == active
    assert cls.get_name() == name
    if active:  # the path vLLM records for the class resolves to it again
        from vllm.utils.import_utils import resolve_obj_by_qualname

        assert resolve_obj_by_qualname(".".join(cls.full_cls_name())) is cls


def test_cuda_platform_refuses_a_backend_it_does_not_split(monkeypatch):
    from topth_ops.vllm import platforms, settings

    class Platform:
        picked = "vllm.v1.attention.backends.flashinfer.FlashInferBackend"

        @classmethod
        def get_attn_backend_cls(cls, *args, **kwargs):
            return cls.picked

    platforms._wrap_platform(Platform, platforms._cuda_choice, "test")
    monkeypatch.setattr(settings, "is_active", lambda **kw: False)
    assert Platform.get_attn_backend_cls(None, None) == Platform.picked  # Top-Theta off: vLLM's choice
    monkeypatch.setattr(settings, "is_active", lambda **kw: True)
    with pytest.raises(NotImplementedError, match="FlashInferBackend.*--attention-backend FLASH_ATTN"):
        Platform.get_attn_backend_cls(None, None)
    for ok in ("topth_ops.vllm.dispatch.FLASH_ATTN", "topth_ops.vllm.backend.TopthAttentionBackend"):
        Platform.picked = ok
        assert Platform.get_attn_backend_cls(None, None) == ok


def test_hnd_views_read_the_platform_rows():
    kv = torch.randn(3, 2, 16, 2 * 8)
    kc, vc, lay = GB.hnd_views(kv, 8)
    assert lay == "HND" and kc.shape == vc.shape == (3, 2, 16, 8)
    # vLLM's own split of the same cache: (B, H, N, 2D) -> (B, N, H, D) K and V
    k_vllm, v_vllm = kv.transpose(1, 2).split(8, dim=-1)
    assert torch.equal(kc.transpose(1, 2), k_vllm) and torch.equal(vc.transpose(1, 2), v_vllm)
    with pytest.raises(NotImplementedError, match="2 \\* 8"):
        GB.hnd_views(torch.randn(3, 2, 16, 20), 8)
