"""Accumulated per-row attention statistics of a model run, bucketed by row id.

Every attention row (a decode step, or one query row of a thresholded prefill) adds its
k~ per query head, its V rows per GQA group (union over the group's heads, paper section
4.6) and its dropped mass beta, indexed by (layer, row id n). Memory is
``O(num_layers x heads x max_row_id)``; nothing per token is kept.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .thresholds.layer_k import DENSE

DEFAULT_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class StatsCollector:
    """Sums of kept elements, V rows and row counts per (layer, row id).

    Parameters
    ----------
    num_layers, num_q_heads, num_kv_heads : int
    max_row_id : int
        Initial capacity; grows when a longer row arrives.
    """

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, max_row_id: int = 8192):
        self.L, self.Hq, self.Hkv = num_layers, num_q_heads, num_kv_heads
        self._alloc(max_row_id)

    def _alloc(self, R: int) -> None:
        f64 = torch.float64
        new = {
            "rows": torch.zeros((self.L, R + 1), dtype=f64),
            "kept": torch.zeros((self.L, self.Hq, R + 1), dtype=f64),
            "v_rows": torch.zeros((self.L, self.Hkv, R + 1), dtype=f64),
            "beta": torch.zeros((self.L, self.Hq, R + 1), dtype=f64),
        }
        if hasattr(self, "rows"):
            for name, t in new.items():
                old = getattr(self, name)
                t[..., : old.shape[-1]] = old
        for name, t in new.items():
            setattr(self, name, t)
        self.R = R

    def add(self, layer: int, row_ids: torch.Tensor, kept: torch.Tensor, v_rows: torch.Tensor,
            dropped_mass: torch.Tensor) -> None:
        """Add rows of one layer.

        Parameters
        ----------
        row_ids : torch.Tensor
            ``[B, T]`` int: n per row (0 rows are padding and are ignored).
        kept, dropped_mass : torch.Tensor
            ``[B, num_q_heads, T]``.
        v_rows : torch.Tensor
            ``[B, num_kv_heads, T]``.
        """
        n = row_ids.detach().to("cpu", torch.int64).reshape(-1)
        if n.numel() == 0:
            return
        if int(n.max()) > self.R:
            self._alloc(max(int(n.max()), 2 * self.R))
        live = n > 0
        idx = n[live]

        def per_head(t):
            H = t.shape[1]
            return t.detach().to("cpu", torch.float64).permute(1, 0, 2).reshape(H, -1)[:, live]

        self.rows[layer].index_add_(0, idx, torch.ones(idx.numel(), dtype=torch.float64))
        self.kept[layer].index_add_(1, idx, per_head(kept))
        self.v_rows[layer].index_add_(1, idx, per_head(v_rows))
        self.beta[layer].index_add_(1, idx, per_head(dropped_mass))

    def add_dense(self, layer: int, row_ids: torch.Tensor) -> None:
        """Add rows of a dense layer: every valid key kept, every V row read, beta 0."""
        n = row_ids.detach().to("cpu", torch.int64)
        B, T = n.shape
        nk = n.view(B, 1, T).to(torch.float64)
        self.add(layer, n, nk.expand(B, self.Hq, T), nk.expand(B, self.Hkv, T),
                 torch.zeros((B, self.Hq, T), dtype=torch.float64))

    # ------------------------------------------------------------------ summaries

    def _row_mask(self, lo: int, hi: Optional[int]) -> torch.Tensor:
        n = torch.arange(self.R + 1)
        m = n > lo
        if hi is not None:
            m &= n <= hi
        return m & (n > 0)

    def num_rows(self, lo: int = 0, hi: Optional[int] = None) -> int:
        """Row instances (over batch and steps) with lo < n <= hi, counted in layer 0."""
        return int(self.rows[0][self._row_mask(lo, hi)].sum())

    def v_rows_frac(self, lo: int = 0, hi: Optional[int] = None,
                    layers: Optional[Sequence[int]] = None) -> float:
        """V rows read / V rows of dense attention, over rows with lo < n <= hi.

        Dense reads n V rows per KV head per row; the union over a GQA group's heads is
        what a kernel reads (paper section 4.6). ``layers`` restricts the layers.
        """
        return self._frac_of_dense(self.v_rows, self.Hkv, lo, hi, layers)

    def attn_kept_frac(self, lo: int = 0, hi: Optional[int] = None,
                       layers: Optional[Sequence[int]] = None) -> float:
        """Kept attention elements / dense attention elements over rows lo < n <= hi."""
        return self._frac_of_dense(self.kept, self.Hq, lo, hi, layers)

    def _frac_of_dense(self, counts: torch.Tensor, heads: int, lo: int, hi: Optional[int],
                       layers: Optional[Sequence[int]]) -> float:
        """``counts`` ([L, heads, R + 1] per row id) summed over the selected rows, divided by
        what dense attention would count there: n per row and head (NaN for no rows)."""
        sel = self._row_mask(lo, hi)
        ls = list(range(self.L)) if layers is None else list(layers)
        n = torch.arange(self.R + 1, dtype=torch.float64)
        got = counts[ls][..., sel].sum()
        dense = (self.rows[ls][:, sel] * n[sel]).sum() * heads
        return float(got / dense) if dense > 0 else float("nan")

    def k_tilde_over_k(self, layer_k: Sequence[int], lo: int = 0, hi: Optional[int] = None) -> tuple[float, int]:
        """Mean k~ / k over thresholded rows (layers with k, rows with n > k and lo < n <= hi).

        Returns
        -------
        ratio : float
            sum of k~ / sum of k over those (row, head) pairs (NaN when there are none).
        rows : int
            Number of (layer, row) instances behind it.
        """
        sel = self._row_mask(lo, hi)
        n = torch.arange(self.R + 1)
        num = den = 0.0
        rows = 0
        for layer, k in enumerate(layer_k):
            if k == DENSE:
                continue
            s = sel & (n > k)
            r = self.rows[layer][s].sum()
            num += float(self.kept[layer][:, s].sum())
            den += float(r) * k * self.Hq
            rows += int(r)
        return (num / den if den > 0 else float("nan")), rows

    def dropped_mass(self, lo: int = 0, hi: Optional[int] = None,
                     layers: Optional[Sequence[int]] = None) -> float:
        """Mean beta over rows lo < n <= hi and heads."""
        sel = self._row_mask(lo, hi)
        ls = list(range(self.L)) if layers is None else list(layers)
        cnt = self.rows[ls][:, sel].sum() * self.Hq
        return float(self.beta[ls][..., sel].sum() / cnt) if cnt > 0 else float("nan")


def length_buckets(max_row: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> list[tuple[int, int]]:
    """(lo, hi] pairs covering 1..max_row from ``buckets`` (extended by doubling)."""
    edges = list(buckets)
    while edges[-1] < max_row:
        edges.append(edges[-1] * 2)
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1) if edges[i] < max_row]
