"""brisk vs llama.cpp's native `llama-server` on quantized GGUF models, same machine, same client.

Writes a TinyLlama-shaped (hidden 2048, 22 layers, FFN 5632, 32/4 heads; 1.1B parameters with
the demo tokenizer's 49k vocabulary; `--shape mistral7b`: hidden 4096, 32 layers, FFN 14336, 32/8
heads) random-weight GGUF in each requested type with the demo model's tokenizer
(`brisk.loading.gguf_random`; K-quant types such as Q4_K_M by llama.cpp's `llama-quantize` from
the shape's Q8_0 file), and also serves the demo model's own Q4_1 GGUF. For each model and server: process start -> ready (its own readiness endpoint answers 200:
brisk's /ready, llama-server's /health; brisk twice: the first start converts the GGUF into the
cache, the second is the warm-cache start users see) and -> the first answered 1-token chat
completion, resident memory (VmRSS after the runs and VmHWM, the peak), and the same `brisk bench`
streaming workload at 1/16/64 concurrent streams (short chat prompts, 64-token replies,
ignore_eos) as benchmarks/peers/run_peers.py. Prints the machine's read bandwidth beside it.

Type BF16: llama-server serves the BF16 GGUF; brisk serves the same weights as a Hugging Face
bfloat16 safetensors directory (`bf16_checkpoint`), the form most checkpoints come in: `brisk`
keeps them bfloat16 (`--quantization auto`), `brisk-f32` casts them to float32 (`--dtype float32`,
brisk's only CPU behaviour before), and `brisk-gguf` serves the BF16 GGUF itself (kept bfloat16 too).
`brisk-kv-D` is brisk with `--kv-cache-dtype D` (e.g. bfloat16: the bytes a token of llama-server's default
f16 KV cache takes; brisk's `auto` is float32 on a CPU without AVX-512 BF16).

llama-server is the native build with `--parallel` slots and continuous batching, from the
llama-cpp-python sdist's vendored tree (see benchmarks/peers/run_peers.py):
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
        -DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-server -j2

    .venv/bin/python benchmarks/quantized_peers.py --llama-server PATH/build/bin/llama-server \\
        [--work DIR] [--types Q4_0,Q8_0,BF16,Q4_K_M,demo]
        [--systems brisk,brisk-gguf,brisk-f32,brisk-kv-bfloat16,llama-server]
        [--concurrency 1,16,64] [--long-prompt 1000] [--shape tinyllama|mistral7b|qwen3-30b-a3b]
        [--llama-quantize PATH] [--brisk-kv-memory 1GiB]

`--shape qwen3-30b-a3b`: Qwen3-30B-A3B's layer (hidden 2048, 48 layers, 128 experts of FFN 768 with 8 used, 32/4
heads x 128, q/k norms); the script also prints the bytes of weights one decoded token reads (the experts used,
not all 128) and the decode speed the read bandwidth allows for them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

from decode_speed import read_bandwidth_gbs  # noqa: E402
from run_peers import bench, free_port, wait_ready  # noqa: E402

MODEL_ID = "bench-model"
SLOT_CONTEXT = 256  # tokens per llama-server slot: a 12-token prompt in the chat template + 64 replies


# types llama.cpp's own quantizer writes (the `gguf` package cannot): made from the shape's Q8_0 file
# with `llama-quantize --allow-requantize` (--llama-quantize PATH)
LLAMA_QUANTIZE_TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL")


def model_path(kind: str, work: Path, shape: str = "tinyllama", llama_quantize: str | None = None) -> Path:
    from brisk.loading.gguf_random import SHAPES, write_random_gguf
    from brisk.models.registry import resolve

    demo = resolve("smollm2-135m-instruct").path
    if kind == "demo":
        return demo
    path = work / f"{shape}-shape-{kind}.gguf"
    if path.exists():
        return path
    tmp = path.with_suffix(".tmp")
    if kind in LLAMA_QUANTIZE_TYPES:
        if not llama_quantize:
            raise SystemExit(f"{kind} is written by llama.cpp's quantizer: pass --llama-quantize PATH")
        source = model_path("Q8_0", work, shape, llama_quantize)
        subprocess.run([llama_quantize, "--allow-requantize", str(source), str(tmp), kind, str(os.cpu_count() or 2)],
                       check=True, capture_output=True)
    else:
        write_random_gguf(tmp, SHAPES[shape], kind, demo)
    tmp.rename(path)
    return path


def bf16_checkpoint(gguf: Path, work: Path) -> Path:
    """The BF16 GGUF's weights as a Hugging Face bfloat16 safetensors directory (what the Hub ships):
    brisk's own GGUF conversion (float32, Q/K un-permuted, config and tokenizer) cast back to
    bfloat16, which is exact: every value came from a bfloat16."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from brisk.loading import gguf_convert

    out = work / f"{gguf.stem}-hf"
    if (out / "config.json").exists():
        return out
    f32 = work / f"{gguf.stem}-hf-f32"
    if not (f32 / "config.json").exists():
        gguf_convert.convert(gguf, f32, "none")
    tmp = work / f"{gguf.stem}-hf.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for item in f32.iterdir():
        if item.suffix == ".safetensors":
            tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in load_file(item).items()}
            save_file(tensors, tmp / item.name)
        elif item.is_file():
            shutil.copy(item, tmp / item.name)
    config = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2))
    shutil.rmtree(f32)
    tmp.rename(out)
    return out


