// The KV cache's element types (brisk/kv_dtype.py names them; the codes are the ABI's kv_dtype):
//   0 float32, 1 bfloat16, 2 float16, 3 fp8 e4m3 (OCP "fn": no infinities, max 448),
//   4 fp8 e5m2 (OCP, IEEE-like, max finite 57344), 5 int8 with one float32 scale per token and
//   KV head (scale = max |x| / 127, q = round-half-even(x / scale)), kept in a [slots, kv_heads]
//   array beside the cache.
// Writes convert with round-to-nearest-even and saturate to the largest finite value (a key that
// overflows an 8- or 16-bit float becomes its largest value, never inf): exactly what
// torch.clamp(x, -max, max).to(dtype) gives. Reads widen to float32 in registers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvt {

enum Code { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4, I8 = 5 };

// Element types the kernels are templated on (their sizes are the element's bytes).
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
struct e4m3_t { uint8_t bits; };
struct e5m2_t { uint8_t bits; };
// float and int8_t stand for themselves; int8_t is the scaled one.

inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float bits_f32(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as PyTorch converts; NaN stays NaN
    uint32_t bits = f32_bits(f);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

// IEEE half to float, in software (the portable path; the vector paths use vcvtph2ps)
inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
        const float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7F800000u | (man << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

// e5m2 is the high byte of a half; e4m3's 7 magnitude bits, placed at a half's bits 13..7, read
// as a half 2^8 too small (exponent bias 7 against 15), subnormals included
inline uint16_t e5m2_to_f16(uint8_t b) { return (uint16_t)((uint16_t)b << 8); }
inline uint16_t e4m3_to_f16_scaled(uint8_t b) { return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7)); }
constexpr float E4M3_UNSCALE = 256.f;

inline float e5m2_to_f32(uint8_t b) { return f16_to_f32(e5m2_to_f16(b)); }
// (the NaN code 0x7F, written only for a NaN input, reads as 480 here and on the vector paths)
inline float e4m3_to_f32(uint8_t b) { return f16_to_f32(e4m3_to_f16_scaled(b)) * E4M3_UNSCALE; }

// |x| rounded to nearest even into a float format with MAN mantissa bits and exponent BIAS,
// saturating at MAX_CODE (the largest finite magnitude's code); the sign is the caller's.
template <int MAN, int BIAS, uint32_t MAX_CODE>
inline uint32_t small_float_code(float a) {
    const float min_normal = std::ldexp(1.f, 1 - BIAS);
    if (a < min_normal)  // subnormal (or zero): a multiple of 2^(1 - BIAS - MAN); 2^MAN is min normal's code
        return (uint32_t)std::nearbyint(a * std::ldexp(1.f, BIAS + MAN - 1));
    const int shift = 23 - MAN;
    uint32_t u = f32_bits(a);
    u = (u + ((1u << (shift - 1)) - 1) + ((u >> shift) & 1u)) >> shift;
    const uint32_t code = u - ((uint32_t)(127 - BIAS) << MAN);
    return code < MAX_CODE ? code : MAX_CODE;
}

inline uint16_t f32_to_f16(float f) {
    const uint32_t sign = (f32_bits(f) >> 16) & 0x8000u;
    if (std::isnan(f)) return (uint16_t)(sign | 0x7E00u);
    return (uint16_t)(sign | small_float_code<10, 15, 0x7BFF>(std::fabs(f)));
}

inline uint8_t f32_to_e5m2(float f) {
    const uint32_t sign = (f32_bits(f) >> 24) & 0x80u;
    if (std::isnan(f)) return (uint8_t)(sign | 0x7F);
    return (uint8_t)(sign | small_float_code<2, 15, 0x7B>(std::fabs(f)));
}

inline uint8_t f32_to_e4m3(float f) {
    const uint32_t sign = (f32_bits(f) >> 24) & 0x80u;
    if (std::isnan(f)) return (uint8_t)(sign | 0x7F);
    return (uint8_t)(sign | small_float_code<3, 7, 0x7E>(std::fabs(f)));
}

}  // namespace kvt
