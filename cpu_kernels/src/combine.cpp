// Combining the partial records of the splits of one (sequence, KV head) and writing the
// outputs (docs/semantics.md, "The formulas"; split-KV combine as in flash-decoding).
//
// Each split p holds, per query head, its max m_p (NaN ignored), its sums relative to its
// reference max mref_p (R_p: kept weights, acc_p: sum of w * v), its dropped weights D_p and
// Z_p (all weights) relative to max(m_p, 0 if -inf), and its kept count. mref_p is m_p except
// where a head keeps only rows far below it (pre_softmax, group selection: the maximum over
// its kept rows, item.cpp). Every sum is rescaled to one reference M per head (a split whose
// scores are all -inf adds nothing).
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel.h"

namespace topth_cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// x * exp(d) (0 and NaN stay), without exp(d) alone overflowing or turning subnormal when the
// product is in range: there in the log domain (relative error ~|log |x| + d| ulp); elsewhere
// the plain product, as before.
float scaled_exp(float x, float d) {
    if (x == 0.0f || x != x || d == 0.0f) return x;
    if (d > -87.0f && d < 88.0f) return x * std::exp(d);
    return std::copysign(std::exp(std::log(std::fabs(x)) + d), x);
}

uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Global max over the splits of a pair (NaN-free maxima), as M and its safe value.
float pair_max(const Plan& plan, int64_t first, int64_t count, int32_t h) {
    float M = -kInf;
    for (int64_t p = first; p < first + count; ++p) M = std::fmax(M, plan.m_loc[size_t(p * plan.G + h)]);
    return M;
}

// Z relative to Msafe: sum over splits of exp(m_p safe - Msafe) * Z_p.
float pair_z(const Plan& plan, int64_t first, int64_t count, int32_t h, float Msafe) {
    float Z = 0.0f;
    for (int64_t p = first; p < first + count; ++p) {
        const float m = plan.m_loc[size_t(p * plan.G + h)];
        if (m == -kInf) continue;
        Z += std::exp(safe_max(m) - Msafe) * plan.Z[size_t(p * plan.G + h)];
    }
    return Z;
}

void write_out(const Params& P, int64_t b, int64_t h, const float* o, int32_t D) {
    uint8_t* base = static_cast<uint8_t*>(P.out);
    const int64_t es = P.dtype == kF32 ? 4 : 2;
    const int64_t off = (b * P.out_s[0] + h * P.out_s[1]) * es;
    for (int32_t d = 0; d < D; ++d) {
        uint8_t* dst = base + off + d * P.out_s[2] * es;
        if (P.dtype == kF32) {
            std::memcpy(dst, &o[d], 4);
        } else {
            const uint16_t v = P.dtype == kBF16 ? float_to_bf16(o[d]) : float_to_half(o[d]);
            std::memcpy(dst, &v, 2);
        }
    }
}

}  // namespace

// IEEE float -> half, round to nearest even (subnormals, overflow to inf, NaN kept quiet).
uint16_t float_to_half(float f) {
    uint32_t x = bits(f);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));
    if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (x < 0x38800000u) {                                   // below 2^-14: half subnormal or 0
        const float t = from_bits(x) + 0.5f;                  // the add rounds to nearest even
        return uint16_t(sign | (bits(t) - 0x3f000000u));
    }
    const uint32_t odd = (x >> 13) & 1u;
    x += ((15u - 127u) << 23) + 0xfffu + odd;
    return uint16_t(sign | (x >> 13));
}

