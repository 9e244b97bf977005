// Mini-kernels for the unit tests of the CPU model's cube core and cross-core flags: each
// breaks one rule of the device (or, "cube_ok", follows them all), and CubeGemm is the
// cube pipeline of the product kernel (ND2NZ, LoadData, Mmad, Fixpipe) on small matrices,
// for tests that check its layouts against numpy.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kernel_operator.h"

using namespace AscendC;

namespace topth_selftest {
namespace {

struct Bufs {
    std::vector<half> a = std::vector<half>(64 * 64, half(0.5f));  // read-only "query"
    std::vector<float> out = std::vector<float>(64 * 64, 0.0f);   // writable "out"
};

// One AI core of a 1:2 mix kernel (one AIC, two AIVs).
void LaunchMix(Bufs& b, const std::function<void()>& body, bool vectorOnly = false) {
    topth_model::Launch launch(196608, 48);
    launch.AddGm("query", b.a.data(), b.a.size() * 2, false, "");
    launch.AddGm("out", b.out.data(), b.out.size() * 4, true, "");
    launch.Run(1, body, vectorOnly ? 0 : 1, vectorOnly ? 1 : 2);
}

template <HardEvent E>
void SyncEv() {
    SetFlag<E>(0);
    WaitFlag<E>(0);
}

// AIC: a 16 x 16 x 16 product of the query buffer with itself into out (faults by name).
void Gemm16(Bufs& b, const std::string& fault) {
    TPipe pipe;
    TBuf<TPosition::A1> aL1;
    TBuf<TPosition::A2> aL0;
    TBuf<TPosition::B2> bL0;
    TBuf<TPosition::CO1> cL0;
    pipe.InitBuffer(aL1, 512);
    pipe.InitBuffer(aL0, 512);
    pipe.InitBuffer(bL0, fault == "l0_misaligned" ? 1024 : 512);
    pipe.InitBuffer(cL0, 1024);
    GlobalTensor<half> a;
    a.SetGlobalBuffer(b.a.data(), b.a.size());
    GlobalTensor<float> o;
    o.SetGlobalBuffer(b.out.data(), b.out.size());
    LocalTensor<half> a1 = aL1.Get<half>(), a0 = aL0.Get<half>(), b0 = bL0.Get<half>();
    LocalTensor<float> c0 = cL0.Get<float>();
    DataCopy(a1, a, Nd2NzParams(1, 16, 16, 0, 16, 16, 1, 0));
    SyncEv<HardEvent::MTE2_MTE1>();
    LoadData(a0, a1, LoadData2DParams(0, 1, 1, 0, 0, false, 0));
    LoadData(fault == "l0_misaligned" ? b0[16] : b0, a1, LoadData2DParams(0, 1, 1, 0, 0, false, 0));
    SyncEv<HardEvent::MTE1_M>();
    MmadParams mp;
    mp.m = 16;
    mp.n = 16;
    mp.k = 16;
    Mmad(c0, a0, b0, mp);
    if (fault != "fixpipe_before_mmad") SyncEv<HardEvent::M_FIX>();
    Fixpipe(o, c0, FixpipeParamsV220(16, 16, 16, 16, false));
}

const std::map<std::string, std::function<void()>>& Table() {
    static const std::map<std::string, std::function<void()>> table = {
        {"cube_ok",
         [] {
             // The AIC computes a product into GM and hands it to both AIVs (mode 2), which
             // read it after the flag and answer; the AIC takes their answer.
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIC {
                     Gemm16(b, "");
                     CrossCoreSetFlag<2, PIPE_FIX>(1);
                     CrossCoreWaitFlag(2);
                 }
                 if ASCEND_IS_AIV {
                     TPipe pipe;
                     TBuf<> buf;
                     pipe.InitBuffer(buf, 1024);
                     GlobalTensor<float> o;
                     o.SetGlobalBuffer(b.out.data(), b.out.size());
                     CrossCoreWaitFlag(1);
                     DataCopy(buf.Get<float>(), o[GetSubBlockIdx() * 64], 64);
                     CrossCoreSetFlag<2, PIPE_MTE2>(2);
                 }
             });
         }},
        {"cube_op_on_aiv",
         [] {
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIV {
                     TPipe pipe;
                     TBuf<> buf;
                     pipe.InitBuffer(buf, 1024);
                     LocalTensor<half> t = buf.Get<half>();
                     LoadData(t, t, LoadData2DParams(0, 1, 1, 0, 0, false, 0));  // a vector core has no L0
                 }
             });
         }},
        {"l0_overflow",
         [] {
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIC {
                     TPipe pipe;
                     TQue<QuePosition::B2, 2> q;
                     pipe.InitBuffer(q, 2, 64 * 256 * 2);  // two 32 KiB K tiles fit; a third does not
                     TBuf<TPosition::B2> more;
                     pipe.InitBuffer(more, 512);
                 }
             });
         }},
        {"l0_misaligned", [] { Bufs b; LaunchMix(b, [&] { KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2); if ASCEND_IS_AIC { Gemm16(b, "l0_misaligned"); } }); }},
        {"fixpipe_before_mmad", [] { Bufs b; LaunchMix(b, [&] { KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2); if ASCEND_IS_AIC { Gemm16(b, "fixpipe_before_mmad"); } }); }},
        {"cross_wait_missing",
         [] {
             // The AIVs read the product without waiting for the AIC's flag.
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIC {
                     Gemm16(b, "");
                     CrossCoreSetFlag<2, PIPE_FIX>(1);
                 }
                 if ASCEND_IS_AIV {
                     TPipe pipe;
                     TBuf<> buf;
                     pipe.InitBuffer(buf, 1024);
                     GlobalTensor<float> o;
                     o.SetGlobalBuffer(b.out.data(), b.out.size());
                     DataCopy(buf.Get<float>(), o, 64);
                     CrossCoreWaitFlag(1);
                 }
             });
         }},
        {"cross_flag_unmatched",
         [] {
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIC { CrossCoreSetFlag<2, PIPE_FIX>(3); }  // no AIV waits for it
             });
         }},
        {"cross_flag_reserved_id",
         [] {
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIC { CrossCoreSetFlag<2, PIPE_FIX>(12); }  // one of the hard SyncAll's ids
             });
         }},
        {"cross_flag_vector_kernel",
         [] {
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0);
                 CrossCoreSetFlag<2, PIPE_MTE3>(1);
             }, true);
         }},
        {"cross_flag_deadlock",
         [] {
             // The AIC waits for a flag the AIVs never set (they returned).
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIC { CrossCoreWaitFlag(4); }
             });
         }},
        {"cross_flag_counter_overflow",
         [] {
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIC {
                     for (int i = 0; i < 16; ++i) CrossCoreSetFlag<2, PIPE_FIX>(5);  // the AIVs never wait
                 }
             });
         }},
        {"mte2_overlap_no_barrier",
         [] {
             // Two GM -> L1 copies into overlapping bytes on one pipe, no PipeBarrier<PIPE_MTE2>.
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIC {
                     TPipe pipe;
                     TBuf<TPosition::A1> l1;
                     pipe.InitBuffer(l1, 2048);
                     GlobalTensor<half> a;
                     a.SetGlobalBuffer(b.a.data(), b.a.size());
                     LocalTensor<half> t = l1.Get<half>();
                     InitConstValue(t, InitConstValueParams<half>(1, 64, 0, half(0.0f)));
                     DataCopy(t, a, Nd2NzParams(1, 4, 16, 0, 16, 16, 1, 0));
                 }
             });
         }},
        {"nd2nz_overlap",
         [] {
             Bufs b;
             LaunchMix(b, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIC {
                     TPipe pipe;
                     TBuf<TPosition::B1> l1;
                     pipe.InitBuffer(l1, 4096);
                     GlobalTensor<half> a;
                     a.SetGlobalBuffer(b.a.data(), b.a.size());
                     // 32 rows of 32 columns, but column blocks only 16 rows apart
                     DataCopy(l1.Get<half>(), a, Nd2NzParams(1, 32, 32, 0, 32, 16, 1, 0));
                 }
             });
         }},
        {"soft_syncall_mix_aiv_only",
         [] {
             Bufs b;
             std::vector<int32_t> ws(64, 0);
             topth_model::Launch launch(196608, 48);
             launch.AddGm("sync", ws.data(), ws.size() * 4, true, "");
             launch.Run(1, [&] {
                 KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
                 if ASCEND_IS_AIV {
                     TPipe pipe;
                     TBuf<> buf;
                     pipe.InitBuffer(buf, 256);
                     GlobalTensor<int32_t> g;
                     g.SetGlobalBuffer(ws.data(), 64);
                     SyncAll<true>(g, buf.Get<int32_t>(), 2);  // both AIVs would share one slot
                 }
             }, 1, 2);
         }},
    };
    return table;
}

}  // namespace

