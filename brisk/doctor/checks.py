"""The doctor's four examinations — cold start, network, context, concurrency/KV — each
bounded in requests and time, each returning a Finding (status, evidence, fixes) and the
raw measurements for the report. A misbehaving server never crashes a check: what could
not be measured is said so."""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from brisk.doctor.budget import Budget
from brisk.doctor.probe import Prober, Timing, dns_seconds, error_message

OK, WARNING, PROBLEM, UNKNOWN = "ok", "warning", "problem", "unknown"
_RANK = {OK: 0, UNKNOWN: 1, WARNING: 2, PROBLEM: 3}


@dataclass
class Finding:
    area: str
    status: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fixes: list[str] = field(default_factory=list)
    not_measured: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"area": self.area, "status": self.status, "summary": self.summary, "evidence": self.evidence,
                "fixes": self.fixes, "not_measured": self.not_measured}


def worst(statuses) -> str:
    return max(statuses, key=lambda s: _RANK[s], default=OK)


@dataclass
class Options:
    model: str
    quick: bool = False
    max_concurrency: int = 16
    max_model_len: int | None = None
    sample_file: str | None = None
    cold_wait_s: float = 120.0
    progress: Callable[[str], None] = lambda message: None
    budget: Budget = field(default_factory=lambda: Budget(600.0))


SHORT_CHAT = [{"role": "user", "content": "Reply with one short sentence about the sea."}]
FILLER = ("the quick brown fox jumps over a lazy dog while rivers run to the sea and birds sing in old trees "
          "near quiet towns under a wide blue sky ").split()


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values) -> dict[str, float] | None:
    """The samples behind a figure: how many, min, median, max (seconds)."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return {"n": len(values), "min": values[0], "median": statistics.median(values), "max": values[-1]}


def _failed_probe(t: Timing, what: str) -> str:
    return f"{what} ({'timed out: ' if t.timed_out else 'failed: '}{t.error or f'HTTP {t.status}'})"


# -- cold start ---------------------------------------------------------------------------------
def check_cold_start(p: Prober, o: Options) -> tuple[Finding, dict]:
    o.progress("cold start: readiness and first request")
    data: dict[str, Any] = {}
    loading_seen, waited, retry_after, phases = False, 0.0, None, []
    start = time.perf_counter()
    while time.perf_counter() - start < o.cold_wait_s:
        ready = p.get("/ready")
        probe = ready if ready.status not in (None, 404) else p.post_json(
            "/v1/chat/completions", {"model": o.model, "messages": SHORT_CHAT, "max_tokens": 1})
        if probe.status != 503:
            break
        loading_seen = True
        retry_after = probe.headers.get("retry-after", retry_after)
        if isinstance(probe.body, dict) and probe.body.get("phase"):
            phases.append(probe.body["phase"])
        time.sleep(_retry_delay(retry_after))
    waited = time.perf_counter() - start if loading_seen else 0.0
    still_loading = loading_seen and time.perf_counter() - start >= o.cold_wait_s
    budget = o.budget
    if loading_seen:  # the wait for a loading server is measured, not charged to the probes' budget
        budget.start = time.monotonic()
    timings = []
    for i in range(1 + (3 if o.quick else 5)):  # the first request, then the steady samples it is judged by
        if i and budget.remaining() <= 0 and not budget.fixed:
            budget.skipped.append(f"cold start: steady samples after the first {i} requests")
            break
        timings.append(p.stream_chat(o.model, SHORT_CHAT, 4, timeout_s=budget.timeout()))
    data["first_requests"] = [_timing_row(t) for t in timings]
    ok = [t for t in timings[1:] if t.ok and t.ttft_s is not None]
    first = timings[0].ttft_s if timings[0].ok else None
    steady_spread = spread([t.ttft_s for t in ok])
    steady = steady_spread["median"] if steady_spread else None
    penalty = (first - steady) if first is not None and steady is not None else None
    data.update(loading_seen=loading_seen, waited_for_ready_s=waited, retry_after=retry_after,
                load_phases=list(dict.fromkeys(phases)), first_ttft_s=first, steady_ttft_s=steady,
                steady_ttft_spread_s=steady_spread, first_request_penalty_s=penalty)
    evidence = {k: data[k] for k in ("loading_seen", "waited_for_ready_s", "retry_after", "first_ttft_s",
                                     "steady_ttft_s", "steady_ttft_spread_s", "first_request_penalty_s")}
    fixes = []
    cold = waited + max(penalty or 0.0, 0.0)
    # Above noise: the first request must be slower than every steady sample by a clear margin,
    # not merely slower than their median (one slow sample on a warm server is not a cold start).
    slow_first = (first is not None and steady_spread is not None and steady_spread["n"] >= 2
                  and first > steady_spread["max"] + max(1.0, 3 * steady_spread["median"]))
    if still_loading:
        status, summary = PROBLEM, f"still loading after {o.cold_wait_s:.0f} s (503 the whole time)"
    elif loading_seen or slow_first:
        parts = []
        if loading_seen:
            parts.append(f"answered 503 (loading{', phase ' + phases[-1] if phases else ''}) for {waited:.1f} s")
        if slow_first:
            parts.append(f"first request {first:.2f} s vs {steady_spread['min']:.3f}–{steady_spread['max']:.3f} s "
                         f"over {steady_spread['n']} later requests")
        status = PROBLEM if cold >= 2.0 else WARNING
        summary = "cold start: " + "; ".join(parts) + f" — cold penalty {cold:.1f} s"
    else:
        status, summary = OK, (f"warm: first request {first or 0:.3f} s, then {steady_spread['min']:.3f}–"
                               f"{steady_spread['max']:.3f} s over {steady_spread['n']} requests"
                               if steady_spread else "warm")
    metrics = scrape(p)
    tier = _kv_disk_tier(metrics)
    data["kv_disk_tier"] = evidence["kv_disk_tier"] = tier
    if tier and tier["tokens_read"]:
        summary += f"; {tier['tokens_read']:,} prompt tokens read back from the KV disk tier since start"
    host = _kv_host_tier(metrics)
    data["kv_host_tier"] = evidence["kv_host_tier"] = host
    if host and host["tokens_read"]:
        summary += f"; {host['tokens_read']:,} prompt tokens taken back from the KV host tier since start"
    churning = [line for line in (_tier_churn("disk", tier), _tier_churn("host", host)) if line]
    if churning:
        summary += "; " + "; ".join(churning)
        status = WARNING if status == OK else status
        fixes.append("size the KV tiers against your traffic: `brisk kv-plan --trace LOG --disk-bytes SIZE "
                     "--host-bytes SIZE` (LOG: brisk serve --request-log) says what each budget keeps; a tier that "
                     "cannot hold the prefixes users come back to only costs copies and writes")
    if status != OK:
        fixes += ["keep a warm replica, and route traffic only after /ready (or a warm-up request) succeeds",
                  "cache converted/compiled artefacts between restarts (brisk: $BRISK_CACHE; vLLM: compile cache)",
                  "send a warm-up request at start so the first user does not pay for lazy initialisation"]
        if tier is not None and not tier["budget_bytes"]:
            fixes.append("brisk serve --kv-cache-dir DIR: cached prompts (system prompts, chat histories) outlive a "
                         "restart, read back from disk instead of recomputed")
    missing = [_failed_probe(t, "cold start request") for t in timings if not t.ok]
    if not steady_spread or steady_spread["n"] < 2:
        missing.append("steady-state latency (fewer than two later requests succeeded)")
    if missing:  # a failed probe is not evidence either way
        status, fixes = UNKNOWN, []
    return Finding("cold_start", status, summary, evidence, fixes, missing), data


def _kv_disk_tier(metrics: dict[str, float]) -> dict[str, int] | None:
    """brisk's KV disk tier as its /metrics tell it (None: not brisk, or no /metrics); budget 0: not enabled."""
    if "brisk:kv_disk_budget_bytes" not in metrics:
        return None
    return {"budget_bytes": int(metrics["brisk:kv_disk_budget_bytes"]),
            "bytes": int(metrics.get("brisk:kv_disk_bytes", 0)),
            "tokens_read": int(metrics.get("brisk:kv_disk_hits_total", 0)),
            "tokens_missed": int(metrics.get("brisk:kv_disk_misses_total", 0)),
            "blocks_written": int(metrics.get("brisk:kv_disk_blocks_written_total", 0))}


