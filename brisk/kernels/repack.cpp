// GGUF K-quant weights -> brisk's layouts at conversion time: the byte moves `brisk.loading.gguf_convert`
// makes over every weight of a model on its first start, once each. The numpy/torch functions they
// replace (`brisk.loading.dequant`, `brisk.kernels.tile_int*`) stay as the reference and the fallback
// without this library; tests/test_repack.py holds these to them, byte for byte.
//
// Nothing is computed but bit fields: every function moves bits and masks them. They work on 4- and
// 8-byte words (a mask keeps each byte's bits within the byte), so a weight costs a fraction of an
// instruction, and split the rows (or super-blocks) among OpenMP threads: a 7B model's ~7 billion
// weights take well under a second here, where the numpy steps took ~20 s (benchmarks/RESULTS.md).

#include <cstdint>
#include <cstring>

#include "brisk_abi.h"

namespace {

constexpr int64_t QK = 32, QK_K = 256, TILE_ROWS = 8;

inline uint32_t load32(const uint8_t* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    return w;
}
inline void store32(uint8_t* p, uint32_t w) { std::memcpy(p, &w, 4); }

constexpr uint32_t LOW4 = 0x0F0F0F0Fu, LOW2 = 0x03030303u, BIT0 = 0x01010101u;

// One super-block's 256 values (one a byte, element order), by GGUF type (its bits: 6 Q6_K, 5 Q5_K,
// 3 Q3_K, 2 Q2_K); the layouts as brisk.loading.dequant documents them.
void q6_k_values(const uint8_t* b, uint8_t* out) {
    for (int h = 0; h < 2; h++) {  // ql 64 bytes and qh 32 per half of 128 elements
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        uint8_t* o = out + 128 * h;
        for (int l = 0; l < 32; l += 4) {
            const uint32_t lo = load32(ql + l), hi = load32(ql + l + 32), top = load32(qh + l);
            store32(o + l, (lo & LOW4) | ((top & LOW2) << 4));
            store32(o + l + 32, (hi & LOW4) | (((top >> 2) & LOW2) << 4));
            store32(o + l + 64, ((lo >> 4) & LOW4) | (((top >> 4) & LOW2) << 4));
            store32(o + l + 96, ((hi >> 4) & LOW4) | (((top >> 6) & LOW2) << 4));
        }
    }
}

void q5_k_values(const uint8_t* b, uint8_t* out) {
    const uint8_t* qh = b + 16;  // sub-block i's bit 4 is bit i of qh[l]
    const uint8_t* qs = b + 48;  // 64-element chunks: low nibbles then high nibbles
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l += 4) {
            const uint32_t q = load32(qs + 32 * c + l), top = load32(qh + l);
            store32(out + 64 * c + l, (q & LOW4) | (((top >> (2 * c)) & BIT0) << 4));
            store32(out + 64 * c + 32 + l, ((q >> 4) & LOW4) | (((top >> (2 * c + 1)) & BIT0) << 4));
        }
}

void q3_k_values(const uint8_t* b, uint8_t* out) {
    const uint8_t* hmask = b;  // element 128h + 32j + l: bit 4h + j of hmask[l] is its bit 2
    const uint8_t* qs = b + 32;  // and the 2 bits at 2j of qs[32h + l] its low bits
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l += 4) {
                const uint32_t q = load32(qs + 32 * h + l), top = load32(hmask + l);
                store32(out + 128 * h + 32 * j + l, ((q >> (2 * j)) & LOW2) | (((top >> (4 * h + j)) & BIT0) << 2));
            }
}

void q2_k_values(const uint8_t* b, uint8_t* out) {
    const uint8_t* qs = b + 16;  // element 128h + 32j + l: the 2 bits at 2j of qs[32h + l]
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l += 4)
                store32(out + 128 * h + 32 * j + l, (load32(qs + 32 * h + l) >> (2 * j)) & LOW2);
}

// A tile's block of 32 weights for one of its rows j (w: the row's 32 values, one a byte) into the
// tile layouts of quant_matmul.cpp (brisk.kernels.tile_int*): W(i) is the word of weights 4i .. 4i + 3.
// low nibbles (int4's 128 bytes, also the first of int5/int6): byte 32v + 4j + e = w[4v + e] | w[16 + 4v + e] << 4
inline void low_nibbles(const uint8_t* w, int64_t j, uint8_t* dst) {
    for (int v = 0; v < 4; v++)
        store32(dst + 32 * v + 4 * j, (load32(w + 4 * v) & LOW4) | ((load32(w + 16 + 4 * v) & LOW4) << 4));
}
// one bit per weight (int5's bit 4, int3's bit 2 at `shift`): byte 4j + e, bit u = weight 4u + e
inline void bit_plane(const uint8_t* w, int64_t j, int shift, uint8_t* dst) {
    uint32_t word = 0;
    for (int u = 0; u < 8; u++) word |= ((load32(w + 4 * u) >> shift) & BIT0) << u;
    store32(dst + 4 * j, word);
}
// two bits per weight (int2's and int3's low bits, int6's top at `shift`): byte 32k + 4j + e, bits 2v =
// weight 16k + 4v + e
inline void two_bit_planes(const uint8_t* w, int64_t j, int shift, uint8_t* dst) {
    for (int k = 0; k < 2; k++) {
        uint32_t word = 0;
        for (int v = 0; v < 4; v++) word |= ((load32(w + 16 * k + 4 * v) >> shift) & LOW2) << (2 * v);
        store32(dst + 32 * k + 4 * j, word);
    }
}

