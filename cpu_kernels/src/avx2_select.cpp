// AVX2 level, stage 2: thresholding and the group union, 8 positions per step (the AVX-512
// stage's design at half width). Pass 1 builds the kept-union mask of each 8-position block
// (head selection: OR over the heads of x > cut[h]; group selection: NaN-propagating group
// max of x > cut[0]) and writes the kept positions; pass 2, per head, packs the scores of the
// kept-union rows (-inf where the head dropped a row kept by another head of its group),
// then turns them into weights exp(a - mref) in place (exp runs on kept rows only); plus
// their sum R, the kept count and, for exact SDC, the sum over the dropped positions.
// Packing: a permutation per 8-bit mask (vpermd from a 256-entry table) and a full 8-lane
// store (the buffers have 16 elements of slack: Scratch::reserve).
#include "avx2_common.h"

namespace topth_cpu {
namespace avx2_level {
namespace {

// Built at compile time: a static initialiser in this file would run AVX2 code at module
// load, on CPUs without AVX2 too.
struct CompressTable {
    int32_t perm[256][8]{};
    constexpr CompressTable() {
        for (int m = 0; m < 256; ++m) {
            int n = 0;
            for (int l = 0; l < 8; ++l)
                if (m >> l & 1) perm[m][n++] = l;
            for (; n < 8; ++n) perm[m][n] = 0;
        }
    }
};

constexpr CompressTable kCompress;

inline __m256i compress_perm(int m) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kCompress.perm[m]));
}

inline __m256 load_masked(const float* p, int64_t n, __m256 fill) {
    if (n >= 8) return _mm256_loadu_ps(p);
    const __m256i tm = lane_mask(n);
    return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, tm), _mm256_castsi256_ps(tm));
}

}  // namespace

int64_t select(const SelectArgs& a) {
    const int32_t G = a.G;
    const int64_t len = a.len;
    const int64_t nblk = (len + 7) / 8;
    uint8_t* umask = a.flags;  // one 8-bit union mask per block (nblk <= len + 16 bytes)
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    int64_t cnt = 0;
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t j0 = blk * 8;
        const int tm = len - j0 >= 8 ? 0xFF : (1 << (len - j0)) - 1;
        int u = 0;
        if (a.group) {
            __m256 xg = ninf, nan = _mm256_setzero_ps();
            for (int32_t h = 0; h < G; ++h) {
                const __m256 s = load_masked(a.S + h * a.ldS + j0, len - j0, ninf);
                const __m256 x = _mm256_sub_ps(_mm256_sub_ps(s, _mm256_set1_ps(a.sub1[h])), _mm256_set1_ps(a.sub2[h]));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
                xg = _mm256_max_ps(x, xg);
            }
            u = _mm256_movemask_ps(_mm256_cmp_ps(xg, _mm256_set1_ps(a.cut[0]), _CMP_GT_OQ)) &
                ~_mm256_movemask_ps(nan) & tm;
        } else {
            for (int32_t h = 0; h < G; ++h) {
                const __m256 s = load_masked(a.S + h * a.ldS + j0, len - j0, ninf);
                const __m256 x = _mm256_sub_ps(_mm256_sub_ps(s, _mm256_set1_ps(a.sub1[h])), _mm256_set1_ps(a.sub2[h]));
                u |= _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(a.cut[h]), _CMP_GT_OQ));
            }
            u &= tm;
        }
        umask[blk] = uint8_t(u);
        const __m256i pos = _mm256_add_epi32(iota, _mm256_set1_epi32(int32_t(j0)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.idx + cnt),
                            u == 0xFF ? pos : _mm256_permutevar8x32_epi32(pos, compress_perm(u)));
        cnt += __builtin_popcount(unsigned(u));
    }
    for (int32_t h = 0; h < G; ++h) {
        const float* s = a.S + h * a.ldS;
        const __m256 s1 = _mm256_set1_ps(a.sub1[h]), s2 = _mm256_set1_ps(a.sub2[h]);
        const __m256 c = _mm256_set1_ps(a.group ? -INFINITY : a.cut[h]);  // cut[1..] exist only per head
        const __m256 mr = _mm256_set1_ps(a.mref[h]);
        float* w = a.wk + h * a.ldw;
        int64_t k = 0, off = 0;
        // 1. this head's scores of the kept-union rows, -inf where it dropped the row
        for (int64_t blk = 0; blk < nblk; ++blk) {
            const int u = umask[blk];
            if (!u) continue;
            const __m256 x = load_masked(s + blk * 8, len - blk * 8, ninf);
            const int kh = a.group ? u : _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(_mm256_sub_ps(x, s1), s2), c,
                                                                          _CMP_GT_OQ)) & u;
            const __m256 xk = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_and_si256(_mm256_set1_epi32(kh), _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128)),
                _mm256_setzero_si256())));
            _mm256_storeu_ps(w + off, u == 0xFF ? xk : _mm256_permutevar8x32_ps(xk, compress_perm(u)));
            k += __builtin_popcount(unsigned(kh));
            off += __builtin_popcount(unsigned(u));
        }
        // 2. weights exp(a - mref) in place (exp(-inf) = 0) and their sum
        __m256 R = _mm256_setzero_ps();
        for (int64_t t = 0; t < off; t += 8) {
            const __m256i tm = lane_mask(off - t);
            const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(load_masked(w + t, off - t, ninf), mr)),
                                           _mm256_castsi256_ps(tm));
            if (off - t >= 8) _mm256_storeu_ps(w + t, e);
            else _mm256_maskstore_ps(w + t, tm, e);
            R = _mm256_add_ps(R, e);
        }
        // 3. exact SDC: exp(a - mref) over the valid positions this head dropped
        __m256 D = _mm256_setzero_ps();
        if (a.need_dropped) {
            for (int64_t blk = 0; blk < nblk; ++blk) {
                const int64_t j0 = blk * 8;
                const int tm = len - j0 >= 8 ? 0xFF : (1 << (len - j0)) - 1;
                const __m256 x = load_masked(s + j0, len - j0, ninf);
                const int kh = a.group ? umask[blk] : _mm256_movemask_ps(_mm256_cmp_ps(
                    _mm256_sub_ps(_mm256_sub_ps(x, s1), s2), c, _CMP_GT_OQ));
                const int drop = tm & ~kh;
                const __m256 dm = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                    _mm256_and_si256(_mm256_set1_epi32(drop), _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128)),
                    _mm256_setzero_si256()));
                D = _mm256_add_ps(D, _mm256_and_ps(exp256(_mm256_sub_ps(x, mr)), dm));
            }
        }
        a.R[h] = hsum(R);
        a.dropped[h] = hsum(D);
        a.kcount[h] = k;
    }
    return cnt;
}

}  // namespace avx2_level
}  // namespace topth_cpu
