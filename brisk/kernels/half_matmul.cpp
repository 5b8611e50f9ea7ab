// 16-bit float weights, float32 activations: y[M, N] = x[M, K] @ W[N, K]^T, W in bfloat16 or
// float16 (kv_types.h's codes 1 and 2), as the checkpoint stores it.
//
// Most Hub checkpoints are bfloat16. Cast to float32 they take twice the memory and a decode step
// reads twice the bytes; run in bfloat16 (PyTorch's CPU path) the activations are rounded to 8 bits
// of mantissa and oneDNN's one-row kernels read them at ~60% of the float32 path's bandwidth here.
// These kernels keep the weights in 16 bits and the activations in float32: each weight is widened
// in registers (bf16: a zero-extend and a shift; f16: vcvtph2ps) and multiplied in float32, so a
// result equals the float32 model's on the same (exactly representable) weights up to summation
// order, and the bytes read are the file's.
//
// Two layouts. Linears are packed at load into panels of 16 rows (see "panels" below): one fma per
// k per output, the same chain on every path and at every row count. Weights kept in the
// checkpoint's [N, K] rows (a tied LM head reads the embedding table) take dot-product register
// tiles of NW weight rows x MT activation rows: each output keeps its own accumulator over the same
// k order whatever the tile around it. Either way a row's result does not depend on the batch
// (brisk's greedy outputs must not). Threads (OpenMP, PyTorch's libgomp) split the weight rows.
//
// Paths: AVX-512 (16 lanes) where brisk_kernels_isa() says 3, AVX2+F16C (8 lanes) at 2, a portable
// loop at 0: the same path for a given CPU every call.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <immintrin.h>
#include <omp.h>

#include "brisk_abi.h"
#include "kv_types.h"
#include "simd_widen.h"

namespace {

constexpr int NW = 4;                  // weight rows per register tile
constexpr int MT = 4;                  // activation rows per register tile
constexpr int64_t ROWS_PER_TASK = 16;  // weight rows a thread takes at a time

template <int KIND>
inline float widen(uint16_t h) {
    return KIND == kvt::BF16 ? kvt::bf16_to_f32(h) : kvt::f16_to_f32(h);
}

// ---------------------------------------------------------------- portable
template <int KIND>
void rows_scalar(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t n0, int64_t n1, float* out,
                 int64_t N) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t n = n0; n < n1; n++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += widen<KIND>(w[n * K + k]) * x[r * K + k];
            out[r * N + n] = acc;
        }
}

// ---------------------------------------------------------------- AVX2 + F16C
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX2_INL __attribute__((target("avx2,fma,f16c"), always_inline)) inline

template <int KIND>
AVX2_INL __m256 load8(const uint16_t* p) {
    if constexpr (KIND == kvt::BF16) return widen::bf16x8(widen::load128(p));
    else return widen::f16x8(widen::load128(p));
}

AVX2_INL float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Weight rows n0..n0+NWT-1 against activation rows r0..r0+MTT-1; a K tail (K % 8) goes through
// zero-padded copies, so every element takes the same vector lane it would at any tile size.
template <int KIND, int NWT, int MTT>
AVX2_FN void tile_avx2(const float* x, const uint16_t* w, int64_t K, int64_t n0, int64_t r0, float* out, int64_t N) {
    __m256 acc[NWT][MTT];
    for (int j = 0; j < NWT; j++)
        for (int i = 0; i < MTT; i++) acc[j][i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[MTT];
        for (int i = 0; i < MTT; i++) xv[i] = _mm256_loadu_ps(x + (r0 + i) * K + k);
        for (int j = 0; j < NWT; j++) {
            const __m256 wv = load8<KIND>(w + (n0 + j) * K + k);
            for (int i = 0; i < MTT; i++) acc[j][i] = _mm256_fmadd_ps(wv, xv[i], acc[j][i]);
        }
    }
    if (k < K) {
        alignas(32) float xt[MTT][8] = {};
        alignas(16) uint16_t wt[NWT][8] = {};
        for (int64_t e = k; e < K; e++) {
            for (int i = 0; i < MTT; i++) xt[i][e - k] = x[(r0 + i) * K + e];
            for (int j = 0; j < NWT; j++) wt[j][e - k] = w[(n0 + j) * K + e];
        }
        for (int j = 0; j < NWT; j++) {
            const __m256 wv = load8<KIND>(wt[j]);
            for (int i = 0; i < MTT; i++) acc[j][i] = _mm256_fmadd_ps(wv, _mm256_load_ps(xt[i]), acc[j][i]);
        }
    }
    for (int j = 0; j < NWT; j++)
        for (int i = 0; i < MTT; i++) out[(r0 + i) * N + n0 + j] = hsum8(acc[j][i]);
}

