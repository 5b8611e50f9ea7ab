"""Where the grammar library breaks, for the bounds in brisk/structured/limits.py.

For each shape of grammar that recursed deep enough to crash the server (a chain of `$ref`s,
nested objects reached through `$ref`s, a chain of Lark rules, nested anyOf), this bisects the
largest size the compile sandbox's worker survives on its CHECK_STACK_BYTES stack, with brisk's
own bounds bypassed, and prints it beside what `limits` allows. A bound should sit well below
the crash; the sandbox is what stands between the rest and the server.

    .venv/bin/python benchmarks/grammar_limits.py [--max 4096]
"""

from __future__ import annotations

import argparse
import time

from brisk.structured.sandbox import CHECK_STACK_BYTES, CompileSandbox, SandboxError
from brisk.structured.sources import GrammarError, check_limits
from brisk.structured.spec import GrammarSpec, json_spec


def ref_chain(n: int) -> GrammarSpec:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json_spec({"$ref": "#/$defs/d0", "$defs": defs}, "response_format")


def anyof_chain(n: int) -> GrammarSpec:
    defs = {f"d{i}": {"anyOf": [{"type": "integer"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json_spec({"$ref": "#/$defs/d0", "$defs": defs}, "guided_json")


def lark_chain(n: int) -> GrammarSpec:
    rules = "".join(f"r{i}: r{i + 1}\n" for i in range(n))
    return GrammarSpec("lark", f"start: r0\n{rules}r{n}: \"a\"\n", "guided_grammar")


def gbnf_chain(n: int) -> GrammarSpec:
    rules = "".join(f"r{i} ::= r{i + 1}\n" for i in range(n))
    return GrammarSpec("lark", f"root ::= r0\n{rules}r{n} ::= \"a\"\n", "guided_grammar")


SHAPES = {"$ref chain": ref_chain, "anyOf via $ref chain": anyof_chain, "Lark rule chain": lark_chain,
          "GBNF rule chain": gbnf_chain}


def survives(sandbox: CompileSandbox, spec: GrammarSpec) -> bool:
    try:
        sandbox.check(spec)
    except SandboxError:
        return False
    except GrammarError:
        return True  # refused in words by the library: it did not crash
    return True


def largest_surviving(sandbox: CompileSandbox, shape, upper: int) -> int | None:
    """Largest n in [1, upper] the worker survives (None: it survives all of them)."""
    if survives(sandbox, shape(upper)):
        return None
    low, high = 1, upper  # survives(low), not survives(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if survives(sandbox, shape(mid)) else (low, mid)
    return low


def accepted(spec: GrammarSpec) -> bool:
    try:
        check_limits(spec)
    except GrammarError:
        return False
    return True


def largest_accepted(shape, upper: int) -> int:
    """Largest n in [0, upper] brisk's bounds accept (they are monotone in n)."""
    if accepted(shape(upper)):
        return upper
    low, high = 0, upper
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if accepted(shape(mid)) else (low, mid)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=4096, help="largest size tried per shape")
    args = parser.parse_args()
    from brisk.models.registry import resolve
    from brisk.loading.loader import load

    demo = load(resolve(None).name)
    tok = demo.tokenizer
    sandbox = CompileSandbox(tok.fast.to_str(), demo.config.vocab_size, tok.eos_token_ids, timeout_s=120)
    print(f"worker stack {CHECK_STACK_BYTES >> 20} MiB; sizes tried up to {args.max}")
    print("| shape | largest the worker survives | largest brisk accepts | margin |")
    print("|---|---|---|---|")
    for name, shape in SHAPES.items():
        t0 = time.perf_counter()
        crash = largest_surviving(sandbox, shape, args.max)
        ok = largest_accepted(shape, args.max if crash is None else crash)
        margin = "-" if crash is None or ok == 0 else f"{crash / ok:.1f}x"
        print(f"| {name} | {'no crash' if crash is None else crash} | {ok} | {margin} |"
              f"  ({time.perf_counter() - t0:.0f} s, workers started so far: {sandbox.workers_started})")
    sandbox.close()


if __name__ == "__main__":
    main()
