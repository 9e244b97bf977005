// Tiling data of the topth decode-attention kernel: computed on the host
// (topth_tiling.h), copied to device memory, read by every block at kernel start.
// Plain struct, no includes: the kernel includes it after kernel_operator.h, the host
// after <cstdint>. Host and device are both little-endian with the same alignment rules,
// so the layout is identical; the kernel reads it word by word (sizeof is a multiple of 8).
#ifndef TOPTH_TILING_DATA_H
#define TOPTH_TILING_DATA_H

// dtype codes
#define TOPTH_DTYPE_FP16 0u
#define TOPTH_DTYPE_BF16 1u
#define TOPTH_DTYPE_FP32 2u
// placement codes
#define TOPTH_PRE_SOFTMAX 0u
#define TOPTH_POST_SOFTMAX 1u
// sdc codes
#define TOPTH_SDC_NONE 0u
#define TOPTH_SDC_EXACT 1u
#define TOPTH_SDC_EXP_THRESHOLD 2u
#define TOPTH_SDC_OFFLINE 3u
// selection codes
#define TOPTH_SELECT_HEAD 0u
#define TOPTH_SELECT_GROUP 1u
// all-core synchronisation of the split-KV combine
#define TOPTH_SYNC_HARD 1u  // SyncAll<true>() of a mix kernel (hardware flags)
#define TOPTH_SYNC_SOFT 0u  // SyncAll(gm, ub, n): software flags in a zeroed GM area

// Width of a score tile: positions per tile in the selection step (one 256-byte vector
// repeat of float32 per query head). K tiles (tileK rows) divide it.
#define TOPTH_TILE_W 64u
// Pair vectors hold one float per query head at even positions (value, index slot).
#define TOPTH_NUM_PAIR_VECS 12u
// Group selection with pre_softmax: a head's kept rows may all lie far below its own maximum,
// so its kept weights and accumulators are relative to the maximum over its kept rows (the
// kept reference, docs/semantics.md "A head's kept rows far below its own maximum"). That
// takes one more pair vector, and one more in each split's partial record.
#define TOPTH_KEPT_REF(selection, placement) \
    ((selection) == TOPTH_SELECT_GROUP && (placement) == TOPTH_PRE_SOFTMAX ? 1u : 0u)
// Pair vectors at the head of a split's partial record: [M, R, E, K], and MK (the kept
// reference) with TOPTH_KEPT_REF.
#define TOPTH_RECORD_PAIRS(selection, placement) (4u + TOPTH_KEPT_REF(selection, placement))
// The Ascend C API keeps a scratch area in the top 8 KiB of the unified buffer (Select in
// tensor-scalar / tensor-tensor mode writes 32 bytes at 184 KiB on Atlas A2, whose UB is
// 192 KiB): the tiling never plans buffers there.
#define TOPTH_UB_API_RESERVE 8192u

struct TopthTilingData {
    // workspace layout, bytes from the workspace base (all 32-byte aligned)
    uint64_t wsSyncOff;    // soft SyncAll area: blockDim * 32 bytes, zeroed by the host
    uint64_t wsScoresOff;  // post_softmax: scores [pairs, G, maxSeqLen] float32
    uint64_t wsStatsOff;   // post_softmax with splits: per item (m, Z) pair vectors
    uint64_t wsPartOff;    // splits: per item partial record (partFloats floats)
    uint64_t wsRingOff;    // cube path: score ring [aivCount][ringSlots][G][64] float32 (last)
    uint64_t wsBytes;      // total workspace bytes
    // KV caches, in elements: row (block blk, kv head h, slot s) of K starts at
    // blk*kStrideBlk + h*kStrideH + s*kStrideSlot (head_dim contiguous); likewise V.
    // Contiguous BNSD caches are one block of maxSeqLen slots per sequence (block = batch
    // index). kSpan / vSpan: elements from the first to one past the last addressable one.
    uint64_t kStrideBlk, kStrideH, kStrideSlot, vStrideBlk, vStrideH, vStrideSlot, kSpan, vSpan;
    // problem
    uint32_t batch, numQHeads, numKvHeads, group, maxSeqLen, headDim, headDimPad, maxRowId;
    uint32_t dtype, elemBytes, placement, sdc, vmc, selection;
    // paged caches: block_table [batch, maxBlocksPerSeq] int32 (paged == 0: no table, the
    // block of sequence b is b and blockSize == maxSeqLen)
    uint32_t paged, blockSize, numBlocks, maxBlocksPerSeq;
    // thresholds [numSets, thHeads, maxRowId] float32 (thHeads = numQHeads for "head",
    // numKvHeads for "group"); hasSets: threshold_set [batch] int32 is read (clamped)
    uint32_t numSets, thHeads, hasSets, syncMode;
    float scale, sdcGamma;
    // work split: splitCap splits at most per (batch, kv head) pair; the kernel picks the
    // count from the actual lengths (each split >= minSplitLen positions)
    uint32_t blockDim, splitCap, minSplitLen, numPairs;
    uint32_t tileK, tileV, pairWidth, partFloats;
    // unified-buffer plan: bytes of each buffer (0: not allocated), and their sum
    uint32_t ubKIn, ubKF32, ubProd, ubQ, ubAcc, ubTile, ubMask, ubVIn, ubVF32, ubWc, ubWb;
    uint32_t ubPair, ubPairB, ubStage, ubMu, ubCmb, ubMAll, ubSync, ubStat, ubSIn, ubTotal;
    uint32_t ubLimit;  // bytes the plan may use (the unified buffer less the API reserve)
    // V rows: two runs of kept positions inside one cache block are fetched with one copy
    // (the rows between them too, zeroed in UB) when the end of the one and the start of
    // the other lie in the same GM granule of this many bytes (a DRAM access fetches it
    // whole anyway; 0: never merge)
    uint32_t mergeGapBytes;
    // K and V are read once per call: when together they exceed 1.2 x the L2 cache (IFA's
    // rule), the kernel turns L2 caching off for them (GlobalTensor::SetL2CacheHint) so the
    // stream does not evict what other data the L2 holds
    uint32_t l2CacheOff;
    // Cube path: a mix kernel (KERNEL_TYPE_MIX_AIC_1_2, entry topth_decode_attn_cube,
    // blockDim AI cores) whose cube core computes the scores Q.K^T of 64-position tiles for
    // its two vector cores and hands them over through a GM ring of ringSlots tiles per
    // vector core (cross-core flags); the vector cores do everything from the scores on.
    // 0: the all-vector kernel (entry topth_decode_attn, blockDim vector cores).
    uint32_t cubePath;
    uint32_t aivCount;   // vector cores taking work items (blockDim, or 2 x blockDim on the cube path)
    uint32_t ringSlots;  // score tiles one vector core may have in flight (<= 15: flag counters)
    uint32_t mPad, kPad; // G and head_dim rounded up to 16 (Q rows, the K dimension of the cube)
    uint32_t l1Q, l1K, l0aQ, l0bK, l0c;  // cube-core buffer bytes: query (both AIVs' items), one K tile, one score tile
    // 1: the first V batch of the next selection tile is copied while the last batch of the
    // current one is accumulated (a second weights buffer in UB)
    uint32_t vPrefetch;
    // heads whose broadcast V weights fit UB at once: P.V row by row for that many heads
    // (one barrier per row) when it takes fewer barriers than head by head
    uint32_t wbHeads;
};

#endif  // TOPTH_TILING_DATA_H
