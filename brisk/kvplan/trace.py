"""Request traces for `brisk kv-plan`.

A trace is a list of requests with an arrival time, prompt and output token counts, and
optionally the max_tokens the client asked for and a shared prefix. Accepted files:

- JSONL, one request per line: `arrival_s` (or `timestamp`), `prompt_tokens` (or
  `input_tokens`), `output_tokens` (or `completion_tokens`), optional `max_tokens`,
  `prefix_group` and `prefix_tokens`. `brisk serve --request-log` writes this format.
- The JSON that `brisk bench --json` writes (its first run: `send_offsets`, `input_lens`,
  `output_lens`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from brisk.errors import BriskError


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None = None
    prefix_group: str | None = None
    prefix_tokens: int = 0


def _first(row: dict, *keys):
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    return None


def load_trace(path: Path) -> tuple[list[TraceRequest], int]:
    """Returns the requests (sorted by arrival, times from 0) and how many lines were skipped
    (aborted requests with no output count)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise BriskError(f"--trace {path}: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and "runs" in doc:
        return _from_bench(doc, path), 0
    rows, skipped = [], 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BriskError(f"--trace {path}:{lineno}: not JSON ({e.msg})") from None
        arrival = _first(row, "arrival_s", "timestamp", "arrival")
        prompt = _first(row, "prompt_tokens", "input_tokens")
        output = _first(row, "output_tokens", "completion_tokens")
        if output is None and prompt is not None:
            skipped += 1  # an aborted request: its length is unknown
            continue
        try:
            rows.append(TraceRequest(float(arrival if arrival is not None else 0.0), int(prompt), int(output),
                                     None if row.get("max_tokens") is None else int(row["max_tokens"]),
                                     None if row.get("prefix_group") is None else str(row["prefix_group"]),
                                     int(row.get("prefix_tokens") or 0)))
        except (TypeError, ValueError):
            raise BriskError(f"--trace {path}:{lineno}: need prompt_tokens and output_tokens as numbers "
                             "(and arrival_s)") from None
    return _normalised(rows, path), skipped


def _from_bench(doc: dict, path: Path) -> list[TraceRequest]:
    run = doc["runs"][0]
    offsets = run.get("send_offsets") or [0.0] * len(run["input_lens"])
    rows = [TraceRequest(float(t), int(p), int(o)) for t, p, o in zip(offsets, run["input_lens"], run["output_lens"])
            if p is not None and o is not None]
    return _normalised(rows, path)


def _normalised(rows: list[TraceRequest], path) -> list[TraceRequest]:
    if not rows:
        raise BriskError(f"--trace {path}: no requests with token counts")
    bad = next((r for r in rows if r.prompt_tokens < 1 or r.output_tokens < 1), None)
    if bad is not None:
        raise BriskError(f"--trace {path}: token counts must be >= 1 (got prompt {bad.prompt_tokens}, "
                         f"output {bad.output_tokens})")
    start = min(r.arrival_s for r in rows)
    rows = sorted(rows, key=lambda r: r.arrival_s)
    return [TraceRequest(r.arrival_s - start, r.prompt_tokens, r.output_tokens, r.max_tokens, r.prefix_group,
                         r.prefix_tokens) for r in rows]


def synthetic_trace(prompt_dist, output_dist, num_requests: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at `rate` requests/s with lengths drawn from the two distributions."""
    from brisk.bench.workloads import arrival_offsets

    rng = np.random.default_rng(seed)
    prompts, outputs = prompt_dist.sample(rng, num_requests), output_dist.sample(rng, num_requests)
    arrivals = arrival_offsets(num_requests, rate, 1.0, rng)
    return [TraceRequest(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]
