// Weight-only quantized matmuls for brisk's CPU path: y[M, N] = x[M, K] @ W[N, K]^T.
//
// W is stored in blocks of 32 consecutive input features (GGML's block size), each with a
// float16 scale `d` and an optional float16 offset `m`: w = d * q + m. Two storage formats:
//   int4: q in [0, 15], two per byte; byte j of a block holds element j (low nibble) and
//         element j + 16 (high nibble) -- GGUF Q4_0/Q4_1's own order, so those repack by slicing.
//         Without `m` the offset is -8 * d (GGUF Q4_0).
//   int8: q a signed byte (GGUF Q8_0; Q5/Q6 values also fit).
// The activations are quantized per row and block of 32 to int8 with a float scale (as
// llama.cpp does for its CPU dot products), so each block's dot product is integer
// (AVX2 maddubs) and one float FMA: sum_j w_j x_j = d*dx*sum(q_j*xq_j) + m*dx*sum(xq_j).
//
// int4 and int8 also come in tiled layouts of 8 weight rows (see "int4 in tiles of 8 weight rows" and
// "int8 in tiles of 8 weight rows" below), which brisk's conversion writes for linear layers and
// token embeddings; GGUF Q5_K and Q6_K are kept as stored in tiled layouts of their own ("int5 and
// int6 in tiles of 8 weight rows"), and Q3_K and Q2_K in ones beside them ("int3 and int2 in tiles of 8
// weight rows").
//
// Plain C ABI, loaded with ctypes (brisk/kernels/__init__.py); threads come from OpenMP, the
// same libgomp that PyTorch already loaded, so they share its thread team.
// An AVX2 path is chosen at run time (the tiled int4 kernel in AVX-512 VNNI where the CPU has it);
// other CPUs take the portable scalar loop.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <immintrin.h>
#include <omp.h>
#include "brisk_abi.h"

namespace {

constexpr int QK = 32;
constexpr int IQ4 = 20;  // `bits` of the iq4 layout (4-bit codes into IQ4_VALUES; brisk.kernels.IQ4)
constexpr int MXFP4 = 21;  // `bits` of MXFP4 (E2M1 codes into MXFP4_VALUES with an E8M0 scale; brisk.kernels.MXFP4)

inline float f16_to_f32(uint16_t h) {
    // IEEE half -> float without F16C, for the scalar path.
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

struct Weights {
    const uint8_t* q;     // int4: [N, K/2]; int8: [N, K] (signed bytes)
    const uint16_t* d;    // [N, K/32] float16 scales (K-quants: their d per 256)
    const uint16_t* m;    // [N, K/32] float16 offsets, or null (K-quants: their dmin per 256)
    int bits;             // 4 or 8; tiled only: 2, 3, 5, 6 (GGUF Q2_K, Q3_K, Q5_K, Q6_K as stored), IQ4, MXFP4
    bool tiled;           // in tiles of 8 rows (see "int4 in tiles of 8 weight rows" below)
    const uint8_t* sub;   // tiled int4 with super-block scales (GGUF Q4_K): see tile_scales;
                          // tiled int6/int3 (GGUF Q6_K/Q3_K): their signed sub-scales, see "int6 in
                          // tiles"; int2's and IQ4_XS's scales; else null
};

struct Acts {
    const int8_t* q;    // [M, K]
    const float* d;     // [M, K/32] scale of each block
    const float* s;     // [M, K/32] d * sum(q) of each block
    const int32_t* n;   // [M, K/32] sum(q) of each block (the tiled int8 kernel's exact offset)
    const int32_t* h;   // [M, K/32] sum(q) of each block's first 16 (the int6 tiles' zero point)
};

// ---------------------------------------------------------------- scalar reference path

void quantize_rows_scalar(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs, int32_t* xn,
                          int32_t* xh) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float* src = x + r * K + b * QK;
            float amax = 0.f;
            for (int j = 0; j < QK; j++) amax = std::fmax(amax, std::fabs(src[j]));
            const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
            int sum = 0, half = 0;
            for (int j = 0; j < QK; j++) {
                const int v = (int)std::nearbyint(src[j] * id);
                xq[r * K + b * QK + j] = (int8_t)v;
                sum += v;
                if (j == QK / 2 - 1) half = sum;
            }
            xd[r * nb + b] = d;
            xs[r * nb + b] = d * (float)sum;
            xn[r * nb + b] = sum;
            xh[r * nb + b] = half;
        }
    }
}

float dot_scalar(const Weights& w, int64_t n, const Acts& a, int64_t r, int64_t K) {
    const int64_t nb = K / QK;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t* y = a.q + r * K + b * QK;
        int isum = 0;
        if (w.bits == 4) {
            const uint8_t* q = w.q + n * (K / 2) + b * (QK / 2);
            for (int j = 0; j < QK / 2; j++) isum += (q[j] & 0x0F) * y[j] + (q[j] >> 4) * y[j + QK / 2];
        } else {
            const int8_t* q = (const int8_t*)w.q + n * K + b * QK;
            for (int j = 0; j < QK; j++) isum += q[j] * y[j];
        }
        const float d = f16_to_f32(w.d[n * nb + b]);
        const float m = w.m ? f16_to_f32(w.m[n * nb + b]) : (w.bits == 4 ? -8.f * d : 0.f);
        acc += d * a.d[r * nb + b] * (float)isum + m * a.s[r * nb + b];
    }
    return acc;
}

// ---------------------------------------------------------------- AVX2 path

__attribute__((target("avx2,fma,f16c"))) inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma,f16c")))
void quantize_rows_avx2(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs, int32_t* xn,
                        int32_t* xh, bool paired) {
    const int64_t nb = K / QK;
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float* src = x + r * K + b * QK;
            __m256 v0 = _mm256_loadu_ps(src), v1 = _mm256_loadu_ps(src + 8);
            __m256 v2 = _mm256_loadu_ps(src + 16), v3 = _mm256_loadu_ps(src + 24);
            __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign_mask, v0), _mm256_andnot_ps(sign_mask, v1)),
                                        _mm256_max_ps(_mm256_andnot_ps(sign_mask, v2), _mm256_andnot_ps(sign_mask, v3)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
            const __m256 mul = _mm256_set1_ps(id);
            constexpr int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), rnd));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), rnd));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), rnd));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), rnd));
            const __m256i s01 = _mm256_add_epi32(i0, i1);  // elements 0..15
            __m256i s = _mm256_add_epi32(s01, _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(s01), _mm256_extracti128_si256(s01, 1));
            h4 = _mm_hadd_epi32(h4, h4);
            h4 = _mm_hadd_epi32(h4, h4);
            // int32 -> int8 keeping element order (packs work per 128-bit lane, then fix the order)
            __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
            __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), perm);
            int8_t* dst = xq + r * K + b * QK;
            if (paired && b % 2 == 1) {
                // pair layout: [b-1 elements 0..15 | b 0..15 | b-1 16..31 | b 16..31], matching the
                // low and high nibbles of the two int4 blocks' 32 bytes (see dot_pairs_int4)
                const __m256i prev = _mm256_loadu_si256((const __m256i*)(dst - QK));
                _mm256_storeu_si256((__m256i*)(dst - QK), _mm256_permute2x128_si256(prev, p, 0x20));
                p = _mm256_permute2x128_si256(prev, p, 0x31);
            }
            _mm256_storeu_si256((__m256i*)dst, p);
            xd[r * nb + b] = d;
            xs[r * nb + b] = d * (float)_mm_cvtsi128_si32(s4);
            xn[r * nb + b] = _mm_cvtsi128_si32(s4);
            xh[r * nb + b] = _mm_cvtsi128_si32(h4);
        }
    }
}

// The integer part of one block's dot product, as 8 int32 lanes.
__attribute__((target("avx2,fma,f16c"))) inline __m256i block_dot_u8s8(__m256i wq, __m256i y) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wq, y), _mm256_set1_epi16(1));
}

__attribute__((target("avx2,fma,f16c"))) inline __m256i load_int4_block(const uint8_t* q) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)q);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Sum over blocks of m_b * s_b (the offset term), m = -8 d when the format has no offsets.
__attribute__((target("avx2,fma,f16c")))
float offset_term(const Weights& w, int64_t n, const float* s, int64_t nb) {
    const uint16_t* mrow = (w.m ? w.m : w.d) + n * nb;
    const float factor = w.m ? 1.f : (w.bits == 4 ? -8.f : 0.f);
    if (factor == 0.f) return 0.f;
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mrow + b)));
        acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(s + b), acc);
    }
    float total = hsum(acc);
    for (; b < nb; b++) total += _cvtsh_ss(mrow[b]) * s[b];
    return factor * total;
}

// MT activation rows against one weight row n. Blocks alternate between U accumulators per
// row, so consecutive blocks' FMAs do not wait on each other.
// NOTE: measured against tiles of 2-4 weight rows x MT activation rows (each activation block
// loaded once for several weight rows): those were slower at 1-4 rows and no faster at 16-64
// with AVX2's 16 registers.
template <int MT, int U>
__attribute__((target("avx2,fma,f16c")))
void dot_rows_avx2(const Weights& w, int64_t n, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    const int64_t nb = K / QK;
    __m256 acc[MT][U];
    for (int i = 0; i < MT; i++)
        for (int u = 0; u < U; u++) acc[i][u] = _mm256_setzero_ps();
    const uint16_t* drow = w.d + n * nb;
    const int8_t* y0 = a.q + r0 * K;
    const float* yd0 = a.d + r0 * nb;
    for (int64_t b = 0; b < nb; b++) {
        const int u = (int)(b % U);
        const float d = _cvtsh_ss(drow[b]);
        __m256i wq, wsign = _mm256_setzero_si256();
        if (w.bits == 4) {
            wq = load_int4_block(w.q + n * (K / 2) + b * (QK / 2));
        } else {
            wsign = _mm256_loadu_si256((const __m256i*)(w.q + n * K + b * QK));
            wq = _mm256_sign_epi8(wsign, wsign);  // |q|; the sign moves onto the activations
        }
        for (int i = 0; i < MT; i++) {
            __m256i y = _mm256_loadu_si256((const __m256i*)(y0 + i * K + b * QK));
            if (w.bits == 8) y = _mm256_sign_epi8(y, wsign);
            const __m256 p = _mm256_cvtepi32_ps(block_dot_u8s8(wq, y));
            acc[i][u] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * yd0[i * nb + b]), acc[i][u]);
        }
    }
    for (int i = 0; i < MT; i++) {
        __m256 total = acc[i][0];
        for (int u = 1; u < U; u++) total = _mm256_add_ps(total, acc[i][u]);
        out[(r0 + i) * N + n] = hsum(total) + offset_term(w, n, a.s + (r0 + i) * nb, nb);
    }
}

