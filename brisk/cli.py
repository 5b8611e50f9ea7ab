"""`brisk` command line. Heavy imports (torch) happen inside the subcommands, so
`brisk --help` is instant and the import time is reported as a load phase."""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from brisk import __version__
from brisk.config import DEFAULT_BLOCK_SIZE, QUANTIZATION_CHOICES
from brisk.errors import BriskError

EXIT_USER_ERROR = 2


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="Hugging Face model directory, .gguf file, or catalog name (default: smollm2-135m-instruct)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    p.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATION_CHOICES,
                   help="weight format: auto (a GGUF keeps its quantized types, e.g. Q4_0 as int4; float "
                        "checkpoints stay float), none (dequantize to --dtype), int8 or int4 (every weight "
                        "matrix quantized in blocks of 32 at load)")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--verbose", "-v", action="store_true", help="print the load report; tracebacks on errors")


def _add_engine_args(p) -> None:
    memory = p.add_mutually_exclusive_group()
    memory.add_argument("--kv-cache-memory", default=None,
                        help="KV cache size, e.g. 2GiB (default: 20%% of the memory available after the weights)")
    memory.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                        help="vLLM's flag: the KV cache takes this fraction of the device's free memory once the "
                             "weights are loaded (on CPU: of available RAM), in (0, 0.95]")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="auto: the model's dtype (the only one brisk stores; fp8 is refused)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    from brisk.engine.scheduler import SchedulerConfig  # torch-free: the defaults live with the scheduler

    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help=f"sequences batched per step (default {SchedulerConfig.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                   help=f"token budget per step (default {SchedulerConfig.max_num_batched_tokens})")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV blocks of a common prompt prefix (default on)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="the same as --no-enable-prefix-caching")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="a request's greedy output depends on the request only: not on what it is batched with "
                        "nor on the prefix cache (prompt tokens attend row by row through the compiled kernel, "
                        "in tiles). Default: on wherever that kernel runs (CPU, float32/bfloat16 KV); "
                        "--batch-invariant makes it an error where it cannot; --no-batch-invariant: prompt "
                        "chunks take SDPA (vLLM's VLLM_BATCH_INVARIANT, SGLang's "
                        "--enable-deterministic-inference)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's flag: speculative decoding, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}' "
                        "(off by default; see docs/speculative.md)")


def engine_configs(args: argparse.Namespace, max_model_len: int):
    """The engine's cache and scheduler configs from serve/generate flags (torch-free: kv-plan
    validates the flags it recommends with this)."""
    from brisk.config import CacheConfig, parse_memory
    from brisk.engine.scheduler import SchedulerConfig

    if args.kv_cache_dtype != "auto":
        raise BriskError(f"--kv-cache-dtype {args.kv_cache_dtype}: brisk stores the KV cache in the model's dtype "
                         "only (fp8 KV is not implemented); use --kv-cache-dtype auto")
    try:
        memory = parse_memory(args.kv_cache_memory) if args.kv_cache_memory else None
        fraction = {} if args.gpu_memory_utilization is None else {"kv_cache_fraction": args.gpu_memory_utilization}
        cache = CacheConfig(block_size=args.block_size, kv_cache_memory=memory,
                            enable_prefix_caching=args.enable_prefix_caching, **fraction)
        sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=max_model_len)
    except ValueError as e:
        message = str(e)
        if "kv_cache_fraction" in message:  # name the flag the user gave
            message = f"--gpu-memory-utilization must be in (0, 0.95], got {args.gpu_memory_utilization}"
        raise BriskError(message) from None
    return cache, sched


def speculative_config(args: argparse.Namespace):
    """--speculative-config parsed and checked (torch-free, so `serve` refuses a bad one at start)."""
    from brisk.engine.spec_decode.config import SpeculativeConfig

    if args.speculative_config is None:
        return None
    config = SpeculativeConfig.parse(args.speculative_config)
    if config.method == "draft_model":
        from brisk.models.registry import resolve

        try:
            resolve(config.model)
        except BriskError as e:
            raise BriskError(f"--speculative-config model: {e}") from None
    return config


