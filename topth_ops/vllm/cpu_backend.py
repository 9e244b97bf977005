"""The CPU backend: vLLM's own CPU attention (``CPU_ATTN``) with only the thresholded
decode rows replaced by :func:`topth_ops.decode_attention` (vLLM 0.32 interfaces).

It subclasses vLLM's ``CPUAttentionBackend``, so the engine keeps everything of it: the
KV-cache shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` and block sizes
(multiples of 32), the cache writes (``cpu_attn_reshape_and_cache``, which packs each
block for the layer's ISA), the scheduler metadata and ``cpu_attention_with_kv_cache`` for
everything that is not a thresholded decode row:

- prefill, chunked prefill and prefix-cache tails, in every layer;
- every row of layers the threshold file keeps dense (k = dense), and of every layer in
  dense mode (then the engine runs vLLM's attention unchanged, plus bookkeeping);
- layers the op does not cover: sliding-window, logit soft-capping, attention sinks,
  ALiBi, encoder / cross attention, KV-cache sharing (a warning at the layer's first step
  when the file thresholds it).

The decode rows of thresholded layers (requests with one new token past their prompt; the
builder asks vLLM to put one-token requests first) are one op call that reads vLLM's cache in place: with the ``amx`` ISA
(bfloat16, AMX tiles) ``kv_layout="VLLM_AMX"``; with ``vec`` / ``vec16`` (other dtypes or
CPUs) K is stored transposed per block and head (``[head_dim, block_size]``) and V as rows,
an ``HND`` view with strides. VMC keeps per-block V sums beside the cache
(:class:`topth_ops.paged.PagedValueSum`), updated before each write.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
    _get_attn_isa,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from ..paged import PagedValueSum
from .runtime import DecodeSets, LayerRule, decode_rows, decode_sets, layer_rule, record, runtime, value_sums

logger = logging.getLogger("vllm.topth_ops")

#: vLLM CPU attention ISAs whose cache packing the op reads, and the op layout for each.
ISA_LAYOUTS = {"amx": "VLLM_AMX", "vec": "HND", "vec16": "HND"}


def cache_views(kv_cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """K and V caches of vLLM's per-layer CPU cache as the op reads them.

    Parameters
    ----------
    kv_cache : torch.Tensor
        ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, contiguous (vLLM's).
    isa : str
        The layer's CPU attention ISA (``layer.isa``, set by vLLM's metadata builder).

    Returns
    -------
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, num_kv_heads, block_size, head_size]`` views of ``kv_cache``.
    kv_layout : {"VLLM_AMX", "HND"}

    Raises
    ------
    NotImplementedError
        An ISA whose packing the op does not read (ARM, POWER, RISC-V, s390x).
    """
    if isa not in ISA_LAYOUTS:
        raise NotImplementedError(f"topth vLLM backend: vLLM's CPU attention ISA {isa!r} packs its cache in a layout "
                                  f"the op does not read (supported: {sorted(ISA_LAYOUTS)})")
    nb, H, bs, two_d = kv_cache.shape
    D = two_d // 2
    kc, vc = kv_cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    if isa == "amx":
        return kc, vc, "VLLM_AMX"
    # vec / vec16: each block and head stores K as [D, bs] (slot stride 1, dim stride bs)
    kt = kc.as_strided((nb, H, bs, D), (kc.stride(0), kc.stride(1), 1, bs), kc.storage_offset())
    return kt, vc, "HND"


@dataclass
class TopthCpuMetadata:
    """One batch: vLLM's metadata of the whole batch (``full``), of its prefill requests
    alone (``prefill``, token and request indices re-based to 0; None without decodes or
    without prefills), and the decode requests ``[0, num_decodes)`` for the op. ``sets``
    (each decode row's threshold set) is filled by the first layer that needs it and
    shared by the others."""

    full: CPUAttentionMetadata
    prefill: Optional[CPUAttentionMetadata]
    num_decodes: int
    num_prefill_tokens: int
    seq_lens: torch.Tensor       # [num_decodes]
    block_table: torch.Tensor    # [num_decodes, width] int32
    sets: Optional[DecodeSets] = None


#: Lazily filled per-batch caches of CommonAttentionMetadata that a sliced copy must not inherit.
_WHOLE_BATCH_CACHES = ("_num_computed_tokens_cache", "_token_to_req_indices_cache")


def prefill_part(cm: CommonAttentionMetadata, num_decodes: int, num_decode_tokens: int) -> CommonAttentionMetadata:
    """The common metadata of requests ``[num_decodes, num_reqs)`` alone (tokens from
    ``num_decode_tokens``), re-based so its first token and request are 0."""
    qsl = cm.query_start_loc[num_decodes:] - num_decode_tokens
    qsl_cpu = cm.query_start_loc_cpu[num_decodes:] - num_decode_tokens
    ql = qsl_cpu[1:] - qsl_cpu[:-1]
    return dataclasses.replace(
        cm, query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=cm.seq_lens[num_decodes:],
        num_reqs=cm.num_reqs - num_decodes, num_actual_tokens=cm.num_actual_tokens - num_decode_tokens,
        max_query_len=int(ql.max()), block_table_tensor=cm.block_table_tensor[num_decodes:],
        slot_mapping=cm.slot_mapping[num_decode_tokens:cm.num_actual_tokens],
        positions=None if cm.positions is None else cm.positions[num_decode_tokens:],
        seq_lens_cpu_upper_bound=(None if cm.seq_lens_cpu_upper_bound is None
                                  else cm.seq_lens_cpu_upper_bound[num_decodes:]),
        is_prefilling=None if cm.is_prefilling is None else cm.is_prefilling[num_decodes:],
        logits_indices_padded=None, num_logits_indices=None, req_idx=None, mm_req_doc_ranges=None,
        **{f: None for f in _WHOLE_BATCH_CACHES if hasattr(cm, f)})


def split_metadata(build, cm: CommonAttentionMetadata, block_size: int, split: bool = True) -> TopthCpuMetadata:
    """Build :class:`TopthCpuMetadata` with ``build`` (vLLM's builder: common metadata ->
    ``CPUAttentionMetadata``).

    Decode rows are requests with one new token that are past their prompt (vLLM's
    ``is_prefilling`` where the runner gives it): a one-token prompt tail (the last prompt
    token recomputed after a full prefix-cache hit, a one-token final chunk) stays with vLLM.
    ``split=False`` (encoder-only and cross-attention groups, whose builder rewrites the slot
    mapping in place) gives no decode rows: vLLM serves the whole batch.
    """
    if not split:
        full = build(cm)
        return TopthCpuMetadata(full, None, 0, cm.num_actual_tokens, cm.seq_lens[:0],
                                cm.block_table_tensor[:0, :1].to(torch.int32))
    nd, npf, ndt, npt = split_decodes_and_prefills(
        cm, decode_threshold=1, treat_short_extends_as_decodes=cm.is_prefilling is None)
    if ndt != nd:
        raise NotImplementedError(f"topth vLLM backend: {nd} decode requests carry {ndt} tokens; multi-token "
                                  "decode steps (speculative decoding) are not supported")
    full = build(cm)
    prefill = build(prefill_part(cm, nd, ndt)) if nd and npf else None
    width = max(1, min(cm.block_table_tensor.shape[1], -(-int(cm.max_seq_len) // block_size)))
    bt = cm.block_table_tensor[:nd, :width]
    if bt.dtype != torch.int32:
        bt = bt.to(torch.int32)
    # a copy: vLLM rewrites its seq_lens buffer for the next step before the statistics of
    # this one are summed (they keep references until the step ends)
    return TopthCpuMetadata(full, prefill, nd, npt, cm.seq_lens[:nd].clone(), bt)


class TopthCpuMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder, asking for decodes first and adding the split."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TopthCpuMetadata:
        sup = super().build
        return split_metadata(lambda cm: sup(common_prefix_len, cm, fast_build), common_attn_metadata,
                              self.block_size, split=not (self.is_cross_attention or self.is_encoder_only_attention))


def platform_reason(impl: CPUAttentionBackendImpl, kv_sharing: bool) -> Optional[str]:
    """Why vLLM's own attention must serve every row of this layer, or None."""
    reasons = {
        f"sliding window {impl.sliding_window}": impl.sliding_window != -1,
        f"logit soft-capping {impl.logits_soft_cap}": bool(impl.logits_soft_cap),
        "attention sinks": impl.sinks is not None,
        "ALiBi slopes": impl.alibi_slopes is not None,
        f"attention type {impl.attn_type}": impl.attn_type != AttentionType.DECODER,
        "KV-cache sharing with another layer": kv_sharing,
    }
    bad = [k for k, v in reasons.items() if v]
    return ", ".join(bad) if bad else None


class TopthCpuImpl(CPUAttentionBackendImpl):
    """One attention layer: vLLM's CPU attention, thresholded decode rows through the op."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes=None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, sinks=None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.rt = runtime()  # engine start: settings and threshold file checked here
        if self.rt.thresholds is not None and is_quantized_kv_cache(kv_cache_dtype):
            raise NotImplementedError(f"topth vLLM backend: KV cache dtype {kv_cache_dtype} is not supported by the "
                                      "op; serve Top-Theta with kv_cache_dtype='auto'")
        self._platform = platform_reason(self, kv_sharing_target_layer_name is not None)
        self.layer: Optional[int] = None
        self.rule: Optional[LayerRule] = None
        self._vsum: Optional[PagedValueSum] = None

    def _bind(self, layer_module, kv_cache: torch.Tensor) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.layer = extract_layer_index(layer_module.layer_name)
        if self._platform is not None:
            self.rule = LayerRule(False, torch.empty(0))
            if self.rt.calib is not None:
                self.rt.calib.platform_layer(self.layer, self._platform)
            if self.rt.thresholds is not None and self.rt.thresholds.layer_k[self.layer] != 0:
                logger.warning("topth: layer %d is thresholded in the file but served densely by vLLM's own "
                               "attention in every row (%s)", self.layer, self._platform)
            return
        self.rule = layer_rule(self.rt, self.layer, self.num_heads, self.num_kv_heads, kv_cache.device)
        if self.rule.thresholded:
            isa = self._isa(layer_module, kv_cache)
            cache_views(kv_cache, isa)  # refuses an ISA the op cannot read, at the layer's first step

    def _isa(self, layer_module, kv_cache: torch.Tensor) -> str:
        isa = getattr(layer_module, "isa", None)
        if isa is None:  # set by vLLM's builder; the same rule otherwise
            isa = _get_attn_isa(kv_cache.dtype, kv_cache.shape[2], self.head_size, self.kv_cache_dtype)
        return isa

    def _value_sum(self, value_cache: torch.Tensor, kv_layout: str) -> PagedValueSum:
        self._vsum = value_sums(self._vsum, value_cache, self.num_kv_heads, self.head_size, kv_layout)
        return self._vsum

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """vLLM's own write; with VMC the per-block V sums are updated first (they read
        the rows a slot held before)."""
        if self.layer is None:
            self._bind(layer, kv_cache)
        if self.rule.vmc:
            _, vc, lay = cache_views(kv_cache, self._isa(layer, kv_cache))
            n = slot_mapping.shape[0]
            self._value_sum(vc, lay).update(vc, value[:n], slot_mapping)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[TopthCpuMetadata], output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """Attention of one layer for a mixed batch, into ``output``."""
        if attn_metadata is None:  # profiling / warm-up run
            return super().forward(layer, query, key, value, kv_cache, None, output, output_scale,
                                   output_block_scale)
        if self.layer is None:
            self._bind(layer, kv_cache)
        m = attn_metadata
        B = m.num_decodes
        rt = self.rt
        if B and m.sets is None and (self.rule.thresholded or rt.settings.metrics):
            m.sets = decode_sets(rt, B, m.seq_lens)
        if not (B and self.rule.thresholded and self.rule.serves(m.sets.present)):
            super().forward(layer, query, key, value, kv_cache, m.full, output, output_scale, output_block_scale)
            if rt.stats is not None or rt.settings.metrics:
                n = m.seq_lens if self.sliding_window <= 0 else m.seq_lens.clamp(max=self.sliding_window)
                record(rt, self.layer, self.rule, m.sets, n, self.num_kv_heads, None, m.num_prefill_tokens)
            if rt.calib is not None and self._platform is None:
                f = m.full
                kc, _, lay = cache_views(kv_cache, self._isa(layer, kv_cache))
                rt.calib.observe(self.layer, query, kc, lay, f.query_start_loc, f.seq_lens, f.block_table, B,
                                 self.scale)
            return output
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("topth vLLM backend: fused output quantization is not supported")
        kc, vc, lay = cache_views(kv_cache, self._isa(layer, kv_cache))
        n = m.seq_lens
        value_mean = self._value_sum(vc, lay).mean(m.block_table, n, vc) if self.rule.vmc else None
        res, op_stats = decode_rows(rt, self.rule, query[:B], kc, vc, n, m.block_table, self.scale, lay, m.sets,
                                    value_mean)
        output[:B] = res.reshape(output[:B].shape).to(output.dtype)
        if m.prefill is not None:
            super().forward(layer, query[B:], key[B:], value[B:], kv_cache, m.prefill, output[B:])
        record(rt, self.layer, self.rule, m.sets, n, self.num_kv_heads, op_stats, m.num_prefill_tokens)
        return output


class TopthCpuAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with Top-Theta decode rows (module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[TopthCpuImpl]:
        return TopthCpuImpl

    @staticmethod
    def get_builder_cls() -> type[TopthCpuMetadataBuilder]:
        return TopthCpuMetadataBuilder
