"""Decode steps through the whole-stack compiled call (brisk/engine/decode_stack.py) give the same
bits as the layer-by-layer Python path: same kernels, same order. Checked end to end on greedy
generations with logprobs, where any difference in any layer would show: the demo model (its own
Q4_1/Q8_0 weights, batched ragged prompts) and a tiny Qwen2 quantized at load (qkv bias, GQA, one
full-attention and one sliding-window layer, small blocks, chunked prefill, past three windows)."""

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import Qwen2Config, Qwen2ForCausalLM

from brisk import kernels
from brisk.config import CacheConfig
from brisk.engine.decode_stack import DecodeStack
from brisk.engine.engine import LLMEngine
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import SchedulerConfig
from brisk.loading.gguf_random import Shape, write_random_gguf
from brisk.loading.loader import load

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="compiled kernels not built")


def _engine(loaded, block_size=16, max_tokens_per_step=512):
    return LLMEngine(loaded, CacheConfig(block_size=block_size, num_gpu_blocks_override=512),
                     SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_tokens_per_step,
                                     max_model_len=loaded.max_model_len))


def _generate(engine, prompts, params):
    """(token ids, logprobs) per prompt, and how many steps ran through the stack."""
    stack = engine.runner.decode_stack
    calls = [0]
    if stack is not None:
        def counted(*args, **kwargs):
            calls[0] += 1
            return stack(*args, **kwargs)
        engine.runner.decode_stack = counted
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    engine.runner.decode_stack = stack
    return [(final[i].token_ids, [lp["logprob"] for lp in final[i].logprobs]) for i in ids], calls[0]


def _compare(loaded, prompts, params, **engine_args):
    with_stack = _engine(loaded, **engine_args)
    assert isinstance(with_stack.runner.decode_stack, DecodeStack)
    without = _engine(loaded, **engine_args)
    without.runner.decode_stack = None
    ours, stack_steps = _generate(with_stack, prompts, params)
    ref, none = _generate(without, prompts, params)
    assert stack_steps > 0 and none == 0
    assert ours == ref  # token ids and every logprob, bit for bit


def test_demo_model_batched_decode_is_bit_identical(demo):
    texts = ["Tell me about owls.", "Count from 1 to 20.", "A" * 200, "你好" * 40, "Name four seasons."]
    prompts = [demo.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    _compare(demo, prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2))


VOCAB, WINDOW = 256, 16


def _qwen2_checkpoint(path, dtype=torch.float32):
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # transformers initializes biases to zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.to(dtype).save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def qwen2_int8(tmp_path_factory, brisk_cache):
    path = _qwen2_checkpoint(tmp_path_factory.mktemp("qwen2-stack"))
    return load(str(path), max_model_len=256, warmup=False, quantization="int8")


def test_qkv_bias_windows_and_gqa_are_bit_identical(qwen2_int8):
    assert qwen2_int8.config.layer_windows == (None, WINDOW)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (20, 3, 33)]
    _compare(qwen2_int8, prompts, SamplingParams(max_tokens=3 * WINDOW, temperature=0, ignore_eos=True, logprobs=0),
             block_size=4, max_tokens_per_step=8)


def test_bf16_checkpoint_weights_kept_16_bit_are_bit_identical(tmp_path_factory, brisk_cache):
    """A bfloat16 checkpoint loads with its 16-bit weights (half_matmul.cpp) and runs the stack."""
    loaded = load(str(_qwen2_checkpoint(tmp_path_factory.mktemp("qwen2-bf16"), torch.bfloat16)), max_model_len=256,
                  warmup=False)
    assert loaded.report.weight_formats["qkv_proj"] == "bf16"
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (20, 3, 33)]
    _compare(loaded, prompts, SamplingParams(max_tokens=3 * WINDOW, temperature=0, ignore_eos=True, logprobs=0),
             block_size=4, max_tokens_per_step=8)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K_mix", "IQ4_NL", "IQ4_XS"])
