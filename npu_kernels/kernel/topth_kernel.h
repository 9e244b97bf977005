// The kernel class: state, buffers, Init and the top-level schedule (Process) of the vector
// cores. Stages: topth_plan.h (work split, addressing), topth_scores.h (K stream or score
// ring, scores), topth_select.h (selection, V gather), topth_kept_ref.h (group selection with
// pre_softmax), topth_finalize.h (combine, output); the mix kernel's cube core: topth_cube.h.
#ifndef TOPTH_KERNEL_H
#define TOPTH_KERNEL_H

#include "topth_common.h"

namespace topth {

template <typename T>
class TopthDecodeKernel {
public:
    __aicore__ inline TopthDecodeKernel() {}
    __aicore__ inline void Init(const KernelArgs& a, const TopthTilingData& tiling, TPipe* tpipe);
    __aicore__ inline void Process();
    // cube core (AIC) of the mix kernel: topth_cube.h
    __aicore__ inline void InitCube(const KernelArgs& a, const TopthTilingData& tiling, TPipe* tpipe);
    __aicore__ inline void ProcessCube();

private:
    // ---- topth_plan.h: work split, lengths, thresholds, cache addressing
    __aicore__ inline uint32_t SeqLen(uint32_t b);
    __aicore__ inline void PlanSplits();
    __aicore__ inline uint32_t Pieces(uint32_t len, uint32_t& splitLen);
    __aicore__ inline bool SetItem(uint32_t item);
    __aicore__ inline void SetPair(uint32_t pair);
    __aicore__ inline uint32_t RowIndex(uint32_t len);
    __aicore__ inline uint32_t SetOf(uint32_t b);
    __aicore__ inline uint64_t ThIndex(uint32_t g, uint32_t row);
    __aicore__ inline uint64_t SdcIndex(uint32_t g, uint32_t row);
    __aicore__ inline uint32_t BlockOf(uint32_t i);
    __aicore__ inline uint64_t VRowOffset(uint32_t p);
    __aicore__ inline DataCopyExtParams RowParams(uint32_t rows, uint64_t rowStride);
    __aicore__ inline DataCopyPadExtParams<T> RowPad();
    __aicore__ inline void CopyRows(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t rows,
                                    uint64_t rowStride);
    __aicore__ inline void CopySeqRows(const LocalTensor<T>& dst, bool isKey, uint32_t pos, uint32_t rows);
    __aicore__ inline LocalTensor<float> Pair(uint32_t slot) { return pairs[slot * PW]; }
    __aicore__ inline void AllSync();

    // ---- item flow (this file)
    __aicore__ inline void RunItem(uint32_t item);
    __aicore__ inline void RunItemRing(uint32_t item, uint32_t partner, uint32_t items);
    __aicore__ inline void BeginItem();
    __aicore__ inline void FinishItem();
    __aicore__ inline void RunItemPassB(uint32_t item);
    __aicore__ inline void ResetAccumulators();
    __aicore__ inline uint32_t TilesOf(uint32_t item, uint32_t items, bool& active);

    // ---- topth_scores.h
    __aicore__ inline void LoadQuery();
    __aicore__ inline void BuildThresholds(bool logDomain);
    __aicore__ inline void CopyKTile(uint32_t pos);
    __aicore__ inline void StreamKeys();
    __aicore__ inline void Scores(LocalTensor<T>& kIn, uint32_t rows);
    __aicore__ inline void RunningMax();
    __aicore__ inline void RescaleStats();
    __aicore__ inline void ScoreTile(uint32_t pos, uint32_t rows);
    __aicore__ inline void CopyRingTile(uint64_t step, uint32_t rows);
    __aicore__ inline void StreamRing(uint32_t steps, uint32_t tiles);
    __aicore__ inline void FetchRing(uint32_t s, uint32_t tiles);
    __aicore__ inline void ScaleRows(const LocalTensor<float>& rows, const LocalTensor<float>& bcast);
    __aicore__ inline void AccumulateZ();
    __aicore__ inline void StoreScores(uint32_t pos, uint32_t rows);
    __aicore__ inline void WriteStatsA(uint64_t rec);
    __aicore__ inline void MergeStatsA();

