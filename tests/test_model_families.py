"""Model families against transformers itself. For each family a tiny random-weight model built by
transformers (fp32, eager attention, random norm weights so that Gemma's (1 + w) shows, prompts
longer than any sliding window or RoPE original context) is saved as an HF directory and converted
to GGUF by llama.cpp's own `convert_hf_to_gguf.py`; brisk loads both and must give HF's logits
(1e-4 of their range) and HF's greedy tokens through the serving engine.

Tokenizers: byte-level BPE families use the demo's tokenizer (llama.cpp's converter knows its
pre-tokenizer); Gemma and Gemma 2, whose converter wants a SentencePiece model, get one trained
here, and brisk's SentencePiece vocabulary rebuilt from the GGUF must tokenize as transformers'
tokenizer.json made from the same model."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from brisk.engine.sampling_params import SamplingParams
from brisk.errors import ModelLoadError
from brisk.llm import LLM
from brisk.loading.gguf_convert import converted_dir
from brisk.loading.loader import load
from brisk.models.simple_cache import SingleSequenceCache
from brisk.tokenizer import Tokenizer

from live_server import serve_engine
from llamacpp import convert_hf_to_gguf, llamacpp_dir, train_sentencepiece
from test_doctor import run_doctor, statuses

PROMPT_LEN, NEW_TOKENS, MAX_LEN = 72, 24, 256


@dataclass(frozen=True)
class Family:
    config: str  # transformers' config and model classes
    model: str
    kwargs: dict = field(default_factory=dict)
    spm: bool = False  # needs a SentencePiece tokenizer (Gemma 1/2's converter reads tokenizer.model)


COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=MAX_LEN, bos_token_id=2, eos_token_id=1,
              pad_token_id=0, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
FAMILIES = {
    "llama31": Family("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, tie_word_embeddings=True), spm=True),
    # query_pre_attn_scalar = head_dim: llama.cpp's GGUF path infers it (hidden/heads for the 27Bs only)
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, sliding_window=16, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, tie_word_embeddings=True), spm=True),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=16, query_pre_attn_scalar=16, num_hidden_layers=7, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", dict(
        original_max_position_embeddings=64, sliding_window=48,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [2.0 + 0.2 * i for i in range(8)]})),
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=8)),
    # mixtures of experts: 8 experts (Mixtral 4), 2 per token; Qwen3-MoE renormalises its top k (as
    # Qwen3-30B-A3B does and llama.cpp's qwen3moe always does), Qwen2-MoE and OLMoE do not
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                 intermediate_size=96)),
    "qwen3moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen2moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    # OLMoE's heads are all key/value heads (llama.cpp's olmoe takes no GQA: its k_norm spans the hidden size)
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, num_key_value_heads=4,
                                                             intermediate_size=32, rms_norm_eps=1e-5)),
    # gpt-oss: sinks, every other layer sliding (window 16 < the prompt), YaRN past a 32-token original context
    # (its ramp truncated, as llama.cpp always computes it: the Hub's truncate false is test_gpt_oss's), biases
    # everywhere, the clamped SwiGLU at llama.cpp's constant limit (7, which experts of scale 2 reach), the
    # top-k-then-softmax router
    "gptoss": Family("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": 32})),
}


@dataclass
class Built:
    hf: torch.nn.Module
    hf_dir: Path
    gguf: Path


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    """A SentencePiece vocabulary with Gemma's special tokens and Gemma 2's real chat template."""
    # fixed English text (the README as it stood at da625e8), so that editing the README changes no test vocabulary
    corpus = (Path(__file__).resolve().parent / "data" / "sentencepiece_corpus.md").read_text(encoding="utf-8")
    corpus += "\n".join(["你好，世界。今天天气很好。", "Grüße aus Köln — naïve façade", "日本語のテキスト 🙂"] * 20)
    folder = train_sentencepiece(tmp_path_factory.mktemp("spm"), corpus)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (llamacpp_dir() / "models" / "templates" / "google-gemma-2-2b-it.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory, demo, spm_dir, brisk_cache):
    """Each family's model, HF directory and GGUF, made on first use and shared by the tests."""
    cache: dict[str, Built] = {}

    def build(name: str) -> Built:
        if name not in cache:
            cache[name] = _build(name, FAMILIES[name], tmp_path_factory.mktemp(name), demo, spm_dir)
        return cache[name]

    return build


