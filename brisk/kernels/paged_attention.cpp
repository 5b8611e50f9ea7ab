// Paged decode attention for brisk's CPU path: one query token per sequence attends to its
// whole context through the sequence's block table, reading K/V where they lie in the cache
// (no gathered copy of the context, unlike the torch reference in brisk/engine/attention.py).
//
// Layout (what brisk.engine.attention.PagedKVCache holds per layer):
//   k_cache, v_cache  [num_slots, num_kv_heads, head_dim] of one element type (kv_types.h: float32,
//                     bfloat16, float16, fp8 e4m3/e5m2, int8); slot = block * bs + offset
//   k_scale, v_scale  int8 only: [num_slots, num_kv_heads] float32, each (token, head) row's scale
//   q                 [rows, num_heads, head_dim] float32
//   block_tables      [rows, max_blocks] int32; context_lens [rows] int32 (>= 1)
//   out               [rows, num_heads * head_dim] float32
// GQA: query head h reads kv head h / (num_heads / num_kv_heads), as SDPA's enable_gqa does.
//
// Work is split into items (row, part of its context): an item walks its positions in chunks of
// up to CHUNK positions across blocks (CHUNK_SPAN: 8-bit types 32, 4 blocks at brisk's default
// block size of 8; the wider types 16, or a block's size if more), reads each slot's K/V for all
// heads together (one contiguous span of memory), and keeps an online softmax per query head
// (running max m, sum l, weighted V sum); the parts of a row are then merged ("flash decoding").
// Splitting the context keeps every core busy when few rows are long. Items are handed out in
// order (ItemQueue); an item's last chunk prefetches the first chunk of the worker's next item.
//
// Narrow elements are widened to float32 in registers as they are loaded (no dequantized copy);
// an int8 row's scale multiplies its score (K) or its softmax weight (V), never the elements. The
// AVX2 and AVX-512 loops score int8 K without widening it to float: the query, rounded to int16 per
// head, meets the codes in integer multiply-adds (scores_heads_i8, score_group16_i8).
//
// Plain C ABI, loaded with ctypes (brisk/kernels/__init__.py). An AVX-512 item loop (head_dim a
// multiple of 16) or an AVX2+FMA+F16C one (a multiple of 8) is picked at run time; other CPUs and
// shapes take the portable loop. On AVX512-FP16 CPUs fp8 K/V (head_dim a multiple of 32) take a loop
// that multiplies in float16 (chunk_fp16).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include <immintrin.h>
#include <omp.h>

#include "simd_avx2.h"
#include "brisk_abi.h"
#include "kv_types.h"
#include "simd_widen.h"

namespace {

constexpr int CHUNK = 32;      // positions scored at once at most (CHUNK_SPAN: from one block or several)
constexpr int MAX_HEADS = 128;  // query heads
constexpr int MAX_DIM = 256;

struct Args {
    const float* q;
    const void* k_cache;
    const void* v_cache;
    const float* k_scale;  // int8 only
    const float* v_scale;
    const int32_t* block_tables;
    const int32_t* context_lens;
    int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    float softcap;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2's soft-capping)
};

// Gemma 2's soft-capped scores, on the n scores of a chunk (the lanes past it stay -inf)
inline void cap_scores(const Args& a, float* s, int64_t n) {
    if (a.softcap > 0.f)
        for (int64_t t = 0; t < n; t++) s[t] = a.softcap * std::tanh(s[t] / a.softcap);
}

using kvt::bf16_t;
using kvt::e4m3_t;
using kvt::e5m2_t;
using kvt::f16_t;

#define ROW_INLINE __attribute__((always_inline)) inline

ROW_INLINE void load_row(const float* src, float* dst, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }
ROW_INLINE void load_row(const bf16_t* src, float* dst, int64_t d) {
    for (int64_t i = 0; i < d; i++) dst[i] = kvt::bf16_to_f32(src[i].bits);
}
ROW_INLINE void load_row(const f16_t* src, float* dst, int64_t d) {
    for (int64_t i = 0; i < d; i++) dst[i] = kvt::f16_to_f32(src[i].bits);
}
ROW_INLINE void load_row(const e4m3_t* src, float* dst, int64_t d) {
    for (int64_t i = 0; i < d; i++) dst[i] = kvt::e4m3_to_f32(src[i].bits);
}
ROW_INLINE void load_row(const e5m2_t* src, float* dst, int64_t d) {
    for (int64_t i = 0; i < d; i++) dst[i] = kvt::e5m2_to_f32(src[i].bits);
}
ROW_INLINE void load_row(const int8_t* src, float* dst, int64_t d) {
    for (int64_t i = 0; i < d; i++) dst[i] = (float)src[i];
}

// int8 rows carry a scale per (slot, kv head); every other type reads as it is
template <typename KV>
constexpr bool SCALED = std::is_same<KV, int8_t>::value;

// A row's attention is kept as un-normalised state: acc [H, D], m [H] (running max), l [H] (sum).
// prep_* scales the row's query into qs [H, D] and clears the state; chunk_* folds in one chunk of
// n positions (at most CHUNK) whose slots are slots[0 .. n). A row's result depends only on its
// query and the chunks it is given (their positions' K/V, not where the blocks lie): whether it is
// processed alone (a decode row) or in a tile with the rows after it (a prompt chunk), in place or
// staged, the same calls on the same values give the same bits.
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

struct NextChunkPrefetch;

template <typename KV>
void chunk_portable(const Args& a, const float* qs, float* acc, float* m, float* l, const int64_t* slots,
                    int64_t n, NextChunkPrefetch&) {
    const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, H = a.num_heads;
    const int64_t stride = a.num_kv_heads * D;  // elements between consecutive slots
    const KV* kc = static_cast<const KV*>(a.k_cache);
    const KV* vc = static_cast<const KV*>(a.v_cache);
    float row_buf[MAX_DIM], s[MAX_HEADS][CHUNK], ks = 1.f;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t g = 0; g < H; g++) {
            if (g % G == 0) {
                load_row(kc + slots[t] * stride + (g / G) * D, row_buf, D);
                if (SCALED<KV>) ks = a.k_scale[slots[t] * a.num_kv_heads + g / G];
            }
            float dot = 0.f;
            for (int64_t d = 0; d < D; d++) dot += qs[g * D + d] * row_buf[d];
            s[g][t] = SCALED<KV> ? dot * ks : dot;
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
    float vs = 1.f;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t g = 0; g < H; g++) {
            if (g % G == 0) {
                load_row(vc + slots[t] * stride + (g / G) * D, row_buf, D);
                if (SCALED<KV>) vs = a.v_scale[slots[t] * a.num_kv_heads + g / G];
            }
            const float p = SCALED<KV> ? s[g][t] * vs : s[g][t];
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += p * row_buf[d];
        }
    }
}

// The next chunk's K/V lines (other blocks, somewhere else in the pool), prefetched a few at a time
// through this chunk's work: k_step() once per score group, v_step() once per head's V pass. The
// reads then overlap the math; one burst of every line at the start of a chunk overflows the core's
// outstanding-miss slots (a burst measured 10.3 ms per layer at 64 rows x 2,000 tokens where
// spreading it measured 7.3 ms, benchmarks/decode_attention.py).
struct NextChunkPrefetch {
    const char* k = nullptr;
    const char* v = nullptr;
    int64_t slots[CHUNK];
    // the chunk as runs of contiguous slots (one per block it touches): byte offset and lines of each
    int64_t run_at[CHUNK], run_lines[CHUNK];
    int64_t lines = 0, k_done = 0, v_done = 0, k_per = 1, v_per = 1;
    int64_t k_run = 0, k_line = 0, v_run = 0, v_line = 0;  // where k_done / v_done point
    bool to_l2 = false;  // prefetch into L2 (T2), not L1 (T0): tile_item's L2_PREFETCH

    NextChunkPrefetch() = default;  // prefetches nothing (a tile's later rows: the first row's chunks did)

    template <typename KV>
    NextChunkPrefetch(const Args& a, const int32_t* table, int64_t next, int64_t end, const KV* kc, const KV* vc,
                    int64_t k_steps);
    // int8's scales lie in their own arrays: the next chunk's lines of both, at once (a chunk's scales
    // span a few lines: 96 bytes a block with 3 KV heads). Unprefetched, the loads of the scales drew
    // a quarter of the int8 kernel's samples (perf, decode_attention.py's shape); prefetched, the
    // kernel took 1/1.15 of the time (decode_attention.py --baseline-lib, AVX2).
    void prefetch_scales(const Args& a, int64_t n) {
        const int64_t nkv = a.num_kv_heads;
        const char* kbase = reinterpret_cast<const char*>(a.k_scale);
        const char* vbase = reinterpret_cast<const char*>(a.v_scale);
        int64_t last = -1;  // the last line prefetched, in bytes from the arrays' start / 64
        for (int64_t t = 0; t < n; t++) {
            const int64_t first = slots[t] * nkv * (int64_t)sizeof(float);
            for (int64_t ln = first / 64; ln <= (first + nkv * (int64_t)sizeof(float) - 1) / 64; ln++)
                if (ln != last) {
                    last = ln;
                    _mm_prefetch(kbase + 64 * ln, _MM_HINT_T0);
                    _mm_prefetch(vbase + 64 * ln, _MM_HINT_T0);
                }
        }
    }
    // prefetches the chunk's lines from `done` to `stop`, base k or v
    inline void advance(const char* base, int64_t& done, int64_t& run, int64_t& ln, int64_t stop) {
        for (; done < stop; done++) {
            const char* line = base + run_at[run] + 64 * ln;
            if (to_l2)
                _mm_prefetch(line, _MM_HINT_T2);
            else
                _mm_prefetch(line, _MM_HINT_T0);
            if (++ln == run_lines[run]) {
                ln = 0;
                run++;
            }
        }
    }
    inline void k_step() { advance(k, k_done, k_run, k_line, std::min(lines, k_done + k_per)); }
    inline void v_step() { advance(v, v_done, v_run, v_line, std::min(lines, v_done + v_per)); }
};

// How many positions a chunk of KV type KV spans across blocks. The 8-bit types' chunks span 32
// positions: their softmax and accumulator passes cost more than their reads (int8 and fp8
// 1.15-1.25x faster across blocks and with paired heads, decode_attention.py --baseline-lib on AVX2).
// The wider types' span 16: they paid the per-chunk work (a scalar exp per head for the rescale, the
// running max and sum, a load and store of the V sums) per 8-slot block; at 16 (AVX2) bfloat16 ran
// 1.15-1.20x and float16 1.10-1.26x faster in cache, 1.03-1.19x on scattered decode rows and
// 1.19-1.35x on prompt tiles, and float32 1.02-1.07x in cache, 1.03-1.05x on decode rows and 1.31x on
// prompt tiles. At 32 bfloat16 took ~10% longer on scattered blocks (32 positions of K and V ahead no
// longer fit L1 beside the current ones). Always the in-place type's rule, so a staged tile takes the
// chunks a lone row takes.
template <typename KV>
constexpr int64_t CHUNK_SPAN = sizeof(KV) == 1 ? 32 : 16;
static_assert(CHUNK_SPAN<int8_t> <= CHUNK && CHUNK_SPAN<float> <= CHUNK, "a chunk holds at most CHUNK positions");