// ---------------------------------------------------------------- AVX-512
// (avx512dq for the shared widening helpers: every CPU brisk_kernels_isa() calls 3, AVX-512 VNNI, has it)
#define AVX512_FN __attribute__((target(BRISK_WIDEN_AVX512_TARGET)))
#define AVX512_INL __attribute__((target(BRISK_WIDEN_AVX512_TARGET), always_inline)) inline

template <int KIND>
AVX512_INL __m512 widen16(__m256i h) {
    if constexpr (KIND == kvt::BF16) return widen::bf16x16(h);
    else return widen::f16x16(h);
}

template <int KIND, int NWT, int MTT>
AVX512_FN void tile_avx512(const float* x, const uint16_t* w, int64_t K, int64_t n0, int64_t r0, float* out,
                           int64_t N) {
    __m512 acc[NWT][MTT];
    for (int j = 0; j < NWT; j++)
        for (int i = 0; i < MTT; i++) acc[j][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[MTT];
        for (int i = 0; i < MTT; i++) xv[i] = _mm512_loadu_ps(x + (r0 + i) * K + k);
        for (int j = 0; j < NWT; j++) {
            const __m512 wv = widen16<KIND>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n0 + j) * K + k)));
            for (int i = 0; i < MTT; i++) acc[j][i] = _mm512_fmadd_ps(wv, xv[i], acc[j][i]);
        }
    }
    if (k < K) {  // masked loads read zeros past K: the same lanes as a longer row's
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[MTT];
        for (int i = 0; i < MTT; i++) xv[i] = _mm512_maskz_loadu_ps(m, x + (r0 + i) * K + k);
        for (int j = 0; j < NWT; j++) {
            const __m512 wv = widen16<KIND>(_mm256_maskz_loadu_epi16(m, w + (n0 + j) * K + k));
            for (int i = 0; i < MTT; i++) acc[j][i] = _mm512_fmadd_ps(wv, xv[i], acc[j][i]);
        }
    }
    for (int j = 0; j < NWT; j++)
        for (int i = 0; i < MTT; i++) out[(r0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[j][i]);
}

// ---------------------------------------------------------------- driver
template <int KIND, int NWT, int MTT>
void tile(int isa, const float* x, const uint16_t* w, int64_t K, int64_t n0, int64_t r0, float* out, int64_t N) {
    if (isa >= 3) tile_avx512<KIND, NWT, MTT>(x, w, K, n0, r0, out, N);
    else tile_avx2<KIND, NWT, MTT>(x, w, K, n0, r0, out, N);
}

template <int KIND>
void matmul(const float* x, const uint16_t* w, int64_t M, int64_t N, int64_t K, float* out) {
    const int isa = brisk_kernels_isa();
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) if (tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n_begin = t * ROWS_PER_TASK, n_end = std::min(N, n_begin + ROWS_PER_TASK);
        if (isa < 2) {
            rows_scalar<KIND>(x, w, M, K, n_begin, n_end, out, N);
            continue;
        }
        int64_t r = 0;
        for (; r + MT <= M; r += MT) {
            int64_t n = n_begin;
            for (; n + NW <= n_end; n += NW) tile<KIND, NW, MT>(isa, x, w, K, n, r, out, N);
            for (; n < n_end; n++) tile<KIND, 1, MT>(isa, x, w, K, n, r, out, N);
        }
        for (; r < M; r++) {
            int64_t n = n_begin;
            for (; n + NW <= n_end; n += NW) tile<KIND, NW, 1>(isa, x, w, K, n, r, out, N);
            for (; n < n_end; n++) tile<KIND, 1, 1>(isa, x, w, K, n, r, out, N);
        }
    }
}

// ---------------------------------------------------------------- panels of 16 weight rows
//
// The layout linears are stored in (brisk.kernels.pack_half writes it at load): weight rows in
// panels of PR = 16, [ceil(N/16)][K][16], the panel's 16 rows side by side for each k (rows past N
// zero). Each output lane then takes one fused multiply-add per k, k = 0, 1, ..., K-1 in order,
// from a broadcast activation: no horizontal sums, each widened weight vector serves MR activation
// rows, and a panel streams from L2 once per MR rows. Every output is the same sequential fma
// chain on every path (AVX-512, AVX2, the portable loop with std::fma) and at every row count, so
// the results are bit for bit equal across paths and batches. Against the dot-product tiles above
// this is what prompt chunks need (measured in benchmarks/half_matmul.py); single rows read the
// same bytes.
constexpr int PR = 16;

