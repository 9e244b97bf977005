"""Completing threshold tables over row ids: columns without calibration rows take the
nearest sampled column, and row ids n <= k (and dense layers) are set to a fill value."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .layer_k import DENSE


def fill_unsampled(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Fill row ids without samples from the nearest sampled row id.

    Parameters
    ----------
    values : numpy.ndarray
        ``[..., R]``, column c holds row id c + 1.
    counts : numpy.ndarray
        ``[..., R]`` sample counts (integers); 0 marks an unsampled row id.

    Returns
    -------
    numpy.ndarray
        Copy of ``values`` where every unsampled column takes the value of the nearest
        sampled column of the same leading index (ties: the smaller row id; before the
        first sampled row id the first, after the last the last). Vectors with no sample
        at all are returned unchanged.
    """
    out = np.array(values, copy=True)
    R = out.shape[-1]
    flat_v = out.reshape(-1, R)
    flat_c = np.asarray(counts).reshape(-1, R)
    cols = np.arange(R)
    for i in range(flat_v.shape[0]):
        sampled = np.flatnonzero(flat_c[i] > 0)
        if sampled.size == 0 or sampled.size == R:
            continue
        right = np.searchsorted(sampled, cols, side="left")  # first sampled >= col
        right_c = np.clip(right, 0, sampled.size - 1)
        left_c = np.clip(right - 1, 0, sampled.size - 1)
        r_pos, l_pos = sampled[right_c], sampled[left_c]
        d_right = np.where(r_pos >= cols, r_pos - cols, np.iinfo(np.int64).max)
        d_left = np.where(l_pos <= cols, cols - l_pos, np.iinfo(np.int64).max)
        src = np.where(d_left <= d_right, l_pos, r_pos)  # ties -> the smaller row id
        flat_v[i] = flat_v[i][src]
    return out


def dense_rows(values: np.ndarray, layer_k: Sequence[int], fill: float) -> np.ndarray:
    """Set columns of row ids n <= k (and whole dense layers) to ``fill``."""
    out = np.array(values, copy=True)
    R = out.shape[-1]
    for layer, k in enumerate(layer_k):
        if k == DENSE:
            out[layer] = fill
        else:
            out[layer, :, : min(k, R)] = fill
    return out
