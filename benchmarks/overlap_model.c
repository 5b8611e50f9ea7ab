// A model of the paged decode kernel's memory walk, to ask one question without hardware counters: how much
// of a loop's arithmetic hides behind its reads from memory, for a given walk and prefetch schedule?
//
// Each 64-byte line read gets `reps` units of the float16 loop's work on one fp8 e4m3 line (widen 2 x 32
// codes: sign-extend, shift, mask; 6 FMAs into 3 "heads"), so reps sets the arithmetic per byte; 4 is about
// the kernel's at the demo shape (its time with the data in L3). Two threads, as the kernel's 2 workers.
// Walks:
//   linear      each thread reads its half of one buffer front to back, prefetching 128 lines ahead
//   kv-split    the kernel's walk (blocks in order): items of 1,536 lines (a row's 512 positions x 3 KV
//               heads x 64 bytes) taken in turn by the threads, each in chunks of 96 lines: the chunk's
//               K lines (one buffer), then its V lines (another, same offsets); the next chunk prefetched
//               one line per line read, at an item's last chunk the thread's next item's first
//     K->K,V->V   the next chunk's K during this chunk's K lines, its V during the V lines (the kernel's)
//     even        the next chunk's K and half its V during the K lines, the other half during the V lines
//   A "softmax" of `soft` dependent FMAs (no reads) may sit between each chunk's K and V lines.
// Each is timed cold (after reading 640 MB) and warm (its data in the last-level cache), best of 7 and 5.
// In time a cold walk can at best equal its warm time (the arithmetic) or the read time alone (reps 0).
//
// build: gcc -O2 -fopenmp -o overlap_model benchmarks/overlap_model.c
// run:   ./overlap_model [MiB per buffer, 22] [reps, 4] [soft, 0]
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define FP16 __attribute__((target("avx512f,avx512bw,avx512fp16,avx512vl")))
#define FP16_INLINE __attribute__((target("avx512f,avx512bw,avx512fp16,avx512vl"), always_inline)) inline

enum { LINEAR, KV_SPLIT_KK, KV_SPLIT_EVEN };
static const char* NAMES[] = {"linear, prefetch 128 lines ahead", "kv-split, K->K, V->V (the kernel's)",
                              "kv-split, even"};
enum { ITEM = 1536, CHUNK = 96, DIST = 128 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    __m512h a[6];
} Acc;

FP16_INLINE void work(Acc* acc, const char* line, int reps) {
    const __m512i x = _mm512_loadu_si512(line);
    if (reps == 0) {
        acc->a[0] = _mm512_castsi512_ph(_mm512_xor_si512(_mm512_castph_si512(acc->a[0]), x));
        return;
    }
    const __m512h q0 = _mm512_set1_ph((_Float16)0.001f), q1 = _mm512_set1_ph((_Float16)0.002f),
                  q2 = _mm512_set1_ph((_Float16)0.003f);
    const __m512i mask = _mm512_set1_epi16((short)0xBFFF);
    for (int r = 0; r < reps; r++) {
        const __m512h k0 = _mm512_castsi512_ph(
            _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm512_castsi512_si256(x)), 7), mask));
        const __m512h k1 = _mm512_castsi512_ph(
            _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(x, 1)), 7), mask));
        acc->a[0] = _mm512_fmadd_ph(q0, k0, acc->a[0]);
        acc->a[1] = _mm512_fmadd_ph(q1, k0, acc->a[1]);
        acc->a[2] = _mm512_fmadd_ph(q2, k0, acc->a[2]);
        acc->a[3] = _mm512_fmadd_ph(q0, k1, acc->a[3]);
        acc->a[4] = _mm512_fmadd_ph(q1, k1, acc->a[4]);
        acc->a[5] = _mm512_fmadd_ph(q2, k1, acc->a[5]);
    }
}