    // ---- topth_select.h
    __aicore__ inline void CopyScoreTile(uint32_t pos);
    __aicore__ inline void PassB();
    __aicore__ inline void SelectAccumulate(const LocalTensor<float>& s, uint32_t rows, uint32_t pos, bool post);
    // V copy plan of one score tile: spans of positions (runs of kept positions, merged
    // across small gaps), the kept and the fetched positions as bit masks, rows fetched.
    struct VSpans {
        uint32_t start[W];
        uint32_t len[W];
        uint32_t n;
        uint32_t rows;
        uint64_t keptBits;
        uint64_t fetchBits;
    };
    __aicore__ inline void PlanSpans(uint64_t keptBits, uint32_t pos, VSpans& sp);
    __aicore__ inline void IssueV(uint32_t batch, uint32_t pos, const VSpans& sp);
    __aicore__ inline void AccumulateV(uint32_t batch, uint32_t nb, const VSpans& sp, const LocalTensor<float>& w);
    __aicore__ inline void FlushV();

    // ---- topth_kept_ref.h (group selection, pre_softmax: weights relative to the kept maximum)
    __aicore__ inline void KeptWeights(const LocalTensor<float>& s);
    __aicore__ inline void KeptEstimates(uint32_t len, uint32_t row);

    // ---- topth_cube.h (AIC)
    struct CubeItem {
        uint32_t pair, b, kv, start, end, tiles;
    };
    __aicore__ inline void UseCubeItem(uint32_t sub);
    __aicore__ inline void LoadQueries(uint32_t active);
    __aicore__ inline void CopyKTileL1(const LocalTensor<T>& dst, uint32_t pos, uint32_t rows);
    __aicore__ inline void CubeTile(uint32_t sub, uint32_t s, uint64_t step);

    // ---- topth_finalize.h
    __aicore__ inline void WritePartial(uint64_t rec);
    __aicore__ inline void Combine(uint32_t pair);
    __aicore__ inline void Finalize(uint32_t len, uint32_t unionRows);
    __aicore__ inline void WriteOutput();

    // ---------------------------------------------------------------- state
    TopthTilingData td;
    TPipe* pipe = nullptr;
    uint32_t G = 1, D = 1, Dp = 1, PW = 8, S = 1;
    static constexpr bool kWiden = (sizeof(T) != sizeof(float));  // fp16 / bf16: cast to float32 in UB
    bool rowAligned = true;
    bool keptRef = false;  // TOPTH_KEPT_REF: P_R and acc relative to P_MK (topth_kept_ref.h)
    uint32_t recPairs = 4;  // pair vectors of a partial record: [M, R, E, K] (and MK with keptRef)

    GlobalTensor<T> qGm, kGm, vGm, outGm;
    GlobalTensor<int32_t> lensGm, keptGm, vRowsGm, syncGm, partGmI, tableGm, setGm;
    GlobalTensor<float> thGm, sdcGm, muGm, droppedGm, scoresGm, statsGm, partGm;

    TQue<QuePosition::VECIN, 2> kQue, vQue, sQue;
    // cube core: K tiles in L1 (Nz) and L0B (Zn), score tiles in L0C; the queries in L1 / L0A
    TQue<QuePosition::B1, 2> kL1Que;
    TQue<QuePosition::B2, 2> kL0Que;
    TQue<QuePosition::CO1, 2> cQue;
    TBuf<TPosition::A1> qL1Buf;
    TBuf<TPosition::A2> qL0Buf;
    LocalTensor<T> qL1, qL0;
    GlobalTensor<float> ringGm;  // score ring [aivCount][ringSlots][G][W]
    CubeItem ci[2];
    uint64_t ringStep = 0;       // ring steps so far (the AIC and its AIVs count alike)
    TBuf<> kF32Buf, prodBuf, qBuf, accBuf, scBuf, eBuf, ekBuf, indBuf, thrBuf, onesBuf, maskBuf;
    TBuf<> vF32Buf, wcBuf, wbBuf, pairBuf, pairBBuf, stageBuf, muBuf, cmbBuf, mAllBuf, syncBuf, statBuf;

    LocalTensor<float> kF32, prod, qF, acc, sc, ex, ek, ind, thr, ones, vF32, wc, wb, pairs, mB, fB;
    LocalTensor<float> mu, cmb, mAll, statF;
    LocalTensor<int32_t> statI, statU;
    LocalTensor<uint8_t> mask;
    LocalTensor<uint8_t> uBits8;         // the union bit mask as Compare writes it
    LocalTensor<uint32_t> uBits, fBits;  // union and fetch bit masks of a score tile (64 bits each)
    LocalTensor<T> stage;