int64_t tile_bytes(int bits) {
    switch (bits) {
        case 2: return 64;
        case 3: return 96;
        case 5: return 160;
        case 6: return 192;
        default: return 0;
    }
}

}  // namespace

extern "C" {

int brisk_k_quant_values(const uint8_t* blocks, int bits, int64_t n_super, uint8_t* out) {
    void (*values)(const uint8_t*, uint8_t*);
    int64_t bytes;
    switch (bits) {
        case 6: values = q6_k_values, bytes = 210; break;
        case 5: values = q5_k_values, bytes = 176; break;
        case 3: values = q3_k_values, bytes = 110; break;
        case 2: values = q2_k_values, bytes = 84; break;
        default: return 1;
    }
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < n_super; s++) values(blocks + s * bytes, out + s * QK_K);
    return 0;
}

void brisk_k4_codes(const uint8_t* blocks, int64_t block_bytes, int64_t qs_offset, int64_t n_super, uint8_t* out) {
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < n_super; s++) {
        const uint8_t* qs = blocks + s * block_bytes + qs_offset;
        uint8_t* o = out + s * (QK_K / 2);
        for (int c = 0; c < 4; c++)  // a chunk's bytes i and i + 16: first block's byte i from their low halves
            for (int i = 0; i < 16; i += 4) {
                const uint32_t a = load32(qs + 32 * c + i), b = load32(qs + 32 * c + 16 + i);
                store32(o + 32 * c + i, (a & LOW4) | ((b & LOW4) << 4));
                store32(o + 32 * c + 16 + i, ((a >> 4) & LOW4) | (b & ~LOW4));
            }
    }
}

void brisk_split_blocks(const uint8_t* blocks, int64_t block_bytes, int64_t head_bytes, int64_t n_blocks, uint8_t* head,
                        uint8_t* payload) {
    const int64_t tail = block_bytes - head_bytes;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n_blocks; i++) {
        std::memcpy(head + i * head_bytes, blocks + i * block_bytes, head_bytes);
        std::memcpy(payload + i * tail, blocks + i * block_bytes + head_bytes, tail);
    }
}

void brisk_tile_words(const uint8_t* rows, int64_t n, int64_t nb, int64_t words, uint8_t* out) {
    const int64_t row_bytes = nb * words * 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n / TILE_ROWS; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t* dst = out + (t * nb + b) * words * 4 * TILE_ROWS;
            for (int64_t j = 0; j < TILE_ROWS; j++) {
                const uint8_t* src = rows + (t * TILE_ROWS + j) * row_bytes + b * words * 4;
                for (int64_t v = 0; v < words; v++) std::memcpy(dst + (v * TILE_ROWS + j) * 4, src + 4 * v, 4);
            }
        }
}

void brisk_k4_scales(const uint8_t* blocks, int64_t block_bytes, int64_t n_super, uint16_t* d, uint16_t* dmin,
                     uint8_t* sub) {
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < n_super; s++) {
        const uint8_t* b = blocks + s * block_bytes;
        std::memcpy(d + s, b, 2);
        std::memcpy(dmin + s, b + 2, 2);
        const uint8_t* k = b + 4;  // 12 bytes: sc and mn of blocks 0-3 in the low 6 bits of 0-3 and 4-7;
        uint8_t* o = sub + 16 * s;  // blocks 4-7 take the nibbles of 8-11 and those bytes' top 2 bits
        for (int i = 0; i < 4; i++) {
            o[2 * i] = k[i] & 63;
            o[2 * i + 1] = k[i + 4] & 63;
            o[2 * i + 8] = (k[i + 8] & 0x0F) | ((k[i] >> 6) << 4);
            o[2 * i + 9] = (k[i + 8] >> 4) | ((k[i + 4] >> 6) << 4);
        }
    }
}

int brisk_tile_values(const uint8_t* q, int64_t rows, int64_t cols, int bits, uint8_t* out) {
    const int64_t per = tile_bytes(bits), nb = cols / QK;
    if (per == 0 || rows % TILE_ROWS || cols % QK) return 1;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < rows / TILE_ROWS; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t* dst = out + (t * nb + b) * per;
            for (int64_t j = 0; j < TILE_ROWS; j++) {
                const uint8_t* w = q + (t * TILE_ROWS + j) * cols + b * QK;
                switch (bits) {
                    case 2: two_bit_planes(w, j, 0, dst); break;
                    case 3: two_bit_planes(w, j, 0, dst), bit_plane(w, j, 2, dst + 64); break;
                    case 5: low_nibbles(w, j, dst), bit_plane(w, j, 4, dst + 128); break;
                    default: low_nibbles(w, j, dst), two_bit_planes(w, j, 4, dst + 128); break;
                }
            }
        }
    return 0;
}

}  // extern "C"