def _kv_host_tier(metrics: dict[str, float]) -> dict[str, int] | None:
    """brisk's KV host tier as its /metrics tell it (None: not brisk, or a brisk without one); budget 0: not
    enabled."""
    if "brisk:kv_host_budget_bytes" not in metrics:
        return None
    return {"budget_bytes": int(metrics["brisk:kv_host_budget_bytes"]),
            "bytes": int(metrics.get("brisk:kv_host_bytes", 0)),
            "tokens_read": int(metrics.get("brisk:kv_host_hits_total", 0)),
            "tokens_missed": int(metrics.get("brisk:kv_host_misses_total", 0)),
            "blocks_stored": int(metrics.get("brisk:kv_host_blocks_stored_total", 0))}


CHURN_MIN_TOKENS = 4096  # prompt tokens a tier must have been asked for before its hit rate is judged
CHURN_HIT_RATE = 0.05


def _tier_churn(name: str, tier: dict[str, int] | None) -> str | None:
    """A line when a KV tier is full and answers (almost) none of what it is asked: the LRU loop of a budget
    smaller than the prefixes users come back to, or traffic with little reuse. None otherwise."""
    if not tier or not tier["budget_bytes"]:
        return None
    asked = tier["tokens_read"] + tier["tokens_missed"]
    full = tier["bytes"] >= 0.9 * tier["budget_bytes"]
    if asked < CHURN_MIN_TOKENS or not full or tier["tokens_read"] > CHURN_HIT_RATE * asked:
        return None
    flag = "--kv-cache-disk-bytes" if name == "disk" else "--kv-cache-host-bytes"
    return (f"the KV {name} tier is full ({tier['bytes'] / 2**20:,.0f} of {tier['budget_bytes'] / 2**20:,.0f} MiB) "
            f"and held {tier['tokens_read'] / asked:.0%} of the {asked:,} prompt tokens asked of it: its budget "
            f"({flag}) is smaller than the prefixes users come back to, or the traffic reuses little")


def _retry_delay(retry_after: str | None) -> float:
    """Honour a numeric Retry-After, but poll at least once a second to time the load."""
    try:
        return min(max(float(retry_after), 0.1), 1.0)
    except (TypeError, ValueError):
        return 0.5


def _timing_row(t: Timing) -> dict[str, Any]:
    return {"status": t.status, "ttfb_s": t.ttfb_s, "ttft_s": t.ttft_s, "e2e_s": t.e2e_s, "connect_s": t.connect_s,
            "tls_s": t.tls_s, "reused_connection": t.reused_connection, "chunks": len(t.chunk_ts),
            "prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens, "error": t.error,
            "server_timings": (t.usage or {}).get("brisk")}


