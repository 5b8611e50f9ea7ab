// 16-bit floats widened to float32 in registers, shared by the paged attention kernel (bfloat16 and
// float16 KV, paged_attention.cpp) and the 16-bit weight matmuls (half_matmul.cpp): bfloat16 is a
// zero-extend and a shift (exact), float16 is vcvtph2ps (exact). Each translation unit gets its
// own inline copy.
#pragma once

#include <immintrin.h>

#include "kv_types.h"

#define BRISK_WIDEN_AVX2_TARGET "avx2,fma,f16c"
#define BRISK_WIDEN_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define BRISK_WIDEN_AVX2 __attribute__((target(BRISK_WIDEN_AVX2_TARGET), always_inline)) inline
#define BRISK_WIDEN_AVX512 __attribute__((target(BRISK_WIDEN_AVX512_TARGET), always_inline)) inline

namespace widen {

BRISK_WIDEN_AVX2 __m256 bf16x8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
BRISK_WIDEN_AVX2 __m256 f16x8(__m128i h) { return _mm256_cvtph_ps(h); }

BRISK_WIDEN_AVX512 __m512 bf16x16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
BRISK_WIDEN_AVX512 __m512 f16x16(__m256i h) { return _mm512_cvtph_ps(h); }

BRISK_WIDEN_AVX2 __m128i load128(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
BRISK_WIDEN_AVX512 __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 / 16 consecutive elements as float32, by element type
BRISK_WIDEN_AVX2 __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
BRISK_WIDEN_AVX2 __m256 load8(const kvt::bf16_t* p) { return bf16x8(load128(p)); }
BRISK_WIDEN_AVX2 __m256 load8(const kvt::f16_t* p) { return f16x8(load128(p)); }
BRISK_WIDEN_AVX512 __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
BRISK_WIDEN_AVX512 __m512 load16(const kvt::bf16_t* p) { return bf16x16(load256(p)); }
BRISK_WIDEN_AVX512 __m512 load16(const kvt::f16_t* p) { return f16x16(load256(p)); }

}  // namespace widen
