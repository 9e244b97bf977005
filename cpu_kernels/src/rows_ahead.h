// Which rows a stage prefetches, shared by the stages of the AVX2 and AVX-512 levels: the
// rows some distance ahead of the rows being computed on (lists in their natural or visit
// order), and whether a list is a run the hardware prefetchers stream alone. Scalar code with
// internal linkage: each level's file gets its own copy, compiled with its own flags.
#pragma once

#include <stdint.h>

namespace topth_cpu {
namespace rows_ahead {
namespace {

// The rows of the n visits from visit `first` on into out, *t the row of visit `first` (rows of
// a visit order: row k * stride mod count; stride 1 is the list in order); *t advances while
// the next visit exists, so visits past the list repeat its last one (for prefetches: harmless).
inline void visit_rows(const uint8_t* const* rows, int64_t count, int64_t stride, int64_t first, int64_t n, int64_t* t,
                       const uint8_t** out) {
    for (int64_t i = 0; i < n; ++i) {
        out[i] = rows[*t];
        if (first + i + 1 < count) {
            *t += stride;
            *t -= *t >= count ? count : 0;
        }
    }
}

// The stages that compute on a tile while prefetching spread the prefetches over the tile's
// loads (one line ahead per line loaded), not in a burst before it: on AMD Zen 4 a burst of a
// 16-row tile's prefetches (8 KiB of 512-byte rows) stalled the stage, and spreading them made
// the op 1.4-2.2x faster end to end on BNSD and HND128 caches of 512-byte rows (docs/cpu.md,
// "Software prefetch"). Element t (t < n) of the result is the row `dist` rows after row
// t0 + t of a list of count rows; past the list, its last row (a harmless repeat), written to
// out. Returns rows + t0 + dist where all n lie in the list (nothing copied), else out, or
// nullptr when even the first of them lies past the list.
inline const uint8_t* const* ahead_rows(const uint8_t* const* rows, int64_t t0, int64_t count, int64_t dist,
                                        int64_t n, const uint8_t** out) {
    if (t0 + dist >= count) return nullptr;
    if (t0 + dist + n <= count) return rows + t0 + dist;  // all of them in the list: no copy
    int64_t t = t0 + dist;
    visit_rows(rows, count, 1, t0 + dist, n, &t, out);
    return out;
}

// The caller's rows to prefetch while rows [t0, t0 + n) of a stage's list are read (the walks
// of unit_walk.cpp hand the stage the next chunk's rows, pf_count of them): given + t0 where all
// n lie in the list (nothing copied), else its rows padded with the last one (a harmless
// repeat) in out (n entries), or nullptr when none is left.
inline const uint8_t* const* given_rows(const uint8_t* const* given, int64_t t0, int64_t pf_count, int64_t n,
                                        const uint8_t** out) {
    if (!given || t0 >= pf_count) return nullptr;
    if (t0 + n <= pf_count) return given + t0;
    for (int64_t t = 0; t < n; ++t) out[t] = given[t0 + t < pf_count ? t0 + t : pf_count - 1];
    return out;
}

// The rows to prefetch for each block of kBlock visits of a P.V list, in its visit order: the
// next block's (into L1) and those `far` visits ahead (into L2), walked once along the list.
template <int64_t kBlock>
struct VisitAhead {
    const uint8_t* const* rows;
    int64_t count, stride, far;
    int64_t tn, tf;  // rows of the visits kBlock and far ahead of the next block
    const uint8_t* near_rows[kBlock];
    const uint8_t* far_rows[kBlock];

    VisitAhead(const uint8_t* const* r, int64_t n, int64_t s, int64_t f)
        : rows(r), count(n), stride(s), far(f), tn((kBlock * s) % n), tf((f * s) % n) {}

    // For the block of visits [k0, k0 + R), called for every block in order: *pn the next
    // block's rows (with near), *pf the rows `far` ahead (with far_on); null where none lie in
    // the list. Near the end of a list *pf falls back to *pn (those rows into L2 as well).
    void block(int64_t k0, int64_t R, bool near, bool far_on, const uint8_t* const** pn, const uint8_t* const** pf) {
        *pn = *pf = nullptr;
        if (near && k0 + kBlock < count) {
            visit_rows(rows, count, stride, k0 + kBlock, R, &tn, near_rows);
            *pn = near_rows;
        }
        if (far_on && k0 + far < count) {
            visit_rows(rows, count, stride, k0 + far, R, &tf, far_rows);
            *pf = far_rows;
        }
        if (!*pf) *pf = *pn;
    }
};

// Whether the count rows of a list, rows of at most kRunMaxBytes, lie back to back as one
// contiguous run, as far as its ends tell (a BNSD range). The AVX-512 stages then issue no
// software prefetch, the AVX2 stages only the next tile's or block's rows (not those about
// 12 KiB ahead): the hardware prefetchers stream such a run. Runs broken by block boundaries
// keep both distances, and so do longer rows and strided runs (not measured). On AMD Zen 4
// with the prefetches spread (ahead_rows), BNSD runs of 256-byte rows were 1.15x faster with
// them (llama8b's shape, dense; 1.3x at f = 0.1) and runs of 128-byte rows 0.95-1.0x; on AMD
// Zen 3 the AVX2 stages' next-tile prefetch made such runs 1.01-1.22x faster (docs/cpu.md,
// "Software prefetch", "AVX2 stages"). Only the speed depends on the answer.
constexpr int64_t kRunMaxBytes = 128;

inline bool one_run(const uint8_t* const* rows, int64_t count, int64_t row_bytes) {
    if (count < 2 || row_bytes > kRunMaxBytes || rows[1] - rows[0] != row_bytes) return false;
    const uint64_t first = reinterpret_cast<uintptr_t>(rows[0]), last = reinterpret_cast<uintptr_t>(rows[count - 1]);
    return last - first == uint64_t(count - 1) * uint64_t(row_bytes);
}

}  // namespace
}  // namespace rows_ahead
}  // namespace topth_cpu
