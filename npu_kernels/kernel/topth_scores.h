// Pass A: the query of the group, the thresholds, the K stream and the scores a_j of all
// G heads on the vector unit (all-vector path) or the score tiles the cube core computed
// (cube path, the ring), running maxima (flash-attention rescaling) and, for post_softmax,
// Z and the score workspace.
#ifndef TOPTH_SCORES_H
#define TOPTH_SCORES_H

#include "topth_plan.h"

namespace topth {

// The G query rows of this group, as float32 rows of Dp (zero padded) in qF.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::LoadQuery()
{
    const uint64_t off = (uint64_t(bIdx) * td.numQHeads + uint64_t(kvIdx) * G) * D;
    Sync<HardEvent::V_MTE2>();  // the previous item's vector reads of qF / stage are done
    if constexpr (kWiden) {
        Sync<HardEvent::MTE3_MTE2>();  // stage also carries the previous output to GM
        DataCopyPad(stage, qGm[off], RowParams(G, D), RowPad());
        Sync<HardEvent::MTE2_V>();
        Cast(qF, stage, RoundMode::CAST_NONE, G * Dp);
    } else {
        LocalTensor<T> qT = qF.template ReinterpretCast<T>();
        DataCopyPad(qT, qGm[off], RowParams(G, D), RowPad());
        Sync<HardEvent::MTE2_V>();
    }
    PipeBarrier<PIPE_V>();
}

// thr[g, :] = theta_g (pre_softmax) or ln(theta_g) (post_softmax; theta <= 0 -> -inf,
// so every finite score is kept; NaN stays NaN and keeps nothing). With group selection
// every row holds the group's theta.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::BuildThresholds(bool logDomain)
{
    const uint32_t row = RowIndex(n);
    LocalTensor<float> tmp = Pair(P_TMP);
    if (logDomain) {
        Sync<HardEvent::V_S>();
        // Decided on the bits (LnArgument, LnShift), so that a flush of subnormals to zero
        // cannot change the cut.
        for (uint32_t g = 0; g < G; ++g) {
            const float th = thGm.GetValue(ThIndex(g, row));
            const uint32_t bits = FloatBits(th);
            tmp.SetValue(2 * g, bits != 0u && bits < 0x80000000u ? LnArgument(th) : 1.0f);
        }
        Sync<HardEvent::S_V>();
        Ln(tmp, tmp, PW);
        Sync<HardEvent::V_S>();
    }
    for (uint32_t g = 0; g < G; ++g) {
        const float th = thGm.GetValue(ThIndex(g, row));
        float v = th;
        if (logDomain) {
            const uint32_t bits = FloatBits(th);
            const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
            const bool positive = bits != 0u && bits < 0x80000000u;
            v = nan ? th : (positive ? tmp.GetValue(2 * g) - LnShift(th) : NegInf());
        }
        thrScalar = v;
        Duplicate(thr[g * W], thrScalar, W);
    }
    if (logDomain) Sync<HardEvent::S_V>();
    PipeBarrier<PIPE_V>();
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::CopyKTile(uint32_t pos)
{
    const uint32_t rows = Min32(td.tileK, chunkEnd - pos);
    LocalTensor<T> kIn = kQue.template AllocTensor<T>();
    CopySeqRows(kIn, true, pos, rows);
    kQue.EnQue(kIn);
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::StreamKeys()
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
        ScoreTile(pos, rows);
    }
    FlushV();
}

// One tile of scores in sc (G x W, -inf beyond rows): running maxima, then selection and the
// V gather (pre_softmax) or Z and the score workspace (post_softmax pass A).
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::ScoreTile(uint32_t pos, uint32_t rows)
{
    RunningMax();
    if (td.placement == TOPTH_PRE_SOFTMAX) {
        RescaleStats();
        SelectAccumulate(sc, rows, pos, false);
    } else {
        AccumulateZ();
        StoreScores(pos, rows);
    }
}

// Cube path: the score tile of ring step `step` (G rows of `rows` floats, W apart) into the
// score queue, padded with -inf to a whole number of 32-byte blocks.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::CopyRingTile(uint64_t step, uint32_t rows)
{
    const uint32_t rows8 = ((rows + 7) / 8) * 8;
    LocalTensor<float> sIn = sQue.template AllocTensor<float>();
    DataCopyExtParams p;
    p.blockCount = static_cast<uint16_t>(G);
    p.blockLen = rows * 4;
    p.srcStride = (W - rows) * 4;
    p.dstStride = (W - rows8) / 8;
    p.rsv = 0;
    DataCopyPadExtParams<float> pad;
    pad.isPad = (rows8 != rows);
    pad.leftPadding = 0;
    pad.rightPadding = static_cast<uint8_t>(rows8 - rows);
    pad.paddingValue = NegInf();
    DataCopyPad(sIn, ringGm[(step % td.ringSlots) * G * W], p, pad);
    sQue.EnQue(sIn);
}

// Cube path: `steps` ring steps in step with the cube core (topth_cube.h); this item's
// tiles are the first `tiles`. The score tile of the next step is copied while the current
// one is processed; each step frees its slot (FLAG_SLOT_FREE, on MTE2: after the copy) as
// soon as it is in UB.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::FetchRing(uint32_t s, uint32_t tiles)
{
    if (!TOPTH_MODEL_FAULT(read_ring_before_flag)) CrossCoreWaitFlag(FLAG_SCORES_READY);
    if (s < tiles) CopyRingTile(ringStep, Min32(W, chunkEnd - (chunkStart + s * W)));
    CrossCoreSetFlag<2, PIPE_MTE2>(FLAG_SLOT_FREE);
    ringStep++;
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::StreamRing(uint32_t steps, uint32_t tiles)
{
    if (steps > 0) FetchRing(0, tiles);
    for (uint32_t s = 0; s < steps; ++s) {
        if (s + 1 < steps) FetchRing(s + 1, tiles);
        if (s >= tiles) continue;
        const uint32_t pos = chunkStart + s * W;
        const uint32_t rows = Min32(W, chunkEnd - pos);
        const uint32_t rows8 = ((rows + 7) / 8) * 8;
        LocalTensor<float> sIn = sQue.template DeQue<float>();
        if (rows8 < W) {
            Duplicate(sIn[rows8], NegInf(), W - rows8, static_cast<uint8_t>(G), 1, 8);
            PipeBarrier<PIPE_V>();
        }
        Muls(sc, sIn, td.scale, G * W);
        PipeBarrier<PIPE_V>();
        sQue.FreeTensor(sIn);
        ScoreTile(pos, rows);
    }
    FlushV();
}

// sc[g, j] = scale * <q_g, k_j> for j < rows; -inf for rows <= j < W.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::Scores(LocalTensor<T>& kIn, uint32_t rows)
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
        RowSum(sc[g * W], prod, static_cast<int32_t>(lanes), static_cast<int32_t>(rows), 1, 1, 8);
        PipeBarrier<PIPE_V>();
    }
    if constexpr (!kWiden) kQue.FreeTensor(kIn);
    Muls(sc, sc, td.scale, G * W);
    PipeBarrier<PIPE_V>();
}

