// Mini-kernels for the unit tests of the CPU model itself: each breaks one rule the
// device enforces (or, "ok", follows them all) and must raise a ModelError naming the
// faulty call. They use the same model API the product kernel is built against.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kernel_operator.h"

using namespace AscendC;

namespace topth_selftest {
namespace {

struct Bufs {
    std::vector<float> in = std::vector<float>(256, 1.0f);  // read-only input "value_cache"
    std::vector<float> out = std::vector<float>(256, 0.0f); // writable "out"
};

void Launch1(Bufs& b, uint32_t blocks, const std::function<void()>& body) {
    topth_model::Launch launch(196608, 48);
    launch.AddGm("value_cache", b.in.data(), b.in.size() * 4, false, "V");
    launch.AddGm("out", b.out.data(), b.out.size() * 4, true, "");
    launch.Run(blocks, body);
}

float* In(Bufs& b) { return b.in.data(); }
float* Out(Bufs& b) { return b.out.data(); }

const std::map<std::string, std::function<void()>>& Table() {
    static const std::map<std::string, std::function<void()>> table = {
        {"ok",
         [] {
             // The canonical copy-in / compute / copy-out pipeline with queues: no error.
             Bufs b;
             Launch1(b, 2, [&] {
                 TPipe pipe;
                 TQue<QuePosition::VECIN, 2> inQ;
                 TQue<QuePosition::VECOUT, 2> outQ;
                 pipe.InitBuffer(inQ, 2, 64 * 4);
                 pipe.InitBuffer(outQ, 2, 64 * 4);
                 GlobalTensor<float> x, y;
                 const uint32_t base = GetBlockIdx() * 128;
                 x.SetGlobalBuffer(In(b) + base, 128);
                 y.SetGlobalBuffer(Out(b) + base, 128);
                 for (int i = 0; i < 2; ++i) {
                     LocalTensor<float> a = inQ.AllocTensor<float>();
                     DataCopy(a, x[i * 64], 64);
                     inQ.EnQue(a);
                     LocalTensor<float> a2 = inQ.DeQue<float>();
                     LocalTensor<float> c = outQ.AllocTensor<float>();
                     Exp(c, a2, 64);
                     outQ.EnQue(c);
                     inQ.FreeTensor(a2);
                     LocalTensor<float> c2 = outQ.DeQue<float>();
                     DataCopy(y[i * 64], c2, 64);
                     outQ.FreeTensor(c2);
                 }
             });
         }},
        {"gm_out_of_bounds",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 GlobalTensor<float> v;
                 v.SetGlobalBuffer(In(b));
                 LocalTensor<float> t = buf.Get<float>();
                 DataCopy(t, v[200], 64);  // reads elements 200..263 of a 256-element buffer
             });
         }},
        {"ub_misaligned",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 GlobalTensor<float> v;
                 v.SetGlobalBuffer(In(b), 256);
                 LocalTensor<float> t = buf.Get<float>();
                 DataCopy(t[4], v, 8);  // UB destination 16 bytes into the buffer
             });
         }},
        {"length_misaligned",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 GlobalTensor<float> v;
                 v.SetGlobalBuffer(In(b), 256);
                 LocalTensor<float> t = buf.Get<float>();
                 DataCopy(t, v, 10);  // 40 bytes: not a whole number of 32-byte blocks
             });
         }},
        {"ub_overflow",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> big, more;
                 pipe.InitBuffer(big, 150 * 1024);
                 pipe.InitBuffer(more, 50 * 1024);  // 200 KiB > 192 KiB
             });
         }},
        {"alloc_exhausted",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TQue<QuePosition::VECIN, 2> q;
                 pipe.InitBuffer(q, 2, 256);
                 LocalTensor<float> a = q.AllocTensor<float>();
                 LocalTensor<float> c = q.AllocTensor<float>();
                 LocalTensor<float> d = q.AllocTensor<float>();  // third buffer of two
                 (void)a; (void)c; (void)d;
             });
         }},
        {"deque_empty",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TQue<QuePosition::VECIN, 2> q;
                 pipe.InitBuffer(q, 2, 256);
                 LocalTensor<float> a = q.DeQue<float>();
                 (void)a;
             });
         }},
        {"free_enqueued",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TQue<QuePosition::VECIN, 2> q;
                 pipe.InitBuffer(q, 2, 256);
                 LocalTensor<float> a = q.AllocTensor<float>();
                 q.EnQue(a);
                 q.FreeTensor(a);  // still in the queue
             });
         }},
        {"enque_over_depth",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TQue<QuePosition::VECIN, 1> q;  // depth 1, two buffers
                 pipe.InitBuffer(q, 2, 256);
                 LocalTensor<float> a = q.AllocTensor<float>();
                 LocalTensor<float> c = q.AllocTensor<float>();
                 q.EnQue(a);
                 q.EnQue(c);
             });
         }},
        {"leak",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TQue<QuePosition::VECIN, 2> q;
                 pipe.InitBuffer(q, 2, 256);
                 LocalTensor<float> a = q.AllocTensor<float>();
                 (void)a;  // never freed
             });
         }},
        {"use_after_free",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TQue<QuePosition::VECIN, 2> q;
                 pipe.InitBuffer(q, 2, 256);
                 GlobalTensor<float> v;
                 v.SetGlobalBuffer(In(b), 256);
                 LocalTensor<float> a = q.AllocTensor<float>();
                 DataCopy(a, v, 64);
                 q.EnQue(a);
                 LocalTensor<float> a2 = q.DeQue<float>();
                 q.FreeTensor(a2);
                 Exp(a2, a2, 64);
             });
         }},
        {"hazard_mte2_v",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 GlobalTensor<float> v;
                 v.SetGlobalBuffer(In(b), 256);
                 LocalTensor<float> t = buf.Get<float>();
                 DataCopy(t, v, 64);
                 Exp(t, t, 64);  // no MTE2 -> V synchronisation
             });
         }},
        {"hazard_v_v",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 LocalTensor<float> t = buf.Get<float>();
                 Duplicate(t, 1.0f, 64);
                 Exp(t[64], t, 64);  // reads what Duplicate wrote: needs PipeBarrier<PIPE_V>
             });
         }},
        {"hazard_v_s",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 LocalTensor<float> t = buf.Get<float>();
                 Duplicate(t, 1.0f, 64);
                 float x = t.GetValue(3);  // scalar read without V -> S synchronisation
                 (void)x;
             });
         }},
        {"waitflag_unset",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 WaitFlag<HardEvent::MTE2_V>(0);
             });
         }},
        {"scalar_read_written_gm",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 LocalTensor<float> t = buf.Get<float>();
                 Duplicate(t, 2.0f, 64);
                 TEventID id = GetTPipePtr()->FetchEventID(HardEvent::V_MTE3);
                 SetFlag<HardEvent::V_MTE3>(id);
                 WaitFlag<HardEvent::V_MTE3>(id);
                 GlobalTensor<float> o;
                 o.SetGlobalBuffer(Out(b), 256);
                 DataCopy(o, t, 64);
                 float x = o.GetValue(0);  // scalar read of GM this kernel wrote
                 (void)x;
             });
         }},
        {"cross_block_race",
         [] {
             Bufs b;
             Launch1(b, 2, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 LocalTensor<float> t = buf.Get<float>();
                 Duplicate(t, 3.0f, 64);
                 TEventID id = GetTPipePtr()->FetchEventID(HardEvent::V_MTE3);
                 SetFlag<HardEvent::V_MTE3>(id);
                 WaitFlag<HardEvent::V_MTE3>(id);
                 GlobalTensor<float> o;
                 o.SetGlobalBuffer(Out(b), 256);
                 DataCopy(o, t, 64);  // both blocks write the same 256 bytes
             });
         }},
        {"readonly_write",
         [] {
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 LocalTensor<float> t = buf.Get<float>();
                 Duplicate(t, 3.0f, 64);
                 TEventID id = GetTPipePtr()->FetchEventID(HardEvent::V_MTE3);
                 SetFlag<HardEvent::V_MTE3>(id);
                 WaitFlag<HardEvent::V_MTE3>(id);
                 GlobalTensor<float> v;
                 v.SetGlobalBuffer(In(b), 256);
                 DataCopy(v, t, 64);  // writes the read-only input
             });
         }},
        {"syncall_hang",
         [] {
             Bufs b;
             std::vector<int32_t> syncWs(2 * 8, 0);
             topth_model::Launch launch(196608, 48);
             launch.AddGm("sync", syncWs.data(), syncWs.size() * 4, true, "");
             launch.Run(2, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 64);
                 if (GetBlockIdx() == 1) return;  // one block skips the barrier
                 GlobalTensor<int32_t> g;
                 g.SetGlobalBuffer(syncWs.data(), 16);
                 SyncAll(g, buf.Get<int32_t>(), 2);
             });
         }},
        {"select_scratch_overlap",
         [] {
             // A plan that uses the whole 192 KiB: Select's scratch block at 184 KiB lies in it.
             Bufs b;
             Launch1(b, 1, [&] {
                 TPipe pipe;
                 TBuf<> low, high;
                 pipe.InitBuffer(low, 188416 - 1024);
                 pipe.InitBuffer(high, 196608 - (188416 - 1024));
                 LocalTensor<float> x = low.Get<float>();
                 LocalTensor<uint8_t> m = high.Get<uint8_t>();
                 Duplicate(x, 1.0f, 64);
                 Duplicate(m.ReinterpretCast<float>(), 0.0f, 64);
                 PipeBarrier<PIPE_V>();
                 Select(x, m, x, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, 64);
             });
         }},
        {"hard_syncall_aiv_only",
         [] {
             Bufs b;
             Launch1(b, 2, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
                 SyncAll<true>();
             });
         }},
        {"syncall_concurrent_streams",
         [] {
             // Another stream holds cores: 2 of the 4 blocks start, and the kernel was not
             // launched in batch schedule mode.
             Bufs b;
             topth_model::Launch launch(196608, 48);
             launch.AddGm("out", b.out.data(), b.out.size() * 4, true, "");
             launch.SetResidentBlocks(2);
             launch.Run(4, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0);
                 SyncAll<true>();
             });
         }},
        {"cache_row_not_owned",
         [] {
             // Sequence 0 (length 2, head 0) may read rows 0 and 1 of the cache only.
             Bufs b;
             topth_model::Launch launch(196608, 48);
             launch.AddGm("value_cache", b.in.data(), b.in.size() * 4, false, "V");
             topth_model::RowOwnership own;
             own.enabled = true;
             own.kRowBytes = own.vRowBytes = 32;
             own.kRows = own.vRows = {{0, 32}};
             own.usedBlocks = {1};
             launch.SetOwnership(own);
             launch.Run(1, [&] {
                 TPipe pipe;
                 TBuf<> buf;
                 pipe.InitBuffer(buf, 1024);
                 GlobalTensor<float> v;
                 v.SetGlobalBuffer(In(b), 256);
                 TOPTH_MODEL_OWNER(0, 0);
                 DataCopy(buf.Get<float>(), v, 24);  // rows 0, 1 and 2
             });
         }},
        {"block_table_past_used",
         [] {
             // Sequence 0 uses one block; its table row has 4 entries.
             Bufs b;
             std::vector<int32_t> table = {0, -1, -1, -1};
             topth_model::Launch launch(196608, 48);
             launch.AddGm("block_table", table.data(), table.size() * 4, false, "");
             topth_model::RowOwnership own;
             own.enabled = true;
             own.kRowBytes = own.vRowBytes = 32;
             own.kRows = own.vRows = {{0}};
             own.maxBlocksPerSeq = 4;
             own.usedBlocks = {1};
             launch.SetOwnership(own);
             launch.Run(1, [&] {
                 GlobalTensor<int32_t> t;
                 t.SetGlobalBuffer(table.data(), 4);
                 TOPTH_MODEL_OWNER(0, 0);
                 (void)t.GetValue(0);
                 (void)t.GetValue(1);  // an entry past the sequence's blocks
             });
         }},
    };
    return table;
}

}  // namespace

std::vector<std::string> Cases() {
    std::vector<std::string> names;
    for (const auto& kv : Table()) names.push_back(kv.first);
    return names;
}

void Run(const std::string& name) {
    auto it = Table().find(name);
    if (it == Table().end()) throw std::invalid_argument("unknown self-test case " + name);
    it->second();
}

}  // namespace topth_selftest
