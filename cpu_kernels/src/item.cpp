// One work item (sequence b, KV head g, positions [lo, hi)): the pipeline of the kernel.
//
//   scores   K rows read once for the G query heads of the group (SIMD stage), per-head max
//            and NaN/+inf flag; post_softmax: sum of exp(a - m); VMC without value_mean: the
//            V-row sum of the range (the only read of V rows that are not kept);
//   select   thresholding (pre: a > theta; post: (a - M) - log Z > log theta with the
//            sequence's global M and Z), the group union, kept-row weights;
//   P.V      only the kept-union rows, each read once for the whole group.
//
// Phases: kFull runs all three (the item covers the whole sequence, or pre_softmax, whose
// selection needs no global statistic); post_softmax with split-KV runs kScores on every
// item, then combine_lse, then kSelect (scores kept in Plan::ws between the two).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernel.h"

namespace topth_cpu {
namespace {

// ln(theta) for the post_softmax cut, decided on the bits of theta so that a flush of
// subnormals (DAZ/FTZ set by the caller's thread) cannot change it: -inf for +-0 and
// negative theta (every finite score kept), NaN stays NaN (nothing kept), and a positive
// subnormal m x 2^-149 (m < 2^23 an integer) gives ln(m) - 149 ln 2.
float log_cut(float theta)
{
    uint32_t bits;
    std::memcpy(&bits, &theta, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return theta;
    if (bits == 0u || bits >= 0x80000000u) return -std::numeric_limits<float>::infinity();
    if (bits < 0x00800000u) return std::log(static_cast<float>(bits)) - 103.27892990343184f;
    return std::log(theta);
}

constexpr int64_t kChunk = 512;  // row pointers resolved per call of a SIMD stage
constexpr int64_t kSlack = 16;   // elements past the end of each kept list / weight row

int64_t elem_size(int32_t dtype) { return dtype == kF32 ? 4 : 2; }

// Positions lo .. lo + count - 1 of a sequence, one block segment at a time: seg(bi, slot, t,
// run) for table entry bi, its first slot, the segment's offset t in the range and its rows.
template <typename Seg>
void for_each_segment(const Params& P, int64_t lo, int64_t count, Seg seg) {
    const int64_t bs = P.block_size;
    int64_t bi = lo / bs, slot = lo % bs;
    for (int64_t t = 0; t < count;) {
        const int64_t run = std::min(count - t, bs - slot);  // rows left in this block
        seg(bi, slot, t, run);
        t += run;
        slot = 0;
        ++bi;
    }
}

}  // namespace

// Byte pointers of the rows of positions lo .. lo + count - 1 (consecutive) of (b, g).
void consecutive_rows(const Params& P, const void* base, const int64_t* s, int64_t b, int64_t g, int64_t lo,
                      int64_t count, const uint8_t** out) {
    const int64_t es = elem_size(P.dtype), step = s[2] * es;
    const uint8_t* p0 = static_cast<const uint8_t*>(base);
    for_each_segment(P, lo, count, [&](int64_t bi, int64_t slot, int64_t t, int64_t run) {
        const uint8_t* row = p0 + (block_of(P, b, bi) * s[0] + g * s[1] + slot * s[2]) * es;
        for (int64_t r = 0; r < run; ++r, row += step) out[t + r] = row;
    });
}

// Byte pointers of the rows of positions lo + idx[t] of (b, g).
void listed_rows(const Params& P, const void* base, const int64_t* s, int64_t b, int64_t g, int64_t lo,
                 const int32_t* idx, int64_t count, const uint8_t** out) {
    const int64_t es = elem_size(P.dtype), bs = P.block_size;
    const uint8_t* p0 = static_cast<const uint8_t*>(base);
    const int64_t head = g * s[1];
    if (!P.block_table) {  // BNSD: one block per sequence, no division
        const uint8_t* seq = p0 + (b * s[0] + head) * es;
        const int64_t step = s[2] * es;
        for (int64_t t = 0; t < count; ++t) out[t] = seq + (lo + idx[t]) * step;
        return;
    }
    // the block-table entry and the block's base are looked up only when a row falls outside
    // the block of the previous one (once per block for an ascending list)
    const int64_t step = s[2] * es;
    int64_t blk_lo = 0, blk_hi = 0;
    const uint8_t* blk = nullptr;
    for (int64_t t = 0; t < count; ++t) {
        const int64_t j = lo + idx[t];
        if (j < blk_lo || j >= blk_hi) {
            const int64_t bi = j / bs;
            blk_lo = bi * bs;
            blk_hi = blk_lo + bs;
            blk = p0 + (block_of(P, b, bi) * s[0] + head) * es;
        }
        out[t] = blk + (j - blk_lo) * step;
    }
}

// K stored transposed per block (vLLM's vector-ISA CPU cache) on a level that reads it as such.
bool key_transposed(const Params& P, const SimdOps& ops) { return P.k_s[2] == 1 && P.k_s[3] != 1 && ops.scores_kt; }

// scale * query of the G heads of KV group g of sequence b ([G][dpad] floats).
const float* group_query(const Plan& plan, int64_t b, int64_t g) {
    return plan.q.data() + (b * plan.P->num_q_heads + g * plan.G) * plan.dpad;
}

const uint16_t* group_qraw(const Plan& plan, int64_t b, int64_t g) {
    return plan.qraw.empty() ? nullptr : plan.qraw.data() + (b * plan.P->num_q_heads + g * plan.G) * plan.dpad;
}

namespace {

// Scores of positions lo .. lo + count - 1 of (b, g) from a cache whose K is stored transposed
// per block (slots contiguous, head_dim strided: vLLM's vector-ISA CPU cache), one call of the
// stage per block segment, each told where the next segment starts (it prefetches that one).
void transposed_key_scores(const Params& P, const SimdOps& ops, int64_t b, int64_t g, int64_t lo, int64_t count,
                           const float* q, const uint16_t* qraw, int32_t G, int32_t dpad, float* S, int64_t ldS) {
    const int64_t es = elem_size(P.dtype), dstride = P.k_s[3] * es;
    const uint8_t* p0 = static_cast<const uint8_t*>(P.key);
    const auto at = [&](int64_t bi, int64_t slot) {
        return p0 + (block_of(P, b, bi) * P.k_s[0] + g * P.k_s[1] + slot) * es;
    };
    for_each_segment(P, lo, count, [&](int64_t bi, int64_t slot, int64_t t, int64_t run) {
        const int64_t next_count = std::min(count - t - run, P.block_size);
        const uint8_t* next = next_count > 0 ? at(bi + 1, 0) : nullptr;
        ops.scores_kt(at(bi, slot), run, dstride, P.dtype, int32_t(P.head_dim), dpad, q, G, S + t, ldS, next,
                      next_count, qraw, P.scale);
    });
}

// With group selection a head may keep only rows far below its own maximum (its maximum sits
// on a row the group dropped): their weights exp(a - m) are then subnormal or 0 and so is their
// sum R. Such a head's weights are recomputed relative to the maximum over its kept rows mk
// (m_ref becomes mk; combine_pair rescales every split to one reference). The sum over the
// dropped rows (exact SDC) stays relative to the split's maximum m_loc, which combine_pair
// knows (docs/semantics.md, "A head's kept rows far below its own maximum"). Below 2^-64
// only: larger sums keep every weight that matters normal.
void rebase_far_kept(Plan& plan, int64_t i, const SelectArgs& a, int64_t kept) {
    constexpr float kTiny = 5.421010862427522e-20f;  // 2^-64
    for (int32_t h = 0; h < a.G; ++h) {
        if (!(a.R[h] < kTiny)) continue;  // also skips NaN
        const float* S = a.S + h * a.ldS;
        float mk = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < kept; ++t) mk = std::fmax(mk, S[a.idx[t]]);
        if (!(mk > -std::numeric_limits<float>::infinity()) || mk >= a.mref[h]) continue;
        float* w = a.wk + h * a.ldw;
        float R = 0.0f;
        for (int64_t t = 0; t < kept; ++t) {
            w[t] = std::exp(S[a.idx[t]] - mk);
            R += w[t];
        }
        a.R[h] = R;
        plan.m_ref[size_t(i * a.G + h)] = mk;
    }
}

}  // namespace

void Scratch::reserve(int64_t len, int32_t G, int32_t dpad) {
    if (int64_t(S.size()) < G * len) S.resize(size_t(G * len));
    // kept lists and weights: 16 elements of slack per list (the SIMD select stores whole vectors)
    if (int64_t(wk.size()) < G * (len + kSlack)) wk.resize(size_t(G * (len + kSlack)));
    if (int64_t(idx.size()) < len + kSlack) idx.resize(size_t(len + kSlack));
    if (int64_t(flags.size()) < len + 16) flags.resize(size_t(len + 16));
    // K pointers of one chunk of scores; P.V: one item's kept list
    if (int64_t(rows.size()) < std::max(kChunk, len)) rows.resize(size_t(std::max(kChunk, len)));
    if (int64_t(unpacked.size()) < kChunk * dpad) unpacked.resize(size_t(kChunk * dpad));
    // tile: 32 converted rows (avx512 P.V, V sum), or the amx level's query, C tiles and copies
    const int64_t tile_floats = std::max<int64_t>(32 * dpad, 40 * dpad + 1024);
    if (int64_t(tile.size()) < tile_floats) tile.resize(size_t(tile_floats));
    if (int64_t(small.size()) < 5 * G) small.resize(size_t(5 * G));
}

float threshold_of(const Plan& plan, int64_t b, int64_t th_head) {
    const Params& P = *plan.P;
    return P.thresholds[plan.set[b] * P.th_s[0] + th_head * P.th_s[1] + plan.row[b] * P.th_s[2]];
}

UnitList unit_list(Scratch& sc, int64_t k, int64_t len, int32_t G) {
    const int64_t ldw = len + kSlack;
    // resize keeps the lists of the unit's earlier items
    if (int64_t(sc.unit_idx.size()) < (k + 1) * ldw) sc.unit_idx.resize(size_t((k + 1) * ldw));
    if (int64_t(sc.unit_wk.size()) < (k + 1) * G * ldw) sc.unit_wk.resize(size_t((k + 1) * G * ldw));
    return {sc.unit_idx.data() + k * ldw, sc.unit_wk.data() + k * G * ldw, ldw};
}

void run_item(Plan& plan, int64_t i, Phase phase, Scratch& sc, float* scored, int64_t slot) {
    const Params& P = *plan.P;
    const SimdOps& ops = *plan.ops;
    const Item& it = plan.items[size_t(i)];
    const int32_t G = plan.G, D = plan.D, dpad = plan.dpad;
    const int64_t len = it.hi - it.lo, b = it.b, g = it.g;
    float* S = scored ? scored : plan.two_phase ? plan.ws.data() + it.ws_off : sc.S.data();
    float* m_loc = &plan.m_loc[size_t(i * G)];
    const uint8_t** rows = sc.rows.data();

    if (phase != kSelect) {
        const float* q = group_query(plan, b, g);
        const uint16_t* qraw = group_qraw(plan, b, g);
        if (scored) {
            // computed by unit_scores
        } else if (P.kv_packed && ops.scores_packed && qraw && G <= 16) {  // vLLM's AMX cache, native
            packed_key_tiles(P, b, g, it.lo, len, rows);
            ops.scores_packed(rows, it.lo % 16, len, D, dpad, qraw, G, P.scale, S, len, sc.tile.data());
        } else if (P.kv_packed) {  // rows unpacked first, kChunk at a time
            for (int64_t c = 0; c < len; c += kChunk) {
                const int64_t cnt = len - c < kChunk ? len - c : kChunk;
                packed_key_rows(P, b, g, it.lo + c, cnt, sc.unpacked.data(), rows);
                ops.scores(rows, cnt, P.dtype, 1, D, dpad, q, G, S + c, len, sc.tile.data(), qraw, P.scale);
            }
        } else if (key_transposed(P, ops)) {
            transposed_key_scores(P, ops, b, g, it.lo, len, q, qraw, G, dpad, S, len);
        } else {
            // the whole range in one call (Scratch::rows holds len pointers): the stage prefetches
            // ahead across blocks and pages
            consecutive_rows(P, P.key, P.k_s, b, g, it.lo, len, rows);
            ops.scores(rows, len, P.dtype, P.k_s[3], D, dpad, q, G, S, len, sc.tile.data(), qraw, P.scale);
        }
        plan.k_rows[size_t(i)] = len;
        for (int32_t h = 0; h < G; ++h) {
            ops.max_bad(S + h * len, len, &m_loc[h], &plan.bad[size_t(i * G + h)]);
            if (P.placement == kPost) plan.Z[size_t(i * G + h)] = ops.sum_exp(S + h * len, len, safe_max(m_loc[h]));
        }
        if (P.vmc == kVmcComputed) {
            float* vs = &plan.vs[size_t(i * dpad)];
            for (int64_t c = 0; c < len; c += kChunk) {
                const int64_t cnt = len - c < kChunk ? len - c : kChunk;
                if (P.kv_packed) {
                    packed_value_rows(P, b, g, it.lo + c, nullptr, cnt, sc.unpacked.data(), rows);
                    ops.vsum(rows, cnt, P.dtype, 1, D, dpad, vs, sc.tile.data());
                } else {
                    consecutive_rows(P, P.value, P.v_s, b, g, it.lo + c, cnt, rows);
                    ops.vsum(rows, cnt, P.dtype, P.v_s[3], D, dpad, vs, sc.tile.data());
                }
            }
            plan.vm_rows[size_t(i)] = len;
        }
        if (phase == kScores) return;
    }

    // selection parameters per query head of the group
    float* sub1 = sc.small.data();
    float* sub2 = sub1 + G;
    float* cut = sub2 + G;
    float* mref = cut + G;
    const int64_t pair = b * P.num_kv_heads + g;
    for (int32_t h = 0; h < G; ++h) {
        const float theta = threshold_of(plan, b, P.group_selection ? g : g * G + h);
        if (P.placement == kPre) {
            sub1[h] = sub2[h] = 0.0f;
            cut[h] = theta;
            mref[h] = safe_max(m_loc[h]);
        } else {
            float M, logz;
            if (plan.two_phase) {
                M = plan.pair_m[size_t(pair * G + h)];
                logz = plan.pair_logz[size_t(pair * G + h)];
            } else {
                M = safe_max(m_loc[h]);
                logz = log_sum(plan.Z[size_t(i * G + h)]);
            }
            sub1[h] = M;
            sub2[h] = logz;
            cut[h] = log_cut(theta);  // log domain
            mref[h] = M;
        }
        plan.m_ref[size_t(i * G + h)] = mref[h];
    }
    SelectArgs a;
    a.S = S; a.ldS = len; a.G = G; a.len = len;
    a.sub1 = sub1; a.sub2 = sub2; a.cut = cut; a.group = P.group_selection; a.mref = mref;
    a.need_dropped = P.placement == kPre && P.sdc == kSdcExact;
    const UnitList list = slot >= 0 ? unit_list(sc, slot, len, G) : UnitList{sc.idx.data(), sc.wk.data(), len + kSlack};
    const int64_t ldw = list.ldw;
    a.idx = list.idx; a.wk = list.wk; a.ldw = ldw; a.flags = sc.flags.data();
    a.R = &plan.R[size_t(i * G)]; a.dropped = &plan.Dd[size_t(i * G)]; a.kcount = &plan.kc[size_t(i * G)];
    const int64_t kept = ops.select(a);
    plan.uni[size_t(i)] = kept;
    if (P.placement == kPre && P.group_selection && kept > 0) rebase_far_kept(plan, i, a, kept);
    plan.v_rows[size_t(i)] = kept;
    if (slot < 0) item_pv(plan, i, sc, list);  // else unit_pv, over the unit's lists
}

void item_pv(Plan& plan, int64_t i, Scratch& sc, const UnitList& list) {
    const Params& P = *plan.P;
    const SimdOps& ops = *plan.ops;
    const Item& it = plan.items[size_t(i)];
    const int32_t G = plan.G, D = plan.D, dpad = plan.dpad;
    const int64_t len = it.hi - it.lo, b = it.b, g = it.g, kept = plan.uni[size_t(i)], ldw = list.ldw;
    const uint8_t** rows = sc.rows.data();
    float* acc = &plan.acc[size_t(i * G * dpad)];
    std::memset(acc, 0, sizeof(float) * size_t(G * dpad));
    // the whole kept list in one call (Scratch::rows holds len pointers), so the P.V stage's
    // prefetch runs ahead across it
    if (kept > 0 && P.kv_packed && ops.pv_packed) {  // vLLM's AMX cache, read in place
        packed_value_pointers(P, b, g, it.lo, list.idx, kept, rows);
        ops.pv_packed(rows, kept, D, dpad, P.block_size * 32, list.wk, ldw, G, acc,
                      int32_t(scattered_list(kept, len)));
    } else if (kept > 0 && P.kv_packed) {  // vLLM's AMX cache: the kept rows unpacked, kChunk at a time
        for (int64_t c = 0; c < kept; c += kChunk) {
            const int64_t cnt = kept - c < kChunk ? kept - c : kChunk;
            packed_value_rows(P, b, g, it.lo, list.idx + c, cnt, sc.unpacked.data(), rows);
            ops.pv(rows, cnt, P.dtype, 1, D, dpad, list.wk + c, ldw, G, acc, sc.tile.data(), 0);
        }
    } else if (kept > 0) {
        listed_rows(P, P.value, P.v_s, b, g, it.lo, list.idx, kept, rows);
        // a sparse subset is visited in a strided order, denser lists stream (scattered_list)
        ops.pv(rows, kept, P.dtype, P.v_s[3], D, dpad, list.wk, ldw, G, acc, sc.tile.data(),
               int32_t(scattered_list(kept, len)));
    }
}

}  // namespace topth_cpu
