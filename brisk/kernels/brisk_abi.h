// brisk's compiled kernels: their C interface, declared once. Every .cpp includes this file, so
// the compiler holds each definition to its declaration (a C function declared twice with other
// parameters does not compile); brisk/kernels/abi.py gives Python the same signatures, in the
// same order. Change a signature here, in its definition and in abi.py together.
#pragma once

#include <cstdint>

// One weight [n, k] kept as stored: quantized (quant_matmul.cpp's layouts; bits 2 to 8, 20: iq4, 21: mxfp4) or 16-bit
// floats (half_matmul.cpp; bits 16, `half` the kv_types.h code: 1 bfloat16, 2 float16, with d and m
// null), and an optional float32 bias [n].
struct BriskQuantWeight {
    const uint8_t* q;
    const uint16_t* d;
    const uint16_t* m;  // null: no offsets
    const uint8_t* sub;  // tiled int4 with super-block scales (Q4_K), tiled int6's sub-scales (Q6_K), else null
    const float* bias;  // null: no bias
    int64_t bits, n, k;
    int64_t tiled;  // int4/int8 in tiles of 8 rows; 16-bit floats in panels of 16 rows
    int64_t half;   // bits 16: 1 bfloat16, 2 float16
};

// A mixture of experts' stacked weights: expert e's arrays start at w.q + e * q_stride (bytes; likewise d, m,
// sub), each one [n, k] as `w` describes (tiled quantized: quant_matmul.cpp's layouts).
struct BriskExpertWeight {
    BriskQuantWeight w;
    int64_t q_stride, d_stride, m_stride, sub_stride;
};

// A mixture-of-experts MLP (moe.cpp): the router [num, hidden] float32, each expert's gate and up rows
// [2 * inter, hidden] and down [hidden, inter], the top_k experts a token takes, renormalised or not.
// gpt-oss (`oai` 1): the router's bias [num], the top k logits softmaxed among themselves, each expert's biases
// (gate_up_bias [num, 2 * inter]: gate's then up's; down_bias [num, hidden]) and the clamped SwiGLU.
struct BriskExperts {
    const float* router;
    BriskExpertWeight gate_up, down;
    int64_t num, top_k, renorm;
    const float* router_bias;  // null: none
    const float* gate_up_bias;
    const float* down_bias;
    int64_t oai;
    float swiglu_alpha, swiglu_limit;
};

// One decoder layer of the compiled decode step (decoder.cpp).
struct BriskLayer {
    BriskQuantWeight qkv, o, gate_up, down;
    // q == null, or the q/k/v rows after qkv's, stored apart in another format (a GGUF Q4_K_M layer's
    // Q6_K attn_v beside its Q4_K attn_q/attn_k): the layer's qkv is [qkv; qkv_rest]
    BriskQuantWeight qkv_rest;
    const float* input_norm;  // weights [hidden]
    const float* post_norm;
    void* k_cache;  // [slots, kv_heads, head_dim] of the kv_dtype (kv_types.h)
    void* v_cache;
    float* k_scale;  // int8: [slots, kv_heads]; else null
    float* v_scale;
    int64_t window;  // sliding window, 0: none
    // RMSNorm of q and k before RoPE: 0 none, 1 per head (weights [head_dim]: Qwen3), 2 over the whole
    // projection (weights [heads * head_dim] and [kv_heads * head_dim]: OLMoE)
    int64_t qk_norm;
    const float* q_norm;
    const float* k_norm;
    BriskExperts moe;  // router null: the dense MLP (gate_up, down)
    const float* sinks;  // [heads]: gpt-oss's attention sinks; null: none
};

struct BriskDims {
    int64_t hidden, heads, kv_heads, head_dim, rot_dim, inter;
    int64_t kv_dtype, block_size, part_tokens;  // kv_dtype: kv_types.h's code
    float eps, scale;
};

struct BriskScratch {  // float32 buffers the caller allocates, sized for the step's rows
    float *x, *qkv, *q, *attn, *proj, *gate_up, *act;
    int8_t* xq;  // activation blocks for the matmuls
    float *xd, *xs;
    int32_t* xn;  // [2, rows, K/32] (brisk_quant_matmul's xn)
};

