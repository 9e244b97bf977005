"""What every attention layer of the vLLM backends shares: the per-engine runtime
(settings, the checked threshold file, the tensor-parallel rank, statistics), each
layer's rule (threshold rows, placement, compensation) and the one decode call of
:func:`topth_ops.decode_attention` on a paged cache.

Used by the platform splits (:mod:`topth_ops.vllm.split` and the CPU, CUDA and Ascend
modules on it) and the generic backend (:mod:`topth_ops.vllm.backend`); none of those
imports the generic backend or the other way round.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from vllm.config import get_current_vllm_config

from .. import decode_attention
from ..value_sum import PagedValueSum
from ..contract import DEFAULT_SDC_GAMMA
from ..thresholds import attention_config_of
from . import requests as requests_mod
from . import stats as stats_mod
from .fidelity import Fidelity, buckets
from .model_check import load_sets_for_model, model_name_of
from .settings import VllmTopthSettings, from_sources
from .tp import rank_kv_rows, rank_rows

logger = logging.getLogger("vllm.topth_ops")


@dataclass
class Runtime:
    """Per-process state shared by every layer: settings, the checked threshold file, the
    set table requests choose from, this rank's place in tensor parallelism, statistics.

    The set table has one row per set of the file (file order) and a last row, dense,
    that keeps every position: a request's choice (:mod:`topth_ops.vllm.requests`) is an
    index into it."""

    settings: VllmTopthSettings
    thresholds: Optional[object]  # ThresholdSet: the default set
    tp_rank: int
    tp_size: int
    stats: Optional[stats_mod.ServingStats]
    model_name: Optional[str]
    sets: list = field(default_factory=list)  # every ThresholdSet of the file
    servable: list = field(default_factory=list)
    num_layers: int = 0
    default_set: int = 0
    fidelity: Optional[Fidelity] = None
    calib: Optional[object] = None  # EngineCalibration (mode "calibrate")
    decode_steps: int = 0  # steps with decode rows seen by decode_sets (statistics sampling)
    _step: tuple = (None, True)  # (the step's forward-context metadata, measured) of the last step
    _resolved: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.thresholds is not None and not self.sets:  # a runtime of one set (tests, tools)
            self.sets, self.servable, self.default_set = [self.thresholds], [True], 0
        if not self.num_layers and self.thresholds is not None:
            self.num_layers = self.thresholds.num_layers

    @property
    def dense_index(self) -> int:
        return len(self.sets)

    @property
    def set_labels(self) -> list:
        return [str(i) for i in range(len(self.sets))] + ["dense"]

    def resolve(self, choice) -> int:
        """Set-table row of one request's choice (None: the default). A choice the file
        cannot serve (possible only when the front end could not check it) is served dense
        and warned about once."""
        if choice not in self._resolved:
            try:
                idx = requests_mod.resolve(choice, self.sets, self.default_set, self.servable,
                                           dense_mode=self.thresholds is None)
            except requests_mod.RequestChoiceError as e:
                logger.warning("topth: %s; requests choosing %s are served dense", e, choice.describe())
                idx = self.dense_index
            self._resolved[choice] = idx
        return self._resolved[choice]


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
        sets, ts = load_sets_for_model(settings, hf, name, tp_size)
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
    elif settings.mode == "dense":
        logger.info("topth: dense mode (every row kept; A/B baseline); TP rank %d of %d", tp_rank, tp_size)
    servable = []
    if ts is not None:
        servable = requests_mod.servable_sets(sets, ts.set_index, settings.sdc)
        if settings.mode == "calibrate":
            logger.info("topth: second calibration round: every request is served with set %d (k=%d); requests' "
                        "own choices (extra_args['topth']) are not read", ts.set_index, ts.k)
        else:
            logger.info("topth: requests may choose (extra_args['topth']): %s, or dense; default set %d",
                        ", ".join(f"set {i} (k={s.k})" for i, s in enumerate(sets) if servable[i]), ts.set_index)
    if settings.dense_beyond:
        logger.info("topth: decode rows beyond row id %d are served dense (dense_beyond)", settings.dense_beyond)
    st = None
    if settings.stats_file or settings.log_interval > 0:
        path = stats_mod.rank_path(settings.stats_file, tp_rank) if settings.stats_file else None
        st = stats_mod.install(stats_mod.ServingStats(
            settings.mode, path, settings.log_interval,
            meta={"model": name, "thresholds": settings.thresholds, "vmc": settings.vmc, "sdc": settings.sdc,
                  "placement": ts.placement if ts is not None else None, "tp_rank": tp_rank,
                  "tp_size": tp_size}))
    calib = None
    if settings.mode == "calibrate":
        from .calibration import EngineCalibration

        calib = EngineCalibration(settings, hf, name, tp_rank, tp_size, int(vcfg.model_config.max_model_len),
                                  served=ts)
        calib.start_triggers()
        if st is not None:
            st.sections["calibration"] = calib.report
    return Runtime(settings, ts, tp_rank, tp_size, st, name, sets, servable,
                   int(attention_config_of(hf)["num_layers"]), ts.set_index if ts is not None else 0, calib=calib)


def fidelity(rt: Runtime, device) -> Optional[Fidelity]:
    """The runtime's fidelity sums (created at the first decode step; None with metrics
    off). With prometheus_client present, each flush updates the metrics."""
    if not rt.settings.metrics or not rt.num_layers:
        return None
    if rt.fidelity is None:
        from .metrics import PrometheusExporter

        info = [{"set": lab, "k": (ts.k if i < len(rt.sets) else "dense"),
                 "placement": (ts.placement if i < len(rt.sets) else "dense"),
                 "selection": (ts.selection if i < len(rt.sets) else "dense"),
                 "file": rt.settings.thresholds or ""}
                for i, (lab, ts) in enumerate(zip(rt.set_labels, [*rt.sets, None]))
                if i == len(rt.sets) or rt.servable[i]]
        try:
            exporter = PrometheusExporter(rt.tp_rank, info)
        except ImportError:
            logger.warning("topth: prometheus_client is not installed; fidelity statistics go to the JSON report only")
            exporter = None
        s = rt.settings
        rt.fidelity = Fidelity(rt.num_layers, rt.set_labels, device, s.guard_band, s.guard_window, exporter)
        if rt.stats is not None:
            # the forward flushes every FLUSH_STEPS steps; the statistics thread reads the last
            # flush, and flushes itself only when no decode row came for a second (the end of a burst)
            rt.stats.sections["per_set"] = lambda: rt.fidelity.report(fresh=False)
            rt.stats.idle_hooks.append(_idle_flush(rt.fidelity))
    return rt.fidelity


def _idle_flush(fid: Fidelity):
    """The statistics thread's hook: flush ``fid`` once decoding has stopped; True when it
    did (the JSON report is then rewritten with the new sums)."""
    def hook() -> bool:
        if fid.idle():
            fid.snapshot()
            return True
        return False
    return hook


@dataclass
class DecodeSets:
    """The decode rows' set-table rows of one step (built by the step's first layer that needs
    them, shared through the attention metadata).

    Attributes
    ----------
    threshold_set : torch.Tensor
        ``[num_decodes]`` int32, the op's ``threshold_set``.
    set_idx, bucket : torch.Tensor or None
        ``[num_decodes]`` int64 (statistics; None with metrics off).
    present : frozenset of int
        Set-table rows that may occur this step (host side: decides per layer whether the
        op runs at all).
    measured : bool
        The step's statistics are recorded (one step in ``metrics_every``); False: the op
        runs without statistics and :func:`record` only counts prefill tokens.
    """

    threshold_set: torch.Tensor
    set_idx: Optional[torch.Tensor]
    bucket: Optional[torch.Tensor]
    present: frozenset
    measured: bool = True


def decode_sets(rt: Runtime, num_decodes: int, seq_lens: torch.Tensor) -> DecodeSets:
    """Each decode row's set-table row: the request's choice, then ``dense_beyond``
    (rows longer than it read every position). ``seq_lens`` ``[num_decodes]`` on the
    device; no host sync. Called by the step's first layer that needs it in each KV-cache
    group (shared through the group's metadata; hybrid models such as Gemma 3 have several
    groups per step): the first call of a step decides whether the step is measured (one
    in ``metrics_every``) and counts an unmeasured step's rows on the host; the other
    groups of that step (same forward context) follow it."""
    idx = [rt.resolve(c) for c in requests_mod.row_choices(num_decodes)]
    present = set(idx)
    ts = torch.tensor(idx, dtype=torch.int32).to(seq_lens.device, non_blocking=True)
    if rt.settings.dense_beyond:
        ts = torch.where(seq_lens > rt.settings.dense_beyond, torch.full_like(ts, rt.dense_index), ts)
        present.add(rt.dense_index)
    s = rt.settings
    measured = True
    key = _forward_key()
    if key is not None and key is rt._step[0]:
        measured = rt._step[1]  # another KV-cache group of the same step (hybrid models): decided already
    elif rt.stats is not None or s.metrics:
        measured = rt.decode_steps % s.metrics_every == 0
        rt.decode_steps += 1
        rt._step = (key, measured)
        if not measured:
            if rt.stats is not None:
                rt.stats.skip_step(num_decodes)
            fid = fidelity(rt, seq_lens.device)
            if fid is not None:
                fid.skip_step(ts)
    metrics = s.metrics and measured
    return DecodeSets(ts, ts.to(torch.int64) if metrics else None, buckets(seq_lens) if metrics else None,
                      frozenset(present), measured)


def _forward_key():
    """The current forward pass's attention-metadata object (one per step, shared by every
    KV-cache group), or None outside a forward (tests, tools). With vLLM's dual-batch
    overlap (CUDA) each micro-batch's forward counts as a step (not run here)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context().attn_metadata if is_forward_context_available() else None