# -- network ------------------------------------------------------------------------------------------
def check_network(p: Prober, o: Options, steady_ttft_s: float | None) -> tuple[Finding, dict]:
    o.progress("network: connect, TLS, time to first byte, streaming")
    fresh = Prober(p.base_url, timeout_s=30)  # a new connection, to see connect and TLS cost
    fresh.client.headers.update(p.client.headers)
    first = fresh.get("/v1/models")
    fresh.close()
    trivial = [p.get("/v1/models", timeout_s=o.budget.timeout()) for _ in range(5)]
    stream = p.stream_chat(o.model, [{"role": "user", "content": "Count from one to forty in words."}],
                           24 if o.quick else 48, {"ignore_eos": True}, timeout_s=o.budget.timeout())
    dns = dns_seconds(p.base_url)
    data = {"dns_s": dns, "connect_s": first.connect_s, "tls_s": first.tls_s, "fresh_ttfb_s": first.ttfb_s,
            "trivial_ttfb_s": _median([t.ttfb_s for t in trivial]),
            "trivial_ttfb_spread_s": spread([t.ttfb_s for t in trivial if t.ok]),
            "reused_connections": sum(t.reused_connection for t in trivial), "trivial_requests": len(trivial),
            "stream": _timing_row(stream), "steady_ttft_s": steady_ttft_s}
    problems, warnings, fixes, missing = [], [], [], []
    setup = (dns or 0) + first.connect_s + first.tls_s
    if steady_ttft_s and setup > 0.05 and setup > 0.3 * steady_ttft_s:
        warnings.append(f"connection set-up {setup * 1e3:.0f} ms (DNS {(dns or 0) * 1e3:.0f}, connect "
                        f"{first.connect_s * 1e3:.0f}, TLS {first.tls_s * 1e3:.0f}) is {setup / steady_ttft_s:.0%} "
                        "of a request's TTFT")
        fixes.append("reuse connections (HTTP keep-alive / a pooled client) and place clients near the server")
    if data["reused_connections"] == 0:
        warnings.append("no connection was reused: the server (or a proxy) closes connections after each request")
        fixes.append("enable HTTP keep-alive on the server and any proxy in between")
    if stream.ok and stream.completion_tokens and stream.completion_tokens >= 16 and stream.chunk_ts:
        span = stream.chunk_ts[-1] - stream.chunk_ts[0]
        ttft_share = stream.ttft_s / stream.e2e_s if stream.e2e_s else 0.0
        tokens_per_chunk = stream.completion_tokens / len(stream.chunk_ts)
        data.update(ttft_share_of_e2e=ttft_share, tokens_per_chunk=tokens_per_chunk, chunk_span_s=span)
        if ttft_share > 0.85 or tokens_per_chunk > 4:
            problems.append(f"streaming is buffered: the first token arrived after {ttft_share:.0%} of the "
                            f"response time ({stream.ttft_s:.2f} of {stream.e2e_s:.2f} s), "
                            f"{stream.completion_tokens} tokens in {len(stream.chunk_ts)} chunks")
            fixes.append("turn off response buffering in proxies (nginx: proxy_buffering off, or send "
                         "X-Accel-Buffering: no) and make sure the client requests stream=true")
    elif not stream.ok:
        missing.append(_failed_probe(stream, "streaming behaviour"))
    else:
        missing.append(f"streaming behaviour (only {stream.completion_tokens} tokens came back; 16 needed)")
    if not any(t.ok for t in trivial):
        missing.append(_failed_probe(trivial[0], "time to first byte of a trivial request"))
    if steady_ttft_s and data["trivial_ttfb_s"] is not None:
        data["server_share_of_ttft"] = max(0.0, 1 - data["trivial_ttfb_s"] / steady_ttft_s)
    status = PROBLEM if problems else WARNING if warnings else OK
    streamed = "tokens_per_chunk" in data  # measured: the stream probe came back whole
    summary = "; ".join(problems + warnings) or (
        f"network is not the bottleneck: a trivial request answers in {(data['trivial_ttfb_s'] or 0) * 1e3:.1f} ms, "
        f"connect {first.connect_s * 1e3:.1f} ms, "
        + ("streaming token by token" if streamed else "streaming not measured"))
    if missing:  # a failed probe is not evidence either way
        status = UNKNOWN
    evidence = {k: data.get(k) for k in ("dns_s", "connect_s", "tls_s", "trivial_ttfb_s", "trivial_ttfb_spread_s",
                                         "reused_connections",
                                         "ttft_share_of_e2e", "tokens_per_chunk", "server_share_of_ttft")}
    return Finding("network", status, summary, evidence, fixes, missing), data


