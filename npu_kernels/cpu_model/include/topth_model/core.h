// CPU model of the Ascend C API subset used by topth-ops: the runtime under the API.
//
// What it models (and enforces, by throwing ModelError with a message that names the
// operation, its source line and the buffers involved):
//   * global memory (GM): every buffer the host hands to the kernel is registered with a
//     name, a size, a tag (K, V, ...) and read-only / writable; copies that leave a buffer,
//     writes to read-only inputs, scalar reads of GM written during the kernel (stale
//     scalar data cache on the device) and cross-block races within one SyncAll epoch
//     are errors. Bytes moved GM -> on-chip and on-chip -> GM are counted per buffer.
//   * the on-chip buffers of an AI core (Atlas A2 / Ascend 910B): the unified buffer (UB)
//     of each AI vector core (AIV, 196608 bytes), and the cube core's (AIC) L1 (512 KiB),
//     L0A / L0B (64 KiB each) and L0C (128 KiB). TPipe::InitBuffer fails when the buffers
//     do not fit; arena bytes start as 0xFF (NaN) so reads of never-written data show up.
//   * the pipes of each core: MTE2 (GM -> UB / L1), MTE3 (UB -> GM), V (vector unit) and S
//     (scalar) on an AIV; MTE2, MTE1 (L1 -> L0A / L0B), M (cube) and FIX (L0C -> GM) and S
//     on an AIC. Every access to on-chip memory and to writable GM is recorded; an access
//     that depends on an earlier access by another pipe (of this core, or of another core
//     of the same AI core) without an intervening synchronisation (queues, SetFlag /
//     WaitFlag, PipeBarrier, CrossCoreSetFlag / CrossCoreWaitFlag) is a data-hazard error.
//     Only the scalar pipe is ordered with itself: dependent instructions of one pipe
//     (vector, cube, and copies whose destinations overlap) need PipeBarrier<pipe>.
//   * blocks: a vector-only kernel (KERNEL_TYPE_MIX_AIV_1_0) runs one AIV per block; a mix
//     kernel (KERNEL_TYPE_MIX_AIC_1_2) one AIC and two AIVs per block (an AI core). Every
//     core runs on its own host thread, so SyncAll and the cross-core flags really block;
//     a launch in which every live core waits for something no core will do is reported
//     as a deadlock.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <source_location>
#include <stdexcept>
#include <string>
#include <vector>

