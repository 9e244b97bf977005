"""Row helpers shared by the calibration estimators: the maximum and log-normaliser of
score rows, host copies, and the error for a k that no calibration row exceeds."""

from __future__ import annotations

from typing import Optional

import torch


def row_max(scores: torch.Tensor) -> torch.Tensor:
    """Row maximum m ``[..., 1]`` of logits ``[..., S]`` (-inf at invalid keys); 0 for rows
    without a finite value, so that ``exp(a - m)`` stays defined."""
    m = scores.amax(-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def row_log_z(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row maximum m and log sum_j exp(a_j - m), both ``[..., 1]``, of logits ``[..., S]``
    (-inf at invalid keys): the log-softmax of a row is ``a - m - log_z``."""
    m = row_max(scores)
    return m, torch.log(torch.exp(scores - m).sum(-1, keepdim=True))


def to_host(*tensors: Optional[torch.Tensor]) -> tuple:
    """The tensors on the CPU (None stays None): the calibration accumulators keep their
    histograms, sums and tables in host memory, so what they record from a GPU or NPU
    forward pass (the recorded rows, or a row's top values) is copied over instead of
    mixing devices in index operations.

    Parameters
    ----------
    *tensors : torch.Tensor or None
        Any shape and dtype, on any device.

    Returns
    -------
    tuple
        The same number of entries: detached CPU tensors (same shape and dtype; sharing
        storage with the input when it is already on the CPU), None where None was given.
    """
    return tuple(None if t is None else t.detach().cpu() for t in tensors)


def no_long_rows_error(k: int, layer: int) -> ValueError:
    """The error of a thresholded layer without a calibration row longer than its k."""
    return ValueError(
        f"no calibration row longer than k={k} in layer {layer} (k per layer comes "
        f"from k and the --layer-k overrides): use longer calibration samples, a "
        f"smaller k, or another --layer-k (e.g. {layer}:dense)"
    )
