// Kept-count calibration's histogram update (calib_hist.h): one pass over a chunk's score
// rows fills the per-head and per-group histograms of both placements.

#include "calib_hist.h"

#include <math.h>

#include <vector>

namespace topth_cpu {
namespace {

// clamp(floor(v), 0, bins - 1) for finite v, without a call to floor: truncation equals
// floor on [0, bins - 1), and everything below 0 (floor in [-1, 0) included) clamps to 0.
// bins - 1 (top) is exact in float32: the accumulator allows at most 2^20 bins.
inline int64_t bin_of(float v, float top) {
    if (!(v >= 0.0f)) return 0;
    if (v >= top) return static_cast<int64_t>(top);
    return static_cast<int64_t>(v);
}

// A value after which the group maximum is not finite whatever follows (NaN, +inf).
inline bool poison(float v) { return !(v <= INFINITY) || v == INFINITY; }

}  // namespace

int32_t calib_hist_add(const float* x, int64_t R, int64_t Hq, int64_t G, int64_t S, int64_t s_row, int64_t s_head,
                       const float* lse, const int64_t* bucket, int64_t num_buckets, int64_t bins,
                       const CalibHist& pre_head, const CalibHist& post_head, const CalibHist& pre_group,
                       const CalibHist& post_group) {
    if (bins < 1 || bins > (int64_t{1} << 24)) return 1;
    for (int64_t r = 0; r < R; ++r)
        if (bucket[r] < 0 || bucket[r] >= num_buckets) return 1;
    const float top = static_cast<float>(bins - 1);
    const int64_t Hkv = Hq / G;
    const bool post = post_head.hist || post_group.hist;
    const bool group = pre_group.hist || post_group.hist;
    const float ninf = -INFINITY;
    std::vector<float> gmax_pre(group ? S : 0), gmax_post(group ? S : 0);
    for (int64_t r = 0; r < R; ++r) {
        const int64_t b = bucket[r];
        for (int64_t g = 0; g < Hkv; ++g) {
            if (group) {
                for (int64_t j = 0; j < S; ++j) gmax_pre[j] = gmax_post[j] = ninf;
            }
            for (int64_t i = 0; i < G; ++i) {
                const int64_t h = g * G + i;
                const float* row = x + r * s_row + h * s_head;
                const float l = post ? lse[r * Hq + h] : 0.0f;
                int64_t* ph = pre_head.hist ? pre_head.hist + (h * num_buckets + b) * bins : nullptr;
                int64_t* qh = post_head.hist ? post_head.hist + (h * num_buckets + b) * bins : nullptr;
                const float plo = ph ? pre_head.lo[h] : 0.0f, pw = ph ? pre_head.inv_w[h] : 0.0f;
                const float qlo = qh ? post_head.lo[h] : 0.0f, qw = qh ? post_head.inv_w[h] : 0.0f;
                for (int64_t j = 0; j < S; ++j) {
                    const float a = row[j], p = a - l;
                    if (ph && isfinite(a)) ++ph[bin_of((a - plo) * pw, top)];
                    if (qh && isfinite(p)) ++qh[bin_of((p - qlo) * qw, top)];
                    if (group) {  // torch's amax: NaN (and +inf) poison the key, -inf is ignored
                        gmax_pre[j] = poison(a) ? NAN : (a > gmax_pre[j] ? a : gmax_pre[j]);
                        gmax_post[j] = poison(p) ? NAN : (p > gmax_post[j] ? p : gmax_post[j]);
                    }
                }
            }
            if (!group) continue;
            if (pre_group.hist) {
                int64_t* gh = pre_group.hist + (g * num_buckets + b) * bins;
                const float glo = pre_group.lo[g], gw = pre_group.inv_w[g];
                for (int64_t j = 0; j < S; ++j)
                    if (isfinite(gmax_pre[j])) ++gh[bin_of((gmax_pre[j] - glo) * gw, top)];
            }
            if (post_group.hist) {
                int64_t* gh = post_group.hist + (g * num_buckets + b) * bins;
                const float glo = post_group.lo[g], gw = post_group.inv_w[g];
                for (int64_t j = 0; j < S; ++j)
                    if (isfinite(gmax_post[j])) ++gh[bin_of((gmax_post[j] - glo) * gw, top)];
            }
        }
    }
    return 0;
}

}  // namespace topth_cpu