def build_engine(args: argparse.Namespace, loaded):
    from brisk.engine.engine import LLMEngine

    cache, sched = engine_configs(args, loaded.max_model_len)
    speculative = speculative_config(args)
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        from brisk.loading.loader import load

        # the target's device, dtype and quantization; positions up to the target's context
        draft = load(speculative.model, device=str(loaded.device), dtype=args.dtype, quantization=args.quantization,
                     max_model_len=loaded.max_model_len, warmup=False)
    return LLMEngine(loaded, cache, sched, seed=args.seed or 0, speculative=speculative, draft=draft,
                     batch_invariant=args.batch_invariant)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brisk", description="LLM inference server and latency diagnostics",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"brisk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", allow_abbrev=False, help="generate a completion for one prompt")
    _add_model_args(gen)
    _add_engine_args(gen)
    gen.add_argument("prompt", help="the prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object {text, token_ids, prompt_tokens, completion_tokens, load_report, timings}")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible server", allow_abbrev=False)
    model = srv.add_argument_group("model")
    model.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                       help="model directory, .gguf file, or catalog name (default: smollm2-135m-instruct)")
    _add_model_args(model)
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model id(s) clients send; responses carry the first (default: from MODEL)")
    model.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template, as a file or inline, instead of the model's own; "
                            "`chatml_tools` names the ChatML template with tool calling that brisk ships")
    model.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                       help="put a reasoning model's <think>...</think> into the reply's reasoning_content "
                            "(Qwen3: qwen3; DeepSeek-R1 and its distills: deepseek_r1)")
    model.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "json", "mistral"],
                       help="how tool calls are written: auto (from the chat template, default), hermes "
                            "(<tool_call>, Qwen/Hermes), json (Llama 3.x), mistral ([TOOL_CALLS])")
    _add_engine_args(srv.add_argument_group("KV cache and scheduler"))
    http = srv.add_argument_group("HTTP server")
    http.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--context-policy", default="reject", choices=["reject", "truncate-oldest", "clamp-max-tokens"],
                      help="when prompt + max_tokens exceeds the window: reject with 400 (default), drop the "
                           "oldest chat messages, or lower max_tokens; always reported to the client")
    http.add_argument("--max-queued-requests", type=int, default=256,
                      help="requests allowed to wait beyond --max-num-seqs; more get 429 (default 256)")
    http.add_argument("--request-timeout", type=float, default=None, help="seconds before a request is ended")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    http.add_argument("--seed", type=int, default=None, help="seed of the sampler for unseeded requests")
    http.add_argument("--allow-priority", action="store_true",
                      help="honour the request field `priority` (lower first); off by default, since any "
                           "client could then jump the queue")
    limits = srv.add_argument_group("security and limits")
    limits.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on every route but /health and /ready; prefer "
                             "the environment variable BRISK_API_KEY (a flag is visible to every user in `ps`)")
    limits.add_argument("--metrics-public", action="store_true",
                        help="serve /metrics without the API key (for a Prometheus scraper that has none)")
    limits.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                        help="request body limit (default 16 MiB)")
    limits.add_argument("--max-prompt-chars", type=int, default=1_000_000,
                        help="characters of text one request may send to the tokenizer (default 1,000,000); "
                             "more: 413")
    limits.add_argument("--max-token-ids", type=int, default=262_144,
                        help="token ids one request may send (/detokenize, token-id prompts; default 262,144); "
                             "more: 413")
    limits.add_argument("--max-messages", type=int, default=10_000,
                        help="chat messages one request may send (default 10,000; each costs template work "
                             "beyond its characters); more: 413")
    limits.add_argument("--tokenizer-threads", type=int, default=2,
                        help="requests tokenized at once, off the event loop (default 2); the others wait")
    limits.add_argument("--header-timeout", type=float, default=15.0,
                        help="seconds a connection has to send a complete request head (default 15)")
    limits.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request body has to arrive once its head has (default 30)")
    limits.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open (default 5)")
    limits.add_argument("--max-connections", type=int, default=1000,
                        help="open connections at most; a new one past it gets 503 and is closed (default 1000)")
    logs = srv.add_argument_group("logging and observability")
    logs.add_argument("--uvicorn-log-level", default="warning",
                      choices=["critical", "error", "warning", "info", "debug", "trace"],
                      help="uvicorn's own log level (default warning)")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="no access-log line per request (vLLM's flag)")
    logs.add_argument("--log-prompts", action="store_true",
                      help="put each request's prompt text in its access-log line (off: lengths only)")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="no periodic engine stats line (throughput, running/waiting, KV usage)")
    logs.add_argument("--log-stats-interval", type=float, default=10.0,
                      help="seconds between engine stats lines while busy (default 10)")
    logs.add_argument("--request-log", default=None,
                      help="append one JSON line per finished request (a trace: lengths, timings) to this file; "
                           "brisk kv-plan --trace and brisk bench --workload replay read it")
    logs.add_argument("--otlp-endpoint", default=None,
                      help="export OpenTelemetry spans per request (OTLP/HTTP), e.g. http://127.0.0.1:4318")
    from brisk.cluster.settings import add_arguments as add_cluster_arguments

    add_cluster_arguments(srv.add_argument_group("scale-out (Ray Serve)"))
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", allow_abbrev=False,
                           help="load an OpenAI-compatible endpoint; vLLM-comparable latency metrics")
    from brisk.bench.args import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=lambda args: __import__("brisk.bench.command", fromlist=["cmd_bench"]).cmd_bench(args))

    doctor = sub.add_parser("doctor", allow_abbrev=False,
                            help="diagnose why an OpenAI-compatible endpoint is slow")
    from brisk.doctor.args import add_arguments as add_doctor_arguments

    add_doctor_arguments(doctor)
    doctor.set_defaults(func=lambda args: __import__("brisk.doctor.command", fromlist=["cmd_doctor"]).cmd_doctor(args))

    plan = sub.add_parser("kv-plan", allow_abbrev=False,
                          help="fit request lengths, simulate KV-cache strategies, size the pool")
    from brisk.kvplan.args import add_arguments as add_plan_arguments

    add_plan_arguments(plan)
    plan.set_defaults(func=lambda args: __import__("brisk.kvplan.command", fromlist=["cmd_kv_plan"]).cmd_kv_plan(args))

    top = sub.add_parser("top", allow_abbrev=False, help="live terminal view of a running brisk server's /metrics")
    top.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="server base URL")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes (default 2)")
    top.add_argument("--once", action="store_true", help="print one view (two scrapes) and exit")
    top.set_defaults(func=lambda args: __import__("brisk.top", fromlist=["run_top"]).run_top(
        args.url, args.interval, args.once))
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from brisk.server.preflight import preflight

    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise BriskError(f"two models given ({args.model_arg!r} and --model {args.model!r}); give one")
        args.model = args.model_arg
    from brisk.cluster.settings import from_args as cluster_settings

    cluster = cluster_settings(args)  # scale-out flags (and a reachable --ray-address): before the model
    if cluster is not None:
        from brisk.cluster.settings import require_ray

        require_ray()
    checked = preflight(args)  # flags, model, window, KV budget and port: before any heavy import
    if cluster is not None:
        from brisk.cluster.launch import serve_cluster

        return serve_cluster(args, checked, cluster)
    from brisk.server.serve import serve

    return serve(args, build_engine, checked)