    uint32_t splits = 1;  // splits per pair in use this launch (<= td.splitCap), from the lengths
    uint32_t pairIdx = 0, splitIdx = 0, bIdx = 0, kvIdx = 0, n = 0, chunkStart = 0, chunkEnd = 0;
    uint32_t pieces = 0, splitLen = 0;  // splits of this pair's sequence, positions per split
    uint32_t setIdx = 0;                // threshold set of this sequence
    uint32_t cachedBlk = 0, cachedBlkIdx = 0xffffffffu;  // block-table entry last read
    uint32_t unionCount = 0;
    float thrScalar = 0.0f;
    // V prefetch: the last batch of the previous selection tile, not yet accumulated
    VSpans spans[2];
    uint32_t tileParity = 0;
    bool vPending = false;
    uint32_t pendBatch = 0, pendNb = 0, pendParity = 0;
};

// ------------------------------------------------------------------ Init / Process

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::Init(const KernelArgs& a, const TopthTilingData& tiling, TPipe* tpipe)
{
    td = tiling;
    pipe = tpipe;
    G = td.group;
    D = td.headDim;
    Dp = td.headDimPad;
    PW = td.pairWidth;
    S = td.maxSeqLen;
    rowAligned = ((D * sizeof(T)) % 32 == 0);
    keptRef = TOPTH_KEPT_REF(td.selection, td.placement) != 0;
    recPairs = TOPTH_RECORD_PAIRS(td.selection, td.placement);  // as the tiling's partFloats

    const uint64_t B = td.batch, Hq = td.numQHeads, Hkv = td.numKvHeads;
    qGm.SetGlobalBuffer((__gm__ T*)a.query, B * Hq * D);
    // The caches may be strided views and paged (host tiling: strides and spans in elements).
    kGm.SetGlobalBuffer((__gm__ T*)a.key, td.kSpan);
    vGm.SetGlobalBuffer((__gm__ T*)a.value, td.vSpan);
    if (td.l2CacheOff) {  // streamed once per call and larger than the L2: do not cache them
        kGm.SetL2CacheHint(CacheMode::CACHE_MODE_DISABLE);
        vGm.SetL2CacheHint(CacheMode::CACHE_MODE_DISABLE);
    }
    lensGm.SetGlobalBuffer((__gm__ int32_t*)a.seqLens, B);
    thGm.SetGlobalBuffer((__gm__ float*)a.thresholds, uint64_t(td.numSets) * td.thHeads * td.maxRowId);
    if (td.sdc == TOPTH_SDC_OFFLINE) {
        sdcGm.SetGlobalBuffer((__gm__ float*)a.sdcTable, uint64_t(td.numSets) * Hq * td.maxRowId);
    }
    if (td.vmc) muGm.SetGlobalBuffer((__gm__ float*)a.valueMean, B * Hkv * D);
    if (td.paged) tableGm.SetGlobalBuffer((__gm__ int32_t*)a.blockTable, B * td.maxBlocksPerSeq);
    if (td.hasSets) setGm.SetGlobalBuffer((__gm__ int32_t*)a.thresholdSet, B);
    outGm.SetGlobalBuffer((__gm__ T*)a.out, B * Hq * D);
    keptGm.SetGlobalBuffer((__gm__ int32_t*)a.kept, B * Hq);
    vRowsGm.SetGlobalBuffer((__gm__ int32_t*)a.vRows, B * Hkv);
    droppedGm.SetGlobalBuffer((__gm__ float*)a.dropped, B * Hq);
    const uint64_t records = uint64_t(td.numPairs) * td.splitCap;
    if (td.splitCap > 1) {
        if (td.syncMode == TOPTH_SYNC_SOFT) {
            syncGm.SetGlobalBuffer((__gm__ int32_t*)(a.workspace + td.wsSyncOff), td.aivCount * 8);
        }
        partGm.SetGlobalBuffer((__gm__ float*)(a.workspace + td.wsPartOff), records * td.partFloats);
        partGmI.SetGlobalBuffer((__gm__ int32_t*)(a.workspace + td.wsPartOff), records * td.partFloats);
    }
    if (td.placement == TOPTH_POST_SOFTMAX) {
        scoresGm.SetGlobalBuffer((__gm__ float*)(a.workspace + td.wsScoresOff), uint64_t(td.numPairs) * G * S);
        if (td.splitCap > 1) {
            statsGm.SetGlobalBuffer((__gm__ float*)(a.workspace + td.wsStatsOff), records * 2 * PW);
        }
    }

    if (td.cubePath) {  // this vector core's score ring, written by the cube core of its AI core
        const uint64_t slots = uint64_t(td.ringSlots) * G * W;
        ringGm.SetGlobalBuffer((__gm__ float*)(a.workspace + td.wsRingOff) + GetBlockIdx() * slots, slots);
    }

    // Unified buffer: sizes from the host tiling (its ubTotal is the sum of these).
    if (td.ubKIn) pipe->InitBuffer(kQue, 2, td.ubKIn);
    if (td.ubKF32) pipe->InitBuffer(kF32Buf, td.ubKF32);
    pipe->InitBuffer(prodBuf, td.ubProd);
    if (td.ubQ) pipe->InitBuffer(qBuf, td.ubQ);
    pipe->InitBuffer(accBuf, td.ubAcc);
    pipe->InitBuffer(scBuf, td.ubTile);
    pipe->InitBuffer(eBuf, td.ubTile);
    pipe->InitBuffer(ekBuf, td.ubTile);
    pipe->InitBuffer(indBuf, td.ubTile);
    pipe->InitBuffer(thrBuf, td.ubTile);
    pipe->InitBuffer(onesBuf, td.ubTile);
    pipe->InitBuffer(maskBuf, td.ubMask);
    pipe->InitBuffer(vQue, 2, td.ubVIn);
    if (td.ubVF32) pipe->InitBuffer(vF32Buf, td.ubVF32);
    pipe->InitBuffer(wcBuf, td.ubWc);
    pipe->InitBuffer(wbBuf, td.ubWb);
    pipe->InitBuffer(pairBuf, td.ubPair);
    pipe->InitBuffer(pairBBuf, td.ubPairB);
    if (td.ubStage) pipe->InitBuffer(stageBuf, td.ubStage);
    if (td.ubMu) pipe->InitBuffer(muBuf, td.ubMu);
    if (td.ubCmb) pipe->InitBuffer(cmbBuf, td.ubCmb);
    if (td.ubMAll) pipe->InitBuffer(mAllBuf, td.ubMAll);
    if (td.ubSync) pipe->InitBuffer(syncBuf, td.ubSync);
    pipe->InitBuffer(statBuf, td.ubStat);
    if (td.ubSIn) pipe->InitBuffer(sQue, 2, td.ubSIn);

    if (td.ubKF32) kF32 = kF32Buf.Get<float>();
    prod = prodBuf.Get<float>();
    if (td.ubQ) qF = qBuf.Get<float>();
    acc = accBuf.Get<float>();
    sc = scBuf.Get<float>();
    ex = eBuf.Get<float>();
    ek = ekBuf.Get<float>();
    ind = indBuf.Get<float>();
    thr = thrBuf.Get<float>();
    ones = onesBuf.Get<float>();
    mask = maskBuf.Get<uint8_t>();
    const uint32_t maskBytes = ((G * W / 8 + 31) / 32) * 32;
    uBits8 = mask[maskBytes];
    uBits = uBits8.ReinterpretCast<uint32_t>();
    fBits = mask[maskBytes + 32].ReinterpretCast<uint32_t>();
    if (td.ubVF32) vF32 = vF32Buf.Get<float>();
    wc = wcBuf.Get<float>();
    wb = wbBuf.Get<float>();
    pairs = pairBuf.Get<float>();
    LocalTensor<float> pb = pairBBuf.Get<float>();
    mB = pb;
    fB = pb[PW * 8];
    if (td.ubStage) stage = stageBuf.Get<T>();
    if (td.ubMu) mu = muBuf.Get<float>();
    if (td.ubCmb) cmb = cmbBuf.Get<float>();
    if (td.ubMAll) mAll = mAllBuf.Get<float>();
    LocalTensor<uint8_t> st = statBuf.Get<uint8_t>();
    const uint32_t statStride = ((G * 4 + 31) / 32) * 32;
    statI = st.ReinterpretCast<int32_t>();
    statF = st[statStride].ReinterpretCast<float>();
    statU = st[2 * statStride].ReinterpretCast<int32_t>();

    Duplicate(ones, 1.0f, G * W);
    PipeBarrier<PIPE_V>();
}

// Items are (pair, split) with pair = (batch, kv head); the split count follows the actual
// lengths (PlanSplits). Pass A (all items), then with splits: all-core sync, pass B of
// post_softmax (and a second sync), and the combine of every split pair.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::Process()
{
    const uint32_t blk = GetBlockIdx();
    // vector cores taking items: blockDim, or blockDim AI cores x 2 on the cube path
    const uint32_t nblk = td.cubePath ? GetBlockNum() * GetTaskRation() : GetBlockNum();
    PlanSplits();
    const uint32_t items = td.numPairs * splits;
    if (td.cubePath) {
        // Rounds in step with the cube core: round r takes item blk + r * nblk here and
        // (blk ^ 1) + r * nblk on the other vector core of this AI core (topth_cube.h).
        for (uint32_t r = 0; r < CeilDiv(items, nblk); ++r) {
            RunItemRing(blk + r * nblk, (blk ^ 1u) + r * nblk, items);
        }
    } else {
        for (uint32_t item = blk; item < items; item += nblk) {
            RunItem(item);
        }
    }
    if (splits <= 1) return;  // every block computed the same plan: no sync anywhere
    AllSync();
    if (td.placement == TOPTH_POST_SOFTMAX) {
        for (uint32_t item = blk; item < items; item += nblk) {
            RunItemPassB(item);
        }
        AllSync();
    }
    for (uint32_t pair = blk; pair < td.numPairs; pair += nblk) {
        Combine(pair);
    }
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::ResetAccumulators()
{
    Duplicate(Pair(P_M), NEG_FLOOR, PW);
    Duplicate(Pair(P_R), 0.0f, PW);
    Duplicate(Pair(P_E), 0.0f, PW);
    Duplicate(Pair(P_K), 0.0f, PW);
    if (keptRef) Duplicate(Pair(P_MK), NEG_FLOOR, PW);
    Duplicate(acc, 0.0f, G * Dp);
    PipeBarrier<PIPE_V>();
    unionCount = 0;
}

// A pair with one piece runs to the end here; with several, pass A writes a partial.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::RunItem(uint32_t item)
{
    if (!SetItem(item)) return;
    BeginItem();
    if (chunkStart < chunkEnd) {
        LoadQuery();
        StreamKeys();
    }
    FinishItem();
}

// Tiles of an item (0 when the item is empty or not this launch's), and whether it exists.
template <typename T>
__aicore__ inline uint32_t TopthDecodeKernel<T>::TilesOf(uint32_t item, uint32_t items, bool& active)
{
    active = item < items && SetItem(item);
    return (active && chunkStart < chunkEnd) ? CeilDiv(chunkEnd - chunkStart, W) : 0;
}

// Cube path: the scores come from the cube core through the ring; every vector core of an
// AI core takes the same number of ring steps per round (the longer of its and its
// partner's item), empty ones where its own item has no tile.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::RunItemRing(uint32_t item, uint32_t partner, uint32_t items)
{
    bool active = false;
    const uint32_t other = TilesOf(partner, items, active);
    const uint32_t tiles = TilesOf(item, items, active);  // last: leaves this item's state set
    const uint32_t steps = other > tiles ? other : tiles;
    if (active) BeginItem();
    StreamRing(steps, tiles);
    if (active) FinishItem();
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::BeginItem()
{
    ResetAccumulators();
    if (chunkStart < chunkEnd && td.placement == TOPTH_PRE_SOFTMAX) BuildThresholds(false);
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::FinishItem()
{
    const bool single = pieces <= 1;
    const uint64_t rec = uint64_t(pairIdx) * td.splitCap + splitIdx;
    if (td.placement == TOPTH_POST_SOFTMAX) {
        if (!single) {
            WriteStatsA(rec);
            return;
        }
        // Z accumulated in P_R; the scores are in the workspace (written by this core).
        Sync<HardEvent::MTE3_MTE2>();
        PassB();
    }
    if (single) {
        Finalize(n, unionCount);
    } else {
        WritePartial(rec);
    }
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::RunItemPassB(uint32_t item)
{
    if (!SetItem(item) || pieces <= 1) return;
    MergeStatsA();
    PassB();
    WritePartial(uint64_t(pairIdx) * td.splitCap + splitIdx);
}

}  // namespace topth

#endif  // TOPTH_KERNEL_H
