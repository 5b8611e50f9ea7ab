"""`brisk serve`'s start: every mistake fails before anything heavy (no torch, no FastAPI import,
no weights read) as one line and exit 2; vLLM's flags mean what they mean there; the access and
engine-stats log lines; GET /v1/models/{id} and model aliases with the official client."""

import json
import logging
import socket
import subprocess
import sys
import time

import pytest

from brisk.cli import build_parser
from brisk.engine.factory import engine_configs
from brisk.errors import BriskError
from brisk.server.preflight import chat_template

from live_server import serve_engine
from engines import make_engine


def serve_fails(*argv: str, cwd=None, env=None) -> tuple[str, float, str]:
    """Run `brisk serve ARGV` with -X importtime; returns (the error line, seconds, modules imported)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "brisk", "serve", *argv],
                          capture_output=True, text=True, timeout=60, cwd=cwd, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    imported = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("import time:"))
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines  # one line, no usage block
    assert lines[0].startswith("brisk: error: "), lines
    return lines[-1], elapsed, imported


@pytest.mark.parametrize("argv,needle", [
    (["--max-model-len", "16384"], "exceeds the model's context window of 8192 tokens"),
    (["--max-model-len", "999999"], "context window of 8192"),  # the window, not "raise KV memory"
    (["--kv-cache-memory", "1KB"], "cannot hold one max-length sequence"),
    (["--kv-cache-host-bytes", "lots"], "--kv-cache-host-bytes: memory size 'lots' is not understood"),
    (["--kv-cache-host-bytes", "1000TiB"], "--kv-cache-host-bytes 1024000.0 GiB is more than the"),
    (["--model", "/nope/model.gguf"], "not found"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 0.95]"),
    (["--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: 'fp4' is not a KV cache dtype; use one of auto"),
    (["--chat-template", "{% if %}"], "--chat-template: line 1"),
    (["--chat-template", "not-a-file.jinja"], "no such file, and not a Jinja template"),
    (["--block-size", "4096"], "block_size must be in [1, 1024]"),
    (["--max-model", "2048"], "unrecognized arguments: --max-model; did you mean --max-model-len?"),  # no abbreviations
    (["--max-num-seq", "8"], "did you mean --max-num-seqs?"),
    (["--enable-prefix-cache"], "did you mean --enable-prefix-caching?"),
    (["--port", "99999"], "argument --port: must be in 1-65535, got 99999"),
    (["--port", "-1"], "argument --port: must be in 1-65535, got -1"),
    (["--port", "http"], "argument --port: expected an integer, got 'http'"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64' (choose from 'auto', 'float32'"),
    (["--device", "mps"], "argument --device: 'mps' is not a device brisk runs on"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
    (["--max-num-batched-tokens", "-5"], "argument --max-num-batched-tokens: must be >= 1, got -5"),
    (["--max-model-len", "0"], "argument --max-model-len: must be >= 1, got 0"),
    (["--tokenizer-threads", "0"], "argument --tokenizer-threads: must be >= 1, got 0"),
    (["--request-timeout", "0"], "argument --request-timeout: must be > 0, got 0"),
    (["--body-timeout", "nan"], "argument --body-timeout: expected a finite number, got 'nan'"),
    (["--context-policy", "drop"], "argument --context-policy: invalid choice: 'drop' (choose from 'reject'"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 4}'], "unknown method 'eagle'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 32}'], "must be in [1, 16], got 32"),
    (["--speculative-config", '{"model": "/nope/draft.gguf", "num_speculative_tokens": 4}'],
     "--speculative-config model: "),
], ids=["over-window", "far-over-window", "kv-too-small", "host-tier-size", "host-tier-too-big", "no-model", "gpu-util", "fp8-kv", "template-syntax",
        "template-missing", "block-size", "abbreviation", "typo", "typo-2", "port-high", "port-negative", "port-text",
        "dtype", "device", "max-num-seqs", "batched-tokens", "max-model-len-0", "tokenizer-threads",
        "request-timeout", "body-timeout-nan", "choice", "spec-method", "spec-k", "spec-draft-missing"])
def test_mistakes_fail_fast_in_one_line(argv, needle):
    line, elapsed, imported = serve_fails(*argv)
    assert needle in line, line
    assert " torch" not in imported and "fastapi" not in imported  # nothing heavy was imported


def _cpu_only_torch() -> bool:
    import torch

    return torch.version.cuda is None


@pytest.mark.skipif(not _cpu_only_torch(), reason="this torch has CUDA")
def test_cuda_without_a_usable_gpu_is_refused_before_torch_loads(tmp_path):
    """This machine has a CPU-only torch: --device cuda fails from torch's version file, before the
    model is resolved, torch imported or a port bound; `generate` likewise."""
    line, _, imported = serve_fails("--device", "cuda", "--port", "1")  # port 1 would need root: never reached
    assert "--device cuda: this torch build has no CUDA" in line and " torch" not in imported
    proc = subprocess.run([sys.executable, "-m", "brisk", "generate", "--device", "cuda:1", "hi"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("brisk: error: --device cuda:1: "), proc.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is greater than --max-replicas 2"),
    (["--replicas", "5", "--min-replicas", "1", "--max-replicas", "2"], "--replicas 5 must lie between"),
    (["--replicas", "64"], "need 64 CPUs; this machine has"),
    (["--replicas", "2", "--ray-address", "127.0.0.1:9"], "--ray-address 127.0.0.1:9: cannot connect"),
    (["--replicas", "2", "--ray-address", "nonsense"], "expected auto, host:port or ray://host:port"),
    (["--ray-address", "auto"], "--ray-address applies to Ray Serve only; add --replicas N"),
    (["--replicas", "2", "--target-ongoing-requests", "0"], "--target-ongoing-requests must be > 0"),
    (["--replicas", "1", "--stream-interval", "0"], "--stream-interval must be >= 1 (tokens per message), got 0"),
    (["--stream-interval", "4"], "--stream-interval applies to Ray Serve only; add --replicas N"),
    (["--replica-stream", "ray"], "--replica-stream applies to Ray Serve only; add --replicas N"),
], ids=["zero-replicas", "min-over-max", "outside-range", "too-many-cpus", "unreachable", "bad-address",
        "address-without-replicas", "target", "stream-interval", "stream-interval-without-replicas",
        "replica-stream-without-replicas"])
def test_scale_out_mistakes_fail_fast_without_starting_ray(argv, needle):
    line, _, imported = serve_fails(*argv)
    assert needle in line, line
    assert " ray" not in imported and " torch" not in imported


def test_scale_out_without_ray_installed_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None; from brisk.cli import main; "
            "sys.exit(main(['serve', '--replicas', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "pip install 'brisk-llm[ray]'" in proc.stderr


def test_single_process_serve_does_not_import_ray():
    # --help parses every flag (the scale-out group included) and exits; nothing may pull Ray in
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "brisk", "serve", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--replicas" in proc.stdout
    assert " ray" not in proc.stderr
    # and the modules that serve one process with
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import brisk.cli, brisk.cluster.settings, "
                           "brisk.server.serve, brisk.server.app, brisk.engine.async_engine"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " ray" not in proc.stderr


def test_not_a_gguf_file_fails_fast(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a model")
    line, elapsed, imported = serve_fails("--model", str(bad))
    assert "not a GGUF file" in line and " torch" not in imported


@pytest.mark.parametrize("kwargs, needle", [
    ({"tokenizer_model": "bert"}, "GGUF tokenizer type 'bert'"),
    ({"arch": "gptneox"}, "unsupported GGUF architecture 'gptneox'"),
    ({"tensor_type": "IQ2_XXS"}, "tensor token_embd.weight uses quantization IQ2_XXS"),
])
def test_a_gguf_brisk_cannot_run_fails_before_anything_loads(tmp_path, kwargs, needle):
    """Architecture, tokenizer, tensor type: named with the file in one line, before torch and before
    any conversion (nothing is written to the cache)."""
    import gguf

    from test_bad_input import write_tiny_gguf

    if "tensor_type" in kwargs:
        kwargs["tensor_type"] = gguf.GGMLQuantizationType[kwargs["tensor_type"]]
    path = write_tiny_gguf(tmp_path / "m.gguf", **kwargs)
    env = {**__import__("os").environ, "BRISK_CACHE": str(tmp_path / "cache")}
    line, _, imported = serve_fails("--model", str(path), env=env)
    assert "m.gguf" in line and needle in line, line
    assert " torch" not in imported and not (tmp_path / "cache" / "converted").exists()


def test_a_port_in_use_fails_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line, elapsed, imported = serve_fails("--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in line and "another server" in line
    assert " torch" not in imported


def parse_serve(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_vllm_flags_mean_what_they_mean_in_vllm():
    for argv, enabled in (((), True), (("--enable-prefix-caching",), True), (("--no-enable-prefix-caching",), False),
                          (("--no-prefix-caching",), False)):
        cache, _ = engine_configs(parse_serve(*argv), 2048)
        assert cache.enable_prefix_caching is enabled, argv
    cache, _ = engine_configs(parse_serve("--gpu-memory-utilization", "0.3"), 2048)
    assert cache.kv_cache_fraction == 0.3 and cache.kv_cache_memory is None
    args = parse_serve("--served-model-name", "smol", "gpt-4o", "--uvicorn-log-level", "info",
                       "--disable-log-requests")
    assert args.served_model_name == ["smol", "gpt-4o"] and args.uvicorn_log_level == "info"
    assert args.disable_log_requests is True
    with pytest.raises(SystemExit):  # both ways of sizing the KV cache at once: argparse refuses
        parse_serve("--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.5")


def test_chat_template_from_a_file_or_inline(tmp_path, demo):
    template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert chat_template(str(path)) == template and chat_template(template) == template
    with pytest.raises(BriskError, match="no such file"):
        chat_template(str(tmp_path / "missing.jinja"))
    tok = demo.tokenizer
    original = tok.chat_template_source
    try:
        tok.set_chat_template(template)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user:hi]"
    finally:
        tok.set_chat_template(original)


def test_access_and_stats_lines_models_retrieve_and_aliases(demo, caplog):
    caplog.set_level(logging.INFO)
    with serve_engine(make_engine(demo), served_model_name="smol", model_aliases=("smol", "gpt-4o"),
                      log_requests=True, log_stats_interval_s=0.2) as live:
        client = live.openai()
        card = client.models.retrieve("gpt-4o")  # the official SDK's models.retrieve
        assert card.id == "gpt-4o" and [m.id for m in client.models.list().data] == ["smol", "gpt-4o"]
        reply = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=6, extra_body={"ignore_eos": True})
        assert reply.model == "smol"  # responses carry the first name
        with live.client() as http:
            assert http.get("/v1/models/nope").status_code == 404
        deadline = time.monotonic() + 10
        while not any(r.name == "brisk.stats" for r in caplog.records):
            assert time.monotonic() < deadline, "no engine stats line"
            time.sleep(0.1)
    access = [r.getMessage() for r in caplog.records if r.name == "brisk.access"]
    chat = next(line for line in access if "POST /v1/chat/completions" in line)
    assert " 200 " in chat and f"prompt={reply.usage.prompt_tokens}" in chat and "completion=6" in chat
    assert "ttft=" in chat and "total=" in chat and "prompt_text" not in chat  # no prompt text by default
    assert any('"GET /v1/models/nope" 404' in line for line in access)
    stats = next(r.getMessage() for r in caplog.records if r.name == "brisk.stats")
    for needle in ("generation", "tok/s", "running", "waiting", "KV usage", "prefix-cache hits"):
        assert needle in stats


def _model_files(tmp_path):
    """A directory with a config and a tokenizer but no weights, a lone weights file, and a truncated GGUF."""
    from brisk.models.registry import resolve

    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}))
    (folder / "tokenizer.json").write_text("{}")
    lone = tmp_path / "model.safetensors"
    lone.write_bytes(b"\\x08\\x00\\x00\\x00\\x00\\x00\\x00\\x00{}      ")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(resolve(None).path.read_bytes()[:3000])
    return folder, lone, cut


@pytest.mark.parametrize("which, needles", [
    ("folder", ["no weights (no *.safetensors file)"]),
    ("lone", ["a weights file alone is not a model; pass its directory"]),
    ("cut", ["GGUF header is cut short or corrupt", "download it again"]),
])
def test_a_model_that_cannot_load_fails_before_the_port_is_bound(tmp_path, which, needles):
    """Newcomers' cases: each is one `brisk: error:` line before anything is bound or imported (the folder without
    weights bound the port, logged "listening" and failed 2.9 s later), and none carries Python's internals."""
    folder, lone, cut = _model_files(tmp_path)
    line, _, imported = serve_fails(str({"folder": folder, "lone": lone, "cut": cut}[which]))
    assert all(n in line for n in needles), line
    assert "struct" not in line and "unpack" not in line and "buffer" not in line, line
    assert " torch" not in imported and "fastapi" not in imported