extern "C" {

// quant_matmul.cpp: out [M, N] = x [M, K] . W^T, quantizing x into the caller's scratch first.
// xq [M, K], xd, xs [M, K/32] float and xn [2, M, K/32] int32: the activation blocks' values, scales,
// scaled sums, and integer sums (then the integer sums of each block's first 16).
// wsub: tiled int4 with super-block scales (GGUF Q4_K as stored; quant_matmul.cpp, tile_scales) or tiled
// int6/int3 (bits 6/3, GGUF Q6_K/Q3_K as stored: their sub-scales), tiled int2's and IQ4_XS's scales, else null.
void brisk_quant_matmul(const float* x, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
                        const uint8_t* wsub, int bits, int tiled, int64_t M, int64_t N, int64_t K, int8_t* xq,
                        float* xd, float* xs, int32_t* xn, float* out);
// The same for a mixture of experts' stacked tiled weights: out [A, N], rows offsets[e] .. offsets[e + 1] - 1 of
// x [A, K] (grouped by expert) times expert experts[e]'s W, whose arrays start at wq + experts[e] * q_stride
// (bytes; likewise wd, wm, wsub); one pass over every (expert, tile), each expert read once. Scratch sized
// for A rows. 0, or 1 for a shape the kernel does not take.
int brisk_quant_matmul_experts(const float* x, const uint8_t* wq, const uint16_t* wd, const uint16_t* wm,
                               const uint8_t* wsub, int64_t q_stride, int64_t d_stride, int64_t m_stride,
                               int64_t sub_stride, const int64_t* experts, const int64_t* offsets, int64_t E, int bits,
                               int64_t N, int64_t K, int8_t* xq, float* xd, float* xs, int32_t* xn, float* out);
int brisk_kernels_isa();
void brisk_kernels_force_isa(int isa);

// moe.cpp: the router's top k of each row of x [rows, H] (router_bias [E] added where not null): ids [rows, k]
// int64 by probability (highest first) and their weights [rows, k]. mode 0: softmax probabilities; 1: those
// renormalised to sum 1; 2 (gpt-oss): the top k logits, softmaxed among themselves
void brisk_moe_route(const float* x, const float* router, const float* router_bias, int64_t rows, int64_t E,
                     int64_t H, int64_t k, int mode, int64_t* ids, float* weights);
// out [rows, hidden] = the mixture of experts of x [rows, hidden]; 0, or 1 for weights it does not take
int brisk_moe_block(const BriskExperts* m, const float* x, int64_t rows, float* out);

// half_matmul.cpp: out [M, N] = x [M, K] . W^T, W 16-bit floats (kind 1 bfloat16, 2 float16);
// 0, or 1 for another kind. Takes brisk_kernels_isa()'s path.
int brisk_half_matmul(const float* x, const uint16_t* w, int kind, int64_t M, int64_t N, int64_t K, float* out);
// the same with W in panels of 16 rows, [ceil(N/16)][K][16] (brisk.kernels.pack_half)
int brisk_half_matmul_panels(const float* x, const uint16_t* w, int kind, int64_t M, int64_t N, int64_t K,
                             float* out);

// paged_attention.cpp: 0, or a nonzero code for a shape the kernel does not take.
int brisk_paged_decode_attention(const float* q, const void* k_cache, const void* v_cache, int kv_dtype,
                                 const float* k_scale, const float* v_scale, const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                                 int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, float scale, int64_t part_tokens, int64_t window,
                                 float softcap, const float* sinks, float* out);
int brisk_paged_attention_isa();
void brisk_paged_attention_force_isa(int isa);
// staging of narrow K/V runs: 0 never, 1 tiles only (default), 2 always (the same bits in every mode);
// returns the previous mode (any other value: only read it)
int brisk_paged_attention_staged(int mode);

// fused_ops.cpp
void brisk_rms_norm(const float* x, float* residual, const float* w, float* out, int64_t rows, int64_t dim,
                    float eps);
void brisk_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter);
void brisk_rope(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t rows, int64_t heads,
                int64_t head_dim, int64_t rot_dim);
void brisk_store_kv(const float* k, const float* v, int64_t src_stride, const int64_t* slots, void* k_cache,
                    void* v_cache, float* k_scale, float* v_scale, int kv_dtype, int64_t rows, int64_t kv_heads,
                    int64_t head_dim);

// decoder.cpp: 0, or the paged kernel's nonzero code (checked before anything is written).
int brisk_decode_stack(const BriskLayer* layers, int64_t num_layers, const BriskDims* dims, const float* final_norm,
                       float* residual, const float* cos, const float* sin, const int64_t* slots,
                       const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens, int64_t rows,
                       const BriskScratch* scratch, float* out);

// repack.cpp: GGUF K-quant weights -> brisk's layouts at conversion (0, or 1 for bits it does not take).
// n_super super-blocks of GGUF type Q6_K/Q5_K/Q3_K/Q2_K (bits 6/5/3/2) -> their values, 256 a super-block.
int brisk_k_quant_values(const uint8_t* blocks, int bits, int64_t n_super, uint8_t* out);
// Q4_K's (or Q5_K's low) nibbles, 128 bytes at qs_offset of each block_bytes -> 16 bytes a block of 32 in
// Q4_0's nibble order (byte j: weight j | weight j + 16 << 4)
void brisk_k4_codes(const uint8_t* blocks, int64_t block_bytes, int64_t qs_offset, int64_t n_super, uint8_t* out);
// n_blocks blocks of block_bytes (Q4_0, Q4_1, Q8_0, IQ4_NL) -> their first head_bytes (the scales) and the rest
// (the weights), each run together
void brisk_split_blocks(const uint8_t* blocks, int64_t block_bytes, int64_t head_bytes, int64_t n_blocks, uint8_t* head,
                        uint8_t* payload);
// rows [n, nb blocks of `words` 4-byte words] -> tiles [n/8, nb, words, 8 rows] of the same words (tile_int4:
// 4 words a block, tile_int8: 8)
void brisk_tile_words(const uint8_t* rows, int64_t n, int64_t nb, int64_t words, uint8_t* out);
// Q4_K's (or Q5_K's) scales as stored: each super-block's float16 d and dmin (their bits) and its 8 blocks'
// 6-bit sc and mn, interleaved [n_super, 8, 2]
void brisk_k4_scales(const uint8_t* blocks, int64_t block_bytes, int64_t n_super, uint16_t* d, uint16_t* dmin,
                     uint8_t* sub);
// values [rows, cols] (one a byte) -> the tiled int2/int3/int5/int6 layout (brisk.kernels.tile_int*)
int brisk_tile_values(const uint8_t* q, int64_t rows, int64_t cols, int bits, uint8_t* out);

}  // extern "C"
