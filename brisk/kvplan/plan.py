"""Run every strategy over a trace for one memory budget and recommend a paged set-up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from brisk.errors import BriskError
from brisk.kv_dtype import resolve as resolve_kv_dtype
from brisk.kvplan.engine_sim import EngineSimConfig, StepCost, simulate_engine
from brisk.kvplan.simulate import BucketAllocator, ContiguousAllocator, SimConfig, SimResult, simulate
from brisk.trace import TraceRequest


@dataclass(frozen=True)
class ModelShape:
    name: str
    bytes_per_token: int
    max_model_len: int
    detail: str
    kv_dtype: str = "float32"  # canonical (brisk/kv_dtype.py): what brisk serve's --kv-cache-dtype gets
    weight_bytes: int = 0  # the weights as brisk serve holds them (memory plan: experts counted in their format)
    parameters: tuple[int, int] = (0, 0)  # (total, active per token)


def model_shape(model: str | None, kv_dtype: str) -> ModelShape:
    """KV bytes per token from a model's config (HF dir, GGUF metadata or catalog name), no weights read."""
    from brisk.config import ModelConfig
    from brisk.loading.gguf_header import hf_config
    from brisk.loading.gguf_header import read_gguf_metadata
    from brisk.models.registry import resolve

    try:  # brisk computes in float32 on CPU: auto is then what serve picks on this machine
        kv = resolve_kv_dtype(kv_dtype, "float32", "cpu")
    except BriskError as e:
        raise BriskError(str(e).replace("--kv-cache-dtype", "--kv-dtype")) from None
    src = resolve(model)
    if src.kind == "gguf":  # the metadata alone, in milliseconds (tie_word_embeddings does not matter here)
        config = hf_config(read_gguf_metadata(src.path), True, str(src.path))
    else:
        config = json.loads((Path(src.path) / "config.json").read_text(encoding="utf-8"))
    cfg = ModelConfig.from_hf_dict(config, str(src.path))
    per_token = cfg.kv_bytes_per_token(kv)
    weight_bytes = _weight_bytes(src)
    detail = (f"{cfg.num_layers} layers × {cfg.num_kv_heads} KV heads × {cfg.head_dim} dims × 2 (K, V) × "
              f"{kv.bytes_per_element(cfg.head_dim):g} bytes ({kv.name}"
              + (", its scale per token and head included)" if kv.scaled else ")"))
    return ModelShape(src.name, per_token, cfg.max_position_embeddings, detail, kv.name, weight_bytes,
                      cfg.parameter_counts())


def _weight_bytes(src) -> int:
    """The weights' bytes as `brisk serve` holds them on this CPU, from file headers alone (brisk's memory plan:
    quantized experts and layers in their own formats, 16-bit checkpoints kept 16-bit)."""
    from brisk.loading import memory_plan

    if src.kind == "gguf":
        return memory_plan.gguf_weight_bytes(src.path, "auto")[0]
    return memory_plan.checkpoint_weight_bytes(Path(src.path), "auto", 4)


@dataclass
class PlanInputs:
    capacity_tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step_s: float
    prefill_tps: float
    default_max_tokens: int | None
    block_sizes: list[int]
    bucket_sizes: list[int]
    bucket_shares: list[float]
    rebalance_every: int
    enable_prefix_caching: bool = True
    memory_flag: str | None = None  # --memory as the user wrote it: brisk serve's --kv-cache-memory takes it as is
    kv_dtype: str = "float32"  # brisk serve's --kv-cache-dtype, canonical


def serve_flags(p: PlanInputs, block_size: int, bytes_per_token: int) -> str:
    """The `brisk serve` flags that give the engine simulated for this block size."""
    memory = p.memory_flag or f"{p.capacity_tokens * bytes_per_token // 2**20}MiB"
    flags = (f"--block-size {block_size} --kv-cache-memory {memory} --kv-cache-dtype {p.kv_dtype} "
             f"--max-num-seqs {p.max_num_seqs} "
             f"--max-num-batched-tokens {p.max_num_batched_tokens} --max-model-len {p.max_model_len}")
    return flags + ("" if p.enable_prefix_caching else " --no-prefix-caching")


def blocks_of_flags(flags: str, bytes_per_token: int, max_model_len: int) -> int:
    """Parse `flags` with brisk serve's own parser and build its engine configs: the number of KV
    blocks brisk serve would allocate, or a BriskError saying why it would refuse to start."""
    import contextlib
    import io

    from brisk.engine.factory import engine_configs, engine_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = engine_parser().parse_args(flags.split())
    except SystemExit:
        raise BriskError(f"brisk serve would reject {flags!r}: {err.getvalue().strip().splitlines()[-1]}") from None
    cache, sched = engine_configs(args, args.max_model_len or max_model_len)
    return cache.num_blocks(bytes_per_token, sched.max_model_len, available_bytes=0)


