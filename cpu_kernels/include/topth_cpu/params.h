// One decode-attention call as the CPU kernel sees it: shapes, options, and every tensor as a
// data pointer plus element strides (the Python side passes torch.Tensor.data_ptr() and
// .stride(); no torch headers are used). Semantics: docs/semantics.md; design: docs/cpu.md.
//
// This header holds plain data only (no inline functions): it is included by translation
// units compiled with different target flags (generic, AVX2, AVX-512), and an inline
// function emitted by two of them could be merged by the linker into the wrong one.
#pragma once

#include <cstdint>

namespace topth_cpu {

enum Dtype : int32_t { kF16 = 0, kBF16 = 1, kF32 = 2 };
enum Placement : int32_t { kPre = 0, kPost = 1 };
enum Sdc : int32_t { kSdcNone = 0, kSdcExact = 1, kSdcExpThreshold = 2, kSdcOffline = 3 };
enum VmcMode : int32_t { kVmcOff = 0, kVmcGiven = 1, kVmcComputed = 2 };

struct Params {
    // shapes
    int64_t batch = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
    int64_t block_size = 0, num_blocks = 0, max_blocks_per_seq = 0;
    int64_t max_row_id = 0, num_sets = 0;
    // options
    int32_t dtype = kF32, placement = kPost, sdc = kSdcNone, vmc = kVmcOff;
    int32_t group_selection = 0;
    int32_t kv_packed = 0;  // 1: vLLM's AMX cache (paged; each block and head packed: topth_ops/packed.py)
    float scale = 1.0f, sdc_gamma = 0.05f;
    // tensors: pointer + strides in elements (block, kv_head, slot, dim for the caches)
    const void* query = nullptr;      int64_t q_s[3] = {0, 0, 0};
    const void* key = nullptr;        int64_t k_s[4] = {0, 0, 0, 0};
    const void* value = nullptr;      int64_t v_s[4] = {0, 0, 0, 0};
    const int32_t* block_table = nullptr; int64_t bt_s[2] = {0, 0};  // null: BNSD, block b = sequence b
    const void* seq_lens = nullptr;   int32_t seq_lens_i64 = 0; int64_t lens_s = 0;
    const float* thresholds = nullptr; int64_t th_s[3] = {0, 0, 0};  // [num_sets, H, max_row_id]
    const void* threshold_set = nullptr; int32_t tset_i64 = 0; int64_t tset_s = 0;  // null: set 0
    const float* sdc_table = nullptr; int64_t sdc_s[3] = {0, 0, 0};  // [num_sets, Hq, max_row_id]
    const float* value_mean = nullptr; int64_t vm_s[3] = {0, 0, 0};  // [B, Hkv, D]
    void* out = nullptr;              int64_t out_s[3] = {0, 0, 0};
    int32_t* kept = nullptr;          int64_t kept_s[2] = {0, 0};    // null: no stats
    int32_t* v_rows = nullptr;        int64_t vrows_s[2] = {0, 0};
    float* dropped_mass = nullptr;    int64_t dm_s[2] = {0, 0};
    // execution
    int32_t threads = 1;
    int64_t split_len = 0;  // positions per KV split; 0: automatic
    int32_t use_openmp = 1; // run on the loaded OpenMP runtime (torch's) when there is one
};

// Rows read by the stages of one call (the kernel's debug counters, exact by construction).
struct Counters {
    int64_t k_rows = 0;       // K rows scored (once per KV group and valid position)
    int64_t v_rows = 0;       // V rows read by P.V (kept-union rows only)
    int64_t v_mean_rows = 0;  // V rows read to compute the VMC mean (value_mean absent)
    int64_t items = 0;        // work items (sequence x KV head x split)
    int64_t units = 0;        // scheduled units (an item, or the items of every KV head of a range)
    int64_t splits_max = 0;   // largest number of splits of one (sequence, KV head)
    int64_t k_walks = 0;      // units whose K rows were read in one walk (unit_scores)
    int64_t pv_walks = 0;     // units whose V rows were read in one walk (unit_pv)
    int64_t threads_used = 0;
    int32_t runtime = 0;      // 0: caller's thread only, 1: own pool, 2: the loaded OpenMP runtime
};

// Arguments of the selection stage (thresholding + group union + kept weights) on the
// scores S[h * ldS + j], j < len, of one work item; x = (S - sub1[h]) - sub2[h] is compared
// with cut (per head, or one cut for the group maximum with group selection).
struct SelectArgs {
    const float* S = nullptr; int64_t ldS = 0; int32_t G = 0; int64_t len = 0;
    const float* sub1 = nullptr; const float* sub2 = nullptr;  // [G]
    const float* cut = nullptr;                                  // [G] (head) or [1] (group)
    int32_t group = 0;
    const float* mref = nullptr;  // [G]: weights are exp(S - mref) for kept positions
    int32_t need_dropped = 0;     // also sum exp(S - mref) over valid dropped positions (exact SDC)
    // outputs
    // (idx and each row of wk have room for 16 elements past len: SIMD levels may store whole vectors)
    int32_t* idx = nullptr;       // kept-union positions (relative to the item start), ascending
    float* wk = nullptr; int64_t ldw = 0;  // wk[h * ldw + t]: weight of head h on kept row t (0: dropped by h)
    uint8_t* flags = nullptr;     // [len] scratch
    float* R = nullptr; float* dropped = nullptr; int64_t* kcount = nullptr;  // [G]
};

// The stages that have one implementation per SIMD level (generic C++, AVX2, AVX-512).
// Rows are given as byte pointers to their first element; elements are `sdim` apart.
struct SimdOps {
    const char* name;
    // S[h * ldS + t] = <q_h, row_t> for t < count, q already scaled, [G][dpad] zero padded;
    // tile: scratch of 16 * dpad floats. qraw: the group's query as given ([G][dpad] 16-bit
    // values, zero padded), only for bfloat16 caches (else null); the avx512bf16 level then
    // computes scale * <qraw_h, row_t> with vdpbf16ps (docs/cpu.md, "SIMD levels").
    void (*scores)(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d,
                   int32_t dpad, const float* q, int32_t G, float* S, int64_t ldS, float* tile,
                   const uint16_t* qraw, float scale);
    // m = max of S ignoring NaN (-inf when empty/all NaN); bad = 1 if any NaN or +inf.
    void (*max_bad)(const float* S, int64_t len, float* m, int32_t* bad);
    // sum_j exp(S[j] - m)
    float (*sum_exp)(const float* S, int64_t len, float m);
    // returns the kept-union count
    int64_t (*select)(const SelectArgs& a);
    // acc[h * dpad + d] += sum_t wk[h * ldw + t] * row_t[d]; tile: scratch of 32 * dpad floats;
    // scattered != 0: the rows are a sparse subset of a range (visited in a strided order, not
    // ascending: avx512_pv.cpp, visit_stride)
    void (*pv)(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
               const float* wk, int64_t ldw, int32_t G, float* acc, float* tile, int32_t scattered);
    // sum[d] += sum_t row_t[d]; tile: scratch of 32 * dpad floats
    void (*vsum)(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d,
                 int32_t dpad, float* sum, float* tile);
    // Scores of bfloat16 K in vLLM's AMX packing (null on levels without a native path: the
    // kernel then unpacks rows first): tiles[i] is the K tile of 16 slots (one slot group of a
    // block and head), position t < count is lane (t + skip) % 16 of tile (t + skip) / 16;
    // S[h * ldS + t] = scale * <qraw_h, k_t>; tile: scratch of >= 40 * dpad + 1024 floats.
    void (*scores_packed)(const uint8_t* const* tiles, int64_t skip, int64_t count, int32_t d, int32_t dpad,
                          const uint16_t* qraw, int32_t G, float scale, float* S, int64_t ldS, float* tile) = nullptr;
    // P.V over kept bfloat16 V rows in vLLM's AMX packing (null: rows unpacked first): rows[t]
    // points at row t's first element, its 16-element vectors gstride bytes apart (each the
    // even or odd half of a 64-byte line); acc and wk as in pv.
    void (*pv_packed)(const uint8_t* const* rows, int64_t count, int32_t d, int32_t dpad, int64_t gstride,
                      const float* wk, int64_t ldw, int32_t G, float* acc, int32_t scattered) = nullptr;
    // Scores of K stored transposed (vLLM's vector-ISA CPU cache: element i of slot t at byte
    // k + i * dstride + t * elem_size): count consecutive slots, S[h * ldS + t] = <q_h, k_t>, q,
    // qraw and scale as in scores (the avx512bf16 and amx levels take scale * <qraw_h, k_t> for
    // bfloat16). next (may be null): the next segment's first slot, next_count slots,
    // prefetched while this one is read. Null on levels without it (rows read element-wise).
    void (*scores_kt)(const uint8_t* k, int64_t count, int64_t dstride, int32_t dtype, int32_t d, int32_t dpad,
                      const float* q, int32_t G, float* S, int64_t ldS, const uint8_t* next,
                      int64_t next_count, const uint16_t* qraw, float scale) = nullptr;
    // scores as above with the caller choosing what goes into L2 while the rows are read: pf[t]
    // (t < pf_count, may be null) while row t is, instead of the rows the stage would find
    // further down its own list (the walk over the KV heads of a paged NHD range: kernel.h,
    // unit_scores). Null on levels without it.
    void (*scores_pf)(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf, int64_t pf_count,
                      int32_t dtype, int64_t sdim, int32_t d, int32_t dpad, const float* q, int32_t G, float* S,
                      int64_t ldS, float* tile, const uint16_t* qraw, float scale) = nullptr;
    // pv over rows in the given order (never the strided visit) with the caller choosing what
    // goes into L2 while the rows are read: pf[t] (t < pf_count, may be null) while row t is read
    // (the walk over the KV heads of a paged NHD range: kernel.h, unit_pv). Null on levels
    // without it.
    void (*pv_pf)(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf, int64_t pf_count,
                  int32_t dtype, int64_t sdim, int32_t d, int32_t dpad, const float* wk, int64_t ldw, int32_t G,
                  float* acc, float* tile) = nullptr;
};

const SimdOps* ops_generic();
const SimdOps* ops_avx2();    // null when not compiled (non-x86 build)
const SimdOps* ops_avx512();  // null when not compiled
const SimdOps* ops_avx512bf16();  // null when not compiled (AVX-512 with AVX512-BF16 for bfloat16 scores)
const SimdOps* ops_amx();  // null when not compiled (avx512bf16 with AMX-BF16 tiles for bfloat16 scores)

}  // namespace topth_cpu
