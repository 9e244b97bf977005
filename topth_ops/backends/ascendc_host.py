"""Host glue of the Ascend C kernel, shared by the ``ascendc`` and ``ascendc-cpu`` backends:
the kernel's view of one call (shapes, option codes, cache strides), the tensors in the
layouts it reads, and a mirror of its work split (for the byte expectations of tests and
benchmarks). No compiled module is imported here.

The kernel reads the KV caches in place through their (block, KV head, slot) strides:
contiguous BNSD caches as one block per sequence, paged NHD / HND caches through the block
table (docs/ascendc.md, "Cache layouts"). Small tensors (query, lengths, thresholds,
sdc_table, value_mean, block_table, threshold_set) are copied to contiguous int32 /
float32 tensors here, after clamping lengths and set indices in their own dtype's full
range (contract v0.2, "Unchecked values").
"""

from __future__ import annotations

from typing import Optional

import torch

from ..codes import DType, Placement, Sdc, Selection
from ..contract import DecodeInputs
from ..vmean import valid_value_mean



def cache_layout_reason(inputs: DecodeInputs, which: str) -> Optional[str]:
    """Why the kernel cannot read the key (``which="key"``) or value cache in place, or None.

    The kernel needs every row of head_dim elements contiguous, the rows of one (block, KV
    head) not overlapping, and the gap between rows under 4 GiB (a 32-bit byte stride of
    DataCopyPad). Block and head strides are free (slices of a larger pool, BSND caches
    viewed as BNSD, K and V interleaved in one tensor).
    """
    t = inputs.key_cache if which == "key" else inputs.value_cache
    name = "key_cache" if which == "key" else "value_cache"
    _s_blk, _s_head, s_slot, s_dim = inputs.cache_strides(which)
    D, bs = inputs.head_dim, inputs.block_size
    if s_dim != 1 and D > 1:
        return (f"{name} with strides {tuple(t.stride())} ({inputs.kv_layout} {tuple(t.shape)}): head_dim is not the "
                f"innermost contiguous dimension; the kernel reads cache rows in place and never copies a cache "
                f"(pass a cache whose head_dim has stride 1)")
    if bs > 1 and s_slot < D:
        return f"{name}: slot stride {s_slot} < head_dim {D} (rows overlap); the kernel copies whole rows"
    if bs > 1 and (s_slot - D) * t.element_size() >= 2**32:
        return f"{name}: the gap between rows is 4 GiB or more (DataCopyPad takes a 32-bit byte stride)"
    return None


def problem_shape(inputs: DecodeInputs) -> dict:
    """The kernel's view of one call for the tiling: shapes, dtype and option codes, the
    paged geometry and the caches' (block, KV head, slot) strides in elements."""
    ks, vs = inputs.cache_strides("key"), inputs.cache_strides("value")
    return {
        "batch": inputs.batch,
        "num_q_heads": inputs.num_q_heads,
        "num_kv_heads": inputs.num_kv_heads,
        "max_seq_len": inputs.max_seq_len,
        "head_dim": inputs.head_dim,
        "max_row_id": inputs.max_row_id,
        "dtype": int(DType.of(inputs.dtype)),
        "placement": int(Placement.of(inputs.placement)),
        "sdc": int(Sdc.of(inputs.sdc)),
        "vmc": int(inputs.vmc),
        "scale": float(inputs.scale),
        "sdc_gamma": float(inputs.sdc_gamma),
        "selection": int(Selection.of(inputs.selection)),
        "num_sets": inputs.num_sets,
        "has_sets": int(inputs.threshold_set is not None),
        "paged": int(inputs.paged),
        "block_size": inputs.block_size if inputs.paged else 0,
        "num_blocks": inputs.num_blocks if inputs.paged else 0,
        "max_blocks_per_seq": inputs.max_blocks_per_seq,
        "k_strides": [int(x) for x in ks[:3]],
        "v_strides": [int(x) for x in vs[:3]],
    }


def value_mean_of(inputs: DecodeInputs) -> torch.Tensor:
    """mean_{j<n} v_j in float32, ``[batch, num_kv_heads, head_dim]``; 0 where n = 0.

    Used when ``vmc=True`` and no ``value_mean`` is given: it reads every valid V row
    (gathered through the block table when paged), on the host side of the kernel; pass
    ``value_mean`` (e.g. :func:`topth_ops.value_sum.paged_value_mean` of a maintained V sum) to
    keep V traffic at the kept rows.
    """
    from .torch_ref import dense_caches

    n = inputs.clamped_lengths()
    _k, v = dense_caches(inputs, n)
    return valid_value_mean(v, n).contiguous()


