"""Backend ``torch``: the vectorized PyTorch reference of the op contract.

Runs on any torch device, float16 / bfloat16 / float32 inputs, float32 math, output in
the input dtype. No Python loop over batch, heads or tokens. It is the fallback on every
device; it is *not* the conformance oracle (that one is float64 numpy code in
:mod:`topth_ops.conformance.oracle`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import packed
from ..contract import DecodeInputs, DecodeStats
from ..vmean import valid_value_mean
from ..registry import Backend


def _scaled_exp(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x * exp(d) (0 and NaN kept), without exp(d) alone overflowing or turning subnormal when
    the product is in float32 range: there computed as sign(x) exp(log |x| + d); elsewhere the
    plain product."""
    x, d = torch.broadcast_tensors(x, d)
    near = (d > -87.0) & (d < 88.0)
    direct = x * torch.exp(torch.where(near, d, torch.zeros_like(d)))
    ax = x.abs()
    logd = torch.copysign(torch.exp(torch.log(torch.where(ax > 0, ax, torch.ones_like(ax))) + d), x)
    return torch.where((x != 0) & ~torch.isnan(x), torch.where(near, direct, logd), x)


def dense_caches(inputs: DecodeInputs, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as BNSD ``[batch, num_kv_heads, max_seq_len, head_dim]`` views or copies.

    Paged caches are gathered through the block table. Table entries of blocks a sequence
    does not use are never followed (index 0 stands in; those positions are masked out by
    the caller), and used entries are clamped into [0, num_blocks) so that unchecked
    inputs never index out of bounds.
    """
    if not inputs.paged:
        return inputs.key_cache, inputs.value_cache
    bt = inputs.block_table.to(torch.int64)
    B, M = bt.shape
    bs = inputs.block_size
    used = torch.arange(M, device=bt.device)[None, :] < ((n + bs - 1) // bs)[:, None]
    idx = torch.where(used, bt.clamp(0, inputs.num_blocks - 1), 0)

    def gather(cache: torch.Tensor, kind: str) -> torch.Tensor:
        blocks = cache[idx]  # NHD: [B, M, bs, H, D]; HND, VLLM_AMX: [B, M, H, bs, D]
        if inputs.kv_layout == "VLLM_AMX":
            blocks = packed.unpack(blocks, kind)
        if inputs.kv_layout == "NHD":
            blocks = blocks.permute(0, 3, 1, 2, 4)  # [B, H, M, bs, D]
        else:
            blocks = blocks.permute(0, 2, 1, 3, 4)
        return blocks.reshape(B, blocks.shape[1], M * bs, blocks.shape[-1])

    return gather(inputs.key_cache, "key"), gather(inputs.value_cache, "value")


def per_sequence_rows(inputs: DecodeInputs, table: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``table[set_b, :, row_b]`` for every sequence: ``[batch, rows]`` float32.

    ``table`` is ``[num_sets, rows, max_row_id]``; row_b = min(max(n_b, 1), max_row_id) - 1
    and set_b = threshold_set[b] (0 without sets), clamped into [0, num_sets).
    """
    row = n.clamp(min=1).clamp(max=inputs.max_row_id) - 1
    if inputs.threshold_set is None:
        sets = torch.zeros_like(row)
    else:
        sets = inputs.threshold_set.to(torch.int64).clamp(0, inputs.num_sets - 1)
    return table[sets, :, row]  # [B, rows]


def reference_decode(inputs: DecodeInputs) -> tuple[torch.Tensor, DecodeStats]:
    """Thresholded decode attention, formulas of docs/semantics.md (paper sections 3.1-3.2).

    Parameters
    ----------
    inputs : DecodeInputs
        Validated inputs (see :func:`topth_ops.contract.make_inputs`); BNSD or paged
        caches, per-head or group selection, one or several threshold sets.

    Returns
    -------
    out : torch.Tensor
        ``[batch, num_q_heads, head_dim]`` in the input dtype.
    stats : DecodeStats
        kept ``[batch, num_q_heads]`` int32, v_rows ``[batch, num_kv_heads]`` int32,
        dropped_mass ``[batch, num_q_heads]`` float32.

    Notes
    -----
    Memory is O(batch x num_q_heads x max_seq_len) for the scores plus a float32 copy of
    the caches (gathered, when paged): a reference, not a fast path.
    """
    B, Hq, D = inputs.query.shape
    Hkv, S, G = inputs.num_kv_heads, inputs.max_seq_len, inputs.group_size
    dev = inputs.device
    f32 = torch.float32
    n = inputs.clamped_lengths()  # [B] int64
    k_cache, v_cache = dense_caches(inputs, n)
    pos = torch.arange(S, device=dev)
    valid = (pos[None, :] < n[:, None])[:, None, :]  # [B, 1, S]

    q = inputs.query.to(f32).reshape(B, Hkv, G, D)
    k = k_cache.to(f32)
    # a_j = scale * <q, k_j> in fp32 (semantics step 1); tail positions are masked out below.
    a = torch.einsum("bkgd,bksd->bkgs", q, k).reshape(B, Hq, S) * inputs.scale
    a = torch.where(valid, a, float("-inf"))
    m = a.amax(dim=-1, keepdim=True)  # NaN if a valid score is NaN; -inf when n = 0
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = torch.where(valid, torch.exp(a - m_safe), 0.0)  # exp(a_j - m); NaN propagates
    Z = e.sum(-1, keepdim=True)

    theta = per_sequence_rows(inputs, inputs.thresholds_3d(), n)  # [B, threshold_heads]
    if inputs.placement == "pre_softmax":
        x, cut = a, theta
    else:
        # log s_j, compared in the log domain; -inf where a_j = -inf (also in a head whose
        # every score is -inf, Z = 0, where a - m - ln Z would be NaN and poison the group max)
        x = torch.where(a == float("-inf"), float("-inf"), a - m_safe - torch.log(Z))
        cut = log_threshold(theta)
    if inputs.selection == "group":
        # One threshold per KV head against the group maximum of x (NaN-propagating max).
        x_group = x.view(B, Hkv, G, S).amax(dim=2)  # [B, Hkv, S]
        kept = (valid & (x_group > cut.unsqueeze(-1))).repeat_interleave(G, dim=1)
        theta_h = theta.repeat_interleave(G, dim=1).unsqueeze(-1)  # [B, Hq, 1]
    else:
        kept = valid & (x > cut.unsqueeze(-1))
        theta_h = theta.unsqueeze(-1)

    if inputs.placement == "pre_softmax":
        # Weights relative to the maximum over the head's kept positions, mk (semantics: "a
        # head's kept rows far below its own maximum"): with group selection a head may keep
        # only rows far below its own maximum, whose exp(a - m) underflow. mk = m whenever the
        # head's maximum is kept (always with per-head selection). E~ is defined relative to
        # m; exp(m - mk) >= 1 rescales it (inf only when the product exceeds float32: the kept
        # weights are then 0).
        mk = torch.where(kept, a, float("-inf")).amax(dim=-1, keepdim=True)
        # m where the head keeps no row with a finite score (then its kept weights are 0)
        mk = torch.where(mk > float("-inf"), mk, m_safe)
        emk = torch.where(valid, torch.exp(a - mk), 0.0)  # exp(a_j - mk) at every valid position
        ek = torch.where(kept, emk, 0.0)
        R = ek.sum(-1, keepdim=True)
        k_tilde = kept.sum(-1, keepdim=True)
        if inputs.sdc == "none":
            E = torch.zeros_like(R)
        elif inputs.sdc == "exact":
            E = torch.where(kept, 0.0, emk).sum(-1, keepdim=True)
        elif inputs.sdc == "exp_threshold":
            dropped = (n[:, None, None] - k_tilde).to(f32)
            E = _scaled_exp(inputs.sdc_gamma * dropped, theta_h - mk)  # 0 when gamma or nothing dropped is 0
        else:  # offline: sdc_table is in units of exp(a - m)
            E = _scaled_exp(per_sequence_rows(inputs, inputs.sdc_table_3d(), n).unsqueeze(-1), m_safe - mk)
        # R + E = 0 only where every kept weight is 0 (a_j = -inf: weight 0, never NaN)
        w = torch.where(kept & (R + E != 0), ek / (R + E), 0.0)
    else:
        w = torch.where(kept & (Z != 0), e / Z, 0.0)  # Z = 0: every score -inf, weight 0

    beta = (1.0 - w.sum(-1)).clamp(0.0, 1.0)  # [B, Hq]; NaN stays NaN
    v = v_cache.to(f32)
    union = kept.view(B, Hkv, G, S).any(dim=2)  # [B, Hkv, S]
    # Rows kept by no head of the group are never read: zero them so that NaN or inf in
    # a dropped row (or in the tail) cannot leak through 0 * NaN.
    v_read = torch.where(union.unsqueeze(-1), v, 0.0)
    out = torch.einsum("bkgs,bksd->bkgd", w.view(B, Hkv, G, S), v_read).reshape(B, Hq, D)
    if inputs.vmc:
        if inputs.value_mean is not None:
            mu = inputs.value_mean.to(f32)
        else:
            mu = valid_value_mean(v_cache, n)
        out = out.view(B, Hkv, G, D) + beta.view(B, Hkv, G, 1) * mu.view(B, Hkv, 1, D)
        out = out.reshape(B, Hq, D)

    # A NaN or +inf score makes the whole head NaN (semantics: non-finite inputs).
    poisoned = torch.isnan(m) | (m == float("inf"))  # [B, Hq, 1]
    out = torch.where(poisoned, float("nan"), out)
    empty = (n == 0).view(B, 1)
    out = torch.where(empty.unsqueeze(-1), 0.0, out)
    beta = torch.where(empty, 0.0, beta)
    stats = DecodeStats(
        kept=kept.sum(-1).to(torch.int32),
        v_rows=union.sum(-1).to(torch.int32),
        dropped_mass=beta.to(f32),
    )
    return out.to(inputs.dtype), stats


# 149 ln 2: a positive subnormal float32 is m x 2^-149 with the integer m < 2^23.
_LN_SUBNORMAL_UNIT = 103.27892990343184


def log_threshold(theta: torch.Tensor) -> torch.Tensor:
    """ln(theta) of float32 post_softmax thresholds, the cut of the log-domain test
    ``a - LSE > ln(theta)`` (docs/semantics.md): -inf for theta <= 0 (every finite score is
    kept), NaN for NaN (nothing is kept). Decided on the bits, so that a flush of subnormals
    (``torch.set_flush_denormal(True)``) cannot change it: a positive subnormal m x 2^-149
    gives ln(m) - 149 ln 2."""
    bits = theta.contiguous().view(torch.int32)
    positive = bits > 0
    subnormal = positive & (bits < 0x00800000)
    ln = torch.where(subnormal, torch.log(bits.to(torch.float32)) - _LN_SUBNORMAL_UNIT,
                     torch.log(torch.where(subnormal, torch.ones_like(theta), theta)))
    cut = torch.where(positive, ln, float("-inf"))
    return torch.where((bits & 0x7FFFFFFF) > 0x7F800000, theta, cut)


class TorchBackend(Backend):
    name = "torch"
    device_type = "any"
    description = "vectorized PyTorch reference (fp32 math), any torch device"
    features = frozenset({"paged", "group_selection", "threshold_sets", "vllm_amx"})

    def devices(self) -> list[torch.device]:
        devs = [torch.device("cpu")]
        if torch.cuda.is_available():
            devs.append(torch.device("cuda"))
        return devs

    def forward(self, inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]) -> None:
        result, st = reference_decode(inputs)
        out.copy_(result)
        if stats is not None:
            for dst, src in zip(stats, st):
                dst.copy_(src)


BACKENDS = [TorchBackend()]