// int4, AVX2: two blocks per step. Their 32 bytes hold the low halves of both blocks in the
// low nibbles and the high halves in the high nibbles; the activations were quantized in the
// matching pair layout, so one load, two masks and two maddubs cover 64 weights. Scales come
// eight blocks at a time as vectors (weight scales x activation scales), and each pair takes
// its two from there with one permute: about 4 instructions a block and row, against 8.
template <int MT, int U>
__attribute__((target("avx2,fma,f16c")))
void dot_pairs_int4(const Weights& w, int64_t n, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    const int64_t nb = K / QK, npairs = nb / 2;
    const uint8_t* wrow = w.q + n * (K / 2);
    const uint16_t* drow = w.d + n * nb;
    const int8_t* y0 = a.q + r0 * K;
    const float* yd0 = a.d + r0 * nb;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MT][U];
    for (int i = 0; i < MT; i++)
        for (int u = 0; u < U; u++) acc[i][u] = _mm256_setzero_ps();
    alignas(32) float scale[MT][8];
    int64_t pair = 0;
    for (; pair < npairs; pair++) {
        const int64_t b = 2 * pair;
        const int k = (int)(pair % 4);
        if (k == 0) {  // the next 8 blocks' scales (fewer at the end: built one pair at a time)
            if (b + 8 <= nb) {
                const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(drow + b)));
                for (int i = 0; i < MT; i++) _mm256_store_ps(scale[i], _mm256_mul_ps(sw, _mm256_loadu_ps(yd0 + i * nb + b)));
            } else {
                for (int i = 0; i < MT; i++)
                    for (int j = 0; b + j < nb && j < 8; j++) scale[i][j] = _cvtsh_ss(drow[b + j]) * yd0[i * nb + b + j];
            }
        }
        const __m256i idx = _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1);
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(wrow + b * (QK / 2)));
        const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        for (int i = 0; i < MT; i++) {
            const int8_t* y = y0 + i * K + b * QK;
            const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)y)),
                                                 _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(y + QK))));
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
            const __m256 sc = _mm256_permutevar8x32_ps(_mm256_load_ps(scale[i]), idx);
            acc[i][pair % U] = _mm256_fmadd_ps(p, sc, acc[i][pair % U]);
        }
    }
    for (int i = 0; i < MT; i++) {
        __m256 total = acc[i][0];
        for (int u = 1; u < U; u++) total = _mm256_add_ps(total, acc[i][u]);
        float sum = hsum(total);
        if (nb % 2) {  // an odd last block, in natural order
            const int64_t b = nb - 1;
            const __m256i y = _mm256_loadu_si256((const __m256i*)(y0 + i * K + b * QK));
            const __m256 p = _mm256_cvtepi32_ps(block_dot_u8s8(load_int4_block(wrow + b * (QK / 2)), y));
            sum += hsum(p) * _cvtsh_ss(drow[b]) * yd0[i * nb + b];
        }
        out[(r0 + i) * N + n] = sum + offset_term(w, n, a.s + (r0 + i) * nb, nb);
    }
}

// ---------------------------------------------------------------- int4 in tiles of 8 weight rows
//
// The tiled int4 layout (`tiled`, int4 only, N a multiple of 8; brisk.kernels.tile_int4 writes it at
// conversion): weight rows in tiles of NR = 8, and for tile t and block b 128 bytes at
// q + (t * nb + b) * 128, four 32-byte vectors: vector v holds, for each row j of the tile, 4 bytes
// at v*32 + 4j: low nibbles = the row's weights 4v..4v+3 of the block, high nibbles = its weights
// 4(v+4)..4(v+4)+3. Scales and offsets: [N/8][nb][8] float16, the tile's 8 rows side by side.
//
// So the 8 rows' results sit side by side in one vector: one broadcast of 4 activation bytes and
// one maddubs make 32 products for 8 rows, 8 of them summed in int16 cover a block (|sum| <=
// 8*2*15*127 = 30480: no overflow) and one madd widens: 9 multiplies per 256 products against 12
// in the row layout, no horizontal sums, and the tile's weights unpacked once for every activation
// row (llama.cpp repacks Q4_0 into such 8-row layouts at load for the same reason). Each block then
// takes, per activation row, acc = fma(tot, d8 * yd, acc); acc = fma(m8, ys, acc), d8/m8 the tile's
// scales/offsets of that block (m = -8 d for Q4_0), yd the activation block's scale, ys = yd *
// sum(xq): the same float sequence for every row count, so a row's result does not depend on the
// batch.

constexpr int NR = 8;

// A tile's 8 scales and offsets for block b, as the float steps use them. Plain tiles store them
// (float16, [tiles][nb][8]; no offsets: -8 d). Tiles with super-block scales (`sub`, GGUF Q4_K kept as
// stored) hold, per row and super-block of 8 blocks, d and dmin (float16, [tiles][nb/8][8] in `d`/`m`)
// and per block 6-bit integers sc and mn (`sub`: [tiles][nb][16], the tile's 8 sc then its 8 mn):
// scale = d * sc and offset = -(dmin * mn), both exact in float32 (11 x 6 significant bits), so a
// block's weights are what gguf's dequantizer computes, bit for bit.
__attribute__((target("avx2,fma,f16c")))
inline void tile_scales(const Weights& w, int64_t tile, int64_t b, int64_t nb, __m256& d8, __m256& m8) {
    if (w.sub) {
        const int64_t at = (tile * (nb / 8) + b / 8) * NR;
        const uint8_t* s = w.sub + (tile * nb + b) * 16;
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)s)));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s + 8))));
        d8 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.d + at))), sc);
        m8 = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.m + at))), mn),
                           _mm256_set1_ps(-0.f));
        return;
    }
    d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.d + (tile * nb + b) * NR)));
    m8 = w.m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.m + (tile * nb + b) * NR)))
             : _mm256_mul_ps(d8, _mm256_set1_ps(-8.f));
}

// The same for scalar code: row j of the tile.
inline void tile_scale(const Weights& w, int64_t tile, int64_t b, int64_t nb, int64_t j, float& d, float& m) {
    if (w.sub) {
        const int64_t at = (tile * (nb / 8) + b / 8) * NR + j;
        const uint8_t* s = w.sub + (tile * nb + b) * 16;
        d = f16_to_f32(w.d[at]) * (float)s[j];
        m = -(f16_to_f32(w.m[at]) * (float)s[8 + j]);
        return;
    }
    d = f16_to_f32(w.d[(tile * nb + b) * NR + j]);
    m = w.m ? f16_to_f32(w.m[(tile * nb + b) * NR + j]) : -8.f * d;
}


