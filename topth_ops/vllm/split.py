"""The decode-row split that every platform backend of the plugin shares (vLLM 0.32
interfaces): the platform's own attention serves a batch, except the decode rows of
thresholded layers, which are one call of :func:`topth_ops.decode_attention` reading the
platform's cache in place.

- :func:`split_metadata` builds, with the platform's own metadata builder, the metadata of
  the whole batch and of its prefill requests alone (decode requests first: the builders
  ask vLLM to reorder one-token requests to the front);
- :class:`SplitImpl` is the mixin of the attention implementations: it goes before the
  platform's implementation class in the bases and calls it (``super()``) for everything
  that is not a thresholded decode row. A platform module gives it the op's view of the
  cache (:meth:`SplitImpl._views`) and the sliding window.

Used by :mod:`topth_ops.vllm.cpu_backend` (vLLM's CPU attention) and
:mod:`topth_ops.vllm.gpu_backend` (FlashAttention and Triton attention on CUDA).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from ..value_sum import PagedValueSum
from .runtime import DecodeSets, LayerRule, decode_rows, decode_sets, layer_rule, record, runtime, value_sums

logger = logging.getLogger("vllm.topth_ops")


@dataclass
class SplitMetadata:
    """One batch: the platform's metadata of the whole batch (``full``), of its prefill
    requests alone (``prefill``, token and request indices re-based to 0; None without
    decodes or without prefills), and the decode requests ``[0, num_decodes)`` for the op.
    ``sets`` (each decode row's threshold set) is filled by the first layer that needs it
    and shared by the others."""

    full: Any
    prefill: Optional[Any]
    num_decodes: int
    num_prefill_tokens: int
    seq_lens: torch.Tensor       # [num_decodes]
    block_table: torch.Tensor    # [num_decodes, width] int32
    sets: Optional[DecodeSets] = None


#: Lazily filled per-batch caches of CommonAttentionMetadata that a sliced copy must not inherit.
_WHOLE_BATCH_CACHES = ("_num_computed_tokens_cache", "_token_to_req_indices_cache")


def prefill_part(cm: CommonAttentionMetadata, num_decodes: int, num_decode_tokens: int) -> CommonAttentionMetadata:
    """The common metadata of requests ``[num_decodes, num_reqs)`` alone (tokens from
    ``num_decode_tokens``), re-based so its first token and request are 0.

    Parameters
    ----------
    cm : CommonAttentionMetadata
        The whole batch: ``query_start_loc`` ``[num_reqs + 1]``, ``seq_lens`` ``[num_reqs]``,
        ``block_table_tensor`` ``[num_reqs, max_blocks]``, ``slot_mapping`` ``[num_tokens]``.
    num_decodes, num_decode_tokens : int
        Requests and tokens of the decode part at the front of the batch.

    Returns
    -------
    CommonAttentionMetadata
        Views of ``cm``'s tensors (``query_start_loc`` shifted: a new tensor).
    """
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


def split_metadata(build: Callable, cm: CommonAttentionMetadata, block_size: int, split: bool = True,
                   build_prefill: Optional[Callable] = None) -> SplitMetadata:
    """Build :class:`SplitMetadata` with ``build`` (the platform's builder: common metadata
    -> its metadata) and ``build_prefill`` (the same for the prefill part; default
    ``build``).

    Decode rows are requests with one new token that are past their prompt (vLLM's
    ``is_prefilling`` where the runner gives it): a one-token prompt tail (the last prompt
    token recomputed after a full prefix-cache hit, a one-token final chunk) stays with the
    platform. ``split=False`` (encoder-only and cross-attention groups, whose builder
    rewrites the slot mapping in place) gives no decode rows: the platform serves the whole
    batch. Runs on the host before the step (no device sync: ``max_seq_len`` and the CPU
    copies of the query offsets are host values).

    Raises
    ------
    NotImplementedError
        Decode requests with several tokens (speculative decoding).
    """
    if not split:
        full = build(cm)
        return SplitMetadata(full, None, 0, cm.num_actual_tokens, cm.seq_lens[:0],
                             cm.block_table_tensor[:0, :1].to(torch.int32))
    nd, npf, ndt, npt = split_decodes_and_prefills(
        cm, decode_threshold=1, treat_short_extends_as_decodes=cm.is_prefilling is None)
    if ndt != nd:
        raise NotImplementedError(f"topth vLLM backend: {nd} decode requests carry {ndt} tokens; multi-token "
                                  "decode steps (speculative decoding) are not supported")
    full = build(cm)
    prefill = (build_prefill or build)(prefill_part(cm, nd, ndt)) if nd and npf else None
    width = max(1, min(cm.block_table_tensor.shape[1], -(-int(cm.max_seq_len) // block_size)))
    bt = cm.block_table_tensor[:nd, :width]
    if bt.dtype != torch.int32:
        bt = bt.to(torch.int32)
    # a copy: vLLM rewrites its seq_lens buffer for the next step before the statistics of
    # this one are summed (they keep references until the step ends)
    return SplitMetadata(full, prefill, nd, npt, cm.seq_lens[:nd].clone(), bt)


def platform_reason(window: Optional[int], soft_cap, sinks, alibi_slopes, attn_type: str,
                    kv_sharing: bool) -> Optional[str]:
    """Why the platform's own attention must serve every row of a layer, or None.
    ``window``: the layer's sliding window in positions (None: none)."""
    reasons = {
        f"sliding window {window}": window is not None,
        f"logit soft-capping {soft_cap}": bool(soft_cap),
        "attention sinks": sinks is not None,
        "ALiBi slopes": alibi_slopes is not None,
        f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        "KV-cache sharing with another layer": kv_sharing,
    }
    bad = [k for k, v in reasons.items() if v]
    return ", ".join(bad) if bad else None


class SplitImpl:
    """Mixin of a platform attention implementation: thresholded decode rows through the
    op, everything else through the platform (``super()``).

    A subclass lists it before the platform's class, calls :meth:`_split_init` after the
    platform's ``__init__``, and defines :meth:`_views` and :meth:`_window`.
    """

    #: Name of the platform attention in messages ("vLLM's CPU attention", ...).
    platform_name = "the platform's attention"

    def _split_init(self, kv_cache_dtype: str, kv_sharing: bool) -> None:
        self.rt = runtime()  # engine start: settings and threshold file checked here
        if self.rt.thresholds is not None and is_quantized_kv_cache(kv_cache_dtype):
            raise NotImplementedError(f"topth vLLM backend: KV cache dtype {kv_cache_dtype} is not supported by the "
                                      "op; serve Top-Theta with kv_cache_dtype='auto'")
        self._platform = platform_reason(self._window(), getattr(self, "logits_soft_cap", None),
                                         getattr(self, "sinks", None), getattr(self, "alibi_slopes", None),
                                         self.attn_type, kv_sharing)
        self.layer: Optional[int] = None
        self.rule: Optional[LayerRule] = None
        self._vsum: Optional[PagedValueSum] = None

    # ------------------------------------------------------------ platform hooks

    def _views(self, layer_module, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(key_cache, value_cache, kv_layout)``: the op's views of the layer's cache."""
        raise NotImplementedError

    def _window(self) -> Optional[int]:
        """The layer's sliding window in positions, None without one."""
        raise NotImplementedError

    # ------------------------------------------------------------ per-layer setup

    def _bind(self, layer_module, kv_cache: torch.Tensor) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.layer = extract_layer_index(layer_module.layer_name)
        if self._platform is not None:
            self.rule = LayerRule(False, torch.empty(0))
            if self.rt.calib is not None:
                self.rt.calib.platform_layer(self.layer, self._platform)
            if self.rt.thresholds is not None and self.rt.thresholds.layer_k[self.layer] != 0:
                logger.warning("topth: layer %d is thresholded in the file but served densely by %s in every row "
                               "(%s)", self.layer, self.platform_name, self._platform)
            return
        device = (kv_cache if torch.is_tensor(kv_cache) else kv_cache[0]).device  # vLLM-Ascend: a (K, V) pair
        self.rule = layer_rule(self.rt, self.layer, self.num_heads, self.num_kv_heads, device)
        if self.rule.thresholded:
            self._views(layer_module, kv_cache)  # refuses a cache the op cannot read, at the layer's first step

    def _value_sum(self, value_cache: torch.Tensor, kv_layout: str) -> PagedValueSum:
        self._vsum = value_sums(self._vsum, value_cache, self.num_kv_heads, self.head_size, kv_layout)
        return self._vsum

    # ------------------------------------------------------------ vLLM hooks

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """The platform's own write; with VMC the per-block V sums are updated first (they
        read the rows a slot held before)."""
        if self.layer is None:
            self._bind(layer, kv_cache)
        if self.rule.vmc:
            _, vc, lay = self._views(layer, kv_cache)
            n = slot_mapping.shape[0]
            self._value_sum(vc, lay).update(vc, value[:n], slot_mapping)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[SplitMetadata], output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """Attention of one layer for a mixed batch, into ``output`` ``[num_tokens,
        num_heads * head_size]``: decode rows ``[0, num_decodes)`` of a thresholded layer
        through the op, the rest (or the whole batch) through the platform."""
        if attn_metadata is None:  # profiling / warm-up run
            return super().forward(layer, query, key, value, kv_cache, None, output, output_scale,
                                   output_block_scale)
        if self.layer is None:
            self._bind(layer, kv_cache)
        m = attn_metadata
        B = m.num_decodes
        rt = self.rt
        if rt.calib is not None and rt.thresholds is not None:  # a second calibration round: no statistics
            if self.rule.thresholded:
                return self._second_round(layer, query, kv_cache, m, output, output_scale, output_block_scale)
            super().forward(layer, query, key, value, kv_cache, m.full, output, output_scale, output_block_scale)
            if self._platform is None:
                self._observe(layer, query, kv_cache, m)
            return output
        if B and m.sets is None and (self.rule.thresholded or rt.settings.metrics or rt.stats is not None):
            # once per step, shared by every layer (statistics sampling decides per step)
            m.sets = decode_sets(rt, B, m.seq_lens)
        if not (B and self.rule.thresholded and self.rule.serves(m.sets.present)):
            super().forward(layer, query, key, value, kv_cache, m.full, output, output_scale, output_block_scale)
            if rt.stats is not None or rt.settings.metrics:
                w = self._window()
                n = m.seq_lens if w is None else m.seq_lens.clamp(max=w)
                record(rt, self.layer, self.rule, m.sets, n, self.num_kv_heads, None, m.num_prefill_tokens)
            if rt.calib is not None and self._platform is None:
                self._observe(layer, query, kv_cache, m)
            return output
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("topth vLLM backend: fused output quantization is not supported")
        kc, vc, lay = self._views(layer, kv_cache)
        n = m.seq_lens
        value_mean = self._value_sum(vc, lay).mean(m.block_table, n, vc) if self.rule.vmc else None
        res, op_stats = decode_rows(rt, self.rule, query[:B], kc, vc, n, m.block_table, self.scale, lay, m.sets,
                                    value_mean)
        output[:B] = res.reshape(output[:B].shape).to(output.dtype)
        if m.prefill is not None:
            super().forward(layer, query[B:], key[B:], value[B:], kv_cache, m.prefill, output[B:])
        record(rt, self.layer, self.rule, m.sets, n, self.num_kv_heads, op_stats, m.num_prefill_tokens)
        return output

    def _second_round(self, layer, query: torch.Tensor, kv_cache: torch.Tensor, m: SplitMetadata,
                      output: torch.Tensor, output_scale=None, output_block_scale=None) -> torch.Tensor:
        """A second calibration round (mode ``calibrate`` with a file): every token of the
        batch, prompt rows included, is one decode row of the op with the served set (the
        file's set for every request), then the rows are recorded (the layers above see
        thresholded activations, as they will when the file is served). No statistics."""
        from .calib_plan import token_rows

        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("topth vLLM backend: fused output quantization is not supported")
        f, rt = m.full, self.rt
        kc, vc, lay = self._views(layer, kv_cache)
        n, bt = token_rows(f.query_start_loc, f.seq_lens, f.block_table)
        R = n.shape[0]
        ts = torch.full((R,), rt.default_set, dtype=torch.int32)
        sets = DecodeSets(ts, None, None, frozenset({rt.default_set}), False)
        value_mean = self._value_sum(vc, lay).mean(bt, n, vc) if self.rule.vmc else None
        res, _ = decode_rows(rt, self.rule, query[:R], kc, vc, n, bt, self.scale, lay, sets, value_mean)
        output[:R] = res.reshape(output[:R].shape).to(output.dtype)
        self._observe(layer, query, kv_cache, m)
        return output

    def _observe(self, layer, query: torch.Tensor, kv_cache: torch.Tensor, m: SplitMetadata) -> None:
        """Mode ``calibrate``: record this layer's rows of the step (after the forward wrote them)."""
        f = m.full
        kc, _, lay = self._views(layer, kv_cache)
        self.rt.calib.observe(self.layer, query, kc, lay, f.query_start_loc, f.seq_lens, f.block_table,
                              m.num_decodes, self.scale)