// A row's chunk from position pos: up to `span` positions (or a block's, if more; at most CHUNK)
// before `end`, across blocks, their slots in `slots`. The chunks depend on the row's positions only
// (never on the batch or on how the row is processed).
inline int64_t chunk_slots(const Args& a, const int32_t* table, int64_t pos, int64_t end, int64_t span,
                           int64_t* slots) {
    const int64_t bs = a.block_size;
    const int64_t n = std::min<int64_t>({CHUNK, end - pos, std::max(span, bs)});
    int64_t block = pos / bs, off = pos % bs;  // one division per chunk, none per position
    int64_t base = (int64_t)table[block] * bs;
    for (int64_t t = 0; t < n; t++) {
        slots[t] = base + off;
        if (++off == bs && t + 1 < n) {
            off = 0;
            base = (int64_t)table[++block] * bs;
        }
    }
    return n;
}

template <typename KV>
NextChunkPrefetch::NextChunkPrefetch(const Args& a, const int32_t* table, int64_t next, int64_t end, const KV* kc,
                                 const KV* vc, int64_t k_steps) {
    const int64_t row_bytes = a.num_kv_heads * a.head_dim * (int64_t)sizeof(KV);  // a slot's K (or V), all heads
    if (next < end) {
        k = reinterpret_cast<const char*>(kc);
        v = reinterpret_cast<const char*>(vc);
        const int64_t n = chunk_slots(a, table, next, end, CHUNK_SPAN<KV>, slots);
        for (int64_t t0 = 0, runs = 0; t0 < n; runs++) {
            int64_t t = t0 + 1;
            while (t < n && slots[t] == slots[t - 1] + 1) t++;
            run_at[runs] = slots[t0] * row_bytes;
            run_lines[runs] = ((t - t0) * row_bytes + 63) / 64;
            lines += run_lines[runs];
            t0 = t;
        }
        if (a.k_scale != nullptr) prefetch_scales(a, n);
    }
    k_per = (lines + k_steps - 1) / k_steps;
    v_per = (lines + a.num_heads - 1) / a.num_heads;
}

// ---------------------------------------------------------------- AVX2 + FMA (head_dim % 8 == 0)


#define AVX2H __attribute__((target("avx2,fma,f16c"), always_inline)) inline
#define AVX2H_FN __attribute__((target("avx2,fma,f16c")))

using widen::load8;  // float, bf16, f16 (simd_widen.h); the 8-bit types below
AVX2H __m128i bytes8(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
AVX2H __m256 load8(const e5m2_t* p) { return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes8(p)), 8)); }
// e4m3 s.eeee.mmm -> float16 s.0eeee.mmm0000000: the value / 256 (exponent bias 7 vs 15; e4m3's
// subnormals land on float16's). Sign-extended to 16 bits and shifted left by 7, the byte's sign
// lands in bits 15 and 14; clearing bit 14 leaves exactly that float16. The loop takes the values
// so, short by UNSCALE: prep_avx2 multiplies the queries by it (the scores come out the same
// bits: scaling by a power of two is exact) and the merge the output (the V sums are exactly
// 1/256 of the true ones). Saves the multiply per 8 elements: 1.14x on e4m3's kernel time. The
// AVX-512 loop reads e4m3 the same way (load16, prep_avx512).
AVX2H __m256 load8(const e4m3_t* p) {
    const __m128i b = _mm_slli_epi16(_mm_cvtepi8_epi16(bytes8(p)), 7);
    return _mm256_cvtph_ps(_mm_and_si128(b, _mm_set1_epi16(static_cast<short>(0xBFFF))));
}
template <typename KV>
constexpr float UNSCALE = 1.f;
template <>
constexpr float UNSCALE<e4m3_t> = kvt::E4M3_UNSCALE;
AVX2H __m256 load8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(p))); }

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

// A score vector holds GS heads x TOKENS<GS> tokens (lane g * T + j: head g0 + g, token t0 + j):
// one head 8 tokens, two 4, three or four 2 (three leave lanes 6 and 7 empty).
template <int GS>
constexpr int TOKENS = GS == 1 ? 8 : GS == 2 ? 4 : 2;

// The scores of GS heads sharing one KV head, as one vector (TOKENS' lanes). Each K vector is
// widened once and multiplied into every head's chain; a (head, token) score takes the same
// operations in the same order whatever GS is (one FMA chain over head_dim, then hsum8x8's
// reduction, the same for every lane).
template <typename KV, int GS>
AVX2H __m256 scores_heads(const float* q0, int64_t D, const KV* const* rows, int64_t V) {
    constexpr int T = TOKENS<GS>;
    __m256 d[8];
    for (int i = GS * T; i < 8; i++) d[i] = _mm256_setzero_ps();
    {
        __m256 q[GS];
        for (int g = 0; g < GS; g++) q[g] = _mm256_loadu_ps(q0 + g * D);
        for (int j = 0; j < T; j++) {
            const __m256 k = load8(rows[j]);
            for (int g = 0; g < GS; g++) d[g * T + j] = _mm256_mul_ps(q[g], k);
        }
    }
    for (int64_t v = 1; v < V; v++) {
        __m256 q[GS];
        for (int g = 0; g < GS; g++) q[g] = _mm256_loadu_ps(q0 + g * D + 8 * v);
        for (int j = 0; j < T; j++) {
            const __m256 k = load8(rows[j] + 8 * v);
            for (int g = 0; g < GS; g++) d[g * T + j] = _mm256_fmadd_ps(q[g], k, d[g * T + j]);
        }
    }
    return hsum8x8(d);
}

// int8 on AVX2: the scores in integers. prep_avx2<int8_t> rounds each head's scaled query to int16
// codes (its largest element to 32767; the head's step sq kept beside them: QCodes), and a K row's
// int8 codes, sign-extended to int16, meet them in vpmaddwd: 16 elements in three instructions where
// widening to float takes six, and the int32 sums are exact (|sum| <= 256 x 32767 x 128 < 2^31).
// The only rounding is the query's (relative step 2^-15 of its largest element, against int8 K's own
// 2^-8); a score is sq * ks[t] * its integer sum, the same bits whatever GS is.
struct QCodes {
    const int16_t* codes;  // [D]
    float step;
};
AVX2H QCodes qcodes(const float* qs_head, int64_t D) {
    return {reinterpret_cast<const int16_t*>(qs_head), qs_head[D / 2]};
}

AVX2H __m256i hsum8x8_epi32(const __m256i* d) {
    const __m256i b0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
    const __m256i b1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

// 16 int8 codes at p as int16 (only 8 read when `half`: the upper 8 are 0)
AVX2H __m256i codes16(const int8_t* p, bool half) {
    return _mm256_cvtepi8_epi16(half ? bytes8(p) : _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int GS>
AVX2H __m256 scores_heads_i8(const QCodes* q, int64_t D, const int8_t* const* rows, __m256 steps) {
    constexpr int T = TOKENS<GS>;
    __m256i d[8];
    for (int i = 0; i < 8; i++) d[i] = _mm256_setzero_si256();
    for (int64_t e = 0; e < D; e += 16) {
        // head_dim a multiple of 8, not of 16: the last 8. K's upper 8 lanes are then 0, so whatever
        // follows the query's codes in its row (the step, the next head) adds nothing.
        const bool half = e + 16 > D;
        __m256i qv[GS];
        for (int g = 0; g < GS; g++) qv[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[g].codes + e));
        for (int j = 0; j < T; j++) {
            const __m256i k = codes16(rows[j] + e, half);
            for (int g = 0; g < GS; g++) d[g * T + j] = _mm256_add_epi32(d[g * T + j], _mm256_madd_epi16(qv[g], k));
        }
    }
    return _mm256_mul_ps(_mm256_cvtepi32_ps(hsum8x8_epi32(d)), steps);
}

// A score vector's per-lane factor: x[g] in head g's lanes (0 in the empty ones)
template <int GS>
AVX2H __m256 per_head(const float* x) {
    if constexpr (GS == 1) return _mm256_set1_ps(x[0]);
    if constexpr (GS == 2) return _mm256_setr_m128(_mm_set1_ps(x[0]), _mm_set1_ps(x[1]));
    const float x3 = GS == 4 ? x[3] : 0.f;
    return _mm256_setr_ps(x[0], x[0], x[1], x[1], x[2], x[2], x3, x3);
}

// The chunk's scales ks[t0 ..] in a score vector's lanes (each head's tokens)
template <int GS>
AVX2H __m256 per_token(const float* ks) {
    if constexpr (GS == 1) return _mm256_load_ps(ks);
    if constexpr (GS == 2) return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(ks));
    return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(ks)));
}

// Stores scores_heads' vector into s[g0 ..][t0 ..] (aligned); tokens from `left` on lie past the
// chunk (they read its last row) and are stored as -inf, so that exp turns them into 0.
template <int GS>
AVX2H void store_scores(float (*s)[CHUNK], int64_t g0, int64_t t0, __m256 sums, int64_t left) {
    constexpr int T = TOKENS<GS>;
    if (left < T) {
        const __m256i lane = T == 8 ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                             : T == 4 ? _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3)
                                      : _mm256_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1);
        const __m256 past = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32((int)(left - 1))));
        sums = _mm256_blendv_ps(sums, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), past);
    }
    const __m128 lo = _mm256_castps256_ps128(sums), hi = _mm256_extractf128_ps(sums, 1);
    if constexpr (GS == 1) {
        _mm256_store_ps(&s[g0][t0], sums);
    } else if constexpr (GS == 2) {
        _mm_store_ps(&s[g0][t0], lo);
        _mm_store_ps(&s[g0 + 1][t0], hi);
    } else {  // two tokens a head: 8 bytes each
        _mm_storel_pi(reinterpret_cast<__m64*>(&s[g0][t0]), lo);
        _mm_storeh_pi(reinterpret_cast<__m64*>(&s[g0 + 1][t0]), lo);
        _mm_storel_pi(reinterpret_cast<__m64*>(&s[g0 + 2][t0]), hi);
        if constexpr (GS == 4) _mm_storeh_pi(reinterpret_cast<__m64*>(&s[g0 + 3][t0]), hi);
    }
}

// For GS heads sharing one KV head: acc_g[0 .. 8W) = acc_g * corr_g + sum over t < n of
// p_g[t] * v[at[t] + (0 .. 8W)], acc_g = acc + g * D. Each V vector is widened once for
// all GS heads; an element gets the same operations in the same order whatever GS is.
template <typename KV, int GS, int W>
AVX2H void accumulate_v(float* acc, int64_t D, const KV* v, const int64_t* at, const float* const* p, int64_t n,
                        const float* corr) {
    __m256 x[GS][W];
    for (int g = 0; g < GS; g++)
        for (int w = 0; w < W; w++) x[g][w] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + 8 * w), _mm256_set1_ps(corr[g]));
    for (int64_t t = 0; t < n; t++) {
        const KV* row = v + at[t];
        __m256 pt[GS];
        for (int g = 0; g < GS; g++) pt[g] = _mm256_set1_ps(p[g][t]);
        for (int w = 0; w < W; w++) {
            const __m256 vv = load8(row + 8 * w);
            for (int g = 0; g < GS; g++) x[g][w] = _mm256_fmadd_ps(pt[g], vv, x[g][w]);
        }
    }
    for (int g = 0; g < GS; g++)
        for (int w = 0; w < W; w++) _mm256_storeu_ps(acc + g * D + 8 * w, x[g][w]);
}

