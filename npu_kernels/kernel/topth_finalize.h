// Split partials, their log-sum-exp combine, and the finalisation of a whole row: SDC,
// normalisation, VMC, output and statistics.
#ifndef TOPTH_FINALIZE_H
#define TOPTH_FINALIZE_H

#include "topth_kept_ref.h"

namespace topth {

// Partial record: [M, R, E, K] pair vectors (then MK with the kept reference: recPairs in
// all), union count (int32 in an 8-word block), acc.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::WritePartial(uint64_t rec)
{
    const uint64_t base = rec * td.partFloats, head = uint64_t(recPairs) * PW;
    statU.SetValue(0, static_cast<int32_t>(unionCount));
    Sync<HardEvent::S_MTE3>();
    Sync<HardEvent::V_MTE3>();
    DataCopy(partGm[base], pairs, 4 * PW);
    if (keptRef) DataCopy(partGm[base + 4 * PW], Pair(P_MK), PW);
    DataCopy(partGmI[base + head], statU, 8);
    DataCopy(partGm[base + head + 8], acc, G * Dp);
    Sync<HardEvent::MTE3_V>();
    Sync<HardEvent::MTE3_S>();
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::Combine(uint32_t pair)
{
    SetPair(pair);
    if (pieces <= 1) return;  // finalised by its only item
    ResetAccumulators();
    const uint64_t first = uint64_t(pair) * td.splitCap * td.partFloats;
    // m of every split: `pieces` blocks of PW floats, GM gap partFloats - PW, packed in UB
    DataCopyParams mp(static_cast<uint16_t>(pieces), static_cast<uint16_t>(PW / 8),
                      static_cast<uint16_t>((td.partFloats - PW) / 8), 0);
    // with the kept reference also the kept maxima of every split, after the M's
    const LocalTensor<float> mkAll = mAll[td.splitCap * PW];
    Sync<HardEvent::V_MTE2>();
    DataCopy(mAll, partGm[first], mp);
    if (keptRef) DataCopy(mkAll, partGm[first + 4 * PW], mp);
    Sync<HardEvent::MTE2_V>();
    for (uint32_t s = 0; s < pieces; ++s) {  // M = max over splits of their reference maxima
        Max(Pair(P_M), Pair(P_M), mAll[s * PW], PW);
        // the kept reference: the largest of the splits that kept rows (NEG_FLOOR in the others)
        if (keptRef) Max(Pair(P_MK), Pair(P_MK), mkAll[s * PW], PW);
        PipeBarrier<PIPE_V>();
    }
    LocalTensor<int32_t> cmbI = cmb.template ReinterpretCast<int32_t>();
    const uint32_t head = recPairs * PW;
    LocalTensor<float> row = cmb[head + 8];  // one accumulator row of a partial record
    for (uint32_t s = 0; s < pieces; ++s) {
        const uint64_t rec = first + uint64_t(s) * td.partFloats;
        Sync<HardEvent::V_MTE2>();
        Sync<HardEvent::S_MTE2>();
        DataCopy(cmb, partGm[rec], head + 8);
        Sync<HardEvent::MTE2_V>();
        Sync<HardEvent::MTE2_S>();
        unionCount += static_cast<uint32_t>(cmbI.GetValue(head));
        Sub(Pair(P_F), cmb, Pair(P_M), PW);  // f = exp(m_s - M)
        if (keptRef) Sub(Pair(P_TMP), cmb[4 * PW], Pair(P_MK), PW);  // fk = exp(mk_s - M_K) <= 1
        PipeBarrier<PIPE_V>();
        Exp(Pair(P_F), Pair(P_F), PW);
        if (keptRef) Exp(Pair(P_TMP), Pair(P_TMP), PW);
        PipeBarrier<PIPE_V>();
        // R and the accumulators by fk with the kept reference (E by f: relative to M)
        const LocalTensor<float> fr = keptRef ? Pair(P_TMP) : Pair(P_F);
        Mul(cmb[PW], cmb[PW], fr, PW);
        Mul(cmb[2 * PW], cmb[2 * PW], Pair(P_F), PW);
        Brcb(fB, fr, static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
        PipeBarrier<PIPE_V>();
        Add(Pair(P_R), Pair(P_R), cmb[PW], PW);
        Add(Pair(P_E), Pair(P_E), cmb[2 * PW], PW);
        Add(Pair(P_K), Pair(P_K), cmb[3 * PW], PW);
        // acc[g] += f_g * partial acc[g], one row at a time (the record does not need to
        // fit the unified buffer: groups near the UB limit keep their KV split)
        for (uint32_t g = 0; g < G; ++g) {
            Sync<HardEvent::V_MTE2>();
            DataCopy(row, partGm[rec + head + 8 + uint64_t(g) * Dp], Dp);
            Sync<HardEvent::MTE2_V>();
            for (uint32_t c0 = 0; c0 < Dp; c0 += 64) {
                BinaryRepeatParams p(1, 1, 0, 8, 8, 0);
                Mul(row[c0], row[c0], fB[2 * g * 8], Min32(64, Dp - c0), 1, p);
            }
            PipeBarrier<PIPE_V>();
            Add(acc[g * Dp], acc[g * Dp], row, Dp);
            PipeBarrier<PIPE_V>();
        }
    }
    Finalize(n, unionCount);
}

// From (M, R, E, K, acc) of a whole row: SDC, normalisation, VMC, output and stats.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::Finalize(uint32_t len, uint32_t unionRows)
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
    if (keptRef && td.sdc != TOPTH_SDC_NONE) {
        KeptEstimates(len, row);  // E~ relative to the kept reference, in pExp
    } else if (expThreshold) {  // exp(theta - M) for the whole group with one vector Exp
        for (uint32_t g = 0; g < G; ++g) {
            const float th = thGm.GetValue(ThIndex(g, row));
            // m = -FLT_MAX when every valid score is -inf: then nothing is kept and the
            // weights are 0 whatever exp(theta - m) is (the k == 0 case below).
            pExp.SetValue(2 * g, th - pm.GetValue(2 * g));
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
            } else if (keptRef) {
                eTilde = pExp.GetValue(2 * g);
            } else if (expThreshold) {  // gamma (n - k~) exp(theta - m), paper section 3.2.1
                const int32_t droppedRows = static_cast<int32_t>(len) - k;
                // 0 when gamma is 0 (not 0 x inf when theta - m > 88)
                eTilde = droppedRows > 0 && td.sdcGamma != 0.0f
                             ? td.sdcGamma * static_cast<float>(droppedRows) * pExp.GetValue(2 * g)
                             : 0.0f;
            } else if (td.sdc == TOPTH_SDC_OFFLINE) {
                eTilde = sdcGm.GetValue(SdcIndex(g, row));
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

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::WriteOutput()
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

}  // namespace topth

#endif  // TOPTH_FINALIZE_H
