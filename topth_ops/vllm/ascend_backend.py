"""The Ascend backend: vLLM-Ascend's own attention (``AscendAttentionBackend``) with the
decode rows of thresholded layers replaced by :func:`topth_ops.decode_attention` in
decode-only steps. WRITTEN AGAINST vLLM-Ascend's SOURCES, NEVER RUN (no NPU here, and
vLLM-Ascend does not install without CANN): the class wiring is checked on the CPU with a
stand-in of vLLM-Ascend's classes (tests/serving/test_vllm_ascend_backend.py).

vLLM-Ascend keeps its cache as ``(key_cache, value_cache)``, each ``[num_blocks,
block_size, num_kv_heads, head_size]`` (NHD, read in place), writes it inside its forward
(``reshape_and_cache``) and then calls ``forward_impl`` for the attention. This subclass
overrides only:

- ``forward_impl``: in a step where every request is a decode (``attn_state`` DecodeOnly,
  one token per request) and the layer is thresholded, the op serves the rows; any other
  step (prefill, chunked prefill with decodes, speculative decoding) and every
  sliding-window / soft-capped / sink layer go to vLLM-Ascend unchanged, so decode rows
  that share a step with a prompt chunk are dense in that step. Unlike the CPU and CUDA
  splits, vLLM-Ascend's metadata (host lists for its fused kernels) is not re-built for a
  prefill part;
- ``reshape_and_cache`` / ``do_kv_cache_update``: with VMC, the per-block V sums are
  updated before vLLM-Ascend's write.

The decode path's only host-to-device transfer is the step's ``seq_lens``, which
vLLM-Ascend keeps on the host (one copy per step, shared by the layers).
"""

from __future__ import annotations

from typing import Optional

import torch

from .runtime import decode_rows, decode_sets, record
from .split import SplitImpl

BACKEND_PATH = "vllm_ascend.attention.attention_v1"


def _impl_cls(base_impl: type, decode_only) -> type:
    class TopthAscendImpl(SplitImpl, base_impl):
        """One attention layer: vLLM-Ascend's attention, thresholded decode rows of
        decode-only steps through the op (module docstring)."""

        platform_name = "vLLM-Ascend's attention"

        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                     kv_cache_dtype, logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
                     **kwargs):
            super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                             kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, **kwargs)
            self.logits_soft_cap = logits_soft_cap  # vLLM-Ascend does not keep it; platform_reason reads it
            self._split_init(kv_cache_dtype, kv_sharing_target_layer_name is not None)
            if self.rt.calib is not None:
                raise NotImplementedError("topth vLLM backend: mode 'calibrate' runs on vLLM's CPU attention; on "
                                          "Ascend calibrate offline (`topth-ops calibrate`)")

        def _window(self) -> Optional[int]:
            w = getattr(self, "sliding_window", None)
            return None if w is None or w <= 0 else int(w)

        def _views(self, layer_module, kv_cache) -> tuple[torch.Tensor, torch.Tensor, str]:
            if not isinstance(kv_cache, (list, tuple)) and not (torch.is_tensor(kv_cache) and kv_cache.shape[0] == 2):
                raise NotImplementedError("topth vLLM backend: vLLM-Ascend's KV cache is not a (key, value) pair")
            return kv_cache[0], kv_cache[1], "NHD"

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                    output_block_scale=None):
            if self.layer is None and attn_metadata is not None:
                self._bind(layer, kv_cache)
            return base_impl.forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                     output_block_scale)

        def reshape_and_cache(self, query, key, value, kv_cache, attn_metadata, output):
            if self.rule.vmc and key is not None and len(kv_cache) > 1:
                _, vc, lay = self._views(None, kv_cache)
                n = attn_metadata.num_actual_tokens
                self._value_sum(vc, lay).update(vc, value[:n], attn_metadata.slot_mapping[:n])
            return super().reshape_and_cache(query, key, value, kv_cache, attn_metadata, output)

        def _step_rows(self, m, B: int, device):
            """The step's decode lengths on the device and threshold sets (once per step,
            shared by the layers through the metadata; vLLM-Ascend keeps seq_lens on the host)."""
            if getattr(m, "_topth_rows", None) is None:
                lens = m.seq_lens[:B].to(device, torch.int32, non_blocking=True)
                m._topth_rows = (lens, decode_sets(self.rt, B, lens))
            return m._topth_rows

        def forward_impl(self, query, key, value, kv_cache, attn_metadata, output):
            m, rt = attn_metadata, self.rt
            B = m.num_decodes
            want = rt.stats is not None or rt.settings.metrics
            if not (B and m.num_decode_tokens == B and (self.rule.thresholded or want)):
                return super().forward_impl(query, key, value, kv_cache, m, output)
            lens, sets = self._step_rows(m, B, query.device)
            prefill_tokens = m.num_actual_tokens - B
            if not (decode_only(m) and self.rule.thresholded and self.rule.serves(sets.present)):
                out = super().forward_impl(query, key, value, kv_cache, m, output)
                if want:
                    w = self._window()
                    record(rt, self.layer, self.rule, sets, lens if w is None else lens.clamp(max=w),
                           self.num_kv_heads, None, prefill_tokens)
                return out
            kc, vc, lay = self._views(None, kv_cache)
            bt = m.block_tables[:B]
            if bt.dtype != torch.int32:
                bt = bt.to(torch.int32)
            value_mean = self._value_sum(vc, lay).mean(bt, lens, vc) if self.rule.vmc else None
            res, op_stats = decode_rows(rt, self.rule, query[:B], kc, vc, lens, bt, self.scale, lay, sets, value_mean)
            output[:B] = res.reshape(output[:B].shape).to(output.dtype)
            record(rt, self.layer, self.rule, sets, lens, self.num_kv_heads, op_stats, prefill_tokens)
            return output

    return TopthAscendImpl