def kernel_tensors(inputs: DecodeInputs) -> dict:
    """Tensors in the layouts the kernel reads: the caches as they are (read through their
    strides), every small tensor contiguous: seq_lens int32 clamped into [0, max_seq_len],
    thresholds / sdc_table as ``[num_sets, H, max_row_id]`` float32, threshold_set int32
    clamped into [0, num_sets - 1], block_table int32 (the kernel clamps used entries into
    [0, num_blocks - 1]), value_mean float32."""
    t = {
        "query": inputs.query.contiguous(),
        "key_cache": inputs.key_cache,
        "value_cache": inputs.value_cache,
        "seq_lens": inputs.clamped_lengths(torch.int32).contiguous(),
        "thresholds": inputs.thresholds_3d().contiguous(),
        "sdc_table": inputs.sdc_table_3d().contiguous() if inputs.sdc_table is not None else None,
        "value_mean": None,
        "block_table": inputs.block_table.contiguous() if inputs.paged else None,
        "threshold_set": None,
    }
    if inputs.threshold_set is not None:
        t["threshold_set"] = inputs.threshold_set.clamp(0, inputs.num_sets - 1).to(torch.int32).contiguous()
    if inputs.vmc:
        vm = inputs.value_mean if inputs.value_mean is not None else value_mean_of(inputs)
        t["value_mean"] = vm.to(torch.float32).contiguous()
    return t