// The scores of heads g0 .. g0 + GS of one KV head (all of head_dim) over the chunk, into s
template <typename KV, int GS>
AVX2H void score_group(const Args& a, const float* qs, const KV* kh, const int64_t* at, int64_t n,
                       const float* ks, int64_t g0, float (*s)[CHUNK], NextChunkPrefetch& prefetch) {
    constexpr int T = TOKENS<GS>;
    const int64_t D = a.head_dim;
    QCodes q[GS];  // int8: the heads' codes, and their steps in the score vector's lanes
    __m256 steps = _mm256_setzero_ps();
    if constexpr (std::is_same<KV, int8_t>::value) {
        float step[GS];
        for (int g = 0; g < GS; g++) {
            q[g] = qcodes(qs + (g0 + g) * D, D);
            step[g] = q[g].step;
        }
        steps = per_head<GS>(step);
    }
    for (int64_t t0 = 0; t0 < n; t0 += T) {
        const KV* rows[T];
        for (int j = 0; j < T; j++) rows[j] = kh + at[t0 + j];
        __m256 sums;
        if constexpr (std::is_same<KV, int8_t>::value)
            sums = scores_heads_i8<GS>(q, D, rows, steps);
        else
            sums = scores_heads<KV, GS>(qs + g0 * D, D, rows, D / 8);
        if (SCALED<KV>) sums = _mm256_mul_ps(sums, per_token<GS>(ks + t0));
        store_scores<GS>(s, g0, t0, sums, n - t0);
        // a step per call, planned as one per 8 scores (a lone head's call); three heads' calls score 6,
        // so they take their steps early, and the prefetch stops at the chunk's last line
        prefetch.k_step();
    }
}

// One head's online softmax over a chunk's n scores, 8 at a time: s becomes the weights (times
// `vscale`, int8's V scales, when given: after l summed them unscaled), m and l move on; returns the
// old sums' rescale (0 on the first chunk, m = -inf). Lanes n .. 8 * ceil(n / 8) are set to -inf
// first (a 4-token score group may leave them unwritten).
AVX2H float softmax8(float* s, int64_t n, float& m, float& l, const float* vscale) {
    const int64_t n8 = (n + 7) / 8;
    for (int64_t t = n; t < 8 * n8; t++) s[t] = -std::numeric_limits<float>::infinity();
    __m256 mx8 = _mm256_set1_ps(m);
    for (int64_t c = 0; c < n8; c++) mx8 = _mm256_max_ps(mx8, _mm256_load_ps(s + 8 * c));
    const float mx = hmax8(mx8);
    const float corr = std::exp(m - mx);
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t c = 0; c < n8; c++) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_load_ps(s + 8 * c), mxv));
        sum = _mm256_add_ps(sum, p);
        _mm256_store_ps(s + 8 * c, vscale != nullptr ? _mm256_mul_ps(p, _mm256_load_ps(vscale + 8 * c)) : p);
    }
    l = l * corr + hsum8(sum);
    m = mx;
    return corr;
}

// The V sums of heads g0 .. g0 + GS - 1 of one KV head (their weights s[g0 ..], their sums in acc's
// rows g0 ..), all of head_dim, in slices of W vectors (GS x W accumulators: at most 8 of AVX2's 16
// registers)
template <typename KV, int GS>
AVX2H void v_group(const Args& a, float* acc_all, const KV* vh, const int64_t* at, int64_t n, float (*s)[CHUNK],
                   int64_t g0, const float* corr_all, NextChunkPrefetch& prefetch) {
    const int64_t D = a.head_dim, V = D / 8;
    float* acc = acc_all + g0 * D;
    const float* corr = corr_all + g0;
    const float* p[GS];
    for (int g = 0; g < GS; g++) p[g] = s[g0 + g];
    int64_t v0 = 0;
    for (; v0 + 8 / GS <= V; v0 += 8 / GS) accumulate_v<KV, GS, 8 / GS>(acc + 8 * v0, D, vh + 8 * v0, at, p, n, corr);
    for (; v0 < V; v0++) accumulate_v<KV, GS, 1>(acc + 8 * v0, D, vh + 8 * v0, at, p, n, corr);
    for (int g = 0; g < GS; g++) prefetch.v_step();
}

template <typename KV>
AVX2H_FN void prep_avx2(const Args& a, int64_t row, float* qs, float* acc, float* m, float* l) {
    const int64_t D = a.head_dim, H = a.num_heads, V = D / 8;
    const float* q = a.q + row * H * D;
    const __m256 scale = _mm256_set1_ps(a.scale * UNSCALE<KV>);
    for (int64_t g = 0; g < H; g++) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        for (int64_t v = 0; v < V; v++) {
            _mm256_storeu_ps(acc + g * D + 8 * v, _mm256_setzero_ps());
            _mm256_storeu_ps(qs + g * D + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(q + g * D + 8 * v), scale));
        }
        if (std::is_same<KV, int8_t>::value) {  // the head's int16 codes and step, in place (QCodes)
            float* h = qs + g * D;
            const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
            __m256 amax8 = _mm256_setzero_ps();
            for (int64_t v = 0; v < V; v++) amax8 = _mm256_max_ps(amax8, _mm256_and_ps(_mm256_loadu_ps(h + 8 * v), magnitude));
            const float amax = hmax8(amax8);
            const float step = amax > 0.f ? amax / 32767.f : 1.f;
            const __m256 stepv = _mm256_set1_ps(step);
            alignas(32) int16_t codes[MAX_DIM + 8];
            for (int64_t v = 0; v < V; v += 2) {  // round to nearest (even), 16 at a time; an odd V's last 8 packed with 0
                const __m256i c0 = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(h + 8 * v), stepv));
                const __m256i c1 = v + 1 < V ? _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(h + 8 * v + 8), stepv))
                                             : _mm256_setzero_si256();
                _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * v),
                                   _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8));
            }
            std::memcpy(h, codes, D * sizeof(int16_t));
            h[D / 2] = step;
        }
    }
}

// Which types the AVX2 loop takes a KV head's query heads together for, so that each K and V vector
// is widened once for the group: all but float32, which has nothing to widen. The groups are of up
// to four heads: a GQA group of 3 or 4 in one pass, 7 in two (4 + 3). int8's scores are the
// exception: they go two heads at a time (SCORE_GROUP). Its integer scores widen K in one
// instruction, and four heads' 2-token score vectors cost more in query loads and reductions than
// they save. A (head, token) score and a V element take the same operations in the same order
// whatever the group, so the output is the same bits as before grouping (decode_attention.py
// --baseline-lib, every dtype, 9/3 and 32/8 heads).
// Against the loop before (pairs for the 1-byte types, one head at a time for the 16-bit ones), on
// the 2-core AVX2 host:
//   - in cache (one core, 16 rows x 500 tokens, 9/3 heads x 64, best of ~3 s, two runs): bfloat16
//     1.15-1.22x, float16 0.96-1.02x, e4m3 1.18-1.19x, e5m2 1.20-1.25x, int8 1.02-1.05x;
//   - 64 scattered rows x 2,000, 2 threads, the same run: e4m3 1.08-1.13x, e5m2 1.07-1.12x at 9/3 x 64
//     and 1.18x / 1.13x at 32/8 x 128; bfloat16 0.96x and 1.25x, float16 0.93-0.96x and 1.04x,
//     int8 0.87-1.13x and 1.00x, where float32 (unchanged code) read 0.95-0.97x (an A/A run: 0.92-1.04x).
// Before, the same measure found pairs cost float32 1/0.78 and bfloat16 1/0.87 of the time; the
// groups of four here also group the V sums, which pairs of 16-bit types did not pay for.
template <typename KV>
constexpr bool GROUPED = sizeof(KV) <= 2;
template <typename KV>
constexpr int SCORE_GROUP = std::is_same<KV, int8_t>::value ? 2 : 4;

// GROUPED types on AVX2: heads g .. end - 1 of one KV head in groups of SCORE_GROUP, then those left
template <typename KV>
AVX2H void score_groups(const Args& a, const float* qs, const KV* kh, const int64_t* at, int64_t n,
                        const float* ks, int64_t g, int64_t end, float (*s)[CHUNK], NextChunkPrefetch& prefetch) {
    constexpr int M = SCORE_GROUP<KV>;
    for (; g + M <= end; g += M) score_group<KV, M>(a, qs, kh, at, n, ks, g, s, prefetch);
    if constexpr (M == 4) {
        if (end - g == 3) score_group<KV, 3>(a, qs, kh, at, n, ks, g, s, prefetch);
        if (end - g == 2) score_group<KV, 2>(a, qs, kh, at, n, ks, g, s, prefetch);
    }
    if (end - g == 1) score_group<KV, 1>(a, qs, kh, at, n, ks, g, s, prefetch);
}

// ... and their V sums: groups of four, then the 3, 2 or 1 left
template <typename KV>
AVX2H void v_groups(const Args& a, float* acc, const KV* vh, const int64_t* at, int64_t n, float (*s)[CHUNK],
                    const float* corr, int64_t g, int64_t end, NextChunkPrefetch& prefetch) {
    for (; g + 4 <= end; g += 4) v_group<KV, 4>(a, acc, vh, at, n, s, g, corr, prefetch);
    if (end - g == 3) v_group<KV, 3>(a, acc, vh, at, n, s, g, corr, prefetch);
    if (end - g == 2) v_group<KV, 2>(a, acc, vh, at, n, s, g, corr, prefetch);
    if (end - g == 1) v_group<KV, 1>(a, acc, vh, at, n, s, g, corr, prefetch);
}

// Each of the chunk's n positions' offset in the scale arrays (the slot times num_kv_heads): run_scales_avx2's idx
inline void scale_offsets(const Args& a, const int64_t* slots, int64_t n, int32_t* idx) {
    for (int64_t t = 0; t < n; t++) idx[t] = (int32_t)(slots[t] * a.num_kv_heads);
}

// out[t] = the scale of the chunk's position t for kv head kvh (t < n), 1 past n, for t < CHUNK: each
// group of 8 positions' scales gathered from their rows (idx: scale_offsets; lanes past n are not read)
// and stored as one vector. Scalar loads and stores here cost the int8 kernel ~15% of its time (a
// vector load of 8 just-stored scalars waits for them; decode_attention.py shape). The AVX-512 loop
// gathers them so too: its int8 kernel 1.03-1.05x faster, in cache and at 64 rows (2-core AVX-512 host).
AVX2H void run_scales_avx2(const float* scales, const int32_t* idx, int64_t n, int64_t kvh, float* out) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t t0 = 0; t0 < CHUNK; t0 += 8) {
        __m256 v = _mm256_set1_ps(1.f);
        if (t0 < n) {
            const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - t0)), lane);
            v = _mm256_mask_i32gather_ps(v, scales + kvh, _mm256_load_si256(reinterpret_cast<const __m256i*>(idx + t0)),
                                         _mm256_castsi256_ps(live), 4);
        }
        _mm256_store_ps(out + t0, v);
    }
}

