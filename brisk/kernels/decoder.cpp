// A whole stack of Llama decoder layers for one decode step, in one call: the step where every
// row is a single new token (the bulk of serving, and all of single-stream decoding). From
// Python that step is ~10 calls a layer (norms, matmuls, RoPE, K/V store, attention, SiLU-gate),
// each paying dispatch that at one row costs as much as its math; here the loop over layers runs
// in C and calls the same kernels the Python path calls, in the same order, on the same values:
// the two paths give bit-identical results (tests/test_decode_stack.py holds them to it).
//
// Applies to layers whose four projections are brisk's quantized linears (quant_matmul.cpp) or
// 16-bit float ones (half_matmul.cpp), q/k/v in one weight or two (`qkv_rest`), biases on q/k/v and o,
// q/k norms (Qwen3's per head, OLMoE's over the projection), attention sinks (gpt-oss), an MLP that is
// dense or a mixture of experts (moe.cpp, the function the Python path calls too: gpt-oss's included),
// float32 activations, and K/V read in place by the paged kernel (paged_attention.cpp).
// brisk/engine/decode_stack.py checks that and builds the per-layer table once.

#include <cstdint>
#include <cstring>

#include "brisk_abi.h"

namespace {

using QuantWeight = BriskQuantWeight;
using Layer = BriskLayer;
using Dims = BriskDims;
using Scratch = BriskScratch;

void matmul(const QuantWeight& w, const float* x, int64_t rows, const Scratch& s, float* out) {
    if (w.bits == 16 && w.tiled)
        brisk_half_matmul_panels(x, reinterpret_cast<const uint16_t*>(w.q), (int)w.half, rows, w.n, w.k, out);
    else if (w.bits == 16)
        brisk_half_matmul(x, reinterpret_cast<const uint16_t*>(w.q), (int)w.half, rows, w.n, w.k, out);
    else
        brisk_quant_matmul(x, w.q, w.d, w.m, w.sub, (int)w.bits, (int)w.tiled, rows, w.n, w.k, s.xq, s.xd, s.xs, s.xn, out);
    if (w.bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < w.n; i++) out[r * w.n + i] += w.bias[i];
}

}  // namespace

extern "C" {

// residual [rows, hidden]: the embeddings in, the residual stream after the last layer out;
// out [rows, hidden]: the final norm of it. cos, sin [rows, rot_dim / 2]; slots [rows] int64;
// block_tables [rows, max_blocks] and context_lens [rows] int32 (lengths include the new token).
// Returns 0, or the paged kernel's nonzero code for a shape it refuses (checked before the first
// layer, so nothing has been written then).
int brisk_decode_stack(const Layer* layers, int64_t num_layers, const Dims* dims, const float* final_norm,
                       float* residual, const float* cos, const float* sin, const int64_t* slots,
                       const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens, int64_t rows,
                       const Scratch* scratch, float* out) {
    const Dims& d = *dims;
    const Scratch& s = *scratch;
    const int64_t q_size = d.heads * d.head_dim, kv_size = d.kv_heads * d.head_dim;
    const int64_t qkv_n = q_size + 2 * kv_size;
    if (d.head_dim > 256) return 1;
    if (d.kv_heads <= 0 || d.heads % d.kv_heads) return 3;
    if (d.heads > 128) return 2;

    brisk_rms_norm(residual, nullptr, layers[0].input_norm, s.x, rows, d.hidden, d.eps);
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer& L = layers[l];
        if (L.qkv_rest.q) {  // two parts: each into the free gate_up buffer, then their rows side by side
            const int64_t n0 = L.qkv.n, n1 = L.qkv_rest.n;
            matmul(L.qkv, s.x, rows, s, s.gate_up);
            matmul(L.qkv_rest, s.x, rows, s, s.gate_up + rows * n0);
            for (int64_t r = 0; r < rows; r++) {
                std::memcpy(s.qkv + r * qkv_n, s.gate_up + r * n0, n0 * sizeof(float));
                std::memcpy(s.qkv + r * qkv_n + n0, s.gate_up + rows * n0 + r * n1, n1 * sizeof(float));
            }
        } else {
            matmul(L.qkv, s.x, rows, s, s.qkv);
        }
        if (L.qk_norm) {  // q and k normalized (per head, or each over its projection), then rotated apart
            // as the Python path does; the normed k goes back into qkv, beside v, for the K/V store
            const bool head = L.qk_norm == 1;
            for (int64_t r = 0; r < rows; r++) {
                float* row = s.qkv + r * qkv_n;
                brisk_rms_norm(row, nullptr, L.q_norm, s.q + r * q_size, head ? d.heads : 1,
                               head ? d.head_dim : q_size, d.eps);
                brisk_rms_norm(row + q_size, nullptr, L.k_norm, s.attn, head ? d.kv_heads : 1,
                               head ? d.head_dim : kv_size, d.eps);
                std::memcpy(row + q_size, s.attn, kv_size * sizeof(float));
            }
            brisk_rope(s.q, q_size, cos, sin, rows, d.heads, d.head_dim, d.rot_dim);
            brisk_rope(s.qkv + q_size, qkv_n, cos, sin, rows, d.kv_heads, d.head_dim, d.rot_dim);
        } else {
            brisk_rope(s.qkv, qkv_n, cos, sin, rows, d.heads + d.kv_heads, d.head_dim, d.rot_dim);
            for (int64_t r = 0; r < rows; r++)
                std::memcpy(s.q + r * q_size, s.qkv + r * qkv_n, q_size * sizeof(float));
        }
        brisk_store_kv(s.qkv + q_size, s.qkv + q_size + kv_size, qkv_n, slots, L.k_cache, L.v_cache, L.k_scale,
                       L.v_scale, (int)d.kv_dtype, rows, d.kv_heads, d.head_dim);
        const int code = brisk_paged_decode_attention(s.q, L.k_cache, L.v_cache, (int)d.kv_dtype, L.k_scale,
                                                      L.v_scale, block_tables,
                                                      max_blocks, context_lens, rows, d.heads, d.kv_heads,
                                                      d.head_dim, d.block_size, d.scale, d.part_tokens, L.window,
                                                      0.f, L.sinks, s.attn);
        if (code) return code;
        matmul(L.o, s.attn, rows, s, s.proj);
        brisk_rms_norm(s.proj, residual, L.post_norm, s.x, rows, d.hidden, d.eps);
        if (L.moe.router) {
            if (brisk_moe_block(&L.moe, s.x, rows, s.proj)) return 4;  // decode_stack.py checked what it takes
        } else {
            matmul(L.gate_up, s.x, rows, s, s.gate_up);
            brisk_silu_mul(s.gate_up, s.act, rows, d.inter);
            matmul(L.down, s.act, rows, s, s.proj);
        }
        const float* next_norm = l + 1 < num_layers ? layers[l + 1].input_norm : final_norm;
        brisk_rms_norm(s.proj, residual, next_norm, l + 1 < num_layers ? s.x : out, rows, d.hidden, d.eps);
    }
    return 0;
}

}  // extern "C"
