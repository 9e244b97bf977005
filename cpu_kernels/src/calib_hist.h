// Kept-count calibration's histogram update on the CPU (calib_hist.cpp; the reference is
// the torch path of topth_ops.calibration.count.CountAccumulator._add). Plain data in.
#pragma once

#include <stdint.h>

namespace topth_cpu {

// One histogram set of a layer: hist [H, num_buckets, bins] int64 contiguous, and per head
// the range lo[h] and inverse bin width inv_w[h] (float32). null hist: not recorded.
struct CalibHist {
    int64_t* hist;
    const float* lo;
    const float* inv_w;
};

// Add the rows x [R, Hq, S] (float32 logits; element (r, h, j) at x[r * s_row + h * s_head + j])
// to up to four histogram sets: pre-softmax per head (x), post-softmax per head (x - lse[r, h]),
// pre-softmax per group and post-softmax per group (the maximum over the G = Hq / Hkv query
// heads of a KV head). Row r goes to bucket bucket[r] of every set. A value's bin is
// clamp(floor((v - lo) * inv_w), 0, bins - 1) in float32, as the torch path computes it;
// non-finite values (keys that are not valid for the row) are not counted. lse [R, Hq]
// contiguous, needed when a post-softmax set is given.
// Returns 0, or 1 (nothing added) when a bucket index is outside [0, num_buckets) or bins is
// outside [1, 2^24] (bin indices are exact in float32 below that).
int32_t calib_hist_add(const float* x, int64_t R, int64_t Hq, int64_t G, int64_t S, int64_t s_row, int64_t s_head,
                       const float* lse, const int64_t* bucket, int64_t num_buckets, int64_t bins,
                       const CalibHist& pre_head, const CalibHist& post_head, const CalibHist& pre_group,
                       const CalibHist& post_group);

}  // namespace topth_cpu