// P_MNEW = max(P_M, tile max); P_F = exp(P_M - P_MNEW); P_M = P_MNEW; mB = broadcast(P_M).
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::RunningMax()
{
    // RowMax writes a (max, index) pair per repeat, dstRepStride counted in pairs: head g's
    // maximum lands at element 2g, the layout of every pair vector here. Odd elements are
    // never read.
    RowMax(Pair(P_TMAX), sc, static_cast<int32_t>(W), static_cast<int32_t>(G), 1, 1, 8);
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

// Flash-attention rescale of R and E by P_F, and fB = broadcast(P_F) for the accumulators
// (scaled in SelectAccumulate, after the previous tile's last V batch). With the kept
// reference only E: R and the accumulators follow the kept maximum (KeptWeights).
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::RescaleStats()
{
    if (keptRef) {
        Mul(Pair(P_E), Pair(P_E), Pair(P_F), PW);
        PipeBarrier<PIPE_V>();
        return;
    }
    Mul(Pair(P_R), Pair(P_R), Pair(P_F), PW);
    Mul(Pair(P_E), Pair(P_E), Pair(P_F), PW);
    Brcb(fB, Pair(P_F), static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
    PipeBarrier<PIPE_V>();
}

// rows[g, :] *= broadcast[g] (broadcast: one 32-byte block per pair element).
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::ScaleRows(const LocalTensor<float>& rows, const LocalTensor<float>& bcast)
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
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::AccumulateZ()
{
    BinaryRepeatParams p(1, 1, 0, 8, 8, 2);
    Sub(ex, sc, mB, W, static_cast<uint8_t>(G), p);
    PipeBarrier<PIPE_V>();
    Exp(ex, ex, G * W);
    PipeBarrier<PIPE_V>();
    RowSum(Pair(P_RT), ex, static_cast<int32_t>(W), static_cast<int32_t>(G), 2, 1, 8);
    Mul(Pair(P_R), Pair(P_R), Pair(P_F), PW);
    PipeBarrier<PIPE_V>();
    Add(Pair(P_R), Pair(P_R), Pair(P_RT), PW);
    PipeBarrier<PIPE_V>();
}

// post_softmax pass A: scores of this tile -> workspace [pair, g, pos].
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::StoreScores(uint32_t pos, uint32_t rows)
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

// post_softmax with splits: (m, Z) of this split -> workspace record `rec`.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::WriteStatsA(uint64_t rec)
{
    Sync<HardEvent::V_MTE3>();
    DataCopy(statsGm[rec * 2 * PW], Pair(P_M), PW);
    DataCopy(statsGm[rec * 2 * PW + PW], Pair(P_R), PW);
    Sync<HardEvent::MTE3_V>();
}

// post_softmax pass B prologue with splits: global M and Z from every split of the pair.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::MergeStatsA()
{
    Sync<HardEvent::V_MTE2>();
    DataCopy(mAll, statsGm[uint64_t(pairIdx) * td.splitCap * 2 * PW], pieces * 2 * PW);
    Sync<HardEvent::MTE2_V>();
    Duplicate(Pair(P_M), NEG_FLOOR, PW);
    Duplicate(Pair(P_R), 0.0f, PW);
    PipeBarrier<PIPE_V>();
    for (uint32_t s = 0; s < pieces; ++s) {
        Max(Pair(P_M), Pair(P_M), mAll[s * 2 * PW], PW);
        PipeBarrier<PIPE_V>();
    }
    for (uint32_t s = 0; s < pieces; ++s) {
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

}  // namespace topth

#endif  // TOPTH_SCORES_H
