"""The "topth" attention function for transformers (AttentionInterface).

:func:`enable` registers the function under the name ``"topth"`` (so it can also be
given as ``attn_implementation="topth"`` when a model is loaded), attaches a
:class:`TopthAttention` controller holding the settings to every attention module of the
model, and switches the model to it. Per call (one layer, one forward):

- decode steps (query length 1) in Top-Theta mode call :func:`topth_ops.decode_attention`,
  so the backend registry picks the kernel for the device (the ``cpu`` kernel, Triton on
  CUDA, Ascend C on NPU, else the PyTorch reference);
- prefill (query length > 1) applies the same per-row thresholding through
  :func:`topth_ops.prefill.prefill_attention` (each row with its own row id), or stays
  dense (SDPA) with ``prefill="dense"``;
- exact top-k mode runs every row, decode included, through the prefill reference (the
  op takes one threshold per row id, while top-k needs one per sequence);
- dense layers (k = dense in the layer map) and dense mode use transformers' SDPA.

Row ids and valid keys come from the attention mask, which transformers builds from the
cache's positions (:mod:`topth_ops.hf.cache_view`): dynamic, static, offloaded and quantized
caches work (the key/value passed in are the whole cache after the update, BNSD), with GQA.
Sliding-window layers (Gemma 3: 5 of every 6 layers, window 512) are thresholded with row
id = the number of keys the row attends, min(n, window), which is what their mask gives
and what calibration records for them; VMC averages the window's V rows there. Chunked and
other attention types are refused by :func:`enable`. Threshold sets: several sets give the
op 3-D thresholds and a per-request ``threshold_set``; group selection is passed through
as ``selection="group"``. Padding:
prefill accepts any padding mask (each row's valid keys are counted); decode needs each
sequence's valid keys to be a prefix of the cache, and raises a ValueError for left-padded
batches.

VMC: the V mean handed to the op as ``value_mean`` comes from running V sums that live on
the transformers cache object and follow its edits (reorder, batch selection, repeat; a
crop or reset rebuilds them from the cache), so a decode step adds one V row instead of
re-reading all of them (:mod:`topth_ops.hf.vmean`); the prefill reference averages each
row's own valid V rows.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional

import torch

from ..prefill import MAX_CHUNK_ELEMS, RowRule, prefill_attention
from ..rowstats import StatsCollector
from ..thresholds import DENSE
from ..vmean import valid_value_mean
from .cache_view import check_supported, rows_from_mask, sdpa_can_skip_mask, topth_mask
from .settings import TopthSettings, check_set_indices
from .vmean import value_sums_for

logger = logging.getLogger("topth_ops")

ATTN_NAME = "topth"


ScoreHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class TopthAttention:
    """Controller attached to a model's attention modules by :func:`enable`.

    Attributes
    ----------
    settings : TopthSettings
    prefill_stats, decode_stats : StatsCollector or None
        When set, every thresholded row adds its k~, V rows and beta (prefill rows and
        decode steps separately).
    score_hook : callable or None
        ``hook(layer, scores, row_ids, m, log_z)`` for every chunk of rows of every
        forward (calibration); forces the reference path for every layer.
    dense_prefix : int
        0 (default), or N > 0: in a multi-row forward, the first N valid positions (rows
        with row id n <= N on full-attention layers) attend densely through SDPA and are
        not added to the stats, as a serving engine's own prefill serves a prompt of N
        tokens; later rows are thresholded and see the prefix's K and V as dense layers
        produced them (the engine's decode rows after that prompt, teacher-forced).
        Single-row (decode) forwards are thresholded at every row id; calibration
        (``score_hook``, layer-wise) ignores it. On sliding-window layers, whose row ids
        stop at the window, a prefix at or above the window takes positions from the
        ``position_ids`` transformers passes along (:meth:`_late_rows`).
    """

    def __init__(self, model, settings: TopthSettings, *, prefill_stats: Optional[StatsCollector] = None,
                 decode_stats: Optional[StatsCollector] = None, score_hook: Optional[ScoreHook] = None,
                 max_chunk_elems: int = MAX_CHUNK_ELEMS):
        cfg = model.config
        self.num_layers = int(cfg.num_hidden_layers)
        if settings.mode == "topth" and settings.thresholds is not None:
            name = _model_name(model)
            for ts in settings.sets:
                ts.check_model(cfg, name or type(model).__name__, placement=settings.placement,
                               selection=settings.selection, compare_name=name is not None)
                ts.check_rule(settings.sdc, settings.vmc)
        self.settings = settings.resolved(self.num_layers)
        self.prefill_stats = prefill_stats
        self.decode_stats = decode_stats
        self.score_hook = score_hook
        self.dense_prefix = 0
        self.max_chunk_elems = max_chunk_elems
        self._rules: dict[tuple, RowRule] = {}
        self._tables: dict[tuple, torch.Tensor] = {}
        self._cache = None  # the transformers cache of the running forward (see _capture_cache)
        # layer-wise calibration (topth_ops.hf.calib_layerwise) takes over every layer when set
        self.layer_calibrator = None

    def _capture_cache(self, module, args, kwargs) -> None:
        """Forward pre-hook of each attention module: remember the cache object of this
        call (keyword ``cache``, or ``past_key_values`` in older transformers) so that the
        VMC sums can live on it (:mod:`topth_ops.hf.vmean`)."""
        self._cache = kwargs.get("cache", kwargs.get("past_key_values"))

    # ------------------------------------------------------------------ helpers

    def layer_k(self, layer: int) -> int:
        return self.settings.layer_k[layer]

    def _table(self, name: str, layer: int, device) -> Optional[torch.Tensor]:
        """One layer's table: ``[H, max_row_id]``, or ``[num_sets, H, max_row_id]`` with
        several threshold sets."""
        key = (name, layer, device)
        if key not in self._tables:
            sets = self.settings.sets
            if len(sets) == 1:
                src = getattr(sets[0], name)
                t = None if src is None else src[layer]
            else:
                from ..thresholds import stack_sets

                t = stack_sets(sets, layer, name)
            self._tables[key] = None if t is None else t.to(device, torch.float32).contiguous()
        return self._tables[key]

    @property
    def multi_set(self) -> bool:
        return len(self.settings.sets) > 1

    def set_threshold_set(self, choice) -> None:
        """Change the per-request threshold-set choice (see ``TopthSettings.threshold_set``)
        between calls, e.g. for the next batch of requests.

        Raises
        ------
        ThresholdFileError
            An index out of range (the message names the file).
        TypeError
            Not an int, a sequence of int or a 1-D integer tensor.
        ValueError
            None (or empty) while the thresholds hold several sets.
        """
        self.settings.threshold_set = check_set_indices(choice, self.settings.sets)

    def _threshold_set(self, B: int, device) -> Optional[torch.Tensor]:
        """``[B]`` int64 set index per batch row (None with one set)."""
        if not self.multi_set:
            return None
        idx = torch.as_tensor(self.settings.threshold_set, dtype=torch.int64)  # a list (TopthSettings)
        if idx.numel() == 1:
            idx = idx.expand(B)
        elif idx.numel() != B:
            if B % idx.numel():
                raise ValueError(f"threshold_set has {idx.numel()} entries but the batch has {B} rows (give one "
                                 "per request, or one for all)")
            idx = idx.repeat_interleave(B // idx.numel())  # generate() expanded each request (beams, samples)
        return idx.to(device)

    def _rule(self, layer: int, device, calibrating: bool) -> Optional[RowRule]:
        """RowRule of a layer, None for the dense (SDPA) path."""
        s = self.settings
        k = s.layer_k[layer]
        if s.mode == "dense" or k == DENSE:
            return RowRule("dense") if calibrating else None
        if s.mode == "topk":
            return RowRule("topk", placement=s.placement, sdc=s.sdc, sdc_gamma=s.sdc_gamma, k=k, vmc=s.vmc)
        key = (layer, device)
        if key not in self._rules:
            self._rules[key] = RowRule(
                "table", placement=s.placement, sdc=s.sdc, sdc_gamma=s.sdc_gamma,
                thresholds=self._table("thresholds", layer, device),
                sdc_table=self._table("sdc_table", layer, device) if s.sdc == "offline" else None,
                vmc=s.vmc, selection=s.selection or "head",
            )
        return self._rules[key]

    # ------------------------------------------------------------------ forward

    def forward(self, module, query, key, value, attention_mask, scaling, kwargs) -> torch.Tensor:
        """One layer's attention; returns ``[B, T, num_q_heads, head_dim]``."""
        if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
            raise NotImplementedError("topth attention is causal decode attention; got a non-causal call")
        layer = module.layer_idx
        B, Hq, T, D = query.shape
        S = key.shape[2]
        scale = float(scaling) if scaling is not None else D ** -0.5
        dev = query.device
        row_ids, key_valid = rows_from_mask(attention_mask, B, T, S, dev)
        if self.layer_calibrator is not None:
            return self.layer_calibrator.forward(layer, query, key, value, row_ids, key_valid, scale)
        calibrating = self.score_hook is not None
        rule = self._rule(layer, dev, calibrating)
        s = self.settings

        late = (self._late_rows(layer, row_ids, kwargs)
                if T > 1 and self.dense_prefix > 0 and not calibrating else None)
        if rule is None or (T > 1 and s.prefill == "dense" and not calibrating):
            out = _sdpa(module, query, key, value, attention_mask, row_ids, key_valid, scale, kwargs)
            stats = self.decode_stats if T == 1 else self.prefill_stats
            if stats is not None:
                if late is not None:  # the prefix rows are not counted (as thresholded layers do)
                    row_ids = torch.where(late, row_ids, 0)
                stats.add_dense(layer, row_ids)
            return out

        sliding = kwargs.get("sliding_window") is not None
        if T == 1 and rule.kind == "table" and not calibrating:
            return self._decode_op(layer, query, key, value, row_ids, key_valid, rule, scale, sliding)

        if late is not None:
            return self._dense_prefix_forward(module, query, key, value, attention_mask, row_ids, key_valid,
                                              late, rule, scale, kwargs)
        hook = None
        if calibrating:
            hook = functools.partial(self.score_hook, layer)
        stats = self.decode_stats if T == 1 else self.prefill_stats
        out, st = prefill_attention(query, key, value, row_ids, rule, scale=scale, key_valid=key_valid,
                                    return_stats=stats is not None, score_hook=hook,
                                    max_chunk_elems=self.max_chunk_elems,
                                    threshold_set=self._threshold_set(B, dev) if rule.kind == "table" else None)
        if stats is not None:
            stats.add(layer, row_ids, *st)
        return out.transpose(1, 2)

    def _late_rows(self, layer: int, row_ids: torch.Tensor, kwargs) -> torch.Tensor:
        """``[B, T]`` bool: the rows past ``dense_prefix`` (padding rows never are).

        A row's id is its position + 1 among the valid tokens, except on a sliding-window
        layer, which caps row ids at the window: a prefix at or above the window takes the
        positions there from the model's ``position_ids`` (which transformers passes on to
        the attention function; they must count valid tokens only, as ``generate`` builds
        them for left-padded batches). Without them, or where they disagree with the row
        ids below the window, ValueError.
        """
        window = kwargs.get("sliding_window")
        if window is None or self.dense_prefix < window:
            return row_ids > self.dense_prefix
        B, T = row_ids.shape
        pos = kwargs.get("position_ids")
        why = None
        if pos is None:
            why = "the model passed no position_ids"
        elif pos.dim() != 2 or pos.shape[0] not in (1, B) or pos.shape[1] != T:
            why = f"position_ids of shape {list(pos.shape)} (expected [{B} or 1, {T}])"
        else:
            n = (pos.to(device=row_ids.device, dtype=torch.int64) + 1).expand(B, T)
            below = (row_ids > 0) & (row_ids < window)
            if bool((n[below] != row_ids[below]).any()):
                why = ("its position_ids disagree with the valid keys of the rows below the window (left "
                       "padding with positions that count the pads?)")
            else:
                return (row_ids > 0) & (n > self.dense_prefix)
        raise ValueError(f"dense_prefix={self.dense_prefix}: layer {layer} attends over a sliding window of "
                         f"{window} keys, where row ids stop at {window}, and {why}, so the first "
                         f"{self.dense_prefix} positions cannot be told from later ones; pass position_ids "
                         f"that count the valid tokens, or use a prefix below {window}")

    def _dense_prefix_forward(self, module, query, key, value, attention_mask, row_ids, key_valid, late, rule,
                              scale, kwargs) -> torch.Tensor:
        """A multi-row forward with the rows before ``late`` through SDPA, the late rows thresholded."""
        B = query.shape[0]
        out = _sdpa(module, query, key, value, attention_mask, row_ids, key_valid, scale, kwargs)
        cols = late.any(0).nonzero()
        if cols.numel() == 0:
            return out
        t0 = int(cols[0])
        stats = self.prefill_stats
        sub, st = prefill_attention(query[:, :, t0:], key, value, row_ids[:, t0:], rule, scale=scale,
                                    key_valid=None if key_valid is None else key_valid[:, t0:],
                                    return_stats=stats is not None, max_chunk_elems=self.max_chunk_elems,
                                    threshold_set=self._threshold_set(B, query.device) if rule.kind == "table" else None)
        keep = late[:, t0:]
        out = out.clone()
        out[:, t0:] = torch.where(keep[:, :, None, None], sub.transpose(1, 2).to(out.dtype), out[:, t0:])
        if stats is not None:
            stats.add(module.layer_idx, torch.where(keep, row_ids[:, t0:], 0), *st)
        return out

    def _decode_op(self, layer, query, key, value, row_ids, key_valid, rule, scale, sliding=False) -> torch.Tensor:
        from .. import decode_attention

        if key_valid is not None:
            raise ValueError(
                "topth decode: the valid keys of every sequence must be a prefix of the KV cache "
                "(the decode op reads positions 0..n-1), but in this batch padding sits inside "
                "some sequence's cache (left-padded prompts, or right-padded prompts followed by "
                "generation); run sequences without padding (batch size 1 or equal-length prompts)"
            )
        n = row_ids[:, 0]
        s = self.settings
        value_mean = None
        if s.vmc:
            # a sliding window drops a row as it adds one, which the running sums (rows are
            # only ever appended) cannot follow: its mean is taken over the <= window rows
            sums = None if sliding else value_sums_for(self._cache)
            value_mean = sums.mean(layer, value, n) if sums is not None else valid_value_mean(value, n)
        collect = self.decode_stats is not None
        res = decode_attention(
            query[:, :, 0], key, value, n, rule.thresholds, scale=scale, placement=s.placement,
            sdc=s.sdc, sdc_gamma=s.sdc_gamma, sdc_table=rule.sdc_table, vmc=s.vmc,
            value_mean=value_mean, return_stats=collect, backend=s.backend,
            selection=rule.selection, threshold_set=self._threshold_set(query.shape[0], query.device),
        )
        if collect:
            out, st = res
            self.decode_stats.add(layer, row_ids, st.kept.unsqueeze(-1), st.v_rows.unsqueeze(-1),
                                  st.dropped_mass.unsqueeze(-1))
        else:
            out = res
        return out.unsqueeze(1)  # [B, 1, Hq, D]


def _sdpa(module, query, key, value, attention_mask, row_ids, key_valid, scale, kwargs) -> torch.Tensor:
    """Dense attention of every row through transformers' SDPA function, ``[B, T, Hq, D]``
    (the mask is dropped where the rows are plain causal prefixes)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = None if sdpa_can_skip_mask(row_ids, key_valid, key.shape[2]) else attention_mask
    out, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scale, **kwargs)
    return out


def model_display_name(model) -> str:
    """The name used in messages and threshold files: the one :func:`~topth_ops.hf.model.load_model`
    gave the model, else the last component of ``name_or_path``, else the class name."""
    return _model_name(model) or type(model).__name__


def _model_name(model) -> Optional[str]:
    """The model's own name (see :func:`model_display_name`), or None for an unnamed model."""
    given = getattr(model, "_topth_name", None)
    if given:
        return given
    path = str(getattr(model, "name_or_path", "") or "").rstrip("/\\")
    return os.path.basename(path) or None


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctl = getattr(module, "_topth", None)
    if ctl is None:
        raise RuntimeError(
            "attn_implementation='topth' needs Top-Theta settings: call "
            "topth_ops.hf.attention.enable(model, TopthSettings(...)) after loading the model"
        )
    return ctl.forward(module, query, key, value, attention_mask, scaling, kwargs), None


def register() -> None:
    """Register "topth" with transformers' AttentionInterface and AttentionMaskInterface
    (boolean masks as for SDPA, always materialized: :func:`topth_ops.hf.cache_view.topth_mask`).
    Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, topth_mask)


def _attention_modules(model):
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")
            and hasattr(m, "head_dim")]
    if not mods:
        raise ValueError(f"{type(model).__name__} has no attention modules that use transformers' "
                         "AttentionInterface (Llama-family models do)")
    return mods


def enable(model, settings: TopthSettings, **kwargs) -> TopthAttention:
    """Switch a transformers model to Top-Theta attention.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder whose attention goes through AttentionInterface (Llama family).
    settings : TopthSettings
    **kwargs
        ``prefill_stats``, ``decode_stats``, ``score_hook``, ``max_chunk_elems`` of
        :class:`TopthAttention`.

    Returns
    -------
    TopthAttention
        The controller (its stats collectors fill as the model runs).

    Raises
    ------
    ValueError, ThresholdFileError
        Invalid settings, or a thresholds file made for another model or placement; a
        model or generation config the integration does not support (sliding-window or
        other non-full attention layers, ``is_causal=False``, the paged cache of continuous
        batching; :func:`topth_ops.hf.cache_view.check_supported`).
    """
    check_supported(model)
    register()
    ctl = TopthAttention(model, settings, **kwargs)
    for m in _attention_modules(model):
        if hasattr(m, "_topth_hook"):
            m._topth_hook.remove()
        m._topth = ctl
        m._topth_hook = m.register_forward_pre_hook(ctl._capture_cache, with_kwargs=True)
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        model._topth_previous_attn = model.config._attn_implementation
        model.set_attn_implementation(ATTN_NAME)
    return ctl


def disable(model) -> None:
    """Restore the attention implementation the model had before :func:`enable`."""
    for m in _attention_modules(model):
        if hasattr(m, "_topth"):
            del m._topth
        if hasattr(m, "_topth_hook"):
            m._topth_hook.remove()
            del m._topth_hook
    prev = getattr(model, "_topth_previous_attn", None) or "sdpa"
    model.set_attn_implementation(prev)
