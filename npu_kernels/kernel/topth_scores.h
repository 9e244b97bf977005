// Pass A: the query of the group, the thresholds, the K stream and the scores a_j of all
// G heads on the vector unit, running maxima (flash-attention rescaling) and, for
// post_softmax, Z and the score workspace.
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
        for (uint32_t g = 0; g < G; ++g) {
            const float th = thGm.GetValue(ThIndex(g, row));
            tmp.SetValue(2 * g, th > 0.0f ? th : 1.0f);
        }
        Sync<HardEvent::S_V>();
        Ln(tmp, tmp, PW);
        Sync<HardEvent::V_S>();
    }
    for (uint32_t g = 0; g < G; ++g) {
        const float th = thGm.GetValue(ThIndex(g, row));
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

// Flash-attention rescale of R, E and the output accumulators by P_F.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::RescaleAccumulators()
{
    Mul(Pair(P_R), Pair(P_R), Pair(P_F), PW);
    Mul(Pair(P_E), Pair(P_E), Pair(P_F), PW);
    Brcb(fB, Pair(P_F), static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
    PipeBarrier<PIPE_V>();
    ScaleRows(acc, fB);
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
