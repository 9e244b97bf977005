/*
 * Top-Theta thresholded incremental (decode) flash attention: Ascend C kernel for
 * Atlas A2 / Ascend 910B AI vector cores.
 *
 * One source, two builds: with CANN (bisheng, ascendc_library) for the NPU, and with g++
 * against the CPU model of the Ascend C API in npu_kernels/cpu_model (the model's
 * kernel_operator.h), which runs every block on the host and checks unified-buffer
 * capacity, alignment, queue discipline and pipe synchronisation.
 *
 * Semantics: docs/semantics.md (op contract), method of Berestizshevsky et al., "Top-Theta
 * Attention", arXiv 2502.08363, sections 3.1-3.2: per query head h, with n valid positions,
 * a_j = scale <q_h, k_j>, m = max_j a_j, theta = thresholds[h, min(n, R) - 1]:
 *   pre_softmax : keep a_j > theta; w_j = exp(a_j - m) / (R + E~)  (R over kept, E~ by sdc)
 *   post_softmax: keep a_j - m - ln Z > ln theta, Z = sum_j exp(a_j - m); w_j = exp(a_j - m) / Z
 *   out = sum_kept w_j v_j (+ beta mu with VMC, beta = 1 - sum_kept w_j).
 *
 * Work decomposition (after Ascend's IncrementalFlashAttention): one work item is one
 * (batch, kv-head) pair -- all query heads of a GQA group together, so K is read once per
 * group -- or, when batch x kv-heads is small, one split of the KV sequence of a pair
 * (flash-decoding); split partials are combined by log-sum-exp after SyncAll. Per item:
 *   1. K tiles (tileK rows) stream GM -> UB through a double-buffered queue; a_j for all
 *      heads of the group on the vector unit (float32 products, row sums).
 *   2. Per 64-position score tile: selection mask (Compare), kept / dropped exponentials
 *      (Select), per-head sums; the union over the group's heads of kept positions.
 *   3. Only V rows in that union are copied GM -> UB (runs of consecutive kept rows in one
 *      copy, each row a whole number of 32-byte blocks), weighted and accumulated.
 * pre_softmax runs 1-3 in one pass with a running maximum (flash attention); post_softmax
 * needs the full-row log-sum-exp first, so pass A streams K and writes the scores (4
 * bytes per head and position) to a GM workspace, pass B re-reads them and does 2-3.
 */
#include "kernel_operator.h"
#include "topth_tiling_data.h"

using namespace AscendC;