namespace topth_model {

class ModelError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// "file.cpp:123" for a source location (basename only).
std::string Where(const std::source_location& loc);

// Throws ModelError("[ascendc-cpu model] <core>: " + msg).
[[noreturn]] void Fail(const std::string& msg);

// Pipes of one core (an AIV uses MTE2, MTE3, V, S; an AIC MTE2, MTE1, M, FIX, S).
enum class Pipe : int { MTE2 = 0, MTE3 = 1, V = 2, S = 3, MTE1 = 4, M = 5, FIX = 6 };
constexpr int kPipes = 7;
const char* PipeName(Pipe p);

// Cores of one block (AI core) share one hazard tracker: slot 0 is the AIC of a mix kernel
// (or the only AIV of a vector-only kernel), slots 1 and 2 the two AIVs of a mix kernel.
constexpr int kSlots = 3;
constexpr int kGPipes = kSlots * kPipes;

// Memories the tracker tells apart: GM, the AIC's buffers, and the UB of each core slot.
enum class Space : int { GM = 0, L1 = 1, L0A = 2, L0B = 3, L0C = 4, UB = 5 };
constexpr int kSpaces = 8;  // UB of slot s is space 5 + s
const char* SpaceName(int space);

enum class CoreType : int { AIV = 0, AIC = 1 };

// One recorded access: what did it (operation and source line).
struct AccessInfo {
    const char* op = "";
    const char* file = "";
    uint32_t line = 0;
    std::string Describe() const;
};

struct Interval {
    uint64_t lo = 0, hi = 0, seq = 0;
    AccessInfo info;
};

// Intervals accessed by one pipe (reads or writes), each with the pipe sequence number of
// its latest access; an older access contained in a newer one is dropped.
class IntervalSet {
public:
    void Add(uint64_t lo, uint64_t hi, uint64_t seq, const AccessInfo& info);
    // The most recent interval overlapping [lo, hi) with seq > after, or nullptr.
    const Interval* OverlapAfter(uint64_t lo, uint64_t hi, uint64_t after) const;
    void PruneUpTo(uint64_t seq);
    size_t Size() const { return v_.size(); }

private:
    std::vector<Interval> v_;
};

// What one pipe has observed of the others: clk[q][p] = the last operation of pipe p that
// pipe q is ordered after (vector clocks carried by flags).
struct PipeClock {
    uint64_t c[kGPipes] = {};
    void Join(const PipeClock& o);
};

// Ordering of the pipes of the cores of one block and the log of their accesses.
// Thread-safe (the cores of a mix kernel run on their own threads).
class HazardTracker {
public:
    // Optional: render a GM range for messages (buffer name and offsets).
    std::function<std::string(uint64_t, uint64_t)> describeGm;
    // Names of the core slots, for messages ("AIC", "AIV0", ...).
    std::string slotName[kSlots];
    // Check an access of [lo, hi) by global pipe gp against every earlier conflicting access
    // it is not ordered after (read-after-write, write-after-write, write-after-read), then log it.
    void Access(int space, int gp, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info);
    // The knowledge a flag set now by global pipe gp carries.
    PipeClock Capture(int gp);
    // Global pipe gp waits for a flag carrying c.
    void Observe(int gp, const PipeClock& c);
    // Every pipe of core slot s waits for c (CrossCoreWaitFlag: no later instruction issues).
    void ObserveCore(int slot, const PipeClock& c);
    // PipeBarrier<pipe>: later instructions of gp wait for the earlier ones of gp.
    void BarrierPipe(int gp);
    // PipeBarrier<PIPE_ALL> of core slot s.
    void BarrierCore(int slot);
    // All pipes of the given slots observe each other (an all-core barrier they all passed).
    void BarrierSlots(const std::vector<int>& slots);
    // Pipes that may access a space (for pruning the logs); set by the launch.
    void SetActive(int slot, bool active, CoreType type);
    std::string PipeLabel(int gp) const;

private:
    void Prune();
    std::mutex mu_;
    uint64_t seq_[kGPipes] = {};
    uint64_t clk_[kGPipes][kGPipes] = {};
    IntervalSet log_[kSpaces][kGPipes][2];  // [space][pipe][write]
    bool active_[kSlots] = {false, false, false};
    CoreType type_[kSlots] = {CoreType::AIV, CoreType::AIV, CoreType::AIV};
    uint64_t accesses_ = 0;
};

// A buffer of global memory registered for one launch.
struct GmBuffer {
    std::string name;
    std::string tag;  // "K", "V" or "" (other)
    uint8_t* base = nullptr;
    uint64_t bytes = 0;
    bool writable = false;
    uint64_t bytesToUb = 0;    // GM -> on-chip bytes (MTE2: UB or L1)
    uint64_t bytesFromUb = 0;  // on-chip -> GM bytes (MTE3 from UB, FIX from L0C)
    uint64_t copiesToUb = 0;   // number of GM -> on-chip copy instructions
    bool writtenByKernel = false;
};

struct GmRecord {
    uint64_t lo, hi;
    uint32_t block;
    bool write;
    AccessInfo info;
};

// State of one queue buffer (slot) of a TQue.
struct SlotState {
    enum St { Free, Allocated, Enqueued, Dequeued } st = Free;
    uint32_t gen = 0;
    uint32_t lo = 0, hi = 0;  // byte range in its memory
    PipeClock enqueued;       // producer's knowledge at EnQue (DeQue waits for it)
    PipeClock freed;          // consumer's knowledge at FreeTensor (AllocTensor waits for it)
};

struct QueueState {
    std::string desc;  // "TQue<VECIN, depth 2> initialised at file:line"
    int position = 0;  // TPosition value
    int32_t depth = 1;
    std::vector<std::unique_ptr<SlotState>> slots;
    std::vector<int> freeOrder;  // free slot indices, FIFO
    std::vector<int> fifo;       // enqueued slot indices, FIFO
};

struct BufferDesc {
    int space;  // Space of the memory (UB, L1, L0A, L0B, L0C)
    uint32_t lo, hi;
    std::string desc;
};

class Launch;

// Per-pipe work one core issued (docs/ascendc.md, "Counters"): what a cycle estimate or a
// performance gate needs, counted instruction by instruction.
struct PipeCounters {
    uint64_t mte2Bytes = 0, mte2Requests = 0;  // GM -> UB / L1 copies (all buffers)
    uint64_t kBytes = 0, kRequests = 0, vBytes = 0, vRequests = 0;  // of them, the K / V caches
    uint64_t mte3Bytes = 0, mte3Requests = 0;  // UB -> GM copies
    uint64_t vecInstr = 0, vecRepeats = 0;     // vector instructions and their 256-byte repeats
    uint64_t scalarUbReads = 0, scalarUbWrites = 0, scalarGmReads = 0;  // scalar unit
    uint64_t barriers = 0, flags = 0;          // PipeBarrier calls, SetFlag/WaitFlag pairs
    uint64_t cubeInstr = 0;                    // cube-side instructions (Mmad, LoadData, Fixpipe, InitConstValue)
    uint64_t mmadInstr = 0, mmadFractals = 0;  // Mmad calls, 16x16x16 (b16) fractal products
    uint64_t mte1Bytes = 0, mte1Requests = 0;  // L1 -> L0A / L0B (LoadData), L0 fills
    uint64_t fixBytes = 0, fixRequests = 0;    // L0C -> GM (Fixpipe)
    uint64_t crossSets = 0, crossWaits = 0;    // CrossCoreSetFlag / CrossCoreWaitFlag
    uint64_t selectScratchWrites = 0;          // Select calls that wrote the API scratch block
    void Add(const PipeCounters& o);
};

// Kernel types (KERNEL_TASK_TYPE_DEFAULT).
enum class KernelType : int { Unset = -1, AivOnly = 0, AicOnly = 1, MixAiv10 = 2, MixAic10 = 3, MixAic11 = 4,
                              MixAic12 = 5 };

// Memory sizes of the cores (Atlas A2 defaults).
struct CoreMemory {
    uint32_t ub = 196608, l1 = 524288, l0a = 65536, l0b = 65536, l0c = 131072;
};

// Everything one core (an AIV or an AIC) owns while it runs.
struct BlockCtx {
    Launch* launch = nullptr;
    uint32_t block = 0;     // the block (AI core) index
    uint32_t dim = 1;       // blocks in the launch
    CoreType type = CoreType::AIV;
    uint32_t sub = 0;       // AIV index inside its AI core (0 or 1); 0 on the AIC
    uint32_t ratio = 1;     // AIVs per AI core in this launch (GetTaskRation on an AIV)
    int slot = 0;           // slot in the block's hazard tracker
    HazardTracker* haz = nullptr;
    std::vector<uint8_t> ub, l1, l0a, l0b, l0c;
    bool pipeAlive = false;
    void* pipePtr = nullptr;     // the live AscendC::TPipe
    uint32_t cursor[kSpaces] = {};  // next free byte per on-chip memory
    std::vector<BufferDesc> buffers;
    std::vector<std::unique_ptr<QueueState>> queues;
    std::map<std::pair<int, int>, PipeClock> flags;  // (event, id) -> setter's knowledge
    uint32_t syncAllCalls = 0;
    KernelType kernelType = KernelType::Unset;
    int64_t ownerSeq = -1, ownerHead = -1;  // TOPTH_MODEL_OWNER: whose cache rows this core reads
    PipeCounters cnt;
    std::string name;  // "block 3" (vector-only) or "block 3 AIC" / "block 3 AIV1"