template <typename KV>
AVX2H_FN void chunk_avx2(const Args& a, const float* qs, float* acc, float* m, float* l,
                         const int64_t* slots, int64_t n, NextChunkPrefetch& prefetch) {
    const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, H = a.num_heads;
    const KV* kc = static_cast<const KV*>(a.k_cache);
    const KV* vc = static_cast<const KV*>(a.v_cache);
    alignas(32) float s[MAX_HEADS][CHUNK];
    alignas(32) float ks[CHUNK], vs[CHUNK], corr[MAX_HEADS];  // int8: the chunk's scales
    // each position's element offset in the cache; the positions past n up to a multiple of 8 repeat
    // the last one (a score group reads them, then sets their scores to -inf)
    int64_t at[CHUNK];
    const int64_t stride = a.num_kv_heads * D;
    for (int64_t t = 0; t < (n + 7) / 8 * 8; t++) at[t] = slots[std::min<int64_t>(t, n - 1)] * stride;
    alignas(32) int32_t scale_at[CHUNK];  // int8: each position's offset in the scale arrays
    if (SCALED<KV>) scale_offsets(a, slots, n, scale_at);
    // scores: GROUPED types take the query heads of one KV head together (score_groups), the others
    // one at a time
    for (int64_t kvh = 0; kvh < a.num_kv_heads; kvh++) {
        const KV* kh = kc + kvh * D;
        if (SCALED<KV>) run_scales_avx2(a.k_scale, scale_at, n, kvh, ks);
        if (GROUPED<KV>)
            score_groups<KV>(a, qs, kh, at, n, ks, kvh * G, kvh * G + G, s, prefetch);
        else
            for (int64_t g = kvh * G; g < kvh * G + G; g++) score_group<KV, 1>(a, qs, kh, at, n, ks, g, s, prefetch);
    }
    for (int64_t g = 0; g < H; g++) cap_scores(a, s[g], n);
    // acc = acc * corr + sum_t p_t v_t: int8's weights take the V scales first (after l summed them
    // unscaled). GROUPED types: every head's softmax, then the heads of one KV head together; the
    // others head by head, each V pass right after its softmax
    for (int64_t kvh = 0; kvh < a.num_kv_heads; kvh++) {
        const KV* vh = vc + kvh * D;
        if (SCALED<KV>) run_scales_avx2(a.v_scale, scale_at, n, kvh, vs);
        if (GROUPED<KV>) {
            for (int64_t h = kvh * G; h < kvh * G + G; h++)
                corr[h] = softmax8(s[h], n, m[h], l[h], SCALED<KV> ? vs : nullptr);
            v_groups<KV>(a, acc, vh, at, n, s, corr, kvh * G, kvh * G + G, prefetch);
        } else {
            for (int64_t g = kvh * G; g < kvh * G + G; g++) {
                corr[g] = softmax8(s[g], n, m[g], l[g], SCALED<KV> ? vs : nullptr);
                v_group<KV, 1>(a, acc, vh, at, n, s, g, corr, prefetch);
            }
        }
    }
}

// ---------------------------------------------------------------- AVX-512 (head_dim % 16 == 0)
// The AVX2 loop's structure at twice the width, with two changes the width calls for: a score's
// 16 lanes fold to 8 before the shared transposing reduction, and the V accumulation keeps two
// sets of accumulators (even and odd tokens) so that head_dim 64 still has 8 independent FMA chains.

#define AVX512_TARGET BRISK_WIDEN_AVX512_TARGET
#define AVX512 __attribute__((target(AVX512_TARGET), always_inline)) inline

using widen::load16;  // float, bf16, f16 (simd_widen.h); the 8-bit types below
AVX512 __m128i bytes16(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
AVX512 __m512 load16(const e5m2_t* p) { return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes16(p)), 8)); }
// e4m3 as AVX2's load8 reads it: 1/UNSCALE of the value (prep_avx512 and the merge make up for it)
AVX512 __m512 load16(const e4m3_t* p) {
    const __m256i b = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes16(p)), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(b, _mm256_set1_epi16(static_cast<short>(0xBFFF))));
}
AVX512 __m512 load16(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(p))); }

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

// For GS heads sharing one KV head: acc_g[0 .. 16W) = acc_g * corr_g + sum over t < n of
// p_g[t] * v[slots[t] * stride + (0 .. 16W)], acc_g = acc + g * D. Even and odd positions sum apart
// (8 independent FMA chains at head_dim 64 for one head). Each V vector is widened once for all GS
// heads; an element gets the same operations in the same order whatever GS is.
template <typename KV, int GS, int W>
AVX512 void accumulate_v16(float* acc, int64_t D, const KV* v, const int64_t* slots, const float* const* p, int64_t n,
                           int64_t stride, const float* corr) {
    __m512 x[GS][W], y[GS][W];
    for (int g = 0; g < GS; g++)
        for (int w = 0; w < W; w++) {
            x[g][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * w), _mm512_set1_ps(corr[g]));
            y[g][w] = _mm512_setzero_ps();
        }
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
        __m512 p0[GS], p1[GS];
        for (int g = 0; g < GS; g++) {
            p0[g] = _mm512_set1_ps(p[g][t]);
            p1[g] = _mm512_set1_ps(p[g][t + 1]);
        }
        const KV* r0 = v + slots[t] * stride;
        const KV* r1 = v + slots[t + 1] * stride;
        for (int w = 0; w < W; w++) {
            const __m512 v0 = load16(r0 + 16 * w), v1 = load16(r1 + 16 * w);
            for (int g = 0; g < GS; g++) {
                x[g][w] = _mm512_fmadd_ps(p0[g], v0, x[g][w]);
                y[g][w] = _mm512_fmadd_ps(p1[g], v1, y[g][w]);
            }
        }
    }
    if (t < n) {
        for (int w = 0; w < W; w++) {
            const __m512 v0 = load16(v + slots[t] * stride + 16 * w);
            for (int g = 0; g < GS; g++) x[g][w] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][t]), v0, x[g][w]);
        }
    }
    for (int g = 0; g < GS; g++)
        for (int w = 0; w < W; w++) _mm512_storeu_ps(acc + g * D + 16 * w, _mm512_add_ps(x[g][w], y[g][w]));
}

// all of head_dim for GS heads, in passes of 8 vectors for one head and 4 for two or three (2 x GS x W
// accumulators: 16, 16, 24 of AVX-512's 32 registers)
template <typename KV, int GS>
AVX512 void v_heads16(float* acc, int64_t D, const KV* vh, const int64_t* slots, const float* const* p, int64_t n,
                      int64_t stride, const float* corr) {
    const int64_t V = D / 16;
    int64_t v0 = 0;
    if constexpr (GS == 1)
        for (; v0 + 8 <= V; v0 += 8) accumulate_v16<KV, GS, 8>(acc + 16 * v0, D, vh + 16 * v0, slots, p, n, stride, corr);
    for (; v0 + 4 <= V; v0 += 4) accumulate_v16<KV, GS, 4>(acc + 16 * v0, D, vh + 16 * v0, slots, p, n, stride, corr);
    for (; v0 < V; v0++) accumulate_v16<KV, GS, 1>(acc + 16 * v0, D, vh + 16 * v0, slots, p, n, stride, corr);
}

// int8 K on AVX-512, as on AVX2 (QCodes): the query as int16 codes per head (prep_avx512), 32 of K's codes
// sign-extended to int16 in one instruction meet them in vpmaddwd, and the int32 sums are exact; a score is
// the head's step x the position's K scale x its integer sum. Where widening to float took 2 instructions
// per 16 codes and a multiply-add per head, this takes 1 per 32 and 2 per head. A head_dim that is a
// multiple of 16, not of 32, reads its last 16 codes alone (the upper lanes 0: whatever follows the query's
// codes adds nothing). On a 2-core AVX-512 Xeon against widened float scores (decode_attention.py
// --baseline-lib): decode rows 1.04-1.08x (scattered, cache read cold, and in order), prompt tiles 1.43x
// (--chunk 256 --rows 512: the tiles, no longer staged, widen nothing for their scores); the engine's decode
// with int8 KV 1.05x (kv_decode.py, 16 x 2,000 tokens); kv_accuracy.py's int8 KL 7.36e-4 against 7.28e-4.
template <int GS>
AVX512 void score_group16_i8(const float* qs, int64_t D, const int8_t* kh, const int64_t* slots, int64_t n,
                             int64_t stride, const float* ks, int64_t g0, float (*s)[CHUNK],
                             NextChunkPrefetch& prefetch) {
    const int16_t* codes[GS];
    float step[GS];
    for (int g = 0; g < GS; g++) {
        const QCodes c = qcodes(qs + (g0 + g) * D, D);
        codes[g] = c.codes;
        step[g] = c.step;
    }
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const int8_t* rows8[8];
        for (int j = 0; j < 8; j++) rows8[j] = kh + slots[std::min<int64_t>(t0 + j, n - 1)] * stride;
        __m512i d[GS][8];
        for (int g = 0; g < GS; g++)
            for (int j = 0; j < 8; j++) d[g][j] = _mm512_setzero_si512();
        for (int64_t e = 0; e < D; e += 32) {
            const bool half = e + 32 > D;
            __m512i q[GS];
            for (int g = 0; g < GS; g++) q[g] = _mm512_loadu_si512(codes[g] + e);
            for (int j = 0; j < 8; j++) {
                const __m512i k = half ? _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(bytes16(rows8[j] + e)))
                                       : _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows8[j] + e)));
                for (int g = 0; g < GS; g++) d[g][j] = _mm512_add_epi32(d[g][j], _mm512_madd_epi16(q[g], k));
            }
        }
        for (int g = 0; g < GS; g++) {
            __m256i h[8];
            for (int j = 0; j < 8; j++)
                h[j] = _mm256_add_epi32(_mm512_castsi512_si256(d[g][j]), _mm512_extracti64x4_epi64(d[g][j], 1));
            const __m256 sums = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hsum8x8_epi32(h)), _mm256_set1_ps(step[g])),
                                              _mm256_load_ps(ks + t0));
            store_scores<1>(s, g0 + g, t0, sums, n - t0);
            prefetch.k_step();
        }
    }
}

// The scores of heads g0 .. g0 + GS - 1 of one KV head over the chunk, 8 positions at a time, into s
// (times ks, int8's K scales). Each K vector is widened once for the GS heads; a (head, position)
// score takes the same operations whatever GS is: one FMA chain over head_dim, fold16, hsum8x8.
template <typename KV, int GS>
AVX512 void score_group16(const float* qs, int64_t D, const KV* kh, const int64_t* slots, int64_t n, int64_t stride,
                          const float* ks, int64_t g0, float (*s)[CHUNK], NextChunkPrefetch& prefetch) {
    if constexpr (std::is_same<KV, int8_t>::value) {
        score_group16_i8<GS>(qs, D, kh, slots, n, stride, ks, g0, s, prefetch);
        return;
    }
    const int64_t V = D / 16;
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const KV* rows8[8];
        for (int j = 0; j < 8; j++) rows8[j] = kh + slots[std::min<int64_t>(t0 + j, n - 1)] * stride;
        __m512 d[GS][8];
        {
            __m512 q[GS];
            for (int g = 0; g < GS; g++) q[g] = _mm512_loadu_ps(qs + (g0 + g) * D);
            for (int j = 0; j < 8; j++) {
                const __m512 k = load16(rows8[j]);
                for (int g = 0; g < GS; g++) d[g][j] = _mm512_mul_ps(q[g], k);
            }
        }
        for (int64_t v = 1; v < V; v++) {
            __m512 q[GS];
            for (int g = 0; g < GS; g++) q[g] = _mm512_loadu_ps(qs + (g0 + g) * D + 16 * v);
            for (int j = 0; j < 8; j++) {
                const __m512 k = load16(rows8[j] + 16 * v);
                for (int g = 0; g < GS; g++) d[g][j] = _mm512_fmadd_ps(q[g], k, d[g][j]);
            }
        }
        for (int g = 0; g < GS; g++) {
            __m256 h[8];
            for (int j = 0; j < 8; j++) h[j] = fold16(d[g][j]);
            __m256 sums = hsum8x8(h);
            if (SCALED<KV>) sums = _mm256_mul_ps(sums, _mm256_load_ps(ks + t0));
            store_scores<1>(s, g0 + g, t0, sums, n - t0);
            prefetch.k_step();
        }
    }
}

