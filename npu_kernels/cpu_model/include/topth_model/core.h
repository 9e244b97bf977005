// CPU model of the Ascend C API subset used by topth-ops: the runtime under the API.
//
// What it models (and enforces, by throwing ModelError with a message that names the
// operation, its source line and the buffers involved):
//   * global memory (GM): every buffer the host hands to the kernel is registered with a
//     name, a size, a tag (K, V, ...) and read-only / writable; copies that leave a buffer,
//     writes to read-only inputs, scalar reads of GM written during the kernel (stale
//     scalar data cache on the device) and cross-block races within one SyncAll epoch
//     are errors. Bytes moved GM->UB and UB->GM are counted per buffer.
//   * the unified buffer (UB) of one AI vector core: a fixed-size arena per block
//     (196608 bytes for Atlas A2 / Ascend 910B); TPipe::InitBuffer fails when the
//     buffers do not fit. Arena bytes start as 0xFF (NaN) so reads of never-written UB
//     show up as NaN, as garbage would on the device.
//   * the four pipes a vector kernel drives: MTE2 (GM->UB), MTE3 (UB->GM), V (vector
//     unit) and S (scalar unit). Every access to UB (and to GM, per core) is recorded;
//     an access that depends on an earlier access by another pipe without an
//     intervening synchronisation (queue EnQue/DeQue, AllocTensor after FreeTensor,
//     SetFlag/WaitFlag, PipeBarrier) is a data-hazard error. Dependent vector
//     instructions need PipeBarrier<PIPE_V> between them, as on the device.
//   * blocks: every block of a launch runs on its own host thread with its own UB, so
//     SyncAll is a real barrier.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
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

// Throws ModelError("[ascendc-cpu model] block i: " + msg).
[[noreturn]] void Fail(const std::string& msg);

enum class Pipe : int { MTE2 = 0, MTE3 = 1, V = 2, S = 3 };
constexpr int kPipes = 4;
const char* PipeName(Pipe p);

// One recorded access: what did it (operation and source line) and when (pipe sequence).
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

// What one pipe has observed of the others: clk[q][p] = the last operation of pipe p
// that pipe q is ordered after. Hardware pipes are in order except the vector pipe
// against itself (PipeBarrier<PIPE_V>); flags (SetFlag/WaitFlag, and the flags TQue
// EnQue/DeQue and FreeTensor/AllocTensor use) carry the setter's knowledge to the waiter.
struct PipeClock {
    uint64_t c[kPipes] = {0, 0, 0, 0};
};

enum class Space : int { UB = 0, GM = 1 };

// Per-core ordering of the four pipes and the log of their accesses to UB and GM.
class HazardTracker {
public:
    // Optional: render a GM range for messages (buffer name and offsets).
    std::function<std::string(uint64_t, uint64_t)> describeGm;
    // Check an access of [lo, hi) by pipe p against every earlier conflicting access it is
    // not ordered after (read-after-write, write-after-write, write-after-read), then log it.
    void Access(Space space, Pipe p, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info);
    // The knowledge a flag set now by pipe p carries.
    PipeClock Capture(Pipe p) const;
    // Pipe q waits for a flag carrying c.
    void Observe(Pipe q, const PipeClock& c);
    void BarrierV();
    void BarrierAll();

private:
    void Prune();
    uint64_t seq_[kPipes] = {0, 0, 0, 0};
    uint64_t clk_[kPipes][kPipes] = {};
    IntervalSet log_[2][kPipes][2];  // [space][pipe][write]
    uint64_t accesses_ = 0;
};

// A buffer of global memory registered for one launch.
struct GmBuffer {
    std::string name;
    std::string tag;  // "K", "V" or "" (other)
    uint8_t* base = nullptr;
    uint64_t bytes = 0;
    bool writable = false;
    uint64_t bytesToUb = 0;  // GM -> UB bytes (MTE2)
    uint64_t bytesFromUb = 0;  // UB -> GM bytes (MTE3)
    uint64_t copiesToUb = 0;  // number of GM -> UB copy instructions
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
    uint32_t lo = 0, hi = 0;  // UB byte range
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
    uint32_t lo, hi;
    std::string desc;
};

class Launch;

// Per-pipe work one block issued (docs/ascendc.md, "Counters"): what a cycle estimate or a
// performance gate needs, counted instruction by instruction.
struct PipeCounters {
    uint64_t mte2Bytes = 0, mte2Requests = 0;  // GM -> UB copies (all buffers)
    uint64_t kBytes = 0, kRequests = 0, vBytes = 0, vRequests = 0;  // of them, the K / V caches
    uint64_t mte3Bytes = 0, mte3Requests = 0;  // UB -> GM copies
    uint64_t vecInstr = 0, vecRepeats = 0;     // vector instructions and their 256-byte repeats
    uint64_t scalarUbReads = 0, scalarUbWrites = 0, scalarGmReads = 0;  // scalar unit
    uint64_t barriers = 0, flags = 0;          // PipeBarrier calls, SetFlag/WaitFlag pairs
    uint64_t cubeInstr = 0;                    // cube-unit instructions (Mmad, LoadData, Fixpipe)
    uint64_t selectScratchWrites = 0;          // Select calls that wrote the API scratch block
    void Add(const PipeCounters& o);
};

