"""`POST /v1/embeddings` (brisk/server/embeddings.py, brisk/loading/pooling.py): a tiny random Qwen3 embedding
model built by transformers (sentence-transformers' modules.json: last-token pooling, L2-normalised, as
Qwen3-Embedding) against transformers' own hidden states pooled and normalised, from its HF directory and from
the GGUF llama.cpp's converter writes; mean and CLS pooling; every input shape, `dimensions`, both encodings; the
official SDK and LangChain's OpenAIEmbeddings; the window; which routes each kind of model serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from brisk.loading.loader import load
from engines import make_engine
from live_server import serve_engine
from llamacpp import convert_hf_to_gguf

MODEL = "smollm2-135m-instruct"  # the served name the test servers keep
TEXTS = ["The cat sat on the mat.", "Embeddings map text to vectors.", "你好，世界", "a"]


def _sentence_transformers_files(folder: Path, mode: str = "lasttoken") -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  f"pooling_mode_{mode}": True}))
    (folder / "2_Normalize").mkdir(exist_ok=True)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, demo, brisk_cache):
    """(HF model, its directory, the converter's GGUF of it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("qwen3-embedding") / "model"
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=demo.config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=True, attn_implementation="eager")
    hf = Qwen3ForCausalLM(config).eval()
    hf.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo.model_dir / f, folder / f)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # loaded as is by the converter (as tests/test_model_families.py does)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _sentence_transformers_files(folder)
    return hf, folder, convert_hf_to_gguf(folder, folder.parent / "embedding-f32.gguf")


def _reference(hf, tokenizer, text: str, mode: str = "last") -> np.ndarray:
    """transformers' final hidden states pooled as sentence-transformers does, L2-normalised."""
    ids = tokenizer.encode(text)
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].double()
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[mode]
    return (vector / vector.norm()).numpy()


def _cosine_distance(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return 1 - float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def server(embedder):
    _, folder, _ = embedder
    with serve_engine(make_engine(load(str(folder)))) as live:
        yield live


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_vectors_equal_transformers_pooled_and_normalised(embedder, source, brisk_cache):
    hf, folder, gguf = embedder
    loaded = load(str(folder if source == "hf" else gguf))
    assert loaded.pooling is not None and loaded.pooling.mode == "last" and loaded.pooling.normalize
    with serve_engine(make_engine(loaded)) as live:
        data = live.openai().embeddings.create(model=MODEL, input=TEXTS).data
    for text, item in zip(TEXTS, data):
        assert _cosine_distance(item.embedding, _reference(hf, loaded.tokenizer, text)) < 1e-5, text
        assert abs(np.linalg.norm(item.embedding) - 1) < 1e-5


def test_a_quantized_gguf_with_its_own_lm_head_embeds(embedder, tmp_path, brisk_cache):
    """An embedding model whose file also holds an untied LM head (`output.weight`, here Q8_0 as the converter
    writes it): the head is never read, and the model loads and pools as the float one does, up to Q8_0's
    rounding (it failed: `lm_head.qweight belongs to a Identity`)."""
    from transformers import Qwen3ForCausalLM

    hf, folder, _ = embedder
    untied = tmp_path / "untied"
    shutil.copytree(folder, untied)
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    model = Qwen3ForCausalLM.from_pretrained(untied).eval()
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight))
    model.save_pretrained(untied)
    gguf = convert_hf_to_gguf(untied, tmp_path / "untied-q8_0.gguf", outtype="q8_0")
    loaded = load(str(gguf))
    assert loaded.pooling is not None and loaded.pooling.mode == "last"
    assert "lm_head" not in loaded.report.weight_formats
    with serve_engine(make_engine(loaded)) as live:
        data = live.openai().embeddings.create(model=MODEL, input=TEXTS).data
    for text, item in zip(TEXTS, data):
        assert _cosine_distance(item.embedding, _reference(hf, loaded.tokenizer, text)) < 2e-3, text


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_mean_and_cls_pooling_as_the_pooling_config_says(embedder, mode, tmp_path, brisk_cache):
    hf, folder, _ = embedder
    other = tmp_path / mode
    shutil.copytree(folder, other)
    _sentence_transformers_files(other, {"mean": "mean_tokens", "cls": "cls_token"}[mode])
    loaded = load(str(other))
    assert loaded.pooling.mode == mode
    with serve_engine(make_engine(loaded, prefix=True)) as live:
        client = live.openai()
        client.embeddings.create(model=MODEL, input=TEXTS[0] + " and more")  # a cached prefix must not shorten it
        data = client.embeddings.create(model=MODEL, input=TEXTS).data
    for text, item in zip(TEXTS, data):
        assert _cosine_distance(item.embedding, _reference(hf, loaded.tokenizer, text, mode)) < 1e-5, text


