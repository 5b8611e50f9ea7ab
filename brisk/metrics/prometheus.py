"""Prometheus metrics for the server — the only module that imports prometheus_client.

Every name starts with `brisk:` (documented in docs/metrics.md). Counters only grow;
engine gauges come from one `EngineStats` snapshot taken on the engine thread just before
each scrape, so a scrape never races a step and never resets anything.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from brisk.engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                    3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# the event loop's own delays: sub-millisecond when it keeps up, the step time when it does not
_LOOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_PHASE_HISTOGRAMS = {  # RequestOutput.metrics key -> (metric name, help)
    "ttft_ms": ("brisk:time_to_first_token_seconds", "Arrival to first generated token."),
    "queue_ms": ("brisk:request_queue_time_seconds", "Arrival to first scheduled (waiting in the queue)."),
    "prefill_ms": ("brisk:request_prefill_time_seconds", "First scheduled to first token (prompt processing)."),
    "decode_ms": ("brisk:request_decode_time_seconds", "First token to finish."),
    "e2e_ms": ("brisk:e2e_request_latency_seconds", "Arrival to finish."),
}


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("brisk:request_success", "Finished requests by finish_reason.",
                                ["finish_reason"], registry=r)
        self.http_responses = Counter("brisk:http_responses", "HTTP responses by route and status code.",
                                      ["route", "status"], registry=r)
        self.context_guard = Counter("brisk:context_guard", "Context-guard outcomes per request.",
                                     ["outcome"], registry=r)
        self.aborts = Counter("brisk:request_aborts", "Requests ended early, by cause.", ["cause"], registry=r)
        self.request_errors = Counter("brisk:request_errors", "Requests ended by a failure of their own (the "
                                      "others went on), by reason: internal_error, grammar_rejected, grammar_unsatisfiable.",
                                      ["reason"], registry=r)
        self.prompt_tokens = Counter("brisk:prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("brisk:generation_tokens", "Generated tokens.", registry=r)
        self.phases = {key: Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r)
                       for key, (name, doc) in _PHASE_HISTOGRAMS.items()}
        self.itl = Histogram("brisk:inter_token_latency_seconds", "Gap between consecutive tokens of a request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.loop_lag = Histogram("brisk:event_loop_lag_seconds",
                                  "How late the server's event loop woke for a timer (a busy or starved loop "
                                  "delays every stream).", buckets=_LOOP_BUCKETS, registry=r)
        self.delivery = Histogram("brisk:token_delivery_seconds",
                                  "Engine step end to the step's output taken by its HTTP request on the event "
                                  "loop (stage=dequeued) and to its SSE chunk handed to the socket "
                                  "(stage=written); single-process serve only.", ["stage"],
                                  buckets=_LOOP_BUCKETS, registry=r)
        self.delivered = self.delivery.labels("dequeued")
        self.written = self.delivery.labels("written")
        self.load_phase = Histogram("brisk:model_load_phase_seconds", "Model load time by phase.", ["phase"],
                                    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
                                    registry=r)
        self.load_state = Gauge("brisk:model_load_state", "1 for the current load state.", ["state"], registry=r)
        self.load_seconds = Gauge("brisk:model_load_duration_seconds", "Total model load time.", registry=r)
        self.build_info = Gauge("brisk:build_info", "Version, model, dtype and device (value 1).",
                                ["version", "model", "dtype", "device"], registry=r)
        # Known label values start at 0, so rate() and absent-series alerts work from the first scrape.
        for reason in ("stop", "length"):
            self.requests.labels(reason)
        for outcome in ("ok", "truncated", "clamped", "rejected"):
            self.context_guard.labels(outcome)
        for cause in ("client_disconnect", "timeout", "shutdown", "engine_error", "replica_lost", "error",
                      "request_error"):
            self.aborts.labels(cause)
        for reason in ("internal_error", "grammar_rejected", "grammar_unsatisfiable"):
            self.request_errors.labels(reason)
        self._engine = _EngineCollector()
        r.register(self._engine)
        self.set_load_state("loading")

    def set_load_state(self, state: str) -> None:
        for s in ("loading", "ready", "failed"):
            self.load_state.labels(s).set(1.0 if s == state else 0.0)

    def observe_load(self, phases_ms: dict[str, float], total_ms: float) -> None:
        for phase, ms in phases_ms.items():
            self.load_phase.labels(phase).observe(ms / 1e3)
        self.load_seconds.set(total_ms / 1e3)

    def observe_finished(self, finish_reason: str | None, metrics: dict[str, Any]) -> None:
        """One finished engine request (one choice), from the engine's own timestamps."""
        self.requests.labels(finish_reason or "abort").inc()
        for key, histogram in self.phases.items():
            value = metrics.get(key)
            if value is not None:
                histogram.observe(value / 1e3)
        for gap_ms in metrics.get("itl_ms") or ():
            self.itl.observe(gap_ms / 1e3)

    def render(self, stats: EngineStats | dict[str, EngineStats] | None) -> bytes:
        self._engine.stats = stats
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine gauges and counters from the latest stats snapshot: one engine's (no labels), or
    several replicas' ({replica id: stats}, each series labelled `replica`) behind a Ray Serve ingress."""

    def __init__(self):
        self.stats: EngineStats | dict[str, EngineStats] | None = None

    def describe(self):
        return []

    def collect(self):
        if self.stats is None:
            return
        if isinstance(self.stats, EngineStats):
            label_names, rows = [], [([], self.stats)]
        else:
            label_names, rows = ["replica"], [([rid], s) for rid, s in sorted(self.stats.items())]
        if not rows:
            return

        def family(kind, name: str, doc: str, value_of):
            f = kind(name, doc, labels=label_names)
            for labels, s in rows:
                f.add_metric(labels, value_of(s))
            return f

        gauges = [
            ("brisk:num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
            ("brisk:num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).",
             lambda s: s.num_waiting),
            ("brisk:kv_num_blocks", "KV-cache blocks in the pool.", lambda s: s.kv_blocks_total),
            ("brisk:kv_blocks_used", "KV blocks held by requests.", lambda s: s.kv_blocks_used),
            ("brisk:kv_blocks_cached", "Free KV blocks still holding a reusable prefix.",
             lambda s: s.kv_blocks_cached_free),
            ("brisk:kv_usage_ratio", "Used / total KV blocks.", lambda s: s.kv_usage),
            ("brisk:kv_fragmentation_ratio", "Unfilled slots in used blocks / slots of used blocks.",
             lambda s: s.kv_internal_fragmentation),
            ("brisk:kv_cache_bytes", "Bytes of the KV pool (K and V, all layers).", lambda s: s.kv_cache_bytes),
            ("brisk:kv_cache_resident_bytes", "Bytes of the KV pool in memory now: blocks are mapped on first "
             "write, so this grows until every block has been used once (0 where the OS cannot say).",
             lambda s: s.kv_cache_resident_bytes),
            ("brisk:kv_disk_budget_bytes", "The KV disk tier's byte budget (--kv-cache-disk-bytes); 0: no disk tier "
             "(--kv-cache-dir not set).", lambda s: s.kv_disk_budget_bytes),
            ("brisk:kv_disk_bytes", "Bytes the KV disk tier's folder holds now.", lambda s: s.kv_disk_bytes),
            ("brisk:kv_host_budget_bytes", "The KV host tier's byte budget (--kv-cache-host-bytes); 0: no host tier.",
             lambda s: s.kv_host_budget_bytes),
            ("brisk:kv_host_bytes", "Bytes of evicted KV blocks the host tier holds now.", lambda s: s.kv_host_bytes),
        ]
        for name, doc, value_of in gauges:
            yield family(GaugeMetricFamily, name, doc, value_of)
        dtype = GaugeMetricFamily("brisk:kv_cache_dtype", "The KV cache's element type (value 1; label dtype: "
                                  "float32, bfloat16, float16, fp8_e4m3, fp8_e5m2, int8).",
                                  labels=[*label_names, "dtype"])
        for labels, s in rows:
            dtype.add_metric([*labels, s.kv_cache_dtype or "unknown"], 1)
        yield dtype
        counters = [
            ("brisk:num_preemptions", "Requests preempted (KV pool full), recomputed later.",
             lambda s: s.num_preemptions),
            ("brisk:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             lambda s: s.prefix_cache_queries_tokens),
            ("brisk:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             lambda s: s.prefix_cache_hits_tokens),
            ("brisk:engine_steps", "Engine steps run.", lambda s: s.num_steps),
            ("brisk:kv_disk_hits", "Prompt tokens whose KV blocks were read from the disk tier (--kv-cache-dir).",
             lambda s: s.kv_disk_hits_tokens),
            ("brisk:kv_disk_blocks_read", "KV blocks read from the disk tier.", lambda s: s.kv_disk_blocks_read),
            ("brisk:kv_disk_blocks_corrupt", "Disk-tier files refused (checksum, length) and removed: a miss.",
             lambda s: s.kv_disk_blocks_corrupt),
            ("brisk:kv_disk_blocks_written", "KV blocks written to the disk tier.", lambda s: s.kv_disk_blocks_written),
            ("brisk:kv_disk_loads", "Cached prefixes read from the disk tier (a waiting request's blocks, read off the "
             "engine's thread).", lambda s: s.kv_disk_loads),
            ("brisk:kv_disk_load_seconds", "Seconds the disk tier's reads took in all (divided by brisk:kv_disk_loads: "
             "the mean load latency).", lambda s: s.kv_disk_load_seconds),
            ("brisk:kv_disk_blocks_not_written", "KV blocks not written to the disk tier (its queue full, or the disk "
             "failed).", lambda s: s.kv_disk_blocks_not_written),
            ("brisk:kv_host_hits", "Prompt tokens whose KV blocks were taken back from the host tier "
             "(--kv-cache-host-bytes).", lambda s: s.kv_host_hits_tokens),
            ("brisk:kv_host_misses", "Prompt tokens (full blocks) past the pool's cached prefix that the host tier "
             "did not hold.", lambda s: s.kv_host_misses_tokens),
            ("brisk:kv_disk_misses", "Prompt tokens (full blocks) past the pool's and the host tier's cached prefix "
             "that the disk tier did not hold.", lambda s: s.kv_disk_misses_tokens),
            ("brisk:kv_host_blocks_read", "KV blocks taken back from the host tier into the pool.",
             lambda s: s.kv_host_blocks_read),
            ("brisk:kv_host_blocks_stored", "Cached KV blocks the pool evicted into the host tier.",
             lambda s: s.kv_host_blocks_stored),
            ("brisk:kv_host_blocks_evicted", "KV blocks the host tier dropped to stay within its budget.",
             lambda s: s.kv_host_blocks_evicted),
        ]
        for name, doc, value_of in counters:
            yield family(CounterMetricFamily, name, doc, value_of)
        rows = [(labels, s) for labels, s in rows if s.spec_acceptance_lengths]  # speculative decoding is on
        if not rows:
            return
        yield family(CounterMetricFamily, "brisk:spec_decode_draft_tokens", "Tokens drafted for verification.",
                     lambda s: s.spec_draft_tokens)
        yield family(CounterMetricFamily, "brisk:spec_decode_accepted_tokens", "Drafted tokens the target accepted.",
                     lambda s: s.spec_accepted_tokens)
        histogram = HistogramMetricFamily("brisk:spec_decode_acceptance_length",
                                          "Drafted tokens accepted per verification (0..k).", labels=label_names)
        for labels, s in rows:
            cumulative, buckets = 0, []
            for length, count in enumerate(s.spec_acceptance_lengths):
                cumulative += count
                buckets.append((str(float(length)), cumulative))
            buckets.append(("+Inf", cumulative))
            histogram.add_metric(labels, buckets, s.spec_accepted_tokens)
        yield histogram
