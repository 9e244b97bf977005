"""The decode attention of the vLLM backends must not synchronise with the host (no
``.item()``, ``.tolist()``, ``.cpu()``, ``bool(tensor)`` or data-dependent shapes), so that
accelerators can capture it in CUDA graphs. Checked on the CPU for the generic backend, the
CPU split and the CUDA split (FlashAttention / Triton attention): the forward of a decode-only
step (VMC off) runs on fake tensors, which have no values: any of those calls raises there.
Only the kernel launch itself is replaced (it needs real memory); everything up to it runs:
the backend's bookkeeping, the op's validation and backend selection. Not covered (they
synchronise today, docs/vllm.md): the generic backend's own KV write (a masked index for
vLLM's padding slots) and VMC's per-block V sums."""

import math
import types

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

import topth_ops.op as op_mod
from topth_ops.vllm.runtime import Runtime
from topth_ops.vllm.settings import VllmTopthSettings

pytestmark = pytest.mark.vllm

LAYER = 1
Hq, Hkv, D, B, NB = 8, 2, 64, 3, 16


@pytest.fixture
def no_kernel(monkeypatch):
    """The selected backend's kernel is not run (fake tensors have no memory); the outputs
    stay as allocated. Counts the launches."""
    launches = []
    real = op_mod.select_backend

    def select(inputs, backend=None):
        chosen = real(inputs, backend)
        return types.SimpleNamespace(forward=lambda i, out, stats: launches.append(chosen.name))

    monkeypatch.setattr(op_mod, "select_backend", select)
    return launches


def _runtime(make_cfg, make_threshold_set, selection):
    cfg = make_cfg(layers=3, heads=Hq, kv_heads=Hkv, head_dim=D)
    ts = make_threshold_set(cfg, rows=256, k=4)
    if selection == "group":
        ts.thresholds = ts.thresholds[:, ::Hq // Hkv].contiguous()
        ts.selection = "group"
    return Runtime(VllmTopthSettings(mode="topth", thresholds="unused"), ts, 0, 1, None, "tiny")


@pytest.mark.parametrize("selection", ["head", "group"])
def test_generic_backend_decode_step_on_fake_tensors(monkeypatch, no_kernel, selection, make_cfg,
                                                    make_threshold_set):
    from topth_ops.vllm import backend as GB

    rt = _runtime(make_cfg, make_threshold_set, selection)
    monkeypatch.setattr(GB, "runtime", lambda: rt)
    impl = GB.TopthAttentionImpl(Hq, D, 1 / math.sqrt(D), Hkv, kv_cache_dtype="auto")
    layer = types.SimpleNamespace(layer_name=f"model.layers.{LAYER}.self_attn.attn")
    impl._bind(layer, torch.device("cpu"))  # the first (profiling) step binds the layer's rows, real tensors
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        bs = 16
        kv_cache = torch.empty(NB, bs, Hkv, 2 * D).permute(0, 2, 1, 3)
        q, k, v = torch.empty(B, Hq, D), torch.empty(B, Hkv, D), torch.empty(B, Hkv, D)
        lens = torch.empty(B, dtype=torch.int32)
        qsl = torch.empty(B + 1, dtype=torch.int32)
        md = GB.TopthAttentionMetadata(
            num_actual_tokens=B, max_seq_len=40, num_decodes=B, num_decode_tokens=B, num_prefills=0,
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, seq_lens_cpu=None,
            block_table=torch.empty(B, 4, dtype=torch.int32), slot_mapping=torch.empty(B, dtype=torch.int64))
        out = torch.empty(B, Hq * D)
        impl.forward(layer, q, k, v, kv_cache, md, out)
    assert mode is not None and no_kernel == ["cpu"] and impl.rule.thresholded


def _split_decode_step(impl, layer, block_size: int) -> None:
    """A decode-only step of a platform split (topth_ops.vllm.split) on fake tensors, after
    the layer's first step bound it on real ones."""
    from topth_ops.vllm import split as SP

    impl._bind(layer, torch.empty(NB, Hkv, block_size, 2 * D, dtype=torch.bfloat16))
    with FakeTensorMode(allow_non_fake_inputs=True):
        kv_cache = torch.empty(NB, Hkv, block_size, 2 * D, dtype=torch.bfloat16)
        q = torch.empty(B, Hq, D, dtype=torch.bfloat16)
        md = SP.SplitMetadata(full=None, prefill=None, num_decodes=B, num_prefill_tokens=0,
                              seq_lens=torch.empty(B, dtype=torch.int32),
                              block_table=torch.empty(B, 4, dtype=torch.int32))
        out = torch.empty(B, Hq * D, dtype=torch.bfloat16)
        impl.forward(layer, q, q[:, :Hkv], q[:, :Hkv], kv_cache, md, out)


@pytest.mark.parametrize("isa", ["amx", "vec"])
def test_cpu_backend_decode_step_on_fake_tensors(monkeypatch, no_kernel, isa, make_cfg, make_threshold_set):
    CB = pytest.importorskip("topth_ops.vllm.cpu_backend")
    SP = pytest.importorskip("topth_ops.vllm.split")
    from vllm.v1.attention.backends import cpu_attn

    rt = _runtime(make_cfg, make_threshold_set, "group")
    monkeypatch.setattr(SP, "runtime", lambda: rt)
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: cfg)
    impl = CB.TopthCpuImpl(Hq, D, 1 / math.sqrt(D), Hkv, kv_cache_dtype="auto")
    layer = types.SimpleNamespace(layer_name=f"model.layers.{LAYER}.self_attn.attn", isa=isa)
    _split_decode_step(impl, layer, 32)
    assert no_kernel == ["cpu"]


