"""Random-weight GGUF files of real architectures, with a real model's tokenizer.

No model hub is reachable here, so benchmarks at scale (a TinyLlama-shaped 1.1B model) and
tests of the quantized paths write their own GGUF with the `gguf` package: the shapes, tensor
types and tokenizer are real, so memory, load time and throughput are real; the text is noise.
The weights are scaled like a trained model's (std 0.02, norms 1) so activations stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    context: int = 2048
    head_dim: int | None = None  # hidden // heads unless given (Qwen3: 128 at hidden 2048 with 32 heads)
    # a mixture of experts: every layer's MLP is `experts` experts of `expert_ffn`, `experts_used` per token
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    arch: str = "llama"  # the GGUF architecture: llama (Llama, Mistral; Mixtral with experts), qwen3, qwen3moe, olmoe

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


TINYLLAMA = Shape(hidden=2048, layers=22, ffn=5632, heads=32, kv_heads=4)
MISTRAL_7B = Shape(hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8)
# Llama-3.2-1B's blocks (16 layers, 32/8 heads x 64, FFN 8192): 1.07B weights with the demo's 49k vocabulary; its
# 128k context cut to 16k (the long prompts the KV benchmarks send fit TinyLlama's 2,048 no longer)
LLAMA32_1B = Shape(hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8, context=16384)
# Qwen3-30B-A3B's layer: 128 experts of 768, 8 per token, 32/4 heads x 128, q/k norms
QWEN3_30B_A3B = Shape(hidden=2048, layers=48, ffn=6144, heads=32, kv_heads=4, context=4096, head_dim=128,
                      experts=128, experts_used=8, expert_ffn=768, arch="qwen3moe")
# Qwen3-Embedding-0.6B's shape (a Qwen3 block, last-token pooling)
QWEN3_EMBEDDING_06B = Shape(hidden=1024, layers=28, ffn=3072, heads=16, kv_heads=8, context=4096, head_dim=128,
                            arch="qwen3")
# gpt-oss-20b's shape: 24 layers, 32 experts of 2880 (4 a token), 64/8 heads x 64, every other layer sliding
# over 128 tokens, sinks and biases (the vocabulary is the tokenizer's the file copies)
GPT_OSS_20B = Shape(hidden=2880, layers=24, ffn=2880, heads=64, kv_heads=8, context=4096, head_dim=64, experts=32,
                    experts_used=4, expert_ffn=2880, arch="gpt-oss")
SHAPES = {"gpt-oss-20b": GPT_OSS_20B, "tinyllama": TINYLLAMA, "llama3.2-1b": LLAMA32_1B, "mistral7b": MISTRAL_7B,
          "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-embedding-0.6b": QWEN3_EMBEDDING_06B}


def _copy_tokenizer(writer, source_gguf: Path) -> int:
    """Copy the tokenizer and chat template of `source_gguf`; returns its vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(source_gguf))
    vocab = 0
    for key in TOKENIZER_KEYS:
        field = reader.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
            if key == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            writer.add_key_value(key, value, kind)
    return vocab


def _small_tokenizer(writer, vocab: int) -> int:
    """A `vocab`-token tokenizer with no merges: quick to read, for tests that need no real text."""
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges([])
    return vocab


