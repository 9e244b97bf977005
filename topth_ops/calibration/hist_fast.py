"""The kept-count histograms' update in one compiled pass (CPU).

:class:`~topth_ops.calibration.count.CountAccumulator` adds each recorded row's values to up
to four histogram sets (pre/post-softmax x per-head/group). The torch path makes about ten
passes over the rows per set; the compiled CPU module (``calib_hist_add``, sources in
cpu_kernels/src/calib_hist.cpp) makes one pass for all of them, with the same bins: the same
float32 arithmetic, non-finite values not counted, and a group's maximum not finite where a
head's value is NaN or +inf (as ``torch.amax``). Without the module, or for anything unusual
(tensors off the CPU, another dtype or shape, a log-normaliser that is not float32 per row and
head), the torch path runs.
"""

from __future__ import annotations

import torch

from ..cpu_kernels import extension_with

#: Use the compiled pass when the CPU module is built. False: the torch path always (the
#: reference; the tests run both).
FUSED_CPU = True


def _module():
    return extension_with("calib_hist_add") if FUSED_CPU else None


def add_rows(acc, layer: int, x: torch.Tensor, lse, b_idx: torch.Tensor) -> bool:
    """Add rows to every histogram set of ``acc`` at ``layer`` in one compiled pass.

    Parameters
    ----------
    acc : CountAccumulator
        Its ranges for ``layer`` are set (every recorded placement and selection).
    layer : int
    x : torch.Tensor
        ``[R, num_q_heads, S]`` float32 logits on the CPU (-inf at invalid keys).
    lse : torch.Tensor or None
        ``[R, num_q_heads, 1]`` float32 log-normaliser per row (post-softmax), else None.
    b_idx : torch.Tensor
        ``[R]`` int64 bucket of each row.

    Returns
    -------
    bool
        True when added; False (nothing changed) when the torch path must run.
    """
    mod = _module()
    if mod is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 3 or x.stride(-1) != 1:
        return False
    R, H, S = x.shape
    if R == 0 or S == 0 or H != acc.Hq or b_idx.shape != (R,):
        return False
    post = "post_softmax" in acc.placements
    if post:  # as the torch path computes x - lse: float32, one value per row and head
        if lse is None or lse.device.type != "cpu" or lse.dtype != torch.float32 or lse.shape != (R, H, 1):
            return False
        lse = lse.reshape(R, H).contiguous()
    b = b_idx.to(torch.int64).contiguous()
    keep = [x, b, lse]  # alive during the call
    ptrs = []
    for p, s in (("pre_softmax", "head"), ("post_softmax", "head"), ("pre_softmax", "group"), ("post_softmax", "group")):
        if (p, s) not in acc.hist:
            ptrs += [0, 0, 0]
            continue
        hist = acc.hist[(p, s)][layer]
        rng = acc.range[(p, s)][layer]
        if not hist.is_contiguous() or bool(torch.isnan(rng[:, 0]).any()):  # a layer's first chunk
            return False  # sets the ranges on the torch path
        lo = rng[:, 0].to(torch.float32).contiguous()
        inv_w = (1.0 / rng[:, 1]).to(torch.float32).contiguous()
        keep += [hist, lo, inv_w]
        ptrs += [hist.data_ptr(), lo.data_ptr(), inv_w.data_ptr()]
    G = acc.Hq // acc.Hkv
    rc = mod.calib_hist_add(x.data_ptr(), R, H, G, S, x.stride(0), x.stride(1), lse.data_ptr() if post else 0,
                            b.data_ptr(), acc.NB, acc.bins, ptrs)
    return rc == 0