    int GPipe(int pipe) const { return slot * kPipes + pipe; }
    int SpaceOf(int space) const { return space == static_cast<int>(Space::UB) ? 5 + slot : space; }
    std::vector<uint8_t>& Mem(int space);
};

BlockCtx& Ctx();  // the calling core's context; Fail() outside a launch
bool InLaunch();

// Bytes at the top of the unified buffer the Ascend C API keeps for itself (Select's
// scratch block sits at its start: 184 KiB on Atlas A2).
constexpr uint32_t kApiScratchReserve = 8192;

// Kernel-source hooks (kernel_operator.h macros).
void SetKernelType(int type);
void SetOwner(int64_t seq, int64_t head);
void DeclareBatchMode();
bool FaultIs(const char* name);  // TOPTH_MODEL_FAULT: a deliberate bug the test switched on

struct CoreReport {
    PipeCounters cnt;
    uint32_t block = 0, sub = 0;
    CoreType type = CoreType::AIV;
};

struct LaunchReport {
    uint32_t blockDim = 0;
    uint32_t ubPeak = 0;  // max over AIVs of the UB bytes TPipe handed out
    uint32_t l1Peak = 0, l0aPeak = 0, l0bPeak = 0, l0cPeak = 0;  // max over AICs
    uint32_t syncAllCalls = 0;
    std::vector<CoreReport> perCore;
    int kernelType = -1;
};

// Which cache rows each (sequence, KV head) may read: byte offsets of row starts inside the
// key / value buffers, from the block table, the lengths and the strides (host side), and
// the block-table entries each sequence may read. Empty: not checked.
struct RowOwnership {
    uint64_t kRowBytes = 0, vRowBytes = 0;
    uint32_t numKvHeads = 1, maxBlocksPerSeq = 1;
    std::vector<std::vector<uint64_t>> kRows, vRows;  // [b * numKvHeads + h] -> sorted row starts
    std::vector<uint32_t> usedBlocks;                 // [b] -> table entries of b that may be read
    bool enabled = false;
};

// Cross-core flags of one block: counters per flag id of each core (modes 1 and 2).
struct CrossFlag {
    int mode = -1;                         // mode in use (-1: none)
    std::deque<PipeClock> toCore[kSlots];  // pending sets a core's CrossCoreWaitFlag consumes
    std::deque<PipeClock> fromAiv[2];      // AIV sets waiting for their partner's (modes 1, 2)
    std::string lastSet;                   // description of the last set (messages)
};

// One kernel launch on the model: register GM buffers, then run blocks.
class Launch {
public:
    Launch(uint32_t ubBytes, uint32_t coreCount);
    ~Launch();
    void AddGm(const std::string& name, void* ptr, uint64_t bytes, bool writable, const std::string& tag);
    // Run `body` on every core of blockDim blocks: one AIV per block (aicPerBlock 0,
    // aivPerBlock 1: a vector-only kernel) or one AIC and two AIVs (a 1:2 mix kernel).
    // Rethrows the first error of any core.
    void Run(uint32_t blockDim, const std::function<void()>& body, uint32_t aicPerBlock = 0, uint32_t aivPerBlock = 1);

