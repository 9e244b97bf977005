// CPU model of the Ascend C API subset used by topth-ops: host storage types for half and
// bfloat16_t (IEEE binary16 and the top 16 bits of binary32), converted with round to
// nearest even as the vector unit's CAST_RINT does. Only conversions are provided: the
// kernel does all arithmetic in float after a Cast, as it must on the device.
#pragma once

#include <cstdint>
#include <cstring>

namespace topth_model {

inline uint32_t FloatBits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float BitsFloat(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// binary32 -> binary16, round to nearest even; NaN stays NaN (quiet), overflow gives inf.
inline uint16_t FloatToHalfBits(float f) {
    uint32_t x = FloatBits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (exp == 0xffu) {  // inf or NaN
        return static_cast<uint16_t>(sign | 0x7c00u | (man ? (0x200u | (man >> 13)) : 0u));
    }
    int32_t e = static_cast<int32_t>(exp) - 127 + 15;
    if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow
    if (e <= 0) {                                                    // subnormal or zero
        if (e < -10) return static_cast<uint16_t>(sign);
        man |= 0x800000u;
        uint32_t shift = static_cast<uint32_t>(14 - e);
        uint32_t half_man = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (half_man & 1u))) half_man++;
        return static_cast<uint16_t>(sign | half_man);
    }
    uint32_t half_man = man >> 13;
    uint32_t rem = man & 0x1fffu;
    uint32_t out = sign | (static_cast<uint32_t>(e) << 10) | half_man;
    if (rem > 0x1000u || (rem == 0x1000u && (half_man & 1u))) out++;  // may carry into exp: ok
    return static_cast<uint16_t>(out);
}

inline float HalfBitsToFloat(uint16_t h) {
    uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        if (man == 0) return BitsFloat(sign);
        // subnormal: normalise
        int32_t e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400u) == 0);
        man &= 0x3ffu;
        return BitsFloat(sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (man << 13));
    }
    if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (man << 13));
    return BitsFloat(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

inline uint16_t FloatToBf16Bits(float f) {
    uint32_t x = FloatBits(f);
    if ((x & 0x7f800000u) == 0x7f800000u && (x & 0x7fffffu)) {
        return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
    }
    uint32_t lsb = (x >> 16) & 1u;
    x += 0x7fffu + lsb;
    return static_cast<uint16_t>(x >> 16);
}

inline float Bf16BitsToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

}  // namespace topth_model

// Storage types named as in Ascend C (global namespace there too).
struct half {
    uint16_t bits = 0;
    half() = default;
    explicit half(float f) : bits(topth_model::FloatToHalfBits(f)) {}
    explicit operator float() const { return topth_model::HalfBitsToFloat(bits); }
};

struct bfloat16_t {
    uint16_t bits = 0;
    bfloat16_t() = default;
    explicit bfloat16_t(float f) : bits(topth_model::FloatToBf16Bits(f)) {}
    explicit operator float() const { return topth_model::Bf16BitsToFloat(bits); }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16_t) == 2, "16-bit storage types");
