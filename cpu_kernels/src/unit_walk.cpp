// The walks over a unit: the items of one range of a sequence for every KV head of a cache
// whose heads are interleaved in each slot (paged NHD), run back to back on one thread
// (dispatch.cpp). Per item, the K pass and the P.V would each read the range once per KV head,
// touching a head's part of every slot; the walks read the range once, in chunks of positions,
// each chunk head after head, while the next chunk is prefetched into L2 slot by slot (all
// heads of a slot together: address order inside each NHD block), spread over the chunk's
// stage calls. The P.V walk runs only where every item's kept list is nearly dense; sparse
// lists keep the per-item P.V (docs/cpu.md, "Paged NHD").
#include <algorithm>
#include <cstring>

#include "kernel.h"

namespace topth_cpu {
namespace {

constexpr int64_t kWalk = 48;  // positions per chunk of a walk

}  // namespace

bool unit_walk(const Plan& plan) {
    const Params& P = *plan.P;
    return !P.kv_packed && !key_transposed(P, *plan.ops) && plan.ops->scores_pf;
}

void unit_scores(Plan& plan, const int64_t* items, int64_t n, Scratch& sc) {
    // chunks of kWalk positions, one stage call per head
    const Params& P = *plan.P;
    const Item& first = plan.items[size_t(items[0])];  // every item of a unit has its b, lo, hi
    const int64_t len = first.hi - first.lo, b = first.b, piece = n * kWalk;
    const int32_t G = plan.G, dpad = plan.dpad;
    if (int64_t(sc.walk.size()) < 3 * piece) sc.walk.resize(size_t(3 * piece));
    if (!plan.two_phase && int64_t(sc.unit_S.size()) < G * n * len) sc.unit_S.resize(size_t(G * n * len));
    sc.scored.resize(size_t(n));
    for (int64_t k = 0; k < n; ++k)
        sc.scored[size_t(k)] = plan.two_phase ? plan.ws.data() + plan.items[size_t(items[k])].ws_off
                                              : sc.unit_S.data() + k * G * len;
    const uint8_t** cur = sc.walk.data();
    const uint8_t** nxt = cur + piece;
    const uint8_t** slots = nxt + piece;
    // rows of positions [first.lo + c, + its count) of every item's head, head after head
    const auto chunk_rows = [&](int64_t c, const uint8_t** out) {
        const int64_t cnt = std::min(kWalk, len - c);
        for (int64_t k = 0; k < n; ++k)
            consecutive_rows(P, P.key, P.k_s, b, plan.items[size_t(items[k])].g, first.lo + c, cnt, out + k * cnt);
        return cnt;
    };
    for (int64_t c = 0, cnt = chunk_rows(0, cur); cnt > 0;) {
        const int64_t next = c + cnt < len ? chunk_rows(c + cnt, nxt) : 0;
        for (int64_t k = 0; k < n; ++k)
            for (int64_t r = 0; r < next; ++r) slots[r * n + k] = nxt[k * next + r];
        for (int64_t k = 0; k < n; ++k) {
            const int64_t g = plan.items[size_t(items[k])].g;
            const int64_t pf_count = std::max<int64_t>(0, std::min(cnt, n * next - k * cnt));
            plan.ops->scores_pf(cur + k * cnt, cnt, slots + k * cnt, pf_count, P.dtype, P.k_s[3], plan.D, dpad,
                                group_query(plan, b, g), G, sc.scored[size_t(k)] + c, len, sc.tile.data(),
                                group_qraw(plan, b, g), P.scale);
        }
        std::swap(cur, nxt);
        c += cnt;
        cnt = next;
    }
}

bool pv_walk(const Plan& plan) { return !plan.P->kv_packed && plan.ops->pv_pf; }

bool unit_pv(Plan& plan, const int64_t* items, int64_t n, Scratch& sc) {
    const Params& P = *plan.P;
    const Item& first = plan.items[size_t(items[0])];
    const int64_t len = first.hi - first.lo, b = first.b;
    const int32_t G = plan.G, dpad = plan.dpad;
    // Walked only when every list is nearly dense (more than 3/4 of the range): a scattered
    // list is read item by item, in the strided visit of the P.V stage for 256 rows or more
    // (pv_visit.h), which keeps the hardware prefetchers off the unkept rows.
    for (int64_t k = 0; k < n; ++k)
        if (scattered_list(plan.uni[size_t(items[k])], len)) {
            for (int64_t j = 0; j < n; ++j) item_pv(plan, items[j], sc, unit_list(sc, j, len, G));
            return false;
        }
    for (int64_t k = 0; k < n; ++k)
        std::memset(&plan.acc[size_t(items[k] * G * dpad)], 0, sizeof(float) * size_t(G * dpad));
    // chunks of kWalk positions, one stage call per head with that head's kept rows
    const int64_t width = std::min(len, kWalk), cap = n * width;
    if (int64_t(sc.walk.size()) < 3 * cap) sc.walk.resize(size_t(3 * cap));
    if (int64_t(sc.unit_pos.size()) < 4 * n) sc.unit_pos.resize(size_t(4 * n));
    const uint8_t** cur = sc.walk.data();
    const uint8_t** nxt = cur + cap;
    const uint8_t** slots = nxt + cap;
    int64_t* from = sc.unit_pos.data();  // each item's first list entry of the chunk
    int64_t* ahead = from + n;           // ... of the next chunk
    int64_t* cnt = ahead + n;            // its entries in the chunk
    int64_t* cnt_next = cnt + n;         // ... in the next chunk
    // entries of every item's list from at[k] on below position c0 + width: counts into
    // counts, their V rows into out (item after item); returns the total
    const auto chunk_rows = [&](int64_t c0, const int64_t* at, int64_t* counts, const uint8_t** out) {
        int64_t total = 0;
        for (int64_t k = 0; k < n; ++k) {
            const int32_t* idx = unit_list(sc, k, len, G).idx;
            const int64_t kept = plan.uni[size_t(items[k])];
            int64_t e = at[k];
            while (e < kept && idx[e] < c0 + width) ++e;
            counts[k] = e - at[k];
            listed_rows(P, P.value, P.v_s, b, plan.items[size_t(items[k])].g, first.lo, idx + at[k], counts[k],
                        out + total);
            total += counts[k];
        }
        return total;
    };
    std::fill(from, from + n, int64_t(0));
    chunk_rows(0, from, cnt, cur);
    for (int64_t c0 = 0; c0 < len; c0 += width) {
        for (int64_t k = 0; k < n; ++k) ahead[k] = from[k] + cnt[k];
        const int64_t next = c0 + width < len ? chunk_rows(c0 + width, ahead, cnt_next, nxt) : 0;
        // the next chunk's rows by rank in their lists, the items' rows of one rank together
        for (int64_t r = 0, s = 0; s < next; ++r)
            for (int64_t k = 0, off = 0; k < n; off += cnt_next[k], ++k)
                if (r < cnt_next[k]) slots[s++] = nxt[off + r];
        for (int64_t k = 0, off = 0; k < n; off += cnt[k], ++k) {
            if (cnt[k] == 0) continue;
            const UnitList l = unit_list(sc, k, len, G);
            const int64_t pf_count = std::max<int64_t>(0, std::min(cnt[k], next - off));
            plan.ops->pv_pf(cur + off, cnt[k], slots + off, pf_count, P.dtype, P.v_s[3], plan.D, dpad, l.wk + from[k],
                            l.ldw, G, &plan.acc[size_t(items[k] * G * dpad)], sc.tile.data());
        }
        std::swap(cur, nxt);
        std::swap(from, ahead);
        std::swap(cnt, cnt_next);
    }
    return true;
}

}  // namespace topth_cpu