// One head's online softmax over the chunk's scores (n16 vectors; those past the chunk -inf): s
// becomes the weights (times vscale, int8's V scales, when given: l sums them unscaled), m and l
// move on; returns the old sums' rescale (0 on the first chunk, m = -inf).
AVX512 float softmax16(float* s, int64_t n16, float& m, float& l, const float* vscale) {
    __m512 mx16 = _mm512_set1_ps(m);
    for (int64_t c = 0; c < n16; c++) mx16 = _mm512_max_ps(mx16, _mm512_load_ps(s + 16 * c));
    const float mx = _mm512_reduce_max_ps(mx16);
    const float corr = std::exp(m - mx);
    const __m512 mxv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < n16; c++) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(s + 16 * c), mxv));
        _mm512_store_ps(s + 16 * c, vscale ? _mm512_mul_ps(p, _mm512_load_ps(vscale + 16 * c)) : p);
        sum = _mm512_add_ps(sum, p);
    }
    l = l * corr + _mm512_reduce_add_ps(sum);
    m = mx;
    return corr;
}

template <typename KV>
__attribute__((target(AVX512_TARGET))) void prep_avx512(
        const Args& a, int64_t row, float* qs, float* acc, float* m, float* l) {
    const int64_t D = a.head_dim, H = a.num_heads, V = D / 16;
    const float* q = a.q + row * H * D;
    const __m512 scale = _mm512_set1_ps(a.scale * UNSCALE<KV>);
    for (int64_t g = 0; g < H; g++) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        for (int64_t v = 0; v < V; v++) {
            _mm512_storeu_ps(acc + g * D + 16 * v, _mm512_setzero_ps());
            _mm512_storeu_ps(qs + g * D + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * v), scale));
        }
        if constexpr (std::is_same<KV, int8_t>::value) {  // the head's int16 codes and step, in place (QCodes)
            float* h = qs + g * D;
            __m512 amax16 = _mm512_setzero_ps();
            for (int64_t v = 0; v < V; v++) amax16 = _mm512_max_ps(amax16, _mm512_abs_ps(_mm512_loadu_ps(h + 16 * v)));
            const float amax = _mm512_reduce_max_ps(amax16);
            const __m512 step = _mm512_set1_ps(amax > 0.f ? amax / 32767.f : 1.f);
            alignas(64) int16_t codes[MAX_DIM];
            for (int64_t v = 0; v < V; v++)  // round to nearest (even), as the AVX2 prep does
                _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 16 * v),
                                   _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(h + 16 * v), step))));
            std::memcpy(h, codes, D * sizeof(int16_t));
            h[D / 2] = _mm512_cvtss_f32(step);
        }
    }
}

// The types narrower than float32 take a KV head's query heads in groups of up to three (GROUPED16; the
// AVX2 loop's groups are of up to four): the group widens each K and V vector once. A group's scores keep
// GS x 8 accumulators, 24 of the 32 registers at three, so four would not fit. A GQA group of 3 (the demo)
// is one group, 4 (Llama 3 8B) two pairs, 7 three + two pairs. The same bits whatever the groups: a
// (head, position) score and a V element take the same operations in the same order.
// On a 16-core AVX-512 Xeon (decode_attention.py --baseline-lib, 2 threads, 64 rows x 2,000, median):
//   - pairs of 1-byte types against one head at a time: e4m3 1.16x, e5m2 1.21x, int8 1.13x at 9/3 heads
//     x 64; 1.41x, 1.45x, 1.30x at 32/8 x 128;
//   - these groups against those pairs (and the 16-bit types head by head), 9/3 x 64: e4m3 1.22x, e5m2
//     1.20x, int8 1.15x, bfloat16 1.07x, float16 1.02x; at 32/8 x 128 (two pairs either way for the 1-byte
//     types) 0.97-1.06x, where float32's unchanged code read 0.95x.
template <typename KV>
constexpr bool GROUPED16 = sizeof(KV) <= 2;
// the size of the next group when `left` heads of a KV head remain
inline int64_t group16(int64_t left) { return left == 1 ? 1 : left == 2 || left == 4 ? 2 : 3; }

// GROUPED16 types: the scores of heads g .. end - 1 of one KV head, group by group
template <typename KV>
AVX512 void score_groups16(const float* qs, int64_t D, const KV* kh, const int64_t* slots, int64_t n, int64_t stride,
                           const float* ks, int64_t g, int64_t end, float (*s)[CHUNK], NextChunkPrefetch& prefetch) {
    for (int64_t gs; g < end; g += gs) {
        gs = group16(end - g);
        if (gs == 3) score_group16<KV, 3>(qs, D, kh, slots, n, stride, ks, g, s, prefetch);
        if (gs == 2) score_group16<KV, 2>(qs, D, kh, slots, n, stride, ks, g, s, prefetch);
        if (gs == 1) score_group16<KV, 1>(qs, D, kh, slots, n, stride, ks, g, s, prefetch);
    }
}

// The V sums of heads g0 .. g0 + GS - 1 of one KV head (their weights s[g0 ..], their sums in acc's rows g0 ..)
template <typename KV, int GS>
AVX512 void v_group16(float* acc, int64_t D, const KV* vh, const int64_t* slots, int64_t n, int64_t stride,
                      float (*s)[CHUNK], const float* corr, int64_t g0, NextChunkPrefetch& prefetch) {
    const float* p[GS];
    for (int g = 0; g < GS; g++) p[g] = s[g0 + g];
    v_heads16<KV, GS>(acc + g0 * D, D, vh, slots, p, n, stride, corr + g0);
    for (int g = 0; g < GS; g++) prefetch.v_step();
}

// ... and GROUPED16 types' V sums, in the same groups
template <typename KV>
AVX512 void v_groups16(float* acc, int64_t D, const KV* vh, const int64_t* slots, int64_t n, int64_t stride,
                       float (*s)[CHUNK], const float* corr, int64_t g, int64_t end, NextChunkPrefetch& prefetch) {
    for (int64_t gs; g < end; g += gs) {
        gs = group16(end - g);
        if (gs == 3) v_group16<KV, 3>(acc, D, vh, slots, n, stride, s, corr, g, prefetch);
        if (gs == 2) v_group16<KV, 2>(acc, D, vh, slots, n, stride, s, corr, g, prefetch);
        if (gs == 1) v_group16<KV, 1>(acc, D, vh, slots, n, stride, s, corr, g, prefetch);
    }
}

template <typename KV>
__attribute__((target(AVX512_TARGET))) void chunk_avx512(
        const Args& a, const float* qs, float* acc, float* m, float* l, const int64_t* slots, int64_t n,
        NextChunkPrefetch& prefetch) {
    const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, H = a.num_heads;
    const int64_t stride = a.num_kv_heads * D;
    const KV* kc = static_cast<const KV*>(a.k_cache);
    const KV* vc = static_cast<const KV*>(a.v_cache);
    alignas(64) float s[MAX_HEADS][CHUNK];
    alignas(64) float ks[CHUNK], vs[CHUNK], corr[MAX_HEADS];  // int8: the chunk's scales
    const int64_t n16 = (n + 15) / 16;
    alignas(32) int32_t scale_at[CHUNK];  // int8: each position's offset in the scale arrays
    if (SCALED<KV>) scale_offsets(a, slots, n, scale_at);
    for (int64_t kvh = 0; kvh < a.num_kv_heads; kvh++) {
        const KV* kh = kc + kvh * D;
        if (SCALED<KV>) run_scales_avx2(a.k_scale, scale_at, n, kvh, ks);
        if constexpr (GROUPED16<KV>)
            score_groups16<KV>(qs, D, kh, slots, n, stride, ks, kvh * G, kvh * G + G, s, prefetch);
        else
            for (int64_t g = kvh * G; g < kvh * G + G; g++) score_group16<KV, 1>(qs, D, kh, slots, n, stride, ks, g, s, prefetch);
        // a 16-wide softmax pass reads s[g][n .. 16 * n16): past the chunk's scores, -inf
        for (int64_t h = kvh * G; h < kvh * G + G; h++)
            for (int64_t t = (n + 7) / 8 * 8; t < n16 * 16; t++) s[h][t] = -std::numeric_limits<float>::infinity();
    }
    for (int64_t g = 0; g < H; g++) cap_scores(a, s[g], n);
    // GROUPED16 types: every head's softmax, then the heads' V sums group by group; float32 head by head,
    // each V pass right after its softmax
    for (int64_t kvh = 0; kvh < a.num_kv_heads; kvh++) {
        const KV* vh = vc + kvh * D;
        const float* vscale = nullptr;
        if (SCALED<KV>) {
            run_scales_avx2(a.v_scale, scale_at, n, kvh, vs);
            vscale = vs;
        }
        if constexpr (GROUPED16<KV>) {
            for (int64_t h = kvh * G; h < kvh * G + G; h++) corr[h] = softmax16(s[h], n16, m[h], l[h], vscale);
            v_groups16<KV>(acc, D, vh, slots, n, stride, s, corr, kvh * G, kvh * G + G, prefetch);
        } else {
            for (int64_t g = kvh * G; g < kvh * G + G; g++) {
                corr[g] = softmax16(s[g], n16, m[g], l[g], vscale);
                v_group16<KV, 1>(acc, D, vh, slots, n, stride, s, corr, g, prefetch);
            }
        }
    }
}

// ---------------------------------------------------------------- AVX512-FP16: fp8 multiplied in float16
// On CPUs with AVX512-FP16 (Sapphire Rapids and later) fp8 K/V are not widened to float32: each 32 codes
// become 32 float16s in two or three instructions (exact: float16 holds every e4m3 and e5m2 value), and the
// products and their sums over a chunk run 32 lanes wide in float16, where widening to float32 took 5
// instructions per 16 e4m3 elements and twice the multiply-adds. What float16 costs, and how it is kept
// from overflowing:
//   - every float16 partial sum is bounded by HALF_LIMIT before it is formed: the query is scaled by a
//     power of two per head (prep_fp16) so that head_dim x max|q| x the type's largest value fits, and the
//     softmax weights (at most 1) so that CHUNK / 2 of them times the largest value fit. Powers of two are
//     exact, and the scores' and the V sums' factors undo them;
//   - a score is a sum of head_dim products rounded to float16 as it is formed, and a chunk's V sum one of
//     up to CHUNK / 2 weighted rows per accumulator before it joins the float32 sums: relative errors of a
//     few 2^-11, where fp8 itself rounds to 2^-4 (e4m3) and 2^-3 (e5m2). End to end (the demo model over a
//     2,048-token prompt) float16 moves the next-token distribution about as far from float32's as the
//     AVX2 and AVX-512 float32 loops are from each other (mean KL 6.5e-3 against 5.3e-3 on an e4m3 cache:
//     K/V rounded to fp8 turn any small change into a different code later), and each path's KL against
//     float32 KV falls within the float32 loops' spread (RESULTS.md). test_kv_dtypes.py holds the kernel
//     to float64 attention within a bound. int8 keeps its own loop (integer scores, float32 V sums): its
//     codes are finer, and float16 bought it 1.04x.
// The softmax, the running max and sum and the sums across chunks stay float32. The intrinsics need GCC 12
// or clang 14: an older compiler builds the kernels without this loop.
#if (defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 12)
#define BRISK_FP16_LOOP 1

#define FP16_TARGET AVX512_TARGET ",avx512fp16"
#define FP16 __attribute__((target(FP16_TARGET), always_inline)) inline

// 32 codes as float16, exact: e4m3 as 1/256 of its value (load16's sign-extend, shift and mask at 32
// lanes), e5m2 its own bits in the high byte
FP16 __m512h load32h(const e4m3_t* p) {
    const __m512i b = _mm512_slli_epi16(_mm512_cvtepi8_epi16(widen::load256(p)), 7);
    return _mm512_castsi512_ph(_mm512_and_si512(b, _mm512_set1_epi16(static_cast<short>(0xBFFF))));
}
FP16 __m512h load32h(const e5m2_t* p) {
    return _mm512_castsi512_ph(_mm512_slli_epi16(_mm512_cvtepu8_epi16(widen::load256(p)), 8));
}

