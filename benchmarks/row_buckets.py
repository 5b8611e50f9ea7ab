"""oneDNN kernels per row count: memory and speed of three ways to serve every row count.

oneDNN (the float32/bf16 linear path, `brisk.models.linear`) builds and caches one primitive
per distinct row count. Serving sees every row count from 1 to the step budget, so RSS grew
with traffic. Compared here, on one decoder layer's linears of the chosen model (all three
shapes: qkv, o/down, gate_up), each mode in a fresh process:

- exact:  today's behaviour before the fix (each row count its own primitive; cache of 1,024);
- cap16:  the same with oneDNN's primitive cache capped (ONEDNN_PRIMITIVE_CACHE_CAPACITY=16);
- bucket: rows padded to `brisk.models.linear.row_bucket` (what brisk does now).

Each mode runs three passes over row counts 1..N in a shuffled order (as traffic would), and
reports RSS after each pass and the pass time. Then, in one process, the steady-state time of
padded vs exact rows at chosen row counts, alternating the two (best of 5 rounds), which is the
price of the padding once every kernel exists.

    .venv/bin/python benchmarks/row_buckets.py [--model PATH] [--max-rows 512]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time


def rss_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(mode: str, model: str | None, max_rows: int) -> dict:
    import torch

    from brisk.loading.loader import load
    from brisk.models import linear

    if mode != "bucket":
        linear.row_bucket = lambda rows: rows
    loaded = load(model, quantization="none", warmup=False)
    layer = loaded.model.model.layers[0]
    linears = [m for m in layer.modules() if isinstance(m, linear.Linear)]
    for m in linears:
        m.prepare()
    hidden = loaded.config.hidden_size
    x = {lin.in_features: torch.randn(max_rows, lin.in_features) for lin in linears}
    order = list(range(1, max_rows + 1))
    random.Random(0).shuffle(order)
    out = {"mode": mode, "passes": [], "rows": {}}
    with torch.inference_mode():
        start_rss = rss_mb()
        for _ in range(3):
            t = time.perf_counter()
            for rows in order:
                for lin in linears:
                    lin(x[lin.in_features][:rows])
            out["passes"].append({"s": round(time.perf_counter() - t, 2), "rss_mb": round(rss_mb())})
        out["start_rss_mb"] = round(start_rss)
    out["hidden"] = hidden
    return out


def steady_state(model: str | None, max_rows: int) -> dict:
    import torch

    from brisk.loading.loader import load
    from brisk.models import linear

    bucketed = linear.row_bucket
    loaded = load(model, quantization="none", warmup=False)
    linears = [m for m in loaded.model.model.layers[0].modules() if isinstance(m, linear.Linear)]
    for m in linears:
        m.prepare()
    x = {lin.in_features: torch.randn(max_rows, lin.in_features) for lin in linears}

    def timed(rows: int, reps: int = 10) -> float:
        t = time.perf_counter()
        for _ in range(reps):
            for lin in linears:
                lin(x[lin.in_features][:rows])
        return (time.perf_counter() - t) / reps * 1e3

    table = {}
    with torch.inference_mode():
        for rows in (1, 5, 9, 17, 33, 65, 100, 257, 300, max_rows):
            best = {"exact": float("inf"), "bucket": float("inf")}
            for _ in range(5):
                for mode, fn in (("exact", lambda r: r), ("bucket", bucketed)):
                    linear.row_bucket = fn
                    timed(rows, 1)
                    best[mode] = min(best[mode], timed(rows))
            table[rows] = {"padded_to": bucketed(rows), **{k: round(v, 3) for k, v in best.items()}}
    linear.row_bucket = bucketed
    return table


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF or HF dir (default: the demo model)")
    parser.add_argument("--max-rows", type=int, default=512)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "steady":
        print(json.dumps(steady_state(args.model, args.max_rows)))
        return
    if args.child:
        print(json.dumps(child(args.child, args.model, args.max_rows)))
        return
    results = []
    for mode in ("exact", "cap16", "bucket"):
        env = {**os.environ}
        if mode == "cap16":
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "16"
        cmd = [sys.executable, __file__, "--child", mode, "--max-rows", str(args.max_rows)]
        if args.model:
            cmd += ["--model", args.model]
        line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results.append(json.loads(line))
    print(f"| mode | RSS at start MB | after pass 1 / 2 / 3 MB | pass 1 / 2 / 3 s |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['start_rss_mb']} | {' / '.join(str(p['rss_mb']) for p in r['passes'])} | "
              f"{' / '.join(str(p['s']) for p in r['passes'])} |")
    cmd = [sys.executable, __file__, "--child", "steady", "--max-rows", str(args.max_rows)]
    if args.model:
        cmd += ["--model", args.model]
    table = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    print()
    print("| rows | padded to | exact ms | bucket ms | bucket / exact |")
    print("|---|---|---|---|---|")
    for rows, r in table.items():
        print(f"| {rows} | {r['padded_to']} | {r['exact']:.3f} | {r['bucket']:.3f} | {r['bucket'] / r['exact']:.2f} |")


if __name__ == "__main__":
    main()