def _builder_cls(base_builder: type) -> type:
    """vLLM-Ascend's metadata builder, declaring no full-graph support: the decode rows read
    the step's threshold sets and statistics from the host, which a captured (ACL) graph would
    replay stale, so vLLM-Ascend runs attention eagerly between piecewise graphs."""
    from vllm.v1.attention.backend import AttentionCGSupport

    never = AttentionCGSupport.NEVER
    return type(f"Topth{base_builder.__name__}", (base_builder,), {
        "_cudagraph_support": never,
        "get_cudagraph_support": classmethod(lambda cls, vllm_config, kv_cache_spec: never),
    })


def split_backend() -> type:
    """The Top-Theta subclass of vLLM-Ascend's ``AscendAttentionBackend`` (imports
    vLLM-Ascend).

    Raises
    ------
    NotImplementedError
        vLLM-Ascend picks another implementation class (prefill / decode context
        parallelism), whose metadata this subclass does not read.
    """
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from importlib import import_module

    mod = import_module(BACKEND_PATH)
    base = mod.AscendAttentionBackend
    base_impl = base.get_impl_cls()
    if base_impl is not mod.AscendAttentionBackendImpl:
        raise NotImplementedError(f"topth vLLM backend: vLLM-Ascend serves this model with {base_impl.__name__} "
                                  "(context parallelism); Top-Theta needs its AscendAttentionBackendImpl")
    decode_only_state = mod.AscendAttentionState.DecodeOnly
    impl = _impl_cls(base_impl, lambda m: m.attn_state == decode_only_state)
    builder = _builder_cls(base.get_builder_cls())
    _CLASS = type("TopthAscendAttentionBackend", (base,), {
        "__doc__": "vLLM-Ascend's attention with Top-Theta decode rows (topth_ops.vllm.ascend_backend).",
        "get_impl_cls": staticmethod(lambda: impl),
        "get_builder_cls": staticmethod(lambda: builder),
    })
    return _CLASS


_CLASS: Optional[type] = None

