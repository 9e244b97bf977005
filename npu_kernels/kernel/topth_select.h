// Selection and V gather: post_softmax pass B (score tiles from the workspace), the kept
// masks per head or per group, kept / dropped sums, the union of kept positions over the
// group and the copy of only those V rows, weighted into the accumulators.
#ifndef TOPTH_SELECT_H
#define TOPTH_SELECT_H

#include "topth_scores.h"

namespace topth {

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::CopyScoreTile(uint32_t pos)
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

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::PassB()
{
    // Reference max M in P_M, Z in P_R: lnZ, broadcasts, then fresh accumulators.
    // Z is at least about 1 wherever a score is finite (its maximum's term is exp(0)); Z = 0
    // where every score is -inf. Z is raised to 2^-100 first, so ln Z is finite there and each
    // a - m - ln Z of that head is -inf (never kept) instead of -inf - -inf = NaN in the group
    // maximum (a poisoned head's NaN scores keep it NaN whatever Maxs does with a NaN Z).
    Maxs(Pair(P_R), Pair(P_R), 7.888609052210118e-31f, PW);
    PipeBarrier<PIPE_V>();
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
    FlushV();
}

// Scores of one tile (G x W, rows valid, -inf beyond) against the reference max in mB:
// kept mask, sums, union of kept positions over the group, gather of those V rows,
// out[g] += sum_kept exp(a - m) v. pre_softmax: the accumulators, relative to the previous
// maximum until the previous tile's last V batch is in, are then rescaled by fB (RescaleStats;
// with group selection exp(a - m_K) and the kept maximum m_K, KeptWeights).
// With td.vPrefetch the first V batch of this tile is copied before that last batch is
// accumulated, and this tile's last batch is left pending for the next tile (FlushV at the end).
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::SelectAccumulate(const LocalTensor<float>& s, uint32_t rows,
                                                              uint32_t pos, bool post)
{
    const uint8_t reps = static_cast<uint8_t>(G);
    BinaryRepeatParams bp(1, 1, 0, 8, 8, 2);
    Sub(ex, s, mB, W, reps, bp);  // a - m
    PipeBarrier<PIPE_V>();
    if (post) {
        Sub(ek, ex, fB, W, reps, bp);  // a - m - ln Z (log of the probability), compared in the log domain
        PipeBarrier<PIPE_V>();
    }
    const LocalTensor<float>& x = post ? ek : s;  // what the threshold is compared with
    Exp(ex, ex, G * W);
    if (td.selection == TOPTH_SELECT_GROUP) {
        // One threshold per KV head against the group maximum of x; every head keeps the
        // same positions. Compare (count form) takes W floats = 256 bytes.
        Adds(ind, x, 0.0f, G * W);
        PipeBarrier<PIPE_V>();
        for (uint32_t h = G; h > 1;) {  // a tree: log2 G barriers
            const uint32_t half = h / 2;
            Max(ind, ind, ind[(h - half) * W], half * W);
            PipeBarrier<PIPE_V>();
            h -= half;
        }
        Compare(mask, ind, thr, CMPMODE::GT, W);
        PipeBarrier<PIPE_V>();
        if (keptRef) {
            KeptWeights(s);  // ek relative to the kept maximum, ex the dropped ones, ind
        } else {
            for (uint32_t g = 0; g < G; ++g) {
                Select(ek[g * W], mask, ex[g * W], 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, W);
                Select(ind[g * W], mask, ones[g * W], 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, W);
            }
            PipeBarrier<PIPE_V>();
        }
    } else {
        // Compare (count form) needs count x sizeof(float) to be a multiple of 256 bytes: G x 64
        // floats. The mask only feeds Select, so its bit order never matters here.
        Compare(mask, x, thr, CMPMODE::GT, G * W);
        PipeBarrier<PIPE_V>();
        Select(ek, mask, ex, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, G * W);
        Select(ind, mask, ones, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, G * W);
        PipeBarrier<PIPE_V>();
    }
    if (!keptRef) Sub(ex, ex, ek, G * W);  // dropped exponentials (exact: x - x = 0, x - 0 = x)
    RowSum(Pair(P_RT), ek, static_cast<int32_t>(W), static_cast<int32_t>(G), 2, 1, 8);
    RowSum(Pair(P_KT), ind, static_cast<int32_t>(W), static_cast<int32_t>(G), 2, 1, 8);
    PipeBarrier<PIPE_V>();
    RowSum(Pair(P_ET), ex, static_cast<int32_t>(W), static_cast<int32_t>(G), 2, 1, 8);
    Add(Pair(P_R), Pair(P_R), Pair(P_RT), PW);
    Add(Pair(P_K), Pair(P_K), Pair(P_KT), PW);
    PipeBarrier<PIPE_V>();
    Add(Pair(P_E), Pair(P_E), Pair(P_ET), PW);
    // union over the group's heads: ind[0, j] = max_g ind[g, j] (a tree: log2 G barriers)
    for (uint32_t h = G; h > 1;) {
        const uint32_t half = h / 2;
        Max(ind, ind, ind[(h - half) * W], half * W);
        PipeBarrier<PIPE_V>();
        h -= half;
    }
    // The union as a 64-bit mask: the scalar unit reads its two words (no per-position
    // scan), plans the V copies over it and writes back the rows to fetch, whose weights
    // the vector unit compacts with GatherMask.
    Compare(uBits8, ind, ones, CMPMODE::GE, W);  // ind is 0 or 1
    Sync<HardEvent::V_S>();
    const uint64_t keptBits = uint64_t(uBits.GetValue(0)) | (uint64_t(uBits.GetValue(1)) << 32);
    const uint32_t par = td.vPrefetch ? (tileParity ^= 1u) : 0u;  // spans / weights of this tile
    VSpans& sp = spans[par];
    const LocalTensor<float> w = wc[par * G * W];
    PlanSpans(keptBits, pos, sp);
    const uint32_t r = static_cast<uint32_t>(ScalarGetCountOfValue<1>(keptBits));
    unionCount += r;
    if (sp.rows > 0) {
        fBits.SetValue(0, static_cast<uint32_t>(sp.fetchBits));
        fBits.SetValue(1, static_cast<uint32_t>(sp.fetchBits >> 32));
    }
    Sync<HardEvent::S_V>();
    if (sp.rows > 0) {
        // w[g, i] = weight of head g for the i-th fetched row (0 for rows fetched between runs)
        uint64_t picked = 0;
        for (uint32_t g = 0; g < G; ++g) {
            GatherMask(w[g * W], ek[g * W], fBits, false, 0, GatherMaskParams(1, 1, 8, 0), picked);
        }
        PipeBarrier<PIPE_V>();
        IssueV(0, pos, sp);  // in flight while the pending batch is accumulated
    }
    FlushV();
    if (!post) ScaleRows(acc, fB);  // now relative to this tile's maximum
    const uint32_t nBatch = CeilDiv(sp.rows, td.tileV);
    for (uint32_t b = 0; b < nBatch; ++b) {
        if (b + 1 < nBatch) {
            IssueV(b + 1, pos, sp);  // double buffering
        }
        const uint32_t nb = Min32(td.tileV, sp.rows - b * td.tileV);
        if (td.vPrefetch && b + 1 == nBatch) {
            vPending = true;  // accumulated after the next tile's first batch is issued
            pendBatch = b;
            pendNb = nb;
            pendParity = par;
        } else {
            AccumulateV(b, nb, sp, w);
        }
    }
}

// The pending V batch of the previous tile, if any, into the accumulators.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::FlushV()
{
    if (!vPending) return;
    vPending = false;
    AccumulateV(pendBatch, pendNb, spans[pendParity], wc[pendParity * G * W]);
}

// Copy spans of one tile from the union mask: runs of kept positions, merged with the next
// run when the last byte of the one and the first byte of the other lie in the same
// mergeGapBytes-aligned GM granule (512: a DRAM access fetches it whole anyway) inside one
// cache block: one copy instead of two; the rows between are zeroed in UB, never used.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::PlanSpans(uint64_t keptBits, uint32_t pos, VSpans& sp)
{
    sp.n = 0;
    sp.rows = 0;
    sp.fetchBits = 0;
    sp.keptBits = keptBits;
    const uint64_t granule = td.mergeGapBytes;
    uint64_t bits = keptBits;
    int64_t s = ScalarGetSFFValue<1>(bits);
    while (s >= 0) {
        const int64_t z = ScalarGetSFFValue<0>(bits >> s);
        const uint32_t len = z < 0 ? static_cast<uint32_t>(64 - s) : static_cast<uint32_t>(z);
        const uint32_t start = static_cast<uint32_t>(s);
        const uint64_t run = (len >= 64 ? ~0ull : ((1ull << len) - 1)) << start;
        bits &= ~run;
        bool merged = false;
        if (sp.n > 0 && granule > 0) {
            const uint32_t end = sp.start[sp.n - 1] + sp.len[sp.n - 1];
            const bool sameBlock = (pos + end - 1) / td.blockSize == (pos + start) / td.blockSize;
            if (sameBlock && (VRowOffset(pos + end - 1) * sizeof(T) + D * sizeof(T) - 1) / granule ==
                                 (VRowOffset(pos + start) * sizeof(T)) / granule) {
                sp.len[sp.n - 1] = start + len - sp.start[sp.n - 1];
                merged = true;
            }
        }
        if (!merged) {
            sp.start[sp.n] = start;
            sp.len[sp.n] = len;
            sp.n++;
        }
        s = ScalarGetSFFValue<1>(bits);
    }
    for (uint32_t k = 0; k < sp.n; ++k) {
        const uint32_t len = sp.len[k];
        sp.fetchBits |= (len >= 64 ? ~0ull : ((1ull << len) - 1)) << sp.start[k];
        sp.rows += len;
    }
}

// Copy the fetched rows of batch `batch` (fetched rows batch*tileV ...) into a queue buffer.
template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::IssueV(uint32_t batch, uint32_t pos, const VSpans& sp)
{
    const uint32_t first = batch * td.tileV;
    const uint32_t last = Min32(sp.rows, first + td.tileV);
    LocalTensor<T> vIn = vQue.template AllocTensor<T>();
    uint32_t r = 0;
    for (uint32_t k = 0; k < sp.n && r < last; ++k) {
        const uint32_t lo = r, hi = r + sp.len[k];
        const uint32_t a = lo > first ? lo : first;
        const uint32_t e = hi < last ? hi : last;
        if (a < e) {
            CopySeqRows(vIn[(a - first) * Dp], false, pos + sp.start[k] + (a - lo), e - a);
        }
        r = hi;
    }
    vQue.EnQue(vIn);
}

template <typename T>
__aicore__ inline void TopthDecodeKernel<T>::AccumulateV(uint32_t batch, uint32_t nb, const VSpans& sp,
                                                         const LocalTensor<float>& w)
{
    LocalTensor<T> vIn = vQue.template DeQue<T>();
    // Rows fetched between two runs were dropped by every head: zero them (they may hold
    // NaN or inf, and 0 x NaN is NaN), so that they change nothing.
    const uint32_t first = batch * td.tileV;
    bool zeroed = false;
    uint32_t r = 0;
    for (uint32_t k = 0; k < sp.n && r < first + nb; ++k) {
        for (uint32_t i = 0; i < sp.len[k]; ++i, ++r) {
            if (r < first || r >= first + nb || ((sp.keptBits >> (sp.start[k] + i)) & 1ull)) continue;
            Duplicate(vIn[(r - first) * Dp], T(0.0f), static_cast<int32_t>(Dp));
            zeroed = true;
        }
    }
    if (zeroed) PipeBarrier<PIPE_V>();
    LocalTensor<float> vf;
    if constexpr (kWiden) {
        Cast(vF32, vIn, RoundMode::CAST_NONE, nb * Dp);
        vQue.FreeTensor(vIn);
        vf = vF32;
    } else {
        vf = vIn.template ReinterpretCast<float>();
    }
    PipeBarrier<PIPE_V>();
    const uint8_t brcbReps = static_cast<uint8_t>(CeilDiv(nb, 8));
    const uint32_t chunks = CeilDiv(Dp, 64);
    uint32_t depth = 0;  // additions of the row tree below
    for (uint32_t k = nb; k > 1; k -= k / 2) ++depth;
    const uint32_t hc = td.wbHeads;  // heads per chunk of the row scheme
    if (CeilDiv(G, hc) * (nb + 1) <= G * (2 + chunks + depth)) {
        // By rows (fewer barriers when the group is larger than a few rows' worth): the
        // weights of hc heads broadcast at once, then acc[g] += w[g, r] v_r for those heads
        // per row (disjoint accumulator rows; one barrier per row).
        const uint32_t tvPad = ((td.tileV + 7) / 8) * 8, full = Dp / 64, tail = Dp % 64;
        const BinaryRepeatParams p(1, 1, 0, 8, 8, 0);  // the weight's block broadcast to every block
        for (uint32_t g0 = 0; g0 < G; g0 += hc) {
            const uint32_t g1 = Min32(G, g0 + hc);
            for (uint32_t g = g0; g < g1; ++g) {
                Brcb(wb[(g - g0) * tvPad * 8], w[g * W + batch * td.tileV], brcbReps, BrcbRepeatParams(1, 8));
            }
            PipeBarrier<PIPE_V>();
            for (uint32_t r = 0; r < nb; ++r) {
                for (uint32_t g = g0; g < g1; ++g) {
                    const LocalTensor<float> wr = wb[((g - g0) * tvPad + r) * 8];
                    if (full) MulAddDst(acc[g * Dp], vf[r * Dp], wr, 64, static_cast<uint8_t>(full), p);
                    if (tail) MulAddDst(acc[g * Dp + full * 64], vf[r * Dp + full * 64], wr, tail, 1, p);
                }
                PipeBarrier<PIPE_V>();
            }
        }
        if constexpr (!kWiden) vQue.FreeTensor(vIn);
        return;
    }
    const uint8_t rowBlocks = static_cast<uint8_t>(Dp / 8);
    for (uint32_t g = 0; g < G; ++g) {  // by heads: weighted rows, summed as a tree
        Brcb(wb, w[g * W + batch * td.tileV], brcbReps, BrcbRepeatParams(1, 8));
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

}  // namespace topth

#endif  // TOPTH_SELECT_H
