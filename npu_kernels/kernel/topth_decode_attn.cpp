/*
 * Top-Theta thresholded incremental (decode) flash attention: Ascend C kernel for
 * Atlas A2 / Ascend 910B AI vector cores.
 *
 * One source, two builds: with CANN (bisheng, ascendc_library) for the NPU, and with g++
 * against the CPU model of the Ascend C API in npu_kernels/cpu_model (the model's
 * kernel_operator.h), which runs every block on the host and checks unified-buffer
 * capacity, alignment, queue discipline, pipe synchronisation and the cache rows read.
 *
 * Semantics: docs/semantics.md (op contract v0.2), method of Berestizshevsky et al.,
 * "Top-Theta Attention", arXiv 2502.08363, sections 3.1-3.2: per query head h, with n
 * valid positions, a_j = scale <q_h, k_j>, m = max_j a_j, theta = thresholds[set_b, h or g,
 * min(n, R) - 1]:
 *   pre_softmax : keep a_j > theta; w_j = exp(a_j - m) / (R + E~)  (R over kept, E~ by sdc)
 *   post_softmax: keep a_j - m - ln Z > ln theta, Z = sum_j exp(a_j - m); w_j = exp(a_j - m) / Z
 *   selection "group": one theta per KV head against the group maximum of those values
 *   out = sum_kept w_j v_j (+ beta mu with VMC, beta = 1 - sum_kept w_j).
 *
 * Work decomposition (after Ascend's IncrementalFlashAttention): one work item is one
 * (batch, kv-head) pair -- all query heads of a GQA group together, so K is read once per
 * group -- or, when batch x kv-heads is small, one split of the actual KV length of a pair
 * (flash-decoding); split partials are combined by log-sum-exp after an all-core sync.
 * Per item:
 *   1. K tiles (tileK rows) stream GM -> UB through a double-buffered queue, addressed
 *      through the block table (paged NHD / HND caches; contiguous BNSD is one block per
 *      sequence); a_j for all heads of the group on the vector unit.
 *   2. Per 64-position score tile: selection mask (Compare), kept / dropped exponentials
 *      (Select), per-head sums; the union over the group's heads of kept positions.
 *   3. Only V rows in that union are copied GM -> UB, weighted and accumulated.
 * pre_softmax runs 1-3 in one pass with a running maximum (flash attention); post_softmax
 * needs the full-row log-sum-exp first, so pass A streams K and writes the scores (4
 * bytes per head and position) to a GM workspace, pass B re-reads them and does 2-3.
 *
 * Stages: topth_plan.h (work split, addressing), topth_scores.h, topth_select.h,
 * topth_finalize.h; the class and the schedule in topth_kernel.h.
 */
#include "topth_finalize.h"

extern "C" TOPTH_SCHED_BATCH __global__ __aicore__ void topth_decode_attn(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR seqLens,
                                                         GM_ADDR thresholds, GM_ADDR sdcTable, GM_ADDR valueMean,
                                                         GM_ADDR blockTable, GM_ADDR thresholdSet, GM_ADDR out,
                                                         GM_ADDR kept, GM_ADDR vRows, GM_ADDR dropped,
                                                         GM_ADDR workspace, GM_ADDR tiling)
{
    // A vector-only kernel of mix type 0:1: the hard SyncAll<true>() of the split-KV
    // combine needs it (the launch starts blockDim vector cores, as AIV_ONLY would).
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0);
#if defined(TOPTH_HAS_SCHEDMODE)
    TOPTH_MODEL_SCHED_BATCH();
#endif
    TopthTilingData td;
    topth::LoadTiling(td, tiling);
    TPipe pipe;
    const topth::KernelArgs args{query, key, value, seqLens, thresholds, sdcTable, valueMean, blockTable,
                                 thresholdSet, out, kept, vRows, dropped, workspace};
    if (td.dtype == TOPTH_DTYPE_FP16) {
        topth::TopthDecodeKernel<half> op;
        op.Init(args, td, &pipe);
        op.Process();
    } else if (td.dtype == TOPTH_DTYPE_BF16) {
        topth::TopthDecodeKernel<bfloat16_t> op;
        op.Init(args, td, &pipe);
        op.Process();
    } else {
        topth::TopthDecodeKernel<float> op;
        op.Init(args, td, &pipe);
        op.Process();
    }
}
