// The small per-layer operations of a Llama decoder step, one call each instead of a chain of
// PyTorch ops: at one decode row these are a few hundred floats, and PyTorch's per-op dispatch
// (RMSNorm alone is ~6 ops, ~50 us a call on this project's CPUs) costs more than the math.
//   brisk_rms_norm     out = w * r / sqrt(mean(r^2) + eps), where r = x, or r = residual += x
//                      (the residual add fused in front of the norm, as vLLM's fused_add_rms_norm)
//   brisk_silu_mul     out = silu(gate) * up, gate_up = [gate | up] per row
//   brisk_rope         rotate-half RoPE in place on the q and k heads of a row (HF's layout)
//   brisk_store_kv     this step's K/V rows into their cache slots, converted to the cache's element
//                      type (kv_types.h: float32, bfloat16, float16, fp8 e4m3/e5m2, scaled int8)
// float32 only; PyTorch runs the same math elsewhere (brisk/models/fused.py holds both, and the
// tests hold these to it). Each row is computed by one thread with the same code whatever the
// number of rows, so a row's result does not depend on the batch.
// Built with the other kernels into _kernels.so; `target_clones` compiles an AVX2 version
// beside the baseline one and the loader picks it on CPUs that have it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>

#include "simd_avx2.h"
#include "brisk_abi.h"
#include "kv_types.h"

namespace {

constexpr int LANES = 16;  // independent partial sums: the compiler vectorizes them without -ffast-math

// Rows are spread over threads only when there is enough work to pay for waking them.
constexpr int64_t PARALLEL_MIN_ELEMS = 1 << 15;

#define CLONES __attribute__((target_clones("avx2", "default")))

CLONES void rms_norm_rows(const float* x, float* residual, const float* w, float* out, int64_t rows,
                          int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float* src = x + r * dim;
        float* o = out + r * dim;
        const float* v = src;
        if (residual) {
            float* res = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) res[i] += src[i];
            v = res;
        }
        float acc[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += v[i + j] * v[i + j];
        float sum = 0.f;
        for (; i < dim; i++) sum += v[i] * v[i];
        for (int j = 0; j < LANES; j++) sum += acc[j];
        const float inv = 1.f / std::sqrt(sum / (float)dim + eps);
        for (int64_t k = 0; k < dim; k++) o[k] = w[k] * (v[k] * inv);
    }
}

// silu(g) * u = g / (1 + e^-g) * u. AVX2: exp8 (simd_avx2.h), e^-g clamped at e^88 (where the
// quotient is 0 to float precision anyway); elsewhere libm's expf.
__attribute__((target("avx2,fma"))) void silu_mul_row_avx2(const float* g, const float* u, float* o, int64_t n) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.f), hi = _mm256_set1_ps(88.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), hi));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

bool cpu_has_avx2() {
    static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return yes;
}

void silu_mul_rows(const float* gate_up, float* out, int64_t rows, int64_t inter) {
    const bool avx2 = cpu_has_avx2();
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        if (avx2) {
            silu_mul_row_avx2(g, u, o, inter);
        } else {
            for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
        }
    }
}

CLONES void rope_rows(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t rows,
                      int64_t heads, int64_t head_dim, int64_t rot_dim) {
    const int64_t half = rot_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * rot_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float* c = cos + r * half;
        const float* s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float* p = x + r * row_stride + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = p[i], x2 = p[half + i];
                const float a = x1 * c[i], b = x2 * s[i], d = x2 * c[i], e = x1 * s[i];
                p[i] = a - b;
                p[half + i] = d + e;
            }
        }
    }
}

template <typename T, T (*Convert)(float)>
void convert_row(const float* s, void* cache, int64_t slot, int64_t width) {
    T* d = static_cast<T*>(cache) + slot * width;
    for (int64_t i = 0; i < width; i++) d[i] = Convert(s[i]);
}

// one (token, head) row of int8: scale = max |x| / 127, q = round-half-even(x / scale) (all zeros:
// scale 0, q 0); division, not a reciprocal multiply, so that torch's x / scale gives the same q
void int8_row(const float* s, int8_t* d, float* scale, int64_t dim) {
    float amax = 0.f;
    for (int64_t i = 0; i < dim; i++) amax = std::max(amax, std::fabs(s[i]));
    const float sc = amax / 127.f;
    *scale = sc;
    for (int64_t i = 0; i < dim; i++) {
        const float q = sc > 0.f ? std::nearbyint(s[i] / sc) : 0.f;
        d[i] = (int8_t)std::min(127.f, std::max(-127.f, q));
    }
}

void store_rows(const float* src, int64_t src_stride, const int64_t* slots, void* cache, float* scales,
                int kv_dtype, int64_t rows, int64_t kv_heads, int64_t head_dim) {
    const int64_t width = kv_heads * head_dim;
    for (int64_t r = 0; r < rows; r++) {
        const float* s = src + r * src_stride;
        switch (kv_dtype) {
            case kvt::F32: std::memcpy((float*)cache + slots[r] * width, s, width * sizeof(float)); break;
            case kvt::BF16: convert_row<uint16_t, kvt::f32_to_bf16>(s, cache, slots[r], width); break;
            case kvt::F16: convert_row<uint16_t, kvt::f32_to_f16>(s, cache, slots[r], width); break;
            case kvt::E4M3: convert_row<uint8_t, kvt::f32_to_e4m3>(s, cache, slots[r], width); break;
            case kvt::E5M2: convert_row<uint8_t, kvt::f32_to_e5m2>(s, cache, slots[r], width); break;
            case kvt::I8:
                for (int64_t h = 0; h < kv_heads; h++)
                    int8_row(s + h * head_dim, (int8_t*)cache + slots[r] * width + h * head_dim,
                             scales + slots[r] * kv_heads + h, head_dim);
                break;
        }
    }
}

}  // namespace

extern "C" {

// x, out: [rows, dim]; residual: [rows, dim] or null; w: [dim]. out may not alias x or residual.
void brisk_rms_norm(const float* x, float* residual, const float* w, float* out, int64_t rows, int64_t dim,
                    float eps) {
    rms_norm_rows(x, residual, w, out, rows, dim, eps);
}

// gate_up: [rows, 2 * inter]; out: [rows, inter].
void brisk_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
    silu_mul_rows(gate_up, out, rows, inter);
}

// x: row r's heads start at x + r * row_stride, `heads` heads of head_dim, the first rot_dim
// of each rotated; cos, sin: [rows, rot_dim / 2] for each row's position.
void brisk_rope(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t rows, int64_t heads,
                int64_t head_dim, int64_t rot_dim) {
    rope_rows(x, row_stride, cos, sin, rows, heads, head_dim, rot_dim);
}

// k, v: row r at k + r * src_stride ([width] floats); slots: [rows] int64;
// k_cache, v_cache: [slots, kv_heads * head_dim] of the kv_dtype (kv_types.h), converted on the way
// in; k_scale, v_scale: int8 only, [slots, kv_heads] (null otherwise).
void brisk_store_kv(const float* k, const float* v, int64_t src_stride, const int64_t* slots, void* k_cache,
                    void* v_cache, float* k_scale, float* v_scale, int kv_dtype, int64_t rows, int64_t kv_heads,
                    int64_t head_dim) {
    store_rows(k, src_stride, slots, k_cache, k_scale, kv_dtype, rows, kv_heads, head_dim);
    store_rows(v, src_stride, slots, v_cache, v_scale, kv_dtype, rows, kv_heads, head_dim);
}

}  // extern "C"
