// Work split from the actual lengths, per-sequence lookups (length, threshold set, row id)
// and the cache addressing through the block table.
#ifndef TOPTH_PLAN_H
#define TOPTH_PLAN_H

#include "topth_kernel.h"

namespace topth {

// n = seq_lens[b], clamped into [0, max_seq_len] (no read past the cache; the host glue
// clamps int64 lengths in their own range before the int32 conversion).
template <typename T>
__aicore__ inline uint32_t TopthDecodeKernel<T>::SeqLen(uint32_t b)
{
    const int32_t len = lensGm.GetValue(b);
    if (len < 0) return 0;
    return static_cast<uint32_t>(len) > S ? S : static_cast<uint32_t>(len);
}

// Splits per pair for this launch, identical on every block: the tiling's cap, lowered
// until the longest sequence gives each split >= minSplitLen positions (IFA's rule, applied
// to the lengths in seq_lens rather than to the cache capacity).
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::PlanSplits()
{
    splits = 1;
    if (td.splitCap <= 1) return;
    uint32_t maxN = 0;
    for (uint32_t b = 0; b < td.batch; ++b) {
        const uint32_t len = SeqLen(b);
        maxN = len > maxN ? len : maxN;
    }
    splits = td.splitCap;
    while (splits > 1 && uint64_t(splits) * td.minSplitLen > maxN) --splits;
}

// Pieces of a sequence of `len` positions (0 or 1: one item does everything) and the
// positions per piece: as many as `splits` allows with >= minSplitLen positions each.
template <typename T>
__aicore__ inline uint32_t TopthDecodeKernel<T>::Pieces(uint32_t len, uint32_t& lenPerPiece)
{
    lenPerPiece = len;
    if (splits <= 1 || len == 0) return len == 0 ? 0 : 1;
    uint32_t want = len / td.minSplitLen;
    want = want > splits ? splits : (want < 1 ? 1 : want);
    lenPerPiece = CeilDiv(len, want);
    return CeilDiv(len, lenPerPiece);
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::SetPair(uint32_t pair)
{
    pairIdx = pair;
    bIdx = pair / td.numKvHeads;
    kvIdx = pair % td.numKvHeads;
    n = SeqLen(bIdx);
    pieces = Pieces(n, splitLen);
    setIdx = SetOf(bIdx);
    cachedBlkIdx = 0xffffffffu;
    TOPTH_MODEL_OWNER(bIdx, kvIdx);
}

// Item (pair, split); false when this split of the pair has nothing to do.
template <typename T>
__aicore__ inline bool TopthDecodeKernel<T>::SetItem(uint32_t item)
{
    SetPair(item / splits);
    splitIdx = item % splits;
    if (pieces <= 1) {
        chunkStart = 0;
        chunkEnd = n;
        return splitIdx == 0;  // n = 0 too: its output is still written
    }
    if (splitIdx >= pieces) return false;
    chunkStart = splitIdx * splitLen;
    chunkEnd = Min32(n, chunkStart + splitLen);
    return true;
}

template <typename T>
__aicore__ inline uint32_t TopthDecodeKernel<T>::RowIndex(uint32_t len)
{
    return (len < td.maxRowId ? len : td.maxRowId) - 1;
}

// threshold_set[b] clamped into [0, num_sets - 1] (0 without sets).
template <typename T>
__aicore__ inline uint32_t TopthDecodeKernel<T>::SetOf(uint32_t b)
{
    if (!td.hasSets) return 0;
    const int32_t s = setGm.GetValue(b);
    if (s < 0) return 0;
    return static_cast<uint32_t>(s) >= td.numSets ? td.numSets - 1 : static_cast<uint32_t>(s);
}

// Element of thresholds [set, head, row] for query head g of this group ("head") or for
// the group's KV head ("group").
template <typename T>
__aicore__ inline uint64_t TopthDecodeKernel<T>::ThIndex(uint32_t g, uint32_t row)
{
    const uint32_t h = td.selection == TOPTH_SELECT_GROUP ? kvIdx : kvIdx * G + g;
    return (uint64_t(setIdx) * td.thHeads + h) * td.maxRowId + row;
}

// Element of sdc_table [set, query head, row] (always per query head).
template <typename T>
__aicore__ inline uint64_t TopthDecodeKernel<T>::SdcIndex(uint32_t g, uint32_t row)
{
    return (uint64_t(setIdx) * td.numQHeads + kvIdx * G + g) * td.maxRowId + row;
}

// Cache block of block index i of this sequence: block_table[b, i] clamped into
// [0, num_blocks - 1] (paged), or b (contiguous: one block per sequence). Only indices of
// used blocks (i < ceil(n / block_size)) are ever asked for.
template <typename T>
__aicore__ inline uint32_t TopthDecodeKernel<T>::BlockOf(uint32_t i)
{
    if (!td.paged) return bIdx;
    if (i != cachedBlkIdx) {
        const int32_t blk = tableGm.GetValue(uint64_t(bIdx) * td.maxBlocksPerSeq + i);
        cachedBlk = blk < 0 ? 0u : (static_cast<uint32_t>(blk) >= td.numBlocks ? td.numBlocks - 1 : uint32_t(blk));
        cachedBlkIdx = i;
    }
    return cachedBlk;
}

// Element offset of position p's V row of this sequence and KV head.
template <typename T>
__aicore__ inline uint64_t TopthDecodeKernel<T>::VRowOffset(uint32_t p)
{
    const uint32_t i = p / td.blockSize;
    return uint64_t(BlockOf(i)) * td.vStrideBlk + uint64_t(kvIdx) * td.vStrideH +
           uint64_t(p - i * td.blockSize) * td.vStrideSlot;
}

// `rows` rows of D elements, `rowStride` elements apart in GM (the byte gap fits 32 bits:
// host tiling).
template <typename T>
__aicore__ inline DataCopyExtParams TopthDecodeKernel<T>::RowParams(uint32_t rows, uint64_t rowStride)
{
    DataCopyExtParams p;
    p.blockCount = static_cast<uint16_t>(rows);
    p.blockLen = D * sizeof(T);
    p.srcStride = static_cast<uint32_t>((rowStride - D) * sizeof(T));
    p.dstStride = 0;
    p.rsv = 0;
    return p;
}

template <typename T>
__aicore__ inline DataCopyPadExtParams<T> TopthDecodeKernel<T>::RowPad()
{
    DataCopyPadExtParams<T> pad;
    pad.isPad = (Dp != D);
    pad.leftPadding = 0;
    pad.rightPadding = static_cast<uint8_t>(Dp - D);
    pad.paddingValue = T(0.0f);
    return pad;
}

// `rows` rows (`rowStride` elements apart in GM) into UB at a row stride of Dp elements:
// one DataCopy when the rows are dense and whole 32-byte blocks, else DataCopyPad (GM gap
// between rows, padding to 32 bytes in UB).
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::CopyRows(const LocalTensor<T>& dst, const GlobalTensor<T>& src,
                                                      uint32_t rows, uint64_t rowStride)
{
    if (rowAligned && rowStride == D) {
        DataCopy(dst, src, rows * D);
    } else {
        DataCopyPad(dst, src, RowParams(rows, rowStride), RowPad());
    }
}

// Positions [pos, pos + rows) of this sequence's K (isKey) or V rows into UB, one copy per
// stretch inside one cache block (positions j and j + 1 are adjacent in GM only within a
// block).
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::CopySeqRows(const LocalTensor<T>& dst, bool isKey, uint32_t pos,
                                                         uint32_t rows)
{
    const uint64_t sBlk = isKey ? td.kStrideBlk : td.vStrideBlk;
    const uint64_t sH = isKey ? td.kStrideH : td.vStrideH;
    const uint64_t sSlot = isKey ? td.kStrideSlot : td.vStrideSlot;
    const GlobalTensor<T>& gm = isKey ? kGm : vGm;
    uint32_t done = 0;
    while (done < rows) {
        const uint32_t p = pos + done;
        const uint32_t i = p / td.blockSize;
        const uint32_t slot = p - i * td.blockSize;
        const uint32_t seg = Min32(rows - done, td.blockSize - slot);
        const uint64_t off = uint64_t(BlockOf(i)) * sBlk + uint64_t(kvIdx) * sH + uint64_t(slot) * sSlot;
        CopyRows(dst[done * Dp], gm[off], seg, sSlot);
        done += seg;
    }
}

// All-core synchronisation between the split passes. Hard: SyncAll<true>() of a
// KERNEL_TYPE_MIX_AIV_1_0 kernel (hardware flags, ids 11-14), launched in batch schedule
// mode so that no block waits for a block another stream keeps off its core. Soft (a
// fallback for toolchains without the hard form in kernel-launch projects): flags in a
// zeroed GM area, which deadlocks when another stream holds some of the cores
// (docs/ascendc.md, "All-core synchronisation").
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::AllSync()
{
    if (td.syncMode == TOPTH_SYNC_HARD) {
        SyncAll<true>();
    } else {
        LocalTensor<int32_t> syncUb = syncBuf.Get<int32_t>();
        SyncAll(syncGm, syncUb, static_cast<int32_t>(td.blockDim));
    }
}

}  // namespace topth

#endif  // TOPTH_PLAN_H