    const std::vector<GmBuffer>& Buffers() const { return gm_; }
    const LaunchReport& Report() const { return report_; }
    uint32_t UbBytes() const { return mem_.ub; }
    uint32_t CoreCount() const { return coreCount_; }
    void SetMemory(const CoreMemory& m) { mem_ = m; }
    void SetAicCount(uint32_t n) { aicCount_ = n; }
    const CoreMemory& Memory() const { return mem_; }
    bool Mix() const { return aicPerBlock_ > 0; }

    // --- used by the API layer ---
    GmBuffer& FindGm(const void* p, const char* op, const std::source_location& loc);
    // "'name' bytes [a, b)" for a host address range inside a registered buffer.
    std::string DescribeGm(uint64_t lo, uint64_t hi) const;
    // Cross-block race check + record, for accesses to writable GM.
    void RecordGm(uint32_t block, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info);
    // All-core barrier of SyncAll: the AIVs (aivOnly) or every core.
    void Barrier(BlockCtx& ctx, bool aivOnly, const std::source_location& loc);
    void CheckSyncWorkspace(const uint8_t* p, uint64_t bytes, const std::source_location& loc);
    void AddBytes(GmBuffer& b, bool toUb, uint64_t bytes);
    void NoteMem(const BlockCtx& ctx);
    // Cross-core flags (CrossCoreSetFlag / CrossCoreWaitFlag, modes 1 and 2).
    void CrossSet(BlockCtx& ctx, int mode, int flagId, const PipeClock& clock, const std::string& what);
    PipeClock CrossWait(BlockCtx& ctx, int flagId, const std::string& what);

