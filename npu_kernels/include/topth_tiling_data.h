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

// Width of a score tile: positions per tile in the selection step (one 256-byte vector
// repeat of float32 per query head). K tiles (tileK rows) divide it.
#define TOPTH_TILE_W 64u
// Pair vectors hold one float per query head at even positions (value, index slot).
#define TOPTH_NUM_PAIR_VECS 12u

struct TopthTilingData {
    // workspace layout, bytes from the workspace base (all 32-byte aligned)
    uint64_t wsSyncOff;    // SyncAll soft-sync area: blockDim * 32 bytes, zeroed by the host
    uint64_t wsScoresOff;  // post_softmax: scores [B, Hkv, G, S] float32
    uint64_t wsStatsOff;   // post_softmax with splits: per item (m, Z) pair vectors
    uint64_t wsPartOff;    // splits: per item partial record (partFloats floats)
    uint64_t wsBytes;      // total workspace bytes
    // problem
    uint32_t batch, numQHeads, numKvHeads, group, maxSeqLen, headDim, headDimPad, maxRowId;
    uint32_t dtype, elemBytes, placement, sdc, vmc, reserved0;
    float scale, sdcGamma;
    // work split
    uint32_t blockDim, splitNum, splitLen, numItems, numPairs;
    uint32_t tileK, tileV, pairWidth, partFloats;
    // unified-buffer plan: bytes of each buffer (0: not allocated), and their sum
    uint32_t ubKIn, ubKF32, ubProd, ubQ, ubAcc, ubTile, ubMask, ubVIn, ubVF32, ubWc, ubWb;
    uint32_t ubPair, ubPairB, ubStage, ubMu, ubCmb, ubMAll, ubSync, ubStat, ubSIn, ubTotal;
    uint32_t reserved1;
};

#endif  // TOPTH_TILING_DATA_H
