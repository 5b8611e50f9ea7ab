"""Cached prompts across a restart: time to first token of a request with a long shared prefix, right after
`brisk serve` was stopped (SIGTERM) and started again, with and without the KV disk tier (--kv-cache-dir).

For each mode: start the server, send a chat whose system prompt is ~--prefix-tokens tokens (question A),
SIGTERM it, start it again on the same model (and, with the tier, the same folder), send the same system prompt
with question B. Reported: TTFT of A (cold: nothing cached), TTFT of B after the restart, and B's cached prompt
tokens. Without the tier the restart forgets the prefix (B is cold again); with it, B reads the prefix back.

    .venv/bin/python benchmarks/kv_restart.py [--model smollm2-135m-instruct | --shape tinyllama|llama3.2-1b] \\
        [--prefix-tokens 8000] [--work DIR]

`--shape tinyllama`: a TinyLlama-shaped (1.1B, a 2,048-token context) random-weight Q4_0 GGUF with the demo
tokenizer (as quantized_peers.py writes it), instead of the demo model; `--shape llama3.2-1b`: Llama-3.2-1B's
blocks (1.07B with that vocabulary, a 16k context), for an 8,000-token prefix on a model of that size.

`--replay N`: a multi-turn chat service across a deploy instead. N users each hold a chat (a shared system
prompt, then the user's own ~--document-tokens document and three turns, the model's replies kept in the
history); the server is SIGTERMed and started again, and every user sends a fourth turn. Reported: the fourth
turns' TTFT p50/p90 and cached prompt tokens after the restart, with and without the tier.

`--bench-replay N`: the same service driven by `brisk bench --workload replay` instead. N users' chats are
written as two traces, each user a prefix group whose prefix grows by a turn (question and reply) from
--prefix-tokens + --document-tokens: turns 1-3 replayed, SIGTERM, a new start, turn 4 replayed. Reported from
bench's JSON: the fourth turns' TTFT p50/p90, cached and disk-read prompt tokens. bench makes each group's text
from the group's name, so the replay after the restart sends the prefixes the one before it cached (the text
is word soup, not the model's replies: a turn's cached prefix is the previous turns' prompts, not their
replies).

`--bench-replay N --pressure`: no restart; a KV pool too small for the users' chats (--kv-cache-memory 128MiB
unless given: about one and a half chats), so every user's history is evicted before the user's next turn. The
first turns are replayed, then turns 2-4 are measured, with the pool alone, with --kv-cache-host-bytes 2GiB, with
--kv-cache-dir, and with --kv-cache-dir on a 256 MiB budget (its folder's size sampled every 50 ms): what a
returning chat costs when the pool evicted it, where it comes back from, and whether the folder keeps its budget.
With `--llama-server PATH`, two more rows: llama-server on the same GGUF, its context the tokens brisk's pool holds,
with `--cache-ram 0` and with `--cache-ram 2048` (its host-memory prompt cache, the nearest peer of the host tier).

`--stall TREE[,TREE...]`: what a prefix read from disk costs the other streams. For each source tree (a checkout
with its kernels built; `python -m brisk` runs from it): start with the tier, cache the long system prompt, restart,
start --streams greedy streams of short prompts (256-token replies), and once they decode send the long prompt,
whose prefix now comes from disk. Reported: the streams' largest gap between two tokens from that request's arrival
to its first token, against their median gap before it, and the request's TTFT. Compare a tree whose disk reads
block the engine's step with one that reads them on a thread.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]

from decode_speed import read_bandwidth_gbs  # noqa: E402
from quantized_peers import model_path, wait_health  # noqa: E402
from run_peers import demo_gguf, free_port  # noqa: E402

WORDS = ("the service manual describes how each part of the bicycle is inspected adjusted and replaced "
         "including brakes gears wheels tyres chains bearings cables and the frame itself").split()


def system_prompt(words: int) -> str:
    rng = np.random.default_rng(0)
    return "You answer from this manual.\n" + " ".join(rng.choice(WORDS, words))


def start(model: str, args, disk: Path | None, tree: Path | None = None, extra: tuple[str, ...] = ()
          ) -> tuple[subprocess.Popen, str]:
    port = free_port()
    chats = args.replay or args.bench_replay
    cmd = [sys.executable, "-m", "brisk", "serve", model, "--port", str(port), "--max-model-len",
           str(min(args.prefix_tokens + (args.document_tokens + 1024 if chats else 512), 8192)),
           "--kv-cache-memory", args.kv_cache_memory or ("128MiB" if args.pressure else "1GiB"), *extra]
    if disk is not None:
        cmd += ["--kv-cache-dir", str(disk)]
    proc = subprocess.Popen(cmd, stdout=open(args.work / "kv_restart.log", "a"), stderr=subprocess.STDOUT, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc, "/ready")
    return proc, url


def ask(url: str, system: str, question: str) -> tuple[float, int, int]:
    """(TTFT in s, prompt tokens, cached prompt tokens) of one streamed greedy chat."""
    ttft, tokens, cached, _ = chat(url, [{"role": "system", "content": system}, {"role": "user", "content": question}], 8)
    return ttft, tokens, cached


def chat(url: str, messages: list[dict], max_tokens: int) -> tuple[float, int, int, str]:
    """(TTFT in s, prompt tokens, cached prompt tokens, the reply) of one streamed greedy chat."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start_s, ttft, usage, text = time.perf_counter(), None, None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - start_s
                text.append(event["choices"][0]["delta"]["content"])
            if event.get("usage"):
                usage = event["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft, usage["prompt_tokens"], cached, "".join(text)


def replay(model: str, args) -> None:
    """--replay: users' chats before a restart, their next turns after it, with and without the tier."""
    rng = np.random.default_rng(1)
    system = system_prompt(int(args.prefix_tokens / 1.04))
    documents = [" ".join(rng.choice(WORDS, int(args.document_tokens / 1.04))) for _ in range(args.replay)]
    questions = ["What does it say about brakes?", "And the chain?", "Summarise the tyres part.",
                 "Which part should I check first?"]
    print(f"{args.replay} chats: a {args.prefix_tokens}-token system prompt shared, a {args.document_tokens}-token "
          "document each, 3 turns before the restart, the 4th after it (64-token replies)")
    print("| mode | 4th-turn prompt tokens (mean) | TTFT p50 after restart | TTFT p90 | cached (mean) |")
    print("|---|---|---|---|---|")
    p50s = {}
    for mode in ("no tier", "--kv-cache-dir"):
        folder = Path(tempfile.mkdtemp(prefix="kv-replay-", dir=args.work)) if mode != "no tier" else None
        try:
            histories = [[{"role": "system", "content": system}, {"role": "user", "content": f"My document: {d}"},
                          {"role": "assistant", "content": "Thank you, I have read it."}] for d in documents]
            proc, url = start(model, args, folder)
            try:
                for turn in questions[:3]:
                    for h in histories:
                        h.append({"role": "user", "content": turn})
                        h.append({"role": "assistant", "content": chat(url, h, 64)[3]})
            finally:
                stop(proc)
            proc, url = start(model, args, folder)
            rows = []
            try:
                for h in histories:
                    ttft, tokens, cached, _ = chat(url, h + [{"role": "user", "content": questions[3]}], 8)
                    rows.append((ttft, tokens, cached))
            finally:
                stop(proc)
            ttfts = [r[0] for r in rows]
            p50s[mode] = float(np.percentile(ttfts, 50))
            print(f"| {mode} | {np.mean([r[1] for r in rows]):.0f} | {p50s[mode]:.2f} s | "
                  f"{np.percentile(ttfts, 90):.2f} s | {np.mean([r[2] for r in rows]):.0f} |", flush=True)
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
    print(f"TTFT p50 after a restart, without the tier / with it: {p50s['no tier'] / p50s['--kv-cache-dir']:.1f}x")


QUESTION_TOKENS, REPLY_TOKENS = 24, 64


def chat_traces(users: int, first_prefix: int, folder: Path, split: int = 3) -> tuple[Path, Path]:
    """Two replay traces of `users` chats (brisk/trace.py): turns 1 to `split`, one turn of every user after
    another, 5 s apart, and the turns after it up to the 4th, 8 s apart (more than a turn's whole prefill on the
    demo here, so that TTFT is not queueing behind the one before). User u is prefix group "user-u"; turn t's
    prefix is its history (the first prefix, then each earlier turn's question and reply), its prompt that plus a
    question."""
    before, after = [], []
    for turn in range(4):
        for u in range(users):
            prefix = first_prefix + turn * (QUESTION_TOKENS + REPLY_TOKENS)
            row = {"prompt_tokens": prefix + QUESTION_TOKENS, "output_tokens": REPLY_TOKENS,
                   "prefix_group": f"user-{u}", "prefix_tokens": prefix}
            rows = before if turn < split else after
            rows.append({"arrival_s": len(rows) * (5.0 if turn < split else 8.0), **row})
    paths = folder / f"turns-1-{split}.jsonl", folder / f"turns-{split + 1}-4.jsonl"
    for path, rows in zip(paths, (before, after)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def bench(url: str, trace: Path, out: Path, tree: Path | None = None) -> dict:
    """`brisk bench --workload replay` of `trace` (chats): its one run's results."""
    subprocess.run([sys.executable, "-m", "brisk", "bench", url, "--workload", "replay", "--trace", str(trace),
                    "--endpoint", "chat", "--json", str(out)], check=True, cwd=tree, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]


def watch_folder(folder: Path | None, done: threading.Event, sizes: list[int]) -> None:
    """Every 50 ms until `done`: the bytes of every file under `folder` (blocks and temporary files)."""
    while folder is not None and not done.wait(0.05):
        total = 0
        for path in folder.rglob("*"):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except OSError:
                pass  # removed meanwhile
        sizes.append(total)


def pool_tokens(url: str) -> int:
    """Tokens a brisk server's KV pool holds (`brisk:kv_num_blocks` of the default block size)."""
    from brisk.config import DEFAULT_BLOCK_SIZE

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("brisk:kv_num_blocks "):
            return int(float(line.split()[1])) * DEFAULT_BLOCK_SIZE
    raise RuntimeError("no brisk:kv_num_blocks in /metrics")


def start_llama_server(gguf: Path, args, ctx_tokens: int, extra: tuple[str, ...]) -> tuple[subprocess.Popen, str]:
    """llama-server on the same GGUF with one slot whose context is the tokens brisk's pool holds (its default
    slots split the context: a chat of 1,900 tokens did not fit one), and `extra` (`--cache-ram` MiB of host-memory
    prompt cache, 0: none). The replay sends one request at a time, so one slot serves it as brisk's pool does."""
    port = free_port()
    cmd = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx_tokens),
           "-np", "1", "-t", "2", *extra]
    proc = subprocess.Popen(cmd, stdout=open(args.work / "kv_restart.log", "a"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc, "/health")
    return proc, url


def bench_pressure(model: str, args) -> None:
    """--bench-replay N --pressure: turns 2-4 of the chats on a pool that cannot keep them, per tier; with
    --llama-server, llama-server on the same GGUF, its context the tokens brisk's pool holds, without and with
    its host-memory prompt cache (--cache-ram 2048: the host tier's 2 GiB)."""
    first = args.prefix_tokens + args.document_tokens
    print(f"{args.bench_replay} chats through `brisk bench --workload replay --endpoint chat`: a {first}-token "
          f"prefix each, growing {QUESTION_TOKENS + REPLY_TOKENS} tokens a turn; turn 1 replayed, then turns 2-4 "
          f"measured, on a {args.kv_cache_memory or '128MiB'} pool")
    print("| tiers | prompt tokens (mean) | TTFT p50 | TTFT p90 | cached (host, disk) "
          "| disk folder: largest seen / budget |")
    print("|---|---|---|---|---|---|")
    p50s = {}
    modes = {"pool only": (), "--kv-cache-host-bytes 2GiB": ("--kv-cache-host-bytes", "2GiB"), "--kv-cache-dir": (),
             "--kv-cache-dir --kv-cache-disk-bytes 256MiB": ("--kv-cache-disk-bytes", "256MiB")}
    if args.llama_server:
        modes.update({"llama-server --cache-ram 0": ("--cache-ram", "0"),
                      "llama-server --cache-ram 2048": ("--cache-ram", "2048")})
    ctx_tokens = 0
    for mode, extra in modes.items():
        if args.tiers and mode not in args.tiers and not mode.startswith("llama-server"):
            continue
        work = Path(tempfile.mkdtemp(prefix="kv-pressure-", dir=args.work))
        folder = work / "kv" if "--kv-cache-dir" in mode else None
        sizes: list[int] = []
        done = threading.Event()
        try:
            warm, measured = chat_traces(args.bench_replay, first, work, split=1)
            if mode.startswith("llama-server"):
                if not ctx_tokens:  # the pool's tokens of a brisk server started as the rows above
                    proc, url = start(model, args, None)
                    ctx_tokens = pool_tokens(url)
                    stop(proc)
                gguf = Path(model) if model.endswith(".gguf") else demo_gguf()
                print(f"(llama-server: -c {ctx_tokens}, brisk's pool in tokens, -np 1)", flush=True)
                proc, url = start_llama_server(gguf, args, ctx_tokens, extra)
            else:
                proc, url = start(model, args, folder, extra=extra)
            watcher = threading.Thread(target=watch_folder, args=(folder, done, sizes), daemon=True)
            watcher.start()
            try:
                bench(url, warm, work / "warm.json")
                run = bench(url, measured, work / "measured.json")
            finally:
                stop(proc)
                done.set()
                watcher.join()
            p50s[mode] = run["median_ttft_ms"] / 1e3
            n = run["completed"]
            host, disk = ((run[f"{tier}_cached_input_tokens"] or 0) / n for tier in ("host", "disk"))
            budget = 256 * 2**20 if "256MiB" in mode else 16 * 2**30
            seen = f"{max(sizes):,} / {budget:,} bytes" if folder is not None and sizes else "–"
            cached = ("not reported" if run["cached_input_tokens"] is None else
                      f"{run['cached_input_tokens'] / n:.0f}" + ("" if mode.startswith("llama") else
                                                                 f" ({host:.0f}, {disk:.0f})"))
            print(f"| {mode} | {run['total_input_tokens'] / n:.0f} | {p50s[mode]:.2f} s | "
                  f"{run['p90_ttft_ms'] / 1e3:.2f} s | {cached} | {seen} |", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for mode in list(p50s):
        if mode != "pool only" and "pool only" in p50s:
            print(f"TTFT p50, pool only / {mode}: {p50s['pool only'] / p50s[mode]:.1f}x")
    for mode in [m for m in p50s if m.startswith("llama-server")]:
        for ours in [m for m in p50s if not m.startswith("llama-server")]:
            print(f"TTFT p50, {mode} / brisk {ours}: {p50s[mode] / p50s[ours]:.1f}x")


def bench_replay(model: str, args) -> None:
    """--bench-replay: the chats replayed by brisk bench before and after a restart, with and without the tier."""
    if args.pressure:
        return bench_pressure(model, args)
    first = args.prefix_tokens + args.document_tokens
    print(f"{args.bench_replay} chats through `brisk bench --workload replay --endpoint chat`: a {first}-token "
          f"prefix each, growing {QUESTION_TOKENS + REPLY_TOKENS} tokens a turn; turns 1-3 before the restart, the "
          "4th after it")
    print("| mode | 4th-turn prompt tokens (mean) | TTFT p50 after restart | TTFT p90 | cached (of them from disk) |")
    print("|---|---|---|---|---|")
    p50s = {}
    for mode in ("no tier", "--kv-cache-dir"):
        work = Path(tempfile.mkdtemp(prefix="kv-bench-replay-", dir=args.work))
        folder = work / "kv" if mode != "no tier" else None
        try:
            before, after = chat_traces(args.bench_replay, first, work)
            proc, url = start(model, args, folder)
            try:
                bench(url, before, work / "before.json")
            finally:
                stop(proc)
            proc, url = start(model, args, folder)
            try:
                run = bench(url, after, work / "after.json")
            finally:
                stop(proc)
            p50s[mode] = run["median_ttft_ms"] / 1e3
            n = run["completed"]
            print(f"| {mode} | {run['total_input_tokens'] / n:.0f} | {p50s[mode]:.2f} s | "
                  f"{run['p90_ttft_ms'] / 1e3:.2f} s | {run['cached_input_tokens'] / n:.0f} "
                  f"({(run['disk_cached_input_tokens'] or 0) / n:.0f}) |",
                  flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"TTFT p50 after a restart, without the tier / with it: {p50s['no tier'] / p50s['--kv-cache-dir']:.1f}x")


def token_times(url: str, prompt: str, max_tokens: int, times: list[float]) -> None:
    """Stream one greedy completion, appending each content delta's arrival time to `times`."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                times.append(time.perf_counter())


def stall(model: str, args) -> None:
    """--stall: the other streams' largest gap while a long prefix is read back from disk, per source tree."""
    import threading

    system = system_prompt(int(args.prefix_tokens / 1.04))
    print(f"{args.streams} streams decoding; then a {args.prefix_tokens}-token prompt whose prefix is on disk")
    print("| tree | streams' median gap before | largest gap after the long prompt arrives | its TTFT | cached |")
    print("|---|---|---|---|---|")
    for tree in [Path(t).resolve() for t in args.stall.split(",")]:
        folder = Path(tempfile.mkdtemp(prefix="kv-stall-", dir=args.work))
        try:
            proc, url = start(model, args, folder, tree)
            try:
                ask(url, system, "Question A: how are brakes adjusted?")
            finally:
                stop(proc)
            proc, url = start(model, args, folder, tree)
            try:
                times: list[list[float]] = [[] for _ in range(args.streams)]
                threads = [threading.Thread(target=token_times, args=(url, f"Tell me a story number {i}.", 256, t))
                           for i, t in enumerate(times)]
                for t in threads:
                    t.start()
                deadline = time.perf_counter() + 120
                while min(len(t) for t in times) < 32 and time.perf_counter() < deadline:
                    time.sleep(0.05)
                sent = time.perf_counter()
                ttft, _, cached = ask(url, system, "Question B: how is a chain replaced?")
                first = sent + ttft
                for t in threads:
                    t.join()
            finally:
                stop(proc)
            before = [b - a for t in times for a, b in zip(t, t[1:]) if b < sent]
            during = [b - a for t in times for a, b in zip(t, t[1:]) if b > sent and a < first]
            print(f"| {tree.name} | {np.median(before) * 1e3:.0f} ms | {max(during, default=0) * 1e3:.0f} ms | "
                  f"{ttft:.2f} s | {cached} |", flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--shape", default=None, choices=["tinyllama", "llama3.2-1b"])
    parser.add_argument("--prefix-tokens", type=int, default=8000)
    parser.add_argument("--work", type=Path, default=HERE / "peers" / ".work")
    parser.add_argument("--replay", type=int, default=0, metavar="N",
                        help="N users' multi-turn chats across the restart instead (see the docstring)")
    parser.add_argument("--document-tokens", type=int, default=600, help="--replay: each user's document")
    parser.add_argument("--bench-replay", type=int, default=0, metavar="N",
                        help="N users' chats replayed by `brisk bench --workload replay` across the restart")
    parser.add_argument("--pressure", action="store_true",
                        help="--bench-replay: no restart; a pool too small for the chats, per tier (docstring)")
    parser.add_argument("--tiers", nargs="*", default=None, metavar="MODE",
                        help="--pressure: only these of brisk's rows (as the table names them), e.g. "
                             "'--kv-cache-dir' (--llama-server's rows run whenever it is given)")
    parser.add_argument("--kv-cache-memory", default=None, help="the servers' pool (default 1GiB; --pressure 128MiB)")
    parser.add_argument("--llama-server", default=None, metavar="PATH",
                        help="--pressure: llama-server rows too (a native build, as quantized_peers.py's docstring)")
    parser.add_argument("--stall", default=None, metavar="TREE[,TREE]",
                        help="the other streams' gap while a prefix is read from disk, per source tree (docstring)")
    parser.add_argument("--streams", type=int, default=4, help="--stall: streams decoding meanwhile")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = str(model_path("Q4_0", args.work, args.shape, None)) if args.shape else args.model
    bandwidth, how = read_bandwidth_gbs()
    print(f"machine read bandwidth: {bandwidth:.1f} GB/s ({how}); model {Path(model).name}", flush=True)
    if args.replay:
        return replay(model, args)
    if args.bench_replay:
        return bench_replay(model, args)
    if args.stall:
        return stall(model, args)
    words = int(args.prefix_tokens / 1.04)  # ~1.04 tokens a word of WORDS in the demo vocabulary (measured)
    print("| mode | prompt tokens | TTFT, cold | TTFT after SIGTERM + restart | cached after restart | cold / restart |")
    print("|---|---|---|---|---|---|")
    for mode in ("no tier", "--kv-cache-dir"):
        folder = Path(tempfile.mkdtemp(prefix="kv-restart-", dir=args.work)) if mode != "no tier" else None
        try:
            proc, url = start(model, args, folder)
            try:
                system = system_prompt(words)
                cold, tokens, _ = ask(url, system, "Question A: how are brakes adjusted?")
            finally:
                stop(proc)
            proc, url = start(model, args, folder)
            try:
                warm, _, cached = ask(url, system, "Question B: how is a chain replaced?")
            finally:
                stop(proc)
            print(f"| {mode} | {tokens} | {cold:.2f} s | {warm:.2f} s | {cached} | {cold / warm:.1f}x |", flush=True)
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
