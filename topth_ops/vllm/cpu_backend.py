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
(:class:`topth_ops.value_sum.PagedValueSum`), updated before each write.
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
    _get_attn_isa,
)

from .split import SplitImpl, SplitMetadata, split_metadata

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


class TopthCpuMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder, asking for decodes first and adding the split."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SplitMetadata:
        sup = super().build
        return split_metadata(lambda cm: sup(common_prefix_len, cm, fast_build), common_attn_metadata,
                              self.block_size, split=not (self.is_cross_attention or self.is_encoder_only_attention))


class TopthCpuImpl(SplitImpl, CPUAttentionBackendImpl):
    """One attention layer: vLLM's CPU attention, thresholded decode rows through the op
    (:class:`topth_ops.vllm.split.SplitImpl`)."""

    platform_name = "vLLM's own attention"

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes=None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, sinks=None) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self._split_init(kv_cache_dtype, kv_sharing_target_layer_name is not None)

    def _window(self) -> Optional[int]:
        w = self.sliding_window
        return None if w is None or w <= 0 else int(w)

    def _isa(self, layer_module, kv_cache: torch.Tensor) -> str:
        isa = getattr(layer_module, "isa", None)
        if isa is None:  # set by vLLM's builder; the same rule otherwise
            isa = _get_attn_isa(kv_cache.dtype, kv_cache.shape[2], self.head_size, self.kv_cache_dtype)
        return isa

    def _views(self, layer_module, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        return cache_views(kv_cache, self._isa(layer_module, kv_cache))


class TopthCpuAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with Top-Theta decode rows (module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[TopthCpuImpl]:
        return TopthCpuImpl

    @staticmethod
    def get_builder_cls() -> type[TopthCpuMetadataBuilder]:
        return TopthCpuMetadataBuilder