def cmd_generate(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from brisk.loading.report import LoadReport

    report = LoadReport()
    with report.phase("imports"):
        from brisk.engine.async_engine import AsyncLLMEngine
        from brisk.engine.sampling_params import SamplingParams
        from brisk.loading.loader import load

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    loaded = load(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                  quantization=args.quantization, report=report)
    if args.verbose:
        print("\n".join(report.lines()), file=sys.stderr)
    tok = loaded.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = tok.encode_chat(messages)
    else:
        prompt_ids = tok.encode(args.prompt)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise BriskError(str(e)) from None
    engine = AsyncLLMEngine(build_engine(args, loaded))

    async def run():
        final = None
        async for out in engine.generate(prompt_ids, params):
            if not args.json and out.delta_text:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            final = out
        return final

    try:
        final = asyncio.run(run())
    except ValueError as e:  # request validation (too long for the context, ...)
        raise BriskError(str(e)) from None
    finally:
        engine.shutdown()
    metrics = final.metrics
    decode_tokens = len(final.token_ids) - 1
    decode_s = (metrics["decode_ms"] or 0) / 1e3
    timings = {**{k: v for k, v in metrics.items() if k.endswith("_ms")},
               "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else None}
    if args.json:
        print(json.dumps({
            "text": final.text, "token_ids": final.token_ids, "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(final.token_ids), "finish_reason": final.finish_reason,
            "load_report": report.to_dict(), "timings": timings,
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    if args.verbose:
        print(f"ttft {timings['ttft_ms']} ms, decode {timings['decode_ms']} ms "
              f"({timings['decode_tokens_per_s']} tok/s), finish_reason={final.finish_reason}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BriskError as e:
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"brisk: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