// the largest magnitude load32h gives (UNSCALE: what its values are short of the true ones by)
template <typename KV>
constexpr float HALF_MAX = 57344.f;  // e5m2
template <>
constexpr float HALF_MAX<e4m3_t> = 448.f / kvt::E4M3_UNSCALE;
constexpr float HALF_LIMIT = 32752.f;  // half of float16's largest: room for rounding
template <typename KV>
constexpr bool HALF_ARITHMETIC = std::is_same<KV, e4m3_t>::value || std::is_same<KV, e5m2_t>::value;

// A power of two c with c * x <= limit, at least half the largest such (x > 0 and finite, else 1;
// c within 2^-60 .. 2^60): from the exponent bits of limit and x, no division
constexpr float pow2_within(float limit, float x) {
    if (!(x > 0.f) || !(x <= std::numeric_limits<float>::max())) return 1.f;
    // x < 2^(ex + 1) and 2^el <= limit: c = 2^(el - ex - 1)
    const int e = std::clamp((int)(__builtin_bit_cast(uint32_t, limit) >> 23) - (int)(__builtin_bit_cast(uint32_t, x) >> 23) - 1, -60, 60);
    return __builtin_bit_cast(float, (uint32_t)(127 + e) << 23);
}

// prep for the float16 loop: qs holds the scaled query as float16 [H, D] (the first H * D / 2 floats),
// then [H] the factor each head's float16 scores are short of the true ones by
template <typename KV>
__attribute__((target(FP16_TARGET))) void prep_fp16(const Args& a, int64_t row, float* qs, float* acc, float* m,
                                                    float* l) {
    const int64_t D = a.head_dim, H = a.num_heads, V = D / 16;
    const float* q = a.q + row * H * D;
    _Float16* qh = reinterpret_cast<_Float16*>(qs);
    float* unscale = qs + H * D / 2;
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int64_t g = 0; g < H; g++) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        __m512 mx = _mm512_setzero_ps();
        for (int64_t v = 0; v < V; v++) {
            _mm512_storeu_ps(acc + g * D + 16 * v, _mm512_setzero_ps());
            mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * v), scale)));
        }
        const float c = pow2_within(HALF_LIMIT / ((float)D * HALF_MAX<KV>), _mm512_reduce_max_ps(mx));
        for (int64_t v = 0; v < V; v++) {
            const __m512 x = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * v), scale), _mm512_set1_ps(c));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(qh + g * D + 16 * v),
                                _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        unscale[g] = UNSCALE<KV> / c;
    }
}

// The sums of 8 float16 vectors' 32 lanes each, as 8 floats: a fixed tree of adds (128-bit blocks
// first, then within them), the same whatever the heads around it
FP16 __m256 hsum8x32h(const __m512h* d) {
    __m512h s[4], t[2];
    for (int i = 0; i < 4; i++) {  // s[i]'s blocks: d[2i]'s halves' sums (2), then d[2i + 1]'s (2)
        const __m512 x = _mm512_castph_ps(d[2 * i]), y = _mm512_castph_ps(d[2 * i + 1]);
        s[i] = _mm512_add_ph(_mm512_castps_ph(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0))),
                             _mm512_castps_ph(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2))));
    }
    for (int i = 0; i < 2; i++) {  // block b of t[i]: vector 4i + b's 8 partial sums
        const __m512 x = _mm512_castph_ps(s[2 * i]), y = _mm512_castph_ps(s[2 * i + 1]);
        t[i] = _mm512_add_ph(_mm512_castps_ph(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0))),
                             _mm512_castps_ph(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1))));
    }
    const __m512 x = _mm512_castph_ps(t[0]), y = _mm512_castph_ps(t[1]);
    // block b's 32-bit words: vector b (2 sums), 4 + b (2), b (2), 4 + b (2)
    __m512h u = _mm512_add_ph(_mm512_castps_ph(_mm512_unpacklo_ps(x, y)), _mm512_castps_ph(_mm512_unpackhi_ps(x, y)));
    u = _mm512_add_ph(u, _mm512_castps_ph(_mm512_permute_ps(_mm512_castph_ps(u), _MM_SHUFFLE(1, 0, 3, 2))));
    u = _mm512_add_ph(u, _mm512_castsi512_ph(_mm512_srli_epi32(_mm512_castph_si512(u), 16)));
    // vector b's sum in block b's float16 0, vector 4 + b's in its float16 2
    alignas(64) static const uint16_t order[32] = {0, 8, 16, 24, 2, 10, 18, 26};
    const __m512i sums = _mm512_permutexvar_epi16(_mm512_load_si512(order), _mm512_castph_si512(u));
    return _mm256_cvtph_ps(_mm512_castsi512_si128(sums));
}

// The scores of heads g0 .. g0 + GS - 1 of one KV head over the chunk, 8 positions at a time, into s:
// score_group16's walk, in float16
template <typename KV, int GS>
FP16 void score_group_h(const _Float16* qh, const float* unscale, int64_t D, const KV* kh, const int64_t* slots,
                        int64_t n, int64_t stride, int64_t g0, float (*s)[CHUNK], NextChunkPrefetch& prefetch) {
    const int64_t V = D / 32;
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const KV* rows8[8];
        for (int j = 0; j < 8; j++) rows8[j] = kh + slots[std::min<int64_t>(t0 + j, n - 1)] * stride;
        __m512h d[GS][8];
        {
            __m512h q[GS];
            for (int g = 0; g < GS; g++) q[g] = _mm512_loadu_ph(qh + (g0 + g) * D);
            for (int j = 0; j < 8; j++) {
                const __m512h k = load32h(rows8[j]);
                for (int g = 0; g < GS; g++) d[g][j] = _mm512_mul_ph(q[g], k);
            }
        }
        for (int64_t v = 1; v < V; v++) {
            __m512h q[GS];
            for (int g = 0; g < GS; g++) q[g] = _mm512_loadu_ph(qh + (g0 + g) * D + 32 * v);
            for (int j = 0; j < 8; j++) {
                const __m512h k = load32h(rows8[j] + 32 * v);
                for (int g = 0; g < GS; g++) d[g][j] = _mm512_fmadd_ph(q[g], k, d[g][j]);
            }
        }
        for (int g = 0; g < GS; g++) {
            store_scores<1>(s, g0 + g, t0, _mm256_mul_ps(hsum8x32h(d[g]), _mm256_set1_ps(unscale[g0 + g])), n - t0);
            prefetch.k_step();
        }
    }
}

// One head's weights (s: n16 vectors, in [0, 1]) times a power of two that keeps a V accumulator's CHUNK / 2
// terms within HALF_LIMIT, as float16, each in both halves of a 32-bit word (a 32-bit broadcast load gives
// the V loop its float16 weight). Returns the factor the V sums are short of the true ones by.
template <typename KV>
FP16 float weights_h(const float* s, int64_t n16, uint32_t* w) {
    constexpr float c = pow2_within(HALF_LIMIT / (HALF_MAX<KV> * (CHUNK / 2)), 1.f);
    for (int64_t i = 0; i < n16; i++) {
        const __m256i h = _mm512_cvtps_ph(_mm512_mul_ps(_mm512_load_ps(s + 16 * i), _mm512_set1_ps(c)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i x = _mm512_cvtepu16_epi32(h);
        _mm512_store_si512(w + 16 * i, _mm512_or_si512(x, _mm512_slli_epi32(x, 16)));
    }
    return UNSCALE<KV> / c;
}

// acc_g[0 .. 32W) = acc_g * corr_g + unscale_g * (sum over t < n of w_g[t] * v[slots[t] * stride + (0 .. 32W)]),
// the sum in float16 (even and odd positions apart), acc_g = acc + g * D
template <typename KV, int GS, int W>
FP16 void accumulate_v_h(float* acc, int64_t D, const KV* v, const int64_t* slots, const uint32_t* const* w,
                         int64_t n, int64_t stride, const float* corr, const float* unscale) {
    __m512h x[GS][W], y[GS][W];
    for (int g = 0; g < GS; g++)
        for (int i = 0; i < W; i++) x[g][i] = y[g][i] = _mm512_setzero_ph();
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
        __m512h p0[GS], p1[GS];
        for (int g = 0; g < GS; g++) {
            p0[g] = _mm512_castsi512_ph(_mm512_set1_epi32((int)w[g][t]));
            p1[g] = _mm512_castsi512_ph(_mm512_set1_epi32((int)w[g][t + 1]));
        }
        const KV* r0 = v + slots[t] * stride;
        const KV* r1 = v + slots[t + 1] * stride;
        for (int i = 0; i < W; i++) {
            const __m512h v0 = load32h(r0 + 32 * i), v1 = load32h(r1 + 32 * i);
            for (int g = 0; g < GS; g++) {
                x[g][i] = _mm512_fmadd_ph(p0[g], v0, x[g][i]);
                y[g][i] = _mm512_fmadd_ph(p1[g], v1, y[g][i]);
            }
        }
    }
    if (t < n)
        for (int i = 0; i < W; i++) {
            const __m512h v0 = load32h(v + slots[t] * stride + 32 * i);
            for (int g = 0; g < GS; g++)
                x[g][i] = _mm512_fmadd_ph(_mm512_castsi512_ph(_mm512_set1_epi32((int)w[g][t])), v0, x[g][i]);
        }
    for (int g = 0; g < GS; g++)
        for (int i = 0; i < W; i++) {
            const __m512i h = _mm512_castph_si512(_mm512_add_ph(x[g][i], y[g][i]));
            float* o = acc + g * D + 32 * i;
            const __m512 c = _mm512_set1_ps(corr[g]), u = _mm512_set1_ps(unscale[g]);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), u,
                                                _mm512_mul_ps(_mm512_loadu_ps(o), c)));
            _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), u,
                                                     _mm512_mul_ps(_mm512_loadu_ps(o + 16), c)));
        }
}

// The V sums of heads g0 .. g0 + GS - 1 of one KV head, over head_dim in passes of 64 elements (GS x 2 x 2
// float16 accumulators) and a last one of 32
template <typename KV, int GS>
FP16 void v_group_h(float* acc, int64_t D, const KV* vh, const int64_t* slots, int64_t n, int64_t stride,
                    uint32_t (*w)[CHUNK], const float* corr, const float* unscale, int64_t g0,
                    NextChunkPrefetch& prefetch) {
    const uint32_t* p[GS];
    for (int g = 0; g < GS; g++) p[g] = w[g0 + g];
    int64_t i = 0;
    for (; i + 64 <= D; i += 64)
        accumulate_v_h<KV, GS, 2>(acc + g0 * D + i, D, vh + i, slots, p, n, stride, corr + g0, unscale + g0);
    if (i < D) accumulate_v_h<KV, GS, 1>(acc + g0 * D + i, D, vh + i, slots, p, n, stride, corr + g0, unscale + g0);
    for (int g = 0; g < GS; g++) prefetch.v_step();
}