@pytest.mark.parametrize("name", ["FLASH_ATTN", "TRITON_ATTN"])
def test_gpu_split_decode_step_on_fake_tensors(monkeypatch, no_kernel, name, make_cfg, make_threshold_set):
    """The CUDA split (FlashAttention / Triton attention subclasses): a decode-only step of a
    thresholded layer is the op alone, with no host sync."""
    pytest.importorskip("vllm.model_executor.layers.attention")
    GPU = pytest.importorskip("topth_ops.vllm.gpu_backend")
    SP = pytest.importorskip("topth_ops.vllm.split")

    rt = _runtime(make_cfg, make_threshold_set, "group")
    monkeypatch.setattr(SP, "runtime", lambda: rt)
    impl = GPU.split_backend(name).get_impl_cls()(Hq, D, 1 / math.sqrt(D), Hkv, None, None, "auto")
    layer = types.SimpleNamespace(layer_name=f"model.layers.{LAYER}.self_attn.attn")
    _split_decode_step(impl, layer, 16)
    assert no_kernel == ["cpu"] and impl.rule.thresholded


def test_a_host_sync_is_caught(monkeypatch, no_kernel, make_cfg, make_threshold_set):
    """The check can fail: an ``.item()`` added to the decode path raises on fake tensors."""
    from topth_ops.vllm import backend as GB
    from topth_ops.vllm import runtime as R

    rt = _runtime(make_cfg, make_threshold_set, "head")
    monkeypatch.setattr(GB, "runtime", lambda: rt)
    real = R.decode_attention

    def with_sync(query, key_cache, value_cache, seq_lens, *a, **kw):
        int(seq_lens.max().item())
        return real(query, key_cache, value_cache, seq_lens, *a, **kw)

    monkeypatch.setattr(R, "decode_attention", with_sync)
    impl = GB.TopthAttentionImpl(Hq, D, 1 / math.sqrt(D), Hkv, kv_cache_dtype="auto")
    layer = types.SimpleNamespace(layer_name=f"model.layers.{LAYER}.self_attn.attn")
    impl._bind(layer, torch.device("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        kv_cache = torch.empty(NB, 16, Hkv, 2 * D).permute(0, 2, 1, 3)
        q = torch.empty(B, Hq, D)
        lens = torch.empty(B, dtype=torch.int32)
        md = GB.TopthAttentionMetadata(
            num_actual_tokens=B, max_seq_len=40, num_decodes=B, num_decode_tokens=B, num_prefills=0,
            query_start_loc=lens, query_start_loc_cpu=lens, seq_lens=lens, seq_lens_cpu=None,
            block_table=torch.empty(B, 4, dtype=torch.int32), slot_mapping=torch.empty(B, dtype=torch.int64))
        with pytest.raises(DataDependentOutputException):
            impl.forward(layer, q, q[:, :Hkv], q[:, :Hkv], kv_cache, md, torch.empty(B, Hq * D))
