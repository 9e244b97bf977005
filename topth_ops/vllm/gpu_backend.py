"""The CUDA backends: vLLM's FlashAttention (``FLASH_ATTN``) and Triton attention
(``TRITON_ATTN``) with only the thresholded decode rows replaced by
:func:`topth_ops.decode_attention` (vLLM 0.32 interfaces). Written against vLLM's
sources and tested on the CPU (classes, split, cache views, no host sync on the decode
path); not yet run on a GPU (docs/vllm.md, "On CUDA").

Each is a subclass of the backend vLLM picks on CUDA, so the engine keeps everything of
it: the KV-cache shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K in
the first ``head_size`` of each row, V in the second), its block sizes, its cache writes
(``reshape_and_cache_flash``), its metadata and its kernels for everything that is not a
thresholded decode row (prefill, chunked prefill, prefix-cache tails, layers the file keeps
dense, sliding-window / soft-capped / sink layers): :class:`topth_ops.vllm.split.SplitImpl`.

The decode rows of thresholded layers are one op call (the ``triton`` backend of the op
on CUDA) reading the cache in place through ``HND`` views with strides. The split around
that call does not synchronise with the host (no ``.item()``, ``.tolist()`` or
data-dependent shapes; tests/serving/test_decode_no_host_sync.py traces it on fake tensors
with the op's CPU backends; the Triton launch itself is not traced there). The builders declare no CUDA-graph support
(``AttentionCGSupport.NEVER``: vLLM then captures the rest of the model piecewise and runs
attention eagerly) until full-graph capture of the split has been run on a GPU: the
per-request threshold sets and the statistics are per-step host inputs that a captured
graph would replay stale.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec

from .split import SplitImpl, SplitMetadata, split_metadata

#: vLLM backends (AttentionBackendEnum names) that the plugin splits on CUDA, and their classes.
PLATFORM_BACKENDS = {
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend",
    "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
}


def hnd_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """K and V caches of vLLM's per-layer CUDA cache as the op reads them.

    Parameters
    ----------
    kv_cache : torch.Tensor
        ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (FlashAttention and Triton
        attention in vLLM 0.32).
    head_size : int

    Returns
    -------
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, num_kv_heads, block_size, head_size]`` views (slot stride
        ``2 * head_size``).
    kv_layout : str
        ``"HND"``.

    Raises
    ------
    NotImplementedError
        A cache whose rows are not ``2 * head_size`` wide (padded per-token-head quantized
        caches) or not 4-D.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise NotImplementedError(f"topth vLLM backend: a KV cache of shape {tuple(kv_cache.shape)} is not "
                                  f"[num_blocks, num_kv_heads, block_size, 2 * {head_size}]; the op reads only that one")
    return kv_cache[..., :head_size], kv_cache[..., head_size:], "HND"


def _window(sliding_window) -> Optional[int]:
    """Positions of a ``(left, right)`` window of vLLM's CUDA implementations (None without)."""
    if sliding_window is None:
        return None
    left = sliding_window[0] if isinstance(sliding_window, tuple) else sliding_window
    return None if left is None or left < 0 else int(left) + 1


class _GpuSplitImpl(SplitImpl):
    """The decode-row split on a CUDA implementation (FlashAttentionImpl, TritonAttentionImpl)."""

    # the op reads the whole (unsharded) cache of a decode row: no decode / prefill context parallelism
    supports_dcp = False
    supports_pcp = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes=None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: Optional[str] = None, sinks=None,
                 **kwargs) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks, **kwargs)
        self._split_init(kv_cache_dtype, kv_sharing_target_layer_name is not None)
        if getattr(self, "chunk_lookback", -1) > -1:  # Triton's chunked attention with lookback
            self._platform = ", ".join(filter(None, [self._platform, f"chunk lookback {self.chunk_lookback}"]))
        if self.rt.calib is not None:
            raise NotImplementedError("topth vLLM backend: mode 'calibrate' runs on vLLM's CPU attention; on CUDA "
                                      "calibrate offline (`topth-ops calibrate`)")

    def _window(self) -> Optional[int]:
        return _window(self.sliding_window)

    def _views(self, layer_module, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        return hnd_views(kv_cache, self.head_size)


def _builder_cls(base: type) -> type:
    class Builder(base):
        """The platform's metadata builder, asking for decodes first and adding the split."""

        _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
        # vLLM's V1 runner would reuse one group's SplitMetadata for the next group of equal
        # spec through FlashAttention's update_block_table, leaving .full / .prefill stale
        supports_update_block_table = False

        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
            return AttentionCGSupport.NEVER

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self._init_reorder_batch_threshold(1)
            self._split = not isinstance(kv_cache_spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec))
            if vllm_config.model_config.rswa_window is not None:
                raise NotImplementedError("topth vLLM backend: R-SWA (rswa_window) is not supported by the split")

        def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
                  fast_build: bool = False) -> SplitMetadata:
            sup = super().build
            # the prefill part: no cascade prefix and no ahead-of-time schedule (FlashAttention
            # keeps that schedule in one persistent buffer, which the whole batch's metadata holds)
            # multimodal prefix-LM ranges are not re-based for a prefill part (and FlashAttention
            # stages them in one persistent buffer): such steps are the platform's, whole
            mm = common_attn_metadata.mm_req_doc_ranges
            return split_metadata(lambda cm: sup(common_prefix_len, cm, fast_build), common_attn_metadata,
                                  self.kv_cache_spec.block_size, split=self._split and not (mm and any(mm.values())),
                                  build_prefill=lambda cm: sup(0, cm, True))

    Builder.__name__ = Builder.__qualname__ = f"Topth{base.__name__}"
    return Builder


def split_backend(name: str) -> type:
    """The Top-Theta subclass of vLLM's CUDA backend ``name`` (a key of
    :data:`PLATFORM_BACKENDS`): same name, cache, writes and kernels, thresholded decode
    rows through the op.

    Raises
    ------
    KeyError
        A backend the plugin does not split.
    """
    if name in _CLASSES:
        return _CLASSES[name]
    from importlib import import_module

    module, cls_name = PLATFORM_BACKENDS[name].rsplit(".", 1)
    import_module("vllm.model_executor.layers.attention")  # vLLM's backends import it first
    base = getattr(import_module(module), cls_name)
    impl = type(f"Topth{base.get_impl_cls().__name__}", (_GpuSplitImpl, base.get_impl_cls()),
                {"platform_name": f"vLLM's {name}", "__doc__": _GpuSplitImpl.__doc__})
    builder = _builder_cls(base.get_builder_cls())
    backend = type(f"Topth{cls_name}", (base,), {
        "__doc__": f"vLLM's {name} with Top-Theta decode rows (topth_ops.vllm.gpu_backend).",
        "get_impl_cls": staticmethod(lambda: impl),
        "get_builder_cls": staticmethod(lambda: builder),
        # the class path vLLM records and resolves again (full_cls_name): the dispatch name
        "__module__": "topth_ops.vllm.dispatch",
        "__qualname__": name,
    })
    _CLASSES[name] = backend
    return backend


_CLASSES: dict = {}
