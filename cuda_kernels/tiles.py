"""Device helpers shared by every stage: lengths and set indices read through their
strides and clamped in their own dtype, split ranges, KV row addresses through the block
table, tile loads and the two tensor-core products (q k^T and p v).

Cache addressing (contract v0.2): position j of sequence b is slot ``j % block_size`` of
block ``block_table[b, j // block_size]``; a BNSD cache is one block of ``max_seq_len``
slots per sequence (block = b, ``PAGING`` 0, no table read). Every cache is addressed as
``base + block * s_block + kv_head * s_head + slot * s_slot + d * s_dim`` in elements, so
NHD, HND and BNSD (any strides) share one code path.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def clamped_len(LENS, stride_l, b, max_seq_len):
    """n = clamp(seq_lens[b], 0, max_seq_len), compared in seq_lens' own dtype (an int64
    1 << 40 clamps to max_seq_len, it never wraps through int32 first), then int32."""
    n = tl.load(LENS + b.to(tl.int64) * stride_l)
    n = tl.minimum(tl.maximum(n, 0), max_seq_len)
    return n.to(tl.int32)


@triton.jit
def set_index(TSET, stride_ts, b, num_sets, HAS_SETS: tl.constexpr):
    """threshold_set[b] clamped into [0, num_sets - 1] in its own dtype (0 without sets)."""
    if HAS_SETS:
        s = tl.load(TSET + b.to(tl.int64) * stride_ts)
        s = tl.minimum(tl.maximum(s, 0), num_sets - 1).to(tl.int32)
    else:
        s = b * 0
    return s


@triton.jit
def row_index(n, max_row_id):
    """Threshold column of row id n: min(max(n, 1), max_row_id) - 1."""
    return tl.minimum(tl.maximum(n, 1), max_row_id) - 1


@triton.jit
def split_range(n, pid_s, num_splits, BLOCK_N: tl.constexpr):
    """[start, end) of split pid_s: ceil(n / num_splits) rounded up to whole tiles."""
    per = tl.cdiv(n, num_splits)
    chunk = tl.cdiv(per, BLOCK_N) * BLOCK_N
    start = pid_s * chunk
    end = tl.minimum(start + chunk, n)
    return start, end


@triton.jit
def program_tile(LENS, stride_l, num_kv_heads, max_seq_len, num_splits, G, D,
                 G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """The work of program (b * Hkv + kv head, split) of the split-KV grid, shared by every
    kernel's prologue: (pid_s, b, kvh, n, start, end, offs_g, gmask, h, offs_d, dmask) with
    n the clamped length, [start, end) the split's positions, h the group's query heads
    (offs_g < G valid) and offs_d < D the valid head_dim lanes."""
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads
    n = clamped_len(LENS, stride_l, b, max_seq_len)
    start, end = split_range(n, pid_s, num_splits, BLOCK_N)
    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    h = kvh * G + offs_g
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    return pid_s, b, kvh, n, start, end, offs_g, gmask, h, offs_d, dmask


@triton.jit
def row_offsets(BT, stride_btb, stride_bti, b, pos, pmask, tile_start, block_size, block_shift, num_blocks,
                s_block_k, s_slot_k, s_block_v, s_slot_v, PAGING: tl.constexpr):
    """Element offsets (int64) of the K and V rows of positions ``pos`` of sequence b.

    ``PAGING``: 0, BNSD (block = b, slot = position); paged, the table entry of each
    position is read only where ``pmask`` (entries past the sequence's blocks are never
    read) and clamped into [0, num_blocks - 1], so unchecked tables never address
    outside the cache: 1, a contiguous tile inside one block (block_size a multiple of
    the tile; ``tile_start`` is its first position): one table entry per tile; 2, a
    power-of-two block size (``block_shift`` = log2): shift and mask per row; 3, any
    block size: a division per row.
    """
    if PAGING == 0:
        slot = pos.to(tl.int64)
        blk = b.to(tl.int64)
    elif PAGING == 1:
        blk_i = tile_start // block_size
        slot = (pos - blk_i * block_size).to(tl.int64)
        blk = tl.load(BT + b.to(tl.int64) * stride_btb + blk_i.to(tl.int64) * stride_bti)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
    else:
        if PAGING == 2:
            blk_i = pos >> block_shift
            slot = (pos & (block_size - 1)).to(tl.int64)
        else:
            blk_i = pos // block_size
            slot = (pos - blk_i * block_size).to(tl.int64)
        blk = tl.load(BT + b.to(tl.int64) * stride_btb + blk_i.to(tl.int64) * stride_bti,
                      mask=pmask, other=0)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
    return blk * s_block_k + slot * s_slot_k, blk * s_block_v + slot * s_slot_v


@triton.jit
def load_rows(base, off, rmask, offs_d, dmask, s_dim, EVEN_D: tl.constexpr):
    """Rows ``base + off[i]`` of a cache, [len(off), D_PAD]; rows where ``rmask`` is off are
    never read (predicated; they are zero)."""
    ptrs = base + off[:, None] + offs_d[None, :] * s_dim
    if EVEN_D:
        x = tl.load(ptrs, mask=rmask[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=rmask[:, None] & dmask[None, :], other=0.0)
    return x


@triton.jit
def dot_qk(q, k, DOT_PREC: tl.constexpr):
    """q k^T: [G_PAD, D_PAD] x [BLOCK_N, D_PAD] -> [G_PAD, BLOCK_N] fp32 on tensor cores
    (16-bit inputs) or as exact fp32 products (``DOT_PREC="ieee"``). The head tile has at
    least 16 rows even for one query head per KV head: the padded rows cost tensor-core
    throughput, which a decode kernel has in excess, while a CUDA-core product costs
    3.6x more instructions per byte (docs/triton.md, "One query head per KV head")."""
    return tl.dot(q, tl.trans(k), input_precision=DOT_PREC, out_dtype=tl.float32)


@triton.jit
def dot_pv(p, v, DOT_PREC: tl.constexpr):
    """p v: [G_PAD, BLOCK_N] x [BLOCK_N, D_PAD] -> [G_PAD, D_PAD] fp32; ``p`` is already in
    the product's operand dtype (v's dtype for 16-bit inputs: one tensor-core product per
    tile, as FlashAttention does)."""
    return tl.dot(p, v, input_precision=DOT_PREC, out_dtype=tl.float32)