def command(system: str, gguf: Path, port: int, args) -> list[str]:
    levels = [int(c) for c in args.concurrency.split(",")]
    if system.startswith("brisk"):  # brisk, brisk-gguf, or brisk-f32 (--dtype float32: a float checkpoint cast)
        source = bf16_checkpoint(gguf, args.work) if gguf.stem.endswith("-BF16") and system != "brisk-gguf" else gguf
        kv = ["--kv-cache-dtype", system.removeprefix("brisk-kv-")] if system.startswith("brisk-kv-") else []
        return [sys.executable, "-m", "brisk", "serve", str(source), "--port", str(port), "--served-model-name",
                MODEL_ID, "--max-model-len", "2048", "--max-num-seqs", str(max(levels))] + \
            (["--dtype", "float32"] if system == "brisk-f32" else []) + kv + \
            (["--kv-cache-memory", args.brisk_kv_memory] if args.brisk_kv_memory else [])
    slots = max(levels)
    return [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", MODEL_ID,
            "--parallel", str(slots), "-c", str(slots * max(SLOT_CONTEXT, args.long_prompt + 64)),
            "-t", str(os.cpu_count() or 2)]


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def wait_health(url: str, proc: subprocess.Popen, path: str, timeout_s: float = 900) -> float:
    """Seconds until GET `path` answers 200: the server says it is ready (brisk /ready, llama-server /health)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("not ready in time")


def start(system: str, gguf: Path, args, log: Path) -> tuple[subprocess.Popen, str, tuple[float, float]]:
    """The server, its URL, and (seconds to its own readiness endpoint, seconds to the first answered
    1-token chat completion), both from process start."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(command(system, gguf, port, args), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    ready = wait_health(url, proc, "/ready" if system.startswith("brisk") else "/health")
    return proc, url, (ready, ready + wait_ready(url, proc, model=MODEL_ID))


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_one(system: str, kind: str, args) -> str:
    gguf = model_path(kind, args.work, args.shape, args.llama_quantize)
    levels = [int(c) for c in args.concurrency.split(",")]
    log = args.work / f"{system}-{kind}.log"
    first_start = ""
    try:
        if system.startswith("brisk"):  # the first start converts into the cache; time the warm one after it
            proc, _, (ready, _) = start(system, gguf, args, log)
            stop(proc)
            first_start = f"{ready:.1f} s / "
        proc, url, ready = start(system, gguf, args, log)
    except RuntimeError as e:
        return f"| {kind} | {system} | failed: {e} (see {log}) |"
    try:
        runs = {c: bench(url, c, args.work / f"{system}-{kind}-c{c}.json", model=MODEL_ID) for c in levels}
        long_ttft = long_prompt_ttft(url, args, args.work / f"{system}-{kind}-long.json") if args.long_prompt else None
        rss, hwm = memory_mb(proc.pid)
    except subprocess.CalledProcessError as e:
        return f"| {kind} | {system} | bench failed: {e.stderr[-300:]} |"
    finally:
        stop(proc)
    cells = " | ".join(f"{runs[c]['output_throughput']:.1f}" for c in levels)
    top = runs[levels[-1]]
    long_cell = "" if long_ttft is None else f" {long_ttft:.2f} s |"
    return (f"| {kind} | {system} | {first_start}{ready[0]:.1f} s, {ready[1]:.1f} s | {cells} | {top['median_ttft_ms'] / 1e3:.2f} s "
            f"|{long_cell} {rss:.0f} / {hwm:.0f} MB | {sum(r['failed'] for r in runs.values())} |")