template <int MT>
__attribute__((target("avx2,fma,f16c")))
void tile_rows(const Weights& w, int64_t tile, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    const int64_t nb = K / QK;
    const uint8_t* wt = w.q + tile * nb * 128;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i s16[MT];
        for (int i = 0; i < MT; i++) s16[i] = _mm256_setzero_si256();
        const int8_t* yb = a.q + r0 * K + b * QK;
        for (int v = 0; v < 4; v++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(wt + b * 128 + v * 32));
            const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            for (int i = 0; i < MT; i++) {
                int32_t y_lo, y_hi;
                std::memcpy(&y_lo, yb + i * K + 4 * v, 4);
                std::memcpy(&y_hi, yb + i * K + 4 * (v + 4), 4);
                s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(y_lo)),
                                                                   _mm256_maddubs_epi16(hi, _mm256_set1_epi32(y_hi))));
            }
        }
        __m256 d8, m8;
        tile_scales(w, tile, b, nb, d8, m8);
        for (int i = 0; i < MT; i++) {
            const __m256 tot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], ones));
            acc[i] = _mm256_fmadd_ps(tot, _mm256_mul_ps(d8, _mm256_set1_ps(a.d[(r0 + i) * nb + b])), acc[i]);
            acc[i] = _mm256_fmadd_ps(m8, _mm256_set1_ps(a.s[(r0 + i) * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) _mm256_storeu_ps(out + (r0 + i) * N + tile * NR, acc[i]);
}

// The same tile with AVX-512 VNNI: vpdpbusd multiplies 4 weight bytes by 4 activation bytes and adds
// them into an int32 lane in one instruction, 16 lanes at once. A zmm holds two of the tile's
// 32-byte vectors (v, v+1); the activations' 4-byte groups for v and v+1 are spread over the two
// halves with one permute. Four vpdpbusd cover a block for one activation row (the AVX2 loop: 8
// maddubs, 8 int16 adds, a madd), and the halves are then added. Every block's integer sum is
// exact in both paths, and the float steps after it are the AVX2 loop's, in the same order: the
// results are bit for bit the AVX2 kernel's (tests compare them).
template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
void tile_rows_vnni(const Weights& w, int64_t tile, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    const int64_t nb = K / QK;
    const uint8_t* wt = w.q + tile * nb * 128;
    const __m512i low = _mm512_set1_epi8(0x0F);
    // dword g of the block's 32 activation bytes into lanes 0-7, dword g + 1 into lanes 8-15
    const __m512i lo01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i lo23 = _mm512_add_epi32(lo01, _mm512_set1_epi32(2));
    const __m512i hi01 = _mm512_add_epi32(lo01, _mm512_set1_epi32(4));
    const __m512i hi23 = _mm512_add_epi32(lo01, _mm512_set1_epi32(6));
    __m256 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512i raw01 = _mm512_loadu_si512(wt + b * 128), raw23 = _mm512_loadu_si512(wt + b * 128 + 64);
        const __m512i wl01 = _mm512_and_si512(raw01, low), wh01 = _mm512_and_si512(_mm512_srli_epi16(raw01, 4), low);
        const __m512i wl23 = _mm512_and_si512(raw23, low), wh23 = _mm512_and_si512(_mm512_srli_epi16(raw23, 4), low);
        __m256 d8, m8;
        tile_scales(w, tile, b, nb, d8, m8);
        for (int i = 0; i < MT; i++) {
            const __m512i y = _mm512_castsi256_si512(
                _mm256_loadu_si256((const __m256i*)(a.q + (r0 + i) * K + b * QK)));
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wl01, _mm512_permutexvar_epi32(lo01, y));
            s = _mm512_dpbusd_epi32(s, wh01, _mm512_permutexvar_epi32(hi01, y));
            s = _mm512_dpbusd_epi32(s, wl23, _mm512_permutexvar_epi32(lo23, y));
            s = _mm512_dpbusd_epi32(s, wh23, _mm512_permutexvar_epi32(hi23, y));
            const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
            const __m256 tot = _mm256_cvtepi32_ps(s8);
            acc[i] = _mm256_fmadd_ps(tot, _mm256_mul_ps(d8, _mm256_set1_ps(a.d[(r0 + i) * nb + b])), acc[i]);
            acc[i] = _mm256_fmadd_ps(m8, _mm256_set1_ps(a.s[(r0 + i) * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) _mm256_storeu_ps(out + (r0 + i) * N + tile * NR, acc[i]);
}

// Two tiles at once with AVX-512 VNNI (16 weight rows): vector v of tile t and of tile t+1 fill
// one zmm's halves (rows 0-7 | rows 8-15, each 4 bytes of k-group v), so every lane wants the same
// 4 activation bytes: vpdpbusd takes them as a 32-bit broadcast, with no permute, and the 16 lanes
// are the 16 rows' block sums, with no halves to add. Per block and activation row: 8 vpdpbusd
// for 16 weight rows, against 4 vpdpbusd + 4 permutes + an extract and add for 8 rows above.
// Float steps per output element as in tile_rows: bit for bit the same results.
// A pair of tiles' 16 outputs of activation row r, from one zmm: out[r][8 tile .. 8 tile + 16).
__attribute__((target("avx512f,avx2"))) inline void store_pair(float* out, int64_t r, int64_t N, int64_t tile,
                                                               __m512 acc) {
    _mm256_storeu_ps(out + r * N + tile * NR, _mm512_castps512_ps256(acc));
    _mm256_storeu_ps(out + r * N + tile * NR + NR, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}

template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
void tile_pair_vnni(const Weights& w, int64_t tile, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    const int64_t nb = K / QK;
    const uint8_t* w0 = w.q + tile * nb * 128;
    const uint8_t* w1 = w0 + nb * 128;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i lo[4], hi[4];
        for (int v = 0; v < 4; v++) {
            const __m512i raw = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(w0 + b * 128 + v * 32))),
                _mm256_loadu_si256((const __m256i*)(w1 + b * 128 + v * 32)), 1);
            lo[v] = _mm512_and_si512(raw, low);
            hi[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        __m256 da, ma, db, mb;
        tile_scales(w, tile, b, nb, da, ma);
        tile_scales(w, tile + 1, b, nb, db, mb);
        const __m512 d16 = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(da)),
                                                               _mm256_castps_pd(db), 1));
        const __m512 m16 = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(ma)),
                                                               _mm256_castps_pd(mb), 1));
        for (int i = 0; i < MT; i++) {
            // the block's 32 activation bytes as 8 groups of 4, read in place (may_alias: an int8
            // buffer read as int32 is defined; each y[v] becomes a broadcast load, where a memcpy
            // to a local array measured 15-20% slower at 16-64 rows)
            typedef int32_t __attribute__((may_alias)) group_t;
            const group_t* y = reinterpret_cast<const group_t*>(a.q + (r0 + i) * K + b * QK);
            // two chains (low and high nibbles) so that consecutive vpdpbusd do not wait on each other
            __m512i s_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], _mm512_set1_epi32(y[0]));
            __m512i s_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], _mm512_set1_epi32(y[4]));
            for (int v = 1; v < 4; v++) {
                s_lo = _mm512_dpbusd_epi32(s_lo, lo[v], _mm512_set1_epi32(y[v]));
                s_hi = _mm512_dpbusd_epi32(s_hi, hi[v], _mm512_set1_epi32(y[v + 4]));
            }
            const __m512 tot = _mm512_cvtepi32_ps(_mm512_add_epi32(s_lo, s_hi));
            acc[i] = _mm512_fmadd_ps(tot, _mm512_mul_ps(d16, _mm512_set1_ps(a.d[(r0 + i) * nb + b])), acc[i]);
            acc[i] = _mm512_fmadd_ps(m16, _mm512_set1_ps(a.s[(r0 + i) * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) store_pair(out, r0 + i, N, tile, acc[i]);
}

// ---------------------------------------------------------------- int8 in tiles of 8 weight rows
//
// The tiled int8 layout (`tiled`, bits 8, N a multiple of 8; brisk.kernels.tile_int8 writes it at
// conversion): for tile t and block b 256 bytes at q + (t * nb + b) * 256, eight 32-byte vectors:
// vector v holds, for each row j of the tile, 4 signed bytes at v*32 + 4j = the row's weights
// 4v..4v+3 of the block (GGUF Q8_0's bytes, moved, not changed). Scales and offsets as int4's tiles.
//
// Each block's integer sum sum_j q_j x_j is exact in int32 on every path, and the float steps after
// it are the same on every path and for every row count: acc = fma(tot, d * yd, acc), then (with
// offsets) acc = fma(m, ys, acc). So all paths give the same bits, alone or in any batch.
//   AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes; the weights become unsigned as
//     q + 128 (one xor), and the block's sum loses 128 * sum(x) in int32 (the activation block's
//     integer sum, from the quantizer). Two tiles at once (16 rows in a zmm, as tile_pair_vnni), the
//     activations as 4-byte broadcasts: 8 vpdpbusd per block and activation row for 16 weight rows.
//   AVX2: maddubs(|q|, x with q's sign) (|products| <= 2 * 128 * 127 < 32768: no saturation), one
//     madd to int32 per vector.

template <int MT>
__attribute__((target("avx2,fma,f16c")))
void tile8_rows(const Weights& w, int64_t tile, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    const int64_t nb = K / QK;
    const int8_t* wt = reinterpret_cast<const int8_t*>(w.q) + tile * nb * 256;
    const uint16_t* dt = w.d + tile * nb * NR;
    const uint16_t* mt = w.m ? w.m + tile * nb * NR : nullptr;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i s32[MT];
        for (int i = 0; i < MT; i++) s32[i] = _mm256_setzero_si256();
        const int8_t* yb = a.q + r0 * K + b * QK;
        for (int v = 0; v < 8; v++) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(wt + b * 256 + v * 32));
            const __m256i mag = _mm256_abs_epi8(q);
            for (int i = 0; i < MT; i++) {
                int32_t y4;
                std::memcpy(&y4, yb + i * K + 4 * v, 4);
                const __m256i y = _mm256_sign_epi8(_mm256_set1_epi32(y4), q);
                s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, y), ones));
            }
        }
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dt + b * NR)));
        for (int i = 0; i < MT; i++) {
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]), _mm256_mul_ps(d8, _mm256_set1_ps(a.d[(r0 + i) * nb + b])),
                                     acc[i]);
            if (mt)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mt + b * NR))),
                                         _mm256_set1_ps(a.s[(r0 + i) * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) _mm256_storeu_ps(out + (r0 + i) * N + tile * NR, acc[i]);
}

// Two tiles (16 rows) with VNNI in a zmm. (The last tile of an odd count takes tile8_rows: the same bits.)
template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
void tile8_pair_vnni(const Weights& w, int64_t tile, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    const int64_t nb = K / QK;
    const uint8_t* w0 = w.q + tile * nb * 256;
    const uint8_t* w1 = w0 + nb * 256;
    const uint16_t* d0 = w.d + tile * nb * NR;
    const uint16_t* d1 = d0 + nb * NR;
    const uint16_t* m0 = w.m ? w.m + tile * nb * NR : nullptr;
    const uint16_t* m1 = m0 ? m0 + nb * NR : nullptr;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i u[8];
        for (int v = 0; v < 8; v++)
            u[v] = _mm512_xor_si512(_mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(w0 + b * 256 + v * 32))),
                _mm256_loadu_si256((const __m256i*)(w1 + b * 256 + v * 32)), 1), flip);
        const __m512 d16 = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(d0 + b * NR))),
            _mm_loadu_si128((const __m128i*)(d1 + b * NR)), 1));
        for (int i = 0; i < MT; i++) {
            typedef int32_t __attribute__((may_alias)) group_t;
            const group_t* y = reinterpret_cast<const group_t*>(a.q + (r0 + i) * K + b * QK);
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(y[0]));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], _mm512_set1_epi32(y[1]));
            for (int v = 2; v < 8; v += 2) {
                s0 = _mm512_dpbusd_epi32(s0, u[v], _mm512_set1_epi32(y[v]));
                s1 = _mm512_dpbusd_epi32(s1, u[v + 1], _mm512_set1_epi32(y[v + 1]));
            }
            const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(128 * a.n[(r0 + i) * nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d16, _mm512_set1_ps(a.d[(r0 + i) * nb + b])),
                                     acc[i]);
            if (m0)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_inserti128_si256(
                                             _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(m0 + b * NR))),
                                             _mm_loadu_si128((const __m128i*)(m1 + b * NR)), 1)),
                                         _mm512_set1_ps(a.s[(r0 + i) * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) store_pair(out, r0 + i, N, tile, acc[i]);
}

// Weight row n of the tiled int8 layout, one activation row, portable: the same float steps.
float dot_scalar_tiled8(const Weights& w, int64_t n, const Acts& a, int64_t r, int64_t K) {
    const int64_t nb = K / QK, tile = n / NR, j = n % NR;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t* blk = reinterpret_cast<const int8_t*>(w.q) + (tile * nb + b) * 256;
        const int8_t* y = a.q + r * K + b * QK;
        int isum = 0;
        for (int v = 0; v < 8; v++)
            for (int e = 0; e < 4; e++) isum += blk[v * 32 + j * 4 + e] * y[4 * v + e];
        const float d = f16_to_f32(w.d[(tile * nb + b) * NR + j]);
        acc = std::fma((float)isum, d * a.d[r * nb + b], acc);
        if (w.m) acc = std::fma(f16_to_f32(w.m[(tile * nb + b) * NR + j]), a.s[r * nb + b], acc);
    }
    return acc;
}