@dataclass
class LayerRule:
    """How one attention layer's decode rows are served on this rank.

    Attributes
    ----------
    thresholded : bool
        Some set of the table thresholds this layer (False in dense mode, for layers every
        set keeps dense, and for layers vLLM's own attention serves).
    thresholds : torch.Tensor
        ``[num_sets + 1, H, max_row_id]`` float32, H = this rank's query heads (selection
        "head") or KV heads ("group"): one row per set of the file, -inf rows for sets
        that keep the layer dense or cannot be served, and a last row of -inf (dense).
    active : tuple of bool
        Per set-table row: that set thresholds this layer.
    set_k : torch.Tensor
        ``[num_sets + 1]`` float32 target k of the layer per set-table row (0: dense).
    placement, sdc, selection : str
    sdc_table : torch.Tensor or None
        ``[num_sets + 1, num_heads, max_row_id]`` (sdc "offline"; zeros in dense rows).
    vmc : bool
    """

    thresholded: bool
    thresholds: torch.Tensor
    active: tuple = ()
    set_k: Optional[torch.Tensor] = None
    placement: str = "post_softmax"
    sdc: str = "none"
    selection: str = "head"
    sdc_table: Optional[torch.Tensor] = None
    vmc: bool = False

    def serves(self, present: frozenset) -> bool:
        """Whether a step whose rows use the set-table rows ``present`` needs the op."""
        return self.thresholded and any(self.active[i] for i in present)