const std::map<std::string, std::function<void()>>& CubeTable() { return Table(); }

// C (m x n, row stride nPad) = A (m x k) . B (n x k)^T as the product kernel's cube core
// computes it: both ND2NZ into L1 (rows padded to 16 with zeros for A), A to L0A (Nz -> Zz),
// B to L0B (its Nz tile is B^T in Zn), Mmad with m, n, k, Fixpipe NZ -> ND.
std::vector<float> CubeGemm(uint32_t m, uint32_t n, uint32_t k, const std::vector<uint16_t>& aBits,
                            const std::vector<uint16_t>& bBits) {
    const uint32_t mp = (m + 15) / 16 * 16, np = (n + 15) / 16 * 16, kp = (k + 15) / 16 * 16;
    std::vector<half> A(aBits.size()), B(bBits.size());
    std::memcpy(A.data(), aBits.data(), aBits.size() * 2);
    std::memcpy(B.data(), bBits.data(), bBits.size() * 2);
    std::vector<float> C(uint64_t(m) * np, 0.0f);
    topth_model::Launch launch(196608, 48);
    launch.AddGm("a", A.data(), A.size() * 2, false, "");
    launch.AddGm("b", B.data(), B.size() * 2, false, "");
    launch.AddGm("c", C.data(), C.size() * 4, true, "");
    launch.Run(1, [&] {
        KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
        if ASCEND_IS_AIV return;
        TPipe pipe;
        TBuf<TPosition::A1> aL1;
        TBuf<TPosition::B1> bL1;
        TBuf<TPosition::A2> aL0;
        TBuf<TPosition::B2> bL0;
        TBuf<TPosition::CO1> cL0;
        pipe.InitBuffer(aL1, mp * kp * 2);
        pipe.InitBuffer(bL1, np * kp * 2);
        pipe.InitBuffer(aL0, mp * kp * 2);
        pipe.InitBuffer(bL0, np * kp * 2);
        pipe.InitBuffer(cL0, mp * np * 4);
        GlobalTensor<half> a, bg;
        a.SetGlobalBuffer(A.data(), A.size());
        bg.SetGlobalBuffer(B.data(), B.size());
        GlobalTensor<float> c;
        c.SetGlobalBuffer(C.data(), C.size());
        LocalTensor<half> a1 = aL1.Get<half>(), b1 = bL1.Get<half>(), a0 = aL0.Get<half>(), b0 = bL0.Get<half>();
        InitConstValue(a1, InitConstValueParams<half>(1, static_cast<uint16_t>(mp * kp * 2 / 32), 0, half(0.0f)));
        PipeBarrier<PIPE_MTE2>();
        DataCopy(a1, a, Nd2NzParams(1, m, k, 0, k, mp, 1, 0));
        DataCopy(b1, bg, Nd2NzParams(1, n, k, 0, k, np, 1, 0));
        SyncEv<HardEvent::MTE2_MTE1>();
        for (uint32_t mb = 0; mb < mp / 16; ++mb)
            LoadData(a0[mb * kp * 16], a1[mb * 256], LoadData2DParams(0, kp / 16, mp / 16, 0, 0, false, 0));
        LoadData(b0, b1, LoadData2DParams(0, (kp / 16) * (np / 16), 1, 0, 0, false, 0));
        SyncEv<HardEvent::MTE1_M>();
        MmadParams p;
        p.m = m;
        p.n = n;
        p.k = k;
        Mmad(cL0.Get<float>(), a0, b0, p);
        SyncEv<HardEvent::M_FIX>();
        Fixpipe(c, cL0.Get<float>(), FixpipeParamsV220(np, m, mp, np, false));
    }, 1, 2);
    return C;
}

}  // namespace topth_selftest