FP16 static uint64_t walk(int how, const char* K, const char* V, size_t lines, int reps, int soft) {
    uint64_t sink = 0;
#pragma omp parallel reduction(^ : sink)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        Acc acc;
        for (int i = 0; i < 6; i++) acc.a[i] = _mm512_setzero_ph();
        if (how == LINEAR) {
            const size_t mine = 2 * lines / nt;  // both buffers as one: K then V
            for (size_t i = 0; i < mine; i++) {
                const size_t at = (size_t)t * mine + i, ahead = at + DIST;
                if (i + DIST < mine)
                    _mm_prefetch((ahead < lines ? K + ahead * 64 : V + (ahead - lines) * 64), _MM_HINT_T0);
                work(&acc, at < lines ? K + at * 64 : V + (at - lines) * 64, reps);
            }
        } else {
            const size_t items = lines / ITEM;
            for (size_t it = t; it < items; it += nt) {
                const char* k = K + it * ITEM * 64;
                const char* v = V + it * ITEM * 64;
                for (int c = 0; c < ITEM; c += CHUNK) {
                    // the next chunk: this item's, or at its last chunk the next item's first
                    const char* pk = k + (c + CHUNK) * 64;
                    const char* pv = v + (c + CHUNK) * 64;
                    const int any = c + CHUNK < ITEM || it + nt < items;
                    if (c + CHUNK >= ITEM) {
                        pk = K + (it + nt) * ITEM * 64;
                        pv = V + (it + nt) * ITEM * 64;
                    }
                    for (int i = 0; i < CHUNK; i++) {
                        if (any) {
                            _mm_prefetch(pk + i * 64, _MM_HINT_T0);
                            if (how == KV_SPLIT_EVEN && (i & 1)) _mm_prefetch(pv + (i / 2) * 64, _MM_HINT_T0);
                        }
                        work(&acc, k + (c + i) * 64, reps);
                    }
                    for (int j = 0; j < soft; j++) acc.a[5] = _mm512_fmadd_ph(acc.a[5], acc.a[4], acc.a[3]);
                    for (int i = 0; i < CHUNK; i++) {
                        if (any && how == KV_SPLIT_KK) _mm_prefetch(pv + i * 64, _MM_HINT_T0);
                        if (any && how == KV_SPLIT_EVEN && !(i & 1)) _mm_prefetch(pv + (CHUNK / 2 + i / 2) * 64, _MM_HINT_T0);
                        work(&acc, v + (c + i) * 64, reps);
                    }
                }
            }
        }
        __m512h s = acc.a[0];
        for (int i = 1; i < 6; i++) s = _mm512_add_ph(s, acc.a[i]);
        uint64_t o[8];
        _mm512_storeu_si512(o, _mm512_castph_si512(s));
        sink ^= o[0] ^ o[7];
    }
    return sink;
}

static char* huge_buffer(size_t bytes) {  // 2 MB pages, as the KV pool's (brisk/engine/hugepages.py)
    const size_t huge = 2u << 20;
    char* raw = mmap(0, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char* b = (char*)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
    madvise(b, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < bytes; i++) b[i] = (char)(i * 7 + 3);
    return b;
}

int main(int argc, char** argv) {
    const size_t bytes = (size_t)(argc > 1 ? atoi(argv[1]) : 22) << 20;
    const int reps = argc > 2 ? atoi(argv[2]) : 4, soft = argc > 3 ? atoi(argv[3]) : 0;
    const size_t lines = bytes / 64 / ITEM * ITEM;
    char* K = huge_buffer(bytes);
    char* V = huge_buffer(bytes);
    const size_t flush_bytes = 640u << 20;
    char* flush = malloc(flush_bytes);
    if (K == NULL || V == NULL || flush == NULL) return 1;
    memset(flush, 1, flush_bytes);
    uint64_t sink = 0;
    printf("2 x %zu MiB, reps %d, soft %d, %d threads\n", bytes >> 20, reps, soft, omp_get_max_threads());
    for (int how = LINEAR; how <= KV_SPLIT_EVEN; how++)
        for (int r = 0; r <= reps; r += reps > 0 ? reps : 1) {
            double cold = 1e9, warm = 1e9;
            for (int i = 0; i < 7; i++) {
                uint64_t f = 0;
                for (size_t j = 0; j < flush_bytes; j += 64) f += ((volatile char*)flush)[j];
                const double t0 = now();
                sink ^= f ^ walk(how, K, V, lines, r, soft);
                const double dt = now() - t0;
                cold = dt < cold ? dt : cold;
            }
            for (int i = 0; i < 5; i++) {
                const double t0 = now();
                sink ^= walk(how, K, V, lines, r, soft);
                const double dt = now() - t0;
                warm = dt < warm ? dt : warm;
            }
            printf("%-38s reps %d: cold %6.2f ms (%5.1f GB/s)  warm %6.2f ms  cold/warm %.2f\n", NAMES[how], r,
                   cold * 1e3, 2.0 * lines * 64 / cold / 1e9, warm * 1e3, cold / warm);
            if (reps == 0) break;
        }
    return sink == 42 ? 2 : 0;  // (keeps the sums live)
}