def _build(name: str, family: Family, root: Path, demo, spm_dir: Path) -> Built:
    import transformers

    hf_dir = root / "hf"
    hf_dir.mkdir(parents=True)
    if family.spm:
        for f in spm_dir.iterdir():
            shutil.copy(f, hf_dir / f.name)
        vocab = Tokenizer.from_dir(spm_dir).fast.get_vocab_size()
    else:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo.model_dir / f, hf_dir / f)
        config = json.loads((hf_dir / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = "GPT2Tokenizer"  # loaded as is by the converter (and Phi-3's asks for it)
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
        vocab = demo.config.vocab_size
    cfg = getattr(transformers, family.config)(**{**COMMON, "vocab_size": vocab, **family.kwargs},
                                               attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, family.model)(cfg).eval()
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if "norm" in param_name:  # random norms: a missed (1 + w) or a swapped norm shows
                param.normal_(0.0, 0.3)
            elif param_name.endswith((".mlp.gate.weight", "block_sparse_moe.gate.weight", ".mlp.router.weight")):
                param.normal_(0.0, 0.5)  # routers that choose clearly (no near-ties between experts)
            elif param_name.endswith(("sinks", "_bias", ".bias")):  # gpt-oss's sinks and biases (zeros at init)
                param.normal_(0.0, 0.5)
            elif param_name.endswith("experts.gate_up_proj"):  # gpt-oss: gates past the clamp's limit
                param.normal_(0.0, 2.0)
    hf.save_pretrained(hf_dir)
    return Built(hf, hf_dir, convert_hf_to_gguf(hf_dir, root / f"{name}-f32.gguf"))


def prompt_ids(vocab: int, n: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    hf.generation_config.eos_token_id = None  # run the full length, as brisk's ignore_eos does
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def brisk_logits(path: Path, ids: list[int]) -> torch.Tensor:
    loaded = load(str(path), max_model_len=MAX_LEN, warmup=False, quantization="none")
    cache = SingleSequenceCache(loaded.config, len(ids), torch.float32, "cpu")
    cache.begin(len(ids))
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache))


def brisk_greedy(path: Path, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """Through the engine (paged KV cache, scheduler, the attention backend the model gets)."""
    llm = LLM(str(path), quantization="none", max_model_len=MAX_LEN, num_blocks=64, max_num_batched_tokens=32)
    return llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max()
    torch.testing.assert_close(actual / scale, expected / scale, rtol=0, atol=1e-4)


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_and_greedy_tokens_match_hf(built, name, source):
    model = built(name)
    path = model.hf_dir if source == "hf" else model.gguf
    ids = prompt_ids(model.hf.config.vocab_size)
    assert_logits_close(brisk_logits(path, ids), hf_logits(model.hf, ids))
    assert brisk_greedy(path, ids) == hf_greedy(model.hf, ids)


def test_sentencepiece_gguf_vocabulary_tokenizes_as_transformers(built, brisk_cache):
    """Gemma's GGUF carries the SentencePiece pieces and scores only: brisk's rebuilt tokenizer
    must split text as transformers' tokenizer.json made from the same model."""
    model = built("gemma")
    load(str(model.gguf), max_model_len=MAX_LEN, warmup=False, quantization="none")  # converts it
    ours = Tokenizer.from_dir(converted_dir(brisk_cache, model.gguf, "none")).fast
    reference = Tokenizer.from_dir(model.hf_dir).fast
    texts = ["Hello world", "  two  spaces  ", "brisk serve --port 8000\n\nnext line", "你好，世界。",
             "Grüße — naïve façade 🙂 🦙", "<start_of_turn>user\nhi<end_of_turn>", "ZZZ qqq ÆØÅ 𝔘𝔫𝔦"]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False).ids == \
            reference.encode(text, add_special_tokens=False).ids, text


def test_the_llama31_gguf_holds_its_rope_scaling_as_rope_freqs(built):
    """What made Llama 3.1 GGUFs silently wrong: the scaling lives in a tensor, not in metadata."""
    import gguf

    reader = gguf.GGUFReader(str(built("llama31").gguf))
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}
    assert not any("rope.scaling" in key for key in reader.fields)


