// Paged decode attention for brisk's CPU path: one query token per sequence attends to its
// whole context through the sequence's block table, reading K/V where they lie in the cache
// (no gathered copy of the context, unlike the torch reference in brisk/engine/attention.py).
//
// Layout (what brisk.engine.attention.PagedKVCache holds per layer):
//   k_cache, v_cache  [num_slots, num_kv_heads, head_dim], float32 or bfloat16; slot = block * bs + offset
//   q                 [rows, num_heads, head_dim] float32
//   block_tables      [rows, max_blocks] int32; context_lens [rows] int32 (>= 1)
//   out               [rows, num_heads * head_dim] float32
// GQA: query head h reads kv head h / (num_heads / num_kv_heads), as SDPA's enable_gqa does.
//
// Work is split into items (row, part of its context): an item walks its positions in runs of
// contiguous slots (within one block), reads each slot's K/V for all heads together (one
// contiguous span of memory), and keeps an online softmax per query head (running max m, sum l,
// weighted V sum); the parts of a row are then merged ("flash decoding"). Splitting the context
// keeps every core busy when few rows are long.
//
// Plain C ABI, loaded with ctypes (brisk/kernels/__init__.py). An AVX-512 item loop (head_dim a
// multiple of 16) or an AVX2+FMA one (a multiple of 8) is picked at run time; other CPUs and shapes
// take the portable loop.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include <immintrin.h>
#include <omp.h>

#include "simd_avx2.h"
#include "brisk_abi.h"

namespace {

constexpr int CHUNK = 32;      // tokens scored at once (at most one block's run of contiguous slots)
constexpr int MAX_HEADS = 128;  // query heads
constexpr int MAX_DIM = 256;

struct Args {
    const float* q;
    const void* k_cache;
    const void* v_cache;
    const int32_t* block_tables;
    const int32_t* context_lens;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    float softcap;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2's soft-capping)
};

// Gemma 2's soft-capped scores, on the n scores of a run (the lanes past it stay -inf)
inline void cap_scores(const Args& a, float* s, int64_t n) {
    if (a.softcap > 0.f)
        for (int64_t t = 0; t < n; t++) s[t] = a.softcap * std::tanh(s[t] / a.softcap);
}

inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

template <typename KV>
__attribute__((always_inline)) inline void load_row(const KV* src, float* dst, int64_t d);

template <>
__attribute__((always_inline)) inline void load_row<float>(const float* src, float* dst, int64_t d) {
    std::memcpy(dst, src, d * sizeof(float));
}

template <>
__attribute__((always_inline)) inline void load_row<uint16_t>(const uint16_t* src, float* dst, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
}

// A row's attention is kept as un-normalised state: acc [H, D], m [H] (running max), l [H] (sum).
// prep_* scales the row's query into qs [H, D] and clears the state; chunk_* folds in one run of
// n contiguous slots from `slot` (at most CHUNK, within one block). A row's result depends only on
// its query and the runs it is given: whether it is processed alone (a decode row) or in a tile
// with the rows after it (a prompt chunk), the same calls on the same data give the same bits.
// Portable versions: plain loops (what CPUs without AVX2 run, and the model for the others).
void prep_portable(const Args& a, int64_t row, float* qs, float* acc, float* m, float* l) {
    const int64_t D = a.head_dim, H = a.num_heads;
    const float* q = a.q + row * H * D;
    for (int64_t g = 0; g < H; g++) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        for (int64_t d = 0; d < D; d++) {
            acc[g * D + d] = 0.f;
            qs[g * D + d] = q[g * D + d] * a.scale;
        }
    }
}

struct NextRunPrefetch;

