"""The mean of the valid V rows, the mu of V-mean compensation (paper section 3.2.2), where
it is computed from the cache rows themselves."""

from __future__ import annotations

import torch


def valid_value_mean(value: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Mean of each sequence's n valid V rows (positions 0..n-1 of the cache).

    Cost: one read of the valid V rows, O(n * head_dim) per sequence and KV head. Rows at
    positions >= n are never part of it: NaN or inf there changes nothing.

    Parameters
    ----------
    value : torch.Tensor
        ``[B, num_kv_heads, S, head_dim]`` (BNSD), any float dtype.
    n : torch.Tensor
        ``[B]`` int64, valid rows per sequence (0..S).

    Returns
    -------
    torch.Tensor
        ``[B, num_kv_heads, head_dim]`` float32 (zeros where n = 0).
    """
    B = value.shape[0]
    n_max = int(n.max()) if n.numel() else 0
    denom = n.clamp(min=1).to(torch.float32).view(B, 1, 1)
    if bool((n == n_max).all()):  # no padding: one prefix for the whole batch
        return value[:, :, :n_max].sum(2, dtype=torch.float32) / denom
    valid = torch.arange(n_max, device=value.device).view(1, 1, n_max, 1) < n.view(B, 1, 1, 1)
    # where, not a product with the mask: 0 x NaN of a row past n would be NaN
    return torch.where(valid, value[:, :, :n_max].to(torch.float32), 0.0).sum(2) / denom
