// A mixture-of-experts MLP in one call: the router, the top k, and the routed experts' SwiGLU, for rows of
// float32 activations. The Python path (brisk/models/moe.py) calls it once per MoE layer, and the compiled
// decode step (decoder.cpp) calls the same function, so the two give the same bits; from Python it replaces
// ~25 small PyTorch ops a layer (sort, count, gather, scatter, weighted sum) whose dispatch, at one decode
// row, costs as much as reading the experts.
//   route     logits = x . router^T in float32 (LANES partial sums, a fixed order), softmax (libm expf), the
//             top k by probability (ties: the lower expert id first), renormalised to sum 1 where asked:
//             transformers' TopKRouter, up to float rounding. gpt-oss (`oai`): the router's bias added, the
//             top k logits (ties: the lower id) softmaxed among themselves (GptOssTopKRouter)
//   experts   the (row, choice) pairs grouped by expert (rows ascending within one), so that each chosen
//             expert's weights are read once for all the rows that chose it (brisk_quant_matmul_experts),
//             SiLU-gate, down, then each row's sum of weight * expert output in its own choice order, one
//             addition at a time: a row's result is the same alone or in any batch. gpt-oss: each expert's
//             biases after its gate_up and its down, and the clamped SwiGLU in place of SiLU-gate
// Experts are stacked tiled quantized weights (quant_matmul.cpp's layouts with a leading expert dimension).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "brisk_abi.h"

namespace {

constexpr int LANES = 16;  // independent partial sums: vectorized without reassociating (no -ffast-math)
constexpr int64_t PARALLEL_MIN_MACS = 1 << 16;

#define CLONES __attribute__((target_clones("avx2", "default")))

CLONES void router_logits(const float* x, const float* w, int64_t rows, int64_t E, int64_t H, float* logits) {
#pragma omp parallel for collapse(2) schedule(static) if (rows * E * H >= PARALLEL_MIN_MACS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t e = 0; e < E; e++) {
            const float* a = x + r * H;
            const float* b = w + e * H;
            float acc[LANES] = {0};
            int64_t i = 0;
            for (; i + LANES <= H; i += LANES)
                for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
            float sum = 0.f;
            for (; i < H; i++) sum += a[i] * b[i];
            for (int j = 0; j < LANES; j++) sum += acc[j];
            logits[r * E + e] = sum;
        }
}

// gpt-oss: the top k logits (ties: the lower id first), then a softmax over those k
void top_k_logits(const float* logits, int64_t rows, int64_t E, int64_t k, int64_t* ids, float* weights) {
    for (int64_t r = 0; r < rows; r++) {
        const float* l = logits + r * E;
        int64_t* id = ids + r * k;
        float* wt = weights + r * k;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                bool taken = false;
                for (int64_t t = 0; t < j && !taken; t++) taken = id[t] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[j] = best;
        }
        const float top = l[id[0]];
        float total = 0.f;
        for (int64_t j = 0; j < k; j++) {
            wt[j] = std::exp(l[id[j]] - top);
            total += wt[j];
        }
        for (int64_t j = 0; j < k; j++) wt[j] /= total;
    }
}

// gpt-oss's gate over [A, 2 * I] (gate's columns, then up's): (clamp(up) + 1) * g * sigmoid(alpha * g), with
// g = min(gate, limit) and up clamped to +-limit (transformers' GptOssExperts)
void clamped_swiglu(const float* gate_up, float* out, int64_t A, int64_t I, float alpha, float limit) {
    for (int64_t a = 0; a < A; a++) {
        const float* g = gate_up + a * 2 * I;
        const float* u = g + I;
        float* o = out + a * I;
        for (int64_t i = 0; i < I; i++) {
            const float gate = std::min(g[i], limit);
            const float up = std::max(-limit, std::min(u[i], limit));
            o[i] = (up + 1.f) * (gate * (1.f / (1.f + std::exp(-(gate * alpha)))));
        }
    }
}

// each grouped row's expert bias ([E, n]) added to its output row
void add_expert_bias(float* rows, const float* bias, const std::vector<int64_t>& experts,
                     const std::vector<int64_t>& offsets, int64_t n) {
    for (size_t g = 0; g < experts.size(); g++) {
        const float* b = bias + experts[g] * n;
        for (int64_t pos = offsets[g]; pos < offsets[g + 1]; pos++)
            for (int64_t i = 0; i < n; i++) rows[pos * n + i] += b[i];
    }
}

void top_k(const float* logits, int64_t rows, int64_t E, int64_t k, bool renorm, float* probs, int64_t* ids,
           float* weights) {
    for (int64_t r = 0; r < rows; r++) {
        const float* l = logits + r * E;
        float* p = probs + r * E;
        const float top = *std::max_element(l, l + E);
        float total = 0.f;
        for (int64_t e = 0; e < E; e++) {
            p[e] = std::exp(l[e] - top);
            total += p[e];
        }
        for (int64_t e = 0; e < E; e++) p[e] /= total;
        int64_t* id = ids + r * k;
        float* wt = weights + r * k;
        for (int64_t j = 0; j < k; j++) {  // k passes of a max: k is small (2-8) and E at most a few hundred
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                bool taken = false;
                for (int64_t t = 0; t < j && !taken; t++) taken = id[t] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            id[j] = best;
            wt[j] = p[best];
        }
        if (renorm) {
            float sum = 0.f;
            for (int64_t j = 0; j < k; j++) sum += wt[j];
            for (int64_t j = 0; j < k; j++) wt[j] /= sum;
        }
    }
}