template <typename KV>
void chunk_portable(const Args& a, const float* qs, float* acc, float* m, float* l, int64_t slot, int64_t n,
                    NextRunPrefetch&) {
    const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, H = a.num_heads;
    const int64_t stride = a.num_kv_heads * D;  // elements between consecutive slots
    const KV* kc = static_cast<const KV*>(a.k_cache);
    const KV* vc = static_cast<const KV*>(a.v_cache);
    float row_buf[MAX_DIM], s[MAX_HEADS][CHUNK];
    for (int64_t t = 0; t < n; t++) {
        for (int64_t g = 0; g < H; g++) {
            if (g % G == 0) load_row<KV>(kc + (slot + t) * stride + (g / G) * D, row_buf, D);
            float dot = 0.f;
            for (int64_t d = 0; d < D; d++) dot += qs[g * D + d] * row_buf[d];
            s[g][t] = dot;
        }
    }
    for (int64_t g = 0; g < H; g++) cap_scores(a, s[g], n);
    for (int64_t g = 0; g < H; g++) {
        float mx = m[g];
        for (int64_t t = 0; t < n; t++) mx = std::max(mx, s[g][t]);
        const float corr = std::exp(m[g] - mx);  // 0 on the first chunk (m = -inf)
        float sum = 0.f;
        for (int64_t t = 0; t < n; t++) {
            s[g][t] = std::exp(s[g][t] - mx);
            sum += s[g][t];
        }
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        for (int64_t d = 0; d < D; d++) acc[g * D + d] *= corr;
    }
    for (int64_t t = 0; t < n; t++) {
        for (int64_t g = 0; g < H; g++) {
            if (g % G == 0) load_row<KV>(vc + (slot + t) * stride + (g / G) * D, row_buf, D);
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += s[g][t] * row_buf[d];
        }
    }
}

// The next run's K/V lines (another block, somewhere else in the pool), prefetched a few at a time
// through this run's work: k_step() once per score group, v_step() once per head's V pass. The
// reads then overlap the math; one burst of every line at the start of a run overflows the core's
// outstanding-miss slots (a burst measured 10.3 ms per layer at 64 rows x 2,000 tokens where
// spreading it measured 7.3 ms, benchmarks/decode_attention.py).
struct NextRunPrefetch {
    const char* k = nullptr;
    const char* v = nullptr;
    int64_t lines = 0, k_done = 0, v_done = 0, k_per = 1, v_per = 1;

    NextRunPrefetch() = default;  // prefetches nothing (a tile's later rows: the first row's runs did)

    template <typename KV>
    NextRunPrefetch(const Args& a, const int32_t* table, int64_t pos, int64_t n, int64_t end, const KV* kc,
                    const KV* vc, int64_t k_steps) {
        const int64_t next = pos + n, bs = a.block_size, stride = a.num_kv_heads * a.head_dim;
        if (next < end) {
            const int64_t off = next % bs, nn = std::min<int64_t>({bs - off, end - next, CHUNK});
            const int64_t slot = (int64_t)table[next / bs] * bs + off;
            k = reinterpret_cast<const char*>(kc + slot * stride);
            v = reinterpret_cast<const char*>(vc + slot * stride);
            lines = (nn * stride * (int64_t)sizeof(KV) + 63) / 64;
        }
        k_per = (lines + k_steps - 1) / k_steps;
        v_per = (lines + a.num_heads - 1) / a.num_heads;
    }
    inline void k_step() {
        for (const int64_t stop = std::min(lines, k_done + k_per); k_done < stop; k_done++)
            _mm_prefetch(k + 64 * k_done, _MM_HINT_T0);
    }
    inline void v_step() {
        for (const int64_t stop = std::min(lines, v_done + v_per); v_done < stop; v_done++)
            _mm_prefetch(v + 64 * v_done, _MM_HINT_T0);
    }
};

// ---------------------------------------------------------------- AVX2 + FMA (head_dim % 8 == 0)


AVX2 __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

AVX2 float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

AVX2 float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

// The 8 horizontal sums of d[0..7], as one vector [sum d0, ..., sum d7].
AVX2 __m256 hsum8x8(const __m256* d) {
    const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
    const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// Stores 8 tokens' scores at dst (32-byte aligned); lanes from `left` on lie past the run (they
// read its last row) and are stored as -inf, so that exp turns them into 0.
AVX2 void store_scores8(float* dst, __m256 sums, int64_t left) {
    if (left < 8) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 past = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32((int)(left - 1))));
        sums = _mm256_blendv_ps(sums, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), past);
    }
    _mm256_store_ps(dst, sums);
}

