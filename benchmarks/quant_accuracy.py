"""Accuracy of brisk's quantized formats on the demo model, against the float32 reference.

The reference is brisk with `--quantization none`: every GGUF tensor dequantized to float32
(it matches HF transformers' own load of the GGUF within 1e-3 in the logits; see
tests/test_demo_reference.py). Each format runs the same texts (English, Chinese, Japanese,
German, French, Python, SQL; none of them tuned against) through the model in one forward
per text, and at every position compares the next-token distribution with the reference:
top-1 agreement, mean KL(reference || format), and the largest logit difference.

Formats: `auto` (the GGUF's own Q4_1 linears as int4 with offsets, its Q8_0 embedding/LM head
as int8: what brisk serves by default), `int8` and `int4` (every matrix requantized from the
dequantized values), and `auto` with float activations (the same int4/int8 weights through
the torch reference matmul without int8 activation blocks: it isolates the kernel's
activation quantization from the weights' own), and `bf16`/`f16` (the reference's float32 weights
rounded to 16 bits and run by half_matmul.cpp with float32 activations: what a bfloat16 or float16
checkpoint of the same model gives).

With `--llama-quantize PATH --gguf-types Q4_K_M,Q5_K_M,Q6_K,Q8_0`, also the GGUF files llama.cpp's
own quantizer writes from the demo GGUF (`--allow-requantize`: from the same dequantized weights the
reference runs), each served as brisk serves such a file (`auto`). The demo's hidden size (576) is
not a multiple of 256, so llama-quantize gives the K-types only to the matrices whose rows are
(ffn_down, 1536 wide) and its fallback types to the others; each row names the types in the file.
A second row per file runs the file's weights dequantized to float32 (`--quantization none`): the
difference between the two is what brisk's kernels add to the file's own quantization error.

    .venv/bin/python benchmarks/quant_accuracy.py [--min-positions 2000]
        [--llama-quantize PATH --gguf-types Q4_K_M,Q5_K_M,Q6_K,Q8_0 --work DIR]
"""

from __future__ import annotations

import argparse
import collections
import subprocess
from pathlib import Path
from unittest import mock

import torch

from brisk import kernels
from brisk.loading.gguf_header import read_gguf_header
from brisk.loading.loader import load
from brisk.models.registry import resolve
from brisk.models.simple_cache import SingleSequenceCache

TEXTS = [
    "The river had been rising for three days before anyone in the village thought to move the grain. "
    "By then the lower fields were a shallow lake, and the old bridge, which had survived two wars and a "
    "century of careless repairs, groaned every time a branch struck its pillars. Maria walked the bank "
    "each morning with a notebook, recording the height of the water against a painted post, because her "
    "father had done the same and because numbers, unlike rumours, did not grow in the telling. On the "
    "fourth day the rain stopped, the clouds broke into long grey ribbons, and the water began, very slowly, "
    "to fall. Nobody cheered; they simply started carrying sacks back down the hill.",
    "Cache invalidation is hard because a cache is a promise that two copies of the truth agree. Every "
    "write to the source breaks that promise until the copy is refreshed or discarded. Systems choose "
    "between expiring entries after a fixed time, which bounds staleness but wastes work, and notifying "
    "caches on every write, which is precise but couples the writer to every reader. Most real systems "
    "mix both and accept that, for a short window, a reader may see an old value.",
    "长城是中国古代的军事防御工程，绵延数千公里，跨越山脉、沙漠和草原。它并不是一道连续的城墙，而是由许多段城墙、"
    "关隘、烽火台和城堡组成的体系。历代王朝都曾修筑或加固长城，其中明朝修建的部分保存最为完整。今天，长城已经成为"
    "世界文化遗产，每年吸引大量游客前来参观。人们登上城墙，远眺群山，感受历史的厚重与壮阔。",
    "東京は日本の首都であり、世界でも有数の大都市です。高層ビルが立ち並ぶ新宿や渋谷のような繁華街がある一方で、"
    "浅草や谷中のように昔ながらの町並みが残る地域もあります。電車のネットワークは非常に発達しており、通勤時間帯には"
    "多くの人が駅を行き交います。季節ごとに桜や紅葉を楽しめる公園も多く、住む人にも旅行者にも魅力的な街です。",
    "Die Bibliothek war im Winter der wärmste Ort der Stadt, und deshalb kamen nicht nur Leser. Studenten "
    "schrieben ihre Arbeiten an den langen Tischen, Rentner lasen Zeitungen aus drei Ländern, und ein alter "
    "Mann spielte jeden Nachmittag Schach gegen sich selbst. Die Bibliothekarin kannte alle beim Namen.",
    "Le marché ouvrait à six heures, mais les premiers camions arrivaient bien avant l'aube. Les maraîchers "
    "déchargeaient des cagettes de tomates, de courgettes et de pêches, pendant que le boulanger installait "
    "ses pains encore tièdes. Vers huit heures, la place était pleine de voix, d'odeurs et de couleurs.",
    "import heapq\n\n\ndef dijkstra(graph, source):\n    \"\"\"Shortest distances from source in a graph "
    "with non-negative edge weights.\"\"\"\n    dist = {source: 0}\n    queue = [(0, source)]\n    while queue:\n"
    "        d, node = heapq.heappop(queue)\n        if d > dist.get(node, float('inf')):\n            continue\n"
    "        for neighbour, weight in graph[node].items():\n            nd = d + weight\n"
    "            if nd < dist.get(neighbour, float('inf')):\n                dist[neighbour] = nd\n"
    "                heapq.heappush(queue, (nd, neighbour))\n    return dist\n",
    "SELECT c.name, COUNT(o.id) AS orders, SUM(o.total) AS revenue\nFROM customers AS c\n"
    "LEFT JOIN orders AS o ON o.customer_id = c.id AND o.created_at >= DATE '2024-01-01'\n"
    "GROUP BY c.name\nHAVING COUNT(o.id) > 3\nORDER BY revenue DESC\nLIMIT 20;",
]