def test_a_gguf_tensor_brisk_would_not_read_is_refused(built, tmp_path, brisk_cache):
    import gguf

    reader = gguf.GGUFReader(str(built("llama31").gguf))
    path = tmp_path / "extra-tensor.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, field_ in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if field_.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field_.contents())
        else:
            writer.add_key_value(key, field_.contents(), field_.types[0])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    writer.add_tensor("blk.0.ffn_gate_inp.weight", np.ones((4, 64), dtype=np.float32))  # an MoE router
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_gate_inp\.weight are not read"):
        load(str(path), warmup=False, quantization="none")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_serves_the_openai_sdk_from_its_gguf_and_doctor_finds_nothing_wrong(built, name, tmp_path):
    """The GGUF llama.cpp's converter wrote, behind brisk's server: the official client's replies,
    whole and streamed, agree (greedy), and `brisk doctor --quick` finds no problem."""
    from brisk.engine.engine import LLMEngine
    from brisk.config import CacheConfig
    from brisk.engine.scheduler import SchedulerConfig

    loaded = load(str(built(name).gguf), max_model_len=MAX_LEN)
    engine = LLMEngine(loaded, CacheConfig(num_gpu_blocks_override=256), SchedulerConfig(max_model_len=MAX_LEN))
    with serve_engine(engine, served_model_name=name) as live:
        client = live.openai()
        kw = dict(model=name, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**kw)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        assert whole.usage.completion_tokens == 12 and streamed == whole.choices[0].message.content
        report = run_doctor(live.url, tmp_path)
    assert "problem" not in statuses(report).values(), report["findings"]