// acc[0 .. 8W) = acc * corr + sum over t < n of p[t] * v[t * stride + (0 .. 8W)]
template <typename KV, int W>
AVX2 void accumulate_v(float* acc, const KV* v, const float* p, int64_t n, int64_t stride, __m256 corr) {
    __m256 x[W];
    for (int w = 0; w < W; w++) x[w] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * w), corr);
    for (int64_t t = 0; t < n; t++) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        const KV* row = v + t * stride;
        for (int w = 0; w < W; w++) x[w] = _mm256_fmadd_ps(pt, load8(row + 8 * w), x[w]);
    }
    for (int w = 0; w < W; w++) _mm256_storeu_ps(acc + 8 * w, x[w]);
}

__attribute__((target("avx2,fma"))) void prep_avx2(const Args& a, int64_t row, float* qs, float* acc, float* m,
                                                   float* l) {
    const int64_t D = a.head_dim, H = a.num_heads, V = D / 8;
    const float* q = a.q + row * H * D;
    const __m256 scale = _mm256_set1_ps(a.scale);
    for (int64_t g = 0; g < H; g++) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        for (int64_t v = 0; v < V; v++) {
            _mm256_storeu_ps(acc + g * D + 8 * v, _mm256_setzero_ps());
            _mm256_storeu_ps(qs + g * D + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(q + g * D + 8 * v), scale));
        }
    }
}

template <typename KV>
__attribute__((target("avx2,fma"))) void chunk_avx2(const Args& a, const float* qs, float* acc, float* m, float* l,
                                                    int64_t slot, int64_t n, NextRunPrefetch& prefetch) {
    const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, H = a.num_heads, V = D / 8;
    const int64_t stride = a.num_kv_heads * D;
    const KV* kc = static_cast<const KV*>(a.k_cache);
    const KV* vc = static_cast<const KV*>(a.v_cache);
    alignas(32) float s[MAX_HEADS][CHUNK];
    const int64_t n8 = (n + 7) / 8;
    // scores of 8 tokens at a time for one head: 8 independent FMA chains, then one transposing
    // reduction; tokens past the chunk read its last row and are then set to -inf (exp 0)
    for (int64_t kvh = 0; kvh < a.num_kv_heads; kvh++) {
        const KV* kh = kc + slot * stride + kvh * D;
        for (int64_t g = kvh * G; g < kvh * G + G; g++) {
            const float* qg = qs + g * D;
            for (int64_t t0 = 0; t0 < n; t0 += 8) {
                const KV* rows8[8];
                for (int j = 0; j < 8; j++) rows8[j] = kh + std::min<int64_t>(t0 + j, n - 1) * stride;
                __m256 d[8];
                for (int j = 0; j < 8; j++) d[j] = _mm256_mul_ps(_mm256_loadu_ps(qg), load8(rows8[j]));
                for (int64_t v = 1; v < V; v++) {
                    const __m256 qv = _mm256_loadu_ps(qg + 8 * v);
                    for (int j = 0; j < 8; j++) d[j] = _mm256_fmadd_ps(qv, load8(rows8[j] + 8 * v), d[j]);
                }
                __m256 sums = hsum8x8(d);
                store_scores8(&s[g][t0], sums, n - t0);
                prefetch.k_step();
            }
        }
    }
    for (int64_t g = 0; g < H; g++) cap_scores(a, s[g], n);
    // online softmax, 8 scores at a time
    for (int64_t g = 0; g < H; g++) {
        __m256 mx8 = _mm256_set1_ps(m[g]);
        for (int64_t c = 0; c < n8; c++) mx8 = _mm256_max_ps(mx8, _mm256_load_ps(&s[g][8 * c]));
        const float mx = hmax8(mx8);
        const float corr = std::exp(m[g] - mx);  // 0 on the first chunk (m = -inf)
        const __m256 mxv = _mm256_set1_ps(mx);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t c = 0; c < n8; c++) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(&s[g][8 * c]), mxv));
            _mm256_store_ps(&s[g][8 * c], p);
            sum = _mm256_add_ps(sum, p);
        }
        l[g] = l[g] * corr + hsum8(sum);
        m[g] = mx;
        // acc = acc * corr + sum_t p_t v_t, 8-wide slices of acc kept in registers, several
        // at once so that the FMA chains overlap
        const __m256 cv = _mm256_set1_ps(corr);
        float* ag = acc + g * D;
        const KV* vh = vc + slot * stride + (g / G) * D;
        int64_t v0 = 0;
        for (; v0 + 8 <= V; v0 += 8) accumulate_v<KV, 8>(ag + 8 * v0, vh + 8 * v0, s[g], n, stride, cv);
        for (; v0 + 4 <= V; v0 += 4) accumulate_v<KV, 4>(ag + 8 * v0, vh + 8 * v0, s[g], n, stride, cv);
        for (; v0 < V; v0++) accumulate_v<KV, 1>(ag + 8 * v0, vh + 8 * v0, s[g], n, stride, cv);
        prefetch.v_step();
    }
}