def run_strategies(trace: list[TraceRequest], p: PlanInputs, bytes_per_token: int) -> list[SimResult]:
    engines = []  # brisk serve's own config checks first: a flag it would refuse fails before any simulation
    for bs in p.block_sizes:
        flags = serve_flags(p, bs, bytes_per_token)
        num_blocks = blocks_of_flags(flags, bytes_per_token, p.max_model_len)
        engines.append((flags, EngineSimConfig(num_blocks, bs, p.max_num_seqs, p.max_num_batched_tokens,
                                               p.max_model_len, p.enable_prefix_caching)))
    cfg = SimConfig(p.capacity_tokens, p.max_model_len, p.max_num_seqs, p.max_num_batched_tokens, p.step_s,
                    p.prefill_tps, p.default_max_tokens)

    def reserve(s) -> int:
        return s.req.prompt_tokens + s.max_tokens

    results = [
        simulate(trace, ContiguousAllocator(p.capacity_tokens, lambda s: p.max_model_len), cfg,
                 f"static max_model_len ({p.max_model_len})"),
        simulate(trace, ContiguousAllocator(p.capacity_tokens, reserve), cfg, "reserve prompt+max_tokens"),
        simulate(trace, BucketAllocator(p.capacity_tokens, p.bucket_sizes, p.bucket_shares), cfg,
                 "buckets " + "/".join(map(str, p.bucket_sizes))),
        simulate(trace, BucketAllocator(p.capacity_tokens, p.bucket_sizes, p.bucket_shares, p.rebalance_every), cfg,
                 f"buckets + rebalance every {p.rebalance_every} steps", rebalance_every=p.rebalance_every),
    ]
    cost = StepCost(p.step_s, p.prefill_tps)
    for flags, engine in engines:
        result = simulate_engine(trace, engine, cost, f"brisk paged B={engine.block_size}")
        result.serve_flags = flags
        results.append(result)
    return results


def recommend(results: list[SimResult], p: PlanInputs, shape: ModelShape | None) -> dict:
    """The block size whose simulated engine admits requests soonest, then preempts least (each
    within 5%: ties), then is nearest 16, the size paged-attention kernels are tuned for (fewer,
    larger blocks also mean smaller block tables). Concurrency is not the criterion: preempted
    requests live longer, so more preemption shows as more concurrency."""
    pool = [r for r in results if r.serve_flags]

    def delay(r: SimResult) -> float:
        return sum(r.admission_delays_s) / max(len(r.admission_delays_s), 1)

    def block(r: SimResult) -> int:
        return int(r.strategy.split("B=")[1].split()[0])

    least_delay = min(delay(r) for r in pool)
    close = [r for r in pool if delay(r) <= least_delay * 1.05 + 1e-3]
    fewest = min(r.num_preemptions for r in close)
    close = [r for r in close if r.num_preemptions <= fewest * 1.05]
    chosen = min(close, key=lambda r: abs(block(r) - 16))
    bs = block(chosen)
    out = {
        "block_size": bs, "strategy": chosen.strategy, "num_blocks": chosen.capacity_tokens // bs,
        "capacity_tokens": chosen.capacity_tokens,
        "expected_concurrency": {"mean": chosen.mean_running, "peak": chosen.peak_running},
        "admission_delay_s": chosen.to_dict()["admission_delay_s"], "preemptions": chosen.num_preemptions,
        "rejected": chosen.num_rejected, "peak_blocks": max(chosen.used_blocks, default=0),
        "brisk_serve_flags": chosen.serve_flags, "notes": [],
    }
    if chosen.num_preemptions:
        out["notes"].append(f"{chosen.num_preemptions} preemptions: the KV memory is short for this traffic at "
                            f"--max-num-seqs {p.max_num_seqs}; more --memory, or a lower --max-num-seqs, avoids "
                            "recomputing preempted requests")
    if chosen.num_rejected:
        out["notes"].append(f"{chosen.num_rejected} requests are longer than --max-model-len {p.max_model_len} "
                            "(prompt + output) and would be refused")
    if shape is not None:
        out["memory_bytes"] = chosen.capacity_tokens * shape.bytes_per_token
    return out


def synthetic_trace(prompt_dist, output_dist, num_requests: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at `rate` requests/s with lengths drawn from the two distributions."""
    import numpy as np

    from brisk.bench.workloads import arrival_offsets

    rng = np.random.default_rng(seed)
    prompts, outputs = prompt_dist.sample(rng, num_requests), output_dist.sample(rng, num_requests)
    arrivals = arrival_offsets(num_requests, rate, 1.0, rng)
    return [TraceRequest(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]