// Weight row n of the tiled layout, one activation row, portable (the float steps of tile_rows).
float dot_scalar_tiled(const Weights& w, int64_t n, const Acts& a, int64_t r, int64_t K) {
    const int64_t nb = K / QK, tile = n / NR, j = n % NR;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w.q + (tile * nb + b) * 128;
        const int8_t* y = a.q + r * K + b * QK;
        int isum = 0;
        for (int v = 0; v < 4; v++)
            for (int e = 0; e < 4; e++) {
                const uint8_t byte = blk[v * 32 + j * 4 + e];
                isum += (byte & 0x0F) * y[4 * v + e] + (byte >> 4) * y[4 * (v + 4) + e];
            }
        float d, m;
        tile_scale(w, tile, b, nb, j, d, m);
        acc = std::fma((float)isum, d * a.d[r * nb + b], acc);  // the vector paths' steps: the same bits
        acc = std::fma(m, a.s[r * nb + b], acc);
    }
    return acc;
}

// ---------------------------------------------------------------- int5 and int6 in tiles of 8 weight rows
//
// GGUF Q5_K and Q6_K kept as stored (`tiled`, bits 5 or 6, N a multiple of 8; brisk.kernels.tile_int5 /
// tile_int6 write them at conversion). Both are int4's tile of each weight's low 4 bits plus planes of
// its top bits; for tile t and block b, BYTES(bits) at q + (t * nb + b) * BYTES:
//   bytes 0..127: the low 4 bits as int4's tile (vector v, row j, byte e: low nibble weight 4v+e,
//     high nibble weight 16+4v+e);
//   int5, bytes 128..159: byte 4j+e holds at bit u the top bit of logical vector u's weight (u < 4: the
//     low nibble's of vector u, u >= 4: the high nibble's of vector u-4);
//   int6, bytes 128..159 (h0) and 160..191 (h1): byte 4j+e of h_k holds, at bits 2v..2v+1, the top 2
//     bits of row j's weight 16k+4v+e.
// So 5 and 6 bits a weight, as in the files. q is unsigned (0..31, 0..63): AVX2's maddubs and VNNI's
// vpdpbusd take it as it is. Scales:
//   int5 (Q5_K: w = d * sc * q - dmin * mn): Q4_K's super-block scales (`sub` uint8, tile_scales), and
//     Q4_K's float steps per block: acc = fma(tot, d * sc * dx, acc); acc = fma(-(dmin * mn), ys, acc).
//   int6 (Q6_K: w = d * sc * (q - 32)): `d` [tiles][nb/8][8] float16 per 256, `sub` [tiles][nb][16] int8:
//     the tile's 8 rows' sc of weights 0..15, then of 16..31. The nibble split is also the scale split
//     (vectors 0-3's low nibbles are the first 16 weights), so each half's integer sum S_k is kept and
//       T = sc_0 (S_0 - 32 X_0) + sc_1 (S_1 - 32 X_1)   (X_k the activations' half sums, from the quantizer)
//     is exact in int32 (|T| <= 2 * 128 * 16 * 32 * 127 < 2^24, so also as a float); then
//     acc = fma(T, d * dx, acc). (The VNNI loop forms T in float: each product and the sum stay below
//     2^24, so it is exact there too, and vpmulld, slower than the float multiply, is avoided: 64 rows
//     of a 14336x4096 matrix took 60.6 ms with it and 42.4 ms without.)
// Integer sums are exact and the float steps the same on every path and row count: every path gives
// the same bits, alone or batched.
//
// ---------------------------------------------------------------- int3 and int2 in tiles of 8 weight rows
//
// GGUF Q3_K kept as stored (`tiled`, bits 3; brisk.kernels.tile_int3): w = d * sc * (q - 4), q in 0..7,
// with int6's scales (a float16 d per 256, a signed sc per 16: Q3_K's 6-bit scales, each held in a byte)
// and its sums, the offset 4 where int6 has 32. For tile t and block b, 96 bytes at q + (t * nb + b) * 96:
//   bytes 0..31 (p0) and 32..63 (p1): byte 4j+e of p_k holds, at bits 2v..2v+1, the low 2 bits of row j's
//     weight 16k+4v+e;
//   bytes 64..95: the top bit as int5's plane (byte 4j+e, bit u: logical vector u's weight; u < 4 the
//     first 16 weights', u >= 4 the second 16's).
// So 3 bits a weight, and 3.5625 with the scales (the file: 3.4375). The vectors met by the activations
// are int6's (vector v, row j, byte e: weight 4v+e; then 16+4v+e), so one template serves them all.
//
// int2 (GGUF Q2_K kept as stored, bits 2; brisk.kernels.tile_int2): w = d * sc * q - dmin * mn, q in 0..3,
// sc and mn 4 bits per 16 weights, d and dmin float16 per 256. A block is int3's p0 and p1 alone (64 bytes);
// `sub` [tiles][nb][16] holds the file's byte sc | mn << 4 per 16 (the tile's 8 rows' first 16s, then
// their second), `d` and `m` [tiles][nb/8][8] float16. Per block, with S_k and X_k as int6's:
//   T = sc_0 S_0 + sc_1 S_1,  U = mn_0 X_0 + mn_1 X_1   (exact, < 2^24);
//   acc = fma(T, d * dx, acc); acc = fma(-U, dmin * dx, acc).
// 2.625 bits a weight, the file's own.

template <int BITS> constexpr int64_t high_bytes() { return BITS == 2 ? 64 : BITS == 3 ? 96 : BITS == 5 ? 160 : 192; }
template <int BITS> constexpr int64_t high_at() { return BITS == 3 ? 64 : 128; }  // the top-bit plane(s)
template <int BITS> constexpr int32_t zero_point() { return BITS == 3 ? 4 : 32; }  // int3/int6: q - it

// Bit S of each byte (and the bit above it) moved to bit T (and T+1), by a 16-bit shift: for S <= 7
// the target bits of a byte come from the same byte; what crosses from its neighbour the caller masks off.
template <int T, int S>
__attribute__((target("avx2"))) inline __m256i bit_to(__m256i h) {
    return S < T ? _mm256_slli_epi16(h, T - S) : S > T ? _mm256_srli_epi16(h, S - T) : h;
}

template <int T, int S>
__attribute__((target("avx512f,avx512bw"))) inline __m512i bit_to(__m512i h) {
    return S < T ? _mm512_slli_epi16(h, T - S) : S > T ? _mm512_srli_epi16(h, S - T) : h;
}

template <int S, class V> inline V bit_at_4(V h) { return bit_to<4, S>(h); }

// Vector V's top bits at bit 4 (int5) or bits 4..5 (int6) of each byte, for the block's first (lo) and
// second (hi) 16 weights: int5 keeps them at bits V and V+4 of one plane, int6 at bits 2V..2V+1 of two.
template <int BITS, int V> constexpr int top_lo() { return BITS == 5 ? V : 2 * V; }
template <int BITS, int V> constexpr int top_hi() { return BITS == 5 ? V + 4 : 2 * V; }

template <int BITS, int V>
__attribute__((target("avx2"))) inline void top_bits(__m256i h0, __m256i h1, __m256i& lo, __m256i& hi) {
    const __m256i mask = _mm256_set1_epi8(BITS == 5 ? 0x10 : 0x30);
    lo = _mm256_and_si256(bit_at_4<top_lo<BITS, V>()>(h0), mask);
    hi = _mm256_and_si256(bit_at_4<top_hi<BITS, V>()>(BITS == 5 ? h0 : h1), mask);
}

template <int BITS, int V>
__attribute__((target("avx512f,avx512bw"))) inline void top_bits(__m512i h0, __m512i h1, __m512i& lo, __m512i& hi) {
    const __m512i mask = _mm512_set1_epi8(BITS == 5 ? 0x10 : 0x30);
    lo = _mm512_and_si512(bit_at_4<top_lo<BITS, V>()>(h0), mask);
    hi = _mm512_and_si512(bit_at_4<top_hi<BITS, V>()>(BITS == 5 ? h0 : h1), mask);
}

// Vector V of a block: the first and second 16 weights' values, one byte each.
template <int BITS, int V>
__attribute__((target("avx2,fma,f16c")))
inline void high_vectors(const uint8_t* blk, __m256i h0, __m256i h1, __m256i& lo, __m256i& hi) {
    if constexpr (BITS <= 3) {  // p_k's 2 bits at 2V; int3: the top bit from h0's bit V (V + 4) moved to bit 2
        const __m256i two = _mm256_set1_epi8(3);
        lo = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)blk), 2 * V), two);
        hi = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)(blk + 32)), 2 * V), two);
        if constexpr (BITS == 3) {
            const __m256i top = _mm256_set1_epi8(4);
            lo = _mm256_or_si256(lo, _mm256_and_si256(bit_to<2, V>(h0), top));
            hi = _mm256_or_si256(hi, _mm256_and_si256(bit_to<2, V + 4>(h0), top));
        }
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + V * 32));
    __m256i tlo, thi;
    top_bits<BITS, V>(h0, h1, tlo, thi);
    lo = _mm256_or_si256(_mm256_and_si256(raw, low), tlo);
    hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), thi);
}

template <int BITS, int V>
__attribute__((target("avx512f,avx512bw,avx2")))
inline void high_vectors(const uint8_t* b0, const uint8_t* b1, __m512i h0, __m512i h1, __m512i& lo, __m512i& hi) {
    if constexpr (BITS <= 3) {  // as the AVX2 one, two tiles a zmm
        const __m512i two = _mm512_set1_epi8(3);
        const __m512i p0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)b0)),
                                              _mm256_loadu_si256((const __m256i*)b1), 1);
        const __m512i p1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b0 + 32))),
                                              _mm256_loadu_si256((const __m256i*)(b1 + 32)), 1);
        lo = _mm512_and_si512(_mm512_srli_epi16(p0, 2 * V), two);
        hi = _mm512_and_si512(_mm512_srli_epi16(p1, 2 * V), two);
        if constexpr (BITS == 3) {
            const __m512i top = _mm512_set1_epi8(4);
            lo = _mm512_or_si512(lo, _mm512_and_si512(bit_to<2, V>(h0), top));
            hi = _mm512_or_si512(hi, _mm512_and_si512(bit_to<2, V + 4>(h0), top));
        }
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b0 + V * 32))),
                                           _mm256_loadu_si256((const __m256i*)(b1 + V * 32)), 1);
    __m512i tlo, thi;
    top_bits<BITS, V>(h0, h1, tlo, thi);
    lo = _mm512_or_si512(_mm512_and_si512(raw, low), tlo);
    hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), thi);
}

