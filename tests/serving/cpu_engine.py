"""A hand-built vLLM CPU engine for the serving tests: vLLM's own cache writer, metadata
builder and scheduler op around one :class:`topth_ops.vllm.cpu_backend.TopthCpuImpl` layer,
with the per-process runtime replaced by one built by the test."""

import math
import types

import pytest
import torch

from topth_ops.vllm.runtime import Runtime
from topth_ops.vllm.stats import ServingStats

from .slots import PagedBatches

ops = pytest.importorskip("vllm._custom_ops")
CB = pytest.importorskip("topth_ops.vllm.cpu_backend")
SP = pytest.importorskip("topth_ops.vllm.split")
from vllm.v1.attention.backends import cpu_attn  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata  # noqa: E402

LAYER = 2
_AMX = torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()  # Linux grants the tile state (as vLLM's worker asks)
ISAS = [pytest.param("amx", torch.bfloat16, marks=pytest.mark.skipif(
            not _AMX, reason="vLLM's amx kernel needs AMX tiles (this CPU has none)")),
        ("vec", torch.float32), ("vec", torch.bfloat16)]


class Engine(PagedBatches):
    """Allocates blocks and slot mappings for sequences the way vLLM does, writes through
    the backend, builds vLLM's metadata and runs the forward."""

    def __init__(self, impl, isa, dtype, Hq, nb=12, bs=32, H=2, D=64, seed=0, window=-1):
        self.g = torch.Generator().manual_seed(seed)
        self.impl, self.isa, self.dtype, self.Hq, self.bs, self.H, self.D = impl, isa, dtype, Hq, bs, H, D
        self.window = window
        self.kv_cache = (torch.randn(nb, H, bs, 2 * D, generator=self.g) * 50).to(dtype)  # stale garbage
        PagedBatches.__init__(self, torch.randperm(nb, generator=self.g).tolist(), bs, self.g, Hq, H, D, dtype)
        self.layer = types.SimpleNamespace(layer_name=f"model.layers.{LAYER}.self_attn.attn", isa=isa,
                                           _k_scale_float=1.0, _v_scale_float=1.0)

    def _build(self, cm):
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=cm.num_reqs, num_heads=self.Hq, num_kv_heads=self.H, head_dim=self.D, seq_lens=cm.seq_lens,
            dtype=self.dtype, query_start_loc=cm.query_start_loc, causal=True, sliding_window_size=self.window,
            isa=self.isa, enable_kv_split=False)
        return CPUAttentionMetadata(num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
                                    query_start_loc=cm.query_start_loc, max_seq_len=cm.max_seq_len,
                                    seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
                                    slot_mapping=cm.slot_mapping, scheduler_metadata=sched)

    def step(self, plan):
        """plan: list of (seq, new tokens), decodes first."""
        q, k, v, sm, qsl = self.tokens(plan)
        N = qsl[-1]
        self.impl.do_kv_cache_update(self.layer, k, v, self.kv_cache, sm)
        cm = self.common_metadata(plan, qsl, sm)
        bt, lens = cm.block_table_tensor, cm.seq_lens
        md = SP.split_metadata(self._build, cm, self.bs)
        out = torch.full((N, self.Hq * self.D), float("nan"), dtype=self.dtype)
        self.impl.forward(self.layer, q, k, v, self.kv_cache, md, out)
        kept_lens = lens.clone()
        lens.zero_()  # vLLM rewrites its seq_lens buffer for the next step before statistics are summed
        return q, out.view(N, self.Hq, self.D), bt, kept_lens, qsl


def make_impl(monkeypatch, ts, settings, Hq, Hkv, D, sets=(), calib=None, **kw):
    """The layer and its statistics, under a runtime of ``settings`` (threshold set ``ts``)."""
    stats = ServingStats(settings.mode, None, 0.0)
    rt = Runtime(settings, ts, 0, 1, stats, "tiny", list(sets), [True] * len(sets), calib=calib)
    monkeypatch.setattr(SP, "runtime", lambda: rt)
    # vLLM's impl reads the model dtype from the engine config (to pick zentorch on AMD)
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: cfg)
    return CB.TopthCpuImpl(Hq, D, 1 / math.sqrt(D), Hkv, kv_cache_dtype="auto", **kw), stats