def _rank_table(rt: Runtime, table: torch.Tensor, layer: int, num_heads: int, num_kv_heads: int,
                selection: str) -> torch.Tensor:
    if selection == "group":
        # one threshold per KV head (this rank's KV heads), against the group maximum
        th = rank_kv_rows(table, layer, rt.tp_rank, rt.tp_size)
        if th.shape[0] != num_kv_heads:
            raise ValueError(f"topth vLLM backend: rank {rt.tp_rank} holds {num_kv_heads} KV heads, "
                             f"but the group-selection file gives it {th.shape[0]} threshold rows")
        return th
    return rank_rows(table, layer, rt.tp_rank, num_heads)


def layer_rule(rt: Runtime, layer: int, num_heads: int, num_kv_heads: int, device) -> LayerRule:
    """The rule of model layer ``layer`` for this rank's ``num_heads`` query and
    ``num_kv_heads`` KV heads.

    Raises
    ------
    ValueError
        A group-selection file whose KV-head rows do not match this rank's KV heads.
    """
    s, ts = rt.settings, rt.thresholds
    nsets = len(rt.sets)
    active = tuple(rt.servable[i] and rt.sets[i].layer_k[layer] != 0 for i in range(nsets)) + (False,)
    if ts is None or not any(active):
        return LayerRule(False, torch.full((nsets + 1, num_heads, 1), float("-inf"), device=device), active,
                         torch.zeros(nsets + 1, device=device))
    H = num_kv_heads if ts.selection == "group" else num_heads
    R = max(x.max_row_id for x in rt.sets)
    th = torch.full((nsets + 1, H, R), float("-inf"))
    sdc_table = torch.zeros((nsets + 1, num_heads, R)) if s.sdc == "offline" else None
    for i, x in enumerate(rt.sets):
        if not active[i]:
            continue
        t = _rank_table(rt, x.thresholds, layer, num_heads, num_kv_heads, ts.selection)
        th[i, :, :t.shape[-1]] = t
        th[i, :, t.shape[-1]:] = t[:, -1:]  # the op reads the last column beyond a table anyway
        if sdc_table is not None:
            d = rank_rows(x.sdc_table, layer, rt.tp_rank, num_heads)
            sdc_table[i, :, :d.shape[-1]] = d
            sdc_table[i, :, d.shape[-1]:] = d[:, -1:]
    set_k = torch.tensor([float(x.layer_k[layer]) if active[i] else 0.0 for i, x in enumerate(rt.sets)] + [0.0])
    return LayerRule(True, th.to(device), active, set_k.to(device), ts.placement, s.sdc, ts.selection,
                     None if sdc_table is None else sdc_table.to(device), s.vmc)


