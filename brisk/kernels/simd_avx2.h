// AVX2 + FMA helpers shared by brisk's kernels (each translation unit gets its own inline copy).
#pragma once

#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

// exp(x) for x <= 0 (scores minus their running max), 8 lanes: x = n ln2 + r with |r| <= ln2/2,
// e^r by a degree-6 polynomial (relative error < 2e-7), 2^n through the exponent bits; below -87
// (and for -inf) the result is 0.
AVX2 __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.f);
    const __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

