"""The generic vLLM attention backend (``CUSTOM``; the CUDA and Ascend paths): Top-Theta
decode through :func:`topth_ops.decode_attention` on its own paged KV cache (NHD), dense
causal prefill, mixed batches (vLLM 0.32 interfaces). On the CPU the engine uses
:mod:`topth_ops.vllm.cpu_backend` instead, which keeps vLLM's own cache and attention and
replaces only the thresholded decode rows.

Per forward of one attention layer, vLLM hands the backend a flat batch: decode requests
first (one new token each; the builder asks vLLM to reorder them to the front), then
prefill requests (several new tokens: a prompt, a chunk of one, or the tail after a
prefix-cache hit). Before the forward, :meth:`TopthAttentionImpl.do_kv_cache_update`
writes the new tokens' K and V through the slot mapping (and updates the per-block V sum
when VMC is on). Then:

- decode tokens call the op once for all decode requests, with the request's block-table
  row, its length (``seq_lens``, the current token included) and this layer's threshold
  rows for this rank's query heads; VMC takes its V mean from the per-block sums;
- each prefill request runs dense causal attention over its cached positions.

Settings, model checks and statistics: :mod:`topth_ops.vllm.settings`,
:mod:`topth_ops.vllm.stats`, docs/vllm.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import KVCacheLayout

from ..paged import write_kv
from ..value_sum import PagedValueSum
from .paged_ops import nhd_views, prefill_dense
from .runtime import DecodeSets, LayerRule, decode_rows, decode_sets, layer_rule, record, runtime, value_sums

logger = logging.getLogger("vllm.topth_ops")

BACKEND_NAME = "CUSTOM"


class TopthAttentionBackend(AttentionBackend):
    """Top-Theta decode attention on vLLM's paged cache (NHD: ``LBNHC`` layout)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["TopthAttentionImpl"]:
        return TopthAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["TopthMetadataBuilder"]:
        return TopthMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Block tokens outermost: per-layer K and V are NHD views of one tensor.
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class TopthAttentionMetadata:
    """One batch, as the backend reads it.

    ``seq_lens`` count each request's positions after this step (new tokens included);
    requests ``[0, num_decodes)`` are decodes with one new token each (in token order),
    the rest are prefills; ``*_cpu`` copies serve the per-request prefill loop.
    """

    num_actual_tokens: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    sets: Optional[DecodeSets] = None  # filled by the first layer's decode (shared)


class TopthMetadataBuilder(AttentionMetadataBuilder[TopthAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TopthAttentionMetadata:
        cm = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(cm, decode_threshold=1)
        if num_decode_tokens != num_decodes:
            raise NotImplementedError(
                f"topth vLLM backend: {num_decodes} decode requests carry {num_decode_tokens} tokens; "
                "padded or multi-token decode batches (CUDA graphs, speculative decoding) are not supported")
        return TopthAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_seq_len=cm.max_seq_len,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            query_start_loc=cm.query_start_loc,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            seq_lens=cm.seq_lens.clone(),  # vLLM rewrites its buffer for the next step; statistics keep this one
            seq_lens_cpu=cm.seq_lens.to("cpu"),
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
        )


class TopthAttentionImpl(AttentionImpl[TopthAttentionMetadata]):
    """One attention layer's Top-Theta implementation (see the module docstring)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes=None, sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, sinks=None, **kwargs) -> None:
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            "sliding-window attention": sliding_window is not None,
            "logits soft-capping": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32"),
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
            "attention sinks": sinks is not None,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"topth vLLM backend does not support {', '.join(bad)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.rt = runtime()  # engine start: settings and threshold file checked here
        if self.rt.calib is not None:
            raise NotImplementedError("topth vLLM backend: mode 'calibrate' records rows beside vLLM's own CPU "
                                      "attention; on this platform calibrate offline (`topth-ops calibrate`)")
        self.layer: Optional[int] = None
        self.rule: Optional[LayerRule] = None
        self._vsum: Optional[PagedValueSum] = None

    # ---------------------------------------------------------------- per-layer setup

    def _bind(self, layer_module, device) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.layer = extract_layer_index(layer_module.layer_name)
        self.rule = layer_rule(self.rt, self.layer, self.num_heads, self.num_kv_heads, device)

    def _value_sum(self, value_cache: torch.Tensor) -> PagedValueSum:
        self._vsum = value_sums(self._vsum, value_cache, self.num_kv_heads, self.head_size, "NHD")
        return self._vsum

    # ---------------------------------------------------------------- vLLM hooks

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Write the new tokens' K and V into the paged cache through ``slot_mapping``
        (negative slots skipped); with VMC, update the per-block V sums first."""
        if self.layer is None:
            self._bind(layer, key.device)
        k_cache, v_cache = nhd_views(kv_cache, self.head_size)
        n = slot_mapping.shape[0]
        key, value = key[:n], value[:n]
        if self.rule.vmc:
            self._value_sum(v_cache).update(v_cache, value, slot_mapping)
        write_kv(k_cache, v_cache, key, value, slot_mapping, "NHD")

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[TopthAttentionMetadata], output: torch.Tensor,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        """Attention of one layer for a mixed batch; writes ``output`` ``[num_tokens,
        num_heads, head_size]`` and returns it."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("topth vLLM backend: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output.fill_(0)
        if self.layer is None:
            self._bind(layer, query.device)
        m = attn_metadata
        k_cache, v_cache = nhd_views(kv_cache, self.head_size)
        out = output.view(-1, self.num_heads, self.head_size)
        op_stats = None
        if m.num_decodes:
            op_stats = self._decode(query, k_cache, v_cache, m, out)
        prefill_tokens = 0
        if m.num_prefills:
            qsl = m.query_start_loc_cpu.tolist()
            lens_cpu = m.seq_lens_cpu.tolist()
            for i in range(m.num_decodes, m.num_decodes + m.num_prefills):
                lo, hi = qsl[i], qsl[i + 1]
                if hi == lo:
                    continue
                out[lo:hi] = prefill_dense(query[lo:hi], k_cache, v_cache, m.block_table[i], int(lens_cpu[i]),
                                           self.scale).to(out.dtype)
                prefill_tokens += hi - lo
        if self.rt.stats is not None or self.rt.settings.metrics:
            record(self.rt, self.layer, self.rule, m.sets, m.seq_lens[:m.num_decodes], self.num_kv_heads, op_stats,
                   prefill_tokens)
        return output

    def _decode(self, query, k_cache, v_cache, m: TopthAttentionMetadata, out):
        B = m.num_decodes
        bs = k_cache.shape[1]
        n = m.seq_lens[:B]
        width = min(m.block_table.shape[1], max(1, -(-int(m.max_seq_len) // bs)))
        bt = m.block_table[:B, :width]
        if bt.dtype != torch.int32:
            bt = bt.to(torch.int32)
        if m.sets is None:
            m.sets = decode_sets(self.rt, B, n)
        value_mean = self._value_sum(v_cache).mean(bt, n, v_cache) if self.rule.vmc else None
        res, op_stats = decode_rows(self.rt, self.rule, query[:B], k_cache, v_cache, n, bt, self.scale, "NHD",
                                    m.sets, value_mean)
        out[:B] = res.to(out.dtype)
        return op_stats