def quantize_q4_k(values: np.ndarray, top: int = 15) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> GGUF Q4_K blocks [rows, cols / 256 * 144] (uint8),
    for random-weight test models (the `gguf` package has no Q4_K quantizer; llama.cpp's picks scales
    by search, this one by each block's range). Per super-block of 256: float16 d and dmin, then 8
    6-bit scales and mins packed in 12 bytes, then 128 bytes of 4-bit values, sub-blocks 2j and 2j+1 in
    the low and high nibbles of bytes 32j..32j+31; w = d * sc * q - dmin * mn. `top` 31: Q5_K (`quantize_q5_k`)."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 8, 32)  # [super-blocks, sub-blocks, 32]
    lo = np.minimum(x.min(-1), 0.0)
    scale, offset = (x.max(-1) - lo) / top, -lo  # per sub-block, >= 0
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(offset, dminf, out=np.zeros_like(offset), where=dminf > 0)), 0, 63).astype(np.uint8)
    step, shift = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.clip(np.round(np.divide(x + shift, step, out=np.zeros_like(x), where=step > 0)), 0, top).astype(np.uint8)
    packed_scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                                    (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)
    # Q5_K: bit i of byte j of qh is the top bit of sub-block i's element j
    qh = [((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)] if top == 31 else []
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed_scales, *qh,
                             qs], axis=1)
    return blocks.reshape(rows, -1)


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> GGUF Q5_K blocks [rows, cols / 256 * 176]: Q4_K's with 5-bit values, their top
    bits in 32 bytes between the scales and the low nibbles."""
    return quantize_q4_k(values, top=31)


def _signed_sixteens(values: np.ndarray, span: float, low: int, high: int, sc_max: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K's/Q3_K's scheme for random test weights: per super-block of 256 a float16 d, per 16 a signed
    integer sc (each 16's largest magnitude over `span` steps, sc = that step / d in [-sc_max - 1, sc_max]),
    values q in [low, high]. Returns (d [n] float16, sc [n, 16] int16, q - low [n, 16, 16] uint8)."""
    x = values.astype(np.float32).reshape(-1, 16, 16)  # [super-blocks, sub-blocks, 16]
    scale = np.abs(x).max(-1) / span
    d = (scale.max(-1) / sc_max).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -sc_max - 1, sc_max)
    step = (df * sc.astype(np.float32))[..., None]
    q = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0)), low, high) - low
    return d, sc.astype(np.int16), q.astype(np.uint8)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> GGUF Q6_K blocks [rows, cols / 256 * 210] (uint8),
    for random-weight test models (the `gguf` package has no Q6_K quantizer; this one takes each 16's
    range). Per super-block of 256: 128 bytes of low 4 bits (byte i of half h: elements 128h + i and
    128h + 64 + i), 64 bytes of top 2 bits (byte i of half h, bits 2s: element 128h + 32s + i), 16 signed
    scales, float16 d; w = d * sc * (q - 32)."""
    rows, cols = values.shape
    d, sc, q = _signed_sixteens(values, 31.5, -32, 31, 127)
    sc = sc.astype(np.int8)
    q = q.reshape(-1, 2, 128)  # [super-blocks, half, 128]
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)
    top = (q >> 4).reshape(-1, 2, 4, 32)
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                            axis=1)
    return blocks.reshape(rows, cols // 256 * 210)


def quantize_q2_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> GGUF Q2_K blocks [rows, cols / 256 * 84] (uint8), for
    random-weight test models (the `gguf` package has no Q2_K quantizer; this one takes each 16's range). Per
    super-block of 256: 16 bytes sc | mn << 4 (4 bits each, one per 16), 64 bytes of 2-bit values (byte 32h + l,
    bits 2j: element 128h + 32j + l), float16 d and dmin; w = d * sc * q - dmin * mn."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 16, 16)  # [super-blocks, sub-blocks, 16]
    lo = np.minimum(x.min(-1), 0.0)
    scale, offset = (x.max(-1) - lo) / 3, -lo
    d, dmin = (scale.max(-1) / 15).astype(np.float16), (offset.max(-1) / 15).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 15).astype(np.uint8)
    mn = np.clip(np.round(np.divide(offset, dminf, out=np.zeros_like(offset), where=dminf > 0)), 0, 15).astype(np.uint8)
    step, shift = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.clip(np.round(np.divide(x + shift, step, out=np.zeros_like(x), where=step > 0)), 0, 3).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [super-blocks, half h, j, l]
    qs = (q << np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]).sum(2, dtype=np.uint8)
    blocks = np.concatenate([sc | (mn << 4), qs.reshape(-1, 64), d.view(np.uint8).reshape(-1, 2),
                             dmin.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, cols // 256 * 84)


_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_codes(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The nearest IQ4 value's code for each x / step (step [..., 1] broadcast over x's last axis)."""
    scaled = np.divide(x, step, out=np.zeros_like(x), where=step != 0)
    return np.searchsorted((_IQ4[1:] + _IQ4[:-1]) / 2, scaled).astype(np.uint8)  # the values are sorted


