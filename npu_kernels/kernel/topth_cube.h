// The cube core (AIC) of the mix kernel (cube path, the design after
// IncrementalFlashAttention's GQA path): per ring step it computes the scores Q.K^T of one
// 64-position tile for the work item of each of the two vector cores (AIV) of its AI core
// and hands them over through a GM ring with cross-core flags; the vector cores do
// everything from the scores on (topth_scores.h StreamRing, topth_select.h).
//
// Per tile: K rows GM -> L1 (DataCopy ND2NZ, one copy per cache-block stretch: the tile in
// Nz, 64 rows per column block), L1 -> L0B (LoadData: that Nz layout is K^T in the Zn
// layout Mmad takes for the right matrix), Mmad with the group's query (left matrix: G rows
// zero-padded to mPad, loaded once per item GM -> L1 -> L0A in Zz) into L0C (float32), and
// Fixpipe (NZ -> ND) of the G x 64 scores into the vector core's ring slot. Double-buffered
// queues (B1, B2, CO1) let the copy of the next K tile overlap the cube and Fixpipe work of
// the current one; the ring lets the cube core run up to ringSlots steps ahead of the
// vector cores (FLAG_SCORES_READY after the Fixpipes of a step, FLAG_SLOT_FREE from both
// vector cores once they have copied a step's tiles to UB).
#ifndef TOPTH_CUBE_H
#define TOPTH_CUBE_H

#include "topth_finalize.h"

