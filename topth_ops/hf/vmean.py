"""Running V sums for VMC that follow a transformers cache through its edits.

VMC (paper section 3.2.2) needs mu = mean_{j<n} v_j per (sequence, KV head) at every decode
step. Averaging the V rows handed to the attention function reads every valid V row each
step, O(n x head_dim): as much V traffic as dense attention, which erases the saving of
reading only the kept rows. A plain running sum kept beside the cache goes stale when
transformers edits the cache in place (issue 9.4: beam search reorders it, assisted
decoding crops it, ``batch_select_indices`` / ``batch_repeat_interleave`` / ``reset``).

:class:`ValueSums` keeps, per layer, the float32 sum of the V rows seen so far and the
number of rows summed, and lives on the cache object itself. :func:`value_sums_for`
attaches it and wraps that cache object's edit methods (the Cache API that ``generate``
and users call): a reorder / batch selection / repeat applies the same index to the sums,
a crop or reset drops them. A decode step then adds only the newly appended row,
O(head_dim). Whenever the lengths do not continue the sums (first decode step after the
prompt, a crop, any edit not made through those methods that changes lengths), the sums
are rebuilt from the valid V rows once (:func:`~topth_ops.hf.cache_view.valid_value_mean`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .cache_view import valid_value_mean

_ATTR = "_topth_value_sums"
_INDEXED = ("reorder_cache", "batch_select_indices")


class ValueSums:
    """Per-layer ``(sums [B, Hkv, D] float32, counts [B] int64)`` of one cache object."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rebuilds = 0  # full re-reads of the V rows (first step, after crop / reset)

    def edited(self, method: str, arg) -> None:
        """Apply the cache edit ``method(arg)`` to the sums (or drop them)."""
        if method in _INDEXED:
            for layer, (s, c) in list(self.layers.items()):
                idx = torch.as_tensor(arg, dtype=torch.int64)
                self.layers[layer] = (s.index_select(0, idx.to(s.device)), c.index_select(0, idx.to(c.device)))
        elif method == "batch_repeat_interleave":
            for layer, (s, c) in list(self.layers.items()):
                self.layers[layer] = (s.repeat_interleave(arg, dim=0), c.repeat_interleave(arg, dim=0))
        else:  # crop, reset: the sums no longer describe the cache
            self.layers.clear()

    def mean(self, layer: int, value: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """mu for this step: ``[B, Hkv, D]`` float32 from ``value`` ``[B, Hkv, S, D]`` (BNSD)
        whose first ``n[b]`` rows are the valid rows of sequence b."""
        B = value.shape[0]
        st = self.layers.get(layer)
        if st is not None and st[0].shape[0] == B:
            sums, counts = st
            grow = n - counts
            if bool(((grow == 0) | (grow == 1)).all()):
                last = value[torch.arange(B, device=value.device), :, (n - 1).clamp(min=0)]  # [B, Hkv, D]
                sums = sums + last.to(torch.float32) * (grow == 1).to(torch.float32).view(B, 1, 1)
                self.layers[layer] = (sums, n.clone())
                return sums / n.clamp(min=1).to(torch.float32).view(B, 1, 1)
        mu = valid_value_mean(value, n)
        self.rebuilds += 1
        self.layers[layer] = (mu * n.to(torch.float32).view(B, 1, 1), n.clone())
        return mu


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
