"""`brisk` command line. Heavy imports (torch) happen inside the subcommands, so
`brisk --help` is instant and the import time is reported as a load phase."""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from brisk import __version__
from brisk.errors import BriskError

EXIT_USER_ERROR = 2


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="Hugging Face model directory, .gguf file, or catalog name (default: smollm2-135m-instruct)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--verbose", "-v", action="store_true", help="print the load report; tracebacks on errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brisk", description="LLM inference server and latency diagnostics")
    parser.add_argument("--version", action="version", version=f"brisk {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_model_args(gen)
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
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from brisk.loading.report import LoadReport

    report = LoadReport()
    with report.phase("imports"):
        from brisk.generate import GenerationTimings, generate_ids
        from brisk.loading.loader import load

    loaded = load(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, report=report)
    if args.verbose:
        print("\n".join(report.lines()), file=sys.stderr)
    tok = loaded.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = tok.encode_chat(messages)
    else:
        prompt_ids = tok.encode(args.prompt)
    timings = GenerationTimings()
    detok = tok.detokenizer()
    token_ids = []
    for token in generate_ids(loaded, prompt_ids, args.max_tokens, args.temperature, args.seed,
                              args.ignore_eos, timings):
        token_ids.append(token)
        piece = detok.step(token)
        if not args.json and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({
            "text": detok.text, "token_ids": token_ids, "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(token_ids), "load_report": report.to_dict(),
            "timings": timings.to_dict(len(token_ids)),
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    if args.verbose:
        t = timings.to_dict(len(token_ids))
        print(f"prefill {t['prefill_ms']} ms, decode {t['decode_ms']} ms "
              f"({t['decode_tokens_per_s']} tok/s)", file=sys.stderr)
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
