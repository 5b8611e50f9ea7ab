"""`brisk kv-plan`: fit request lengths, simulate KV allocation strategies, recommend a set-up."""

from __future__ import annotations

import argparse
import json
import sys

from brisk.errors import BriskError


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise BriskError(f"{flag} {text!r}: give positive integers separated by commas")
    return values


def _buckets(text: str) -> tuple[list[int], list[float]]:
    sizes_text, _, shares_text = text.partition(":")
    sizes = _ints(sizes_text, "--buckets")
    try:
        shares = [float(x) for x in shares_text.split(",")] if shares_text else [1.0] * len(sizes)
    except ValueError:
        shares = []
    if len(shares) != len(sizes) or any(s <= 0 for s in shares):
        raise BriskError(f"--buckets {text!r}: give sizes:shares with one positive share per size, "
                         "e.g. 512,2048:0.7,0.3")
    return sizes, shares


def _weights_line(shape, memory: int) -> str:
    """What the machine needs beside the KV cache: the weights as brisk serve holds them (a mixture of experts:
    every expert, though a token reads only its active ones)."""
    total, active = shape.parameters
    params = f"{total / 1e9:.2f}B parameters" + (f", {active / 1e9:.2f}B active per token" if active != total else "")
    return (f"weights {shape.weight_bytes / 2**30:.2f} GiB as brisk serve holds them ({params}); with this KV cache "
            f"the server needs {(shape.weight_bytes + memory) / 2**30:.2f} GiB")


