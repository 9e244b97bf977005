"""Calibrate Top-Theta thresholds of a transformers model on real text (algorithm 1).

One forward pass per calibration sample records, for every target k and placement at
once, the per-row samples of :class:`topth_ops.calibration.ThresholdAccumulator`
through the "topth" attention function's score hook (the chunked prefill path, so no
attention matrix is ever stored). With top-k at calibration (TAC) the activations depend
on k, so each target gets its own pass. The offline SDC table is a second pass at the
final thresholds (:class:`topth_ops.calibration.SdcAccumulator`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..calibration import DENSE, CalibrationResult, SdcAccumulator, ThresholdAccumulator, base_k
from ..threshold_file import ThresholdSet, attention_config_of
from .attention import TopthSettings, disable, enable, model_display_name


@dataclass
class CalibrationText:
    """Token samples and a description of their source."""

    samples: list  # of 1-D int64 tensors
    description: str

    @property
    def tokens(self) -> int:
        return int(sum(s.numel() for s in self.samples))


def _run(model, samples, settings: TopthSettings, hook, desc: str, progress: bool) -> None:
    from tqdm.auto import tqdm

    enable(model, settings, score_hook=hook)
    try:
        dev = next(model.parameters()).device
        with torch.inference_mode():
            for ids in tqdm(samples, desc=desc, unit="sample", disable=not progress):
                model(input_ids=ids.view(1, -1).to(dev), use_cache=False)
    finally:
        disable(model)


def calibrate(model, text: CalibrationText, targets: Sequence[list], placements: Sequence[str],
              *, alpha: float = 0.0, topk_at_calibration: bool = False, tac_vmc: bool = False,
              sdc_table: bool = True, model_name: Optional[str] = None, progress: bool = True
              ) -> dict[tuple[int, str], ThresholdSet]:
    """Calibrate thresholds for several layer-k maps and placements.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    text : CalibrationText
        Samples (token id tensors); each sample is one forward pass.
    targets : sequence of list of int
        Layer-k maps (see :func:`topth_ops.calibration.parse_layer_k`).
    placements : sequence of str
        "pre_softmax" and/or "post_softmax".
    alpha : float
        theta = mean + alpha * std.
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

    Returns
    -------
    dict
        ``{(target index, placement): ThresholdSet}``.

    Raises
    ------
    ValueError
        No samples, a target with k < 1 in a thresholded layer, no calibration row
        longer than some layer's k, a non-finite alpha, or a negative alpha that makes
        post_softmax thresholds negative.
    """
    if not text.samples:
        raise ValueError("calibration needs at least one text sample (the calibration text is empty)")
    cfg = model.config
    L, Hq = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    for t in targets:
        if len(t) != L:
            raise ValueError(f"layer-k map must have {L} entries, got {len(t)}")
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
    results: dict[tuple[int, str], CalibrationResult] = {}
    passes = [(list(range(len(targets))))] if not topk_at_calibration else [[i] for i in range(len(targets))]
    for idx in passes:
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

        _run(model, text.samples, settings, hook, desc, progress)
        for j, i in enumerate(idx):
            for p in placements:
                results[(i, p)] = acc.result(j, p, alpha)

    if sdc_table and "pre_softmax" in placements:
        pre = [results[(i, "pre_softmax")] for i in range(len(targets))]
        if topk_at_calibration:
            groups = [[r] for r in pre]
        else:
            groups = [pre]
        for grp in groups:
            sdc = SdcAccumulator(grp)
            if topk_at_calibration:
                settings = TopthSettings(mode="topk", layer_k=list(grp[0].layer_k), placement="pre_softmax",
                                         vmc=tac_vmc)
            else:
                settings = TopthSettings(mode="dense")

            def hook(layer, a, n, m, log_z, sdc=sdc):
                sdc.record(layer, a, n)

            _run(model, text.samples, settings, hook, "offline SDC table", progress)
            sdc.finalize()

    out = {}
    for (i, p), r in results.items():
        out[(i, p)] = ThresholdSet(
            thresholds=r.thresholds, counts=r.counts, layer_k=r.layer_k, placement=p,
            model_name=model_name or model_display_name(model), attention_config=attention_config_of(cfg), alpha=r.alpha,
            sdc_table=r.sdc_table, calibration_text=text.description,
            calibration_samples=len(text.samples), calibration_tokens=text.tokens,
            topk_at_calibration=topk_at_calibration,
        )
    return out
