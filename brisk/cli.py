"""`brisk` command line. Heavy imports (torch) happen inside the subcommands, so
`brisk --help` is instant and the import time is reported as a load phase."""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from brisk import __version__, argtypes, switches
from brisk.engine.factory import add_engine_args, add_model_args, build_engine, check_device
from brisk.errors import BriskError

EXIT_USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argtypes.Parser(prog="brisk", description="LLM inference server and latency diagnostics",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"brisk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", allow_abbrev=False, help="generate a completion for one prompt")
    add_model_args(gen)
    add_engine_args(gen)
    gen.add_argument("prompt", help="the prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=argtypes.positive, default=128)
    gen.add_argument("--temperature", type=argtypes.number(minimum=0), default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=argtypes.integer(0, 2**64 - 1), default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object {text, token_ids, prompt_tokens, completion_tokens, load_report, timings}")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible server", allow_abbrev=False)
    from brisk.cluster.settings import add_serve_arguments

    add_serve_arguments(srv)
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

    return serve(args, checked)


def cmd_generate(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from brisk.loading.report import LoadReport

    switches.check_all()
    check_device(args.device)
    report = LoadReport()
    with report.phase("imports"):
        from brisk.engine.async_engine import AsyncLLMEngine
        from brisk.engine.sampling_params import SamplingParams
        from brisk.loading.loader import load

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    loaded = load(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                  quantization=args.quantization, report=report, kv_cache_dtype=args.kv_cache_dtype,
                  pooling=args.pooling)
    if loaded.pooling is not None:
        raise BriskError(f"{args.model or 'the model'} is an embedding model ({loaded.pooling.describe()}): "
                         "`brisk generate` needs a generative one (or --pooling none); embed with `brisk serve` and "
                         "POST /v1/embeddings")
    built = build_engine(args, loaded)
    report.kv_cache_dtype = built.kv_dtype.name
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
    engine = AsyncLLMEngine(built)

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
