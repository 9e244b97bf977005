"""Running V sums for VMC that follow a transformers cache through its edits.

VMC (paper section 3.2.2) needs mu = mean_{j<n} v_j per (sequence, KV head) at every decode
step. Averaging the V rows handed to the attention function reads every valid V row each
step, O(n x head_dim): as much V traffic as dense attention, which erases the saving of
reading only the kept rows. A plain running sum kept beside the cache goes stale when
transformers edits the cache in place (beam search reorders it, assisted decoding crops
it, ``batch_select_indices`` / ``batch_repeat_interleave`` / ``reset``).

:class:`ValueSums` keeps, per layer, the float32 sum of the V rows seen so far and the
number of rows summed, and lives on the cache object itself. :func:`value_sums_for`
attaches it and wraps that cache object's edit methods (the Cache API that ``generate``
and users call): a reorder / batch selection / repeat applies the same index to the sums,
a crop or reset drops them. A decode step then adds only the newly appended row,
O(head_dim). Whenever the lengths do not continue the sums (first decode step after the
prompt, a crop, any edit not made through those methods that changes lengths), the sums
are rebuilt from the valid V rows once (:func:`~topth_ops.vmean.valid_value_mean`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..vmean import valid_value_mean

_ATTR = "_topth_value_sums"
_INDEXED = ("reorder_cache", "batch_select_indices")


class ValueSums:
    """Per-layer ``(sums [B, Hkv, D] float32, counts)`` of one cache object; ``counts`` is a
    tuple of B ints, the rows summed per sequence (Python ints: the per-step bookkeeping then
    costs no tensor operations)."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}
        self.rebuilds = 0  # full re-reads of the V rows (first step, after crop / reset)

    def edited(self, method: str, arg) -> None:
        """Apply the cache edit ``method(arg)`` to the sums (or drop them)."""
        if method in _INDEXED:
            idx = torch.as_tensor(arg, dtype=torch.int64).reshape(-1)
            rows = idx.tolist()
            for layer, (s, c) in list(self.layers.items()):
                self.layers[layer] = (s.index_select(0, idx.to(s.device)), tuple(c[i] for i in rows))
        elif method == "batch_repeat_interleave":
            for layer, (s, c) in list(self.layers.items()):
                counts = torch.tensor(c, dtype=torch.int64).repeat_interleave(arg, dim=0).tolist()
                self.layers[layer] = (s.repeat_interleave(arg, dim=0), tuple(counts))
        else:  # crop, reset: the sums no longer describe the cache
            self.layers.clear()

    def mean(self, layer: int, value: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """mu for this step: ``[B, Hkv, D]`` float32 from ``value`` ``[B, Hkv, S, D]`` (BNSD)
        whose first ``n[b]`` rows are the valid rows of sequence b.

        When every sequence has the rows of the last call plus at most one (a decode step),
        the new row ``n[b] - 1`` is added to the sums in place (O(head_dim)); otherwise the
        sums are rebuilt from the valid rows (:func:`valid_value_mean`, O(n * head_dim)).
        """
        B = value.shape[0]
        lens = n.tolist()
        st = self.layers.get(layer)
        if st is not None and len(st[1]) == B and st[0].shape[0] == B:
            sums, counts = st
            grow = [a - c for a, c in zip(lens, counts)]
            if all(g == 0 or g == 1 for g in grow):
                if all(grow) and min(lens) == max(lens):  # the usual step: every sequence grew by one
                    sums.add_(value[:, :, lens[0] - 1])
                else:
                    for b, g in enumerate(grow):
                        if g:
                            sums[b].add_(value[b, :, lens[b] - 1])
                self.layers[layer] = (sums, tuple(lens))
                return _divide(sums, lens)
        mu = valid_value_mean(value, n)
        self.rebuilds += 1
        self.layers[layer] = (mu * n.to(torch.float32).view(B, 1, 1), tuple(lens))
        return mu


def _divide(sums: torch.Tensor, lens: list) -> torch.Tensor:
    """``sums[b] / max(lens[b], 1)``, a new float32 tensor (the sums stay owned by ValueSums)."""
    if min(lens) == max(lens):
        return sums / float(max(lens[0], 1))
    denom = torch.tensor([max(x, 1) for x in lens], dtype=torch.float32, device=sums.device)
    return sums / denom.view(-1, 1, 1)


def value_sums_for(cache) -> Optional[ValueSums]:
    """The :class:`ValueSums` of a transformers cache object, attached (and its edit methods
    wrapped) on first use; None for None."""
    if cache is None:
        return None
    sums = getattr(cache, _ATTR, None)
    if sums is not None:
        return sums
    sums = ValueSums()
    for method in (*_INDEXED, "batch_repeat_interleave", "crop", "reset"):
        original = getattr(cache, method, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, _method=method, **kwargs):
            result = _original(*args, **kwargs)
            sums.edited(_method, args[0] if args else next(iter(kwargs.values()), None))
            return result

        setattr(cache, method, wrapped)
    setattr(cache, _ATTR, sums)
    return sums
