"""Models from the Hugging Face Hub (`brisk serve ORG/NAME`, `ORG/NAME-GGUF:QUANT`), against a local
stand-in for the Hub's HTTP API (tests/hub_standin.py) through HF_ENDPOINT: a checkpoint and a GGUF
are downloaded into brisk's cache and run, an interrupted download resumes, HF_HUB_OFFLINE=1 uses
the cache, and a model that cannot arrive is one clear error, exit 2, before torch is imported."""

import os
from pathlib import Path

import pytest
import torch

from brisk.errors import ModelLoadError
from brisk.loading.loader import load
from brisk.models.registry import resolve

from hub_standin import HubStandIn
from test_bad_input import write_tiny_gguf
from test_serve_flags import serve_fails


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hub-repos")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(root / "tiny")
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(str(root / "tiny" / "tokenizer.json"))
    checkpoint = {**_files(root / "tiny"), "README.md": b"# tiny", "original/consolidated.pth": b"not read"}
    gguf = write_tiny_gguf(root / "tiny-F32.gguf").read_bytes()
    return {"org/tiny": checkpoint,
            "org/tiny-GGUF": {"tiny-F32.gguf": gguf, "tiny-Q4_K_M.gguf": gguf, "README.md": b"# gguf"},
            **_moe_repos(root)}


def _moe_repos(root: Path) -> dict[str, dict[str, bytes]]:
    """Qwen3-30B-A3B under its real Hub names, at a tiny size: the checkpoint in shards with their index (as the
    Hub has it), and the GGUF repo's Q4_K_M (a random Qwen3-MoE-shaped GGUF in llama.cpp's Q4_K_M mix)."""
    from tokenizers import Tokenizer, models
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from brisk.loading.gguf_random import Shape, write_random_gguf

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64)
    Qwen3MoeForCausalLM(config).save_pretrained(root / "moe", max_shard_size="40KB")
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(str(root / "moe" / "tokenizer.json"))
    shape = Shape(hidden=256, layers=1, ffn=512, heads=4, kv_heads=2, context=64, head_dim=64, experts=4,
                  experts_used=2, expert_ffn=256, arch="qwen3moe")
    gguf = write_random_gguf(root / "moe-Q4_K_M.gguf", shape, "Q4_K_M", None, small_vocab=64).read_bytes()
    return {"Qwen/Qwen3-30B-A3B": _files(root / "moe"),
            "unsloth/Qwen3-30B-A3B-GGUF": {"Qwen3-30B-A3B-Q4_K_M.gguf": gguf, "Qwen3-30B-A3B-Q8_0.gguf": b"not read"}}


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    with HubStandIn(repos) as standin:
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        # huggingface_hub read HF_ENDPOINT when it was imported (transformers imports it): set what it derived
        monkeypatch.setattr(constants, "ENDPOINT", standin.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            standin.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setenv("BRISK_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield standin


def test_a_checkpoint_repo_downloads_what_brisk_reads_and_runs(hub, tmp_path):
    source = resolve("org/tiny")
    assert source.kind == "hf-dir" and source.from_hub and source.served_name == "org/tiny"
    assert Path(str(tmp_path / "cache" / "hub")) in source.path.parents  # brisk's cache, not ~/.cache
    assert (source.path / "model.safetensors").is_file() and not (source.path / "original").exists()
    loaded = load(source, warmup=False, quantization="none")
    assert loaded.config.num_layers == 1


def test_a_gguf_repo_gives_the_quant_asked_for_or_q4_k_m(hub):
    assert resolve("org/tiny-GGUF:F32").path.name == "tiny-F32.gguf"
    assert resolve("org/tiny-GGUF").path.name == "tiny-Q4_K_M.gguf"  # llama-server's default type
    with pytest.raises(ModelLoadError, match=r"'org/tiny-GGUF' has no GGUF of type Q2_K; its GGUFs: tiny-F32"):
        resolve("org/tiny-GGUF:Q2_K")
    assert load("org/tiny-GGUF:F32", warmup=False).config.num_layers == 1


def test_a_mixture_of_experts_arrives_by_its_hub_names(hub):
    """`brisk serve Qwen/Qwen3-30B-A3B` (safetensors shards) and `unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M`."""
    source = resolve("Qwen/Qwen3-30B-A3B")
    assert source.kind == "hf-dir" and len(list(source.path.glob("model-*.safetensors"))) > 1
    loaded = load(source, warmup=False, quantization="none")
    assert loaded.config.moe.num_experts == 4 and loaded.config.moe.norm_topk_prob
    gguf = resolve("unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M")
    assert gguf.path.name == "Qwen3-30B-A3B-Q4_K_M.gguf"
    loaded = load(gguf, warmup=False)
    assert loaded.config.moe.experts_per_token == 2 and loaded.report.parameters_active < loaded.report.parameters_total


def test_a_dropped_download_resumes_where_it_stopped(hub):
    """The connection drops 15 MB into a 24 MB file: huggingface_hub asks for the rest from the last
    whole chunk it wrote (10 MB), not for the whole file again. (It keeps no partial file across
    processes since huggingface_hub 1.0: a restarted server downloads that file again.)"""
    data = os.urandom(24 << 20)
    hub.repos["org/big-GGUF"] = {"big-Q8_0.gguf": data}
    hub.drop_after["big-Q8_0.gguf"] = 15 << 20
    assert resolve("org/big-GGUF:Q8_0").path.read_bytes() == data
    assert hub.ranges == [("big-Q8_0.gguf", 10 << 20)]


def test_offline_uses_the_cache_and_otherwise_says_what_to_do(hub, monkeypatch):
    first = resolve("org/tiny-GGUF:F32").path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = len(hub.requests)
    assert resolve("org/tiny-GGUF:F32").path == first and len(hub.requests) == before  # no request at all
    with pytest.raises(ModelLoadError, match=r"model 'org/tiny' is not in brisk's cache .* HF_HUB_OFFLINE"):
        resolve("org/tiny")


def test_unknown_repo_is_one_line(hub):
    with pytest.raises(ModelLoadError, match=r"Hub repo 'org/nope' was not found .* HF_TOKEN"):
        resolve("org/nope")


def test_serve_without_the_hub_fails_before_torch_is_imported(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BRISK_CACHE": str(tmp_path)}
    line, _, imported = serve_fails("Qwen/Qwen3-0.6B", env=env)
    assert line.startswith("brisk: error: model 'Qwen/Qwen3-0.6B' is not in brisk's cache")
    assert " torch" not in imported


def test_a_hub_that_does_not_answer_is_one_line_without_retries(tmp_path):
    """Without HF_HUB_OFFLINE, an endpoint that refuses connections (no network) is found out by one probe: the error
    comes with no retry of huggingface_hub's (it used to back off for ~24 s and print 10 lines first)."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{closed}", "BRISK_CACHE": str(tmp_path)}
    env.pop("HF_HUB_OFFLINE", None)
    line, _, _ = serve_fails("Qwen/Qwen3-0.6B", env=env)  # one line on stderr: no "Retrying in 1s" before it
    assert line.startswith("brisk: error: model 'Qwen/Qwen3-0.6B' is not in brisk's cache")


def test_the_probe_sees_a_listening_hub_and_a_closed_port(hub, monkeypatch):
    import huggingface_hub.constants as constants

    from brisk.models import hub as hub_module

    assert hub_module.hub_reachable()  # the stand-in listens
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:1")
    assert not hub_module.hub_reachable()