inline __attribute__((target("avx2"))) __m256i load32(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }

template <int BITS, int MT>
__attribute__((target("avx2,fma,f16c")))
void tile_high_rows(const Weights& w, int64_t tile, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    constexpr int64_t BYTES = high_bytes<BITS>();
    const int64_t nb = K / QK;
    const uint8_t* wt = w.q + tile * nb * BYTES;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = wt + b * BYTES;
        const __m256i h0 = BITS == 2 ? _mm256_setzero_si256() : load32(blk + high_at<BITS>()),
                      h1 = BITS == 6 ? load32(blk + 160) : h0;
        __m256i lo[4], hi[4];
        high_vectors<BITS, 0>(blk, h0, h1, lo[0], hi[0]);
        high_vectors<BITS, 1>(blk, h0, h1, lo[1], hi[1]);
        high_vectors<BITS, 2>(blk, h0, h1, lo[2], hi[2]);
        high_vectors<BITS, 3>(blk, h0, h1, lo[3], hi[3]);
        __m256 d8, m8;
        __m256i sc0, sc1, mn0, mn1;
        if constexpr (BITS == 5) {
            tile_scales(w, tile, b, nb, d8, m8);
        } else if constexpr (BITS == 2) {  // a byte per 16 weights: sc | mn << 4
            const uint8_t* s = w.sub + (tile * nb + b) * 16;
            const __m256i r0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)s));
            const __m256i r1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s + 8)));
            sc0 = _mm256_and_si256(r0, _mm256_set1_epi32(15));
            sc1 = _mm256_and_si256(r1, _mm256_set1_epi32(15));
            mn0 = _mm256_srli_epi32(r0, 4);
            mn1 = _mm256_srli_epi32(r1, 4);
            const int64_t at = (tile * (nb / 8) + b / 8) * NR;
            d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.d + at)));
            m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.m + at)));
        } else {
            const uint8_t* s = w.sub + (tile * nb + b) * 16;
            sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)s));
            sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(s + 8)));
            d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.d + (tile * (nb / 8) + b / 8) * NR)));
        }
        for (int i = 0; i < MT; i++) {
            const int8_t* yb = a.q + (r0 + i) * K + b * QK;
            const int64_t at = (r0 + i) * nb + b;
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int v = 0; v < 4; v += 2) {  // two vectors' int16 products: |sum| <= 4 * 63 * 127 < 2^15
                int32_t y[4];
                std::memcpy(&y[0], yb + 4 * v, 8);
                std::memcpy(&y[2], yb + 4 * (v + 4), 8);
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(lo[v], _mm256_set1_epi32(y[0])),
                    _mm256_maddubs_epi16(lo[v + 1], _mm256_set1_epi32(y[1]))), ones));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(hi[v], _mm256_set1_epi32(y[2])),
                    _mm256_maddubs_epi16(hi[v + 1], _mm256_set1_epi32(y[3]))), ones));
            }
            if constexpr (BITS == 5) {
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)),
                                         _mm256_mul_ps(d8, _mm256_set1_ps(a.d[at])), acc[i]);
                acc[i] = _mm256_fmadd_ps(m8, _mm256_set1_ps(a.s[at]), acc[i]);
            } else if constexpr (BITS == 2) {
                // T = sc_0 S_0 + sc_1 S_1 and U = mn_0 X_0 + mn_1 X_1, exact (< 2^24, so as floats too); then
                // acc += T (d dx) - U (dmin dx)
                const int32_t x0 = a.h[at], x1 = a.n[at] - x0;
                const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(sc0, s0), _mm256_mullo_epi32(sc1, s1));
                const __m256i u = _mm256_add_epi32(_mm256_mullo_epi32(mn0, _mm256_set1_epi32(x0)),
                                                   _mm256_mullo_epi32(mn1, _mm256_set1_epi32(x1)));
                const __m256 dx = _mm256_set1_ps(a.d[at]);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d8, dx), acc[i]);
                acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(u), _mm256_mul_ps(m8, dx), acc[i]);
            } else {
                const int32_t x0 = a.h[at], x1 = a.n[at] - x0;
                constexpr int32_t Z = zero_point<BITS>();
                const __m256i t = _mm256_add_epi32(
                    _mm256_mullo_epi32(sc0, _mm256_sub_epi32(s0, _mm256_set1_epi32(Z * x0))),
                    _mm256_mullo_epi32(sc1, _mm256_sub_epi32(s1, _mm256_set1_epi32(Z * x1))));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d8, _mm256_set1_ps(a.d[at])), acc[i]);
            }
        }
    }
    for (int i = 0; i < MT; i++) _mm256_storeu_ps(out + (r0 + i) * N + tile * NR, acc[i]);
}

__attribute__((target("avx512f,avx2"))) inline __m512i load2x32(const uint8_t* p0, const uint8_t* p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p0)),
                              _mm256_loadu_si256((const __m256i*)p1), 1);
}

__attribute__((target("avx512f,avx2"))) inline __m512 join(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

// 8 float16 at p (a tile's rows) and 8 at p + next (the next tile's), as 16 floats.
__attribute__((target("avx512f,avx2,f16c"))) inline __m512 halves16(const uint16_t* p, int64_t next) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
                                                   _mm_loadu_si128((const __m128i*)(p + next)), 1));
}

// Two tiles (16 rows) with VNNI in a zmm, as tile8_pair_vnni. (An odd last tile takes tile_high_rows.)
template <int BITS, int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
void tile_high_pair_vnni(const Weights& w, int64_t tile, const Acts& a, int64_t r0, int64_t K, float* out,
                         int64_t N) {
    constexpr int64_t BYTES = high_bytes<BITS>();
    const int64_t nb = K / QK;
    const uint8_t* w0 = w.q + tile * nb * BYTES;
    const uint8_t* w1 = w0 + nb * BYTES;
    __m512 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* b0 = w0 + b * BYTES;
        const uint8_t* b1 = w1 + b * BYTES;
        const __m512i h0 = BITS == 2 ? _mm512_setzero_si512() : load2x32(b0 + high_at<BITS>(), b1 + high_at<BITS>()),
                      h1 = BITS == 6 ? load2x32(b0 + 160, b1 + 160) : h0;
        __m512i lo[4], hi[4];
        high_vectors<BITS, 0>(b0, b1, h0, h1, lo[0], hi[0]);
        high_vectors<BITS, 1>(b0, b1, h0, h1, lo[1], hi[1]);
        high_vectors<BITS, 2>(b0, b1, h0, h1, lo[2], hi[2]);
        high_vectors<BITS, 3>(b0, b1, h0, h1, lo[3], hi[3]);
        __m512 d16, m16;
        __m512i sc0, sc1;
        __m512 scf0, scf1, mnf0, mnf1;  // int2's scales and mins as floats
        if constexpr (BITS == 5) {
            __m256 da, ma, db, mb;
            tile_scales(w, tile, b, nb, da, ma);
            tile_scales(w, tile + 1, b, nb, db, mb);
            d16 = join(da, db);
            m16 = join(ma, mb);
        } else if constexpr (BITS == 2) {
            const uint8_t* s0p = w.sub + (tile * nb + b) * 16;
            const uint8_t* s1p = s0p + nb * 16;  // the next tile's
            const __m512i r0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)s0p),
                                                                       _mm_loadl_epi64((const __m128i*)s1p)));
            const __m512i r1 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(s0p + 8)),
                                                                       _mm_loadl_epi64((const __m128i*)(s1p + 8))));
            scf0 = _mm512_cvtepi32_ps(_mm512_and_si512(r0, _mm512_set1_epi32(15)));
            scf1 = _mm512_cvtepi32_ps(_mm512_and_si512(r1, _mm512_set1_epi32(15)));
            mnf0 = _mm512_cvtepi32_ps(_mm512_srli_epi32(r0, 4));
            mnf1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(r1, 4));
            const int64_t at = (tile * (nb / 8) + b / 8) * NR, next = (nb / 8) * NR;
            d16 = halves16(w.d + at, next);
            m16 = halves16(w.m + at, next);
        } else {
            const uint8_t* s0p = w.sub + (tile * nb + b) * 16;
            const uint8_t* s1p = s0p + nb * 16;  // the next tile's
            sc0 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
                _mm_loadl_epi64((const __m128i*)s0p), _mm_loadl_epi64((const __m128i*)s1p)))));
            sc1 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
                _mm_loadl_epi64((const __m128i*)(s0p + 8)), _mm_loadl_epi64((const __m128i*)(s1p + 8))))));
            const uint16_t* dp = w.d + (tile * (nb / 8) + b / 8) * NR;
            d16 = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)dp)),
                                                          _mm_loadu_si128((const __m128i*)(dp + (nb / 8) * NR)), 1));
        }
        for (int i = 0; i < MT; i++) {
            typedef int32_t __attribute__((may_alias)) group_t;
            const group_t* y = reinterpret_cast<const group_t*>(a.q + (r0 + i) * K + b * QK);
            const int64_t at = (r0 + i) * nb + b;
            __m512i s_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], _mm512_set1_epi32(y[0]));
            __m512i s_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], _mm512_set1_epi32(y[4]));
            for (int v = 1; v < 4; v++) {
                s_lo = _mm512_dpbusd_epi32(s_lo, lo[v], _mm512_set1_epi32(y[v]));
                s_hi = _mm512_dpbusd_epi32(s_hi, hi[v], _mm512_set1_epi32(y[v + 4]));
            }
            if constexpr (BITS == 5) {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s_lo, s_hi)),
                                         _mm512_mul_ps(d16, _mm512_set1_ps(a.d[at])), acc[i]);
                acc[i] = _mm512_fmadd_ps(m16, _mm512_set1_ps(a.s[at]), acc[i]);
            } else if constexpr (BITS == 2) {  // T and U in float, exact as in the AVX2 loop
                const int32_t x0 = a.h[at], x1 = a.n[at] - x0;
                const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_lo), scf0,
                                                 _mm512_mul_ps(_mm512_cvtepi32_ps(s_hi), scf1));
                const __m512 u = _mm512_fmadd_ps(_mm512_set1_ps((float)x0), mnf0,
                                                 _mm512_mul_ps(_mm512_set1_ps((float)x1), mnf1));
                const __m512 dx = _mm512_set1_ps(a.d[at]);
                acc[i] = _mm512_fmadd_ps(t, _mm512_mul_ps(d16, dx), acc[i]);
                acc[i] = _mm512_fnmadd_ps(u, _mm512_mul_ps(m16, dx), acc[i]);
            } else {
                // T in float: every product and the sum are below 2^24, so exact: the integer T's bits
                const int32_t x0 = a.h[at], x1 = a.n[at] - x0;
                constexpr int32_t Z = zero_point<BITS>();
                const __m512 t = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_sub_epi32(s_lo, _mm512_set1_epi32(Z * x0))), _mm512_castsi512_ps(sc0),
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s_hi, _mm512_set1_epi32(Z * x1))),
                                  _mm512_castsi512_ps(sc1)));
                acc[i] = _mm512_fmadd_ps(t, _mm512_mul_ps(d16, _mm512_set1_ps(a.d[at])), acc[i]);
            }
        }
    }
    for (int i = 0; i < MT; i++) store_pair(out, r0 + i, N, tile, acc[i]);
}

