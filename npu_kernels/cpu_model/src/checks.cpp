// CPU model of the Ascend C API subset: the checks of a launch that need the host's view
// of the call (which cache rows and block-table entries each work item may read), and the
// pipe counters' sum (see core.h).
#include <algorithm>
#include <sstream>

#include "topth_model/core.h"

namespace topth_model {

void PipeCounters::Add(const PipeCounters& o) {
    mte2Bytes += o.mte2Bytes; mte2Requests += o.mte2Requests;
    kBytes += o.kBytes; kRequests += o.kRequests; vBytes += o.vBytes; vRequests += o.vRequests;
    mte3Bytes += o.mte3Bytes; mte3Requests += o.mte3Requests;
    vecInstr += o.vecInstr; vecRepeats += o.vecRepeats;
    scalarUbReads += o.scalarUbReads; scalarUbWrites += o.scalarUbWrites; scalarGmReads += o.scalarGmReads;
    barriers += o.barriers; flags += o.flags; cubeInstr += o.cubeInstr;
    selectScratchWrites += o.selectScratchWrites;
}

namespace {
std::string OwnerName(const BlockCtx& ctx) {
    return "sequence " + std::to_string(ctx.ownerSeq) + ", KV head " + std::to_string(ctx.ownerHead);
}
}  // namespace

void Launch::CheckCacheRead(const GmBuffer& b, uint64_t lo, uint64_t hi, const BlockCtx& ctx, const char* op,
                            const std::source_location& loc) const {
    if (!own_.enabled) return;
    const bool isK = b.tag == "K";
    const uint64_t rowBytes = isK ? own_.kRowBytes : own_.vRowBytes;
    if (ctx.ownerSeq < 0) {
        Fail(std::string(op) + " at " + Where(loc) + ": reads '" + b.name +
             "' outside a work item (no TOPTH_MODEL_OWNER before it)");
    }
    const auto& rows = (isK ? own_.kRows : own_.vRows)[uint64_t(ctx.ownerSeq) * own_.numKvHeads + ctx.ownerHead];
    if ((hi - lo) % rowBytes != 0) {
        Fail(std::string(op) + " at " + Where(loc) + ": reads " + std::to_string(hi - lo) + " bytes of '" + b.name +
             "', not a whole number of " + std::to_string(rowBytes) + "-byte rows");
    }
    for (uint64_t r = lo; r < hi; r += rowBytes) {
        if (!std::binary_search(rows.begin(), rows.end(), r)) {
            std::ostringstream os;
            os << op << " at " << Where(loc) << ": reads bytes [" << r << ", " << r + rowBytes << ") of '" << b.name
               << "' for " << OwnerName(ctx) << ", which is not one of its valid rows (a block the block table "
               << "names for that sequence, a slot below its length, its KV head)";
            Fail(os.str());
        }
    }
}

void Launch::CheckTableRead(uint64_t index, const BlockCtx& ctx, const std::source_location& loc) const {
    if (!own_.enabled) return;
    const uint64_t b = index / own_.maxBlocksPerSeq, i = index % own_.maxBlocksPerSeq;
    if (ctx.ownerSeq < 0 || b != uint64_t(ctx.ownerSeq) || i >= own_.usedBlocks[b]) {
        std::ostringstream os;
        os << "GlobalTensor::GetValue at " << Where(loc) << ": reads block_table[" << b << ", " << i << "]";
        if (ctx.ownerSeq < 0) {
            os << " outside a work item";
        } else {
            os << " for " << OwnerName(ctx) << ", which uses entries [0, "
               << (b == uint64_t(ctx.ownerSeq) ? own_.usedBlocks[b] : own_.usedBlocks[ctx.ownerSeq])
               << ") of its own row only (entries past a sequence's blocks are never read)";
        }
        Fail(os.str());
    }
}

}  // namespace topth_model
