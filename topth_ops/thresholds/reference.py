"""Import of the paper reference code's text thresholds (kostyanoob/top-theta-attention).

``th.txt`` lines ``L{layer}_H{head}:{seq_len} {theta} {num_samples} {K}`` and ``sdc.txt``
lines ``L{layer}_H{head}:{seq_len} {value} {num_samples}``; seq_len is the attention row
length (our row id), lines exist only for seq_len > K, and the reference lookup takes the
nearest calibrated seq_len with ties to the smaller one (the same fill rule as ours).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from ..contract import PLACEMENTS
from .format import ThresholdFileError, attention_config_of, describe_config
from .layer_k import DENSE
from .sets import ThresholdSet
from .tables import dense_rows, fill_unsampled

_TH_LINE = re.compile(r"^L(\d+)_H(\d+):(\d+)$")


def _parse_reference(path: Path, fields: int, what: str) -> dict:
    """{(layer, head, seq_len): [float value, int num_samples, (int K)]} from a reference file."""
    fmt = ("L{layer}_H{head}:{seq_len} {theta} {num_samples} {K}" if fields == 4
           else "L{layer}_H{head}:{seq_len} {value} {num_samples}")
    out: dict = {}
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            m = _TH_LINE.match(parts[0]) if parts else None
            try:
                if m is None or len(parts) != fields:
                    raise ValueError
                key = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
                value = float(parts[1])
                nums = [int(p) for p in parts[2:]]
            except ValueError:
                raise ThresholdFileError(
                    f"{what} {str(path)!r} line {lineno}: expected '{fmt}', got {line[:120]!r}"
                ) from None
            if key[2] < 1 or nums[0] < 0 or math.isnan(value):
                raise ThresholdFileError(
                    f"{what} {str(path)!r} line {lineno}: seq_len must be >= 1, num_samples >= 0 and "
                    f"the value not NaN, got {line[:120]!r}"
                )
            out[key] = [value, *nums]  # a repeated key keeps the last line, as the reference loader
    if not out:
        raise ThresholdFileError(f"{what} {str(path)!r} holds no lines of the form '{fmt}'")
    return out


def import_reference_text(th_path: Union[str, os.PathLike], sdc_path: Optional[Union[str, os.PathLike]] = None,
                          *, placement: str, attention_config: Any, model_name: str) -> ThresholdSet:
    """Import thresholds written by the paper's reference code (``th.txt`` / ``sdc.txt``).

    Parameters
    ----------
    th_path : path
        ``th.txt``: lines ``L{layer}_H{head}:{seq_len} {theta} {num_samples} {K}``
        (seq_len is the row id n: the number of keys of the attention row).
    sdc_path : path, optional
        ``sdc.txt``: lines ``L{layer}_H{head}:{seq_len} {value} {num_samples}``
        (offline SDC, pre_softmax only).
    placement : str
        The placement the reference run used (the text format does not record it).
    attention_config : transformers config or dict
        The model the thresholds belong to.
    model_name : str

    Returns
    -------
    ThresholdSet
        Layers without lines are dense; rows with seq_len <= K are dense; row ids
        without a line take the nearest row id that has one (ties: the smaller), the same
        rule as the reference code's lookup.

    Raises
    ------
    ThresholdFileError
        Malformed lines, an empty file, layers or heads outside the model, several K in
        one layer, a layer with some heads missing, an sdc file with post_softmax,
        post_softmax values outside [0, 1] (logits imported with the wrong placement), or
        an sdc line for a layer without thresholds.
    ValueError
        ``placement`` is not "pre_softmax" or "post_softmax", or ``attention_config`` is
        a dict lacking keys (:func:`attention_config_of`).
    FileNotFoundError
        ``th_path`` or ``sdc_path`` does not exist (other ``OSError`` for unreadable
        files), raised by ``open``.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    cfg = attention_config_of(attention_config)
    L, H = cfg["num_layers"], cfg["num_q_heads"]
    th = _parse_reference(Path(th_path), 4, "reference thresholds file")
    sdc = _parse_reference(Path(sdc_path), 3, "reference SDC file") if sdc_path is not None else None
    if sdc is not None and placement != "pre_softmax":
        raise ThresholdFileError("an sdc.txt file applies to pre_softmax thresholds only")
    keys = list(th) + (list(sdc) if sdc else [])
    bad = sorted({(l, h) for l, h, _ in keys if l >= L or h >= H})
    if bad:
        l, h = bad[0]
        raise ThresholdFileError(
            f"reference file has layer {l} head {h}, outside model {model_name!r} "
            f"({describe_config(cfg)})"
        )
    R = max(s for _, _, s in keys)
    theta = np.full((L, H, R), np.nan)
    counts = np.zeros((L, H, R), dtype=np.int64)
    present = np.zeros((L, H, R), dtype=bool)
    layer_ks: dict[int, set] = {}
    for (l, h, s), (value, ns, k) in th.items():
        theta[l, h, s - 1] = value
        counts[l, h, s - 1] = ns
        present[l, h, s - 1] = True
        layer_ks.setdefault(l, set()).add(k)
    layer_k = [DENSE] * L
    for l, ks in layer_ks.items():
        if len(ks) != 1:
            raise ThresholdFileError(f"reference thresholds file: layer {l} has several K values {sorted(ks)}")
        layer_k[l] = ks.pop()
        if layer_k[l] < 1:
            raise ThresholdFileError(f"reference thresholds file: layer {l} has K={layer_k[l]} (< 1)")
        missing = [h for h in range(H) if not present[l, h].any()]
        if missing:
            raise ThresholdFileError(f"reference thresholds file: layer {l} has no lines for heads {missing}")
    if placement == "post_softmax":
        vals = theta[present]
        if vals.size and bool(((vals < 0) | (vals > 1)).any()):
            raise ThresholdFileError(
                f"reference thresholds file has values outside [0, 1] (min {vals.min():.4g}, max "
                f"{vals.max():.4g}), which cannot be post_softmax probabilities: were they calibrated "
                "on logits? then use placement pre_softmax")
    theta = fill_unsampled(np.where(present, theta, 0.0), present.astype(np.int64))
    theta = dense_rows(theta, layer_k, -np.inf)
    sdc_table = None
    if sdc is not None:
        table = np.zeros((L, H, R))
        sdc_present = np.zeros((L, H, R), dtype=bool)
        for (l, h, s), (value, _ns) in sdc.items():
            if layer_k[l] == DENSE:
                raise ThresholdFileError(f"reference SDC file has layer {l}, which has no thresholds")
            table[l, h, s - 1] = value
            sdc_present[l, h, s - 1] = True
        table = fill_unsampled(table, sdc_present.astype(np.int64))
        table = dense_rows(table, layer_k, 0.0)
        sdc_table = torch.from_numpy(table.astype(np.float32))
    return ThresholdSet(
        thresholds=torch.from_numpy(theta.astype(np.float32)),
        counts=torch.from_numpy(counts),
        layer_k=layer_k,
        placement=placement,
        model_name=model_name,
        attention_config=cfg,
        alpha=None,
        sdc_table=sdc_table,
        calibration_text=f"imported from {Path(th_path).name}" + (f" + {Path(sdc_path).name}" if sdc_path else ""),
        calibration_samples=0,
        source="reference-text",
    )
