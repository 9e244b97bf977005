"""Threshold sets: :class:`ThresholdSet` (one calibrated k map of one model, placement and
selection mode) and :func:`stack_sets` (several sets as the op's 3-D table).

The file format (version 2 written, version 1 read), the length-model extension on load,
atomic writes, the checks on load and the reference-text import are specified in
docs/thresholds.md; reading is :mod:`topth_ops.thresholds.load`, writing
:mod:`topth_ops.thresholds.save`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from .format import _CONFIG_KEYS, ThresholdFileError, attention_config_of, describe_config, fingerprint
from .layer_k import base_k, format_layer_k
from .length_model import LengthModel
from .save import save_threshold_sets


@dataclass(eq=False)  # compared by identity: tensor fields have no truth value
class ThresholdSet:
    """One threshold set of one model (one k map, placement and selection).

    Attributes
    ----------
    thresholds : torch.Tensor
        float32 ``[num_layers, H, max_row_id]``, H = num_q_heads (selection "head") or
        num_kv_heads ("group"); the op's 2-D thresholds of a layer are ``thresholds[layer]``.
    counts : torch.Tensor
        int64 ``[num_layers, H, R_cal]``, R_cal <= max_row_id: calibration rows behind
        each value over the calibrated row ids. Columns beyond R_cal come from
        ``length_model``.
    layer_k : list of int
        k per layer, 0 (:data:`topth_ops.thresholds.DENSE`) for a dense layer; with
        selection "group" the number of V rows a group keeps.
    placement : str
        "pre_softmax" (thresholds are logits) or "post_softmax" (probabilities).
    model_name : str
    attention_config : dict
        See :func:`attention_config_of`.
    alpha : float or None
        Standard deviations added to the mean (estimator "mean"); None when unknown.
    sdc_table : torch.Tensor or None
        float32 ``[num_layers, num_q_heads, max_row_id]``; pre_softmax only.
    selection : {"head", "group"}
    estimator : {"mean", "count"}
        "mean": algorithm 1 (mean + alpha * std of per-row (k+1)-th values); "count":
        mean kept count k per row-length bucket (:mod:`topth_ops.calibration.count`).
    length_model, sdc_length_model : LengthModel or None
        theta (SDC table) as a function of the row id beyond the calibrated row ids.
    calibration_text, calibration_samples, calibration_tokens, topk_at_calibration, layerwise,
    source : metadata describing how the set was made.
    layerwise_rule : dict or None
        With ``layerwise`` or from a second round: ``{"sdc": str, "vmc": bool}``, the
        compensation the layers below ran with during calibration (the inference rule the
        thresholds fit).
    path, set_index : where it was loaded from / saved to.
    """

    thresholds: torch.Tensor
    counts: torch.Tensor
    layer_k: list
    placement: str
    model_name: str
    attention_config: dict
    alpha: Optional[float] = None
    sdc_table: Optional[torch.Tensor] = None
    calibration_text: str = ""
    calibration_samples: int = 0
    calibration_tokens: int = 0
    topk_at_calibration: bool = False
    layerwise: bool = False
    layerwise_rule: Optional[dict] = None
    source: str = "calibrate"
    selection: str = "head"
    estimator: str = "mean"
    length_model: Optional[LengthModel] = field(default=None, compare=False)
    sdc_length_model: Optional[LengthModel] = field(default=None, compare=False)
    path: Optional[str] = field(default=None, compare=False)
    set_index: int = field(default=0, compare=False)

    @property
    def num_layers(self) -> int:
        return self.thresholds.shape[0]

    @property
    def num_heads(self) -> int:
        """Threshold heads: query heads ("head") or KV heads ("group")."""
        return self.thresholds.shape[1]

    @property
    def num_q_heads(self) -> int:
        return int(self.attention_config["num_q_heads"])

    @property
    def max_row_id(self) -> int:
        return self.thresholds.shape[2]

    @property
    def calibrated_row_ids(self) -> int:
        """Columns that come from calibration (the rest from the length model)."""
        return self.counts.shape[2]

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.attention_config)

    @property
    def max_calibrated_row_id(self) -> int:
        """Largest row id with at least one calibration sample (0 if none)."""
        cols = torch.nonzero(self.counts.sum(dim=(0, 1)) > 0)
        return int(cols.max()) + 1 if cols.numel() else 0

    @property
    def k(self) -> int:
        """The k of the thresholded layers (the most common non-dense value)."""
        return base_k(self.layer_k)

    def rule_text(self) -> str:
        """``"sdc=..., vmc=..."`` of ``layerwise_rule`` ("rule unknown" without one)."""
        r = self.layerwise_rule
        return f"sdc={r.get('sdc')}, vmc={r.get('vmc')}" if r else "rule unknown"

    def check_rule(self, sdc: str, vmc: bool) -> None:
        """Warn (UserWarning) when a set calibrated layer-wise or in a second round (one
        with ``layerwise_rule``) runs with another compensation than the one it was
        calibrated with: its upper layers then see other activations and keep another
        count than k."""
        r = self.layerwise_rule
        if not r:
            return
        if (r.get("sdc"), bool(r.get("vmc"))) != (sdc, bool(vmc)):
            import warnings

            how = "layer-wise" if self.layerwise else "in a second round"
            warnings.warn(f"{self.name()} was calibrated {how} with {self.rule_text()}, but runs with "
                          f"sdc={sdc}, vmc={vmc}: its upper layers' kept counts will differ from k (serve it with "
                          f"{self.rule_text()}, or calibrate again with the rule you run)", UserWarning, stacklevel=3)

    def name(self) -> str:
        """How messages refer to this set: ``"thresholds file (PATH)"`` (with ``set i``
        when the file holds several), or ``"thresholds file"`` when it was neither loaded
        nor saved."""
        where = f" ({self.path}{', set ' + str(self.set_index) if self.set_index else ''})" if self.path else ""
        return f"thresholds file{where}"

    def summary(self) -> str:
        """One-line description for logs and CLI output."""
        ext = (f", length model to row id {self.max_row_id}" if self.length_model is not None
               and self.max_row_id > self.calibrated_row_ids else "")
        return (f"{self.model_name}: placement={self.placement}, selection={self.selection}, k per layer "
                f"[{format_layer_k(self.layer_k)}], estimator={self.estimator}, alpha={self.alpha}, "
                f"calibrated row ids={self.calibrated_row_ids}{ext}, "
                f"sdc_table={'yes' if self.sdc_table is not None else 'no'}, "
                + (f"calibrated layer-wise ({self.rule_text()}), " if self.layerwise else
                   f"calibrated with {self.rule_text()} below, " if self.layerwise_rule else "")
                + f"calibration: {self.calibration_text}"
                + (f" ({self.calibration_samples} sample{'s' if self.calibration_samples != 1 else ''}, "
                   f"{self.calibration_tokens} tokens)" if self.calibration_samples else ""))

    def check_model(self, config: Any, model_name: Optional[str] = None, placement: Optional[str] = None,
                    *, selection: Optional[str] = None, compare_name: bool = True) -> None:
        """Raise :class:`ThresholdFileError` unless the set fits the model, placement and
        selection mode.

        Parameters
        ----------
        config : transformers config or dict
            The model's config (see :func:`attention_config_of`).
        model_name : str, optional
            Used in messages; with ``compare_name``, a name other than the file's gives a
            UserWarning (same attention shape, other weights, e.g. base vs instruct).
        placement : str, optional
            The placement the caller wants; must equal the set's.
        selection : str, optional
            The selection mode the caller wants ("head" / "group"); must equal the set's.
        compare_name : bool

        Raises
        ------
        ThresholdFileError
            Another attention config (naming both models and every differing field, e.g. a
            file for the other model family), or another placement or selection mode.
        """
        mine = attention_config_of(config)
        if fingerprint(mine) != self.fingerprint:
            diffs = [f"{k}: file {self.attention_config[k]!r} vs model {mine[k]!r}"
                     for k in _CONFIG_KEYS if self.attention_config[k] != mine[k]]
            raise ThresholdFileError(
                f"{self.name()} was calibrated for model {self.model_name!r} "
                f"({describe_config(self.attention_config)}), but the model "
                f"{model_name or '(given)'!r} is ({describe_config(mine)}); differs in " + "; ".join(diffs))
        if compare_name and model_name is not None and model_name != self.model_name:
            warnings.warn(
                f"{self.name()} was calibrated on model {self.model_name!r} and is used with model "
                f"{model_name!r}: the attention shapes match, but thresholds are specific to the "
                "weights they were calibrated on", UserWarning, stacklevel=3)
        if placement is not None and placement != self.placement:
            raise ThresholdFileError(
                f"{self.name()} holds {self.placement} thresholds (model {self.model_name!r}), "
                f"but placement={placement!r} was requested; calibrate with --placement "
                f"{placement} or use placement={self.placement!r}")
        if selection is not None and selection != self.selection:
            raise ThresholdFileError(
                f"{self.name()} was calibrated for selection={self.selection!r} (one threshold per "
                f"{'query head' if self.selection == 'head' else 'KV head, against the group maximum'}), "
                f"but selection={selection!r} was requested; calibrate with --selection {selection}")

    def set_metadata(self) -> dict:
        """This set's entry of the file's ``sets`` metadata (JSON-serializable)."""
        return {
            "layer_k": [int(k) for k in self.layer_k],
            "alpha": self.alpha,
            "estimator": self.estimator,
            "extend_to": int(self.max_row_id),
            "length_domain": self.length_model.domain if self.length_model is not None else None,
            "length_feature": self.length_model.feature if self.length_model is not None else None,
            "sdc_length_domain": self.sdc_length_model.domain if self.sdc_length_model is not None else None,
            "sdc_length_feature": self.sdc_length_model.feature if self.sdc_length_model is not None else None,
            "topk_at_calibration": bool(self.topk_at_calibration),
            "layerwise": bool(self.layerwise),
            "layerwise_rule": dict(self.layerwise_rule) if self.layerwise_rule else None,
            "calibration_text": self.calibration_text,
            "calibration_samples": int(self.calibration_samples),
            "calibration_tokens": int(self.calibration_tokens),
            "source": self.source,
        }

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write this set alone as a threshold file (see :func:`save_threshold_sets`)."""
        return save_threshold_sets(path, [self])


def stack_sets(sets: Sequence[ThresholdSet], layer: int, name: str = "thresholds") -> Optional[torch.Tensor]:
    """One layer of several sets as the op's 3-D table ``[num_sets, H, max_row_id]``.

    Sets shorter than the longest are padded with their last column (what the op does
    with ``min(n, max_row_id) - 1`` anyway). ``name`` is "thresholds" or "sdc_table";
    None when some set has no such table.
    """
    tabs = [getattr(ts, name) for ts in sets]
    if any(t is None for t in tabs):
        return None
    R = max(t.shape[-1] for t in tabs)
    rows = []
    for t in tabs:
        x = t[layer]
        if x.shape[-1] < R:
            x = torch.cat([x, x[:, -1:].expand(x.shape[0], R - x.shape[-1])], dim=-1)
        rows.append(x)
    return torch.stack(rows)