// Row j's weight 4v+e (second: 16+4v+e) of a tiled int2/int3/int5/int6 block, as the vector paths unpack it.
template <int BITS>
inline int high_value(const uint8_t* blk, int at, int v, bool second) {
    if constexpr (BITS == 2) return (blk[32 * second + at] >> (2 * v)) & 3;
    if constexpr (BITS == 3)
        return ((blk[32 * second + at] >> (2 * v)) & 3) | (((blk[64 + at] >> (v + 4 * second)) & 1) << 2);
    const int byte = blk[v * 32 + at];
    const int low = second ? byte >> 4 : byte & 0x0F;
    const int top = BITS == 5 ? (blk[128 + at] >> (v + 4 * second)) & 1 : (blk[128 + 32 * second + at] >> (2 * v)) & 3;
    return low | (top << 4);
}

// Weight row n of the tiled int2/int3/int5/int6 layout, one activation row, portable: the same integer and float steps.
template <int BITS>
float dot_scalar_tiled_high(const Weights& w, int64_t n, const Acts& a, int64_t r, int64_t K) {
    constexpr int64_t BYTES = high_bytes<BITS>();
    const int64_t nb = K / QK, tile = n / NR, j = n % NR;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w.q + (tile * nb + b) * BYTES;
        const int8_t* y = a.q + r * K + b * QK;
        int32_t s0 = 0, s1 = 0;
        for (int v = 0; v < 4; v++)
            for (int e = 0; e < 4; e++) {
                const int at = 4 * (int)j + e;
                s0 += high_value<BITS>(blk, at, v, false) * y[4 * v + e];
                s1 += high_value<BITS>(blk, at, v, true) * y[16 + 4 * v + e];
            }
        const int64_t at = r * nb + b;
        if constexpr (BITS == 5) {
            float d, m;
            tile_scale(w, tile, b, nb, j, d, m);
            acc = std::fma((float)(s0 + s1), d * a.d[at], acc);
            acc = std::fma(m, a.s[at], acc);
        } else if constexpr (BITS == 2) {
            const uint8_t* s = w.sub + (tile * nb + b) * 16;
            const int32_t x0 = a.h[at], x1 = a.n[at] - x0;
            const int32_t t = (s[j] & 15) * s0 + (s[8 + j] & 15) * s1, u = (s[j] >> 4) * x0 + (s[8 + j] >> 4) * x1;
            const int64_t k = (tile * (nb / 8) + b / 8) * NR + j;
            acc = std::fma((float)t, f16_to_f32(w.d[k]) * a.d[at], acc);
            acc = std::fma(-(float)u, f16_to_f32(w.m[k]) * a.d[at], acc);
        } else {
            const int8_t* sc = reinterpret_cast<const int8_t*>(w.sub) + (tile * nb + b) * 16;
            const int32_t x0 = a.h[at], x1 = a.n[at] - x0;
            const int32_t t = sc[j] * (s0 - zero_point<BITS>() * x0) + sc[8 + j] * (s1 - zero_point<BITS>() * x1);
            acc = std::fma((float)t, f16_to_f32(w.d[(tile * (nb / 8) + b / 8) * NR + j]) * a.d[at], acc);
        }
    }
    return acc;
}

// ---------------------------------------------------------------- iq4: 4-bit codes into a table of 16 values
//
// GGUF IQ4_NL and IQ4_XS kept as stored (`tiled`, bits IQ4; brisk.kernels.IQ4): a weight is a scale times
// IQ4_VALUES[q], q a 4-bit code in int4's tile (vector v, row j, byte e: low nibble weight 4v+e, high nibble
// 16+4v+e; the files' nibble order is Q4_0's, so codes move by slicing). Scales:
//   IQ4_NL (`sub` null): `d` [tiles][nb][8] float16 per block of 32: acc = fma(S, d * dx, acc);
//   IQ4_XS (`sub` [tiles][nb][8] int8, the file's 6-bit scale - 32 per 32): `d` [tiles][nb/8][8] float16 per
//     256: T = sc * S, acc = fma(T, d * dx, acc),
// with S the block's integer sum of IQ4_VALUES[q] * y (|S| <= 32 * 127 * 127, |T| < 2^24: exact as floats too).
// AVX2 looks the values up with pshufb and meets them with maddubs' sign trick (|value| and y with the value's
// sign: no value is 0); VNNI takes the values + 128 (unsigned) and subtracts 128 * the block's activation sum.
// 4.5 bits a weight (IQ4_NL, the file's) and 4.3125 (IQ4_XS, against the file's 4.25: its scales held in bytes).

alignas(16) constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// MXFP4 (GGUF MXFP4, gpt-oss's experts; `bits` MXFP4) runs the same loops: its codes are E2M1 values, doubled to
// integers (the OCP MX spec's, as gguf's kvalues), sign in the top bit, in int4's tiles as IQ4_NL's; its scale
// per 32 is one E8M0 byte e (`d` [tiles][nb][8] uint8), worth 2^(e - 127) / 2 for the doubled values: bit for
// bit gguf's e8m0_to_fp32_half (e < 2 are the float's subnormals). 4.25 bits a weight, the file's.
alignas(16) constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <bool E8> constexpr const int8_t* codebook() { return E8 ? MXFP4_VALUES : IQ4_VALUES; }

inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

__attribute__((target("avx2,fma,f16c")))
inline __m256i e8m0_half_bits8(const uint8_t* p) {  // 8 bytes -> e8m0_half of each, as float bits
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e));
}

// A block's 8 row scales (one tile): float16 (iq4) or E8M0 (MXFP4)
template <bool E8>
__attribute__((target("avx2,fma,f16c")))
inline __m256 block_scales8(const uint16_t* d, int64_t at) {
    if constexpr (E8) return _mm256_castsi256_ps(e8m0_half_bits8(reinterpret_cast<const uint8_t*>(d) + at));
    else return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + at)));
}

template <bool E8> inline float block_scale(const uint16_t* d, int64_t at) {
    if constexpr (E8) return e8m0_half(reinterpret_cast<const uint8_t*>(d)[at]);
    else return f16_to_f32(d[at]);
}

template <int MT, bool E8>
__attribute__((target("avx2,fma,f16c")))
void tile_iq4_rows(const Weights& w, int64_t tile, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    const int64_t nb = K / QK;
    const uint8_t* wt = w.q + tile * nb * 128;
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)codebook<E8>()));
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        // One vector of codes at a time, every activation row inside (as tile8_rows): the 16 registers
        // of AVX2 cannot hold a block's 8 value vectors and their magnitudes across the rows.
        __m256i s[MT];
        for (int i = 0; i < MT; i++) s[i] = _mm256_setzero_si256();
        const int8_t* yb = a.q + r0 * K + b * QK;
        for (int v = 0; v < 4; v++) {  // vector v: weights 4v+e (low nibbles) and 16+4v+e (high)
            const __m256i raw = load32(wt + b * 128 + v * 32);
            const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, low));
            const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
            const __m256i lo_mag = _mm256_abs_epi8(lo), hi_mag = _mm256_abs_epi8(hi);
            for (int i = 0; i < MT; i++) {
                int32_t y0, y1;
                std::memcpy(&y0, yb + i * K + 4 * v, 4);
                std::memcpy(&y1, yb + i * K + 16 + 4 * v, 4);
                // a pair of products reaches 2 * 127 * 127: one madd per vector, no shared int16 add
                s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(lo_mag, _mm256_sign_epi8(_mm256_set1_epi32(y0), lo)), ones));
                s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(hi_mag, _mm256_sign_epi8(_mm256_set1_epi32(y1), hi)), ones));
            }
        }
        __m256 d8;
        if (w.sub) {
            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w.sub + (tile * nb + b) * NR)));
            for (int i = 0; i < MT; i++) s[i] = _mm256_mullo_epi32(sc, s[i]);
            d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.d + (tile * (nb / 8) + b / 8) * NR)));
        } else {
            d8 = block_scales8<E8>(w.d, (tile * nb + b) * NR);
        }
        for (int i = 0; i < MT; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(d8, _mm256_set1_ps(a.d[(r0 + i) * nb + b])),
                                     acc[i]);
    }
    for (int i = 0; i < MT; i++) _mm256_storeu_ps(out + (r0 + i) * N + tile * NR, acc[i]);
}