// Kernel types (KERNEL_TASK_TYPE_DEFAULT); the model only distinguishes AIV-only from mix.
enum class KernelType : int { Unset = -1, AivOnly = 0, AicOnly = 1, MixAiv10 = 2, MixAic10 = 3, MixAic11 = 4,
                              MixAic12 = 5 };

// Everything one block (one AI vector core) owns while it runs.
struct BlockCtx {
    Launch* launch = nullptr;
    uint32_t idx = 0;
    uint32_t dim = 1;
    std::vector<uint8_t> ub;
    HazardTracker haz;
    bool pipeAlive = false;
    void* pipePtr = nullptr;  // the live AscendC::TPipe
    uint32_t pipeCursor = 0;  // next free UB byte
    std::vector<BufferDesc> buffers;
    std::vector<std::unique_ptr<QueueState>> queues;
    std::map<std::pair<int, int>, PipeClock> flags;  // (event, id) -> setter's knowledge
    uint32_t syncAllCalls = 0;
    KernelType kernelType = KernelType::Unset;
    int64_t ownerSeq = -1, ownerHead = -1;  // TOPTH_MODEL_OWNER: whose cache rows this block reads
    PipeCounters cnt;
};

BlockCtx& Ctx();  // the calling block's context; Fail() outside a launch

// Bytes at the top of the unified buffer the Ascend C API keeps for itself (Select's
// scratch block sits at its start: 184 KiB on Atlas A2).
constexpr uint32_t kApiScratchReserve = 8192;

// Kernel-source hooks (kernel_operator.h macros).
void SetKernelType(int type);
void SetOwner(int64_t seq, int64_t head);
void DeclareBatchMode();

struct LaunchReport {
    uint32_t blockDim = 0;
    uint32_t ubPeak = 0;  // max over blocks of the UB bytes TPipe handed out
    uint32_t syncAllCalls = 0;
    std::vector<PipeCounters> perBlock;  // counters of each block
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

// One kernel launch on the model: register GM buffers, then run blocks.
class Launch {
public:
    Launch(uint32_t ubBytes, uint32_t coreCount);
    ~Launch();
    void AddGm(const std::string& name, void* ptr, uint64_t bytes, bool writable, const std::string& tag);
    // Run `body` once per block on blockDim host threads; rethrows the first block error.
    void Run(uint32_t blockDim, const std::function<void()>& body);

    const std::vector<GmBuffer>& Buffers() const { return gm_; }
    const LaunchReport& Report() const { return report_; }
    uint32_t UbBytes() const { return ubBytes_; }
    uint32_t CoreCount() const { return coreCount_; }

    // --- used by the API layer ---
    GmBuffer& FindGm(const void* p, const char* op, const std::source_location& loc);
    // "'name' bytes [a, b)" for a host address range inside a registered buffer.
    std::string DescribeGm(uint64_t lo, uint64_t hi) const;
    // Cross-block race check + record, for accesses to writable GM.
    void RecordGm(uint32_t block, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info);
    void Barrier(uint32_t block, const std::source_location& loc);
    void CheckSyncWorkspace(const uint8_t* p, uint64_t bytes, const std::source_location& loc);
    void AddBytes(GmBuffer& b, bool toUb, uint64_t bytes);
    void NoteUb(uint32_t used);

    // --- launch conditions the tests set ---
    // Blocks the device starts together when another stream holds the other cores (0: all).
    void SetResidentBlocks(uint32_t n) { resident_ = n; }
    // Relative error the model's Exp / Ln apply (+/- eps, by element): hardware rounding.
    void SetTranscendentalError(float eps) { transErr_ = eps; }
    float TranscendentalError() const { return transErr_; }
    void SetOwnership(RowOwnership o) { own_ = std::move(o); }
    // A K / V read of [lo, hi) bytes (offsets in the buffer) by `block` for its owner.
    void CheckCacheRead(const GmBuffer& b, uint64_t lo, uint64_t hi, const BlockCtx& ctx, const char* op,
                        const std::source_location& loc) const;
    // A scalar read of block_table element `index` by `block`.
    void CheckTableRead(uint64_t index, const BlockCtx& ctx, const std::source_location& loc) const;
    void SetBatchMode(bool on) { batchMode_.store(on && !schedNormal_); }
    // Simulate a toolchain without __schedmode__: the kernel's batch-mode declaration has no effect.
    void SetSchedModeNormal(bool on) { schedNormal_ = on; }
    bool BatchMode() const { return batchMode_.load(); }

private:
    uint32_t ubBytes_, coreCount_;
    std::vector<GmBuffer> gm_;
    LaunchReport report_;
    std::mutex mu_;
    std::condition_variable cv_;
    uint32_t arrived_ = 0, generation_ = 0, running_ = 0, exited_ = 0;
    bool aborted_ = false;
    uint32_t epoch_ = 0;
    std::vector<GmRecord> epochRecords_;
    bool syncWsChecked_ = false;
    uint32_t resident_ = 0;
    std::atomic<bool> batchMode_{false};
    bool schedNormal_ = false;
    float transErr_ = 0.0f;
    RowOwnership own_;
};

}  // namespace topth_model