template <typename KV>
__attribute__((target(FP16_TARGET))) void chunk_fp16(const Args& a, const float* qs, float* acc, float* m, float* l,
                                                     const int64_t* slots, int64_t n, NextChunkPrefetch& prefetch) {
    const int64_t D = a.head_dim, G = a.num_heads / a.num_kv_heads, H = a.num_heads;
    const int64_t stride = a.num_kv_heads * D;
    const KV* kc = static_cast<const KV*>(a.k_cache);
    const KV* vc = static_cast<const KV*>(a.v_cache);
    const _Float16* qh = reinterpret_cast<const _Float16*>(qs);
    const float* unscale_q = qs + H * D / 2;
    alignas(64) float s[MAX_HEADS][CHUNK];
    alignas(64) uint32_t w[MAX_HEADS][CHUNK];
    alignas(64) float corr[MAX_HEADS], unscale_v[MAX_HEADS];
    const int64_t n16 = (n + 15) / 16;
    for (int64_t kvh = 0; kvh < a.num_kv_heads; kvh++) {
        const KV* kh = kc + kvh * D;
        for (int64_t g = kvh * G, gs, end = kvh * G + G; g < end; g += gs) {
            gs = group16(end - g);
            if (gs == 3) score_group_h<KV, 3>(qh, unscale_q, D, kh, slots, n, stride, g, s, prefetch);
            if (gs == 2) score_group_h<KV, 2>(qh, unscale_q, D, kh, slots, n, stride, g, s, prefetch);
            if (gs == 1) score_group_h<KV, 1>(qh, unscale_q, D, kh, slots, n, stride, g, s, prefetch);
        }
        for (int64_t h = kvh * G; h < kvh * G + G; h++)
            for (int64_t t = (n + 7) / 8 * 8; t < n16 * 16; t++) s[h][t] = -std::numeric_limits<float>::infinity();
    }
    // every head's weights before any V sums: the heads' softmax chains (max, exp, sum) overlap
    for (int64_t h = 0; h < H; h++) {
        cap_scores(a, s[h], n);
        corr[h] = softmax16(s[h], n16, m[h], l[h], nullptr);
        unscale_v[h] = weights_h<KV>(s[h], n16, w[h]);
    }
    for (int64_t kvh = 0; kvh < a.num_kv_heads; kvh++) {
        const KV* vh = vc + kvh * D;
        for (int64_t g = kvh * G, gs, end = kvh * G + G; g < end; g += gs) {
            gs = group16(end - g);
            if (gs == 3) v_group_h<KV, 3>(acc, D, vh, slots, n, stride, w, corr, unscale_v, g, prefetch);
            if (gs == 2) v_group_h<KV, 2>(acc, D, vh, slots, n, stride, w, corr, unscale_v, g, prefetch);
            if (gs == 1) v_group_h<KV, 1>(acc, D, vh, slots, n, stride, w, corr, unscale_v, g, prefetch);
        }
    }
}

#else
#define BRISK_FP16_LOOP 0
#endif  // the float16 loop

// ---------------------------------------------------------------- rows in tiles

// float32 K/V on the AVX-512 loop prefetch the next chunk into L2 rather than L1: on a 2-core AVX-512 Xeon
// (Sapphire Rapids class) the engine's decode ran 1.10-1.12x faster with float32 KV (kv_decode.py
// --baseline-lib, 16 x 2,000 tokens, two runs) and the kernel 1.12x cold, 1.17x warm; the other types
// 0.98-1.01x either way. On an AVX2 EPYC an earlier kernel ran 0.92x with L2 prefetches, so the AVX2 and
// portable loops keep L1's.
template <typename KV, void (*Chunk)(const Args&, const float*, float*, float*, float*, const int64_t*, int64_t,
                                     NextChunkPrefetch&)>
constexpr bool L2_PREFETCH = std::is_same<KV, float>::value && Chunk == chunk_avx512<float>;

constexpr int TILE = 8;  // prompt rows that walk their context together

// The rows and positions of one work item: item i is tile i / parts (up to TILE rows that continue one
// another) over the positions of part i % parts; rows with nothing there (before a part's start, or a
// sliding window's) are left out: rows first .. first + count - 1 of the tile are live.
struct ItemSpan {
    int64_t row0 = 0, first = 0, count = 0;
    int64_t start[TILE], end[TILE];
};

// Hands work items out to the workers, in order, each once. A worker claims the item it runs next
// when the one it runs reaches its last chunk (tile_item), so that chunk prefetches the next item's
// first one; otherwise every item starts on K/V lines not yet read. On a 2-core AVX-512 Xeon (64 rows
// x 2,000 tokens, 4 items a row, cache read cold) the kernel ran 1.03-1.06x faster for the 1-byte
// types, 1.00-1.02x for the wider ones, and the engine's decode 1.02x with fp8 and int8 KV (float32
// 0.99x); prefetching the next item's query and state lines as well gained nothing. An item the
// worker does not claim ahead from (an empty one, a staged tile) leaves the claim to the worker's
// loop: the order stays first come, first served, one chunk earlier at most.
struct ItemQueue {
    std::atomic<int64_t> next{0};
    int64_t items = 0, parts = 1, part_tokens = 0, window = 0;
    const int64_t* tile_at = nullptr;  // tile t: rows tile_at[t] .. tile_at[t + 1] - 1
    const int32_t* lens = nullptr;

    int64_t claim() { return next.fetch_add(1, std::memory_order_relaxed); }
    ItemSpan span(int64_t i) const {
        ItemSpan s;
        s.row0 = tile_at[i / parts];
        const int64_t nrows = tile_at[i / parts + 1] - s.row0, part = i % parts;
        s.first = nrows;
        int64_t live = 0;
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t len = lens[s.row0 + r];
            // a sliding window (> 0) sees only the row's last `window` positions: earlier parts are
            // empty and earlier blocks are never read (they may be freed, padded with block 0)
            const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
            s.start[r] = std::max<int64_t>(part * part_tokens, first);
            s.end[r] = std::min<int64_t>(part * part_tokens + part_tokens, len);
            if (s.start[r] < s.end[r]) {
                s.first = std::min(s.first, r);
                live = r + 1;
            }
        }
        s.count = std::max<int64_t>(0, live - s.first);
        return s;
    }
};

// A worker's place in the queue: the item it runs, and the one it has claimed to run next (-1: none yet)
struct ItemCursor {
    ItemQueue* queue = nullptr;
    int64_t claimed = -1;
    // Claims the next item (once) and returns its first live row's span, for a prefetch; count 0:
    // nothing to prefetch (the queue is empty, or the item has no positions)
    ItemSpan claim_next() {
        ItemSpan s;
        if (queue == nullptr || claimed >= 0) return s;
        claimed = queue->claim();
        if (claimed < queue->items) s = queue->span(claimed);
        return s;
    }
};

using ItemFnT = void (*)(const Args&, int64_t, int64_t, const int64_t*, const int64_t*, float* const*, ItemCursor*);

// One work item: rows row0 .. row0 + nrows - 1 (a tile: consecutive positions of one sequence, so
// the same block table; or a single row) over their positions [start_r, end_r) of one part. The
// rows advance chunk by chunk in step, so each chunk's K/V, read from memory for the first row, is
// in cache for the others; every row gets exactly the chunks and calls it would get alone.
template <typename KV, void (*Prep)(const Args&, int64_t, float*, float*, float*, float*),
          void (*Chunk)(const Args&, const float*, float*, float*, float*, const int64_t*, int64_t, NextChunkPrefetch&)>
void tile_item(const Args& a, int64_t row0, int64_t nrows, const int64_t* start, const int64_t* end,
               float* const* state, ItemCursor* cursor) {
    const int64_t D = a.head_dim, H = a.num_heads;
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
            int64_t slots[CHUNK];
            const int64_t n = chunk_slots(a, table, pos[r], end[r], CHUNK_SPAN<KV>, slots);
            float* acc = state[r];
            if (r == 0) {
                // the first row's next chunk, or on its last one the first chunk of the worker's next item
                const ItemSpan following = pos[r] + n < end[r] ? ItemSpan() : cursor->claim_next();
                NextChunkPrefetch prefetch =
                    following.count == 0
                        ? NextChunkPrefetch(a, table, pos[r] + n, end[r], kc, vc, H * ((n + 7) / 8))
                        : NextChunkPrefetch(a, a.block_tables + (following.row0 + following.first) * a.max_blocks,
                                            following.start[following.first], following.end[following.first], kc,
                                            vc, H * ((n + 7) / 8));
                prefetch.to_l2 = L2_PREFETCH<KV, Chunk>;
                Chunk(a, qs_buf.data() + r * H * D, acc, acc + H * D, acc + H * D + H, slots, n, prefetch);
            } else {
                NextChunkPrefetch none;
                Chunk(a, qs_buf.data() + r * H * D, acc, acc + H * D, acc + H * D + H, slots, n, none);
            }
            pos[r] += n;
        }
    }
}

// ---------------------------------------------------------------- a tile's chunks widened once
// The in-place loops widen a narrow K/V element once per group of query heads that read it (GROUPED,
// GROUPED16) and, in a tile, once per row: a prompt chunk's 8 rows widen each chunk 8 times, times
// the number of groups (more on the portable loop, head by head). The staged item widens each chunk
// once per tile into a float32 buffer laid out like a float32 cache holding the chunk's
// positions in slots 0 .. n (CHUNK positions: a few KB in L1/L2, never a copy of the context) and
// runs the same loop on it. It takes the same chunks as the in-place item and the loop gets the
// same float32 values (widening is exact; int8 keeps its scales apart, applied as the in-place
// loop applies them), so a row's result is bit for bit the same on both: a tile may take one and a
// lone row the other. The AVX2 and AVX-512 int8 loops read the codes themselves (integer scores), so
// their staged buffer holds the codes as they are (copy_row) and staging is off by default there.