// Two tiles (16 rows) with VNNI in a zmm, as tile8_pair_vnni. (An odd last tile takes tile_iq4_rows.)
template <int MT, bool E8>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
void tile_iq4_pair_vnni(const Weights& w, int64_t tile, const Acts& a, int64_t r0, int64_t K, float* out, int64_t N) {
    const int64_t nb = K / QK;
    const uint8_t* w0 = w.q + tile * nb * 128;
    const uint8_t* w1 = w0 + nb * 128;
    alignas(16) uint8_t shifted[16];  // the values + 128, as vpdpbusd's unsigned operand
    for (int k = 0; k < 16; k++) shifted[k] = static_cast<uint8_t>(codebook<E8>()[k] + 128);
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)shifted));
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i val[8];
        for (int v = 0; v < 4; v++) {
            const __m512i raw = load2x32(w0 + b * 128 + v * 32, w1 + b * 128 + v * 32);
            val[v] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, low));
            val[v + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
        }
        __m512 scf = _mm512_setzero_ps(), d16;
        if (w.sub) {
            const uint8_t* s0p = w.sub + (tile * nb + b) * NR;
            scf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
                _mm_loadl_epi64((const __m128i*)s0p), _mm_loadl_epi64((const __m128i*)(s0p + nb * NR)))));
            const uint16_t* dp = w.d + (tile * (nb / 8) + b / 8) * NR;
            d16 = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)dp)),
                                                          _mm_loadu_si128((const __m128i*)(dp + (nb / 8) * NR)), 1));
        } else if constexpr (E8) {
            const int64_t at = (tile * nb + b) * NR;
            d16 = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(e8m0_half_bits8(
                reinterpret_cast<const uint8_t*>(w.d) + at)), e8m0_half_bits8(reinterpret_cast<const uint8_t*>(w.d) + at + nb * NR), 1));
        } else {
            const uint16_t* dp = w.d + (tile * nb + b) * NR;
            d16 = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)dp)),
                                                          _mm_loadu_si128((const __m128i*)(dp + nb * NR)), 1));
        }
        for (int i = 0; i < MT; i++) {
            typedef int32_t __attribute__((may_alias)) group_t;
            const group_t* y = reinterpret_cast<const group_t*>(a.q + (r0 + i) * K + b * QK);
            const int64_t at = (r0 + i) * nb + b;
            __m512i s = _mm512_set1_epi32(-128 * a.n[at]);
            for (int v = 0; v < 8; v++) s = _mm512_dpbusd_epi32(s, val[v], _mm512_set1_epi32(y[v]));
            __m512 t = _mm512_cvtepi32_ps(s);
            if (w.sub) t = _mm512_mul_ps(t, scf);  // exact: |T| < 2^24
            acc[i] = _mm512_fmadd_ps(t, _mm512_mul_ps(d16, _mm512_set1_ps(a.d[at])), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) store_pair(out, r0 + i, N, tile, acc[i]);
}

// Weight row n of the tiled iq4 layout, one activation row, portable: the same integer and float steps.
template <bool E8>
float dot_scalar_tiled_iq4(const Weights& w, int64_t n, const Acts& a, int64_t r, int64_t K) {
    const int8_t* values = codebook<E8>();
    const int64_t nb = K / QK, tile = n / NR, j = n % NR;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = w.q + (tile * nb + b) * 128;
        const int8_t* y = a.q + r * K + b * QK;
        int32_t s = 0;
        for (int v = 0; v < 4; v++)
            for (int e = 0; e < 4; e++) {
                const int byte = blk[v * 32 + 4 * j + e];
                s += values[byte & 0x0F] * y[4 * v + e] + values[byte >> 4] * y[16 + 4 * v + e];
            }
        float d;
        if (w.sub) {
            s *= reinterpret_cast<const int8_t*>(w.sub)[(tile * nb + b) * NR + j];
            d = f16_to_f32(w.d[(tile * (nb / 8) + b / 8) * NR + j]);
        } else {
            d = block_scale<E8>(w.d, (tile * nb + b) * NR + j);
        }
        acc = std::fma((float)s, d * a.d[r * nb + b], acc);
    }
    return acc;
}

// Rows r..r+MT-1 against weight rows [n_begin, n_end).
template <int MT>
__attribute__((target("avx2,fma,f16c")))
void rows_avx2(const Weights& w, const Acts& a, int64_t r, int64_t n_begin, int64_t n_end, int64_t K, float* out,
               int64_t N) {
    // NOTE: the same number of accumulators for every tile height, so a row's sum is taken in
    // the same order whatever the batch around it (greedy output must not depend on the batch).
    for (int64_t n = n_begin; n < n_end; n++) {
        if (w.bits == 4) dot_pairs_int4<MT, 1>(w, n, a, r, K, out, N);
        else dot_rows_avx2<MT, 2>(w, n, a, r, K, out, N);
    }
}

// 0 scalar, 2 AVX2, 3 AVX2 + AVX-512 VNNI for the tiled int4 kernel
int detected_isa() {
    static const int isa = !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                             __builtin_cpu_supports("f16c")) ? 0
        : __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") ? 3 : 2;
    return isa;
}

int forced_isa = -1;  // -1: the best the CPU has; tests pin a lower path on any CPU

int kernel_isa() { return forced_isa >= 0 ? std::min(forced_isa, detected_isa()) : detected_isa(); }

bool has_avx2() { return kernel_isa() >= 2; }

constexpr int64_t ROWS_PER_TASK = 8;  // weight rows a thread takes at a time (stay in L1/L2 across row tiles)
constexpr int MT = 4;                 // activation rows per register tile

// The kernels of a tiled layout whose tile pairs take VNNI at every row count (no nibbles to
// unpack, or few enough that the pair pays from one row on): int8, int6, int5, int3 and int2.
// The int3, int2 and iq4 pair loops (GGUF Q3_K, Q2_K, IQ4_NL/IQ4_XS) were written on an AVX2-only host
// and took the AVX2 loops until they had run their tests on a VNNI host: they did on a 2-core AVX-512
// VNNI host (tests/test_quant.py: VNNI forced, bit for bit against AVX2 and the portable loop), where
// they ran 1.2-1.5x the AVX2 loops' speed at one row and 1.8-2.5x at 16-64 (one 14336 x 4096 matrix,
// benchmarks/gguf_type_kernels.py --baseline-lib).
struct Int8Tiles {
    template <int MT> static void pair(const Weights& w, int64_t t, const Acts& a, int64_t r, int64_t K, float* out,
                                       int64_t N) { tile8_pair_vnni<MT>(w, t, a, r, K, out, N); }
    template <int MT> static void one(const Weights& w, int64_t t, const Acts& a, int64_t r, int64_t K, float* out,
                                      int64_t N) { tile8_rows<MT>(w, t, a, r, K, out, N); }
    static float scalar(const Weights& w, int64_t n, const Acts& a, int64_t r, int64_t K) {
        return dot_scalar_tiled8(w, n, a, r, K);
    }
};

template <int BITS>
struct HighTiles {  // int2, int3, int5 and int6
    template <int MT> static void pair(const Weights& w, int64_t t, const Acts& a, int64_t r, int64_t K, float* out,
                                       int64_t N) { tile_high_pair_vnni<BITS, MT>(w, t, a, r, K, out, N); }
    template <int MT> static void one(const Weights& w, int64_t t, const Acts& a, int64_t r, int64_t K, float* out,
                                      int64_t N) { tile_high_rows<BITS, MT>(w, t, a, r, K, out, N); }
    static float scalar(const Weights& w, int64_t n, const Acts& a, int64_t r, int64_t K) {
        return dot_scalar_tiled_high<BITS>(w, n, a, r, K);
    }
};

template <bool E8>
struct CodebookTiles {  // iq4 (E8 false) and MXFP4
    template <int MT> static void pair(const Weights& w, int64_t t, const Acts& a, int64_t r, int64_t K, float* out,
                                       int64_t N) { tile_iq4_pair_vnni<MT, E8>(w, t, a, r, K, out, N); }
    template <int MT> static void one(const Weights& w, int64_t t, const Acts& a, int64_t r, int64_t K, float* out,
                                      int64_t N) { tile_iq4_rows<MT, E8>(w, t, a, r, K, out, N); }
    static float scalar(const Weights& w, int64_t n, const Acts& a, int64_t r, int64_t K) {
        return dot_scalar_tiled_iq4<E8>(w, n, a, r, K);
    }
};
using IQ4Tiles = CodebookTiles<false>;
using MXFP4Tiles = CodebookTiles<true>;

// Tile pairs with VNNI (an odd last tile alone, the same bits), else one tile at a time, else portable.
template <class L>
void matmul_tiles(const Weights& w, const Acts& a, int64_t M, int64_t N, int64_t K, float* out) {
    const int isa = kernel_isa();
    const int64_t tiles = N / NR;
    if (isa >= 3) {
        const int64_t pairs = (tiles + 1) / 2;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t t = 2 * p;
            int64_t r = 0;
            if (t + 1 < tiles) {
                for (; r + 4 <= M; r += 4) L::template pair<4>(w, t, a, r, K, out, N);
                for (; r < M; r++) L::template pair<1>(w, t, a, r, K, out, N);
            } else {
                for (; r + 4 <= M; r += 4) L::template one<4>(w, t, a, r, K, out, N);
                for (; r < M; r++) L::template one<1>(w, t, a, r, K, out, N);
            }
        }
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        if (isa >= 2) {
            int64_t r = 0;
            for (; r + 4 <= M; r += 4) L::template one<4>(w, t, a, r, K, out, N);
            for (; r < M; r++) L::template one<1>(w, t, a, r, K, out, N);
        } else {
            for (int64_t n = t * NR; n < (t + 1) * NR; n++)
                for (int64_t r = 0; r < M; r++) out[r * N + n] = L::scalar(w, n, a, r, K);
        }
    }
}

