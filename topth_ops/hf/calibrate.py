"""Calibrate Top-Theta thresholds of a transformers model on real text (paper section 3.1).

One forward pass per calibration sample records, for every target k, placement and
selection mode at once, the bounded-memory statistics of the estimator: kept-count
histograms (:class:`topth_ops.calibration.count.CountAccumulator`, the default) or algorithm 1's
per-row-id means (:class:`topth_ops.calibration.ThresholdAccumulator`), through the "topth" attention function's score hook (the chunked prefill path, so no
attention matrix is ever stored). With top-k at calibration (TAC) the activations depend
on k, so each target gets its own pass. The offline SDC table is a second pass at the
final thresholds (:class:`topth_ops.calibration.SdcAccumulator`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..calibration import CalibrationResult, CountAccumulator, SdcAccumulator, ThresholdAccumulator
from ..contract import SELECTIONS
from ..thresholds import (DENSE, MAX_ROW_IDS, ThresholdSet, attention_config_of, base_k, default_extend_to,
                          format_layer_k)
from .attention import TopthSettings, disable, enable, model_display_name


@dataclass
class CalibrationText:
    """Token samples and a description of their source."""

    samples: list  # of 1-D int64 tensors
    description: str

    @property
    def tokens(self) -> int:
        return int(sum(s.numel() for s in self.samples))


def run_calibration_pass(model, samples, settings: TopthSettings, hook, desc: str, progress: bool) -> None:
    """One forward pass per sample with the "topth" attention and a score hook.

    Enables ``settings`` on ``model`` with ``score_hook=hook`` (which sends every layer
    through the chunked reference path), runs each sample without a KV cache under
    ``torch.inference_mode``, and restores the previous attention implementation
    afterwards, also on error. :func:`calibrate` records its statistics this way.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A model :func:`topth_ops.hf.attention.enable` supports.
    samples : sequence of torch.Tensor
        1-D int64 token ids, one forward pass (batch 1) each; moved to the model's device.
    settings : TopthSettings
        The attention to run, e.g. ``TopthSettings(mode="dense")`` to record dense scores.
    hook : callable
        ``hook(layer, scores, row_ids, m, log_z)`` for every chunk of rows of every layer:
        logits ``[1, num_q_heads, C, S_c]`` (-inf at invalid keys), row ids ``[1, C]``,
        row max and log-sum-exp ``[1, num_q_heads, C, 1]``.
    desc : str
        Label of the progress bar.
    progress : bool
        Show a tqdm progress bar.

    Raises
    ------
    ValueError, ThresholdFileError
        From :func:`topth_ops.hf.attention.enable` when ``settings`` do not fit the model.
    """
    from tqdm.auto import tqdm

    enable(model, settings, score_hook=hook)
    try:
        dev = next(model.parameters()).device
        with torch.inference_mode():
            for ids in tqdm(samples, desc=desc, unit="sample", disable=not progress):
                model(input_ids=ids.view(1, -1).to(dev), use_cache=False)
    finally:
        disable(model)


ESTIMATORS = ("count", "mean")


def _layerwise_rule(placement: str, sdc_table: bool, vmc: bool) -> dict:
    """The compensation a layer-wise pass propagates with (and its file records)."""
    return dict(sdc="offline" if (sdc_table and placement == "pre_softmax") else "none", vmc=bool(vmc))


def _calibrate_layerwise(model, text, targets, placements, selections, extend_to, shape, *, sdc, vmc, progress,
                         pairs=None, propagate=None) -> dict:
    from tqdm.auto import tqdm

    from .calib_layerwise import LayerwiseCalibrator, run_layerwise

    L, Hq, Hkv = shape
    lengths = [int(s.numel()) for s in text.samples]
    jobs = [(i, p, s) for i in range(len(targets)) for p in placements for s in selections
            if pairs is None or (p, s) in pairs]
    out = {}
    for i, p, s in tqdm(jobs, desc="calibrate layer-wise", unit="pass", disable=not progress):
        rule = _layerwise_rule(p, sdc, vmc)
        cal = LayerwiseCalibrator(L, Hq, Hkv, lengths, list(targets[i]), p, s, extend_to,
                                  sdc=rule["sdc"] == "offline", vmc=rule["vmc"], propagate=propagate)
        run_layerwise(model, text.samples, cal, TopthSettings(mode="dense"))
        out[(i, p, s)] = cal.result()
    return out


def _check_second_round(ts: ThresholdSet, targets, placements, selections, *, estimator: str, other: bool,
                        sdc_table: bool) -> None:
    if other or estimator != "count":
        raise ValueError("a second round (second_round) needs the kept-count estimator and replaces layer-wise "
                         "calibration and top-k at calibration (give one of them)")
    want = ([list(ts.layer_k)], [ts.placement], [ts.selection])
    got = ([list(t) for t in targets], list(placements), list(selections))
    if got != want:
        raise ValueError(f"a second round calibrates its set's own target: layer-k map {format_layer_k(ts.layer_k)}, "
                         f"{ts.placement}, {ts.selection} selection; got layer-k maps "
                         f"{[format_layer_k(t) for t in got[0]]}, placements {got[1]}, selections {got[2]}")
    if sdc_table and ts.placement == "pre_softmax":
        raise ValueError("a second round records no offline SDC table: pass sdc_table=False (--no-sdc-table)")


def calibrate(model, text: CalibrationText, targets: Sequence[list], placements: Sequence[str],
              *, alpha: float = 0.0, topk_at_calibration: bool = False, tac_vmc: bool = False,
              sdc_table: bool = True, model_name: Optional[str] = None, progress: bool = True,
              estimator: str = "count", selections: Sequence[str] = ("head",),
              extend_to: Optional[int] = None, layerwise: bool = False,
              layerwise_vmc: bool = True, pairs: Optional[set] = None,
              second_round: Optional[ThresholdSet] = None) -> dict[tuple[int, str, str], ThresholdSet]:
    """Calibrate thresholds for several layer-k maps, placements and selection modes.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    text : CalibrationText
        Samples (token id tensors); each sample is one forward pass.
    targets : sequence of list of int
        Layer-k maps (see :func:`topth_ops.thresholds.parse_layer_k`); with group
        selection, k is the number of V rows a GQA group keeps.
    placements : sequence of str
        "pre_softmax" and/or "post_softmax".
    alpha : float
        theta = mean + alpha * std (estimator "mean" only; must be 0 with "count").
    topk_at_calibration : bool
        Keep each row's exact top-k during calibration so later layers see sparsified
        activations (one pass per target). The kept weights follow the placement;
        ``tac_vmc`` adds V-mean compensation.
    sdc_table : bool
        Also compute the offline SDC table for pre_softmax (a second pass).
    model_name : str, optional
        Recorded in the files; default :func:`topth_ops.hf.attention.model_display_name`.
    progress : bool
        Show tqdm progress bars.
    estimator : {"count", "mean"}
        "count" (default): theta whose mean kept count is k per row-length bucket, with
        the length model beyond (:mod:`topth_ops.calibration.count`); "mean": the
        paper's algorithm 1 (per-row-id mean + alpha * std), no length model.
    selections : sequence of {"head", "group"}
        "head": one threshold per query head; "group": one per KV head, calibrated on the
        group maximum (estimator "count" only).
    extend_to : int, optional
        Estimator "count": table length in row ids (default: 8 x the longest sample,
        capped at the model's context and at MAX_ROW_IDS, at least the longest sample);
        given: from the longest sample to :data:`~topth_ops.thresholds.format.MAX_ROW_IDS`
        (ValueError otherwise).
    layerwise : bool
        Calibrate each layer on the activations of the layers below it, thresholded with
        their new thresholds (:mod:`topth_ops.hf.calib_layerwise`): one batched pass per
        (target, placement, selection); estimator "count" only. The offline SDC table
        (pre_softmax, ``sdc_table``) is computed in the same pass and applied while
        propagating.
    layerwise_vmc : bool
        With ``layerwise``: apply V-mean compensation while propagating (as the VMC
        variants do at inference).
    pairs : set of (placement, selection), optional
        With ``layerwise``: calibrate only these pairs (each is its own pass); default all.
        Each must be in ``placements`` x ``selections`` (the one-pass calibration records
        every pair anyway).
    second_round : ThresholdSet, optional
        Calibrate again on the activations this earlier set gives: every thresholded
        layer runs the set's thresholds (with VMC per ``layerwise_vmc``) while the pass
        records every layer's dense scores, so a one-pass pre_softmax file, whose layers
        keep above k once the layers below are thresholded, is re-fitted to them. One
        target, the set's own layer-k map, placement and selection; estimator "count";
        no offline SDC table. The reference of the vLLM engine's second round (mode
        ``calibrate`` with a served file, docs/vllm.md); offline, ``layerwise`` fits the
        layers below exactly instead.

    Returns
    -------
    dict
        ``{(target index, placement, selection): ThresholdSet}``.

    Raises
    ------
    ValueError
        No samples, a target with a k that is not an integer >= 1 (or DENSE), ``pairs``
        empty or naming a pair outside placements x selections, no calibration row
        longer than some layer's k, a non-finite alpha, alpha != 0 with "count", group
        selection with "mean", ``layerwise`` with "mean" or with top-k at calibration, a
        negative alpha that makes post_softmax thresholds negative, or ``second_round``
        with another target, placement or selection than its set's, with ``layerwise``,
        top-k at calibration, the "mean" estimator or the offline SDC table.
    """
    if not text.samples:
        raise ValueError("calibration needs at least one text sample (the calibration text is empty)")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    for sel in selections:
        if sel not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {sel!r}")
    if estimator == "mean" and list(selections) != ["head"]:
        raise ValueError("group selection needs the kept-count estimator (estimator='count')")
    if pairs is not None:
        allowed = [(p, sel) for p in placements for sel in selections]
        bad = [pair for pair in pairs if tuple(pair) not in allowed]
        if bad or not pairs:
            raise ValueError(f"pairs must be a non-empty set of (placement, selection) from {allowed}, got "
                             f"{sorted(map(tuple, pairs), key=repr)}")
    if layerwise and (estimator != "count" or topk_at_calibration):
        raise ValueError("layer-wise calibration needs the kept-count estimator (estimator='count') and "
                         "replaces top-k at calibration (give one of them)")
    if estimator == "count" and alpha != 0:
        raise ValueError(f"alpha (--alpha {alpha}) applies to the 'mean' estimator (algorithm 1); the "
                         "'count' estimator targets the mean kept count directly")
    cfg = model.config
    if second_round is not None:
        _check_second_round(second_round, targets, placements, selections, estimator=estimator,
                            other=layerwise or topk_at_calibration, sdc_table=sdc_table)
        second_round.check_model(cfg, model_name, compare_name=model_name is not None)
    L, Hq = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    Hkv = int(getattr(cfg, "num_key_value_heads", None) or Hq)
    for t in targets:
        if len(t) != L:
            raise ValueError(f"layer-k map must have {L} entries, got {len(t)}")
        for k in t:
            if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
                raise ValueError(f"layer-k map values must be integers >= 1 or {DENSE} (dense), got {k!r} in {list(t)}")
        if all(k == DENSE for k in t):
            raise ValueError("every layer is dense in a layer-k map: nothing to calibrate")
    max_len = max(int(s.numel()) for s in text.samples)
    longer = "longer calibration samples (calibrate --max-tokens, evaluate --calib-max-tokens)"
    for t in targets:  # checked here, before the forward passes
        base = base_k(t)  # the target's k; other values are --layer-k overrides
        for layer, k in enumerate(t):
            if k != DENSE and k >= max_len:
                fix = (f"a smaller k or {longer}" if k == base else
                       f"{longer}, or another --layer-k for layer {layer} (e.g. {layer}:dense; the "
                       f"default --layer-k keeps layers 0 and 1 at k=256)")
                raise ValueError(
                    f"layer {layer} has k={k}, but the longest calibration sample has {max_len} "
                    f"tokens, so no row is longer than k: use {fix}")
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha!r}")
    context = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    if extend_to is None:
        extend_to = default_extend_to(max_len, context)
    elif isinstance(extend_to, bool) or not isinstance(extend_to, numbers.Integral) or \
            not max_len <= extend_to <= MAX_ROW_IDS:
        raise ValueError(f"extend_to must be an integer from the longest calibration sample ({max_len} tokens) "
                         f"to {MAX_ROW_IDS}, got {extend_to!r}")
    results: dict[tuple[int, str, str], CalibrationResult] = {}
    batched = layerwise or second_round is not None  # one layer-wise pass per target (calib_layerwise)
    if batched:
        results = _calibrate_layerwise(model, text, targets, placements, selections, extend_to, (L, Hq, Hkv),
                                       sdc=sdc_table, vmc=layerwise_vmc, progress=progress, pairs=pairs,
                                       propagate=None if second_round is None else second_round.thresholds)
    passes = [] if batched else [(list(range(len(targets))))] if not topk_at_calibration else [[i] for i in range(len(targets))]
    for idx in passes:
        if estimator == "count":
            ks = sorted({k for i in idx for k in targets[i] if k != DENSE})
            acc = CountAccumulator(L, Hq, Hkv, max_len, ks, placements, selections)
        else:
            acc = ThresholdAccumulator(L, Hq, max_len, [targets[i] for i in idx], placements)
        if topk_at_calibration:
            t = targets[idx[0]]
            settings = TopthSettings(mode="topk", layer_k=list(t), placement=placements[0], vmc=tac_vmc)
            desc = f"calibrate k={max(t)} (top-k at calibration)"
        else:
            settings = TopthSettings(mode="dense")
            desc = "calibrate (all k, " + "/".join(placements) + ")"

        def hook(layer, a, n, m, log_z, acc=acc):
            acc.record(layer, a, n, m, log_z)

        run_calibration_pass(model, text.samples, settings, hook, desc, progress)
        for j, i in enumerate(idx):
            if estimator == "count":
                results.update({(i, p, sel): r for (_, p, sel), r in acc.results([targets[i]], extend_to).items()})
                continue
            for p in placements:
                results[(i, p, "head")] = acc.result(j, p, alpha)

    if sdc_table and "pre_softmax" in placements and not batched:
        pre = [key for key in results if key[1] == "pre_softmax"]
        groups = [[key for key in pre if key[0] == i] for i in range(len(targets))] if topk_at_calibration else [pre]
        for grp in groups:
            if not grp:
                continue
            sdc = SdcAccumulator([results[key] for key in grp], num_q_heads=Hq)
            if topk_at_calibration:
                settings = TopthSettings(mode="topk", layer_k=list(results[grp[0]].layer_k),
                                         placement="pre_softmax", vmc=tac_vmc)
            else:
                settings = TopthSettings(mode="dense")

            def hook(layer, a, n, m, log_z, sdc=sdc):
                sdc.record(layer, a, n)

            run_calibration_pass(model, text.samples, settings, hook, "offline SDC table", progress)
            sdc.finalize()

    out = {}
    for key, r in results.items():
        out[key] = ThresholdSet(
            thresholds=r.thresholds, counts=r.counts, layer_k=r.layer_k, placement=key[1],
            model_name=model_name or model_display_name(model), attention_config=attention_config_of(cfg),
            alpha=r.alpha, sdc_table=r.sdc_table,
            calibration_text=text.description + (f"; second round of {second_round.name()}"
                                                 if second_round is not None else ""),
            calibration_samples=len(text.samples), calibration_tokens=text.tokens,
            topk_at_calibration=topk_at_calibration, layerwise=layerwise, selection=r.selection,
            layerwise_rule=_layerwise_rule(key[1], sdc_table, layerwise_vmc) if batched else None,
            estimator=r.estimator,
            length_model=r.length_model, sdc_length_model=r.sdc_length_model,
        )
    return out
