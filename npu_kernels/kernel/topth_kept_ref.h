// Group selection with pre_softmax: the kept reference. A head keeps the rows its group keeps,
// which may all score far below the head's own maximum m (its maximum sits on a row the group
// dropped); their exp(a - m) are then subnormal or 0 in float32. The kept weights, R and the
// accumulators are therefore relative to m_K, the running maximum over the head's kept scores
// (P_MK); the dropped sum E stays relative to m. The finalisation rescales E~ (defined
// relative to m) to m_K by exp(m - m_K) >= 1 without letting that factor overflow alone
// (docs/semantics.md, "A head's kept rows far below its own maximum").
#ifndef TOPTH_KEPT_REF_H
#define TOPTH_KEPT_REF_H

#include "topth_select.h"

namespace topth {

// One score tile s (G x W) with the group's kept mask in `mask` and ex = exp(a - m): the
// running kept maximum P_MK, R rescaled to it, fB = broadcast(exp(m_K old - m_K new)) for the
// accumulators; ek = kept exp(a - m_K) (0 where dropped), ex = dropped exp(a - m) (0 where
// kept, exact), ind = kept indicators.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::KeptWeights(const LocalTensor<float>& s)
{
    for (uint32_t g = 0; g < G; ++g) {  // kept scores, -inf elsewhere
        Select(ek[g * W], mask, s[g * W], NegInf(), SELMODE::VSEL_TENSOR_SCALAR_MODE, W);
    }
    PipeBarrier<PIPE_V>();
    RowMax(Pair(P_TMAX), ek, static_cast<int32_t>(W), static_cast<int32_t>(G), 1, 1, 8);
    PipeBarrier<PIPE_V>();
    Max(Pair(P_MNEW), Pair(P_MK), Pair(P_TMAX), PW);  // stays NEG_FLOOR while nothing is kept
    PipeBarrier<PIPE_V>();
    Sub(Pair(P_F), Pair(P_MK), Pair(P_MNEW), PW);
    PipeBarrier<PIPE_V>();
    Exp(Pair(P_F), Pair(P_F), PW);  // 0 when the first kept row arrives (R and acc are 0)
    Adds(Pair(P_MK), Pair(P_MNEW), 0.0f, PW);
    PipeBarrier<PIPE_V>();
    Mul(Pair(P_R), Pair(P_R), Pair(P_F), PW);
    Brcb(fB, Pair(P_MK), static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));  // m_K, for a moment
    PipeBarrier<PIPE_V>();
    BinaryRepeatParams bp(1, 1, 0, 8, 8, 2);
    Sub(ind, s, fB, W, static_cast<uint8_t>(G), bp);  // a - m_K
    PipeBarrier<PIPE_V>();
    // exp(a - m_K) may overflow at dropped positions (scores above m_K): the Select below
    // replaces them by 0 without arithmetic
    Exp(ind, ind, G * W);
    Brcb(fB, Pair(P_F), static_cast<uint8_t>(PW / 8), BrcbRepeatParams(1, 8));
    PipeBarrier<PIPE_V>();
    for (uint32_t g = 0; g < G; ++g) {
        Select(ek[g * W], mask, ind[g * W], 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, W);
    }
    PipeBarrier<PIPE_V>();
    for (uint32_t g = 0; g < G; ++g) {  // the kept exp(a - m)
        Select(ind[g * W], mask, ex[g * W], 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, W);
    }
    PipeBarrier<PIPE_V>();
    Sub(ex, ex, ind, G * W);  // dropped exp(a - m) (exact: x - x = 0, x - 0 = x; NaN stays)
    PipeBarrier<PIPE_V>();
    for (uint32_t g = 0; g < G; ++g) {
        Select(ind[g * W], mask, ones[g * W], 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, W);
    }
    PipeBarrier<PIPE_V>();
}

// Whether x exp(d) is formed as a plain product: exp(d) alone neither overflows nor turns
// subnormal, and x is normal (a scalar unit that flushes subnormals would read a subnormal x
// as 0 in the product; the log path reads it through its bits).
__aicore__ inline bool PlainProduct(float d, bool subnormalX)
{
    return d > -87.0f && d < 88.0f && !subnormalX;
}

// E~ of every head relative to its kept reference (m_K, or m when nothing is kept) into
// P_TMP, from (M, R, E, K, MK) of the whole row: x exp(d) with x = E (exact, d = m - ref),
// gamma (n - k) (exp_threshold, d = theta - ref) or the table value (offline, d = m - ref).
// The plain product where -87 < d < 88 and x is normal (PlainProduct); elsewhere
// sign(x) exp(ln |x| + d), so that exp(d) alone never overflows or turns subnormal while the
// product is in range (inf when the product is not: then the kept weights are 0 and beta is 1).
// 0, inf and NaN stay as they are.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::KeptEstimates(uint32_t len, uint32_t row)
{
    LocalTensor<float> pm = Pair(P_M), pe = Pair(P_E), pk = Pair(P_K), pmk = Pair(P_MK);
    LocalTensor<float> px = Pair(P_RT), pd = Pair(P_ET), pv = Pair(P_TMP);
    Sync<HardEvent::V_S>();
    for (uint32_t g = 0; g < G; ++g) {
        const int32_t k = static_cast<int32_t>(pk.GetValue(2 * g));
        const float m = pm.GetValue(2 * g);
        const float ref = k > 0 ? pmk.GetValue(2 * g) : m;
        float x = pe.GetValue(2 * g);
        float d = m - ref;
        if (td.sdc == TOPTH_SDC_EXP_THRESHOLD) {
            const int32_t droppedRows = static_cast<int32_t>(len) - k;
            x = droppedRows > 0 && td.sdcGamma != 0.0f ? td.sdcGamma * static_cast<float>(droppedRows) : 0.0f;
            d = thGm.GetValue(ThIndex(g, row)) - ref;
        } else if (td.sdc == TOPTH_SDC_OFFLINE) {
            x = sdcGm.GetValue(SdcIndex(g, row));
        }
        const uint32_t bits = FloatBits(x) & 0x7FFFFFFFu;
        px.SetValue(2 * g, x);
        pd.SetValue(2 * g, d);
        // ln |x| from the bits (LnArgument); 1 where x is 0, inf or NaN (x stays as it is)
        pv.SetValue(2 * g, bits != 0u && bits < 0x7F800000u ? LnArgument(x) : 1.0f);
    }
    Sync<HardEvent::S_V>();
    Ln(pv, pv, PW);
    Sync<HardEvent::V_S>();
    for (uint32_t g = 0; g < G; ++g) {
        const float x = px.GetValue(2 * g), d = pd.GetValue(2 * g);
        pv.SetValue(2 * g, PlainProduct(d, IsSubnormal(x)) ? d : pv.GetValue(2 * g) - LnShift(x) + d);
    }
    Sync<HardEvent::S_V>();
    Exp(pv, pv, PW);
    Sync<HardEvent::V_S>();
    for (uint32_t g = 0; g < G; ++g) {
        const float x = px.GetValue(2 * g), d = pd.GetValue(2 * g), e = pv.GetValue(2 * g);
        const uint32_t bits = FloatBits(x) & 0x7FFFFFFFu;
        float r = x;
        if (bits != 0u && bits < 0x7F800000u) {
            r = PlainProduct(d, IsSubnormal(x)) ? x * e : (x < 0.0f ? -e : e);
        }
        pv.SetValue(2 * g, r);
    }
}

}  // namespace topth

#endif  // TOPTH_KEPT_REF_H
