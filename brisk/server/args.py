"""`brisk serve`'s own flags: the model (with the engine's flags from brisk.engine.factory), the
HTTP server, security limits and logging. The scale-out flags join them in brisk.cluster.settings.
Each range is checked as it is parsed (brisk.argtypes): one line naming the flag."""

from __future__ import annotations

import argparse

from brisk import argtypes
from brisk.engine.factory import add_engine_args, add_model_args


def add_serve_arguments(p) -> None:
    _model_arguments(p.add_argument_group("model"))
    add_engine_args(p.add_argument_group("KV cache and scheduler"))
    _http_arguments(p.add_argument_group("HTTP server"))
    _limit_arguments(p.add_argument_group("security and limits"))
    _log_arguments(p.add_argument_group("logging and observability"))


def _model_arguments(model) -> None:
    model.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                       help="model directory, .gguf file, or catalog name (default: smollm2-135m-instruct)")
    add_model_args(model)
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model id(s) clients send; responses carry the first (default: from MODEL)")
    model.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template, as a file or inline, instead of the model's own; "
                            "`chatml_tools` names the ChatML template with tool calling that brisk ships")
    model.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3", "gpt-oss"],
                       help="put a reasoning model's <think>...</think> into the reply's reasoning_content "
                            "(Qwen3: qwen3; DeepSeek-R1 and its distills: deepseek_r1); gpt-oss: its harmony "
                            "channels into reasoning, content and tool calls (gpt-oss models get it by default)")
    model.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "json", "mistral"],
                       help="how tool calls are written: auto (from the chat template, default), hermes "
                            "(<tool_call>, Qwen/Hermes), json (Llama 3.x), mistral ([TOOL_CALLS])")


def _http_arguments(http) -> None:
    http.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    http.add_argument("--port", type=argtypes.port, default=8000, help="TCP port, 1-65535 (default 8000)")
    http.add_argument("--context-policy", default="reject", choices=["reject", "truncate-oldest", "clamp-max-tokens"],
                      help="when prompt + max_tokens exceeds the window: reject with 400 (default), drop the "
                           "oldest chat messages, or lower max_tokens; always reported to the client")
    http.add_argument("--max-queued-requests", type=argtypes.non_negative, default=256,
                      help="requests allowed to wait beyond --max-num-seqs; more get 429 (default 256)")
    http.add_argument("--request-timeout", type=argtypes.number(above=0), default=None,
                      help="seconds before a request is ended")
    http.add_argument("--shutdown-timeout", type=argtypes.number(minimum=0), default=30.0,
                      help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    http.add_argument("--seed", type=argtypes.integer(0, 2**64 - 1), default=None, help="seed of the sampler for unseeded requests")
    http.add_argument("--webui", action=argparse.BooleanOptionalAction, default=True,
                      help="GET / serves a page to chat with the model and watch the engine (KV blocks, queue, "
                           "timings); --no-webui turns it off (default on; behind the API key when one is set)")
    http.add_argument("--allow-priority", action="store_true",
                      help="honour the request field `priority` (lower first); off by default, since any "
                           "client could then jump the queue")


def _limit_arguments(limits) -> None:
    limits.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every route but /health and /ready; prefer "
                             "the environment variable BRISK_API_KEY (a flag is visible to every user in `ps`)")
    limits.add_argument("--metrics-public", action="store_true",
                        help="serve /metrics without the API key (for a Prometheus scraper that has none)")
    limits.add_argument("--max-request-bytes", type=argtypes.positive, default=16 * 2**20,
                        help="request body limit (default 16 MiB)")
    limits.add_argument("--max-prompt-chars", type=argtypes.positive, default=1_000_000,
                        help="characters of text one request may send to the tokenizer (default 1,000,000); "
                             "more: 413")
    limits.add_argument("--max-token-ids", type=argtypes.positive, default=262_144,
                        help="token ids one request may send (/detokenize, token-id prompts; default 262,144); "
                             "more: 413")
    limits.add_argument("--max-messages", type=argtypes.positive, default=10_000,
                        help="chat messages one request may send (default 10,000; each costs template work "
                             "beyond its characters); more: 413")
    limits.add_argument("--tokenizer-threads", type=argtypes.positive, default=2,
                        help="requests tokenized at once, off the event loop (default 2); the others wait")
    limits.add_argument("--header-timeout", type=argtypes.number(above=0), default=15.0,
                        help="seconds a connection has to send a complete request head (default 15)")
    limits.add_argument("--body-timeout", type=argtypes.number(above=0), default=30.0,
                        help="seconds a request body has to arrive once its head has (default 30)")
    limits.add_argument("--timeout-keep-alive", type=argtypes.number(above=0), default=75.0,
                        help="seconds an idle keep-alive connection stays open (default 75: past the idle "
                             "expiry of common client pools, httpx/openai 5 s and aiohttp 15 s, so they drop an "
                             "idle connection before the server closes it)")
    limits.add_argument("--max-connections", type=argtypes.positive, default=1000,
                        help="open connections at most (default 1000); past it the oldest connection idle between "
                             "requests is closed to make room, or, with none idle, the new one gets 503")


def _log_arguments(logs) -> None:
    logs.add_argument("--uvicorn-log-level", default="warning",
                      choices=["critical", "error", "warning", "info", "debug", "trace"],
                      help="uvicorn's own log level (default warning)")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="no access-log line per request (vLLM's flag)")
    logs.add_argument("--log-prompts", action="store_true",
                      help="put each request's prompt text in its access-log line (off: lengths only)")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="no periodic engine stats line (throughput, running/waiting, KV usage)")
    logs.add_argument("--log-stats-interval", type=argtypes.number(above=0), default=10.0,
                      help="seconds between engine stats lines while busy (default 10)")
    logs.add_argument("--request-log", default=None,
                      help="append one JSON line per finished request (a trace: lengths, timings) to this file; "
                           "brisk kv-plan --trace and brisk bench --workload replay read it")
    logs.add_argument("--otlp-endpoint", default=None,
                      help="export OpenTelemetry spans per request (OTLP/HTTP), e.g. http://127.0.0.1:4318")