template <int KIND>
void panels_scalar(const float* x, const uint16_t* p, int64_t M, int64_t N, int64_t K, int64_t q0, int64_t q1,
                   float* out) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t q = q0; q < q1; q++) {
            float acc[PR] = {};
            const uint16_t* panel = p + q * K * PR;
            for (int64_t k = 0; k < K; k++)
                for (int j = 0; j < PR; j++) acc[j] = std::fma(widen<KIND>(panel[k * PR + j]), x[r * K + k], acc[j]);
            for (int j = 0; j < PR && q * PR + j < N; j++) out[r * N + q * PR + j] = acc[j];
        }
}

// AVX2: a panel is two 8-lane vectors; PN panels x MR activation rows of accumulators, over k in
// [k0, k1): they start at zero (k0 == 0) or from what the previous k range left in `out`, and end
// there (storing and reloading a float is exact: the fma chain is the same as in one pass).
template <int KIND, int PN, int MR>
AVX2_FN void panel_tile_avx2(const float* x, const uint16_t* p, int64_t K, int64_t k0, int64_t k1, int64_t q0,
                             int64_t r0, float* out, int64_t N) {
    __m256 acc[PN][2][MR];
    for (int j = 0; j < PN; j++)
        for (int i = 0; i < MR; i++) {
            const int64_t n0 = (q0 + j) * PR;
            alignas(32) float lanes[PR] = {};
            if (k0 > 0)
                for (int64_t n = n0; n < std::min(N, n0 + PR); n++) lanes[n - n0] = out[(r0 + i) * N + n];
            acc[j][0][i] = _mm256_load_ps(lanes);
            acc[j][1][i] = _mm256_load_ps(lanes + 8);
        }
    for (int64_t k = k0; k < k1; k++) {
        __m256 wv[PN][2];
        for (int j = 0; j < PN; j++)
            for (int h = 0; h < 2; h++) wv[j][h] = load8<KIND>(p + ((q0 + j) * K + k) * PR + 8 * h);
        for (int i = 0; i < MR; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + (r0 + i) * K + k);
            for (int j = 0; j < PN; j++)
                for (int h = 0; h < 2; h++) acc[j][h][i] = _mm256_fmadd_ps(wv[j][h], xb, acc[j][h][i]);
        }
    }
    for (int j = 0; j < PN; j++)
        for (int i = 0; i < MR; i++) {
            const int64_t n0 = (q0 + j) * PR;
            alignas(32) float lanes[PR];
            _mm256_store_ps(lanes, acc[j][0][i]);
            _mm256_store_ps(lanes + 8, acc[j][1][i]);
            for (int64_t n = n0; n < std::min(N, n0 + PR); n++) out[(r0 + i) * N + n] = lanes[n - n0];
        }
}

template <int KIND, int PN, int MR>
AVX512_FN void panel_tile_avx512(const float* x, const uint16_t* p, int64_t K, int64_t k0, int64_t k1, int64_t q0,
                                 int64_t r0, float* out, int64_t N) {
    __m512 acc[PN][MR];
    __mmask16 mask[PN];
    for (int j = 0; j < PN; j++) {
        const int64_t n0 = (q0 + j) * PR;
        mask[j] = n0 + PR <= N ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
        for (int i = 0; i < MR; i++)
            acc[j][i] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[j], out + (r0 + i) * N + n0);
    }
    for (int64_t k = k0; k < k1; k++) {
        __m512 wv[PN];
        for (int j = 0; j < PN; j++)
            wv[j] = widen16<KIND>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + ((q0 + j) * K + k) * PR)));
        for (int i = 0; i < MR; i++) {
            const __m512 xb = _mm512_set1_ps(x[(r0 + i) * K + k]);
            for (int j = 0; j < PN; j++) acc[j][i] = _mm512_fmadd_ps(wv[j], xb, acc[j][i]);
        }
    }
    for (int j = 0; j < PN; j++)
        for (int i = 0; i < MR; i++) _mm512_mask_storeu_ps(out + (r0 + i) * N + (q0 + j) * PR, mask[j], acc[j][i]);
}

constexpr int PANELS_PER_TASK = 4;  // 64 weight rows a thread takes at a time
constexpr int MR_512 = 6, MR_256 = 6;  // activation rows per register tile (24 / 12 accumulators)