def cmd_kv_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from brisk.bench.workloads import parse_length_dist
    from brisk.config import parse_memory
    from brisk.kvplan.fit import fit_truncated_lognormal
    from brisk.kvplan.plan import PlanInputs, model_shape, recommend, run_strategies, synthetic_trace
    from brisk.kvplan.report import fit_table, strategy_table, write_plots
    from brisk.trace import Trace, TraceWriter, read_trace, trace_row

    from brisk.fileio import output_path, write_output

    console = Console(width=None if sys.stdout.isatty() else 160)
    for flag, path in (("--json", args.json_path), ("--save-trace", args.save_trace)):  # before the work
        if path is not None:
            output_path(path, flag)
    try:
        memory = parse_memory(args.memory)
    except ValueError as e:
        raise BriskError(f"--memory: {e}") from None
    for flag in ("decode_tps", "prefill_tps"):
        if getattr(args, flag) <= 0:
            raise BriskError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    shape = model_shape(args.model, args.kv_dtype)
    per_token = args.bytes_per_token or shape.bytes_per_token
    max_model_len = args.max_model_len or shape.max_model_len
    if args.trace is not None:
        loaded = read_trace(args.trace)
    else:
        loaded = Trace(synthetic_trace(parse_length_dist(args.prompt_len, "--prompt-len"),
                                       parse_length_dist(args.output_len, "--output-len"), args.num_requests,
                                       args.rate, args.seed))
    trace = loaded.requests
    if args.save_trace is not None:
        with TraceWriter(args.save_trace, mode="w") as writer:
            for r in trace:
                writer.write(trace_row(r))
    if args.buckets == "auto":
        sizes, shares = [max(max_model_len // d, 1) for d in (8, 4, 2, 1)], [1.0] * 4
    else:
        sizes, shares = _buckets(args.buckets)
    inputs = PlanInputs(memory // per_token, max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                        1.0 / args.decode_tps, args.prefill_tps, args.max_tokens,
                        _ints(args.block_sizes, "--block-sizes"), sizes, shares, args.rebalance_every,
                        not args.no_prefix_caching, memory_flag=args.memory.replace(" ", ""),
                        kv_dtype=shape.kv_dtype)
    if inputs.capacity_tokens < max_model_len:
        raise BriskError(f"--memory {args.memory} holds {inputs.capacity_tokens} tokens at {per_token} bytes per "
                         f"token, less than one max-length ({max_model_len}) sequence: brisk serve would refuse "
                         "it; give more --memory or a lower --max-model-len")
    fits = {name: fit_truncated_lognormal([getattr(r, attr) for r in trace])
            for name, attr in (("prompt tokens", "prompt_tokens"), ("output tokens", "output_tokens"))}
    results = run_strategies(trace, inputs, per_token)
    plan = recommend(results, inputs, shape)
    console.print(f"[bold]brisk kv-plan[/]: {len(trace)} requests"
                  + (f" ({loaded.describe()})" if loaded.describe() else "")
                  + f", model {shape.name}: {per_token} bytes/token ({shape.detail}); "
                  f"memory {args.memory} = {inputs.capacity_tokens:,} tokens; max_model_len {max_model_len}; "
                  f"step {inputs.step_s * 1e3:.0f} ms + prompt tokens at {inputs.prefill_tps:g}/s")
    console.print(_weights_line(shape, memory))
    console.print(fit_table(fits))
    console.print(strategy_table(results))
    console.print(f"[bold green]recommendation[/]: paged KV, block size {plan['block_size']}, "
                  f"{plan['num_blocks']:,} blocks ({inputs.capacity_tokens:,} tokens); expected concurrency "
                  f"{plan['expected_concurrency']['mean']:.1f} mean / {plan['expected_concurrency']['peak']} peak "
                  f"sequences; admission delay p99 {plan['admission_delay_s']['p99']:.2f} s; "
                  f"{plan['preemptions']} preemptions; peak {plan['peak_blocks']} blocks\n"
                  f"  brisk serve {plan['brisk_serve_flags']}")
    for note in plan["notes"]:
        console.print(f"[yellow]note[/]: {note}")
    host = _tier("--host-bytes", args.host_bytes, per_token * plan["block_size"], plan["block_size"], trace)
    if host is not None:
        console.print(f"[bold]host tier[/]: --kv-cache-host-bytes {args.host_bytes} keeps {host['tokens']:,} tokens "
                      f"the pool evicts ({host['blocks']:,} blocks of {host['file_bytes']:,} bytes), "
                      f"{host['tokens'] / max(inputs.capacity_tokens, 1):.1f}x the pool's {inputs.capacity_tokens:,}: "
                      f"{host['share_of_prompts']:.0%} of this traffic's {host['prompt_tokens']:,} prompt tokens")
    disk = _disk_tier(args.disk_bytes, per_token, plan["block_size"], trace)
    if disk is not None:
        console.print(f"[bold]disk tier[/]: --kv-cache-disk-bytes {args.disk_bytes} holds {disk['tokens']:,} tokens "
                      f"({disk['blocks']:,} files of {disk['file_bytes']:,} bytes), {disk['share_of_prompts']:.0%} of "
                      f"this traffic's {disk['prompt_tokens']:,} prompt tokens (the prompts of ~{disk['prompts']:,} "
                      "mean requests); shared prefixes are stored once")
    if args.json_path:
        doc = {"brisk_kv_plan_schema": 2, "requests": len(trace), "skipped_lines": loaded.skipped,
               "aborted_requests": loaded.aborted, "prefill_tps": inputs.prefill_tps,
               "bytes_per_token": per_token, "model": shape.name, "memory_bytes": memory,
               "weight_bytes": shape.weight_bytes, "parameters_total": shape.parameters[0],
               "parameters_active": shape.parameters[1],
               "capacity_tokens": inputs.capacity_tokens, "max_model_len": max_model_len, "step_s": inputs.step_s,
               "fits": {k: v.to_dict() for k, v in fits.items()},
               "strategies": [r.to_dict() for r in results], "recommendation": plan,
               **({"disk_tier": disk} if disk is not None else {}),
               **({"host_tier": host} if host is not None else {})}
        write_output(args.json_path, json.dumps(doc, indent=1) + "\n", "--json")
    if args.plot:
        for path in write_plots(args.plot, trace, fits, results):
            console.print(f"plot: {path}")
    return 0


def _disk_tier(flag: str | None, per_token: int, block_size: int, trace) -> dict | None:
    """What --kv-cache-disk-bytes holds: one file per full block of block_size tokens."""
    from brisk.engine.kv_cache.disk_tier import HEADER_BYTES

    return _tier("--disk-bytes", flag, per_token * block_size + HEADER_BYTES, block_size, trace)


def _tier(name: str, flag: str | None, block_bytes: int, block_size: int, trace) -> dict | None:
    """What a KV tier of `flag` bytes holds, in whole blocks of `block_bytes` (`file_bytes`), against the trace's
    prompts (--host-bytes: the host tier, blocks as the pool holds them; --disk-bytes: files with a header)."""
    from brisk.config import parse_memory

    if flag is None:
        return None
    try:
        budget = parse_memory(flag)
    except ValueError as e:
        raise BriskError(f"{name}: {e}") from None
    file_bytes = block_bytes
    blocks = budget // file_bytes
    prompt_tokens = sum(r.prompt_tokens for r in trace)
    mean_prompt = prompt_tokens / max(len(trace), 1)
    return {"budget_bytes": budget, "file_bytes": file_bytes, "blocks": blocks, "tokens": blocks * block_size,
            "prompt_tokens": prompt_tokens, "share_of_prompts": min(1.0, blocks * block_size / max(prompt_tokens, 1)),
            "prompts": int(blocks * block_size / max(mean_prompt, 1))}