def test_qwen3_moe_thinks_through_the_qwen3_reasoning_parser(built):
    """Qwen3-MoE with Qwen3's own chat template (Qwen3-30B-A3B ships the same one) and --reasoning-parser qwen3:
    a thinking block (written here by a regex: the weights are random) comes back as reasoning_content, whole
    and streamed."""
    import copy
    import dataclasses

    from brisk.engine.engine import LLMEngine
    from brisk.config import CacheConfig
    from brisk.engine.scheduler import SchedulerConfig

    loaded = load(str(built("qwen3moe").gguf), max_model_len=MAX_LEN)
    tokenizer = copy.copy(loaded.tokenizer)
    tokenizer.set_chat_template((llamacpp_dir() / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text())
    engine = LLMEngine(dataclasses.replace(loaded, tokenizer=tokenizer), CacheConfig(num_gpu_blocks_override=256),
                       SchedulerConfig(max_model_len=MAX_LEN))
    with serve_engine(engine, served_model_name="qwen3moe", reasoning_parser="qwen3") as live:
        client = live.openai()
        kw = dict(model="qwen3moe", messages=[{"role": "user", "content": "2+2?"}], max_tokens=60, temperature=0,
                  extra_body={"guided_regex": r"<think>[a-z ]{3,20}</think>[A-Za-z ]{3,20}"})
        whole = client.chat.completions.create(**kw).choices[0].message
        reasoning = whole.model_extra["reasoning_content"]
        assert reasoning and whole.content and "think>" not in whole.content + reasoning
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                streamed["content"] += c.delta.content or ""
                streamed["reasoning_content"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
        assert streamed == {"reasoning_content": reasoning, "content": whole.content}


def test_gpt_oss_replies_are_read_by_channel_through_the_sdk(built):
    """gpt-oss with its own chat template (llama.cpp's copy of it) gets the harmony reader by default: a reply's
    analysis channel comes back as reasoning_content, its final channel as content, and a commentary message to
    functions.NAME as a tool call, whole and streamed, through the official SDK (the replies are written here by a
    regex: the weights are random; the demo's vocabulary spells the markers as text, a real one as special tokens,
    which the reader keeps in the text all the same)."""
    import copy
    import dataclasses

    from brisk.engine.engine import LLMEngine
    from brisk.config import CacheConfig
    from brisk.engine.scheduler import SchedulerConfig

    loaded = load(str(built("gptoss").gguf), max_model_len=MAX_LEN)
    tokenizer = copy.copy(loaded.tokenizer)
    tokenizer.set_chat_template((llamacpp_dir() / "models" / "templates" / "openai-gpt-oss-120b.jinja").read_text())
    engine = LLMEngine(dataclasses.replace(loaded, tokenizer=tokenizer), CacheConfig(num_gpu_blocks_override=256),
                       SchedulerConfig(max_model_len=MAX_LEN))
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with serve_engine(engine, served_model_name="gptoss") as live:
        client = live.openai()
        kw = dict(model="gptoss", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=80,
                  temperature=0, reasoning_effort="low", extra_body={"guided_regex": (
                      r"<\|channel\|>analysis<\|message\|>[a-z ]{3,20}<\|end\|>"
                      r"<\|start\|>assistant<\|channel\|>final<\|message\|>[A-Za-z ]{3,20}")})
        whole = client.chat.completions.create(**kw).choices[0].message
        reasoning = whole.model_extra["reasoning_content"]
        assert reasoning and whole.content and "<|" not in whole.content + reasoning
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                streamed["content"] += c.delta.content or ""
                streamed["reasoning_content"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
        assert streamed == {"reasoning_content": reasoning, "content": whole.content}

        call_kw = dict(model="gptoss", messages=[{"role": "user", "content": "Paris?"}], max_tokens=74,
                       temperature=0, tools=tools, extra_body={"guided_regex": (
                           r"<\|channel\|>analysis<\|message\|>[a-z]{2,4}<\|end\|><\|start\|>assistant"
                           r"<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>"
                           r'\{"city": "[A-Z][a-z]{1,3}"\}<\|call\|>')})
        choice = client.chat.completions.create(**call_kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"]
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        names, arguments = [], ""
        for chunk in client.chat.completions.create(stream=True, **call_kw):
            for c in chunk.choices:
                for delta in c.delta.tool_calls or []:
                    names += [delta.function.name] if delta.function and delta.function.name else []
                    arguments += (delta.function.arguments or "") if delta.function else ""
        assert names == ["get_weather"] and arguments == call.function.arguments
        # a forced call, in harmony's own syntax (the demo's vocabulary spells its markers as text); the grammar
        # lets the model think first, which random weights would do until max_tokens: logit_bias steers them off
        # every token that could begin "analysis" after <|channel|>
        vocab = tokenizer.fast.get_vocab()
        no_thinking = {str(i): -100 for t, i in vocab.items() if tokenizer.fast.decode([i]) and
                       "analysis".startswith(tokenizer.fast.decode([i]))}
        forced = client.chat.completions.create(model="gptoss", messages=[{"role": "user", "content": "Paris?"}],
                                                tools=[{**tools[0], "function": {**tools[0]["function"], "parameters": {
                                                    "type": "object", "required": ["city"], "properties": {
                                                        "city": {"enum": ["Paris", "Oslo"]}}}}}],  # (no long strings)
                                                tool_choice="required", max_tokens=74, temperature=0,
                                                logit_bias=no_thinking)
        assert forced.choices[0].message.tool_calls, forced.choices[0]
        (call,) = forced.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
