"""brisk kv-plan: exact figures on hand-checkable traces, the lognormal fit, the CLI, and
the simulator's paged-block usage against brisk's real engine replaying the same trace."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from brisk.config import CacheConfig
from brisk.engine.engine import LLMEngine
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import SchedulerConfig
from brisk.kvplan.fit import fit_truncated_lognormal
from brisk.kvplan.engine_sim import EngineSimConfig, StepCost, simulate_engine
from brisk.kvplan.simulate import BucketAllocator, ContiguousAllocator, SimConfig, simulate
from brisk.trace import TraceRequest, read_trace

STEPS = StepCost(decode_step_s=1.0, prefill_tps=math.inf)  # one second per step, prefill free
CFG = SimConfig(capacity_tokens=100, max_model_len=40, max_num_seqs=8, max_num_batched_tokens=1000, step_s=1.0)
# A and B arrive at step 0, C at step 1 (see the step-by-step accounts in each test)
TRACE = [TraceRequest(0.0, 10, 3, max_tokens=5), TraceRequest(0.0, 20, 2, max_tokens=4),
         TraceRequest(1.0, 30, 1, max_tokens=10)]


def test_static_reservation_of_max_model_len():
    r = simulate(TRACE, ContiguousAllocator(100, lambda s: 40), CFG, "static")
    # step 0: A, B hold 40 each (10 + 20 tokens); step 1: C (40) does not fit in the 20 left,
    # B finishes; step 2: C takes B's old region: A 12 + C 30 tokens, both finish.
    assert (r.steps, r.num_finished, r.peak_running, r.num_preemptions) == (3, 3, 2, 0)
    assert r.timeline["allocated"] == [80, 80, 80] and r.timeline["used"] == [30, 32, 42]
    assert r.mean_reserved_unused == pytest.approx((50 + 48 + 38) / 3)
    assert r.mean_internal == 0 and r.mean_external == 0  # 20 free < 40 needed: not fragmentation
    assert r.admission_delays_s == [0.0, 0.0, 1.0]


def test_reservation_of_prompt_plus_max_tokens():
    r = simulate(TRACE, ContiguousAllocator(100, lambda s: s.req.prompt_tokens + s.max_tokens), CFG, "reserve")
    # regions 15, 24, 40: all three fit at step 1
    assert r.timeline["allocated"] == [39, 79, 15] and r.timeline["used"] == [30, 62, 12]
    assert r.mean_reserved_unused == pytest.approx((9 + 17 + 3) / 3)
    assert r.peak_running == 3 and r.admission_delays_s == [0.0, 0.0, 0.0]


def test_first_fit_holes_are_external_fragmentation():
    cfg = SimConfig(capacity_tokens=30, max_model_len=30, step_s=1.0)
    trace = [TraceRequest(0, 9, 1, max_tokens=1), TraceRequest(0, 9, 3, max_tokens=3),
             TraceRequest(0, 7, 1, max_tokens=1), TraceRequest(1, 13, 1, max_tokens=1)]
    r = simulate(trace, ContiguousAllocator(30, lambda s: s.req.prompt_tokens + s.max_tokens), cfg, "reserve")
    # step 0: [0,10) [10,22) [22,30); the 1st and 3rd finish, leaving holes of 10 and 8.
    # steps 1-2: D needs 14; 18 tokens are free but no hole is big enough: external fragmentation.
    # step 3: B is gone, D takes [0,14).
    assert r.timeline["allocated"] == [30, 12, 12, 14]
    assert r.mean_external == pytest.approx((0 + 18 + 18 + 0) / 4)
    assert r.admission_delays_s[-1] == 2.0


def test_brisk_engine_blocks_grow_with_the_sequence():
    r = simulate_engine(TRACE, EngineSimConfig(12, 8, 8, 1000, 40), STEPS, "paged", arrival_steps=[0, 0, 1])
    # blocks: A 10 -> 2, B 20 -> 3 (step 0); C 30 -> 4 joins at step 1; A alone at step 2
    assert r.timeline["allocated"] == [40, 72, 16] and r.timeline["used"] == [30, 62, 12]
    assert r.mean_internal == pytest.approx((10 + 10 + 4) / 3) and r.mean_reserved_unused == 0
    assert r.used_blocks == [5, 2, 0] and r.num_finished == 3  # after each step, as the engine reports


def test_buckets_with_a_dry_class_count_external_fragmentation():
    alloc = BucketAllocator(100, [16, 40], [0.4, 0.6])
    assert alloc.slots == [2, 1]
    r = simulate(TRACE, alloc, CFG, "buckets")
    # A (need 15) -> a 16-slot, B (24) -> the 40-slot; C (40) waits a step for it though 44 is free
    assert r.timeline["allocated"] == [56, 56, 56] and r.timeline["used"] == [30, 32, 42]
    assert r.mean_internal == pytest.approx((17 + 17 + 1) / 3)
    assert r.mean_reserved_unused == pytest.approx((9 + 7 + 13) / 3)
    assert r.mean_external == pytest.approx(44 / 3)


def test_rebalancing_moves_free_memory_to_the_busy_bucket():
    alloc = BucketAllocator(100, [16, 40], [0.9, 0.1])
    assert alloc.slots == [5, 0]  # no slot of 40 at all
    trace = [TraceRequest(0, 30, 2, max_tokens=5)]
    cfg = SimConfig(capacity_tokens=100, max_model_len=40, step_s=1.0)
    stuck = simulate(trace, BucketAllocator(100, [16, 40], [0.9, 0.1]), cfg, "b")
    assert (stuck.num_finished, stuck.num_rejected, stuck.steps) == (0, 1, 1)  # rejected, not stuck forever
    moved = simulate(trace, alloc, cfg, "b+r", rebalance_every=1)
    assert moved.num_finished == 1 and alloc.num_rebalances >= 1


def test_prefix_sharing_goes_through_the_real_prefix_cache():
    trace = [TraceRequest(0, 10, 2, prefix_group="g", prefix_tokens=8),
             TraceRequest(0, 12, 2, prefix_group="g", prefix_tokens=8)]
    shared = simulate_engine(trace, EngineSimConfig(16, 4, 8, 1000, 64), STEPS, "s", arrival_steps=[0, 0])
    plain = simulate_engine(trace, EngineSimConfig(16, 4, 8, 1000, 64, enable_prefix_caching=False), STEPS, "p",
                            arrival_steps=[0, 0])
    # A registers its 2 full blocks when scheduled; B, admitted in the same step, shares them:
    # 2 shared + 1 + 1 private blocks; step 1: B grows to 13 tokens -> 2 private
    assert shared.timeline["allocated"] == [16, 20] and shared.timeline["used"] == [14, 16]
    assert shared.prefix_hit_tokens == 8
    assert plain.timeline["allocated"] == [24, 28] and plain.timeline["used"] == [22, 24]


def test_brisk_engine_preempts_the_newest_and_recomputes_it():
    trace = [TraceRequest(0, 7, 4), TraceRequest(0, 4, 3)]
    r = simulate_engine(trace, EngineSimConfig(4, 4, 8, 1000, 16), STEPS, "p", arrival_steps=[0, 0])
    # step 2: A needs a 3rd block, none free: B (newest) is preempted; it returns at step 4
    assert r.num_preemptions == 1 and r.used_blocks == [3, 4, 3, 0, 0] and r.num_finished == 2


def test_brisk_engine_chunks_a_prompt_longer_than_the_step_budget():
    """brisk serve's default budget is 512 tokens a step: a 600-token prompt is prefilled in two
    chunks (the old simulator admitted whole prompts only and never finished this one)."""
    trace = [TraceRequest(0, 600, 5), TraceRequest(0.01, 20, 5)]
    r = simulate_engine(trace, EngineSimConfig(200, 8, 64, 512, 2048), StepCost(0.05, 4000.0), "p")
    assert (r.num_finished, r.num_rejected) == (2, 0)
    # step 0: 512 prompt tokens (0.05 + 0.128 s); step 1: the last 88 (0.05 + 0.022 s), the second
    # request arrives at 0.01 s and is admitted in step 1 beside the chunk (88 + 20 tokens)
    assert r.timeline["t"][:3] == pytest.approx([0.0, 0.178, 0.178 + 0.05 + 108 / 4000])
    assert r.used_blocks[0] == 64 and r.used_blocks[1] == 75 + 3


def test_truncated_lognormal_fit_recovers_parameters():
    rng = np.random.default_rng(3)
    x = rng.lognormal(6.0, 0.7, 20000)
    x = x[(x >= 50) & (x <= 3000)][:5000]
    fit = fit_truncated_lognormal(x, 50, 3000)
    assert fit.mu == pytest.approx(6.0, abs=0.05) and fit.sigma == pytest.approx(0.7, abs=0.03)
    assert fit.ks_pvalue > 0.01 and fit.mean() == pytest.approx(x.mean(), rel=0.03)
    assert fit.quantile(0.5) == pytest.approx(np.median(x), rel=0.05)
    bimodal = np.concatenate([rng.normal(100, 5, 1500), rng.normal(1000, 50, 1500)])
    assert fit_truncated_lognormal(bimodal).ks_pvalue < 1e-6  # a bad model is reported as one


def test_trace_formats(tmp_path):
    log = tmp_path / "requests.jsonl"
    log.write_text('{"arrival_s": 100.5, "prompt_tokens": 5, "output_tokens": 3, "finish_reason": "length"}\n'
                   '{"arrival_s": 100.0, "prompt_tokens": 7, "output_tokens": null}\n'
                   '{"timestamp": 101, "input_tokens": 9, "completion_tokens": 2, "prefix_group": "sys",'
                   ' "prefix_tokens": 4}\n')
    loaded = read_trace(log)
    trace = loaded.requests
    assert loaded.skipped == 1 and [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == [
        (0.0, 5, 3), (0.5, 9, 2)]
    assert trace[1].prefix_group == "sys" and trace[1].prefix_tokens == 4
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"send_offsets": [0, 0.2], "input_lens": [4, 6], "output_lens": [8, 9]}]}))
    assert [r.output_tokens for r in read_trace(bench).requests] == [8, 9]


def test_cli_plan_with_json_and_plots(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "kv-plan", "--num-requests", "150", "--rate", "1",
                           "--memory", "256MiB", "--max-model-len", "2048", "--max-tokens", "1024",
                           "--block-sizes", "8,16,64", "--kv-dtype", "int8", "--json", str(out),
                           "--plot", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["bytes_per_token"] == 2 * 30 * 3 * (64 + 4)  # SmolLM2-135M, int8 K and V, a float32 scale per head
    assert doc["capacity_tokens"] == 256 * 2**20 // doc["bytes_per_token"]
    names = [s["strategy"] for s in doc["strategies"]]
    assert any(n.startswith("static") for n in names) and "brisk paged B=16" in names
    rec = doc["recommendation"]
    assert rec["block_size"] in (8, 16, 64)
    # the flags printed are the engine simulated, and brisk serve's own parser takes them
    from brisk.cli import build_parser
    from brisk.engine.factory import engine_configs

    args = build_parser().parse_args(["serve", *rec["brisk_serve_flags"].split()])
    cache, sched = engine_configs(args, args.max_model_len)
    assert (sched.max_num_batched_tokens, sched.max_num_seqs, sched.max_model_len) == (512, 64, 2048)
    assert cache.kv_cache_dtype == "int8"
    assert cache.num_blocks(doc["bytes_per_token"], 2048, 0) == rec["num_blocks"]
    static = next(s for s in doc["strategies"] if s["strategy"].startswith("static"))
    paged = next(s for s in doc["strategies"] if s["strategy"] == "brisk paged B=16")
    assert paged["mean_concurrent_sequences"] > static["mean_concurrent_sequences"]
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"length_fit.png", "memory_over_time.png",
                                                                "waste_breakdown.png"}
    assert "recommendation" in proc.stdout


def test_cli_plans_chunked_prefill_with_serve_defaults(tmp_path):
    """A 600-token prompt under brisk serve's default 512-token step budget is prefilled in chunks,
    in the plan as in the engine (the old simulator never admitted it: 0 finished)."""
    trace = tmp_path / "long.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.5, "prompt_tokens": 600, "output_tokens": 20}) + "\n"
                             for i in range(6)))
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "kv-plan", "--trace", str(trace), "--memory", "256MiB",
                           "--max-model-len", "1024", "--block-sizes", "16", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    paged = next(s for s in json.loads(out.read_text())["strategies"] if s["strategy"] == "brisk paged B=16")
    assert (paged["finished"], paged["rejected"]) == (6, 0)
    assert "--max-num-batched-tokens 512" in paged["brisk_serve_flags"]


def test_cli_sizes_the_disk_and_host_tiers(tmp_path, demo):
    """--disk-bytes: how many tokens brisk serve's --kv-cache-disk-bytes holds, in files of one block each, the
    size the disk tier writes (its header plus the block's K, V and scales); --host-bytes: the same for
    --kv-cache-host-bytes, whose blocks are the pool's bytes alone."""
    from brisk.engine.kv_cache.disk_tier import HEADER_BYTES
    from brisk.kv_dtype import resolve

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i, "prompt_tokens": 600, "output_tokens": 20}) + "\n"
                             for i in range(6)))
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "brisk", "kv-plan", "--trace", str(trace), "--memory", "256MiB",
                           "--max-model-len", "1024", "--block-sizes", "16", "--kv-dtype", "int8", "--disk-bytes",
                           "1MiB", "--host-bytes", "1MiB", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(out.read_text())
    disk, host = plan["disk_tier"], plan["host_tier"]
    block = demo.config.kv_bytes_per_token(resolve("int8", "float32", "cpu")) * 16
    assert disk["file_bytes"] == HEADER_BYTES + block
    assert disk["blocks"] == 2**20 // (HEADER_BYTES + block) and disk["tokens"] == 16 * disk["blocks"]
    assert disk["prompt_tokens"] == 3600 and disk["share_of_prompts"] == pytest.approx(disk["tokens"] / 3600)
    assert "disk tier: --kv-cache-disk-bytes 1MiB holds" in " ".join(proc.stdout.split())
    assert host["file_bytes"] == block and host["blocks"] == 2**20 // block and host["tokens"] == 16 * host["blocks"]
    assert f"host tier: --kv-cache-host-bytes 1MiB keeps {host['tokens']:,} tokens" in " ".join(proc.stdout.split())