namespace topth {

constexpr uint32_t W = TOPTH_TILE_W;  // score-tile width (positions)
constexpr float NEG_BIG = -3.0e38f;   // finite floor of running maxima: exp(a - m) never sees inf - inf

// Pair-vector slots (pairWidth floats each; head g's value at element 2g).
enum PairSlot : uint32_t {
    P_M = 0,   // reference maximum (running max in pass A / pre; global max in pass B)
    P_R = 1,   // sum of kept exp(a - m)      (pass A of post_softmax: Z, sum of all)
    P_E = 2,   // sum of dropped exp(a - m)
    P_K = 3,   // kept count
    P_MNEW = 4,
    P_RT = 5,
    P_ET = 6,
    P_KT = 7,
    P_TMAX = 8,
    P_F = 9,   // rescale factor / reciprocal denominator
    P_LNZ = 10,
    P_TMP = 11,
};

__aicore__ inline float NegInf() { return -__builtin_huge_valf(); }
__aicore__ inline float QNaN() { return __builtin_nanf(""); }
__aicore__ inline uint32_t Min32(uint32_t a, uint32_t b) { return a < b ? a : b; }
__aicore__ inline uint32_t CeilDiv(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// Same-core ordering between two pipes (e.g. V writes, then S reads).
template <HardEvent E>
__aicore__ inline void Sync()
{
    TEventID id = GetTPipePtr()->FetchEventID(E);
    SetFlag<E>(id);
    WaitFlag<E>(id);
}

__aicore__ inline void LoadTiling(TopthTilingData& td, GM_ADDR tiling)
{
    GlobalTensor<uint32_t> src;
    constexpr uint32_t words = sizeof(TopthTilingData) / sizeof(uint32_t);
    src.SetGlobalBuffer((__gm__ uint32_t*)tiling, words);
    uint32_t* dst = reinterpret_cast<uint32_t*>(&td);
    for (uint32_t i = 0; i < words; ++i) {
        dst[i] = src.GetValue(i);
    }
}

template <typename T>
class TopthDecodeKernel {
public:
    __aicore__ inline TopthDecodeKernel() {}

    __aicore__ inline void Init(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR seqLens, GM_ADDR thresholds,
                                GM_ADDR sdcTable, GM_ADDR valueMean, GM_ADDR out, GM_ADDR kept, GM_ADDR vRows,
                                GM_ADDR dropped, GM_ADDR workspace, const TopthTilingData& tiling, TPipe* tpipe)
    {
        td = tiling;
        pipe = tpipe;
        G = td.group;
        D = td.headDim;
        Dp = td.headDimPad;
        PW = td.pairWidth;
        S = td.maxSeqLen;
        rowAligned = ((D * sizeof(T)) % 32 == 0);

        const uint64_t B = td.batch, Hq = td.numQHeads, Hkv = td.numKvHeads;
        qGm.SetGlobalBuffer((__gm__ T*)query, B * Hq * D);
        kGm.SetGlobalBuffer((__gm__ T*)key, B * Hkv * S * D);
        vGm.SetGlobalBuffer((__gm__ T*)value, B * Hkv * S * D);
        lensGm.SetGlobalBuffer((__gm__ int32_t*)seqLens, B);
        thGm.SetGlobalBuffer((__gm__ float*)thresholds, Hq * td.maxRowId);
        if (td.sdc == TOPTH_SDC_OFFLINE) {
            sdcGm.SetGlobalBuffer((__gm__ float*)sdcTable, Hq * td.maxRowId);
        }
        if (td.vmc) {
            muGm.SetGlobalBuffer((__gm__ float*)valueMean, B * Hkv * D);
        }
        outGm.SetGlobalBuffer((__gm__ T*)out, B * Hq * D);
        keptGm.SetGlobalBuffer((__gm__ int32_t*)kept, B * Hq);
        vRowsGm.SetGlobalBuffer((__gm__ int32_t*)vRows, B * Hkv);
        droppedGm.SetGlobalBuffer((__gm__ float*)dropped, B * Hq);
        if (td.splitNum > 1) {
            syncGm.SetGlobalBuffer((__gm__ int32_t*)(workspace + td.wsSyncOff), td.blockDim * 8);
            partGm.SetGlobalBuffer((__gm__ float*)(workspace + td.wsPartOff), uint64_t(td.numItems) * td.partFloats);
            partGmI.SetGlobalBuffer((__gm__ int32_t*)(workspace + td.wsPartOff), uint64_t(td.numItems) * td.partFloats);
        }
        if (td.placement == TOPTH_POST_SOFTMAX) {
            scoresGm.SetGlobalBuffer((__gm__ float*)(workspace + td.wsScoresOff), uint64_t(td.numPairs) * G * S);
            if (td.splitNum > 1) {
                statsGm.SetGlobalBuffer((__gm__ float*)(workspace + td.wsStatsOff), uint64_t(td.numItems) * 2 * PW);
            }
        }

        // Unified buffer: sizes from the host tiling (its ubTotal is the sum of these).
        pipe->InitBuffer(kQue, 2, td.ubKIn);
        if (td.ubKF32) pipe->InitBuffer(kF32Buf, td.ubKF32);
        pipe->InitBuffer(prodBuf, td.ubProd);
        pipe->InitBuffer(qBuf, td.ubQ);
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
        qF = qBuf.Get<float>();
        acc = accBuf.Get<float>();
        sc = scBuf.Get<float>();
        ex = eBuf.Get<float>();
        ek = ekBuf.Get<float>();
        ind = indBuf.Get<float>();
        thr = thrBuf.Get<float>();
        ones = onesBuf.Get<float>();
        mask = maskBuf.Get<uint8_t>();
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

    __aicore__ inline void Process()
    {
        const uint32_t blk = GetBlockIdx();
        const uint32_t nblk = GetBlockNum();
        for (uint32_t item = blk; item < td.numItems; item += nblk) {
            RunItem(item);
        }
        if (td.splitNum > 1) {
            // Soft SyncAll (GM area of blockDim x 32 bytes zeroed by the host, UB area as large):
            // the API reference reserves the hard SyncAll<>() for custom-operator projects, and
            // this kernel is launched directly (ACLRT_LAUNCH_KERNEL). blockDim <= vector cores
            // (host tiling), else SyncAll would hang.
            LocalTensor<int32_t> syncUb = syncBuf.Get<int32_t>();
            SyncAll(syncGm, syncUb, static_cast<int32_t>(td.blockDim));
            if (td.placement == TOPTH_POST_SOFTMAX) {
                for (uint32_t item = blk; item < td.numItems; item += nblk) {
                    RunItemPassB(item);
                }
                SyncAll(syncGm, syncUb, static_cast<int32_t>(td.blockDim));
            }
            for (uint32_t pair = blk; pair < td.numPairs; pair += nblk) {
                Combine(pair);
            }
        }
    }

private:
    // ---------------------------------------------------------------- item bookkeeping
    __aicore__ inline void SetItem(uint32_t item)
    {
        pairIdx = item / td.splitNum;
        splitIdx = item % td.splitNum;
        bIdx = pairIdx / td.numKvHeads;
        kvIdx = pairIdx % td.numKvHeads;
        n = SeqLen(bIdx);
        chunkStart = splitIdx * td.splitLen;
        chunkEnd = Min32(n, chunkStart + td.splitLen);
        kvBase = uint64_t(pairIdx) * S * D;
    }

    // n = seq_lens[b], clamped into [0, max_seq_len] (no read past the cache).
    __aicore__ inline uint32_t SeqLen(uint32_t b)
    {
        int32_t len = lensGm.GetValue(b);
        if (len < 0) return 0;
        return static_cast<uint32_t>(len) > S ? S : static_cast<uint32_t>(len);
    }

    __aicore__ inline uint32_t RowIndex(uint32_t len)
    {
        return (len < td.maxRowId ? len : td.maxRowId) - 1;
    }

    __aicore__ inline LocalTensor<float> Pair(uint32_t slot) { return pairs[slot * PW]; }

    // Item with splitNum == 1 runs to the end; with splits, pass A writes a partial.
    __aicore__ inline void RunItem(uint32_t item)
    {
        SetItem(item);
        const bool single = (td.splitNum == 1);
        if (!single && chunkStart >= chunkEnd) return;  // nothing of this sequence in this split
        ResetAccumulators();
        if (chunkStart < chunkEnd) {
            LoadQuery();
            if (td.placement == TOPTH_PRE_SOFTMAX) {
                BuildThresholds(false);
            }
            StreamKeys();
        }
        if (td.placement == TOPTH_POST_SOFTMAX) {
            if (!single) {
                WriteStatsA(item);
                return;
            }
            // Z accumulated in P_R; the scores are in the workspace (written by this core).
            Sync<HardEvent::MTE3_MTE2>();
            PassB();
        }
        if (single) {
            Finalize(n, unionCount);
        } else {
            WritePartial(item);
        }
    }

    __aicore__ inline void RunItemPassB(uint32_t item)
    {
        SetItem(item);
        if (chunkStart >= chunkEnd) return;
        MergeStatsA();
        PassB();
        WritePartial(item);
    }

    __aicore__ inline void ResetAccumulators()
    {
        Duplicate(Pair(P_M), NEG_BIG, PW);
        Duplicate(Pair(P_R), 0.0f, PW);
        Duplicate(Pair(P_E), 0.0f, PW);
        Duplicate(Pair(P_K), 0.0f, PW);
        Duplicate(acc, 0.0f, G * Dp);
        PipeBarrier<PIPE_V>();
        unionCount = 0;
    }

    // ---------------------------------------------------------------- loads
    __aicore__ inline DataCopyExtParams RowParams(uint32_t rows)
    {
        DataCopyExtParams p;
        p.blockCount = static_cast<uint16_t>(rows);
        p.blockLen = D * sizeof(T);
        p.srcStride = 0;
        p.dstStride = 0;
        p.rsv = 0;
        return p;
    }

    __aicore__ inline DataCopyPadExtParams<T> RowPad()
    {
        DataCopyPadExtParams<T> pad;
        pad.isPad = (Dp != D);
        pad.leftPadding = 0;
        pad.rightPadding = static_cast<uint8_t>(Dp - D);
        pad.paddingValue = T(0.0f);
        return pad;
    }

    // `rows` consecutive rows of K or V from GM into UB at a row stride of Dp elements.
    __aicore__ inline void CopyRows(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t rows)
    {
        if (rowAligned) {
            DataCopy(dst, src, rows * D);
        } else {
            DataCopyPad(dst, src, RowParams(rows), RowPad());
        }
    }

    // The G query rows of this group, as float32 rows of Dp (zero padded) in qF.
    __aicore__ inline void LoadQuery()
    {
        const uint64_t off = (uint64_t(bIdx) * td.numQHeads + uint64_t(kvIdx) * G) * D;
        Sync<HardEvent::V_MTE2>();  // the previous item's vector reads of qF / stage are done
        if constexpr (kWiden) {
            Sync<HardEvent::MTE3_MTE2>();  // stage also carries the previous output to GM
            DataCopyPad(stage, qGm[off], RowParams(G), RowPad());
            Sync<HardEvent::MTE2_V>();
            Cast(qF, stage, RoundMode::CAST_NONE, G * Dp);
        } else {
            LocalTensor<T> qT = qF.template ReinterpretCast<T>();
            DataCopyPad(qT, qGm[off], RowParams(G), RowPad());
            Sync<HardEvent::MTE2_V>();
        }
        PipeBarrier<PIPE_V>();
    }

    // thr[g, :] = theta_g (pre_softmax) or ln(theta_g) (post_softmax; theta <= 0 -> -inf,
    // so every finite score is kept; NaN stays NaN and keeps nothing).
    __aicore__ inline void BuildThresholds(bool logDomain)
    {
        const uint32_t row = RowIndex(n);
        LocalTensor<float> tmp = Pair(P_TMP);
        if (logDomain) {
            Sync<HardEvent::V_S>();
            for (uint32_t g = 0; g < G; ++g) {
                const float th = thGm.GetValue(uint64_t(kvIdx * G + g) * td.maxRowId + row);
                tmp.SetValue(2 * g, th > 0.0f ? th : 1.0f);
            }
            Sync<HardEvent::S_V>();
            Ln(tmp, tmp, PW);
            Sync<HardEvent::V_S>();
        }
        for (uint32_t g = 0; g < G; ++g) {
            const float th = thGm.GetValue(uint64_t(kvIdx * G + g) * td.maxRowId + row);
            float v = th;
            if (logDomain) {
                v = (th != th) ? th : (th > 0.0f ? tmp.GetValue(2 * g) : NegInf());
            }
            thrScalar = v;
            Duplicate(thr[g * W], thrScalar, W);
        }
        if (logDomain) Sync<HardEvent::S_V>();
        PipeBarrier<PIPE_V>();
    }

    // ---------------------------------------------------------------- pass A: K stream
    __aicore__ inline void CopyKTile(uint32_t pos)
    {
        const uint32_t rows = Min32(td.tileK, chunkEnd - pos);
        LocalTensor<T> kIn = kQue.template AllocTensor<T>();
        CopyRows(kIn, kGm[kvBase + uint64_t(pos) * D], rows);
        kQue.EnQue(kIn);
    }

    __aicore__ inline void StreamKeys()
    {
        const uint32_t nTiles = CeilDiv(chunkEnd - chunkStart, td.tileK);
        CopyKTile(chunkStart);
        for (uint32_t t = 0; t < nTiles; ++t) {
            const uint32_t pos = chunkStart + t * td.tileK;
            const uint32_t rows = Min32(td.tileK, chunkEnd - pos);
            if (t + 1 < nTiles) {
                CopyKTile(pos + td.tileK);  // double buffering: next tile in flight
            }
            LocalTensor<T> kIn = kQue.template DeQue<T>();
            Scores(kIn, rows);
            RunningMax();
            if (td.placement == TOPTH_PRE_SOFTMAX) {
                RescaleAccumulators();
                SelectAccumulate(sc, rows, pos, false);
            } else {
                AccumulateZ();
                StoreScores(pos, rows);
            }
        }
    }

    // sc[g, j] = scale * <q_g, k_j> for j < rows; -inf for rows <= j < W.
    __aicore__ inline void Scores(LocalTensor<T>& kIn, uint32_t rows)
    {
        LocalTensor<float> kf;
        if constexpr (kWiden) {
            Cast(kF32, kIn, RoundMode::CAST_NONE, rows * Dp);
            kQue.FreeTensor(kIn);
            kf = kF32;
        } else {
            kf = kIn.template ReinterpretCast<float>();
        }
        Duplicate(sc, NegInf(), G * W);
        PipeBarrier<PIPE_V>();
        const uint8_t rowBlocks = static_cast<uint8_t>(Dp / 8);
        const uint32_t lanes = Min32(64, Dp);
        for (uint32_t g = 0; g < G; ++g) {
            // prod[j, 0:64] = sum over 64-column chunks c of k[j, c] * q_g[c]
            for (uint32_t c0 = 0; c0 < Dp; c0 += 64) {
                const uint64_t m = Min32(64, Dp - c0);
                BinaryRepeatParams p(1, 1, 1, 8, rowBlocks, 0);
                if (c0 == 0) {
                    Mul(prod, kf[c0], qF[g * Dp + c0], m, static_cast<uint8_t>(rows), p);
                } else {
                    MulAddDst(prod, kf[c0], qF[g * Dp + c0], m, static_cast<uint8_t>(rows), p);
                }
                PipeBarrier<PIPE_V>();
            }
            WholeReduceSum(sc[g * W], prod, static_cast<int32_t>(lanes), static_cast<int32_t>(rows), 1, 1, 8);
            PipeBarrier<PIPE_V>();
        }
        if constexpr (!kWiden) kQue.FreeTensor(kIn);
        Muls(sc, sc, td.scale, G * W);
        PipeBarrier<PIPE_V>();
    }

    // P_MNEW = max(P_M, tile max); P_F = exp(P_M - P_MNEW); P_M = P_MNEW; mB = broadcast(P_M).
    __aicore__ inline void RunningMax()
    {
        // WholeReduceMax with its default ReduceOrder::ORDER_VALUE_INDEX writes a (max, index)
        // pair per repeat, dstRepStride counted in pairs (API reference): head g's maximum lands
        // at element 2g, the layout of every pair vector here. Odd elements are never read.
        WholeReduceMax(Pair(P_TMAX), sc, static_cast<int32_t>(W), static_cast<int32_t>(G), 1, 1, 8);
        PipeBarrier<PIPE_V>();
        Max(Pair(P_MNEW), Pair(P_M), Pair(P_TMAX), PW);
        PipeBarrier<PIPE_V>();
        Sub(Pair(P_F), Pair(P_M), Pair(P_MNEW), PW);
        PipeBarrier<PIPE_V>();
        Exp(Pair(P_F), Pair(P_F), PW);
        Adds(Pair(P_M), Pair(P_MNEW), 0.0f, PW);
        PipeBarrier<PIPE_V>();
        Brcb(mB, Pair(P_M), static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();
    }

    // Flash-attention rescale of R, E and the output accumulators by P_F.
    __aicore__ inline void RescaleAccumulators()
    {
        Mul(Pair(P_R), Pair(P_R), Pair(P_F), PW);
        Mul(Pair(P_E), Pair(P_E), Pair(P_F), PW);
        Brcb(fB, Pair(P_F), static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();
        ScaleRows(acc, fB);
    }

    // rows[g, :] *= broadcast[g] (broadcast: one 32-byte block per pair element).
    __aicore__ inline void ScaleRows(const LocalTensor<float>& rows, const LocalTensor<float>& bcast)
    {
        const uint8_t rowBlocks = static_cast<uint8_t>(Dp / 8);
        for (uint32_t c0 = 0; c0 < Dp; c0 += 64) {
            BinaryRepeatParams p(1, 1, 0, rowBlocks, rowBlocks, 2);
            Mul(rows[c0], rows[c0], bcast, Min32(64, Dp - c0), static_cast<uint8_t>(G), p);
            // Chunks touch disjoint columns; the barrier is conservative (the CPU model
            // tracks a strided operand by its whole address span).
            PipeBarrier<PIPE_V>();
        }
    }

    // post_softmax pass A: Z = Z * P_F + sum_j exp(a_j - m) (Z kept in P_R).
    __aicore__ inline void AccumulateZ()
    {
        BinaryRepeatParams p(1, 1, 0, 8, 8, 2);
        Sub(ex, sc, mB, W, static_cast<uint8_t>(G), p);
        PipeBarrier<PIPE_V>();
        Exp(ex, ex, G * W);
        PipeBarrier<PIPE_V>();
        WholeReduceSum(Pair(P_RT), ex, static_cast<int32_t>(W), static_cast<int32_t>(G), 2, 1, 8);
        Mul(Pair(P_R), Pair(P_R), Pair(P_F), PW);
        PipeBarrier<PIPE_V>();
        Add(Pair(P_R), Pair(P_R), Pair(P_RT), PW);
        PipeBarrier<PIPE_V>();
    }

    // post_softmax pass A: scores of this tile -> workspace [pair, g, pos].
    __aicore__ inline void StoreScores(uint32_t pos, uint32_t rows)
    {
        Sync<HardEvent::V_MTE3>();
        DataCopyExtParams p;
        p.blockCount = static_cast<uint16_t>(G);
        p.blockLen = rows * 4;
        p.srcStride = (W * 4 - ((rows * 4 + 31) / 32) * 32) / 32;
        p.dstStride = (S - rows) * 4;
        p.rsv = 0;
        DataCopyPad(scoresGm[uint64_t(pairIdx) * G * S + pos], sc, p);
        Sync<HardEvent::MTE3_V>();  // the next tile rewrites sc
    }

    // post_softmax with splits: (m, Z) of this split -> workspace.
    __aicore__ inline void WriteStatsA(uint32_t item)
    {
        Sync<HardEvent::V_MTE3>();
        DataCopy(statsGm[uint64_t(item) * 2 * PW], Pair(P_M), PW);
        DataCopy(statsGm[uint64_t(item) * 2 * PW + PW], Pair(P_R), PW);
        Sync<HardEvent::MTE3_V>();
    }

    // post_softmax pass B prologue with splits: global M and Z from every split of the pair.
    __aicore__ inline void MergeStatsA()
    {
        const uint32_t used = CeilDiv(n, td.splitLen);
        Sync<HardEvent::V_MTE2>();
        DataCopy(mAll, statsGm[uint64_t(pairIdx) * td.splitNum * 2 * PW], used * 2 * PW);
        Sync<HardEvent::MTE2_V>();
        Duplicate(Pair(P_M), NEG_BIG, PW);
        Duplicate(Pair(P_R), 0.0f, PW);
        PipeBarrier<PIPE_V>();
        for (uint32_t s = 0; s < used; ++s) {
            Max(Pair(P_M), Pair(P_M), mAll[s * 2 * PW], PW);
            PipeBarrier<PIPE_V>();
        }
        for (uint32_t s = 0; s < used; ++s) {
            Sub(Pair(P_TMP), mAll[s * 2 * PW], Pair(P_M), PW);
            PipeBarrier<PIPE_V>();
            Exp(Pair(P_TMP), Pair(P_TMP), PW);
            PipeBarrier<PIPE_V>();
            Mul(Pair(P_TMP), Pair(P_TMP), mAll[s * 2 * PW + PW], PW);
            PipeBarrier<PIPE_V>();
            Add(Pair(P_R), Pair(P_R), Pair(P_TMP), PW);
            PipeBarrier<PIPE_V>();
        }
    }

    // ---------------------------------------------------------------- pass B (post_softmax)
    __aicore__ inline void CopyScoreTile(uint32_t pos)
    {
        const uint32_t rows = Min32(W, chunkEnd - pos);
        const uint32_t rows8 = ((rows + 7) / 8) * 8;
        LocalTensor<float> sIn = sQue.template AllocTensor<float>();
        DataCopyExtParams p;
        p.blockCount = static_cast<uint16_t>(G);
        p.blockLen = rows * 4;
        p.srcStride = (S - rows) * 4;
        p.dstStride = (W - rows8) / 8;
        p.rsv = 0;
        DataCopyPadExtParams<float> pad;
        pad.isPad = (rows8 != rows);
        pad.leftPadding = 0;
        pad.rightPadding = static_cast<uint8_t>(rows8 - rows);
        pad.paddingValue = NegInf();
        DataCopyPad(sIn, scoresGm[uint64_t(pairIdx) * G * S + pos], p, pad);
        sQue.EnQue(sIn);
    }

    __aicore__ inline void PassB()
    {
        // Reference max M in P_M, Z in P_R: lnZ, broadcasts, then fresh accumulators.
        Ln(Pair(P_LNZ), Pair(P_R), PW);
        Brcb(mB, Pair(P_M), static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();
        Brcb(fB, Pair(P_LNZ), static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
        Duplicate(Pair(P_R), 0.0f, PW);
        Duplicate(Pair(P_E), 0.0f, PW);
        Duplicate(Pair(P_K), 0.0f, PW);
        Duplicate(acc, 0.0f, G * Dp);
        PipeBarrier<PIPE_V>();
        unionCount = 0;
        if (chunkStart >= chunkEnd) return;
        BuildThresholds(true);
        const uint32_t nTiles = CeilDiv(chunkEnd - chunkStart, W);
        CopyScoreTile(chunkStart);
        for (uint32_t t = 0; t < nTiles; ++t) {
            const uint32_t pos = chunkStart + t * W;
            const uint32_t rows = Min32(W, chunkEnd - pos);
            const uint32_t rows8 = ((rows + 7) / 8) * 8;
            if (t + 1 < nTiles) {
                CopyScoreTile(pos + W);
            }
            LocalTensor<float> sIn = sQue.template DeQue<float>();
            if (rows8 < W) {
                Duplicate(sIn[rows8], NegInf(), W - rows8, static_cast<uint8_t>(G), 1, 8);
                PipeBarrier<PIPE_V>();
            }
            SelectAccumulate(sIn, rows, pos, true);
            sQue.FreeTensor(sIn);
        }
    }

    // ---------------------------------------------------------------- selection and V
    // Scores of one tile (G x W, rows valid, -inf beyond) against the reference max in mB:
    // kept mask, sums, union of kept positions over the group, gather of those V rows,
    // out[g] += sum_kept exp(a - m) v.
    __aicore__ inline void SelectAccumulate(const LocalTensor<float>& s, uint32_t rows, uint32_t pos, bool post)
    {
        const uint8_t reps = static_cast<uint8_t>(G);
        BinaryRepeatParams bp(1, 1, 0, 8, 8, 2);
        Sub(ex, s, mB, W, reps, bp);  // a - m
        PipeBarrier<PIPE_V>();
        if (post) {
            Sub(ek, ex, fB, W, reps, bp);  // a - m - ln Z (log of the probability), compared in the log domain
            PipeBarrier<PIPE_V>();
        }
        Exp(ex, ex, G * W);
        // Compare (count form) needs count x sizeof(float) to be a multiple of 256 bytes: G x 64
        // floats. The mask only feeds Select, so its bit order never matters here.
        Compare(mask, post ? ek : s, thr, CMPMODE::GT, G * W);
        PipeBarrier<PIPE_V>();
        Select(ek, mask, ex, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, G * W);
        Select(ind, mask, ones, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, G * W);
        PipeBarrier<PIPE_V>();
        Sub(ex, ex, ek, G * W);  // dropped exponentials (exact: x - x = 0, x - 0 = x)
        WholeReduceSum(Pair(P_RT), ek, static_cast<int32_t>(W), static_cast<int32_t>(G), 2, 1, 8);
        WholeReduceSum(Pair(P_KT), ind, static_cast<int32_t>(W), static_cast<int32_t>(G), 2, 1, 8);
        PipeBarrier<PIPE_V>();
        WholeReduceSum(Pair(P_ET), ex, static_cast<int32_t>(W), static_cast<int32_t>(G), 2, 1, 8);
        Add(Pair(P_R), Pair(P_R), Pair(P_RT), PW);
        Add(Pair(P_K), Pair(P_K), Pair(P_KT), PW);
        PipeBarrier<PIPE_V>();
        Add(Pair(P_E), Pair(P_E), Pair(P_ET), PW);
        // union over the group's heads: ind[0, j] = max_g ind[g, j]
        for (uint32_t g = 1; g < G; ++g) {
            Max(ind, ind, ind[g * W], W);
            PipeBarrier<PIPE_V>();
        }

        // Scalar unit: runs of kept positions and the compact weights wc[g, r].
        Sync<HardEvent::V_S>();
        uint32_t runStart[W];
        uint32_t runLen[W];
        uint32_t nRuns = 0;
        uint32_t r = 0;
        for (uint32_t j = 0; j < rows; ++j) {
            if (ind.GetValue(j) != 0.0f) {
                if (nRuns > 0 && runStart[nRuns - 1] + runLen[nRuns - 1] == j) {
                    runLen[nRuns - 1]++;
                } else {
                    runStart[nRuns] = j;
                    runLen[nRuns] = 1;
                    nRuns++;
                }
                for (uint32_t g = 0; g < G; ++g) {
                    wc.SetValue(g * W + r, ek.GetValue(g * W + j));
                }
                r++;
            }
        }
        Sync<HardEvent::S_V>();
        unionCount += r;
        if (r == 0) return;  // no V row of this tile is read

        const uint32_t nBatch = CeilDiv(r, td.tileV);
        IssueV(0, r, pos, runStart, runLen, nRuns);
        for (uint32_t b = 0; b < nBatch; ++b) {
            if (b + 1 < nBatch) {
                IssueV(b + 1, r, pos, runStart, runLen, nRuns);  // double buffering
            }
            AccumulateV(b, Min32(td.tileV, r - b * td.tileV));
        }
    }

    // Copy the V rows of batch `batch` (compact rows batch*tileV ...) into a queue buffer.
    __aicore__ inline void IssueV(uint32_t batch, uint32_t total, uint32_t pos, const uint32_t* runStart,
                                  const uint32_t* runLen, uint32_t nRuns)
    {
        const uint32_t first = batch * td.tileV;
        const uint32_t last = Min32(total, first + td.tileV);
        LocalTensor<T> vIn = vQue.template AllocTensor<T>();
        uint32_t r = 0;
        for (uint32_t k = 0; k < nRuns && r < last; ++k) {
            uint32_t lo = r, hi = r + runLen[k];
            uint32_t a = lo > first ? lo : first;
            uint32_t e = hi < last ? hi : last;
            if (a < e) {
                const uint32_t j = runStart[k] + (a - lo);
                CopyRows(vIn[(a - first) * Dp], vGm[kvBase + uint64_t(pos + j) * D], e - a);
            }
            r = hi;
        }
        vQue.EnQue(vIn);
    }

    __aicore__ inline void AccumulateV(uint32_t batch, uint32_t nb)
    {
        LocalTensor<T> vIn = vQue.template DeQue<T>();
        LocalTensor<float> vf;
        if constexpr (kWiden) {
            Cast(vF32, vIn, RoundMode::CAST_NONE, nb * Dp);
            vQue.FreeTensor(vIn);
            vf = vF32;
        } else {
            vf = vIn.template ReinterpretCast<float>();
        }
        PipeBarrier<PIPE_V>();
        const uint8_t rowBlocks = static_cast<uint8_t>(Dp / 8);
        for (uint32_t g = 0; g < G; ++g) {
            Brcb(wb, wc[g * W + batch * td.tileV], static_cast<uint8_t>(CeilDiv(nb, 8)), BrcbRepeatParams(1, 8));
            PipeBarrier<PIPE_V>();
            for (uint32_t c0 = 0; c0 < Dp; c0 += 64) {
                BinaryRepeatParams p(1, 1, 0, rowBlocks, rowBlocks, 1);
                Mul(prod[c0], vf[c0], wb, Min32(64, Dp - c0), static_cast<uint8_t>(nb), p);
                PipeBarrier<PIPE_V>();  // disjoint columns; conservative (see ScaleRows)
            }
            for (uint32_t rowsLeft = nb; rowsLeft > 1;) {  // sum the nb weighted rows into row 0
                const uint32_t h = rowsLeft / 2;
                Add(prod, prod, prod[(rowsLeft - h) * Dp], h * Dp);
                PipeBarrier<PIPE_V>();
                rowsLeft -= h;
            }
            Add(acc[g * Dp], acc[g * Dp], prod, Dp);
            PipeBarrier<PIPE_V>();
        }
        if constexpr (!kWiden) vQue.FreeTensor(vIn);
    }

    // ---------------------------------------------------------------- splits
    // Partial record: [M, R, E, K] pair vectors, union count (int32 in an 8-word block), acc.
    __aicore__ inline void WritePartial(uint32_t item)
    {
        const uint64_t base = uint64_t(item) * td.partFloats;
        statU.SetValue(0, static_cast<int32_t>(unionCount));
        Sync<HardEvent::S_MTE3>();
        Sync<HardEvent::V_MTE3>();
        DataCopy(partGm[base], pairs, 4 * PW);
        DataCopy(partGmI[base + 4 * PW], statU, 8);
        DataCopy(partGm[base + 4 * PW + 8], acc, G * Dp);
        Sync<HardEvent::MTE3_V>();
        Sync<HardEvent::MTE3_S>();
    }

    __aicore__ inline void Combine(uint32_t pair)
    {
        pairIdx = pair;
        bIdx = pair / td.numKvHeads;
        kvIdx = pair % td.numKvHeads;
        n = SeqLen(bIdx);
        const uint32_t used = CeilDiv(n, td.splitLen);
        ResetAccumulators();
        if (used > 0) {
            const uint64_t first = uint64_t(pair) * td.splitNum * td.partFloats;
            // M = max over splits of their reference maxima.
            // m of every split: `used` blocks of PW floats, GM gap partFloats - PW, packed in UB
            DataCopyParams mp(static_cast<uint16_t>(used), static_cast<uint16_t>(PW / 8),
                              static_cast<uint16_t>((td.partFloats - PW) / 8), 0);
            Sync<HardEvent::V_MTE2>();
            DataCopy(mAll, partGm[first], mp);
            Sync<HardEvent::MTE2_V>();
            for (uint32_t s = 0; s < used; ++s) {
                Max(Pair(P_M), Pair(P_M), mAll[s * PW], PW);
                PipeBarrier<PIPE_V>();
            }
            LocalTensor<int32_t> cmbI = cmb.template ReinterpretCast<int32_t>();
            for (uint32_t s = 0; s < used; ++s) {
                Sync<HardEvent::V_MTE2>();
                Sync<HardEvent::S_MTE2>();
                DataCopy(cmb, partGm[first + uint64_t(s) * td.partFloats], td.partFloats);
                Sync<HardEvent::MTE2_V>();
                Sync<HardEvent::MTE2_S>();
                unionCount += static_cast<uint32_t>(cmbI.GetValue(4 * PW));
                Sub(Pair(P_F), cmb, Pair(P_M), PW);  // f = exp(m_s - M)
                PipeBarrier<PIPE_V>();
                Exp(Pair(P_F), Pair(P_F), PW);
                PipeBarrier<PIPE_V>();
                Mul(cmb[PW], cmb[PW], Pair(P_F), PW);
                Mul(cmb[2 * PW], cmb[2 * PW], Pair(P_F), PW);
                Brcb(fB, Pair(P_F), static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
                PipeBarrier<PIPE_V>();
                Add(Pair(P_R), Pair(P_R), cmb[PW], PW);
                Add(Pair(P_E), Pair(P_E), cmb[2 * PW], PW);
                Add(Pair(P_K), Pair(P_K), cmb[3 * PW], PW);
                ScaleRows(cmb[4 * PW + 8], fB);
                Add(acc, acc, cmb[4 * PW + 8], G * Dp);
                PipeBarrier<PIPE_V>();
            }
        }
        Finalize(n, unionCount);
    }

    // ---------------------------------------------------------------- finalize
    // From (M, R, E, K, acc) of a whole row: SDC, normalisation, VMC, output and stats.
    __aicore__ inline void Finalize(uint32_t len, uint32_t unionRows)
    {
        Sync<HardEvent::V_S>();
        if (len == 0) {  // n = 0: output 0, every statistic 0
            for (uint32_t g = 0; g < G; ++g) {
                statI.SetValue(g, 0);
                statF.SetValue(g, 0.0f);
            }
            statU.SetValue(0, 0);
            Sync<HardEvent::S_V>();
            Duplicate(acc, 0.0f, G * Dp);
            PipeBarrier<PIPE_V>();
            WriteOutput();
            return;
        }
        const uint32_t row = RowIndex(len);
        LocalTensor<float> pm = Pair(P_M), pr = Pair(P_R), pe = Pair(P_E), pk = Pair(P_K);
        LocalTensor<float> pInv = Pair(P_F), pExp = Pair(P_TMP), pDen = Pair(P_MNEW), pOne = Pair(P_LNZ);
        const bool expThreshold = (td.sdc == TOPTH_SDC_EXP_THRESHOLD && td.placement == TOPTH_PRE_SOFTMAX);
        if (expThreshold) {  // exp(theta - M) for the whole group with one vector Exp
            for (uint32_t g = 0; g < G; ++g) {
                const float th = thGm.GetValue(uint64_t(kvIdx * G + g) * td.maxRowId + row);
                const float m = pm.GetValue(2 * g);
                const float mSafe = (m <= NEG_BIG) ? 0.0f : m;  // every valid score was -inf
                pExp.SetValue(2 * g, th - mSafe);
            }
            Sync<HardEvent::S_V>();
            Exp(pExp, pExp, PW);
            Sync<HardEvent::V_S>();
        }
        for (uint32_t g = 0; g < G; ++g) {
            const float rk = pr.GetValue(2 * g);
            const float ed = pe.GetValue(2 * g);
            const int32_t k = static_cast<int32_t>(pk.GetValue(2 * g));
            float eTilde = ed;  // post_softmax (denominator Z = R + E) and sdc "exact"
            if (td.placement == TOPTH_PRE_SOFTMAX) {
                if (td.sdc == TOPTH_SDC_NONE) {
                    eTilde = 0.0f;
                } else if (expThreshold) {  // gamma (n - k~) exp(theta - m), paper section 3.2.1
                    const int32_t droppedRows = static_cast<int32_t>(len) - k;
                    eTilde = droppedRows > 0 ? td.sdcGamma * static_cast<float>(droppedRows) * pExp.GetValue(2 * g)
                                             : 0.0f;
                } else if (td.sdc == TOPTH_SDC_OFFLINE) {
                    eTilde = sdcGm.GetValue(uint64_t(kvIdx * G + g) * td.maxRowId + row);
                }
            }
            pDen.SetValue(2 * g, rk + eTilde);
            statI.SetValue(g, k);
        }
        Sync<HardEvent::S_V>();
        Duplicate(pOne, 1.0f, PW);
        PipeBarrier<PIPE_V>();
        Div(pInv, pOne, pDen, PW);
        Sync<HardEvent::V_S>();
        for (uint32_t g = 0; g < G; ++g) {
            const float rk = pr.GetValue(2 * g);
            const float z = rk + pe.GetValue(2 * g);
            const float denom = pDen.GetValue(2 * g);
            const int32_t k = statI.GetValue(g);
            float inv = pInv.GetValue(2 * g);
            float beta;
            if (z != z) {  // a NaN or +inf score: the whole head is NaN
                inv = QNaN();
                beta = QNaN();
            } else {
                if (k == 0 || denom == 0.0f) {
                    inv = 0.0f;  // nothing kept: the weights are 0, never NaN
                }
                beta = 1.0f - rk * inv;  // 1 - sum of the kept weights, clamped to [0, 1]
                if (beta < 0.0f) beta = 0.0f;
                if (beta > 1.0f) beta = 1.0f;
            }
            pInv.SetValue(2 * g, inv);
            statF.SetValue(g, beta);
        }
        statU.SetValue(0, static_cast<int32_t>(unionRows));
        Sync<HardEvent::S_V>();
        Brcb(fB, pInv, static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();
        ScaleRows(acc, fB);
        if (td.vmc) {  // out += beta * mu (paper section 3.2.2)
            Sync<HardEvent::V_MTE2>();
            DataCopyExtParams p;
            p.blockCount = 1;
            p.blockLen = D * 4;
            p.srcStride = 0;
            p.dstStride = 0;
            p.rsv = 0;
            DataCopyPadExtParams<float> pad;
            pad.isPad = false;
            DataCopyPad(mu, muGm[uint64_t(pairIdx) * D], p, pad);
            Sync<HardEvent::MTE2_V>();
            for (uint32_t g = 0; g < G; ++g) {
                Axpy(acc[g * Dp], mu, statF.GetValue(g), static_cast<int32_t>(D));
                PipeBarrier<PIPE_V>();
            }
        }
        WriteOutput();
    }

    __aicore__ inline void WriteOutput()
    {
        const uint64_t outOff = (uint64_t(bIdx) * td.numQHeads + uint64_t(kvIdx) * G) * D;
        DataCopyExtParams p;
        p.blockCount = static_cast<uint16_t>(G);
        p.blockLen = D * sizeof(T);
        p.srcStride = 0;
        p.dstStride = 0;
        p.rsv = 0;
        if constexpr (kWiden) {
            Sync<HardEvent::MTE3_V>();  // the previous output copy from stage is done
            Cast(stage, acc, RoundMode::CAST_RINT, G * Dp);
            Sync<HardEvent::V_MTE3>();
            DataCopyPad(outGm[outOff], stage, p);
        } else {
            Sync<HardEvent::V_MTE3>();
            DataCopyPad(outGm[outOff], acc.template ReinterpretCast<T>(), p);
        }
        Sync<HardEvent::S_MTE3>();
        DataCopyExtParams sp;
        sp.blockCount = 1;
        sp.blockLen = G * 4;
        sp.srcStride = 0;
        sp.dstStride = 0;
        sp.rsv = 0;
        const uint64_t headOff = uint64_t(bIdx) * td.numQHeads + uint64_t(kvIdx) * G;
        DataCopyPad(keptGm[headOff], statI, sp);
        DataCopyPad(droppedGm[headOff], statF, sp);
        sp.blockLen = 4;
        DataCopyPad(vRowsGm[uint64_t(bIdx) * td.numKvHeads + kvIdx], statU, sp);
        Sync<HardEvent::MTE3_V>();
        Sync<HardEvent::MTE3_S>();
    }

    // ---------------------------------------------------------------- state
    TopthTilingData td;
    TPipe* pipe = nullptr;
    uint32_t G = 1, D = 1, Dp = 1, PW = 8, S = 1;
    static constexpr bool kWiden = (sizeof(T) != sizeof(float));  // fp16 / bf16: cast to float32 in UB
    bool rowAligned = true;

    GlobalTensor<T> qGm, kGm, vGm, outGm;
    GlobalTensor<int32_t> lensGm, keptGm, vRowsGm, syncGm, partGmI;
    GlobalTensor<float> thGm, sdcGm, muGm, droppedGm, scoresGm, statsGm, partGm;

    TQue<QuePosition::VECIN, 2> kQue, vQue, sQue;
    TBuf<> kF32Buf, prodBuf, qBuf, accBuf, scBuf, eBuf, ekBuf, indBuf, thrBuf, onesBuf, maskBuf;
    TBuf<> vF32Buf, wcBuf, wbBuf, pairBuf, pairBBuf, stageBuf, muBuf, cmbBuf, mAllBuf, syncBuf, statBuf;

    LocalTensor<float> kF32, prod, qF, acc, sc, ex, ek, ind, thr, ones, vF32, wc, wb, pairs, mB, fB;
    LocalTensor<float> mu, cmb, mAll, statF;
    LocalTensor<int32_t> statI, statU;
    LocalTensor<uint8_t> mask;
    LocalTensor<T> stage;

    uint32_t pairIdx = 0, splitIdx = 0, bIdx = 0, kvIdx = 0, n = 0, chunkStart = 0, chunkEnd = 0;
    uint64_t kvBase = 0;
    uint32_t unionCount = 0;
    float thrScalar = 0.0f;
};

}  // namespace topth

extern "C" __global__ __aicore__ void topth_decode_attn(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR seqLens,
                                                         GM_ADDR thresholds, GM_ADDR sdcTable, GM_ADDR valueMean,
                                                         GM_ADDR out, GM_ADDR kept, GM_ADDR vRows, GM_ADDR dropped,
                                                         GM_ADDR workspace, GM_ADDR tiling)
{
#ifdef KERNEL_TASK_TYPE_DEFAULT
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);  // vector cores only (no cube work)
#endif
    TopthTilingData td;
    topth::LoadTiling(td, tiling);
    TPipe pipe;
    if (td.dtype == TOPTH_DTYPE_FP16) {
        topth::TopthDecodeKernel<half> op;
        op.Init(query, key, value, seqLens, thresholds, sdcTable, valueMean, out, kept, vRows, dropped, workspace, td, &pipe);
        op.Process();
    } else if (td.dtype == TOPTH_DTYPE_BF16) {
        topth::TopthDecodeKernel<bfloat16_t> op;
        op.Init(query, key, value, seqLens, thresholds, sdcTable, valueMean, out, kept, vRows, dropped, workspace, td, &pipe);
        op.Process();
    } else {
        topth::TopthDecodeKernel<float> op;
        op.Init(query, key, value, seqLens, thresholds, sdcTable, valueMean, out, kept, vRows, dropped, workspace, td, &pipe);
        op.Process();
    }
}
