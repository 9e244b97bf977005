// Internal interfaces of the CPU kernel (baseline-flag translation units only): the plan of
// one call (work items = sequence x KV head x KV split, their partial records), per-worker
// scratch, and the stages' entry points. docs/cpu.md describes the design.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "topth_cpu/params.h"

namespace topth_cpu {

struct Item {
    int64_t b = 0, g = 0, lo = 0, hi = 0;  // positions [lo, hi) of sequence b, KV head g
    int64_t ws_off = 0;                    // offset of its scores in Plan::ws (two-phase only)
};

// Everything one call computes besides the outputs. Partial records are indexed by item;
// arrays marked [.][G] hold one value per query head of the group.
struct Plan {
    const Params* P = nullptr;
    const SimdOps* ops = nullptr;
    int32_t G = 0, D = 0, dpad = 0;
    bool two_phase = false;  // post_softmax with split-KV: scores, global LSE, then selection
    std::vector<int64_t> n, row, set;            // per sequence: clamped length, row id column, set
    std::vector<Item> items;
    std::vector<int64_t> order;                  // items of the units, unit by unit (scheduling)
    std::vector<int64_t> unit_first;             // [units + 1]: unit u runs order[unit_first[u] ..)
    std::vector<int64_t> pair_first, pair_count; // per (b, g): its items
    std::vector<float> q;                        // [B][Hq][dpad]: scale * query, float32, zero padded
    std::vector<uint16_t> qraw;                  // [B][Hq][dpad]: the bfloat16 query as given (bf16 caches)
    std::vector<float> m_loc, m_ref, Z, R, Dd;   // [items][G]
    std::vector<int64_t> kc;                     // [items][G] kept count
    std::vector<int32_t> bad;                    // [items][G] NaN / +inf score seen
    std::vector<int64_t> uni;                    // [items] kept-union rows (= V rows read)
    std::vector<float> acc;                      // [items][G][dpad] sum of w * v
    std::vector<float> vs;                       // [items][dpad] V-row sum (VMC mean computed)
    std::vector<float> pair_m, pair_logz;        // [pairs][G] global max / log-sum (two-phase)
    std::vector<float> ws;                       // two-phase scores workspace
    std::vector<int64_t> k_rows, v_rows, vm_rows;  // [items] counters
    std::vector<uint8_t> walked;                 // [units] bit 0: K rows walked, bit 1: V rows

