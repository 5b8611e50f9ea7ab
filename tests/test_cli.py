"""`brisk generate` end to end in fresh processes: JSON output, load report, conversion cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _generate(cache: Path, *args):
    env = {**os.environ, "BRISK_CACHE": str(cache)}
    result = subprocess.run([sys.executable, "-m", "brisk", "generate", *args], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_json_output_and_conversion_cache_miss_then_hit(tmp_path, demo):
    cache = tmp_path / "cache"
    args = ["--json", "--chat", "--max-tokens", "12", "Name a primary color."]
    first = json.loads(_generate(cache, *args).stdout)
    second = json.loads(_generate(cache, *args).stdout)

    assert first["load_report"]["conversion_cache"] == "miss"
    assert second["load_report"]["conversion_cache"] == "hit"
    assert "dequantize_write" in first["load_report"]["phases_ms"]
    assert "dequantize_write" not in second["load_report"]["phases_ms"]
    for phase in ("imports", "open_mmap", "module_build", "first_forward"):
        assert second["load_report"]["phases_ms"][phase] > 0
    # greedy: same output from a converted and a cached load, and equal to the in-process model
    assert first["token_ids"] == second["token_ids"]
    prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "Name a primary color."}])
    assert second["prompt_tokens"] == len(prompt)
    assert second["completion_tokens"] == len(second["token_ids"]) <= 12
    assert second["text"] == demo.tokenizer.decode(second["token_ids"])
    assert second["timings"]["ttft_ms"] > 0
    # the report names the KV cache's element type the engine chose (auto resolves to a real one)
    from brisk.kv_dtype import DTYPES

    assert second["load_report"]["kv_cache_dtype"] in DTYPES


def test_streamed_text_equals_decoded_tokens(demo, brisk_cache):
    args = ["--max-tokens", "10", "--ignore-eos", "The three primary colors are"]
    streamed = _generate(brisk_cache, *args).stdout
    data = json.loads(_generate(brisk_cache, "--json", *args).stdout)
    assert streamed == data["text"] + "\n"
    assert data["completion_tokens"] == 10


def test_seeded_sampling_is_reproducible(brisk_cache):
    args = ["--json", "--max-tokens", "16", "--ignore-eos", "--temperature", "0.9", "--seed", "7", "Once upon a time"]
    a = json.loads(_generate(brisk_cache, *args).stdout)
    b = json.loads(_generate(brisk_cache, *args).stdout)
    assert a["token_ids"] == b["token_ids"]