// float -> bfloat16, round to nearest even, NaN kept quiet.
uint16_t float_to_bf16(float f) {
    const uint32_t x = bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
    return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

void combine_lse(Plan& plan, int64_t pair) {
    const int64_t first = plan.pair_first[size_t(pair)], count = plan.pair_count[size_t(pair)];
    for (int32_t h = 0; h < plan.G; ++h) {
        const float Msafe = safe_max(pair_max(plan, first, count, h));
        plan.pair_m[size_t(pair * plan.G + h)] = Msafe;
        plan.pair_logz[size_t(pair * plan.G + h)] = log_sum(pair_z(plan, first, count, h, Msafe));
    }
}

void combine_pair(Plan& plan, int64_t pair) {
    const Params& P = *plan.P;
    const int32_t G = plan.G, D = plan.D, dpad = plan.dpad;
    const int64_t b = pair / P.num_kv_heads, g = pair % P.num_kv_heads;
    const int64_t first = plan.pair_first[size_t(pair)], count = plan.pair_count[size_t(pair)];
    const int64_t n = plan.n[size_t(b)];
    const float nan = std::numeric_limits<float>::quiet_NaN();
    thread_local std::vector<float> buf;
    if (buf.size() < size_t(2 * D)) buf.resize(size_t(2 * D));
    float* o = buf.data();
    float* mu = o + D;
    if (P.vmc != kVmcOff) {
        for (int32_t d = 0; d < D; ++d) {
            if (P.vmc == kVmcGiven) {
                mu[d] = P.value_mean[b * P.vm_s[0] + g * P.vm_s[1] + d * P.vm_s[2]];
            } else {
                float s = 0.0f;
                for (int64_t p = first; p < first + count; ++p) s += plan.vs[size_t(p * dpad + d)];
                mu[d] = s / float(n > 0 ? n : 1);
            }
        }
    }
    int64_t union_rows = 0;
    for (int64_t p = first; p < first + count; ++p) union_rows += plan.uni[size_t(p)];
    for (int32_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        float beta = 0.0f;
        int64_t k = 0;
        if (n == 0 || count == 0) {
            for (int32_t d = 0; d < D; ++d) o[d] = 0.0f;
        } else {
            const float Msafe = safe_max(pair_max(plan, first, count, hh));
            // the sums' reference: the largest m_ref of the splits that kept rows with a finite
            // score (pre_softmax with group selection: a split's m_ref may be its kept maximum,
            // far below Msafe, item.cpp; a split whose kept scores are all -inf has R = 0 and
            // must not set the reference); Msafe when no split kept any
            float Mref = Msafe;
            if (P.placement == kPre) {
                float mk = -kInf;
                for (int64_t p = first; p < first + count; ++p) {
                    const size_t ph = size_t(p * G + hh);
                    if (plan.kc[ph] > 0 && plan.m_loc[ph] != -kInf && plan.R[ph] != 0.0f)
                        mk = std::fmax(mk, plan.m_ref[ph]);
                }
                if (mk != -kInf) Mref = mk;
            }
            float R = 0.0f, Dd = 0.0f;
            bool bad = false;
            for (int32_t d = 0; d < D; ++d) o[d] = 0.0f;
            for (int64_t p = first; p < first + count; ++p) {
                const size_t ph = size_t(p * G + hh);
                bad |= plan.bad[ph] != 0;
                k += plan.kc[ph];
                if (plan.m_loc[ph] == -kInf) continue;  // every score -inf: no weight
                // the dropped sum (exact SDC) is relative to the split's own maximum
                Dd += scaled_exp(plan.Dd[ph], safe_max(plan.m_loc[ph]) - Mref);
                if (plan.kc[ph] == 0 || plan.R[ph] == 0.0f) continue;  // R = 0: its kept scores are -inf
                const float f = std::exp(plan.m_ref[ph] - Mref);  // <= 1: Mref is the largest
                R += f * plan.R[ph];
                const float* a = &plan.acc[ph * size_t(dpad)];
                for (int32_t d = 0; d < D; ++d) o[d] += f * a[d];
            }
            float denom;
            if (P.placement == kPost) {
                denom = pair_z(plan, first, count, hh, Msafe);
            } else {
                float E = 0.0f;
                if (P.sdc == kSdcExact) {
                    E = Dd;
                } else if (P.sdc == kSdcExpThreshold) {
                    const float theta = threshold_of(plan, b, P.group_selection ? g : h);
                    if (n - k > 0 && P.sdc_gamma != 0.0f) E = scaled_exp(P.sdc_gamma * float(n - k), theta - Mref);
                } else if (P.sdc == kSdcOffline) {  // the table is in units of exp(a - m): rescaled to Mref
                    E = P.sdc_table[plan.set[size_t(b)] * P.sdc_s[0] + h * P.sdc_s[1] + plan.row[size_t(b)] * P.sdc_s[2]];
                    E = scaled_exp(E, Msafe - Mref);
                }
                denom = R + E;
            }
            float sumw = 0.0f;
            if (k > 0 && denom > 0.0f) {
                const float inv = 1.0f / denom;
                for (int32_t d = 0; d < D; ++d) o[d] *= inv;
                sumw = R * inv;
            } else {
                for (int32_t d = 0; d < D; ++d) o[d] = 0.0f;
            }
            beta = 1.0f - sumw;  // clamp into [0, 1]; NaN stays NaN
            if (beta < 0.0f) beta = 0.0f;
            if (beta > 1.0f) beta = 1.0f;
            if (P.vmc != kVmcOff)
                for (int32_t d = 0; d < D; ++d) o[d] += beta * mu[d];
            if (bad)
                for (int32_t d = 0; d < D; ++d) o[d] = nan;  // a NaN / +inf score poisons the head
        }
        write_out(P, b, h, o, D);
        if (P.kept) {
            P.kept[b * P.kept_s[0] + h * P.kept_s[1]] = int32_t(k);
            P.dropped_mass[b * P.dm_s[0] + h * P.dm_s[1]] = beta;
        }
    }
    if (P.v_rows) P.v_rows[b * P.vrows_s[0] + g * P.vrows_s[1]] = int32_t(n == 0 ? 0 : union_rows);
}

}  // namespace topth_cpu