// ---------------------------------------------------------------- AVX-512 (head_dim % 16 == 0)
// The AVX2 loop's structure at twice the width, with two changes the width calls for: a score's
// 16 lanes fold to 8 before the shared transposing reduction, and the V accumulation keeps two
// sets of accumulators (even and odd tokens) so that head_dim 64 still has 8 independent FMA chains.

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"), always_inline)) inline

AVX512 __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512 __m512 load16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

AVX512 __m256 fold16(__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }

// exp8's polynomial at 16 lanes (same constants, same error bound)
AVX512 __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.f);
    const __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(bits));
}

// acc[0 .. 16W) = acc * corr + sum over t < n of p[t] * v[t * stride + (0 .. 16W)]
template <typename KV, int W>
AVX512 void accumulate_v16(float* acc, const KV* v, const float* p, int64_t n, int64_t stride, __m512 corr) {
    __m512 x[W], y[W];
    for (int w = 0; w < W; w++) {
        x[w] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * w), corr);
        y[w] = _mm512_setzero_ps();
    }
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
        const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
        const KV* r0 = v + t * stride;
        const KV* r1 = r0 + stride;
        for (int w = 0; w < W; w++) {
            x[w] = _mm512_fmadd_ps(p0, load16(r0 + 16 * w), x[w]);
            y[w] = _mm512_fmadd_ps(p1, load16(r1 + 16 * w), y[w]);
        }
    }
    if (t < n) {
        const __m512 p0 = _mm512_set1_ps(p[t]);
        for (int w = 0; w < W; w++) x[w] = _mm512_fmadd_ps(p0, load16(v + t * stride + 16 * w), x[w]);
    }
    for (int w = 0; w < W; w++) _mm512_storeu_ps(acc + 16 * w, _mm512_add_ps(x[w], y[w]));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void prep_avx512(
        const Args& a, int64_t row, float* qs, float* acc, float* m, float* l) {
    const int64_t D = a.head_dim, H = a.num_heads, V = D / 16;
    const float* q = a.q + row * H * D;
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int64_t g = 0; g < H; g++) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        for (int64_t v = 0; v < V; v++) {
            _mm512_storeu_ps(acc + g * D + 16 * v, _mm512_setzero_ps());
            _mm512_storeu_ps(qs + g * D + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * v), scale));
        }
    }
}