# -- context ------------------------------------------------------------------------------------------
class TokenCounter:
    """Counts with the endpoint's own tokenizer when it offers one — brisk's and vLLM's /tokenize
    (after the chat template), or llama.cpp's /apply-template + /tokenize — else approximately
    (one filler word ~ one token)."""

    def __init__(self, p: Prober, model: str):
        self.p, self.model = p, model
        probe = p.post_json("/tokenize", {"model": model, "messages": SHORT_CHAT})
        self.style = "openai" if probe.ok and isinstance(probe.body, dict) and "count" in probe.body else None
        self.window = probe.body.get("max_model_len") if self.style else None
        if self.style is None and self._llamacpp_chat(SHORT_CHAT) is not None:
            self.style = "llamacpp"
        self.exact = self.style is not None

    def _llamacpp_chat(self, messages: list[dict]) -> int | None:
        t = self.p.post_json("/apply-template", {"messages": messages})
        prompt = t.body.get("prompt") if t.ok and isinstance(t.body, dict) else None
        if not isinstance(prompt, str):
            return None
        tokens = self._llamacpp_tokens(prompt, special=True)
        return None if tokens is None else len(tokens)

    def _llamacpp_tokens(self, text: str, special: bool = False):
        r = self.p.post_json("/tokenize", {"content": text, "add_special": special, "parse_special": special})
        tokens = r.body.get("tokens") if r.ok and isinstance(r.body, dict) else None
        return tokens if isinstance(tokens, list) else None

    def _tokens_of(self, text: str):
        if self.style == "llamacpp":
            return self._llamacpp_tokens(text)
        r = self.p.post_json("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return r.body.get("tokens") if r.ok and isinstance(r.body, dict) else None

    def chat(self, messages: list[dict]) -> int | None:
        if self.style == "llamacpp":
            return self._llamacpp_chat(messages)
        if not self.exact:
            return sum(len(m["content"].split()) for m in messages) + 8 * len(messages)
        r = self.p.post_json("/tokenize", {"model": self.model, "messages": messages})
        return r.body.get("count") if r.ok and isinstance(r.body, dict) else None

    def text(self, text: str) -> int | None:
        if not self.exact:
            return None
        tokens = self._tokens_of(text)
        return None if tokens is None else len(tokens)


def _filler(n_words: int, rng: np.random.Generator) -> str:
    return " ".join(rng.choice(FILLER, size=max(n_words, 1)))


def _chat_of(counter: TokenCounter, target: int, rng, head: str = "", tail: str = "") -> list[dict]:
    """A one-message chat of about `target` tokens (exactly, within a few tokens, with /tokenize).
    It opens with a random tag, so no prefix cache (of this run or an earlier one) can serve it:
    the doctor measures what a new prompt costs."""
    tag = f"[{rng.integers(1 << 62):x}] "
    words = max(target - 40, 8)
    for _ in range(5):
        msgs = [{"role": "user", "content": f"{tag}{head}{_filler(words, rng)}{tail}"}]
        n = counter.chat(msgs)
        if n is None or abs(n - target) <= 4:
            return msgs
        words = max(words + (target - n), 8)
    return msgs


def check_context(p: Prober, o: Options, models_body) -> tuple[Finding, dict]:
    o.progress("context: window, prefill cost, truncation")
    rng = np.random.default_rng()  # fresh prompts every run (see _chat_of)
    budget = o.budget
    counter = TokenCounter(p, o.model)
    window = o.max_model_len or _window_from_models(models_body, o.model) or counter.window or _window_from_props(p)
    data: dict[str, Any] = {"window": window, "exact_counts": counter.exact, "sweep": []}
    missing, problems, warnings, fixes = [], [], [], []
    if not counter.exact:
        missing.append("exact token counts (no /tokenize on this endpoint; counts are approximate)")
    if window is None:
        missing.append("the context window (pass --max-model-len): no prompt-length sweep")
        return Finding("context", UNKNOWN, "context window unknown", {"window": None}, [], missing), data
    targets = sorted({min(128, window // 8), min(256, window // 4), min(512, window // 4), min(1024, window // 2),
                      window // 4}) if o.quick else \
        sorted({min(128, window // 8), window // 8, window // 4, window // 2, int(window * 0.75), int(window * 0.9)})
    fit = None  # (intercept s, seconds per token) once two points are in
    for target in targets:
        estimate = _estimate(data["sweep"], fit, target)
        if not budget.fits(1.5 * estimate, f"context sweep at {target} tokens"):
            continue
        msgs = _chat_of(counter, target, rng)
        sent = counter.chat(msgs)
        # Three times the expected time (or the budget): a server slower than that is stuck, not slow
        t = p.stream_chat(o.model, msgs, 1, timeout_s=min(budget.timeout(), max(3 * estimate, 2.0)))
        data["sweep"].append({"target_tokens": target, "client_tokens": sent, "server_prompt_tokens": t.prompt_tokens,
                              "ttft_s": t.ttft_s, "status": t.status, "error": t.error, "timed_out": t.timed_out})
        if not t.ok:
            missing.append(_failed_probe(t, f"prefill at {sent or target} tokens"))
        fit = _prefill_fit(data["sweep"]) or fit
    good = [r for r in data["sweep"] if r["ttft_s"] is not None and r["client_tokens"]]
    if fit is not None and len(good) >= 3:
        data.update(prefill_ms_per_1k_tokens=float(fit[1] * 1e6), ttft_intercept_s=float(fit[0]),
                    prefill_points=len(good))
    else:
        missing.append(f"prefill cost ({len(good)} sweep points succeeded; 3 needed for a fit)")
    truncated = [r for r in good if r["server_prompt_tokens"] is not None and r["client_tokens"]
                 and r["server_prompt_tokens"] < r["client_tokens"] * (0.98 if counter.exact else 0.8) - 2]
    if truncated:
        r = truncated[-1]
        problems.append(f"silent truncation: sent {r['client_tokens']} prompt tokens, the server reports "
                        f"processing {r['server_prompt_tokens']} — the start of long prompts is dropped without an "
                        "error")
        fixes += ["count tokens before sending (POST /tokenize) and trim history yourself",
                  "make the server reject overlong prompts (brisk: --context-policy reject, the default)"]
    over = _overlong_probe(p, o, counter, window, rng, fit)
    data["overlong"] = over
    verdict = over.get("verdict")
    if verdict == "cut_silently" and not truncated:
        problems.append(f"silent truncation: a prompt of {over['client_tokens']} tokens (window {window}) was "
                        f"accepted and reported as {over['server_prompt_tokens']} tokens: the server cuts it "
                        "without an error")
        fixes.append("reject or visibly truncate prompts over the window (brisk: --context-policy)")
    elif verdict == "beyond_window":
        warnings.append(f"accepts prompts beyond its advertised window: {over['client_tokens']} tokens (window "
                        f"{window}) were accepted and all {over['server_prompt_tokens']} processed — the advertised "
                        "window is not the real limit")
        fixes.append("advertise the real window (vLLM/brisk: --max-model-len) so clients budget against it, or make "
                     "the server reject prompts over it")
    elif verdict is None:
        missing.append(over.get("not_measured") or "prompts over the window")
    data["needle"] = _needle(p, o, counter, window, fit)
    needle = data["needle"]
    if needle.get("not_measured"):
        missing.append(needle["not_measured"])
    elif needle.get("control_found") and needle.get("long_found") is False:
        warnings.append(f"a fact at the start of a {needle['long_tokens']}-token prompt was not "
                        "recalled (it was at short length): check truncation or the model's long-context quality")
        fixes.append("if the token counts agree (no truncation), the model itself loses early context: keep key "
                     "facts near the end of the prompt, summarise old history, or use a model with a longer "
                     "effective context")
    if o.sample_file:
        data["sample"] = _sample_ratio(counter, o.sample_file)
        if data["sample"].get("ratio_vs_english", 0) > 1.5:
            warnings.append(f"your sample text costs {data['sample']['ratio_vs_english']:.1f}× the tokens per "
                            "character of English: budget the window in tokens, not characters")
            fixes.append("size max_tokens and history from token counts (POST /tokenize), never from characters")
    status = PROBLEM if problems else WARNING if warnings else OK
    slope_text = (f"prefill {data['prefill_ms_per_1k_tokens']:.0f} ms per 1k prompt tokens ({len(good)} points)"
                  if "prefill_ms_per_1k_tokens" in data else "prefill cost not measured")
    summary = "; ".join(problems + warnings) or (
        f"window {window} tokens: " + ("overlong prompts rejected" if verdict == "rejected" else
                                       "over-window behaviour not measured") +
        f", no truncation up to {max((r['client_tokens'] for r in good), default=0)} tokens; " + slope_text)
    evidence = {"window": window, "exact_counts": counter.exact,
                "prefill_ms_per_1k_tokens": data.get("prefill_ms_per_1k_tokens"),
                "largest_prompt_measured": max((r["client_tokens"] for r in good), default=None),
                "truncated_points": len(truncated), "overlong": verdict,
                "overlong_rejected": verdict == "rejected", "needle": needle, "sample": data.get("sample")}
    failed = [m for m in missing if "timed out" in m or "failed" in m]
    if failed or not good:  # a probe that failed is not evidence either way
        status = UNKNOWN
    return Finding("context", status, summary, evidence, list(dict.fromkeys(fixes)), missing), data


def _estimate(sweep: list[dict], fit, target: int) -> float:
    """Expected TTFT of a `target`-token prompt: the linear fit once there is one, else
    proportional to the one point measured, else 2 s."""
    if fit is not None:
        return fit[0] + fit[1] * target
    good = [r for r in sweep if r["ttft_s"] is not None and r["client_tokens"]]
    return good[0]["ttft_s"] * max(target / good[0]["client_tokens"], 1.0) if good else 2.0


def _prefill_fit(sweep: list[dict]) -> tuple[float, float] | None:
    good = [r for r in sweep if r["ttft_s"] is not None and r["client_tokens"]]
    if len(good) < 2:
        return None
    xs = np.array([r["client_tokens"] for r in good], float)
    ys = np.array([r["ttft_s"] for r in good], float)
    if np.ptp(xs) == 0:
        return None
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(intercept), max(float(slope), 0.0)


def _window_from_models(body, model: str) -> int | None:
    try:
        for m in body["data"]:
            if m.get("id") == model or len(body["data"]) == 1:
                for key in ("max_model_len", "context_length", "max_context_length"):
                    if isinstance(m.get(key), int):
                        return m[key]
    except (KeyError, TypeError):
        pass
    return None


def _window_from_props(p: Prober) -> int | None:
    """llama.cpp's server: GET /props has the context of one slot (what one request may use)."""
    t = p.get("/props", timeout_s=5)
    try:
        n = t.body["default_generation_settings"]["n_ctx"]
    except (KeyError, TypeError):
        return None
    return n if t.ok and isinstance(n, int) and n > 0 else None


def _overlong_probe(p: Prober, o: Options, counter: TokenCounter, window: int, rng, fit) -> dict:
    """Send a prompt 10% over the window. Rejected: fine. Accepted and reported shorter than sent:
    cut silently. Accepted and reported at least as long as sent: accepts beyond its window."""
    n = int(window * 1.1) + 16
    estimate = 10.0 if fit is None else 1.5 * (fit[0] + fit[1] * n) + 2.0  # if it is processed in full
    if not o.budget.fits(min(estimate, 3.0), f"a prompt over the window ({n} tokens)"):
        return {"not_measured": f"a prompt over the window ({n} tokens): skipped, no time left"}
    msgs = _chat_of(counter, n, rng)
    sent = counter.chat(msgs)
    t = p.post_json("/v1/chat/completions", {"model": o.model, "messages": msgs, "max_tokens": 1},
                    timeout_s=min(o.budget.timeout(), estimate))
    out: dict[str, Any] = {"client_tokens": sent, "status": t.status, "server_prompt_tokens": t.prompt_tokens}
    if t.status in (400, 413, 422):
        out["verdict"] = "rejected"
        out["message"] = error_message(t.body if isinstance(t.body, str) else json.dumps(t.body))
    elif t.status == 200 and t.prompt_tokens is not None and sent:
        tolerance = 0.98 if counter.exact else 0.8
        out["verdict"] = "cut_silently" if t.prompt_tokens < sent * tolerance - 2 else "beyond_window"
    elif t.status == 200:
        out["not_measured"] = f"a {sent}-token prompt over the window was accepted, but its token count is unknown"
    else:
        out["not_measured"] = _failed_probe(t, f"a prompt over the window ({sent} tokens)")
    return out


NEEDLE_QUICK_TOKENS = 1024  # --quick asks for the fact at most this far back (the full run: 75% of the window)


def _needle(p: Prober, o: Options, counter: TokenCounter, window: int, fit) -> dict:
    """Recall of a fact at the start of a long prompt. The prompt is the same every run (a fixed
    seed): with greedy decoding, the answer then depends on the server, not on the filler drawn."""
    fact = "The secret code is 4721."
    question = " What is the secret code? Answer with the number only."
    n = min(int(window * 0.75), NEEDLE_QUICK_TOKENS) if o.quick else int(window * 0.75)
    rng = np.random.default_rng(4721)
    estimate = 2.0 + (60.0 if fit is None else 2 * (fit[0] + fit[1] * n))
    if not o.budget.fits(estimate, f"recall of an early fact at {n} tokens"):
        return {"not_measured": f"recall of an early fact at {n} tokens: skipped (needs ~{estimate:.0f} s)"}
    short = [{"role": "user", "content": fact + question}]
    control = p.post_json("/v1/chat/completions", {"model": o.model, "messages": short, "max_tokens": 12,
                                                   "temperature": 0}, timeout_s=o.budget.timeout())
    out: dict[str, Any] = {"control_found": _answer_has(control, "4721")}
    long_msgs = _chat_of(counter, n, rng, head=fact + " ", tail=question)
    out["long_tokens"] = counter.chat(long_msgs)
    if out["long_tokens"] is not None and out["long_tokens"] + 12 > window:  # a vocabulary too small for the words
        out["not_measured"] = (f"recall of an early fact: skipped (the shortest prompt with the fact takes "
                               f"{out['long_tokens']} tokens, over the {window}-token window)")
        return out
    long = p.post_json("/v1/chat/completions", {"model": o.model, "messages": long_msgs, "max_tokens": 12,
                                                "temperature": 0}, timeout_s=o.budget.timeout())
    out["long_found"] = _answer_has(long, "4721") if long.ok else None
    if not long.ok:
        out["not_measured"] = _failed_probe(long, f"recall of an early fact at {out['long_tokens']} tokens")
    return out


def _answer_has(t: Timing, needle: str) -> bool | None:
    try:
        return needle in t.body["choices"][0]["message"]["content"]
    except (KeyError, TypeError, IndexError):
        return None


ENGLISH_REFERENCE = ("Large language model servers are often slow for three reasons: the model is still loading, "
                     "the cache that holds past tokens is full, or the prompt is longer than the context window.")


def _sample_ratio(counter: TokenCounter, path: str) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")[:20000]
    except OSError as e:
        return {"error": f"{path}: {e.strerror or e}"}
    n, ref = counter.text(text), counter.text(ENGLISH_REFERENCE)
    if not text.strip() or n is None or ref is None:
        return {"error": "needs an endpoint with /tokenize to count exactly"}
    ratio = (n / len(text)) / (ref / len(ENGLISH_REFERENCE))
    return {"chars": len(text), "tokens": n, "tokens_per_char": n / len(text),
            "english_tokens_per_char": ref / len(ENGLISH_REFERENCE), "ratio_vs_english": ratio}


# -- concurrency and KV pressure -----------------------------------------------------------------------
_ENGINE_METRICS = {  # engine -> (kv usage gauge, waiting gauge, preemptions counter)
    "brisk": ("brisk:kv_usage_ratio", "brisk:num_requests_waiting", "brisk:num_preemptions_total"),
    "vllm": ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_preemptions_total"),
    "sglang": ("sglang:token_usage", "sglang:num_queue_reqs", None),
    "llamacpp": ("llamacpp:kv_cache_usage_ratio", "llamacpp:requests_deferred", None),
}


_RATIO_SUFFIXES = ("_ratio", "_perc", "token_usage")  # gauges in [0, 1]: never summed


def scrape(p: Prober) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    t = p.get("/metrics")
    if not t.ok or not isinstance(t.body, str):
        return {}
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(t.body):
            for s in family.samples:
                if s.name.endswith(_RATIO_SUFFIXES):  # per replica (or per model): the fullest one
                    out[s.name] = max(out.get(s.name, s.value), s.value)
                else:  # counts add up across replicas
                    out[s.name] = out.get(s.name, 0.0) + s.value
    except ValueError:
        return {}
    if "vllm:gpu_cache_usage_perc" in out and "vllm:kv_cache_usage_perc" not in out:
        out["vllm:kv_cache_usage_perc"] = out["vllm:gpu_cache_usage_perc"]
    return out


def _engine_of(metrics: dict[str, float]) -> str | None:
    for engine, (kv, waiting, _) in _ENGINE_METRICS.items():
        if kv in metrics or waiting in metrics:
            return engine
    return None


class _Sampler:
    """Keeps the maxima of the KV and queue gauges over a level: sampled at its start and end (`observe`) and every
    0.25 s while it runs, so that a level shorter than one poll is still seen."""

    def __init__(self, p: Prober, engine: str | None):
        self.p, self.engine = p, engine
        self.max_kv, self.max_waiting = None, None  # None: not exported, or never sampled (`scrapes` tells which)
        self.scrapes = 0  # /metrics answers read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def observe(self, m: dict[str, float]) -> None:
        if not m or not self.engine:
            return
        self.scrapes += 1
        kv, waiting, _ = _ENGINE_METRICS[self.engine]
        if kv in m:
            self.max_kv = max(self.max_kv or 0.0, m[kv])
        if waiting in m:
            self.max_waiting = max(self.max_waiting or 0.0, m[waiting])

    def _run(self):
        while not self._stop.wait(0.25):
            self.observe(scrape(self.p))

    def __enter__(self):
        if self.engine:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.engine:
            self._thread.join(timeout=5)


ROUNDS = 3  # each level runs this many rounds, the levels interleaved round by round
ONE_STREAM_REQUESTS = 2  # a one-stream round: this many requests one after another


def _round_batches(level: int) -> int:
    """Requests one round of `level` streams sends one after another per stream."""
    return ONE_STREAM_REQUESTS if level == 1 else 1


def check_concurrency(p: Prober, o: Options) -> tuple[Finding, dict]:
    """Ramps parallel streams 1, 2, 4, ... The levels take turns, round by round (1, 2, 4, 1, 2, 4,
    ...): a host whose speed drifts over the minute (a noisy neighbour, a throttled guest) then
    slows every level alike, and the ratios between levels, which the verdict is made of, hold."""
    o.progress("concurrency: ramping parallel streams")
    levels = [1]
    while levels[-1] * 2 <= (min(o.max_concurrency, 4) if o.quick else o.max_concurrency):
        levels.append(levels[-1] * 2)
    engine = _engine_of(scrape(p))
    _, _, preempt = _ENGINE_METRICS.get(engine, (None, None, None))
    budget = o.budget
    max_tokens = 16 if o.quick else 24
    nonce = int(np.random.default_rng().integers(1 << 62))  # fresh prompts every run
    counter = 0
    runs: dict[int, dict] = {}  # level -> what its rounds gathered
    for rnd in range(ROUNDS):
        for level in levels:
            if rnd == 0 and runs:  # admit a level if all its rounds, and the rest of the admitted, fit
                last = runs[max(runs)]
                per_batch = last["round_walls"][0] / _round_batches(last["level"])
                committed = (ROUNDS - 1) * sum(r["round_walls"][0] for r in runs.values())
                estimate = committed + ROUNDS * per_batch * _round_batches(level) * 1.5
                if not budget.fits(estimate, f"concurrency {level}"):
                    break
            elif rnd > 0 and (level not in runs or (not budget.fixed and budget.remaining() <= 0)):
                break
            n = level * _round_batches(level)
            prompts = []
            for _ in range(n):
                counter += 1
                prompts.append([{"role": "user", "content": f"[{nonce:x}-{counter}] List {counter % 7 + 3} colours."}])
            metrics_before = scrape(p) if engine else {}
            with _Sampler(p, engine) as sampler, ThreadPoolExecutor(max_workers=level) as pool:
                sampler.observe(metrics_before)
                start = time.perf_counter()
                deadline = budget.timeout()
                timings = list(pool.map(lambda m: p.stream_chat(
                    o.model, m, max_tokens, {"ignore_eos": True},
                    timeout_s=max(deadline - (time.perf_counter() - start), 0.5)), prompts))
                wall = time.perf_counter() - start
            metrics_after = scrape(p) if engine else {}
            sampler.observe(metrics_after)
            run = runs.setdefault(level, {"level": level, "timings": [], "round_walls": [], "max_kv": None,
                                          "max_waiting": None, "preemptions": None, "scrapes": 0})
            run["scrapes"] += sampler.scrapes
            run["timings"] += timings
            run["round_walls"].append(wall)
            for key, value in (("max_kv", sampler.max_kv), ("max_waiting", sampler.max_waiting)):
                if value is not None:
                    run[key] = max(run[key] or 0.0, value)
            if preempt and preempt in metrics_after:
                run["preemptions"] = ((run["preemptions"] or 0.0)
                                      + metrics_after[preempt] - metrics_before.get(preempt, 0.0))
    rows = [_level_row(runs[level], engine) for level in sorted(runs)]
    for row in rows:
        o.progress(f"concurrency {row['concurrency']}: TTFT p50 {row['ttft_p50_s'] or 0:.3f} s, "
                   f"{row['throughput_tok_s']:.1f} tok/s")
    data = {"engine_metrics": engine, "levels": rows, "rounds": ROUNDS}
    return _concurrency_finding(rows, engine), data


def _level_row(run: dict, engine: str | None) -> dict:
    timings, wall = run["timings"], sum(run["round_walls"])
    ok = [t for t in timings if t.ok and t.ttft_s is not None]
    itls = [b - a for t in ok for a, b in zip(t.chunk_ts, t.chunk_ts[1:])]
    queue = [t.usage["brisk"].get("queue_ms") for t in ok if t.usage and isinstance(t.usage.get("brisk"), dict)]
    return {"concurrency": run["level"], "requests": len(timings), "ok": len(ok), "wall_s": wall,
            "rounds": len(run["round_walls"]),
            "errors": sorted({_failed_probe(t, "request") for t in timings if not t.ok})[:3],
            "ttft_p50_s": _median([t.ttft_s for t in ok]), "ttft_spread_s": spread([t.ttft_s for t in ok]),
            "ttft_p90_s": float(np.percentile([t.ttft_s for t in ok], 90)) if ok else None,
            "itl_p50_s": _median(itls), "itl_p90_s": float(np.percentile(itls, 90)) if itls else None,
            "throughput_tok_s": sum(t.completion_tokens or 0 for t in ok) / wall,
            "queue_ms_p50": _median(queue), "max_kv_usage": run["max_kv"] if engine else None,
            "max_waiting": run["max_waiting"] if engine else None,
            "preemptions": run["preemptions"],  # None: not exported
            "metrics_scrapes": run["scrapes"]}


POOR_EFFICIENCY = 0.35  # throughput per stream below this share of one stream's: saturated
SERIAL_SCALING = 1.1  # 4+ streams giving less than this times one stream's throughput: not rising
COMPUTE_BOUND_EFFICIENCY = 0.75  # throughput per added stream below this, with KV to spare: compute-bound


def _concurrency_finding(rows: list[dict], engine: str | None) -> Finding:
    base, top = rows[0], rows[-1]
    missing, problems, warnings, fixes = [], [], [], []
    for r in rows:
        missing += [f"concurrency {r['concurrency']}: {e}" for e in r["errors"]]
    failed = [(r["concurrency"], r["requests"] - r["ok"]) for r in rows if r["errors"] or r["ok"] < r["requests"]]
    if failed:  # a ramp with requests missing measures the failures, not the server's scaling
        where = ", ".join(f"{n} at concurrency {level}" for level, n in failed)
        return Finding("kv_batching", UNKNOWN, f"not judged: probe requests failed or timed out ({where})",
                       {"levels": [r["concurrency"] for r in rows]}, [], missing)
    if base["ttft_p50_s"] is None or top["ttft_p50_s"] is None:
        return Finding("kv_batching", UNKNOWN, "requests failed during the ramp", {"levels": rows}, [],
                       missing or ["latency under concurrency"])
    if len(rows) < 2:
        return Finding("kv_batching", UNKNOWN, "only one concurrency level fitted the time budget",
                       {"levels": rows}, [], missing + ["latency under concurrency (one level only)"])

    def degraded(r: dict) -> bool:
        """Slower per stream than one stream alone, beyond every base sample: TTFT over twice the
        base median (+50 ms), or ITL over 1.5× (+5 ms)."""
        ttft = r["ttft_p50_s"] > 2 * base["ttft_p50_s"] + 0.05 and r["ttft_p50_s"] > base["ttft_spread_s"]["max"]
        itl = (r["itl_p50_s"] is not None and base["itl_p50_s"] is not None
               and r["itl_p50_s"] > 1.5 * base["itl_p50_s"] + 0.005 and r["itl_p50_s"] > (base["itl_p90_s"] or 0))
        return ttft or itl

    def efficiency_of(r: dict) -> float:
        """Throughput gained per stream added: 1.0 = linear scaling, 1/level = none at all."""
        gain = r["throughput_tok_s"] / base["throughput_tok_s"] if base["throughput_tok_s"] else 0.0
        return gain / (r["concurrency"] / base["concurrency"])

    # The knee: the first level where throughput per stream has fallen below POOR_EFFICIENCY of one
    # stream's while latency is worse. The thresholds sit far from where batching servers land
    # (brisk: 0.55-0.7 at 4 streams on 2 cores) and from where saturated ones do (llama.cpp with
    # 4 slots on 2 threads: 0.3-0.35), so one run and the next give the same verdict.
    knee = next((r["concurrency"] for r in rows[1:] if r["ttft_p50_s"] is not None and degraded(r)
                 and efficiency_of(r) < POOR_EFFICIENCY), None)
    scaling = top["throughput_tok_s"] / base["throughput_tok_s"] if base["throughput_tok_s"] else 0.0
    efficiency = scaling / (top["concurrency"] / base["concurrency"])
    evidence = {"levels": [r["concurrency"] for r in rows], "ttft_p50_s": [r["ttft_p50_s"] for r in rows],
                "ttft_spread_s": [r["ttft_spread_s"] for r in rows],
                "itl_p50_s": [r["itl_p50_s"] for r in rows], "throughput_tok_s": [r["throughput_tok_s"] for r in rows],
                "throughput_scaling": scaling, "scaling_efficiency": efficiency, "knee_concurrency": knee,
                "engine_metrics": engine}
    counted = [r["preemptions"] for r in rows if r.get("preemptions") is not None]
    preemptions = sum(counted) if counted else None  # None: the server does not count them
    gauges = [r["max_kv_usage"] for r in rows if r.get("max_kv_usage") is not None]
    max_kv = max(gauges) if gauges else None
    kv_pressure = (preemptions or 0) > 0 or (max_kv or 0) > 0.9
    # "compute-bound" needs the evidence: KV usage low (exported) and no preemptions counted
    kv_idle = max_kv is not None and max_kv < 0.5 and not preemptions
    # one at a time: more streams add no throughput, each request waits for the ones before it
    # (TTFT grows) and then runs at one stream's pace (ITL does not grow). Parallel slots on a
    # saturated processor also add no throughput, but there every stream slows (ITL grows).
    itl_flat = (top["itl_p50_s"] is None or base["itl_p50_s"] is None
                or top["itl_p50_s"] <= 1.5 * base["itl_p50_s"] + 0.005)
    if (top["concurrency"] >= 4 and scaling < SERIAL_SCALING and top["ttft_p50_s"] > 3 * base["ttft_p50_s"] + 0.05
            and itl_flat):
        problems.append(f"requests are served one at a time: {top['concurrency']} parallel streams give "
                        f"{scaling:.1f}× the throughput of one, and TTFT grows from {base['ttft_p50_s']:.2f} s to "
                        f"{top['ttft_p50_s']:.2f} s (queueing)")
        fixes += ["enable continuous batching / parallel slots (vLLM --max-num-seqs, llama.cpp -np, "
                  "brisk --max-num-seqs)", "scale out replicas behind a load balancer"]
    elif kv_pressure:
        warnings.append("KV cache pressure: " + ", ".join(
            x for x in (f"usage up to {max_kv:.0%}" if max_kv is not None else "",
                        f"{preemptions:.0f} preemptions" if preemptions is not None else "") if x))
        fixes += ["give the KV cache more memory (brisk --kv-cache-memory, vLLM --gpu-memory-utilization)",
                  "store the KV cache in fewer bytes per element: brisk --kv-cache-dtype int8 or fp8 (1 byte; "
                  "brisk:kv_cache_dtype says what it uses now), vLLM --kv-cache-dtype fp8, llama.cpp -ctk q8_0 "
                  "-ctv q8_0 (-fa on)",
                  "lower --max-num-seqs so admitted requests are not preempted",
                  "enable prefix caching for shared system prompts",
                  "brisk --kv-cache-host-bytes SIZE: prefixes the pool evicts under pressure stay in host memory and "
                  "come back as a copy instead of a prefill (vLLM: --kv-offloading-size)"]
    elif knee is not None:
        cause = ""
        if kv_idle and efficiency < COMPUTE_BOUND_EFFICIENCY:
            cause = (f"compute-bound: KV usage stayed at or below {max_kv:.1%}"
                     + (f" with {preemptions:.0f} preemptions" if preemptions is not None else "")
                     + ", so the processor, not KV memory, limits; ")
        warnings.append(f"{cause}latency degrades from {knee} concurrent streams (TTFT p50 "
                        f"{base['ttft_p50_s']:.2f} → {top['ttft_p50_s']:.2f} s, ITL p50 "
                        f"{(base['itl_p50_s'] or 0) * 1e3:.0f} → {(top['itl_p50_s'] or 0) * 1e3:.0f} ms, throughput "
                        f"×{scaling:.1f} for ×{top['concurrency'] // base['concurrency']} streams)")
        fixes.append("add compute (replicas, a faster device, a smaller or quantized model)" if cause else
                     "keep concurrency below the knee, or add capacity (KV memory, replicas)")
    if engine is None:
        missing.append("server-side KV usage and queue depth (no brisk/vLLM/SGLang/llama.cpp /metrics)")
    else:
        waiting = [r["max_waiting"] for r in rows if r.get("max_waiting") is not None]
        evidence.update(max_kv_usage=max_kv, preemptions=preemptions, max_waiting=max(waiting) if waiting else None)
        if max_kv is None and not any(r.get("metrics_scrapes") for r in rows):
            missing.append(f"KV cache usage (not sampled: {engine}'s /metrics did not answer while the levels ran)")
        elif max_kv is None:
            missing.append(f"KV cache usage ({engine}'s /metrics has no KV usage gauge)")
        if preemptions is None:
            missing.append(f"preemptions ({engine}'s /metrics does not count them)")
    queue = top.get("queue_ms_p50")
    if queue is not None and top["ttft_p50_s"]:
        evidence["queue_share_of_ttft"] = queue / 1e3 / top["ttft_p50_s"]
    if not problems and not warnings and scaling < SERIAL_SCALING:
        warnings.append(f"throughput does not rise with streams: ×{scaling:.1f} for ×{top['concurrency'] // base['concurrency']}"
                        f" streams (TTFT p50 {base['ttft_p50_s']:.2f} → {top['ttft_p50_s']:.2f} s, ITL p50 "
                        f"{(base['itl_p50_s'] or 0) * 1e3:.0f} → {(top['itl_p50_s'] or 0) * 1e3:.0f} ms)")
        fixes.append("keep concurrency low, or add capacity (replicas, a faster device, a smaller or quantized model)")
    status = PROBLEM if problems else WARNING if warnings else OK
    bound = ""
    if kv_idle and not kv_pressure and efficiency < COMPUTE_BOUND_EFFICIENCY:
        bound = (f"; compute-bound (KV usage ≤ {max_kv:.1%}"
                 + (f", {preemptions:.0f} preemptions" if preemptions is not None else "") + ")")
    summary = "; ".join(problems + warnings) or (
        f"scales to {top['concurrency']} streams: throughput ×{scaling:.1f}, TTFT p50 {base['ttft_p50_s']:.2f} → "
        f"{top['ttft_p50_s']:.2f} s" + bound)
    return Finding("kv_batching", status, summary, evidence, list(dict.fromkeys(fixes)), missing)