void matmul(const Weights& w, const Acts& a, int64_t M, int64_t N, int64_t K, float* out) {
    if (w.tiled && w.bits == 8) return matmul_tiles<Int8Tiles>(w, a, M, N, K, out);
    if (w.tiled && w.bits == 6) return matmul_tiles<HighTiles<6>>(w, a, M, N, K, out);
    if (w.tiled && w.bits == 5) return matmul_tiles<HighTiles<5>>(w, a, M, N, K, out);
    if (w.tiled && w.bits == 3) return matmul_tiles<HighTiles<3>>(w, a, M, N, K, out);
    if (w.tiled && w.bits == 2) return matmul_tiles<HighTiles<2>>(w, a, M, N, K, out);
    if (w.tiled && w.bits == IQ4) return matmul_tiles<IQ4Tiles>(w, a, M, N, K, out);
    if (w.tiled && w.bits == MXFP4) return matmul_tiles<MXFP4Tiles>(w, a, M, N, K, out);
    const bool avx2 = has_avx2(), vnni = kernel_isa() >= 3;
    // From 8 activation rows on, tiles two at a time (an odd last tile alone); below, the pair's
    // unpacking is not paid back (one TinyLlama layer's linears, same run: the pair loop 2.04x the
    // AVX2 loop at 16 rows and 1.75x at 8, the one-tile loop 1.57x and 1.55x; at 1 row 0.77x
    // against 1.13x). Both give the same bits, so the choice cannot change a row's result.
    if (w.tiled && vnni && M >= 8) {
        const int64_t tiles = N / NR, pairs = (tiles + 1) / 2;
#pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t t = 2 * p;
            int64_t r = 0;
            if (t + 1 < tiles) {
                for (; r + 4 <= M; r += 4) tile_pair_vnni<4>(w, t, a, r, K, out, N);
                for (; r < M; r++) tile_pair_vnni<1>(w, t, a, r, K, out, N);
            } else {
                for (; r + 4 <= M; r += 4) tile_rows_vnni<4>(w, t, a, r, K, out, N);
                for (; r < M; r++) tile_rows_vnni<1>(w, t, a, r, K, out, N);
            }
        }
        return;
    }
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n_end = std::min(N, (t + 1) * ROWS_PER_TASK);
        const int64_t n_begin = t * ROWS_PER_TASK;
        if (w.tiled) {  // ROWS_PER_TASK == NR: one tile
            if (vnni) {
                int64_t r = 0;
                for (; r + 4 <= M; r += 4) tile_rows_vnni<4>(w, t, a, r, K, out, N);
                for (; r < M; r++) tile_rows_vnni<1>(w, t, a, r, K, out, N);
            } else if (avx2) {
                int64_t r = 0;
                for (; r + 4 <= M; r += 4) tile_rows<4>(w, t, a, r, K, out, N);
                for (; r < M; r++) tile_rows<1>(w, t, a, r, K, out, N);
            } else {
                for (int64_t n = n_begin; n < n_end; n++)
                    for (int64_t r = 0; r < M; r++) out[r * N + n] = dot_scalar_tiled(w, n, a, r, K);
            }
            continue;
        }
        for (int64_t r = 0; r < M;) {
            const int64_t mt = std::min<int64_t>(M - r, MT);
            if (!avx2) {
                for (int64_t n = n_begin; n < n_end; n++)
                    for (int64_t i = 0; i < mt; i++) out[(r + i) * N + n] = dot_scalar(w, n, a, r + i, K);
            } else if (mt == 4) {
                rows_avx2<4>(w, a, r, n_begin, n_end, K, out, N);
            } else if (mt == 3) {
                rows_avx2<3>(w, a, r, n_begin, n_end, K, out, N);
            } else if (mt == 2) {
                rows_avx2<2>(w, a, r, n_begin, n_end, K, out, N);
            } else {
                rows_avx2<1>(w, a, r, n_begin, n_end, K, out, N);
            }
            r += mt;
        }
    }
}

// ---------------------------------------------------------------- mixtures of experts
// Several experts' tiled weights over one batch of activation rows grouped by expert (rows
// off[e] .. off[e + 1] - 1 go through expert e): one parallel pass over every (expert, tile) item, so each
// expert's weights are read once for all the rows that chose it (llama.cpp's mul_mat_id), in one call and one
// OpenMP region per projection instead of one per expert. Each row gets the bits matmul() gives it alone.

struct Int4Tiles {  // int4 (GGUF Q4_0, Q4_1, Q4_K): tile_pair_vnni / tile_rows_vnni / tile_rows, as matmul() picks
    template <int MT> static void pair(const Weights& w, int64_t t, const Acts& a, int64_t r, int64_t K, float* out,
                                       int64_t N) { tile_pair_vnni<MT>(w, t, a, r, K, out, N); }
    template <int MT> static void one(const Weights& w, int64_t t, const Acts& a, int64_t r, int64_t K, float* out,
                                      int64_t N) {
        if (kernel_isa() >= 3) tile_rows_vnni<MT>(w, t, a, r, K, out, N);
        else tile_rows<MT>(w, t, a, r, K, out, N);
    }
    static float scalar(const Weights& w, int64_t n, const Acts& a, int64_t r, int64_t K) {
        return dot_scalar_tiled(w, n, a, r, K);
    }
    static constexpr int64_t PAIR_ROWS = 8;  // below, one tile at a time is faster (matmul()'s measurements)
};

template <class L>  // the other tiled types take tile pairs at any row count on VNNI (matmul_tiles)
constexpr int64_t pair_rows() {
    if constexpr (std::is_same<L, Int4Tiles>::value) return Int4Tiles::PAIR_ROWS;
    else return 0;
}

template <class L>
void expert_rows(const Weights& w, int64_t t, bool pair, const Acts& a, int64_t r0, int64_t r1, int64_t K,
                 float* out, int64_t N) {
    int64_t r = r0;
    if (pair) {
        for (; r + 4 <= r1; r += 4) L::template pair<4>(w, t, a, r, K, out, N);
        for (; r < r1; r++) L::template pair<1>(w, t, a, r, K, out, N);
    } else {
        for (; r + 4 <= r1; r += 4) L::template one<4>(w, t, a, r, K, out, N);
        for (; r < r1; r++) L::template one<1>(w, t, a, r, K, out, N);
    }
}

template <class L>
void matmul_experts(const Weights* ws, const int64_t* off, int64_t E, const Acts& a, int64_t N, int64_t K,
                    float* out) {
    const int isa = kernel_isa();
    const int64_t tiles = N / NR;
    if (isa >= 3) {  // tile pairs (an odd last tile alone: the same bits)
        const int64_t pairs = (tiles + 1) / 2;
#pragma omp parallel for schedule(static)
        for (int64_t item = 0; item < E * pairs * 2; item++) {
            const int64_t e = item / (pairs * 2), within = item % (pairs * 2);
            const bool paired_expert = off[e + 1] - off[e] >= pair_rows<L>();
            if (paired_expert) {
                if (within % 2) continue;  // one item a pair
                const int64_t t = within;
                expert_rows<L>(ws[e], t, t + 1 < tiles, a, off[e], off[e + 1], K, out, N);
            } else if (within < tiles) {
                expert_rows<L>(ws[e], within, false, a, off[e], off[e + 1], K, out, N);
            }
        }
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < E * tiles; item++) {
        const int64_t e = item / tiles, t = item % tiles;
        if (isa >= 2) {
            expert_rows<L>(ws[e], t, false, a, off[e], off[e + 1], K, out, N);
        } else {
            for (int64_t n = t * NR; n < (t + 1) * NR; n++)
                for (int64_t r = off[e]; r < off[e + 1]; r++) out[r * N + n] = L::scalar(ws[e], n, a, r, K);
        }
    }
}

void matmul_experts_any(const Weights* ws, const int64_t* off, int64_t E, const Acts& a, int64_t N, int64_t K,
                        float* out) {
    switch (ws[0].bits) {
        case 8: return matmul_experts<Int8Tiles>(ws, off, E, a, N, K, out);
        case 6: return matmul_experts<HighTiles<6>>(ws, off, E, a, N, K, out);
        case 5: return matmul_experts<HighTiles<5>>(ws, off, E, a, N, K, out);
        case 3: return matmul_experts<HighTiles<3>>(ws, off, E, a, N, K, out);
        case 2: return matmul_experts<HighTiles<2>>(ws, off, E, a, N, K, out);
        case IQ4: return matmul_experts<IQ4Tiles>(ws, off, E, a, N, K, out);
        case MXFP4: return matmul_experts<MXFP4Tiles>(ws, off, E, a, N, K, out);
        default: return matmul_experts<Int4Tiles>(ws, off, E, a, N, K, out);
    }
}

// `paired`: the AVX2 int4 layout (whole pairs of blocks interleaved; an odd last block as is).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs, int32_t* xn, int32_t* xh,
                   bool paired) {
    const bool avx2 = has_avx2();
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t r = 0; r < M; r++) {
        if (avx2)
            quantize_rows_avx2(x + r * K, 1, K, xq + r * K, xd + r * nb, xs + r * nb, xn + r * nb, xh + r * nb, paired);
        else
            quantize_rows_scalar(x + r * K, 1, K, xq + r * K, xd + r * nb, xs + r * nb, xn + r * nb, xh + r * nb);
    }
}

}  // namespace

extern "C" {

// out [M, N] = x [M, K] . W^T, quantizing x into the caller's scratch buffers first.
void brisk_quant_matmul(const float* x, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
                        const uint8_t* wsub, int bits, int tiled, int64_t M, int64_t N, int64_t K, int8_t* xq,
                        float* xd, float* xs, int32_t* xn, float* out) {
    int32_t* xh = xn + M * (K / QK);
    quantize_rows(x, M, K, xq, xd, xs, xn, xh, bits == 4 && !tiled && has_avx2());
    const Weights w{wq, wd, wm, bits, tiled != 0, tiled && bits != 8 ? wsub : nullptr};
    const Acts a{xq, xd, xs, xn, xh};
    matmul(w, a, M, N, K, out);
}

int brisk_quant_matmul_experts(const float* x, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
                               const uint8_t* wsub, int64_t q_stride, int64_t d_stride, int64_t m_stride,
                               int64_t sub_stride, const int64_t* experts, const int64_t* offsets, int64_t E, int bits,
                               int64_t N, int64_t K, int8_t* xq, float* xd, float* xs, int32_t* xn, float* out) {
    if (N % NR || K % QK || E <= 0) return 1;
    const int64_t rows = offsets[E];
    int32_t* xh = xn + rows * (K / QK);
    quantize_rows(x, rows, K, xq, xd, xs, xn, xh, false);
    std::vector<Weights> ws(E);
    for (int64_t e = 0; e < E; e++) {
        const int64_t id = experts[e];
        ws[e] = Weights{wq + id * q_stride, reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(wd) + id * d_stride),
                        wm ? reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(wm) + id * m_stride) : nullptr,
                        bits, true, bits != 8 && wsub ? wsub + id * sub_stride : nullptr};
    }
    const Acts a{xq, xd, xs, xn, xh};
    matmul_experts_any(ws.data(), offsets, E, a, N, K, out);
    return 0;
}

int brisk_kernels_isa() { return kernel_isa(); }

// -1: the best path this CPU has; else at most 0 scalar, 2 AVX2, 3 AVX-512 VNNI (tests pin a path)
void brisk_kernels_force_isa(int isa) { forced_isa = isa; }

}  // extern "C"
