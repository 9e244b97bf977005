"""Selection stage: the threshold of a (set, head or KV head, row id) and the kept masks.

Paper section 3.1 (thresholding), contract v0.2 (docs/semantics.md): ``selection="head"``
compares each query head's value with its own theta; ``selection="group"`` compares the
group's maximum (over its query heads) with one theta per KV head, so every head of the
group keeps the same positions and the V rows a group reads are exactly the rows it keeps.
The compared value x is the logit a (pre_softmax) or a - LSE against ln(theta)
(post_softmax, the log domain of s > theta).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_theta(TH, set_idx, st_set, st_head, st_row, row, kvh, h, gmask, GROUP: tl.constexpr):
    """theta of this program's heads, read through the three strides of thresholds
    ``[num_sets, H, max_row_id]`` (2-D thresholds: st_set = 0). Head selection: [G_PAD]
    (padded heads get +inf: they keep nothing); group selection: a scalar."""
    base = TH + set_idx.to(tl.int64) * st_set + row.to(tl.int64) * st_row
    if GROUP:
        theta = tl.load(base + kvh.to(tl.int64) * st_head)
    else:
        theta = tl.load(base + h.to(tl.int64) * st_head, mask=gmask, other=float("inf"))
    return theta


@triton.jit
def log_cut(theta):
    """ln(theta) for the post_softmax comparison a - LSE > ln(theta): -inf for theta <= 0
    (every finite score is kept), NaN stays NaN (nothing is kept), +inf keeps nothing.

    Decided on the bits of theta, so that a flush-to-zero of subnormals cannot change the
    result: a positive subnormal theta is m x 2^-149 with the integer m < 2^23, whose
    logarithm is taken as ln(m) - 149 ln 2 (m is a normal float32)."""
    bits = theta.to(tl.int32, bitcast=True)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    subnormal = (bits > 0) & (bits < 0x00800000)
    mant = tl.where(subnormal, bits, 1).to(tl.float32)
    ln = tl.where(subnormal, tl.log(mant) - 103.27892990343184, tl.log(tl.where(subnormal, 1.0, theta)))
    cut = tl.where(bits > 0, ln, float("-inf"))
    return tl.where(nan, theta, cut)


@triton.jit
def keep_mask(x, valid, cut, GROUP: tl.constexpr):
    """Kept mask ``[G_PAD, BLOCK_N]`` and the group union ``[BLOCK_N]`` (the V rows to read).

    ``x`` is -inf at invalid positions and padded heads. Head selection: x > cut per head
    (strict; NaN never kept). Group selection: max over the heads of x (NaN scores of a
    poisoned head ignored) > cut, the same for every head of the group.
    """
    if GROUP:
        gx = tl.where(x == x, x, float("-inf"))
        union = tl.max(gx, axis=0) > cut
        kept = union[None, :] & valid
    else:
        kept = x > cut[:, None]
        union = tl.max(kept.to(tl.int32), axis=0) > 0
    return kept, union
