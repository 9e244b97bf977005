// AVX-512 level, stage 2: thresholding and the group union. Pass 1 builds the kept-union
// mask of each 16-position block (head selection: OR over the heads of x > cut[h]; group
// selection: NaN-propagating group max of x > cut[0]) and writes the kept positions; pass
// 2, per head, packs the scores of the kept-union rows (-inf where the head dropped a row
// kept by another head of its group) and then turns them into weights exp(a - mref) in
// place, so exp runs on kept rows only; plus their sum R, the kept count and, for exact
// SDC, the sum over the dropped positions.
//
// Packing uses the register form of vpcompressd / vcompressps and a full 16-lane store
// (the buffers have 16 elements of slack, Scratch::reserve): the memory form is
// microcoded and slow on AMD Zen 4.
#include "avx512_common.h"

namespace topth_cpu {
namespace avx512_level {

int64_t select(const SelectArgs& a) {
    const int32_t G = a.G;
    const int64_t len = a.len;
    const int64_t nblk = (len + 15) / 16;
    // the flags scratch ([len] bytes) holds one 16-bit union mask per block (2 * nblk <= len + 15 bytes;
    // dispatch allocates len + 16)
    __mmask16* umask = reinterpret_cast<__mmask16*>(a.flags);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t cnt = 0;
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t j0 = blk * 16;
        const __mmask16 tm = tail_mask(len - j0);
        __mmask16 u = 0;
        if (a.group) {
            __m512 xg = _mm512_set1_ps(-INFINITY);
            __mmask16 nan = 0;
            for (int32_t h = 0; h < G; ++h) {
                const __m512 s = _mm512_maskz_loadu_ps(tm, a.S + h * a.ldS + j0);
                const __m512 x = _mm512_sub_ps(_mm512_sub_ps(s, _mm512_set1_ps(a.sub1[h])), _mm512_set1_ps(a.sub2[h]));
                nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
                xg = _mm512_max_ps(x, xg);
            }
            u = _mm512_mask_cmp_ps_mask(tm, xg, _mm512_set1_ps(a.cut[0]), _CMP_GT_OQ) & __mmask16(~nan);
        } else {
            for (int32_t h = 0; h < G; ++h) {
                const __m512 s = _mm512_maskz_loadu_ps(tm, a.S + h * a.ldS + j0);
                const __m512 x = _mm512_sub_ps(_mm512_sub_ps(s, _mm512_set1_ps(a.sub1[h])), _mm512_set1_ps(a.sub2[h]));
                u |= _mm512_mask_cmp_ps_mask(tm, x, _mm512_set1_ps(a.cut[h]), _CMP_GT_OQ);
            }
        }
        umask[blk] = u;
        const __m512i pos = _mm512_add_epi32(iota, _mm512_set1_epi32(int32_t(j0)));
        _mm512_storeu_si512(a.idx + cnt, u == 0xFFFF ? pos : _mm512_maskz_compress_epi32(u, pos));
        cnt += __builtin_popcount(u);
    }
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int32_t h = 0; h < G; ++h) {
        const float* s = a.S + h * a.ldS;
        const __m512 s1 = _mm512_set1_ps(a.sub1[h]), s2 = _mm512_set1_ps(a.sub2[h]);
        const __m512 c = _mm512_set1_ps(a.group ? -INFINITY : a.cut[h]);  // cut[1..] exist only per head
        const __m512 mr = _mm512_set1_ps(a.mref[h]);
        float* w = a.wk + h * a.ldw;
        int64_t k = 0, off = 0;
        // 1. this head's scores of the kept-union rows, -inf where it dropped the row
        for (int64_t blk = 0; blk < nblk; ++blk) {
            const __mmask16 u = umask[blk];
            if (!u) continue;
            const __m512 x = _mm512_maskz_loadu_ps(u, s + blk * 16);
            const __mmask16 kh = a.group ? u : _mm512_mask_cmp_ps_mask(u, _mm512_sub_ps(_mm512_sub_ps(x, s1), s2),
                                                                        c, _CMP_GT_OQ);
            const __m512 xk = _mm512_mask_mov_ps(ninf, kh, x);
            _mm512_storeu_ps(w + off, u == 0xFFFF ? xk : _mm512_maskz_compress_ps(u, xk));
            k += __builtin_popcount(kh);
            off += __builtin_popcount(u);
        }
        // 2. weights exp(a - mref) in place (exp(-inf) = 0) and their sum
        __m512 R = _mm512_setzero_ps();
        for (int64_t t = 0; t < off; t += 16) {
            const __mmask16 tm = tail_mask(off - t);
            const __m512 e = _mm512_maskz_mov_ps(tm, exp512(_mm512_sub_ps(_mm512_loadu_ps(w + t), mr)));
            _mm512_mask_storeu_ps(w + t, tm, e);
            R = _mm512_add_ps(R, e);
        }
        // 3. exact SDC: exp(a - mref) over the valid positions this head dropped
        __m512 D = _mm512_setzero_ps();
        if (a.need_dropped) {
            for (int64_t blk = 0; blk < nblk; ++blk) {
                const int64_t j0 = blk * 16;
                const __mmask16 tm = tail_mask(len - j0);
                const __m512 x = _mm512_maskz_loadu_ps(tm, s + j0);
                const __mmask16 kh = a.group ? umask[blk] : _mm512_mask_cmp_ps_mask(
                    tm, _mm512_sub_ps(_mm512_sub_ps(x, s1), s2), c, _CMP_GT_OQ);
                D = _mm512_add_ps(D, _mm512_maskz_mov_ps(__mmask16(tm & ~kh), exp512(_mm512_sub_ps(x, mr))));
            }
        }
        a.R[h] = _mm512_reduce_add_ps(R);
        a.dropped[h] = _mm512_reduce_add_ps(D);
        a.kcount[h] = k;
    }
    return cnt;
}

}  // namespace avx512_level
}  // namespace topth_cpu