    // --- launch conditions the tests set ---
    // Blocks the device starts together when another stream holds the other cores (0: all).
    void SetResidentBlocks(uint32_t n) { resident_ = n; }
    // Relative error the model's Exp / Ln apply (+/- eps, by element): hardware rounding.
    void SetTranscendentalError(float eps) { transErr_ = eps; }
    float TranscendentalError() const { return transErr_; }
    void SetOwnership(RowOwnership o) { own_ = std::move(o); }
    void SetFault(const std::string& f) { fault_ = f; }
    const std::string& Fault() const { return fault_; }
    // A K / V read of [lo, hi) bytes (offsets in the buffer) by a core for its owner.
    void CheckCacheRead(const GmBuffer& b, uint64_t lo, uint64_t hi, const BlockCtx& ctx, const char* op,
                        const std::source_location& loc) const;
    // A scalar read of block_table element `index` by a core.
    void CheckTableRead(uint64_t index, const BlockCtx& ctx, const std::source_location& loc) const;
    void SetBatchMode(bool on) { batchMode_.store(on && !schedNormal_); }
    // Simulate a toolchain without __schedmode__: the kernel's batch-mode declaration has no effect.
    void SetSchedModeNormal(bool on) { schedNormal_ = on; }
    bool BatchMode() const { return batchMode_.load(); }
    uint32_t AicPerBlock() const { return aicPerBlock_; }
    uint32_t AivPerBlock() const { return aivPerBlock_; }

private:
    // Deadlock detection (under mu_): a core about to block registers what it waits for.
    struct Waiter {
        const BlockCtx* ctx;
        std::function<bool()> ready;
        std::string what;
    };
    void BlockOn(std::unique_lock<std::mutex>& lk, BlockCtx& ctx, const std::function<bool()>& ready,
                 const std::string& what);
    void CheckDeadlock();  // under mu_
    void CheckCrossFlagsAtEnd();

    uint32_t coreCount_, aicCount_;
    CoreMemory mem_;
    std::vector<GmBuffer> gm_;
    LaunchReport report_;
    std::mutex mu_;
    std::condition_variable cv_;
    uint32_t arrived_ = 0, generation_ = 0, exitedAiv_ = 0, exitedAll_ = 0, alive_ = 0;
    uint32_t aicPerBlock_ = 0, aivPerBlock_ = 1, blocks_ = 0;
    bool aborted_ = false;
    std::string abortReason_;
    uint32_t epoch_ = 0;
    std::vector<GmRecord> epochRecords_;
    std::vector<Waiter> waiters_;
    std::vector<std::unique_ptr<HazardTracker>> trackers_;
    std::vector<std::map<int, CrossFlag>> cross_;  // [block] -> flag id -> state
    std::vector<BlockCtx*> barrierCtx_;
    bool syncWsChecked_ = false;
    uint32_t resident_ = 0;
    std::atomic<bool> batchMode_{false};
    bool schedNormal_ = false;
    float transErr_ = 0.0f;
    RowOwnership own_;
    std::string fault_;
};

}  // namespace topth_model