    int64_t pairs() const { return P->batch * P->num_kv_heads; }
};

struct Scratch {
    std::vector<float> S, wk, tile, small;
    std::vector<uint16_t> unpacked;  // rows unpacked from vLLM's AMX cache (kChunk rows)
    std::vector<int32_t> idx;
    std::vector<uint8_t> flags;
    std::vector<const uint8_t*> rows;
    // unit_scores: row pointers of two chunks of its walk and of the next one slot by slot; the
    // scores of a unit's items in one-phase calls (two-phase calls use Plan::ws); where each
    // item's scores are
    std::vector<const uint8_t*> walk;
    std::vector<float> unit_S;
    std::vector<float*> scored;
    // unit_pv: the kept lists and weights of a unit's items (unit_list), and per item the
    // start and count of its rows in the chunk of the walk and in the next one
    std::vector<int32_t> unit_idx;
    std::vector<float> unit_wk;
    std::vector<int64_t> unit_pos;
    void reserve(int64_t len, int32_t G, int32_t dpad);
};

enum Phase : int32_t { kFull = 0, kScores = 1, kSelect = 2 };

// A head's maximum as a reference for its exponent sums: 0 where every score is -inf (its
// sums are then 0 and exp(a - 0) never turns -inf - -inf into NaN).
inline float safe_max(float m) { return m == -std::numeric_limits<float>::infinity() ? 0.0f : m; }

// Whether a kept list of `kept` of a range's `len` rows is a sparse subset (at most 3/4 of
// the range): its P.V visits the rows in a strided order and is never walked (unit_pv); denser
// lists stream in ascending order, so the hardware prefetchers read only rows that are used.
inline bool scattered_list(int64_t kept, int64_t len) { return 4 * kept <= 3 * len; }

// ln Z of a head's exponent sum, the log-sum of its post_softmax log-probabilities
// a - M - ln Z: +inf where Z is 0 (every valid score -inf), so that each of those
// log-probabilities is -inf (never kept, and no NaN in the group maximum) instead of
// -inf - -inf = NaN. NaN stays NaN.
inline float log_sum(float Z) { return Z == 0.0f ? std::numeric_limits<float>::infinity() : std::log(Z); }

// Block of table entry i of sequence b (BNSD: the sequence itself); used entries of unchecked
// tables are clamped so that nothing is read out of bounds.
inline int64_t block_of(const Params& P, int64_t b, int64_t i) {
    if (!P.block_table) return b;  // BNSD: one block of max_seq_len positions per sequence
    int64_t blk = P.block_table[b * P.bt_s[0] + i * P.bt_s[1]];
    if (blk < 0) blk = 0;
    if (blk >= P.num_blocks) blk = P.num_blocks - 1;
    return blk;
}

// packed.cpp (vLLM's AMX cache): the K tiles of the 16-slot groups of positions
// [lo / 16 * 16, lo + count); K rows [lo, lo + count) and V rows lo + idx[t] (idx null:
// lo + t) unpacked into dst (count x head_dim bfloat16), their pointers into out
void packed_key_tiles(const Params& P, int64_t b, int64_t g, int64_t lo, int64_t count, const uint8_t** out);
void packed_key_rows(const Params& P, int64_t b, int64_t g, int64_t lo, int64_t count, uint16_t* dst,
                     const uint8_t** out);
void packed_value_pointers(const Params& P, int64_t b, int64_t g, int64_t lo, const int32_t* idx, int64_t count,
                           const uint8_t** out);
void packed_value_rows(const Params& P, int64_t b, int64_t g, int64_t lo, const int32_t* idx, int64_t count,
                       uint16_t* dst, const uint8_t** out);

// item.cpp
// Byte pointers of the rows of positions lo .. lo + count - 1 (consecutive), or lo + idx[t],
// of (sequence b, KV head g) of the cache at base with element strides s.
void consecutive_rows(const Params& P, const void* base, const int64_t* s, int64_t b, int64_t g, int64_t lo,
                      int64_t count, const uint8_t** out);
void listed_rows(const Params& P, const void* base, const int64_t* s, int64_t b, int64_t g, int64_t lo,
                 const int32_t* idx, int64_t count, const uint8_t** out);
// K stored transposed per block (vLLM's vector-ISA cache) on a level that reads it as such.
bool key_transposed(const Params& P, const SimdOps& ops);
// scale * query of the G heads of KV group g of sequence b ([G][dpad] floats).
const float* group_query(const Plan& plan, int64_t b, int64_t g);
// The query of those heads as given ([G][dpad] 16-bit values, zero padded) for bfloat16 caches,
// else null.
const uint16_t* group_qraw(const Plan& plan, int64_t b, int64_t g);
// The kept list ([ldw] indices) and weights ([G][ldw]) of item k of a unit whose P.V unit_pv
// walks; ldw = the item's length + slack. Grows the scratch, keeping earlier items' lists.
struct UnitList {
    int32_t* idx;
    float* wk;
    int64_t ldw;
};
UnitList unit_list(Scratch& sc, int64_t k, int64_t len, int32_t G);
// scored: where unit_scores left the item's scores (its K pass is then done), else null.
// slot >= 0: the item is the slot-th of a unit whose P.V unit_pv walks; its selection goes to
// unit_list(sc, slot, ...) and its P.V is left to unit_pv.
void run_item(Plan& plan, int64_t i, Phase phase, Scratch& sc, float* scored = nullptr, int64_t slot = -1);
// P.V of item i over its kept list (plan.uni[i] entries of list), into plan.acc.
void item_pv(Plan& plan, int64_t i, Scratch& sc, const UnitList& list);
float threshold_of(const Plan& plan, int64_t b, int64_t th_head);

// unit_walk.cpp (docs/cpu.md, "Paged NHD")
// Whether unit_scores serves the units of several items of this call: K rows read row by row
// (not vLLM's packed or transposed caches) on a level with scores_pf.
bool unit_walk(const Plan& plan);
// One core's L2 size as the scheduler assumes it (dispatch.cpp).
int64_t unit_bytes();
// The scores of the n items of one unit (the KV heads of one range of a sequence whose heads
// are interleaved in each slot: paged NHD), their K rows read in one walk over the range;
// afterwards sc.scored[k] holds item items[k]'s scores.
void unit_scores(Plan& plan, const int64_t* items, int64_t n, Scratch& sc);
// Whether unit_pv serves the P.V of units of several items: V rows read row by row (not vLLM's
// packed cache) on a level with pv_pf.
bool pv_walk(const Plan& plan);
// P.V of the n items of one unit after run_item left their kept lists in unit_list(sc, k, ...)
// (k the item's place in the unit): where every list holds more than 3/4 of the range, the V
// rows of all of them read in one walk over the range, else item_pv item by item; fills each
// item's plan.acc. Returns whether it walked.
bool unit_pv(Plan& plan, const int64_t* items, int64_t n, Scratch& sc);
// combine.cpp
void combine_lse(Plan& plan, int64_t pair);
void combine_pair(Plan& plan, int64_t pair);
uint16_t float_to_half(float f);
uint16_t float_to_bf16(float f);
// dispatch.cpp
Counters decode(const Params& P, int32_t simd_level);
int32_t best_simd_level();
bool simd_level_supported(int32_t level);
const char* simd_level_name(int32_t level);

constexpr int32_t kLevelAuto = 0, kLevelGeneric = 1, kLevelAvx2 = 2, kLevelAvx512 = 3, kLevelAvx512Bf16 = 4,
                  kLevelAmx = 5;
// Why the amx level cannot run here ("" when it can): not built, the CPU lacks AMX-BF16, or
// Linux refused the tile state to the process.
const char* amx_unavailable_reason();

}  // namespace topth_cpu
