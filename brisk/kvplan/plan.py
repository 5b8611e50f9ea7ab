"""Run every strategy over a trace for one memory budget and recommend a paged set-up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from brisk.errors import BriskError
from brisk.kvplan.simulate import (BucketAllocator, ContiguousAllocator, PagedAllocator, SimConfig, SimResult,
                                   simulate)
from brisk.kvplan.trace import TraceRequest

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelShape:
    name: str
    bytes_per_token: int
    max_model_len: int
    detail: str


def model_shape(model: str | None, kv_dtype: str) -> ModelShape:
    """KV bytes per token from a model's config (HF dir, GGUF metadata or catalog name), no weights read."""
    from brisk.config import ModelConfig
    from brisk.loading.gguf_convert import hf_config, open_gguf, read_metadata
    from brisk.models.registry import resolve

    if kv_dtype not in _DTYPE_BYTES:
        raise BriskError(f"--kv-dtype {kv_dtype!r}: use one of {', '.join(_DTYPE_BYTES)}")
    src = resolve(model)
    if src.kind == "gguf":
        reader = open_gguf(src.path)
        has_output = any(t.name == "output.weight" for t in reader.tensors)
        config = hf_config(read_metadata(reader), has_output, str(src.path))
    else:
        config = json.loads((Path(src.path) / "config.json").read_text(encoding="utf-8"))
    cfg = ModelConfig.from_hf_dict(config, str(src.path))
    per_token = cfg.kv_bytes_per_token(_DTYPE_BYTES[kv_dtype])
    detail = (f"{cfg.num_layers} layers × {cfg.num_kv_heads} KV heads × {cfg.head_dim} dims × 2 (K, V) × "
              f"{_DTYPE_BYTES[kv_dtype]} bytes ({kv_dtype})")
    return ModelShape(src.name, per_token, cfg.max_position_embeddings, detail)


@dataclass
class PlanInputs:
    capacity_tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step_s: float
    default_max_tokens: int | None
    block_sizes: list[int]
    bucket_sizes: list[int]
    bucket_shares: list[float]
    rebalance_every: int


def run_strategies(trace: list[TraceRequest], p: PlanInputs) -> list[SimResult]:
    cfg = SimConfig(p.capacity_tokens, p.max_model_len, p.max_num_seqs, p.max_num_batched_tokens, p.step_s,
                    p.default_max_tokens)

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
    shared = any(r.prefix_group is not None for r in trace)
    for bs in p.block_sizes:
        results.append(simulate(trace, PagedAllocator(p.capacity_tokens, bs), cfg, f"paged B={bs}"))
        if shared:
            results.append(simulate(trace, PagedAllocator(p.capacity_tokens, bs, prefix_sharing=True), cfg,
                                    f"paged B={bs} + prefix sharing"))
    return results


def recommend(results: list[SimResult], p: PlanInputs, shape: ModelShape | None) -> dict:
    paged = [r for r in results if r.strategy.startswith("paged")]
    sharing = [r for r in paged if "sharing" in r.strategy]
    pool = sharing or paged
    best = max(r.mean_running for r in pool)
    close = [r for r in pool if r.mean_running >= 0.99 * best]

    def delay(r: SimResult) -> float:
        return sum(r.admission_delays_s) / max(len(r.admission_delays_s), 1)

    def block(r: SimResult) -> int:
        return int(r.strategy.split("B=")[1].split()[0])

    # Equal concurrency and delay (within 1% / 5%): prefer blocks near 16, the size paged
    # attention kernels are tuned for; fewer, larger blocks also mean smaller block tables.
    least_delay = min(delay(r) for r in close)
    close = [r for r in close if delay(r) <= least_delay * 1.05 + 1e-3]
    chosen = min(close, key=lambda r: abs(block(r) - 16))
    bs = block(chosen)
    out = {
        "block_size": bs, "strategy": chosen.strategy, "num_blocks": p.capacity_tokens // bs,
        "capacity_tokens": p.capacity_tokens,
        "expected_concurrency": {"mean": chosen.mean_running, "peak": chosen.peak_running},
        "admission_delay_s": chosen.to_dict()["admission_delay_s"], "preemptions": chosen.num_preemptions,
        "rejected": chosen.num_rejected,
    }
    if shape is not None:
        out["memory_bytes"] = p.capacity_tokens * shape.bytes_per_token
        out["brisk_serve_flags"] = (f"--block-size {bs} --kv-cache-memory "
                                    f"{p.capacity_tokens * shape.bytes_per_token / 2**30:.2f}GiB "
                                    f"--max-num-seqs {max(chosen.peak_running, 1)}")
    return out
