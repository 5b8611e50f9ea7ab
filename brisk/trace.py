"""Request traces: one schema, one writer, one reader.

A trace is JSONL, one request per line. `brisk serve --request-log` and `brisk kv-plan
--save-trace` write it with `TraceWriter`; `brisk bench --workload replay --trace` and
`brisk kv-plan --trace` read it with `read_trace`. Keys of a line (schema version 1):

- `trace_version` (1), `arrival_s` (seconds; any origin, e.g. Unix time), `prompt_tokens`;
- `output_tokens`: tokens generated, or null when unknown (a request that ended early);
- `max_tokens`, `cached_prompt_tokens`, `prefix_group`, `prefix_tokens` (optional);
- `finish_reason`: stop | length | abort | timeout | error | shutdown | ... (optional);
- anything else (timings, route, request_id) is kept for people and ignored here.

Older files are read too: `timestamp`/`arrival` for `arrival_s`, `input_tokens` for
`prompt_tokens`, `completion_tokens` for `output_tokens`, and the JSON of `brisk bench --json`
(its first run). A request that ended early keeps the tokens it generated when they are known
(they held KV memory); one with no known output is skipped and counted, never an error.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from brisk.errors import BriskError

TRACE_VERSION = 1
FINISHED_NORMALLY = frozenset({"stop", "length", None})


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None = None
    prefix_group: str | None = None
    prefix_tokens: int = 0
    finish_reason: str | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason not in FINISHED_NORMALLY


@dataclass(frozen=True)
class Trace:
    requests: list[TraceRequest]  # sorted by arrival, times from 0
    skipped: int = 0  # lines of requests that ended before any output was known
    aborted: int = 0  # requests kept although they ended early (their partial output counts)

    def describe(self) -> str:
        parts = []
        if self.aborted:
            parts.append(f"{self.aborted} ended early (kept with the tokens they generated)")
        if self.skipped:
            parts.append(f"{self.skipped} ended before any output and were skipped")
        return "; ".join(parts)


def trace_row(request: TraceRequest, **extra: Any) -> dict[str, Any]:
    row = {"trace_version": TRACE_VERSION, "arrival_s": round(request.arrival_s, 6),
           "prompt_tokens": request.prompt_tokens, "output_tokens": request.output_tokens,
           "max_tokens": request.max_tokens, "finish_reason": request.finish_reason}
    if request.prefix_group is not None:
        row.update(prefix_group=request.prefix_group, prefix_tokens=request.prefix_tokens)
    return {**row, **extra}


class TraceWriter:
    """Append-only JSONL, line-buffered (a crash loses at most the line being written), safe
    to call from several threads."""

    def __init__(self, path: str | Path, mode: str = "a"):
        self.path = Path(path)
        try:
            self._file = open(self.path, mode, buffering=1, encoding="utf-8")
        except OSError as e:
            raise BriskError(f"{self.path}: cannot open for writing ({e.strerror or e})") from None
        self._lock = threading.Lock()

    def write(self, row: dict[str, Any]) -> None:
        """`row` as made by `trace_row` or `server_row`."""
        line = json.dumps({"trace_version": TRACE_VERSION, **row}, ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _first(row: dict, *keys):
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    return None


def _int_or_none(value, what: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise BriskError(f"{where}: {what} must be a whole number, got {value!r}")
    return int(value)


def read_trace(path: str | Path, flag: str = "--trace") -> Trace:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BriskError(f"{flag} {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and "runs" in doc:
        return _from_bench(doc, f"{flag} {path}")
    rows, skipped, aborted = [], 0, 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{flag} {path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BriskError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise BriskError(f"{where}: expected a JSON object per line")
        version = row.get("trace_version", TRACE_VERSION)
        if version != TRACE_VERSION:
            raise BriskError(f"{where}: trace_version {version!r} is not supported (this brisk reads "
                             f"{TRACE_VERSION})")
        arrival = _first(row, "arrival_s", "timestamp", "arrival")
        prompt = _int_or_none(_first(row, "prompt_tokens", "input_tokens"), "prompt_tokens", where)
        output = _int_or_none(_first(row, "output_tokens", "completion_tokens"), "output_tokens", where)
        finish = row.get("finish_reason")
        if prompt is None:
            raise BriskError(f"{where}: need prompt_tokens (and output_tokens, arrival_s) on each line")
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool):
            raise BriskError(f"{where}: arrival_s must be a number of seconds, got {arrival!r}")
        if output is None and "output_tokens" not in row and "completion_tokens" not in row:
            raise BriskError(f"{where}: need output_tokens (a number, or null if unknown) on each line")
        if output is None or output < 1:
            skipped += 1  # ended before any output was known: its length says nothing
            continue
        request = TraceRequest(float(arrival), prompt, output,
                               _int_or_none(row.get("max_tokens"), "max_tokens", where),
                               None if row.get("prefix_group") is None else str(row["prefix_group"]),
                               _int_or_none(row.get("prefix_tokens"), "prefix_tokens", where) or 0,
                               None if finish is None else str(finish))
        aborted += request.aborted
        rows.append(request)
    return Trace(_normalised(rows, f"{flag} {path}"), skipped, aborted)


def _from_bench(doc: dict, where: str) -> Trace:
    try:
        run = doc["runs"][0]
        offsets = run.get("send_offsets") or [0.0] * len(run["input_lens"])
        triples = list(zip(offsets, run["input_lens"], run["output_lens"]))
    except (KeyError, IndexError, TypeError):
        raise BriskError(f"{where}: a brisk bench --json file needs runs[0] with input_lens and output_lens") from None
    rows = [TraceRequest(float(t), int(p), int(o)) for t, p, o in triples if p and o]
    return Trace(_normalised(rows, where), skipped=len(triples) - len(rows))


def _normalised(rows: list[TraceRequest], where: str) -> list[TraceRequest]:
    if not rows:
        raise BriskError(f"{where}: no requests with token counts")
    bad = next((r for r in rows if r.prompt_tokens < 1), None)
    if bad is not None:
        raise BriskError(f"{where}: prompt_tokens must be >= 1 (got {bad.prompt_tokens})")
    start = min(r.arrival_s for r in rows)
    rows = sorted(rows, key=lambda r: r.arrival_s)
    return [TraceRequest(r.arrival_s - start, r.prompt_tokens, r.output_tokens, r.max_tokens, r.prefix_group,
                         r.prefix_tokens, r.finish_reason) for r in rows]