def logits_per_position(loaded, ids: list[int]) -> torch.Tensor:
    cache = SingleSequenceCache(loaded.config, len(ids), torch.float32, "cpu")
    cache.begin(len(ids))
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache)
        return loaded.model.compute_logits(hidden)


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    r, g = torch.cat(ref), torch.cat(got)
    ref_logp, got_logp = r.log_softmax(-1), g.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - got_logp)).sum(-1)
    return {"positions": r.shape[0], "top1": float((r.argmax(-1) == g.argmax(-1)).float().mean()),
            "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
            "max_logit_diff": float((r - g).abs().max())}


def llama_quantized(source: Path, qtype: str, work: Path, llama_quantize: str) -> Path:
    """`source` requantized by llama.cpp's quantizer to `qtype` (made once, kept in `work`)."""
    out = work / f"{source.stem}-{qtype}.gguf"
    if not out.exists():
        work.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run([llama_quantize, "--allow-requantize", str(source), str(tmp), qtype], check=True,
                       capture_output=True, text=True)
        tmp.rename(out)
    return out


def file_types(path: Path) -> str:
    """The quantized types of a GGUF's matrices, with counts."""
    counts = collections.Counter(t.type_name for t in read_gguf_header(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{n} {t}" for t, n in counts.most_common())


def float_activation_matmul(x, qweight, scales, mins, bits, subscales=None):
    return kernels.reference_matmul(x, qweight, scales, mins, bits, subscales, quantized_activations=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--min-positions", type=int, default=2000)
    parser.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize, for --gguf-types")
    parser.add_argument("--gguf-types", default="Q4_K_M,Q5_K_M,Q6_K,Q8_0")
    parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parent / "peers" / ".work")
    args = parser.parse_args()
    reference = load(args.model, quantization="none")
    tokenizer = reference.tokenizer
    texts = [tokenizer.encode(t) for t in TEXTS]
    positions = sum(len(t) for t in texts)
    if positions < args.min_positions:  # each text again after the others: longer contexts, new positions
        texts += [sum(texts, [])[: args.min_positions - positions + 1]]
    ref = [logits_per_position(reference, ids) for ids in texts]
    float_dir = str(reference.model_dir)  # the float32 safetensors directory the reference ran from
    del reference
    print("| format | weights MB | positions | top-1 agreement | mean KL | KL p99 | max logit diff |")
    print("|---|---|---|---|---|---|---|")
    runs = [("auto", "auto", False, args.model), ("auto, float activations", "auto", True, args.model),
            ("int8", "int8", False, args.model), ("int4", "int4", False, args.model),
            ("bf16", "bf16", False, float_dir), ("f16", "f16", False, float_dir)]
    if args.llama_quantize:
        demo = Path(args.model) if args.model else resolve("smollm2-135m-instruct").path
        for qtype in args.gguf_types.split(","):
            path = llama_quantized(demo, qtype, args.work, args.llama_quantize)
            runs.append((f"GGUF {qtype} by llama-quantize [{file_types(path)}]", "auto", False, str(path)))
            # the same file dequantized to float32: the file's own error, apart from brisk's kernels
            runs.append((f"GGUF {qtype}, its weights in float32", "none", False, str(path)))
    for label, mode, float_acts, source in runs:
        loaded = load(source, quantization=mode)
        if float_acts:
            with mock.patch.object(kernels, "quant_matmul", float_activation_matmul):
                got = [logits_per_position(loaded, ids) for ids in texts]
        else:
            got = [logits_per_position(loaded, ids) for ids in texts]
        s = compare(ref, got)
        print(f"| {label} ({', '.join(sorted(set(loaded.report.weight_formats.values()))) or 'float32'}) "
              f"| {loaded.report.weight_bytes / 1e6:.0f} | {s['positions']} | {s['top1'] * 100:.1f}% "
              f"| {s['kl_mean']:.4f} | {s['kl_p99']:.4f} | {s['max_logit_diff']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