def split_plan(tiling: dict, seq_lens: list[int]) -> tuple[int, list[int]]:
    """Mirror of the kernel's work split (``topth_plan.h``): the splits per pair in use
    and, per sequence, its pieces (0 or 1: one item computes it whole).

    Splits u: the tiling's ``splitCap``, lowered until u x ``minSplitLen`` <= the longest
    length; a sequence of n positions then takes min(u, max(1, n // minSplitLen)) pieces of
    ceil(n / pieces) positions.

    Parameters
    ----------
    tiling : dict
        The host tiling of the call (``run_cpu_model(...)["tiling"]``).
    seq_lens : list of int
        Lengths clamped into [0, max_seq_len].
    """
    cap, min_len = tiling["splitCap"], tiling["minSplitLen"]
    u = 1
    if cap > 1:
        u, longest = cap, max([int(n) for n in seq_lens] + [0])
        while u > 1 and u * min_len > longest:
            u -= 1
    pieces = []
    for n in (int(x) for x in seq_lens):
        if u <= 1 or n == 0:
            pieces.append(1 if n else 0)
            continue
        want = min(u, max(1, n // min_len))
        per = -(-n // want)
        pieces.append(-(-n // per))
    return u, pieces


def split_workspace_reads(tiling: dict, seq_lens: list[int]) -> int:
    """GM -> UB bytes of the kernel's split bookkeeping (0 when nothing is split).

    A (sequence, KV head) pair in p > 1 pieces (:func:`split_plan`): its combine reads the p
    running maxima (``pairWidth`` floats each; with group selection and pre_softmax also the
    p kept maxima) and the p partial records (``partFloats`` floats each); for post_softmax
    each of its p pass-B items also reads the p (m, Z) pairs (2 x ``pairWidth`` floats). The
    post_softmax score round trip is not included (4 bytes per query head and position,
    computed by the bench harness).
    """
    _u, pieces = split_plan(tiling, seq_lens)
    pw, rec = 4 * tiling["pairWidth"], 4 * tiling["partFloats"]
    post = tiling["placement"] == Placement.POST_SOFTMAX
    maxima = 2 if (not post and tiling["selection"] == Selection.GROUP) else 1
    total = 0
    for p in pieces:
        if p > 1:
            total += tiling["numKvHeads"] * (p * (maxima * pw + rec) + (p * p * 2 * pw if post else 0))
    return total


def v_fetch_plan(kept: list, tiling: dict, seq_lens: list[int], elem_bytes: int,
                 block_table: Optional[torch.Tensor] = None) -> dict:
    """Mirror of the kernel's V copy plan (``PlanSpans`` in ``topth_select.h``): V rows
    fetched and copy spans, from the kept-union masks.

    In each selection tile (``tileK`` positions in pre_softmax, 64 in post_softmax's pass B)
    of each piece (:func:`split_plan`), a run of kept
    positions is merged with the next run when the last byte of the one and the first byte
    of the other (GM offsets from the cache's start) lie in the same ``mergeGapBytes``
    granule, inside one cache block; the rows between are fetched too (and zeroed in UB).

    Parameters
    ----------
    kept : list
        ``kept[b][g]``: bool array of length n_b, the union over KV head g's query heads.
    tiling : dict
        The call's tiling.
    seq_lens : list of int
        Lengths clamped into [0, max_seq_len].
    elem_bytes : int
        Bytes per element of the caches.
    block_table : torch.Tensor, optional
        The block table of paged caches (entries clamped into [0, num_blocks - 1]).

    Returns
    -------
    dict
        ``fetched_rows`` (all rows copied), ``kept_rows``, ``spans`` (merged spans),
        ``copies`` (V copy instructions: a span is cut at batch and cache-block boundaries),
        ``score_tiles`` (selection tiles, over KV heads and pieces).
    """
    # selection runs per K tile in pre_softmax (one pass), per 64-position score tile in
    # post_softmax's pass B
    W = tiling["tileK"] if tiling["placement"] == Placement.PRE_SOFTMAX else 64
    bs, granule = tiling["blockSize"], tiling["mergeGapBytes"]
    s_blk, s_h, s_slot, D = tiling["vStrideBlk"], tiling["vStrideH"], tiling["vStrideSlot"], tiling["headDim"]
    table = None if block_table is None else block_table.to(torch.int64).clamp(0, tiling["numBlocks"] - 1).tolist()
    _u, pieces = split_plan(tiling, seq_lens)

    def offset(b, g, p):  # bytes from the start of the value cache
        blk = table[b][p // bs] if table is not None else b
        return (blk * s_blk + g * s_h + (p % bs) * s_slot) * elem_bytes

    tile_v = tiling["tileV"]
    fetched = kept_rows = spans = copies = tiles = 0
    for b, n in enumerate(int(x) for x in seq_lens):
        if n == 0:
            continue
        per = -(-n // pieces[b]) if pieces[b] > 1 else n
        for g in range(len(kept[b])):
            mask = kept[b][g]
            for c0 in range(0, n, per):
                c1 = min(n, c0 + per)
                for pos in range(c0, c1, W):
                    tiles += 1
                    idx = [pos + j for j in range(min(W, c1 - pos)) if mask[pos + j]]
                    kept_rows += len(idx)
                    tile_spans = []  # [first position, one past the last]
                    for p in idx:
                        if tile_spans and (p == tile_spans[-1][1] or (
                                granule and (tile_spans[-1][1] - 1) // bs == p // bs
                                and (offset(b, g, tile_spans[-1][1] - 1) + D * elem_bytes - 1) // granule
                                == offset(b, g, p) // granule)):
                            tile_spans[-1][1] = p + 1
                        else:
                            tile_spans.append([p, p + 1])
                    spans += len(tile_spans)
                    rows = [p for s0, s1 in tile_spans for p in range(s0, s1)]
                    fetched += len(rows)
                    # copies: per batch of tile_v fetched rows, one per stretch of a span inside
                    # one cache block (IssueV -> CopySeqRows)
                    for first in range(0, len(rows), tile_v):
                        batch = rows[first:first + tile_v]
                        copies += 1 + sum(1 for x, y in zip(batch, batch[1:]) if y != x + 1 or y % bs == 0)
    return {"fetched_rows": fetched, "kept_rows": kept_rows, "spans": spans, "copies": copies,
            "score_tiles": tiles}


def kept_union_masks(inputs: DecodeInputs) -> list:
    """``[b][g]`` bool numpy arrays of the kept-union positions, selected again in float32
    with torch as the contract defines it (for the declared byte expectations of benchmarks,
    whose planted inputs keep every score far from its threshold)."""
    from .torch_ref import dense_caches, per_sequence_rows

    n = inputs.seq_lens.to(torch.int64).clamp(0, inputs.max_seq_len)
    k, _v = dense_caches(inputs, n)
    B, Hq, D = inputs.query.shape
    Hkv, G, S = inputs.num_kv_heads, inputs.group_size, inputs.max_seq_len
    a = torch.einsum("bkgd,bksd->bkgs", inputs.query.float().reshape(B, Hkv, G, D), k.float()) * inputs.scale
    valid = torch.arange(S, device=a.device)[None, :] < n[:, None]
    a = torch.where(valid[:, None, None, :], a, float("-inf"))
    theta = per_sequence_rows(inputs, inputs.thresholds_3d(), n)
    if inputs.placement == "pre_softmax":
        x, cut = a, theta
    else:
        # -inf where a = -inf (a head whose every score is -inf: not -inf - -inf = NaN)
        x = torch.where(a == float("-inf"), float("-inf"), a - torch.logsumexp(a, dim=-1, keepdim=True))
        cut = torch.where(theta > 0, torch.log(theta), float("-inf"))
        cut = torch.where(torch.isnan(theta), theta, cut)
    if inputs.selection == "group":
        union = x.amax(dim=2) > cut[:, :, None]
    else:
        union = (x > cut.view(B, Hkv, G, 1)).any(dim=2)
    union &= valid[:, None, :]
    return [[union[b, g, : int(n[b])].cpu().numpy() for g in range(Hkv)] for b in range(B)]