def test_k_quants_kept_as_stored_are_bit_identical(qtype, tmp_path_factory, brisk_cache):
    """GGUF K-quants in their own tiles (int2 to int6 with super-block scales) through the stack; in the
    mixes q/k (Q4_K/Q5_K/Q3_K/Q2_K) and v (Q6_K/Q6_K/Q4_K/Q3_K) are two weights (`qkv_rest`); IQ4_NL/IQ4_XS
    (4-bit codes into a table) likewise."""
    path = write_random_gguf(tmp_path_factory.mktemp("kq") / f"small-{qtype}.gguf",
                             Shape(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, context=128), qtype, None)
    loaded = load(str(path), max_model_len=128, warmup=False)
    assert loaded.report.weight_formats["qkv_proj"] == {"Q4_K": "int4+min/k", "Q6_K": "int6/k",
                                                        "Q4_K_M": "int4+min/k & int6/k",
                                                        "Q5_K_M": "int5+min/k & int6/k",
                                                        "Q3_K_M": "int3/k & int4+min/k",
                                                        "Q2_K_mix": "int2+min/k & int3/k",
                                                        "IQ4_NL": "iq4", "IQ4_XS": "iq4/k"}[qtype]
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 2, 17)]
    _compare(loaded, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0),
             block_size=4, max_tokens_per_step=8)


def test_float_weights_keep_the_python_path(demo_fp32):
    engine = _engine(demo_fp32)
    assert engine.runner.decode_stack is None


def test_turned_off_by_the_environment(demo, monkeypatch):
    monkeypatch.setenv("BRISK_DECODE_STACK", "off")
    assert _engine(demo).runner.decode_stack is None


def test_each_step_calls_the_library_bound_at_that_time(demo, monkeypatch):
    """A benchmark compares two builds by swapping `kernels._lib` between steps (kv_decode.py
    --baseline-lib): the stack's call must go to the build bound when the step runs, not the one bound
    when the engine was made (it once kept that one, and every engine A/B compared a build with itself)."""
    engine = _engine(demo)
    assert isinstance(engine.runner.decode_stack, DecodeStack)
    real, calls = kernels.library(), []

    class Recorder:  # another "build": forwards every call, recording the whole-stack ones
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name != "brisk_decode_stack":
                return fn
            return lambda *args: calls.append(name) or fn(*args)

    monkeypatch.setattr(kernels, "_lib", Recorder())
    engine.add_request(demo.tokenizer.encode("Name four seasons."),
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(calls) >= 3  # every decode step after the prompt's


# q/k norms and mixtures of experts (moe.cpp, the block the Python path calls too): Qwen3's per-head norms,
# Qwen3-MoE's and OLMoE's routed experts (OLMoE: norms over the whole projection, no renormalised top k),
# Mixtral's Llama block with experts; norms drawn around one, so that swapping q's and k's would show
FAMILIES = {
    "qwen3": Shape(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, context=128, head_dim=64, arch="qwen3"),
    "qwen3moe": Shape(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, context=128, head_dim=64, experts=8,
                      experts_used=2, expert_ffn=256, arch="qwen3moe"),
    "olmoe": Shape(hidden=256, layers=2, ffn=512, heads=4, kv_heads=4, context=128, experts=8, experts_used=3,
                   expert_ffn=256, arch="olmoe"),
    "mixtral": Shape(hidden=256, layers=2, ffn=256, heads=4, kv_heads=2, context=128, experts=4, experts_used=2,
                     expert_ffn=256),
    # gpt-oss: sinks, biases on q/k/v/o, router and experts, the clamped SwiGLU, top-k-then-softmax routing
    "gptoss": Shape(hidden=256, layers=2, ffn=256, heads=4, kv_heads=2, context=128, head_dim=64, experts=8,
                    experts_used=2, expert_ffn=256, arch="gpt-oss"),
}


@pytest.mark.parametrize("family,qtype", [(f, q) for f in sorted(FAMILIES) for q in ("Q4_K_M", "Q8_0")]
                         + [("gptoss", "MXFP4_MOE")])
def test_qk_norms_and_experts_are_bit_identical(family, qtype, tmp_path_factory, brisk_cache):
    path = write_random_gguf(tmp_path_factory.mktemp("fam") / f"{family}-{qtype}.gguf", FAMILIES[family], qtype,
                             None, random_norms=True)
    loaded = load(str(path), max_model_len=128, warmup=False)
    assert loaded.config.qk_norm == {"qwen3": "head", "qwen3moe": "head", "olmoe": "full", "mixtral": None,
                                     "gptoss": None}[family]
    assert loaded.config.attention_sinks == (family == "gptoss")
    assert (loaded.config.moe is not None) == (family != "qwen3")
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 2, 17, 30)]
    _compare(loaded, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
             block_size=4, max_tokens_per_step=8)


def test_a_shared_expert_keeps_the_python_path(tmp_path_factory, brisk_cache):
    """Qwen2-MoE's shared expert is not in the compiled block: its steps go layer by layer, and the log says why."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(5)
    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("qwen2moe")
    Qwen2MoeForCausalLM(config).eval().save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    loaded = load(str(path), max_model_len=128, warmup=False)
    assert _engine(loaded).runner.decode_stack is None
