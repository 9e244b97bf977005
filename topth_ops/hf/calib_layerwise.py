"""Layer-wise calibration: each layer's thresholds on the activations of the sparsified layers below.

The one-pass calibration (:mod:`topth_ops.hf.calibrate`) records every layer on dense
activations. At inference the layers below a layer are thresholded, so its queries and keys
move; a threshold on raw logits (pre_softmax) does not follow that move, and the kept count
drifts away from k in the upper layers (docs/model.md, "Notes and limits"). Layer-wise
calibration removes the mismatch: all calibration samples run as one batch, and when the
forward reaches layer l (layers 0..l-1 already thresholded with their new thresholds and the
inference compensation), layer l

1. records the kept-count histograms of its dense scores (:class:`~topth_ops.calibration.count.
   CountAccumulator`, the same estimator and length model as the one-pass calibration),
2. solves its thresholds from them (and, pre_softmax with the offline SDC, records the
   dropped exponent mass at those thresholds: :class:`~topth_ops.calibration.sdc.SdcAccumulator`),
3. returns the thresholded attention (the inference rule: VMC, offline SDC) to the layers
   above.

One batched pass suffices, instead of one pass per layer, because a layer's statistics are
complete when every sample has reached it. The activations depend on k, placement and
selection, so each (target, placement, selection) is its own pass (as with top-k at
calibration, one pass per target).

A second round (``propagate``) runs the same pass with the thresholds of an earlier file in
step 3 instead of the ones just solved: the layers below are thresholded as that file
thresholds them. It is the reference of the vLLM engine's second round (mode ``calibrate``
with a served file: docs/vllm.md), which cannot solve a layer before the layers above it
run.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ..calibration import CalibrationResult, CountAccumulator, SdcAccumulator
from ..prefill import MAX_CHUNK_ELEMS, RowRule, prefill_attention
from ..thresholds import DENSE


class LayerwiseCalibrator:
    """Calibrates one target layer by layer inside one batched forward pass.

    Parameters
    ----------
    num_layers, num_q_heads, num_kv_heads : int
    lengths : sequence of int
        Token count of each sample of the batch (shorter samples are right-padded; their
        padding rows get row id 0 and are not recorded).
    layer_k : list of int
        The target's k per layer (:data:`~topth_ops.thresholds.DENSE` = dense layer).
    placement : {"pre_softmax", "post_softmax"}
    selection : {"head", "group"}
    extend_to : int
        Threshold table length in row ids (the length model continues beyond the samples).
    sdc : bool
        pre_softmax: compute the offline SDC table and apply it while propagating.
    vmc : bool
        Apply V-mean compensation while propagating (as the inference variant will).
    max_chunk_elems : int
        Score chunk bound of :func:`topth_ops.prefill.prefill_attention`.
    propagate : torch.Tensor, optional
        float32 ``[num_layers, H, R]`` (H as the selection; R >= 1 row ids, the last column
        serving longer rows): a second round: every thresholded layer returns its attention
        under these thresholds (an earlier file's) instead of the ones solved in this pass.

    Raises
    ------
    ValueError
        ``layer_k`` without one entry per layer, ``sdc`` with post_softmax or with
        ``propagate``, or ``propagate`` of another shape.

    Notes
    -----
    Row ids follow :func:`topth_ops.hf.cache_view.rows_from_mask` (sliding-window layers:
    the number of keys in the window), so they match inference.
    """

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, lengths: Sequence[int],
                 layer_k: list, placement: str, selection: str, extend_to: int, *, sdc: bool, vmc: bool,
                 max_chunk_elems: int = MAX_CHUNK_ELEMS, propagate: Optional[torch.Tensor] = None):
        if len(layer_k) != num_layers:
            raise ValueError(f"layer_k must have {num_layers} entries, got {len(layer_k)}")
        if sdc and placement != "pre_softmax":
            raise ValueError("the offline SDC table applies to pre_softmax thresholds only")
        H = num_q_heads if selection == "head" else num_kv_heads
        if propagate is not None:
            if sdc:
                raise ValueError("a second round (propagate) records no offline SDC table")
            if propagate.dim() != 3 or tuple(propagate.shape[:2]) != (num_layers, H):
                raise ValueError(f"propagate must be [num_layers={num_layers}, H={H}, R] thresholds ({selection} "
                                 f"selection), got {tuple(propagate.shape)}")
        self.propagate = propagate
        self.L, self.Hq = num_layers, num_q_heads
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
        self.max_len = int(self.lengths.max())
        self.layer_k = list(layer_k)
        self.placement, self.selection = placement, selection
        self.extend_to = int(extend_to)
        self.sdc, self.vmc = bool(sdc), bool(vmc)
        self.max_chunk_elems = max_chunk_elems
        ks = sorted({k for k in layer_k if k != DENSE})
        self.acc = CountAccumulator(num_layers, num_q_heads, num_kv_heads, self.max_len, ks, [placement],
                                    [selection])
        self._thresholds = torch.full((num_layers, H, self.extend_to), float("-inf"))
        self._sdc_acc: Optional[SdcAccumulator] = None
        if self.sdc:
            shell = CalibrationResult(thresholds=self._thresholds, counts=torch.zeros(
                (num_layers, H, self.max_len), dtype=torch.int64), layer_k=self.layer_k,
                placement=placement, alpha=None, selection=selection, estimator="count")
            self._sdc_acc = SdcAccumulator([shell], num_q_heads=num_q_heads)
        self.applied: dict[int, dict] = {}  # layer -> the tables it ran with (for tests)

    # ---------------------------------------------------------------- per layer

    def _only(self, layer: int) -> list:
        return [k if i == layer else DENSE for i, k in enumerate(self.layer_k)]

    def _layer_thresholds(self, layer: int) -> torch.Tensor:
        th, _, _ = self.acc.result(self.placement, self.selection, self._only(layer), extend_to=self.extend_to)
        row = torch.from_numpy(th[layer].astype("float32"))
        self._thresholds[layer] = row
        return row

    def _layer_sdc(self, layer: int) -> torch.Tensor:
        """The offline SDC row of this layer, computed as :meth:`SdcAccumulator.finalize`
        will compute it for the whole table (every layer is independent there)."""
        src = self._sdc_acc
        shell = CalibrationResult(thresholds=self._thresholds, counts=src.results[0].counts,
                                  layer_k=self._only(layer), placement=self.placement, alpha=None,
                                  selection=self.selection, estimator="count")
        one = SdcAccumulator([shell], num_q_heads=self.Hq)
        one.sums[0][layer] = src.sums[0][layer]
        one.counts[0][layer] = src.counts[0][layer]
        return one.finalize()[0].sdc_table[layer].clone()

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                row_ids: torch.Tensor, key_valid: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """One layer of the calibration pass; returns ``[B, T, num_q_heads, head_dim]``.

        Parameters
        ----------
        query, key, value : torch.Tensor
            BNSD, as :func:`topth_ops.prefill.prefill_attention` takes them.
        row_ids, key_valid : torch.Tensor
            From the attention mask (:func:`topth_ops.hf.cache_view.rows_from_mask`).

        Raises
        ------
        ValueError
            A batch that is not the calibration samples (other batch size, or a query
            longer than the longest sample).
        """
        B, _, T, _ = query.shape
        if B != self.lengths.numel() or T > self.max_len:
            raise ValueError(f"layer-wise calibration expects its {self.lengths.numel()} samples of <= "
                             f"{self.max_len} tokens as one batch, got [B={B}, T={T}]")
        pos = torch.arange(T, device=row_ids.device).view(1, T)
        row_ids = torch.where(pos < self.lengths.to(row_ids.device).view(B, 1), row_ids, 0)
        if key_valid is not None:
            key_valid = key_valid & (row_ids > 0).unsqueeze(-1)
        k = self.layer_k[layer]
        run = functools.partial(prefill_attention, query, key, value, row_ids, scale=scale, key_valid=key_valid,
                                max_chunk_elems=self.max_chunk_elems)
        if k == DENSE:
            return run(RowRule("dense"))[0].transpose(1, 2)
        acc = self.acc
        run(RowRule("dense"), score_hook=lambda a, n, m, lz: acc.record(layer, a, n, m, lz))
        th = self._layer_thresholds(layer)
        if self.propagate is not None:
            th = self.propagate[layer].float()
        sdc_row = None
        if self.sdc:
            run(RowRule("dense"), score_hook=lambda a, n, m, lz: self._sdc_acc.record(layer, a, n))
            sdc_row = self._layer_sdc(layer)
        rule = RowRule("table", placement=self.placement, sdc="offline" if self.sdc else "none",
                       thresholds=th.to(query.device), vmc=self.vmc, selection=self.selection,
                       sdc_table=None if sdc_row is None else sdc_row.to(query.device))
        self.applied[layer] = dict(thresholds=th, sdc_table=sdc_row)
        return run(rule)[0].transpose(1, 2)

    # ---------------------------------------------------------------- result

    def result(self) -> CalibrationResult:
        """The whole target after the pass: thresholds, counts and length model from the
        same histograms the layers used; the offline SDC table when ``sdc``.

        Raises
        ------
        ValueError
            A thresholded layer has no calibration row longer than its k.
        """
        th, counts, lm = self.acc.result(self.placement, self.selection, self.layer_k, extend_to=self.extend_to)
        res = CalibrationResult(thresholds=torch.from_numpy(th.astype("float32")), counts=torch.from_numpy(counts),
                                layer_k=list(self.layer_k), placement=self.placement, alpha=None,
                                selection=self.selection, estimator="count", length_model=lm)
        if self.sdc:
            fin = SdcAccumulator([res], num_q_heads=self.Hq)
            fin.sums[0].copy_(self._sdc_acc.sums[0])
            fin.counts[0].copy_(self._sdc_acc.counts[0])
            res = fin.finalize()[0]
        return res


def run_layerwise(model, samples: Sequence[torch.Tensor], calibrator: LayerwiseCalibrator, settings) -> None:
    """Run the samples as one right-padded batch through the decoder with ``calibrator``
    in charge of every attention layer (no LM head: only the layers are needed).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM (its ``base_model`` runs) or its decoder.
    samples : sequence of torch.Tensor
        1-D int64 token ids, the samples ``calibrator`` was built for (same order and
        lengths); padded with id 0 and masked out.
    calibrator : LayerwiseCalibrator
        Updated in place; read the thresholds with :meth:`LayerwiseCalibrator.result`.
    settings : TopthSettings
        Settings of :func:`topth_ops.hf.attention.enable` (``mode="dense"``: the calibrator takes
        over every layer anyway).

    Raises
    ------
    ValueError
        Sample lengths other than the calibrator's (the padding rows would be recorded).
    """
    from .attention import disable, enable

    lengths = [int(s.numel()) for s in samples]
    if lengths != calibrator.lengths.tolist():
        raise ValueError(f"the calibrator was built for sample lengths {calibrator.lengths.tolist()}, got "
                         f"{lengths}")

    dev = next(model.parameters()).device
    T = max(lengths)
    ids = torch.zeros((len(samples), T), dtype=torch.int64)  # padding id 0, masked out
    mask = torch.zeros((len(samples), T), dtype=torch.int64)
    for i, s in enumerate(samples):
        ids[i, :s.numel()] = s
        mask[i, :s.numel()] = 1
    ctl = enable(model, settings)
    ctl.layer_calibrator = calibrator
    try:
        with torch.inference_mode():
            getattr(model, "base_model", model)(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False)
    finally:
        disable(model)
