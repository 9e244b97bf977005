"""What every attention layer of the vLLM backends shares: the per-engine runtime
(settings, the checked threshold file, the tensor-parallel rank, statistics), each
layer's rule (threshold rows, placement, compensation) and the one decode call of
:func:`topth_ops.decode_attention` on a paged cache.

Used by the CPU backend (:mod:`topth_ops.vllm.cpu_backend`, on vLLM's own CPU attention)
and the generic backend (:mod:`topth_ops.vllm.backend`, CUDA / Ascend); neither module
imports the other.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from vllm.config import get_current_vllm_config

from .. import decode_attention
from ..contract import DEFAULT_SDC_GAMMA
from . import stats as stats_mod
from .settings import VllmTopthSettings, from_sources, load_for_model, model_name_of, rank_kv_rows, rank_rows

logger = logging.getLogger("vllm.topth_ops")


@dataclass
class Runtime:
    """Per-process state shared by every layer: settings, the checked threshold file and
    this rank's place in tensor parallelism."""

    settings: VllmTopthSettings
    thresholds: Optional[object]  # ThresholdSet
    tp_rank: int
    tp_size: int
    stats: Optional[stats_mod.ServingStats]
    model_name: Optional[str]


_RUNTIMES: dict = {}


def runtime() -> Runtime:
    """Load and check the settings once per engine in this process, at the first attention
    layer's construction (engine start). Raises on any problem: never a silent dense
    fallback. Engines with other settings or models in the same process (vLLM's
    in-process mode) get their own runtime."""
    from vllm.distributed import get_tensor_model_parallel_rank

    vcfg = get_current_vllm_config()
    settings = from_sources(additional_config=vcfg.additional_config)
    tp_size = int(vcfg.parallel_config.tensor_parallel_size)
    tp_rank = int(get_tensor_model_parallel_rank()) if tp_size > 1 else 0
    key = (settings, str(vcfg.model_config.model), tp_rank, tp_size)
    if key not in _RUNTIMES:
        _RUNTIMES.clear()
        _RUNTIMES[key] = _load_runtime(vcfg, settings, tp_rank, tp_size)
    return _RUNTIMES[key]


def _load_runtime(vcfg, settings: VllmTopthSettings, tp_rank: int, tp_size: int) -> Runtime:
    hf = vcfg.model_config.hf_config
    name = model_name_of(hf, vcfg.model_config.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts = load_for_model(settings, hf, name, tp_size)
    for w in caught:
        logger.warning("topth: %s", w.message)
    if vcfg.speculative_config is not None:
        raise NotImplementedError("topth vLLM backend: speculative decoding is not supported "
                                  "(its multi-token verification steps and rejected slots)")
    if ts is not None:
        dense_layers = [i for i, k in enumerate(ts.layer_k) if k == 0]
        logger.info("topth: Top-Theta decode, %s; vmc=%s sdc=%s; TP rank %d of %d%s",
                    ts.summary(), settings.vmc, settings.sdc, tp_rank, tp_size,
                    f"; dense layers (k = dense in the file's layer map) {dense_layers}" if dense_layers else "")
    else:
        logger.info("topth: dense mode (every row kept; A/B baseline); TP rank %d of %d", tp_rank, tp_size)
    st = None
    if settings.stats_file or settings.log_interval > 0:
        path = stats_mod.rank_path(settings.stats_file, tp_rank) if settings.stats_file else None
        st = stats_mod.install(stats_mod.ServingStats(
            settings.mode, path, settings.log_interval,
            meta={"model": name, "thresholds": settings.thresholds, "vmc": settings.vmc, "sdc": settings.sdc,
                  "placement": ts.placement if ts is not None else None, "tp_rank": tp_rank,
                  "tp_size": tp_size}))
    return Runtime(settings, ts, tp_rank, tp_size, st, name)


@dataclass
class LayerRule:
    """How one attention layer's decode rows are served on this rank.

    Attributes
    ----------
    thresholded : bool
        False in dense mode and for layers the file keeps dense (k = dense).
    thresholds : torch.Tensor
        ``[num_heads, max_row_id]`` (selection "head") or ``[num_kv_heads, max_row_id]``
        ("group") float32 rows of this rank; ``[num_heads, 1]`` of -inf when not thresholded.
    placement, sdc, selection : str
    sdc_table : torch.Tensor or None
        ``[num_heads, max_row_id]`` (sdc "offline").
    vmc : bool
    """

    thresholded: bool
    thresholds: torch.Tensor
    placement: str = "post_softmax"
    sdc: str = "none"
    selection: str = "head"
    sdc_table: Optional[torch.Tensor] = None
    vmc: bool = False


def layer_rule(rt: Runtime, layer: int, num_heads: int, num_kv_heads: int, device) -> LayerRule:
    """The rule of model layer ``layer`` for this rank's ``num_heads`` query and
    ``num_kv_heads`` KV heads.

    Raises
    ------
    ValueError
        A group-selection file whose KV-head rows do not match this rank's KV heads.
    """
    s, ts = rt.settings, rt.thresholds
    if ts is None or ts.layer_k[layer] == 0:
        return LayerRule(False, torch.full((num_heads, 1), float("-inf"), device=device))
    if ts.selection == "group":
        # one threshold per KV head (this rank's KV heads), against the group maximum
        th = rank_kv_rows(ts.thresholds, layer, rt.tp_rank, rt.tp_size).to(device)
        if th.shape[0] != num_kv_heads:
            raise ValueError(f"topth vLLM backend: rank {rt.tp_rank} holds {num_kv_heads} KV heads, "
                             f"but the group-selection file gives it {th.shape[0]} threshold rows")
    else:
        th = rank_rows(ts.thresholds, layer, rt.tp_rank, num_heads).to(device)
    sdc_table = rank_rows(ts.sdc_table, layer, rt.tp_rank, num_heads).to(device) if s.sdc == "offline" else None
    return LayerRule(True, th, ts.placement, s.sdc, ts.selection, sdc_table, s.vmc)


def decode_rows(rt: Runtime, rule: LayerRule, query: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                kv_layout: str, value_mean: Optional[torch.Tensor] = None):
    """One layer's decode rows through :func:`topth_ops.decode_attention`.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_decodes, num_heads, head_dim]``.
    key_cache, value_cache : torch.Tensor
        The paged caches in ``kv_layout`` (views of vLLM's cache).
    seq_lens : torch.Tensor
        ``[num_decodes]`` positions after this step (the new token included).
    block_table : torch.Tensor
        ``[num_decodes, width]`` int32.
    scale : float
    kv_layout : {"NHD", "HND", "VLLM_AMX"}
    value_mean : torch.Tensor, optional
        ``[num_decodes, num_kv_heads, head_dim]`` (VMC).

    Returns
    -------
    out : torch.Tensor
        ``[num_decodes, num_heads, head_dim]``.
    v_rows : torch.Tensor or None
        ``[num_decodes, num_kv_heads]`` V rows read, when statistics are collected.
    """
    s = rt.settings
    want_stats = rt.stats is not None
    res = decode_attention(
        query, key_cache, value_cache, seq_lens, rule.thresholds, scale=scale,
        placement=rule.placement, sdc=rule.sdc,
        sdc_gamma=s.sdc_gamma if rule.sdc == "exp_threshold" else DEFAULT_SDC_GAMMA,
        sdc_table=rule.sdc_table, vmc=rule.vmc, value_mean=value_mean, return_stats=want_stats,
        backend=s.op_backend, block_table=block_table, kv_layout=kv_layout, selection=rule.selection,
    )
    if want_stats:
        out, st = res
        return out, st.v_rows
    return res, None