struct scaled_f32 {  // int8 widened, its scales still to apply
    float v;
};
template <>
constexpr bool SCALED<scaled_f32> = true;
ROW_INLINE void load_row(const scaled_f32* src, float* dst, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }
AVX2H __m256 load8(const scaled_f32* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
AVX512 __m512 load16(const scaled_f32* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }

template <typename KV>
using Widened = typename std::conditional<SCALED<KV>, scaled_f32, float>::type;

std::atomic<uint64_t> call_generation{0};  // one per kernel call: a buffer never outlives its call

struct StagedRun {
    uint64_t generation = 0;
    const int32_t* table = nullptr;
    int64_t pos = -1, n = 0;
    std::vector<float> k, v, ks, vs;  // [n, kv_heads, head_dim]; int8: scales [n, kv_heads]
};

constexpr int64_t IDENTITY_SLOTS[CHUNK] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                           16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
static_assert(CHUNK == 32, "IDENTITY_SLOTS lists CHUNK slots");

template <typename KV>
void widen_portable(const KV* src, int64_t d, float* dst) {
    load_row(src, dst, d);
}

template <typename KV>
AVX2H_FN void widen_avx2(const KV* src, int64_t d, float* dst) {
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
}

template <typename KV>
__attribute__((target(AVX512_TARGET))) void widen_avx512(const KV* src, int64_t d, float* dst) {
    for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
}

// a chunk copied as it is: the staged type of a path whose loop reads KV's codes themselves (int8 on AVX2
// and AVX-512, fp8 in float16)
template <typename KV>
void copy_row(const KV* src, int64_t d, KV* dst) {
    std::memcpy(dst, src, d * sizeof(KV));
}

// the chunk's n slots, all KV heads, widened (to W) into run.k / run.v (position t at slot t)
template <typename KV, typename W, void (*Widen)(const KV*, int64_t, W*)>
void stage_run(const Args& a, const int64_t* slots, int64_t n, StagedRun& run) {
    const int64_t nkv = a.num_kv_heads, D = a.head_dim, stride = nkv * D;
    if ((int64_t)run.k.size() < CHUNK * stride) {
        run.k.resize(CHUNK * stride);
        run.v.resize(CHUNK * stride);
    }
    if ((int64_t)run.ks.size() < CHUNK * nkv) {  // (a call of another shape may have sized k alone)
        run.ks.resize(CHUNK * nkv);
        run.vs.resize(CHUNK * nkv);
    }
    const KV* kc = static_cast<const KV*>(a.k_cache);
    const KV* vc = static_cast<const KV*>(a.v_cache);
    for (int64_t t = 0; t < n; t++) {  // a slot's heads are contiguous
        Widen(kc + slots[t] * stride, stride, reinterpret_cast<W*>(run.k.data()) + t * stride);
        Widen(vc + slots[t] * stride, stride, reinterpret_cast<W*>(run.v.data()) + t * stride);
        if (SCALED<KV>) {
            std::memcpy(run.ks.data() + t * nkv, a.k_scale + slots[t] * nkv, nkv * sizeof(float));
            std::memcpy(run.vs.data() + t * nkv, a.v_scale + slots[t] * nkv, nkv * sizeof(float));
        }
    }
}

template <typename KV, typename W, void (*Prep)(const Args&, int64_t, float*, float*, float*, float*),
          void (*Widen)(const KV*, int64_t, W*),
          void (*WidenedChunk)(const Args&, const float*, float*, float*, float*, const int64_t*, int64_t, NextChunkPrefetch&)>
void staged_item(const Args& a, int64_t row0, int64_t nrows, const int64_t* start, const int64_t* end,
                 float* const* state, ItemCursor*) {
    const int64_t D = a.head_dim, H = a.num_heads;
    const int32_t* table = a.block_tables + row0 * a.max_blocks;
    thread_local std::vector<float> qs_buf;
    thread_local StagedRun run;
    if ((int64_t)qs_buf.size() < nrows * H * D) qs_buf.resize(nrows * H * D);
    int64_t pos[TILE];
    for (int64_t r = 0; r < nrows; r++) {
        float* acc = state[r];
        Prep(a, row0 + r, qs_buf.data() + r * H * D, acc, acc + H * D, acc + H * D + H);
        pos[r] = start[r];
    }
    const uint64_t generation = call_generation.load(std::memory_order_relaxed);
    Args b = a;  // the loop's view: the staged chunk as a cache holding its positions in slots 0 .. n
    NextChunkPrefetch none;
    for (bool active = true; active;) {
        active = false;
        for (int64_t r = 0; r < nrows; r++) {
            if (pos[r] >= end[r]) continue;
            active = true;
            int64_t slots[CHUNK];
            const int64_t n = chunk_slots(a, table, pos[r], end[r], CHUNK_SPAN<KV>, slots);  // tile_item's chunks
            if (run.generation != generation || run.table != table || run.pos != pos[r] || run.n < n) {
                stage_run<KV, W, Widen>(a, slots, n, run);
                run.generation = generation;
                run.table = table;
                run.pos = pos[r];
                run.n = n;
            }
            b.k_cache = run.k.data();
            b.v_cache = run.v.data();
            b.k_scale = run.ks.data();
            b.v_scale = run.vs.data();
            float* acc = state[r];
            WidenedChunk(b, qs_buf.data() + r * H * D, acc, acc + H * D, acc + H * D + H, IDENTITY_SLOTS, n, none);
            pos[r] += n;
        }
    }
}

// a tile (several rows) staged, a lone row in place: the same bits either way
template <ItemFnT Staged, ItemFnT InPlace>
void tile_or_row(const Args& a, int64_t row0, int64_t nrows, const int64_t* start, const int64_t* end,
                 float* const* state, ItemCursor* cursor) {
    (nrows > 1 ? Staged : InPlace)(a, row0, nrows, start, end, state, cursor);
}

// -1: the best the CPU has; else at most 0 portable, 2 avx2, 3 avx512, 4 avx512 + avx512fp16 (tests pin a path)
int forced_isa = -1;

bool avx512fp16() {
#if BRISK_FP16_LOOP
    return __builtin_cpu_supports("avx512fp16");
#else
    return false;  // built without the float16 loop
#endif
}

int attention_isa() {
    static const int detected =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
            ? (avx512fp16() ? 4 : 3)
        : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") ? 2 : 0;
    return forced_isa >= 0 ? std::min(forced_isa, detected) : detected;
}

// 0: never staged; 1: tiles staged, lone rows in place (the default; except where staging is only a
// copy: float32, and int8 on AVX2 and AVX-512, whose loops read the codes themselves); 2: always staged. Tests and
// benchmarks set it; every mode gives the same bits.
int staged_mode = 1;

template <typename KV, typename W, void (*Prep)(const Args&, int64_t, float*, float*, float*, float*),
          void (*Widen)(const KV*, int64_t, W*),
          void (*InPlaceChunk)(const Args&, const float*, float*, float*, float*, const int64_t*, int64_t, NextChunkPrefetch&),
          void (*WidenedChunk)(const Args&, const float*, float*, float*, float*, const int64_t*, int64_t, NextChunkPrefetch&)>
ItemFnT pick_path() {
    const int mode = std::is_same<KV, W>::value && staged_mode == 1 ? 0 : staged_mode;
    if (mode == 2) return staged_item<KV, W, Prep, Widen, WidenedChunk>;
    if (mode == 1)
        return tile_or_row<staged_item<KV, W, Prep, Widen, WidenedChunk>, tile_item<KV, Prep, InPlaceChunk>>;
    return tile_item<KV, Prep, InPlaceChunk>;
}

// *unscale: the factor the path's V sums are short of the true ones by (the merge applies it)
template <typename KV>
ItemFnT pick_kv(int64_t head_dim, float* unscale) {
    using W = Widened<KV>;
    *unscale = 1.f;
#if BRISK_FP16_LOOP
    if constexpr (HALF_ARITHMETIC<KV>)
        if (attention_isa() >= 4 && head_dim % 32 == 0)  // the float16 loop reads the codes: staging copies them
            return pick_path<KV, KV, prep_fp16<KV>, copy_row<KV>, chunk_fp16<KV>, chunk_fp16<KV>>();
#endif
    if (attention_isa() >= 3 && head_dim % 16 == 0) {
        *unscale = UNSCALE<KV>;  // the staged loop widens with the same load16: short by as much
        if constexpr (std::is_same<KV, int8_t>::value)  // scores from the codes (score_group16_i8)
            return pick_path<KV, KV, prep_avx512<KV>, copy_row<KV>, chunk_avx512<KV>, chunk_avx512<KV>>();
        else
            return pick_path<KV, float, prep_avx512<KV>, widen_avx512<KV>, chunk_avx512<KV>, chunk_avx512<W>>();
    }
    if (attention_isa() >= 2 && head_dim % 8 == 0) {
        *unscale = UNSCALE<KV>;  // the staged loop widens with the same load8: short by as much
        if constexpr (std::is_same<KV, int8_t>::value)  // scores from the codes (scores_heads_i8)
            return pick_path<KV, KV, prep_avx2<KV>, copy_row<KV>, chunk_avx2<KV>, chunk_avx2<KV>>();
        else
            return pick_path<KV, float, prep_avx2<KV>, widen_avx2<KV>, chunk_avx2<KV>, chunk_avx2<W>>();
    }
    return pick_path<KV, float, prep_portable, widen_portable<KV>, chunk_portable<KV>, chunk_portable<W>>();
}

ItemFnT pick(int kv_dtype, int64_t head_dim, float* unscale) {
    switch (kv_dtype) {
        case kvt::F32: return pick_kv<float>(head_dim, unscale);
        case kvt::BF16: return pick_kv<bf16_t>(head_dim, unscale);
        case kvt::F16: return pick_kv<f16_t>(head_dim, unscale);
        case kvt::E4M3: return pick_kv<e4m3_t>(head_dim, unscale);
        case kvt::E5M2: return pick_kv<e5m2_t>(head_dim, unscale);
        case kvt::I8: return pick_kv<int8_t>(head_dim, unscale);
        default: return nullptr;
    }
}

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
// torch path): 1 head_dim > 256, 2 more than 128 query heads, 3 heads not a multiple of kv heads,
// 4 an unknown kv_dtype (kv_types.h), 5 int8 without its scales.
// window > 0: each row attends to its last `window` positions only (sliding-window attention).
// softcap > 0: scores are soft-capped, softcap * tanh(score / softcap) (Gemma 2), before the softmax.
// sinks (null: none): a logit per query head that joins each row's softmax with no value (gpt-oss's attention
// sinks): the merge adds exp(sink) to the denominator.
// part_tokens (<= 0: whole rows) must not depend on the batch: a row's result then depends on
// its own data only, whatever else is in the batch (greedy batch invariance).
int brisk_paged_decode_attention(const float* q, const void* k_cache, const void* v_cache, int kv_dtype,
                                 const float* k_scale, const float* v_scale, const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                                 int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int64_t part_tokens, int64_t window,
                                 float softcap, const float* sinks, float* out) {
    if (head_dim > MAX_DIM) return 1;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads) return 3;
    if (num_heads > MAX_HEADS) return 2;
    float unscale = 1.f;
    const ItemFnT fn = pick(kv_dtype, head_dim, &unscale);
    if (fn == nullptr) return 4;
    if (kv_dtype == kvt::I8 && (k_scale == nullptr || v_scale == nullptr)) return 5;
    call_generation.fetch_add(1, std::memory_order_relaxed);
    const int64_t H = num_heads, D = head_dim;
    const Args a{q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, max_blocks, num_heads, num_kv_heads,
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

    ItemQueue queue;
    queue.items = items;
    queue.parts = parts;
    queue.part_tokens = part_tokens;
    queue.window = window;
    queue.tile_at = tile_at;
    queue.lens = context_lens;
#pragma omp parallel if (items > 1)
    {
        ItemCursor cursor{&queue};
        for (int64_t i = queue.claim(); i < items;) {
            ItemSpan s = queue.span(i);
            const int64_t nrows = tile_at[i / parts + 1] - s.row0, part = i % parts;
            float* states[TILE];
            for (int64_t r = 0; r < nrows; r++) {
                states[r] = state + ((s.row0 + r) * parts + part) * per_item;
                if (s.start[r] >= s.end[r]) {  // an empty part: weight 0 in the merge
                    float* m = states[r] + H * D;
                    for (int64_t h = 0; h < H; h++) { m[h] = -std::numeric_limits<float>::infinity(); m[H + h] = 0.f; }
                    s.start[r] = s.end[r] = 0;
                }
            }
            // rows with nothing in this part (before a part's start, or a window's) are left out
            cursor.claimed = -1;
            if (s.count > 0)
                fn(a, s.row0 + s.first, s.count, s.start + s.first, s.end + s.first, states + s.first, &cursor);
            i = cursor.claimed >= 0 ? cursor.claimed : queue.claim();
        }
    }

    // merge the parts of each (row, head): weights exp(m_p - max m) rescale each part's sums
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t row = 0; row < rows; row++) {
        const float* first = state + row * parts * per_item;
        for (int64_t h = 0; h < H; h++) {
            float mx = -std::numeric_limits<float>::infinity();
            for (int64_t p = 0; p < parts; p++) mx = std::max(mx, first[p * per_item + H * D + h]);
            if (sinks) mx = std::max(mx, sinks[h]);
            float* o = out + (row * H + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.f;
            float total = sinks ? std::exp(sinks[h] - mx) : 0.f;
            for (int64_t p = 0; p < parts; p++) {
                const float* st = first + p * per_item;
                const float lp = st[H * D + H + h];
                if (lp == 0.f) continue;  // an empty part (past this row's length)
                const float w = std::exp(st[H * D + h] - mx);
                total += w * lp;
                for (int64_t d = 0; d < D; d++) o[d] += w * st[h * D + d];
            }
            const float inv = unscale / total;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
    }
    return 0;
}

int brisk_paged_attention_isa() { return attention_isa(); }

void brisk_paged_attention_force_isa(int isa) { forced_isa = isa; }

int brisk_paged_attention_staged(int mode) {
    const int was = staged_mode;
    if (mode >= 0 && mode <= 2) staged_mode = mode;
    return was;
}

}  // extern "C"