struct Scratch {
    std::vector<float> logits, probs, weights, gathered, gate_up, act, down, xd, xs;
    std::vector<int64_t> ids, order, experts, offsets;
    std::vector<int8_t> xq;
    std::vector<int32_t> xn;

    void quant(int64_t rows, int64_t K) {
        xq.resize(rows * K);
        xd.resize(rows * K / 32);
        xs.resize(rows * K / 32);
        xn.resize(2 * rows * K / 32);
    }
};

thread_local Scratch scratch;

int grouped(const float* x, const BriskExpertWeight& w, const Scratch& s, int64_t A, float* out) {
    Scratch& q = scratch;
    q.quant(A, w.w.k);
    return brisk_quant_matmul_experts(x, w.w.q, w.w.d, w.w.m, w.w.sub, w.q_stride, w.d_stride, w.m_stride,
                                      w.sub_stride, s.experts.data(), s.offsets.data(),
                                      (int64_t)s.experts.size(), (int)w.w.bits, w.w.n, w.w.k, q.xq.data(), q.xd.data(),
                                      q.xs.data(), q.xn.data(), out);
}

}  // namespace

extern "C" {

void brisk_moe_route(const float* x, const float* router, const float* router_bias, int64_t rows, int64_t E,
                     int64_t H, int64_t k, int mode, int64_t* ids, float* weights) {
    Scratch& s = scratch;
    s.logits.resize(rows * E);
    s.probs.resize(rows * E);
    router_logits(x, router, rows, E, H, s.logits.data());
    if (router_bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t e = 0; e < E; e++) s.logits[r * E + e] += router_bias[e];
    if (mode == 2)
        top_k_logits(s.logits.data(), rows, E, k, ids, weights);
    else
        top_k(s.logits.data(), rows, E, k, mode != 0, s.probs.data(), ids, weights);
}

int brisk_moe_block(const BriskExperts* m, const float* x, int64_t rows, float* out) {
    const int64_t E = m->num, k = m->top_k, H = m->gate_up.w.k, I = m->down.w.k;
    if (E <= 0 || k <= 0 || k > E || m->gate_up.w.n != 2 * I || m->down.w.n != H || !m->gate_up.w.tiled ||
        !m->down.w.tiled || m->gate_up.w.bits == 16 || m->down.w.bits == 16)
        return 1;
    Scratch& s = scratch;
    const int64_t A = rows * k;
    s.ids.resize(A);
    s.weights.resize(A);
    brisk_moe_route(x, m->router, m->router_bias, rows, E, H, k, m->oai ? 2 : (int)m->renorm, s.ids.data(),
                    s.weights.data());
    // the pairs by expert (a counting sort: rows ascending within an expert, as the Python path's stable sort)
    std::vector<int64_t> count(E + 1, 0);
    for (int64_t a = 0; a < A; a++) count[s.ids[a] + 1]++;
    s.experts.clear();
    s.offsets.assign(1, 0);
    for (int64_t e = 0; e < E; e++)
        if (count[e + 1]) {
            s.experts.push_back(e);
            s.offsets.push_back(s.offsets.back() + count[e + 1]);
        }
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];  // each expert's first position
    s.order.resize(A);  // position in the grouped rows -> pair (row * k + choice)
    std::vector<int64_t> at(A);  // pair -> its position
    for (int64_t a = 0; a < A; a++) {
        const int64_t pos = count[s.ids[a]]++;
        s.order[pos] = a;
        at[a] = pos;
    }
    s.gathered.resize(A * H);
    for (int64_t pos = 0; pos < A; pos++)
        std::memcpy(s.gathered.data() + pos * H, x + (s.order[pos] / k) * H, H * sizeof(float));
    s.gate_up.resize(A * 2 * I);
    s.act.resize(A * I);
    s.down.resize(A * H);
    if (grouped(s.gathered.data(), m->gate_up, s, A, s.gate_up.data())) return 1;
    if (m->gate_up_bias) add_expert_bias(s.gate_up.data(), m->gate_up_bias, s.experts, s.offsets, 2 * I);
    if (m->oai)
        clamped_swiglu(s.gate_up.data(), s.act.data(), A, I, m->swiglu_alpha, m->swiglu_limit);
    else
        brisk_silu_mul(s.gate_up.data(), s.act.data(), A, I);
    if (grouped(s.act.data(), m->down, s, A, s.down.data())) return 1;
    if (m->down_bias) add_expert_bias(s.down.data(), m->down_bias, s.experts, s.offsets, H);
    for (int64_t r = 0; r < rows; r++) {  // weight * output, summed in choice order, one addition at a time
        float* o = out + r * H;
        for (int64_t j = 0; j < k; j++) {
            const float w = s.weights[r * k + j];
            const float* y = s.down.data() + at[r * k + j] * H;
            if (j == 0)
                for (int64_t h = 0; h < H; h++) o[h] = y[h] * w;
            else
                for (int64_t h = 0; h < H; h++) o[h] += y[h] * w;
        }
    }
    return 0;
}

}  // extern "C"