def test_every_input_shape_dimensions_and_both_encodings(server, embedder):
    hf, _, _ = embedder
    client = server.openai()
    tok = server.state.tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    by_text = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in by_text.data] == list(range(len(TEXTS)))
    assert by_text.usage.prompt_tokens == sum(map(len, ids)) == by_text.usage.total_tokens
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    one_ids = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    b64 = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    for a, b, c in zip(by_text.data, by_ids.data, b64.data):
        assert a.embedding == b.embedding and np.allclose(a.embedding, c.embedding, rtol=0, atol=0)
    assert one.data[0].embedding == one_ids.data[0].embedding == by_text.data[1].embedding
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16, encoding_format="float")
    want = np.asarray(by_text.data[0].embedding[:16])
    assert len(short.data[0].embedding) == 16 and np.allclose(short.data[0].embedding, want / np.linalg.norm(want),
                                                              atol=1e-6)


def test_inputs_over_the_window_are_a_400_or_cut_when_asked(embedder, brisk_cache):
    _, folder, _ = embedder
    from brisk.config import CacheConfig
    from brisk.engine.engine import LLMEngine
    from brisk.engine.scheduler import SchedulerConfig

    engine = LLMEngine(load(str(folder), max_model_len=32), CacheConfig(num_gpu_blocks_override=64),
                       SchedulerConfig(max_model_len=32))
    with serve_engine(engine) as live, live.client() as http:
        long = "word " * 60
        r = http.post("/v1/embeddings", json={"input": ["short", long]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]", r.text
        r = http.post("/v1/embeddings", json={"input": ["short", long], "truncate_prompt_tokens": 20})
        assert r.status_code == 200 and r.json()["brisk"]["truncated_inputs"] == [1]
        assert r.json()["usage"]["prompt_tokens"] == len(live.state.tokenizer.encode("short")) + 20
        r = http.post("/v1/embeddings", json={"input": "short", "dimensions": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_langchain_embeds_documents_and_a_query(server, embedder):
    """LangChain's OpenAIEmbeddings (check_embedding_ctx_length off: it would fetch tiktoken's OpenAI vocabulary)."""
    from langchain_openai import OpenAIEmbeddings

    hf, _, _ = embedder
    lc = OpenAIEmbeddings(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", check_embedding_ctx_length=False)
    docs = lc.embed_documents(TEXTS[:2])
    query = lc.embed_query(TEXTS[2])
    tok = server.state.tokenizer
    for text, vector in zip(TEXTS[:3], docs + [query]):
        assert _cosine_distance(vector, _reference(hf, tok, text)) < 1e-5


def test_each_kind_of_model_names_the_routes_it_serves(server, demo):
    with server.client() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "wrong_model_type"
    with serve_engine(make_engine(demo)) as live, live.client() as http:
        r = http.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]


def test_a_thirty_two_input_batch_runs_in_shared_steps(server):
    """Embedding requests are prefill-only requests in the scheduler's batches: 32 inputs in one request share steps
    (fewer steps than inputs) and each gets what it gets alone."""
    client = server.openai()
    texts = [f"sentence number {i} about something" for i in range(32)]
    before = server.engine_stats().num_steps
    batch = client.embeddings.create(model=MODEL, input=texts, encoding_format="float").data
    steps = server.engine_stats().num_steps - before
    assert steps < 32, steps
    alone = client.embeddings.create(model=MODEL, input=texts[7], encoding_format="float").data[0]
    assert _cosine_distance(alone.embedding, batch[7].embedding) < 1e-6
