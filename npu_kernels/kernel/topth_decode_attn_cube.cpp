/*
 * Top-Theta thresholded incremental (decode) flash attention, cube path: the mix kernel
 * (KERNEL_TYPE_MIX_AIC_1_2, one cube core and two vector cores per AI core, blockDim AI
 * cores) of Atlas A2 / Ascend 910B, after IncrementalFlashAttention's GQA path. The cube
 * core computes the scores Q.K^T of each 64-position tile for the GQA group of each of its
 * two vector cores' work items and hands them over through a GM ring (cross-core flags,
 * topth_cube.h); the vector cores do the rest exactly as the all-vector kernel
 * (topth_decode_attn.cpp, whose header describes the method and the work split):
 * thresholds, group union, compaction, V gather, P.V, split-KV combine, output.
 *
 * The host tiling chooses the path (cubePath, docs/ascendc.md "Which path runs") and
 * launches this entry or the all-vector one; both are built from the same stage headers.
 */
#include "topth_cube.h"

namespace {

template <typename T>
__aicore__ inline void RunCubePath(const topth::KernelArgs& args, const TopthTilingData& td, TPipe* pipe)
{
    topth::TopthDecodeKernel<T> op;
    if ASCEND_IS_AIC {
        op.InitCube(args, td, pipe);
        op.ProcessCube();
    }
    if ASCEND_IS_AIV {
        op.Init(args, td, pipe);
        op.Process();
    }
}

}  // namespace

extern "C" TOPTH_SCHED_BATCH __global__ __aicore__ void topth_decode_attn_cube(
    GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR seqLens, GM_ADDR thresholds, GM_ADDR sdcTable,
    GM_ADDR valueMean, GM_ADDR blockTable, GM_ADDR thresholdSet, GM_ADDR out, GM_ADDR kept, GM_ADDR vRows,
    GM_ADDR dropped, GM_ADDR workspace, GM_ADDR tiling)
{
    // One cube core and two vector cores per AI core; the hard SyncAll<true>() of the split-KV
    // combine synchronises the vector cores (the cube core has no part in it).
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
#if defined(TOPTH_HAS_SCHEDMODE)
    TOPTH_MODEL_SCHED_BATCH();
#endif
    TopthTilingData td;
    topth::LoadTiling(td, tiling);
    TPipe pipe;
    const topth::KernelArgs args{query, key, value, seqLens, thresholds, sdcTable, valueMean, blockTable,
                                 thresholdSet, out, kept, vRows, dropped, workspace};
    if (td.dtype == TOPTH_DTYPE_FP16) {
        RunCubePath<half>(args, td, &pipe);
    } else {
        RunCubePath<bfloat16_t>(args, td, &pipe);  // the tiling takes the cube path for 16-bit inputs only
    }
}