template <typename KV>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void chunk_avx512(
        const Args& a, const float* qs, float* acc, float* m, float* l, int64_t slot, int64_t n,
        NextRunPrefetch& prefetch) {
    const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, H = a.num_heads, V = D / 16;
    const int64_t stride = a.num_kv_heads * D;
    const KV* kc = static_cast<const KV*>(a.k_cache);
    const KV* vc = static_cast<const KV*>(a.v_cache);
    alignas(64) float s[MAX_HEADS][CHUNK];
    const int64_t n16 = (n + 15) / 16;
    for (int64_t kvh = 0; kvh < a.num_kv_heads; kvh++) {
        const KV* kh = kc + slot * stride + kvh * D;
        for (int64_t g = kvh * G; g < kvh * G + G; g++) {
            const float* qg = qs + g * D;
            for (int64_t t0 = 0; t0 < n; t0 += 8) {
                const KV* rows8[8];
                for (int j = 0; j < 8; j++) rows8[j] = kh + std::min<int64_t>(t0 + j, n - 1) * stride;
                __m512 d[8];
                for (int j = 0; j < 8; j++) d[j] = _mm512_mul_ps(_mm512_loadu_ps(qg), load16(rows8[j]));
                for (int64_t v = 1; v < V; v++) {
                    const __m512 qv = _mm512_loadu_ps(qg + 16 * v);
                    for (int j = 0; j < 8; j++) d[j] = _mm512_fmadd_ps(qv, load16(rows8[j] + 16 * v), d[j]);
                }
                __m256 h[8];
                for (int j = 0; j < 8; j++) h[j] = fold16(d[j]);
                __m256 sums = hsum8x8(h);
                store_scores8(&s[g][t0], sums, n - t0);
                prefetch.k_step();
            }
            // a 16-wide softmax pass reads s[g][n .. 16 * n16): past the run's scores, -inf
            for (int64_t t = (n + 7) / 8 * 8; t < n16 * 16; t++) s[g][t] = -std::numeric_limits<float>::infinity();
        }
    }
    for (int64_t g = 0; g < H; g++) cap_scores(a, s[g], n);
    for (int64_t g = 0; g < H; g++) {
        __m512 mx16 = _mm512_set1_ps(m[g]);
        for (int64_t c = 0; c < n16; c++) mx16 = _mm512_max_ps(mx16, _mm512_load_ps(&s[g][16 * c]));
        const float mx = _mm512_reduce_max_ps(mx16);
        const float corr = std::exp(m[g] - mx);  // 0 on the first chunk (m = -inf)
        const __m512 mxv = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < n16; c++) {
            const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(&s[g][16 * c]), mxv));
            _mm512_store_ps(&s[g][16 * c], p);
            sum = _mm512_add_ps(sum, p);
        }
        l[g] = l[g] * corr + _mm512_reduce_add_ps(sum);
        m[g] = mx;
        const __m512 cv = _mm512_set1_ps(corr);
        float* ag = acc + g * D;
        const KV* vh = vc + slot * stride + (g / G) * D;
        int64_t v0 = 0;
        for (; v0 + 8 <= V; v0 += 8) accumulate_v16<KV, 8>(ag + 16 * v0, vh + 16 * v0, s[g], n, stride, cv);
        for (; v0 + 4 <= V; v0 += 4) accumulate_v16<KV, 4>(ag + 16 * v0, vh + 16 * v0, s[g], n, stride, cv);
        for (; v0 < V; v0++) accumulate_v16<KV, 1>(ag + 16 * v0, vh + 16 * v0, s[g], n, stride, cv);
        prefetch.v_step();
    }
}

// ---------------------------------------------------------------- rows in tiles

constexpr int TILE = 8;  // prompt rows that walk their context together

// One work item: rows row0 .. row0 + nrows - 1 (a tile: consecutive positions of one sequence, so
// the same block table; or a single row) over their positions [start_r, end_r) of one part. The
// rows advance run by run in step, so each run's K/V, read from memory for the first row, is in
// cache for the others; every row gets exactly the runs and calls it would get alone.
template <typename KV, void (*Prep)(const Args&, int64_t, float*, float*, float*, float*),
          void (*Chunk)(const Args&, const float*, float*, float*, float*, int64_t, int64_t, NextRunPrefetch&)>