def long_prompt_ttft(url: str, args, out: Path) -> float:
    """Median time to first token of 3 single requests with --long-prompt prompt tokens (prefill)."""
    import json

    cmd = [sys.executable, "-m", "brisk", "bench", url, "--model", MODEL_ID, "--endpoint", "completions",
           "--concurrency", "1", "--num-requests", "3", "--warmup", "1", "--input-len", str(args.long_prompt),
           "--output-len", "4", "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    return json.loads(out.read_text())["runs"][0]["median_ttft_ms"] / 1e3


def active_bytes_per_token(gguf: Path) -> int:
    """Weight bytes one decoded token reads: every tensor but the token embedding (one row), and of the stacked
    expert tensors only the experts used per token (expert_used_count of expert_count)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field(key: str) -> int | None:
        f = reader.fields.get(f"{arch}.{key}")
        return None if f is None else int(f.parts[-1][0])

    experts, used = field("expert_count"), field("expert_used_count")
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            total += t.n_bytes // int(t.shape[-1])  # one row
        elif "_exps." in t.name and experts:
            total += t.n_bytes * used // experts
        else:
            total += t.n_bytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-server", required=False, default=None, help="path of a native llama-server build")
    parser.add_argument("--work", type=Path, default=HERE / "peers" / ".work")
    parser.add_argument("--types", default="Q4_0,Q8_0,demo")
    parser.add_argument("--systems", default="brisk,llama-server")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--long-prompt", type=int, default=0,
                        help="also time the first token of a prompt of this many tokens, alone (prefill)")
    parser.add_argument("--shape", default="tinyllama", choices=["tinyllama", "mistral7b", "qwen3-30b-a3b", "gpt-oss-20b"],
                        help="random-weight model shape (brisk.loading.gguf_random.SHAPES)")
    parser.add_argument("--brisk-kv-memory", default=None,
                        help="brisk's --kv-cache-memory (e.g. 1GiB: a large model leaves its default no room)")
    parser.add_argument("--llama-quantize", default=None,
                        help="path of llama.cpp's llama-quantize, for the K-quant types (Q4_K_M, ...)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")
    if "llama-server" in systems and not args.llama_server:
        parser.error("--llama-server PATH is needed to run llama-server (see this script's docstring)")
    bandwidth, how = read_bandwidth_gbs()
    print(f"machine read bandwidth: {bandwidth:.1f} GB/s ({how})", flush=True)
    levels = args.concurrency.split(",")
    rows = []
    for kind in args.types.split(","):
        if kind != "demo":
            active = active_bytes_per_token(model_path(kind, args.work, args.shape, args.llama_quantize))
            print(f"{kind}: {active / 1e9:.2f} GB read per decoded token (active weights) -> at most "
                  f"{bandwidth * 1e9 / active:.1f} tok/s at {bandwidth:.1f} GB/s", flush=True)
        for system in systems:
            rows.append(run_one(system, kind, args))
            print(rows[-1], flush=True)
    print()
    print("| model | server | ready after start (brisk: cold cache / warm), first answer | "
          + " | ".join(f"tok/s @{c}" for c in levels) + f" | TTFT p50 @{levels[-1]} |"
          + (f" TTFT, {args.long_prompt}-token prompt alone |" if args.long_prompt else "") + " RSS / peak | failed |")
    print("|---|---|---|" + "---|" * len(levels) + "---|" + ("---|" if args.long_prompt else "") + "---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