def _iq4_pack(codes: np.ndarray) -> np.ndarray:
    """Codes [..., 32] -> 16 bytes each in Q4_0's order (byte j: element j low, element j + 16 high)."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 32) -> GGUF IQ4_NL blocks [rows, cols / 32 * 18] (uint8), for
    random-weight test models (the `gguf` package has no IQ4 quantizer; llama.cpp's searches the scale, this one
    takes each block's largest magnitude onto -127): float16 d, 16 bytes of codes; w = d * IQ4_VALUES[q]."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 32)
    d = (-np.abs(x).max(-1) / 127).astype(np.float16)
    codes = _iq4_codes(x, d.astype(np.float32)[:, None])
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), _iq4_pack(codes)], axis=1).reshape(rows, cols // 32 * 18)


def quantize_iq4_xs(values: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> GGUF IQ4_XS blocks [rows, cols / 256 * 136] (uint8):
    float16 d, uint16 of the scales' top 2 bits (2 per 32), 4 bytes of their low 4 bits, 128 bytes of codes as
    IQ4_NL's per 32; w = d * (scale - 32) * IQ4_VALUES[q]."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 8, 32)
    block = -np.abs(x).max(-1) / 127  # each 32's own step, <= 0
    d = (np.abs(block).max(-1) / 32).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(block, df, out=np.zeros_like(block), where=df > 0)), -32, 31).astype(np.int16)
    codes = _iq4_codes(x, (df * sc)[..., None])
    stored = (sc + 32).astype(np.uint16)  # [super-blocks, 8], 6 bits each
    high = ((stored >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    low = (stored[:, 0::2] & 15) | ((stored[:, 1::2] & 15) << 4)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2),
                             low.astype(np.uint8), _iq4_pack(codes).reshape(-1, 128)], axis=1)
    return blocks.reshape(rows, cols // 256 * 136)


def quantize_q3_k(values: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> GGUF Q3_K blocks [rows, cols / 256 * 110] (uint8),
    for random-weight test models (the `gguf` package has no Q3_K quantizer; this one takes each 16's
    range). Per super-block of 256: 32 bytes of top bits (bit 4h + j of byte l: element 128h + 32j + l),
    64 bytes of low 2 bits (byte 32h + l, bits 2j: the same element), 16 6-bit scales stored + 32 in 12
    bytes (scale i: nibble i // 8 of byte i % 8, its top 2 bits at 2 (i // 4) of byte 8 + i % 4),
    float16 d; w = d * sc * (q - 4)."""
    rows, cols = values.shape
    d, sc, q = _signed_sixteens(values, 4, -4, 3, 31)
    q = q.reshape(-1, 2, 4, 32)  # [super-blocks, half h, j, l]
    hmask = ((q >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    qs = ((q & 3) << np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]).sum(2, dtype=np.uint8)
    stored = (sc + 32).astype(np.uint8)  # [super-blocks, 16]
    low = (stored[:, :8] & 15) | ((stored[:, 8:] & 15) << 4)
    high = (stored >> 4).reshape(-1, 4, 4)  # [super-blocks, i // 4, i % 4]
    high = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    blocks = np.concatenate([hmask, qs.reshape(-1, 64), low, high, d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, cols // 256 * 110)


_E2M1 = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float32)  # MXFP4's magnitudes, doubled (gguf's kvalues)


def quantize_mxfp4(values: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 32) -> GGUF MXFP4 blocks [rows, cols / 32 * 17] (uint8): an E8M0
    byte e (the block's largest magnitude onto the top of E2M1's range, as gguf's quantizer picks it), then 16
    bytes of codes in Q4_0's order, sign in each code's top bit; w = 2^(e - 128) * MXFP4_VALUES[q]. The nearest
    value by a search of the sorted magnitudes (gguf's quantizer compares all 16, too slow for a 20B shape)."""
    rows, cols = values.shape
    x = values.astype(np.float32).reshape(-1, 32)
    top = np.abs(x).max(-1)
    with np.errstate(divide="ignore"):
        e = np.where(top > 0, np.floor(np.log2(top)) - 2 + 127, 0).clip(0, 254).astype(np.uint8)
    scale = (np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e.astype(np.uint32) - 1) << np.uint32(23))
             .astype(np.uint32).view(np.float32))[:, None]
    magnitude = np.divide(np.abs(x), scale, out=np.zeros_like(x), where=scale > 0)
    codes = np.searchsorted((_E2M1[1:] + _E2M1[:-1]) / 2, magnitude).astype(np.uint8).clip(0, 7)
    codes |= (x < 0).astype(np.uint8) << 3
    return np.concatenate([e[:, None], _iq4_pack(codes)], axis=1).reshape(rows, cols // 32 * 17)


MIXES = {  # llama.cpp's mixes, as far as a test model needs them: tensor name suffix -> type
    "Q4_K_M": ("Q4_K", {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}),
    "Q5_K_M": ("Q5_K", {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}),
    "Q3_K_M": ("Q3_K", {"attn_v.weight": "Q4_K", "attn_output.weight": "Q4_K", "ffn_down.weight": "Q4_K",
                        "output.weight": "Q6_K"}),
    # llama.cpp's Q2_K
    "Q2_K_mix": ("Q2_K", {"attn_v.weight": "Q3_K", "ffn_down.weight": "Q3_K", "output.weight": "Q6_K"}),
    # llama-quantize's MXFP4_MOE (gpt-oss as it ships): the experts in MXFP4, every other matrix Q8_0
    "MXFP4_MOE": ("Q8_0", {"_exps": "MXFP4"}),
}


def _matrices(shape: Shape, vocab: int, tied_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """Every weight of the shape, [out, in] (experts: [experts, out, in])."""
    dim, q, kv = shape.dim, shape.heads * shape.dim, shape.kv_heads * shape.dim
    matrices = {"token_embd.weight": (vocab, shape.hidden)}
    if not tied_embeddings:
        matrices["output.weight"] = (vocab, shape.hidden)
    for i in range(shape.layers):
        p = f"blk.{i}."
        matrices.update({p + "attn_q.weight": (q, shape.hidden), p + "attn_k.weight": (kv, shape.hidden),
                         p + "attn_v.weight": (kv, shape.hidden), p + "attn_output.weight": (shape.hidden, q)})
        if shape.experts:
            e, f = shape.experts, shape.expert_ffn
            matrices.update({p + "ffn_gate_exps.weight": (e, f, shape.hidden), p + "ffn_up_exps.weight": (e, f, shape.hidden),
                             p + "ffn_down_exps.weight": (e, shape.hidden, f)})
        else:
            matrices.update({p + "ffn_gate.weight": (shape.ffn, shape.hidden), p + "ffn_up.weight": (shape.ffn, shape.hidden),
                             p + "ffn_down.weight": (shape.hidden, shape.ffn)})
    return matrices


def _vectors(shape: Shape) -> dict[str, tuple[int, ...]]:
    """The norms (ones) and, for experts, the routers (F32 as llama.cpp keeps them)."""
    vectors = {"output_norm.weight": (shape.hidden,)}
    oai = shape.arch == "gpt-oss"
    for i in range(shape.layers):
        p = f"blk.{i}."
        vectors.update({p + "attn_norm.weight": (shape.hidden,),
                        p + ("post_attention_norm.weight" if oai else "ffn_norm.weight"): (shape.hidden,)})
        if oai:  # gpt-oss: biases on attention, router and experts, and a sink per head
            q, kv, e, f = shape.heads * shape.dim, shape.kv_heads * shape.dim, shape.experts, shape.expert_ffn
            vectors.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,),
                            p + "attn_output.bias": (shape.hidden,), p + "attn_sinks.weight": (shape.heads,),
                            p + "ffn_gate_inp.bias": (e,), p + "ffn_gate_exps.bias": (e, f),
                            p + "ffn_up_exps.bias": (e, f), p + "ffn_down_exps.bias": (e, shape.hidden)})
        if shape.arch in ("qwen3", "qwen3moe"):  # per head
            vectors.update({p + "attn_q_norm.weight": (shape.dim,), p + "attn_k_norm.weight": (shape.dim,)})
        elif shape.arch == "olmoe":  # over the whole projection
            vectors.update({p + "attn_q_norm.weight": (shape.heads * shape.dim,),
                            p + "attn_k_norm.weight": (shape.kv_heads * shape.dim,)})
        if shape.experts:
            vectors[p + "ffn_gate_inp.weight"] = (shape.experts, shape.hidden)
    return vectors


def write_random_gguf(path: Path, shape: Shape, tensor_type: str, tokenizer_from: Path | None, seed: int = 0,
                      tied_embeddings: bool = False, small_vocab: int = 128, pooling_type: int | None = None,
                      random_norms: bool = False) -> Path:
    """A GGUF of `shape.arch` (llama, qwen3, qwen3moe or olmoe) with random weights: every matrix in `tensor_type`
    (e.g. Q4_0, Q8_0, F32, BF16: what `gguf.quants.quantize` writes; or Q2_K-Q6_K, IQ4_NL, IQ4_XS: this module's
    quantize_*), norms in F32 (ones, or with `random_norms` around one, so that a test sees which norm is which;
    and routers, for experts). The tokenizer is copied from `tokenizer_from`, or (None) a
    `small_vocab`-token one. A mix of `MIXES` (Q4_K_M, Q3_K_M) gives some tensors another type, as llama.cpp's mix
    does in every layer (its own choice bumps only some layers). Tensors are written as they are made (memory
    stays one tensor deep: a 30B-parameter shape writes in a few GB)."""
    import gguf

    base, overrides = MIXES.get(tensor_type, (tensor_type, {}))
    writer = gguf.GGUFWriter(str(path), shape.arch)
    vocab = _copy_tokenizer(writer, tokenizer_from) if tokenizer_from else _small_tokenizer(writer, small_vocab)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if shape.head_dim:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    if pooling_type is not None:  # an embedding model, as llama.cpp's converter marks one (3: last-token pooling)
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    writer.add_layer_norm_rms_eps(1e-5 if shape.arch in ("llama", "gpt-oss") else 1e-6)
    if shape.arch == "gpt-oss":  # as the converter writes gpt-oss-20b's
        writer.add_sliding_window(128)
        writer.add_rope_freq_base(150000.0)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    else:
        writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)
    plan = []  # (name, [out, in] dims per matrix (experts: leading count), GGML type)
    for name, dims in _matrices(shape, vocab, tied_embeddings).items():
        # a mix's rule names a tensor (output.weight is the head, not attn_output); ffn_down covers ffn_down_exps
        plain = name.replace("_exps.", ".")
        qtype = gguf.GGMLQuantizationType[next((t for end, t in overrides.items()
                                                if plain == end or plain.endswith("." + end)
                                                or (end == "_exps" and "_exps." in name)), base)]
        plan.append((name, dims, qtype))
    plan += [(name, dims, gguf.GGMLQuantizationType.F32) for name, dims in _vectors(shape).items()]
    for name, dims, qtype in plan:
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        byte_dims = (*dims[:-1], dims[-1] // block * type_bytes)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor_info(name, dims, np.dtype(np.float32 if qtype == gguf.GGMLQuantizationType.F32
                                                        else np.float16), int(np.prod(byte_dims)), raw_dtype=qtype)
        else:
            writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8), int(np.prod(byte_dims)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, qtype in plan:
        if len(dims) == 1 and name.endswith("norm.weight"):
            norm = 1 + 0.25 * rng.standard_normal(dims) if random_norms else np.ones(dims)
            writer.write_tensor_data(norm.astype(np.float32))
            continue
        if len(dims) == 1 or name.endswith("_exps.bias"):  # gpt-oss's biases and sinks
            writer.write_tensor_data((rng.standard_normal(dims) * (0.5 if "sinks" in name else 0.02)).astype(np.float32))
            continue
        rows = [dims] if len(dims) == 2 else [dims[1:]] * dims[0]  # experts one at a time
        data = [_random_matrix(rng, rows_dims, qtype, name) for rows_dims in rows]
        writer.write_tensor_data(data[0] if len(data) == 1 else np.stack(data))
    writer.close()
    return path


def _random_matrix(rng, dims: tuple[int, int], qtype, name: str) -> np.ndarray:
    """One [out, in] matrix of random weights (std 0.02; a router's larger, so that it chooses) as GGML type
    `qtype` stores it."""
    import gguf
    from gguf.quants import quantize

    k_quantizers = {gguf.GGMLQuantizationType.Q4_K: quantize_q4_k, gguf.GGMLQuantizationType.Q5_K: quantize_q5_k,
                    gguf.GGMLQuantizationType.Q6_K: quantize_q6_k, gguf.GGMLQuantizationType.Q3_K: quantize_q3_k,
                    gguf.GGMLQuantizationType.Q2_K: quantize_q2_k,
                    gguf.GGMLQuantizationType.IQ4_NL: quantize_iq4_nl,
                    gguf.GGMLQuantizationType.IQ4_XS: quantize_iq4_xs,
                    gguf.GGMLQuantizationType.MXFP4: quantize_mxfp4}
    values = rng.standard_normal(dims, dtype=np.float32) * (0.5 if name.endswith("ffn_gate_inp.weight") else 0.02)
    if qtype == gguf.GGMLQuantizationType.F32:
        return values
    if qtype in k_quantizers:
        return k_quantizers[qtype](values)
    return quantize(values, qtype)


def write_truncated_gguf(source: Path, path: Path, num_layers: int) -> Path:
    """A copy of `source` keeping only its first `num_layers` transformer blocks (same tokenizer,
    embeddings, final norm and head, tensors copied as stored): a real, smaller draft model for
    speculative decoding whose predictions agree with the full model's only in part."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    block_count = f"{arch}.block_count"
    if not 1 <= num_layers <= reader.fields[block_count].contents():
        raise ValueError(f"{source} has {reader.fields[block_count].contents()} layers; cannot keep {num_layers}")
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        value = num_layers if key == block_count else field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= num_layers:
            continue
        # the reader's data is the stored values ([rows, bytes per row] for quantized types)
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
