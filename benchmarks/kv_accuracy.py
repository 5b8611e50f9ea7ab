"""Accuracy of each KV cache dtype against float32 KV, over long prompts (issue: "KV cache in bf16,
fp8 and int8").

One long prompt per run: quant_accuracy.py's texts (English, Chinese, Japanese, German, French,
Python, SQL), concatenated and repeated until --tokens. It runs through the model as the server
runs it by default: prompt chunks of --chunk tokens laid out as decode rows, each reading its
context through the block table from the paged pool (compiled kernel, the pool's dtype), the
K/V of each chunk written into the pool (converted) before the next chunk reads it. At every
position past --skip, the next-token distribution is compared with the float32-KV run's: top-1
agreement, mean and max KL(float32 || dtype). Weights are the same in both (the model's own).

Models: the demo (SmolLM2-135M Q4_1 GGUF) by default; --model PATH for another (e.g. a 1.1B-shape
random-weight GGUF written by benchmarks/quantized_peers.py: its distributions are close to uniform,
so its KL says how far the attention output moves, not how a trained model's answers change).

    .venv/bin/python benchmarks/kv_accuracy.py [--tokens 2048] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from quant_accuracy import TEXTS  # noqa: E402

from brisk import kernels  # noqa: E402
from brisk.engine.attention import PagedKVCache, attention_backend  # noqa: E402
from brisk.engine.model_runner import SeqSlice, build_batch  # noqa: E402
from brisk.kv_dtype import DTYPES  # noqa: E402
from brisk.loading.loader import load  # noqa: E402


def long_prompt(tokenizer, tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < tokens:
        for text in TEXTS:
            ids += tokenizer.encode(text + "\n\n")
    return ids[:tokens]


@torch.inference_mode()
def prompt_logits(loaded, ids: list[int], kv, chunk: int, block_size: int = 8) -> torch.Tensor:
    """[len(ids), vocab] float32 logits, the prompt run chunk by chunk through a paged pool of `kv`."""
    cfg = loaded.config
    num_blocks = -(-len(ids) // block_size) + 1
    cache = PagedKVCache(cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim, kv,
                         loaded.device, huge_pages=False)
    backend = attention_backend(torch.device(loaded.device))
    table = list(range(1, num_blocks))
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        batch = build_batch([SeqSlice(piece, start, table, True)], block_size, loaded.device, cfg.layer_windows)
        attention = backend(cache, batch.meta, cfg.attn_scale, cfg.attn_softcap)
        hidden = loaded.model(batch.input_ids, batch.positions, attention)
        out.append(loaded.model.compute_logits(hidden).float())
    return torch.cat(out)


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    logp_ref, logp = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    return {"top1": (ref.argmax(-1) == got.argmax(-1)).double().mean().item(), "kl_mean": kl.mean().item(),
            "kl_max": kl.max().item(), "logit_diff_max": (ref - got).abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--skip", type=int, default=16, help="positions left out at the start (short contexts)")
    parser.add_argument("--quantization", default="auto",
                        help="weights as brisk loads them (auto: the GGUF's int4/int8, with int8 activation blocks, "
                             "whose rounding turns any small change into noise; none: float32 weights, the KV "
                             "dtype's own error)")
    parser.add_argument("--kv-dtype", nargs="+", choices=list(DTYPES), default=[d for d in DTYPES if d != "float32"])
    parser.add_argument("--kernel-isa", type=int, default=-1,
                        help="the attention kernel's path, at most: 4 avx512fp16 (fp8 multiplies in float16), "
                             "3 avx512, 2 avx2, 0 portable; -1 the best the CPU has (what serving runs)")
    args = parser.parse_args()
    lib = kernels.library()
    if lib is not None:
        lib.brisk_paged_attention_force_isa(args.kernel_isa)
    loaded = load(args.model, max_model_len=max(args.tokens, 2048), quantization=args.quantization)
    ids = long_prompt(loaded.tokenizer, args.tokens)
    torch.manual_seed(0)
    ref = prompt_logits(loaded, ids, DTYPES["float32"], args.chunk)[args.skip:]
    print(f"model {loaded.config.architecture} ({args.model or 'demo'}, --quantization {args.quantization}), "
          f"attention kernel {kernels.attention_isa()}, {len(ids)}-token prompt "
          f"(7 languages/codes, repeated), positions {args.skip}..{len(ids) - 1}, chunks of {args.chunk}")
    print("| KV dtype | bytes/element | top-1 agreement vs float32 KV | mean KL | max KL | max logit diff |")
    print("|---|---|---|---|---|---|")
    for name in args.kv_dtype:
        kv = DTYPES[name]
        r = compare(ref, prompt_logits(loaded, ids, kv, args.chunk)[args.skip:])
        print(f"| {name} | {kv.bytes_per_element(loaded.config.head_dim):g} | {r['top1']:.2%} | {r['kl_mean']:.2e} | "
              f"{r['kl_max']:.2e} | {r['logit_diff_max']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