def test_readme_command_reproduces_the_docs(tmp_path):
    """The kv-plan command in the README, run as written (its outputs, /tmp/kv-plan, redirected to a temp folder),
    gives exactly the plan and trace committed in docs/kv-plan/; as written it touches no tracked file."""
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    lines = [line for line in (root / "README.md").read_text().splitlines()
             if line.startswith(".venv/bin/brisk kv-plan")]
    assert len(lines) == 1, lines
    assert lines[0] in (root / "docs" / "kv-plan.md").read_text()  # the docs quote the same command
    argv = shlex.split(lines[0])[1:]
    assert not [a for a in argv if "docs/" in a], argv  # a newcomer running it rewrites nothing in the clone
    assert sum("/tmp/kv-plan" in a for a in argv) == 3, argv
    argv = [a.replace("/tmp/kv-plan", str(tmp_path)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "brisk", *argv], capture_output=True, text=True, timeout=600,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr
    docs = root / "docs" / "kv-plan"
    assert (tmp_path / "trace.jsonl").read_text() == (docs / "trace.jsonl").read_text()
    assert json.loads((tmp_path / "plan.json").read_text()) == json.loads((docs / "plan.json").read_text())
    assert {p.name for p in tmp_path.glob("*.png")} == {p.name for p in docs.glob("*.png")}


def test_cli_bad_input_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "brisk", "kv-plan", "--memory", "lots"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--memory" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": "many", "output_tokens": 3}\n')
    proc = subprocess.run([sys.executable, "-m", "brisk", "kv-plan", "--trace", str(bad)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "t.jsonl:1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "brisk", "kv-plan", "--block-sizes", "2048", "--memory", "1GiB",
                           "--max-model-len", "2048"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "block_size must be in [1, 1024]" in proc.stderr  # brisk serve's own check


# -- validation against the real engine --------------------------------------------------------------
def validation_trace(seed: int = 7) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    trace = []
    for i in range(28):
        group = ("a", "b", None, None)[i % 4]
        prompt = int(rng.integers(150, 200)) if i % 5 == 4 else int(rng.integers(45, 90))
        trace.append(TraceRequest(float(i // 2 * 3), prompt, int(rng.integers(3, 30)),
                                  prefix_group=group, prefix_tokens=40 if group else 0))
    return trace


def engine_replay(demo, trace, num_blocks: int, block_size: int, budget: int) -> tuple[list[int], int]:
    """Add each request at its arrival step (no wall clock), step, and read used blocks after every step."""
    rng = np.random.default_rng(0)
    prefixes = {g: [int(t) for t in rng.integers(1000, 20000, 40)] for g in ("a", "b")}
    engine = LLMEngine(demo, CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
                       SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget, max_model_len=256))
    steps = sorted({int(r.arrival_s) for r in trace})
    used, step = [], 0
    while step <= steps[-1] or engine.has_unfinished_requests():
        for r in trace:
            if int(r.arrival_s) == step:
                head = prefixes[r.prefix_group] if r.prefix_group else []
                tail = [int(t) for t in rng.integers(1000, 20000, r.prompt_tokens - len(head))]
                engine.add_request(head + tail, SamplingParams(max_tokens=r.output_tokens, temperature=0,
                                                               ignore_eos=True))
        engine.step()
        used.append(engine.stats().kv_blocks_used)
        step += 1
    return used, engine.scheduler.num_preemptions


@pytest.mark.parametrize("num_blocks,budget", [(200, 4096), (24, 4096), (200, 64)],
                         ids=["roomy", "preempting", "chunked-prefill"])
def test_plan_matches_a_real_engine_run(demo, num_blocks, budget):
    """kv-plan's engine simulation against brisk's engine with the model, stepped through the
    same trace: blocks in use after every step, the peak, and preemptions agree within 2%."""
    trace = validation_trace()
    real, real_preemptions = engine_replay(demo, trace, num_blocks, 16, budget)
    sim = simulate_engine(trace, EngineSimConfig(num_blocks, 16, 64, budget, 256), STEPS, "paged",
                          arrival_steps=[int(r.arrival_s) for r in trace])
    n = max(len(real), len(sim.used_blocks))
    real += [0] * (n - len(real))
    simulated = sim.used_blocks + [0] * (n - len(sim.used_blocks))
    error = sum(abs(a - b) for a, b in zip(real, simulated)) / sum(real)
    assert error <= 0.02, (error, real, simulated)
    assert abs(max(simulated) - max(real)) <= 0.02 * max(real)
    assert abs(sim.num_preemptions - real_preemptions) <= 0.02 * max(real_preemptions, 1)
    if num_blocks == 24:
        assert real_preemptions > 0
    if budget == 64:  # the 150-200-token prompts took several steps to prefill
        assert sum(r.prompt_tokens for r in trace) > 64 * len({r.arrival_s for r in trace})