void tile_item(const Args& a, int64_t row0, int64_t nrows, const int64_t* start, const int64_t* end,
               float* const* state) {
    const int64_t D = a.head_dim, H = a.num_heads, bs = a.block_size;
    const int32_t* table = a.block_tables + row0 * a.max_blocks;
    const KV* kc = static_cast<const KV*>(a.k_cache);
    const KV* vc = static_cast<const KV*>(a.v_cache);
    thread_local std::vector<float> qs_buf;
    if ((int64_t)qs_buf.size() < nrows * H * D) qs_buf.resize(nrows * H * D);
    int64_t pos[TILE];
    for (int64_t r = 0; r < nrows; r++) {
        float* acc = state[r];
        Prep(a, row0 + r, qs_buf.data() + r * H * D, acc, acc + H * D, acc + H * D + H);
        pos[r] = start[r];
    }
    for (bool active = true; active;) {
        active = false;
        for (int64_t r = 0; r < nrows; r++) {
            if (pos[r] >= end[r]) continue;
            active = true;
            const int64_t off = pos[r] % bs;
            const int64_t n = std::min<int64_t>({bs - off, end[r] - pos[r], CHUNK});
            const int64_t slot = (int64_t)table[pos[r] / bs] * bs + off;
            float* acc = state[r];
            if (r == 0) {
                NextRunPrefetch prefetch(a, table, pos[r], n, end[r], kc, vc, H * ((n + 7) / 8));
                Chunk(a, qs_buf.data() + r * H * D, acc, acc + H * D, acc + H * D + H, slot, n, prefetch);
            } else {
                NextRunPrefetch none;
                Chunk(a, qs_buf.data() + r * H * D, acc, acc + H * D, acc + H * D + H, slot, n, none);
            }
            pos[r] += n;
        }
    }
}

using ItemFn = void (*)(const Args&, int64_t, int64_t, const int64_t*, const int64_t*, float* const*);

// -1: the best the CPU has; else at most 0 portable, 2 avx2, 3 avx512 (tests pin a path)
int forced_isa = -1;

int attention_isa() {
    static const int detected =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") ? 3
        : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 0;
    return forced_isa >= 0 ? std::min(forced_isa, detected) : detected;
}

template <typename KV>
ItemFn pick_kv(int64_t head_dim) {
    if (attention_isa() >= 3 && head_dim % 16 == 0) return tile_item<KV, prep_avx512, chunk_avx512<KV>>;
    if (attention_isa() >= 2 && head_dim % 8 == 0) return tile_item<KV, prep_avx2, chunk_avx2<KV>>;
    return tile_item<KV, prep_portable, chunk_portable<KV>>;
}

ItemFn pick(bool bf16, int64_t head_dim) { return bf16 ? pick_kv<uint16_t>(head_dim) : pick_kv<float>(head_dim); }

// Rows r and r - 1 are one sequence's consecutive prompt positions (the same table, one position
// apart): they can share a tile.
bool continues(const Args& a, int64_t r) {
    const int32_t* lens = a.context_lens;
    if (lens[r] != lens[r - 1] + 1) return false;
    const int64_t blocks = std::min<int64_t>((lens[r] + a.block_size - 1) / a.block_size, a.max_blocks);
    return std::memcmp(a.block_tables + r * a.max_blocks, a.block_tables + (r - 1) * a.max_blocks,
                       blocks * sizeof(int32_t)) == 0;
}

}  // namespace