// The rows left after whole MR-row tiles (fewer than 6) go in one tile of their count: a panel is
// read once per tile, so four rows read it once, not four times.
template <int KIND, int PN, bool WIDE>
void panel_tail(const float* x, const uint16_t* p, int64_t K, int64_t k0, int64_t k1, int64_t q, int64_t r,
                int64_t rows, float* out, int64_t N) {
    switch (rows) {
#define BRISK_TAIL(R)                                                                       \
    case R:                                                                                 \
        if constexpr (WIDE) panel_tile_avx512<KIND, PN, R>(x, p, K, k0, k1, q, r, out, N);  \
        else panel_tile_avx2<KIND, PN, R>(x, p, K, k0, k1, q, r, out, N);                   \
        break;
        BRISK_TAIL(1) BRISK_TAIL(2) BRISK_TAIL(3) BRISK_TAIL(4) BRISK_TAIL(5)
#undef BRISK_TAIL
        default: break;
    }
}

template <int KIND, int PN>
void panel_rows(int isa, const float* x, const uint16_t* p, int64_t M, int64_t K, int64_t k0, int64_t k1, int64_t q,
                float* out, int64_t N) {
    if (isa >= 3) {
        int64_t r = 0;
        for (; r + MR_512 <= M; r += MR_512) panel_tile_avx512<KIND, PN, MR_512>(x, p, K, k0, k1, q, r, out, N);
        if (r < M) panel_tail<KIND, PN, true>(x, p, K, k0, k1, q, r, M - r, out, N);
    } else {
        for (int64_t j = 0; j < PN; j++) {  // AVX2's 16 registers: one panel at a time
            int64_t r = 0;
            for (; r + MR_256 <= M; r += MR_256) panel_tile_avx2<KIND, 1, MR_256>(x, p, K, k0, k1, q + j, r, out, N);
            if (r < M) panel_tail<KIND, 1, false>(x, p, K, k0, k1, q + j, r, M - r, out, N);
        }
    }
}

// From CHUNK_ROWS activation rows on, k runs in chunks of KC for all threads together (GotoBLAS's
// order): a chunk of every activation row (M x 1 KB) stays in each core's L2 and a task's panels'
// chunk (4 x 256 x 32 B = 32 KB) in L1 while the row tiles pass over them; without it each task
// re-read every activation row from L3 (5.8 MB at 256 rows x K 5632) and prompt chunks ran at half
// oneDNN's speed. Fewer rows (decode) take K whole: a chunk costs a barrier, ~100 matmuls a step.
constexpr int64_t KC = 256;
constexpr int64_t CHUNK_ROWS = 16;

template <int KIND>
void matmul_panels(const float* x, const uint16_t* p, int64_t M, int64_t N, int64_t K, float* out) {
    const int isa = brisk_kernels_isa();
    const int64_t panels = (N + PR - 1) / PR, tasks = (panels + PANELS_PER_TASK - 1) / PANELS_PER_TASK;
    const int64_t kc = M >= CHUNK_ROWS ? KC : K;
#pragma omp parallel if (tasks > 1)
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t k1 = std::min(K, k0 + kc);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t q0 = t * PANELS_PER_TASK, q1 = std::min(panels, q0 + PANELS_PER_TASK);
            if (isa < 2) {
                if (k0 == 0) panels_scalar<KIND>(x, p, M, N, K, q0, q1, out);  // whole K at once
            } else if (q1 - q0 == PANELS_PER_TASK) {
                panel_rows<KIND, PANELS_PER_TASK>(isa, x, p, M, K, k0, k1, q0, out, N);
            } else {
                for (int64_t q = q0; q < q1; q++) panel_rows<KIND, 1>(isa, x, p, M, K, k0, k1, q, out, N);
            }
        }
    }
}

}  // namespace

extern "C" {

// out [M, N] = x [M, K] . W^T, W [N, K] of 16-bit floats: kind 1 bfloat16, 2 float16 (kv_types.h).
// Returns 0, or 1 for another kind (nothing written).
int brisk_half_matmul(const float* x, const uint16_t* w, int kind, int64_t M, int64_t N, int64_t K, float* out) {
    if (kind == kvt::BF16) matmul<kvt::BF16>(x, w, M, N, K, out);
    else if (kind == kvt::F16) matmul<kvt::F16>(x, w, M, N, K, out);
    else return 1;
    return 0;
}

// The same product with W in panels of 16 rows ([ceil(N/16)][K][16], see "panels" above).
int brisk_half_matmul_panels(const float* x, const uint16_t* w, int kind, int64_t M, int64_t N, int64_t K,
                             float* out) {
    if (kind == kvt::BF16) matmul_panels<kvt::BF16>(x, w, M, N, K, out);
    else if (kind == kvt::F16) matmul_panels<kvt::F16>(x, w, M, N, K, out);
    else return 1;
    return 0;
}

}  // extern "C"