def decode_rows(rt: Runtime, rule: LayerRule, query: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                kv_layout: str, sets: DecodeSets, value_mean: Optional[torch.Tensor] = None):
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
    sets : DecodeSets
        Each row's set-table row.
    value_mean : torch.Tensor, optional
        ``[num_decodes, num_kv_heads, head_dim]`` (VMC).

    Returns
    -------
    out : torch.Tensor
        ``[num_decodes, num_heads, head_dim]``.
    stats : DecodeStats or None
        The op's statistics, when statistics or metrics are collected.
    """
    s = rt.settings
    want_stats = (rt.stats is not None or s.metrics) and sets.measured
    res = decode_attention(
        query, key_cache, value_cache, seq_lens, rule.thresholds, scale=scale,
        placement=rule.placement, sdc=rule.sdc,
        sdc_gamma=s.sdc_gamma if rule.sdc == "exp_threshold" else DEFAULT_SDC_GAMMA,
        sdc_table=rule.sdc_table, vmc=rule.vmc, value_mean=value_mean, return_stats=want_stats,
        backend=s.op_backend, block_table=block_table, kv_layout=kv_layout, selection=rule.selection,
        threshold_set=sets.threshold_set,
    )
    return res if want_stats else (res, None)


def record(rt: Runtime, layer: int, rule: LayerRule, sets: Optional[DecodeSets], seq_lens: torch.Tensor,
           num_kv_heads: int, op_stats=None, prefill_tokens: int = 0) -> None:
    """Statistics of one layer's forward: V rows (the JSON report) and the fidelity sums.
    ``seq_lens`` ``[num_decodes]`` are the rows dense attention reads (clamped to a
    sliding window); ``op_stats`` the op's statistics when it ran (else dense)."""
    st = rt.stats
    if sets is not None and not sets.measured:  # counted by decode_sets; prefill tokens only
        if st is not None and prefill_tokens:
            st.add(layer, None, None, prefill_tokens)
        return
    B = seq_lens.shape[0]
    v_rows = op_stats.v_rows if op_stats is not None else None
    if st is not None:
        rows = v_rows if v_rows is not None or not B else seq_lens[:, None].expand(B, num_kv_heads)
        st.add(layer, rows, seq_lens, prefill_tokens)
    fid = fidelity(rt, seq_lens.device) if sets is not None and sets.set_idx is not None else None
    if fid is not None:
        if op_stats is None:
            fid.add(layer, sets.set_idx, sets.bucket, seq_lens, num_kv_heads)
        else:
            fid.add(layer, sets.set_idx, sets.bucket, seq_lens, num_kv_heads, v_rows, op_stats.kept,
                    op_stats.dropped_mass, rule.set_k)


def value_sums(current: Optional[PagedValueSum], value_cache: torch.Tensor, num_kv_heads: int, head_size: int,
               kv_layout: str) -> PagedValueSum:
    """VMC's per-block V sums for a paged ``value_cache`` (``[num_blocks, block_size, H, D]``
    NHD or ``[num_blocks, H, block_size, D]`` otherwise): ``current`` when it still fits the
    cache, else a new, zeroed one (the first step, or a cache re-allocated by the engine)."""
    nb = value_cache.shape[0]
    bs = value_cache.shape[1] if kv_layout == "NHD" else value_cache.shape[2]
    if (current is None or current.num_blocks != nb or current.block_size != bs
            or current.sum.device != value_cache.device):
        current = PagedValueSum(nb, bs, num_kv_heads, head_size, kv_layout=kv_layout, device=value_cache.device)
    return current