namespace topth {

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::InitCube(const KernelArgs& a, const TopthTilingData& tiling, TPipe* tpipe)
{
    td = tiling;
    pipe = tpipe;
    G = td.group;
    D = td.headDim;
    Dp = td.headDimPad;
    PW = td.pairWidth;
    S = td.maxSeqLen;
    const uint64_t B = td.batch, Hq = td.numQHeads;
    qGm.SetGlobalBuffer((__gm__ T*)a.query, B * Hq * D);
    kGm.SetGlobalBuffer((__gm__ T*)a.key, td.kSpan);
    if (td.l2CacheOff) kGm.SetL2CacheHint(CacheMode::CACHE_MODE_DISABLE);
    lensGm.SetGlobalBuffer((__gm__ int32_t*)a.seqLens, B);
    if (td.paged) tableGm.SetGlobalBuffer((__gm__ int32_t*)a.blockTable, B * td.maxBlocksPerSeq);
    if (td.hasSets) setGm.SetGlobalBuffer((__gm__ int32_t*)a.thresholdSet, B);
    ringGm.SetGlobalBuffer((__gm__ float*)(a.workspace + td.wsRingOff), uint64_t(td.aivCount) * td.ringSlots * G * W);

    // L1, L0A, L0B, L0C: sizes from the host tiling (multiples of 512 / 1024 bytes, so that
    // every buffer starts on the alignment LoadData and Mmad need).
    pipe->InitBuffer(qL1Buf, td.l1Q);
    pipe->InitBuffer(kL1Que, 2, td.l1K);
    pipe->InitBuffer(qL0Buf, td.l0aQ);
    pipe->InitBuffer(kL0Que, 2, td.l0bK);
    pipe->InitBuffer(cQue, 2, td.l0c);
    qL1 = qL1Buf.Get<T>();
    qL0 = qL0Buf.Get<T>();
    // Rows G..mPad-1 of both queries stay 0 (the ND2NZ copies write rows 0..G-1 only): the
    // cube multiplies mPad rows and nothing undefined (NaN) may enter it. The copies into
    // the same L1 bytes come after on the same pipe: MTE2 does not order overlapping writes
    // by itself.
    InitConstValue(qL1, InitConstValueParams<T>(1, static_cast<uint16_t>(td.l1Q / 32), 0, T(0.0f)));
    if (!TOPTH_MODEL_FAULT(no_mte2_barrier)) PipeBarrier<PIPE_MTE2>();
}

// Addressing state (bIdx, kvIdx: cache rows and block table) of vector core `sub`'s item.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::UseCubeItem(uint32_t sub)
{
    pairIdx = ci[sub].pair;
    bIdx = ci[sub].b;
    kvIdx = ci[sub].kv;
    cachedBlkIdx = 0xffffffffu;
    TOPTH_MODEL_OWNER(bIdx, kvIdx);
}

// The query of each active item: GM -> L1 (ND2NZ, G rows of D, mPad rows per column block)
// -> L0A (Nz -> Zz: one LoadData per 16-row block).
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::LoadQueries(uint32_t active)
{
    const uint32_t mb = td.mPad / 16, kb = td.kPad / 16, qElems = td.mPad * td.kPad;
    Sync<HardEvent::MTE1_MTE2>();  // the previous round's LoadData has read L1
    for (uint32_t sub = 0; sub < 2; ++sub) {
        if (!(active & (1u << sub))) continue;
        UseCubeItem(sub);
        const uint64_t off = (uint64_t(bIdx) * td.numQHeads + uint64_t(kvIdx) * G) * D;
        DataCopy(qL1[sub * qElems], qGm[off],
                 Nd2NzParams(1, static_cast<uint16_t>(G), static_cast<uint16_t>(D), 0, static_cast<uint16_t>(D),
                             static_cast<uint16_t>(td.mPad), 1, 0));
    }
    Sync<HardEvent::MTE2_MTE1>();
    Sync<HardEvent::M_MTE1>();  // the previous round's Mmads have read L0A
    for (uint32_t sub = 0; sub < 2; ++sub) {
        if (!(active & (1u << sub))) continue;
        for (uint32_t m = 0; m < mb; ++m) {
            LoadData(qL0[sub * qElems + m * kb * 256], qL1[sub * qElems + m * 256],
                     LoadData2DParams(0, static_cast<uint8_t>(kb), static_cast<uint16_t>(mb), 0, 0, false, 0));
        }
    }
    Sync<HardEvent::MTE1_M>();
}

// Positions [pos, pos + rows) of this item's K rows into L1 as an Nz tile of W rows, one
// ND2NZ copy per stretch inside one cache block.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::CopyKTileL1(const LocalTensor<T>& dst, uint32_t pos, uint32_t rows)
{
    uint32_t done = 0;
    while (done < rows) {
        const uint32_t p = pos + done;
        const uint32_t i = p / td.blockSize;
        const uint32_t slot = p - i * td.blockSize;
        const uint32_t seg = Min32(rows - done, td.blockSize - slot);
        const uint64_t off = uint64_t(BlockOf(i)) * td.kStrideBlk + uint64_t(kvIdx) * td.kStrideH + uint64_t(slot) * td.kStrideSlot;
        DataCopy(dst[done * 16], kGm[off],
                 Nd2NzParams(1, static_cast<uint16_t>(seg), static_cast<uint16_t>(D), 0,
                             static_cast<uint16_t>(td.kStrideSlot), static_cast<uint16_t>(W), 1, 0));
        done += seg;
    }
}

// Tile s of vector core `sub`'s item: scores of G heads x up to 64 positions into its ring
// slot of step `step`.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::CubeTile(uint32_t sub, uint32_t s, uint64_t step)
{
    UseCubeItem(sub);
    const uint32_t pos = ci[sub].start + s * W;
    const uint32_t rows = Min32(W, ci[sub].end - pos);
    const uint32_t nPad = CeilDiv(rows, 16) * 16, nb = nPad / 16, kb = td.kPad / 16;
    LocalTensor<T> kL1 = kL1Que.template AllocTensor<T>();
    CopyKTileL1(kL1, pos, rows);
    kL1Que.EnQue(kL1);
    kL1 = kL1Que.template DeQue<T>();
    LocalTensor<T> kL0 = kL0Que.template AllocTensor<T>();
    const uint32_t l0Off = TOPTH_MODEL_FAULT(l0b_misaligned) ? 16 : 0;
    if (nb == W / 16) {  // a whole tile: the Nz tile is the Zn matrix, fractal for fractal
        LoadData(kL0[l0Off], kL1, LoadData2DParams(0, static_cast<uint8_t>(kb * nb), 1, 0, 0, false, 0));
    } else {  // the last tile: nb of the W / 16 row fractals of each column block
        for (uint32_t k = 0; k < kb; ++k) {
            LoadData(kL0[l0Off + k * nb * 256], kL1[k * (W / 16) * 256],
                     LoadData2DParams(0, static_cast<uint8_t>(nb), 1, 0, 0, false, 0));
        }
    }
    kL1Que.FreeTensor(kL1);
    kL0Que.EnQue(kL0);
    kL0 = kL0Que.template DeQue<T>();
    LocalTensor<float> c = cQue.template AllocTensor<float>();
    MmadParams mp;
    mp.m = static_cast<uint16_t>(td.mPad);
    mp.n = static_cast<uint16_t>(rows);
    mp.k = static_cast<uint16_t>(D);
    mp.cmatrixInitVal = true;
    Mmad(c, qL0[sub * td.mPad * td.kPad], kL0[l0Off], mp);
    kL0Que.FreeTensor(kL0);
    FixpipeParamsV220 fp(static_cast<uint16_t>(nPad), static_cast<uint16_t>(G), static_cast<uint16_t>(td.mPad), W, false);
    fp.quantPre = QuantMode_t::NoQuant;
    GlobalTensor<float> slot = ringGm[((uint64_t(2) * GetBlockIdx() + sub) * td.ringSlots + step % td.ringSlots) * G * W];
    if (TOPTH_MODEL_FAULT(fixpipe_before_mmad)) {  // reads L0C without waiting for the cube
        Fixpipe(slot, c, fp);
        cQue.EnQue(c);
        c = cQue.template DeQue<float>();
    } else {
        cQue.EnQue(c);
        c = cQue.template DeQue<float>();
        Fixpipe(slot, c, fp);
    }
    cQue.FreeTensor(c);
}

// Rounds in step with the vector cores (TopthDecodeKernel::Process): round r takes the items
// of both vector cores, 2 * block + sub + r * aivCount; each ring step one tile of each.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::ProcessCube()
{
    PlanSplits();
    const uint32_t items = td.numPairs * splits;
    const uint32_t nAiv = GetBlockNum() * 2;
    const uint32_t blk = GetBlockIdx();
    for (uint32_t r = 0; r < CeilDiv(items, nAiv); ++r) {
        uint32_t steps = 0, active = 0;
        for (uint32_t sub = 0; sub < 2; ++sub) {
            const uint32_t item = 2 * blk + sub + r * nAiv;
            ci[sub].tiles = 0;
            if (item < items && SetItem(item) && chunkStart < chunkEnd) {
                ci[sub] = CubeItem{pairIdx, bIdx, kvIdx, chunkStart, chunkEnd, CeilDiv(chunkEnd - chunkStart, W)};
                active |= 1u << sub;
                steps = ci[sub].tiles > steps ? ci[sub].tiles : steps;
            }
        }
        if (steps == 0) continue;
        LoadQueries(active);
        for (uint32_t s = 0; s < steps; ++s) {
            // the slots of this step were read ringSlots steps ago
            if (ringStep >= td.ringSlots && !TOPTH_MODEL_FAULT(overwrite_ring_slot)) CrossCoreWaitFlag(FLAG_SLOT_FREE);
            for (uint32_t sub = 0; sub < 2; ++sub) {
                if (s < ci[sub].tiles) CubeTile(sub, s, ringStep);
            }
            CrossCoreSetFlag<2, PIPE_FIX>(FLAG_SCORES_READY);
            ringStep++;
        }
    }
    // every FLAG_SLOT_FREE the vector cores set is taken
    const uint64_t pending = ringStep < td.ringSlots ? ringStep : td.ringSlots;
    for (uint64_t i = 0; i < pending; ++i) {
        if (!(TOPTH_MODEL_FAULT(overwrite_ring_slot) && i + 1 == pending)) CrossCoreWaitFlag(FLAG_SLOT_FREE);
    }
}

}  // namespace topth

#endif  // TOPTH_CUBE_H
