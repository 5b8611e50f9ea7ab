"""/metrics after a scripted workload (exact counts), OpenTelemetry spans, and the docs and
dashboard staying in step with what the server exports."""

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from brisk.config import CacheConfig
from brisk.engine.async_engine import AsyncLLMEngine
from brisk.engine.engine import LLMEngine
from brisk.engine.scheduler import SchedulerConfig
from brisk.engine.spec_decode.config import SpeculativeConfig
from brisk.metrics.tracing import RequestTracer
from brisk.server.state import ServerConfig, ServerState

from live_server import LiveServer, serve_engine
from engines import make_engine

REPO = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "Write a poem about the sea."}]


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} for every brisk sample."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(snapshot: dict, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def workload(demo):
    """A tiny KV pool (preemptions), then a scripted mix of requests; returns the scrapes."""
    engine = LLMEngine(demo, CacheConfig(block_size=16, num_gpu_blocks_override=12),
                       SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=160),
                       speculative=SpeculativeConfig(disable_by_batch_size=8))  # its metrics too
    with serve_engine(engine) as live:
        with live.client() as http:
            before = http.get("/metrics").text

        async def scripted():
            async with httpx.AsyncClient(base_url=live.url, timeout=120) as http:
                chat = {"messages": CHAT, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
                rs = await asyncio.gather(*[http.post("/v1/chat/completions", json=chat) for _ in range(4)])
                rs.append(await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5,
                                                                   "ignore_eos": True}))
                rs.append(await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1000}))
                rs.append(await http.post("/v1/chat/completions", json={"messages": CHAT, "temperature": 9}))
                return rs

        responses = asyncio.run(scripted())
        stats = live.wait_idle()
        with live.client() as http:
            first, second = http.get("/metrics").text, http.get("/metrics").text
    return demo, responses, stats, samples(before), samples(first), samples(second)


def test_request_and_token_counts_are_exact(workload):
    demo, responses, stats, before, after, _ = workload
    assert [r.status_code for r in responses] == [200] * 5 + [400, 400]
    assert value(after, "brisk:request_success_total", finish_reason="length") == 5
    assert value(after, "brisk:generation_tokens_total") == 4 * 40 + 5
    prompt = len(demo.tokenizer.encode_chat(CHAT)) * 4 + len(demo.tokenizer.encode("Hello"))
    assert value(after, "brisk:prompt_tokens_total") == prompt
    assert value(after, "brisk:http_responses_total", route="/v1/chat/completions", status="200") == 4
    assert value(after, "brisk:http_responses_total", route="/v1/chat/completions", status="400") == 2
    assert value(after, "brisk:http_responses_total", route="/v1/completions", status="200") == 1


def test_context_guard_and_preemptions_are_counted(workload):
    _, _, stats, before, after, _ = workload
    assert value(after, "brisk:context_guard_total", outcome="ok") == 5
    assert value(after, "brisk:context_guard_total", outcome="rejected") == 1
    assert stats.num_preemptions >= 1  # the tiny pool forced some
    assert value(after, "brisk:num_preemptions_total") == stats.num_preemptions
    assert value(after, "brisk:kv_num_blocks") == 12 and value(after, "brisk:kv_blocks_used") == 0
    assert value(after, "brisk:num_requests_running") == 0 and value(after, "brisk:num_requests_waiting") == 0


def test_histogram_counts_equal_request_counts(workload):
    _, _, _, _, after, _ = workload
    for name in ("brisk:time_to_first_token_seconds", "brisk:e2e_request_latency_seconds",
                 "brisk:request_queue_time_seconds", "brisk:request_prefill_time_seconds",
                 "brisk:request_decode_time_seconds"):
        assert value(after, f"{name}_count") == 5, name
        assert value(after, f"{name}_bucket", le="+Inf") == 5
    assert value(after, "brisk:inter_token_latency_seconds_count") == 4 * 39 + 4