extern "C" {

// Returns 0, or a nonzero code for shapes the kernel does not take (the caller then uses the
// torch path): 1 head_dim > 256, 2 more than 128 query heads, 3 heads not a multiple of kv heads.
// window > 0: each row attends to its last `window` positions only (sliding-window attention).
// softcap > 0: scores are soft-capped, softcap * tanh(score / softcap) (Gemma 2), before the softmax.
// part_tokens (<= 0: whole rows) must not depend on the batch: a row's result then depends on
// its own data only, whatever else is in the batch (greedy batch invariance).
int brisk_paged_decode_attention(const float* q, const void* k_cache, const void* v_cache, int kv_bf16,
                                 const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                                 int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int64_t part_tokens, int64_t window,
                                 float softcap, float* out) {
    if (head_dim > MAX_DIM) return 1;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads) return 3;
    if (num_heads > MAX_HEADS) return 2;
    const int64_t H = num_heads, D = head_dim;
    const Args a{q, k_cache, v_cache, block_tables, context_lens, max_blocks, num_heads, num_kv_heads,
                 head_dim, block_size, scale, softcap};
    int64_t longest = 1;
    for (int64_t r = 0; r < rows; r++) longest = std::max<int64_t>(longest, context_lens[r]);
    if (part_tokens <= 0) part_tokens = longest;
    const int64_t parts = (longest + part_tokens - 1) / part_tokens;
    const int64_t per_item = H * (D + 2);  // per row and part: acc [H, D], m [H], l [H]
    // tiles: runs of up to TILE rows that continue one another (a prompt chunk's rows); a decode
    // row is a tile of its own
    thread_local std::vector<int64_t> tiles;
    tiles.clear();
    for (int64_t r = 0; r < rows; r++)
        if (r == 0 || r - tiles.back() >= TILE || !continues(a, r)) tiles.push_back(r);
    tiles.push_back(rows);
    const int64_t num_tiles = (int64_t)tiles.size() - 1;
    const int64_t* tile_at = tiles.data();  // (thread_local: the workers read the caller's)
    const int64_t items = num_tiles * parts;  // item i: tile i / parts, positions of part i % parts
    thread_local std::vector<float> scratch;
    if ((int64_t)scratch.size() < rows * parts * per_item) scratch.resize(rows * parts * per_item);
    float* state = scratch.data();
    const ItemFn fn = pick(kv_bf16 != 0, head_dim);

#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
    for (int64_t i = 0; i < items; i++) {
        const int64_t row0 = tile_at[i / parts], nrows = tile_at[i / parts + 1] - row0, part = i % parts;
        int64_t start[TILE], end[TILE];
        float* states[TILE];
        int64_t first_live = nrows, live = 0;
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t row = row0 + r;
            // a sliding window (> 0) sees only the row's last `window` positions: earlier parts are
            // empty and earlier blocks are never read (they may be freed, padded with block 0)
            const int64_t first = window > 0 ? std::max<int64_t>(0, context_lens[row] - window) : 0;
            start[r] = std::max<int64_t>(part * part_tokens, first);
            end[r] = std::min<int64_t>(part * part_tokens + part_tokens, context_lens[row]);
            states[r] = state + (row * parts + part) * per_item;
            if (start[r] >= end[r]) {  // an empty part: weight 0 in the merge
                float* m = states[r] + H * D;
                for (int64_t h = 0; h < H; h++) { m[h] = -std::numeric_limits<float>::infinity(); m[H + h] = 0.f; }
                start[r] = end[r] = 0;
            } else {
                first_live = std::min(first_live, r);
                live = r + 1;
            }
        }
        // rows with nothing in this part (before a part's start, or a window's) are left out
        if (live > first_live)
            fn(a, row0 + first_live, live - first_live, start + first_live, end + first_live, states + first_live);
    }

    // merge the parts of each (row, head): weights exp(m_p - max m) rescale each part's sums
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t row = 0; row < rows; row++) {
        const float* first = state + row * parts * per_item;
        for (int64_t h = 0; h < H; h++) {
            float mx = -std::numeric_limits<float>::infinity();
            for (int64_t p = 0; p < parts; p++) mx = std::max(mx, first[p * per_item + H * D + h]);
            float* o = out + (row * H + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.f;
            float total = 0.f;
            for (int64_t p = 0; p < parts; p++) {
                const float* st = first + p * per_item;
                const float lp = st[H * D + H + h];
                if (lp == 0.f) continue;  // an empty part (past this row's length)
                const float w = std::exp(st[H * D + h] - mx);
                total += w * lp;
                for (int64_t d = 0; d < D; d++) o[d] += w * st[h * D + d];
            }
            const float inv = 1.f / total;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
    }
    return 0;
}

int brisk_paged_attention_isa() { return attention_isa(); }

void brisk_paged_attention_force_isa(int isa) { forced_isa = isa; }

}  // extern "C"
