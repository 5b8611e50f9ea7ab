"""N-gram speculative decoding on the demo model: tok/s with and without it, same process, same
prompts, greedy (so both runs emit the same tokens; the script checks), runs interleaved
off/on/off/on so the machine's drift hits both alike.

tok/s counts decode steps only (after every prompt of the wave has its first token): prefill is the
same with and without speculation.

Workloads:
  grounded-1   1 stream, "rewrite this document with one change" (the reply repeats the prompt)
  code-1       1 stream, "rename this variable in the code" (code editing)
  chat-1       1 stream, ordinary chat questions (little to look up)
  mixed-16     16 streams at once, half grounded, half chat
  mixed-64     64 streams at once, the same mix

    .venv/bin/python benchmarks/speculative.py [--workloads grounded-1,chat-1,...] [--runs 2]
        [--config '{"method": "ngram", "num_speculative_tokens": 4}'] [--max-tokens 160]
        [--truncated-draft N]   (draft model: the demo model cut to its first N layers)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decode_speed import read_bandwidth_gbs  # noqa: E402

from brisk.config import CacheConfig  # noqa: E402
from brisk.engine.engine import LLMEngine  # noqa: E402
from brisk.engine.sampling_params import SamplingParams  # noqa: E402
from brisk.engine.scheduler import SchedulerConfig  # noqa: E402
from brisk.engine.spec_decode.config import SpeculativeConfig  # noqa: E402
from brisk.loading.loader import load  # noqa: E402

DOCUMENTS = [
    "Our team meeting is moved from Tuesday to Thursday at 10 am. Please bring the quarterly report, the "
    "updated budget spreadsheet and your notes from the customer visits. The meeting will take place in "
    "room 4B on the second floor. Lunch will be served after the meeting. If you cannot attend, send your "
    "updates to Maria before Wednesday evening so that she can present them.",
    "The city library opens at nine in the morning and closes at six in the evening from Monday to Friday. "
    "On Saturdays it is open from ten to two. Children's story time is every Wednesday at four. Books can be "
    "borrowed for three weeks and renewed twice online. Late returns cost ten cents per day per book.",
    "Le marché du village a lieu chaque samedi matin sur la place de l'église. On y trouve des fruits, des "
    "légumes, du fromage et du pain frais. Les producteurs viennent des fermes voisines. Le marché ouvre à "
    "huit heures et ferme à midi. En hiver, il est déplacé dans la salle des fêtes.",
    "To install the package, first create a virtual environment with python -m venv .venv, then activate it "
    "and run pip install -r requirements.txt. Copy the file config.example.toml to config.toml and set the "
    "database URL. Finally run python manage.py migrate and start the server with python manage.py runserver.",
]
CHANGES = ["Thursday", "nine", "samedi", "pip"]
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
CHAT = ["What are three good habits for staying healthy?", "Explain what a rainbow is to a child.",
        "Give me ideas for a birthday party.", "Why do cats purr?", "How do I make a cup of tea?",
        "What is the difference between weather and climate?", "Suggest a name for a bakery.",
        "What should I pack for a weekend trip?"]


def prompts(tok, workload: str) -> list[list[int]]:
    def chat(text):
        return tok.encode_chat([{"role": "user", "content": text}])

    grounded = [chat(f"Rewrite the following text exactly as it is, except replace the word '{w}' with "
                     f"'[{w.upper()}]':\n\n{d}") for d, w in zip(DOCUMENTS, CHANGES)]
    code = [chat(f"Rename the variable `{v}` to `{n}` in this code and output the whole code:\n\n{CODE}")
            for v, n in (("subtotal", "net"), ("best", "winner"), ("items", "products"), ("tax", "vat"))]
    chats = [chat(q) for q in CHAT]
    if workload == "grounded-1":
        return grounded
    if workload == "code-1":
        return code
    if workload == "chat-1":
        return chats[:4]
    if workload.startswith("mixed-"):
        n = int(workload.split("-")[1])
        pool = grounded + code + chats + chats
        return [pool[i % len(pool)] for i in range(n)]
    raise SystemExit(f"unknown workload {workload}")


def run_once(loaded, batch: list[list[int]], streams: int, spec, max_tokens: int, draft=None):
    engine = LLMEngine(loaded, CacheConfig(block_size=16, num_gpu_blocks_override=4096),
                       SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048),
                       speculative=spec, draft=draft if spec is not None else None)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outputs, decode_s, decode_tokens = [], 0.0, 0
    for start in range(0, len(batch), streams):
        ids = [engine.add_request(p, params) for p in batch[start:start + streams]]
        finals, started = {}, set()
        while engine.has_unfinished_requests():
            decoding = len(started) == len(ids)  # every prompt done: a pure decode step
            t = time.perf_counter()
            steps = engine.step()
            dt = time.perf_counter() - t
            for o in steps:
                started.add(o.request_id)
                if decoding:
                    decode_tokens += len(o.delta_token_ids)
                if o.finished:
                    finals[o.request_id] = o
            if decoding:
                decode_s += dt
        outputs += [finals[i].token_ids for i in ids]
    return outputs, decode_tokens / decode_s, engine.stats()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="grounded-1,code-1,chat-1,mixed-16,mixed-64")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--truncated-draft", type=int, default=None, metavar="N",
                    help="speculate with a draft model: the demo model's first N layers (written to /tmp)")
    args = ap.parse_args()
    loaded = load("smollm2-135m-instruct", quantization=args.quantization)
    draft = None
    if args.truncated_draft:
        from brisk.loading.gguf_random import write_truncated_gguf
        from brisk.models.registry import resolve

        path = Path(f"/tmp/brisk-draft-{args.truncated_draft}.gguf")
        if not path.exists():
            write_truncated_gguf(resolve("smollm2-135m-instruct").path, path, args.truncated_draft)
        args.config = json.dumps({"model": str(path), "num_speculative_tokens": 4})
        draft = load(str(path), quantization=args.quantization, max_model_len=loaded.max_model_len)
    spec = SpeculativeConfig.parse(args.config)
    bandwidth, how = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s ({how}); demo model, quantization {args.quantization}; {args.config}")
    print(f"{'workload':<12} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'accept':>7} {'tok/verify':>10} "
          f"{'tokens':>7} {'differ':>9}")
    for workload in args.workloads.split(","):
        batch = prompts(loaded.tokenizer, workload)
        streams = int(workload.rsplit("-", 1)[1])
        rates = {"off": [], "on": []}
        ref, differ = None, 0
        for _ in range(args.runs):
            for name, config in (("off", None), ("on", spec)):
                out, rate, st = run_once(loaded, batch, streams, config, args.max_tokens, draft)
                if ref is None:
                    ref = out
                differ = max(differ, sum(a != b for a, b in zip(out, ref)))
                tokens = sum(len(o) for o in out)
                rates[name].append(rate)
                if config is not None:
                    accept = st.spec_accepted_tokens / max(st.spec_draft_tokens, 1)
                    verifications = sum(st.spec_acceptance_lengths)
                    per_verify = (st.spec_accepted_tokens + verifications) / max(verifications, 1)
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        # greedy: the same tokens with and without speculation, except where the quantized model's
        # prompt chunks fall differently (drafts take token budget; see RESULTS.md)
        print(f"{workload:<12} {off:>10.1f} {on:>10.1f} {on / off:>6.2f}x {accept:>7.2f} {per_verify:>10.2f} "
              f"{tokens:>7} {differ:>4}/{len(batch)}", flush=True)


if __name__ == "__main__":
    main()