def test_speculative_decoding_is_counted(workload):
    _, _, stats, _, after, _ = workload
    assert stats.spec_draft_tokens > 0  # the scripted chats drafted (the poem repeats the prompt's words)
    assert value(after, "brisk:spec_decode_draft_tokens_total") == stats.spec_draft_tokens
    assert value(after, "brisk:spec_decode_accepted_tokens_total") == stats.spec_accepted_tokens
    assert value(after, "brisk:spec_decode_acceptance_length_count") == sum(stats.spec_acceptance_lengths)
    assert value(after, "brisk:spec_decode_acceptance_length_sum") == stats.spec_accepted_tokens
    assert value(after, "brisk:spec_decode_acceptance_length_bucket", le="0.0") == stats.spec_acceptance_lengths[0]


def test_a_scrape_resets_nothing(workload):
    _, _, _, _, first, second = workload
    counters = {k: v for k, v in first.items() if k[0].endswith(("_total", "_count", "_sum", "_bucket"))
                and ("route", "/metrics") not in k[1]  # the scrape itself is counted
                and not k[0].startswith("brisk:event_loop_lag_seconds")}  # sampled 20 times a second
    assert counters and all(second[k] == v for k, v in counters.items())
    assert all(second[k] >= v for k, v in first.items() if k[0].startswith("brisk:event_loop_lag_seconds_count"))


def test_every_exported_metric_is_documented_and_vice_versa(workload):
    _, _, _, _, after, _ = workload
    exported = {re.sub(r"(_total|_count|_sum|_bucket|_created)$", "", name) for name, _ in after
                if name.startswith("brisk:")}
    doc = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(brisk:[a-z0-9_:]+)`", doc))
    assert exported - documented == set(), "exported but not documented"
    assert documented - exported == set(), "documented but not exported"


def test_dashboard_queries_only_exported_metrics(workload):
    _, _, _, _, after, _ = workload
    names = {name for name, _ in after}
    dashboard = json.loads((REPO / "deploy" / "grafana" / "brisk.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    used = {m for e in exprs for m in re.findall(r"brisk:[a-z0-9_:]+", e)}
    missing = {m for m in used if m not in names}
    assert not missing, f"dashboard queries metrics the server does not export: {missing}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("ttft", "inter-token", "throughput", "queue", "kv", "fragmentation", "prefix", "preemption",
                  "context guard", "load"):
        assert topic in titles, topic


# -- tracing ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced(demo):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    state = ServerState(ServerConfig(), engine=AsyncLLMEngine(make_engine(demo)), tracer=RequestTracer(provider))
    with LiveServer(state) as live:
        yield live, exporter


def test_span_tree_and_attributes(traced):
    live, exporter = traced
    exporter.clear()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with live.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "n": 2},
                      headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert r.status_code == 200
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert len(roots) == 1
    root = roots[0]
    assert format(root.context.trace_id, "032x") == trace_id  # joined the client's trace
    assert root.attributes["brisk.context_guard.outcome"] == "ok"
    assert root.attributes["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert root.attributes["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    assert sorted(s.name for s in children) == ["decode", "decode", "prefill", "prefill", "queue", "queue"]
    for s in children:
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time
    prefill = next(s for s in children if s.name == "prefill")
    assert prefill.attributes["brisk.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    decode = [s for s in children if s.name == "decode"]
    assert sum(s.attributes["brisk.output_tokens"] for s in decode) == r.json()["usage"]["completion_tokens"]


def test_guard_outcome_is_a_span_attribute(demo):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    from brisk.server.context_guard import ContextPolicy

    engine = LLMEngine(demo, CacheConfig(block_size=16, num_gpu_blocks_override=64),
                       SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=64))
    state = ServerState(ServerConfig(context_policy=ContextPolicy.CLAMP_MAX_TOKENS),
                        engine=AsyncLLMEngine(engine), tracer=RequestTracer(provider))
    with LiveServer(state) as live, live.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 500})
    assert r.status_code == 200
    root = next(s for s in exporter.get_finished_spans() if s.name.startswith("POST"))
    assert root.attributes["brisk.context_guard.outcome"] == "clamped"
    assert root.attributes["brisk.context_guard.max_tokens_clamped_to"] == r.json()["brisk"]["max_tokens_clamped_to"]



def test_engine_stats_of_several_replicas_combine_into_one_pool():
    """The periodic stats line behind Ray Serve: counts add up; KV usage and fragmentation are the
    whole pool's (weighted by blocks), not an average of the replicas' ratios."""
    from brisk.engine.stats import EngineStats

    a = EngineStats(num_running=2, num_waiting=1, kv_blocks_total=100, kv_blocks_used=90, kv_blocks_cached_free=5,
                    kv_blocks_free=10, kv_usage=0.9, kv_internal_fragmentation=0.1, prefix_cache_queries_tokens=50,
                    prefix_cache_hits_tokens=20, num_preemptions=1, num_steps=7, prompt_tokens=30,
                    generation_tokens=40, spec_draft_tokens=8, spec_accepted_tokens=4, spec_acceptance_lengths=(1, 2, 1))
    b = EngineStats(num_running=1, num_waiting=0, kv_blocks_total=300, kv_blocks_used=10, kv_blocks_cached_free=0,
                    kv_blocks_free=290, kv_usage=10 / 300, kv_internal_fragmentation=0.5,
                    prefix_cache_queries_tokens=10, prefix_cache_hits_tokens=0, num_preemptions=0, num_steps=3,
                    prompt_tokens=5, generation_tokens=6)
    both = EngineStats.combine([a, b])
    assert (both.num_running, both.num_waiting, both.kv_blocks_total, both.kv_blocks_used) == (3, 1, 400, 100)
    assert (both.prefix_cache_hits_tokens, both.num_steps, both.generation_tokens) == (20, 10, 46)
    assert both.kv_usage == 100 / 400
    assert both.kv_internal_fragmentation == (0.1 * 90 + 0.5 * 10) / 100
    assert (both.spec_draft_tokens, both.spec_acceptance_lengths) == (8, (1, 2, 1))
    assert EngineStats.combine([]).kv_blocks_total == 0


def test_a_blocked_event_loop_shows_in_delivery_and_lag_histograms(demo):
    """Tokens the engine produced while the server's event loop was blocked reach the socket late, and
    the histograms say by how much: brisk:token_delivery_seconds measures from the end of the engine
    step (not from when the loop got round to it), and brisk:event_loop_lag_seconds sees the stall."""
    block_s = 0.4
    with serve_engine(make_engine(demo)) as live:
        body = {"messages": CHAT, "max_tokens": 80, "ignore_eos": True, "temperature": 0, "stream": True}
        chunks = 0
        with live.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 2:  # streaming has begun: stall the loop while the engine keeps stepping
                        live.state.loop.call_soon_threadsafe(time.sleep, block_s)
        with live.client() as http:
            after = samples(http.get("/metrics").text)
    slow = 0.2  # a bucket bound below the stall
    for stage in ("dequeued", "written"):
        total = value(after, "brisk:token_delivery_seconds_count", stage=stage)
        assert total >= 40, stage  # one observation per engine output of the stream
        late = total - value(after, "brisk:token_delivery_seconds_bucket", stage=stage, le=str(slow))
        assert late >= 1, f"{stage}: no output was delivered later than {slow} s despite a {block_s} s stall"
        assert value(after, "brisk:token_delivery_seconds_sum", stage=stage) >= block_s / 2
    lag_total = value(after, "brisk:event_loop_lag_seconds_count")
    assert lag_total >= 1
    assert lag_total - value(after, "brisk:event_loop_lag_seconds_bucket", le=str(slow)) >= 1
