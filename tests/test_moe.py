"""The expert layer with its experts packed as the GGUF stores them (brisk/models/moe.py): every type brisk
packs a linear in, against `gguf`'s own dequantizer of the same file; the packed model against the same
weights in float; each row's output the same bits alone or in a batch (a request's tokens do not depend on
what it is batched with); the memory plan counting the experts' bytes exactly; and the families' refusals.
The families themselves against transformers: tests/test_model_families.py."""

from __future__ import annotations

import functools
import json

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from brisk import kernels
from brisk.config import ModelConfig
from brisk.engine.sampling_params import SamplingParams
from brisk.errors import ModelLoadError
from brisk.llm import LLM
from brisk.loading import memory_plan
from brisk.loading.gguf_random import Shape, write_random_gguf
from brisk.loading.loader import load
from brisk.models.moe import ExpertLinear, SparseMoeBlock, StackedExpertLinear, route
from brisk.models.simple_cache import SingleSequenceCache

# rows of whole 256s (K-quants' super-blocks); 8 experts of 256, 2 a token; Qwen3-MoE's block (q/k norms)
MOE = Shape(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, context=128, head_dim=64, experts=8,
            experts_used=2, expert_ffn=256, arch="qwen3moe")
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "IQ4_NL", "IQ4_XS", "MXFP4", "BF16"]
# each type's bits a weight as brisk keeps it, and as the GGUF stores it
BITS = {"Q4_0": (4.5, 4.5), "Q4_1": (5.0, 5.0), "Q8_0": (8.5, 8.5), "Q2_K": (2.625, 2.625), "Q3_K": (3.5625, 3.4375),
        "Q4_K": (4.625, 4.5), "Q5_K": (5.625, 5.5), "Q6_K": (6.5625, 6.5625), "IQ4_NL": (4.5, 4.5),
        "IQ4_XS": (4.3125, 4.25), "MXFP4": (4.25, 4.25), "BF16": (16.0, 16.0)}


@pytest.fixture(scope="module", params=TYPES)
def moe_gguf(request, tmp_path_factory):
    return write_random_gguf(tmp_path_factory.mktemp("moe") / f"moe-{request.param}.gguf", MOE, request.param, None)


@functools.lru_cache(maxsize=4)
def _reader(path):
    return gguf.GGUFReader(str(path))


def _gguf_experts(path, name) -> torch.Tensor:
    """gguf's own dequantization of a stacked expert tensor: [experts, out, in]."""
    t = next(t for t in _reader(path).tensors if t.name == name)
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(t.data, t.tensor_type)).astype(np.float32))


def _logits(loaded, ids):
    cache = SingleSequenceCache(loaded.config, len(ids), torch.float32, "cpu")
    cache.begin(len(ids))
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache))


def test_experts_are_packed_as_stored_and_dequantize_as_gguf_does(moe_gguf, brisk_cache):
    """Every expert of the served model equals gguf's dequantization of its slice of the file (gate and up fused,
    or stored as two parts where their types differ), kept in the file's own format at the file's size."""
    loaded = load(str(moe_gguf))
    experts = loaded.model.model.layers[1].mlp.experts
    gate, up, down = (_gguf_experts(moe_gguf, f"blk.1.ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
    for e in range(MOE.experts):
        assert torch.equal(experts.gate_up_proj.dequantized(e), torch.cat([gate[e], up[e]])), e
        assert torch.equal(experts.down_proj.dequantized(e), down[e]), e
    kind = moe_gguf.stem.removeprefix("moe-")
    projections = [experts.down_proj] + (list(experts.gate_up_proj.parts) if isinstance(experts.gate_up_proj, StackedExpertLinear)
                                         else [experts.gate_up_proj])
    for proj in projections:
        assert isinstance(proj, ExpertLinear) and proj.fmt is not None  # packed, never widened to float
    if kind in BITS:  # one type throughout: brisk's bytes against the file's
        ours = sum(t.numel() * t.element_size() for t in (experts.gate_up_proj.qweight, experts.gate_up_proj.scales,
                                                          experts.gate_up_proj.mins, experts.gate_up_proj.subscales)
                   if t is not None)
        kept, stored = BITS[kind]
        weights = MOE.experts * 2 * MOE.expert_ffn * MOE.hidden
        assert ours * 8 == weights * kept and kept / stored <= 1.04, (ours * 8 / weights, stored)


def _float_activation_experts(x, qweight, scales, mins, bits, subscales, experts, offsets):
    """kernels.quant_matmul_experts with float activations (the kernels' reference, expert by expert)."""
    return torch.cat([kernels.reference_matmul(x[offsets[i]:offsets[i + 1]], qweight[e], scales[e],
                                               None if mins is None else mins[e], bits,
                                               None if subscales is None else subscales[e],
                                               quantized_activations=False) for i, e in enumerate(experts)])


def test_packed_experts_compute_the_float_model_up_to_activation_rounding(moe_gguf, brisk_cache, monkeypatch):
    """With the kernels' int8 activation blocks swapped for float activations, the packed model computes the
    dequantized float model's logits; with them, the top token rarely changes."""
    ids = list(range(5, 45))
    float_model = load(str(moe_gguf), quantization="none")
    packed = load(str(moe_gguf))
    reference, served = _logits(float_model, ids), _logits(packed, ids)
    if not moe_gguf.stem.endswith("BF16"):  # (bf16 weights take float32 activations: nothing to swap)
        with monkeypatch.context() as m:
            m.setattr(kernels, "quant_matmul", lambda *a: kernels.reference_matmul(*a, quantized_activations=False))
            m.setattr(kernels, "quant_matmul_experts", _float_activation_experts)
            m.setattr(SparseMoeBlock, "compiled", lambda self: None)  # the torch path, through the kernels above
            exact = _logits(packed, ids)
        torch.testing.assert_close(exact, reference, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(served, reference, rtol=1e-4, atol=1e-4)
    assert float((served.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.9


def test_the_grouped_kernel_gives_each_expert_what_its_own_matmul_gives(moe_gguf, brisk_cache):
    """kernels.quant_matmul_experts (every chosen expert in one call) against quant_matmul expert by expert, on
    every path this CPU has: the same bits, rows grouped unevenly (one expert with 9 rows, one with 1)."""
    from isa_paths import MATMUL_PATHS

    proj = load(str(moe_gguf), warmup=False).model.model.layers[0].mlp.experts.down_proj
    projections = [p for p in (proj.parts if isinstance(proj, StackedExpertLinear) else [proj]) if p.fmt.bits != 16]
    x = torch.randn(14, proj.in_features, generator=torch.Generator().manual_seed(3))
    experts, offsets = [6, 1, 3], [0, 9, 10, 14]
    lib = kernels.library()
    lib.brisk_kernels_force_isa(-1)
    native = lib.brisk_kernels_isa()
    try:
        for level in (lvl for lvl in sorted(MATMUL_PATHS, reverse=True) if lvl <= native):
            lib.brisk_kernels_force_isa(level)
            for p in projections:
                grouped = p.grouped(x, experts, offsets)
                alone = torch.cat([p(x[offsets[i]:offsets[i + 1]], e) for i, e in enumerate(experts)])
                assert torch.equal(grouped, alone), (MATMUL_PATHS[level], p.fmt.name)
    finally:
        lib.brisk_kernels_force_isa(-1)


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0", "BF16", "float"])
def test_a_row_gets_the_same_bits_alone_and_in_a_batch(kind, path, tmp_path_factory, brisk_cache, monkeypatch):
    """The expert-grouped matmul: 23 rows together (experts shared by several rows, read once) give each row
    exactly what it gets alone, so a request's tokens do not depend on what it is batched with; on the
    compiled block (moe.cpp: the quantized types) and on the torch path (every type)."""
    if path == "compiled" and kind in ("BF16", "float"):
        pytest.skip("16-bit and float experts take the torch path")
    gguf_path = write_random_gguf(tmp_path_factory.mktemp("bits") / f"moe-{kind}.gguf", MOE,
                                  "F32" if kind == "float" else kind, None)
    block = load(str(gguf_path), warmup=False).model.model.layers[0].mlp
    if path == "torch":
        monkeypatch.setattr(block, "compiled", lambda: None)
    else:
        assert block.compiled() is not None
    x = torch.randn(23, MOE.hidden, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        together = block(x)
        ids, _ = route(block.gate(x), MOE.experts_used, True)
        assert len(ids.unique()) < 23 * MOE.experts_used  # experts shared by rows
        for r in range(23):
            assert torch.equal(block(x[r:r + 1].clone())[0], together[r]), r


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0", "Q4_0"])
def test_the_compiled_block_routes_and_computes_as_the_torch_path(kind, tmp_path_factory, brisk_cache):
    """moe.cpp's block (router, top k, grouped experts, weighted sum in one call) against the torch path over the
    same packed experts: the same experts for every row, the same order, and outputs equal up to the router's
    float rounding (its logits summed in another order than oneDNN's)."""
    gguf_path = write_random_gguf(tmp_path_factory.mktemp("cblock") / f"moe-{kind}.gguf", MOE, kind, None)
    block = load(str(gguf_path), warmup=False).model.model.layers[1].mlp
    assert block.compiled() is not None
    x = torch.randn(37, MOE.hidden, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ids = torch.empty(37, MOE.experts_used, dtype=torch.int64)
        weights = torch.empty(37, MOE.experts_used)
        kernels.library().brisk_moe_route(x.data_ptr(), block.gate.weight.data_ptr(), None, 37, MOE.experts, MOE.hidden,
                                          MOE.experts_used, 1, ids.data_ptr(), weights.data_ptr())
        ref_ids, ref_weights = route(torch.nn.functional.linear(x, block.gate.weight), MOE.experts_used, True)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
        compiled = block(x)
        reference = block.experts(x, ref_ids, ref_weights)
    torch.testing.assert_close(compiled, reference, rtol=1e-4, atol=1e-5)


OSS = Shape(hidden=256, layers=2, ffn=256, heads=4, kv_heads=2, context=128, head_dim=64, experts=8, experts_used=2,
            expert_ffn=256, arch="gpt-oss")


def test_gpt_oss_compiled_block_routes_and_computes_as_the_torch_path(tmp_path_factory, brisk_cache, monkeypatch):
    """gpt-oss's block in moe.cpp (router bias, top-k logits softmaxed, expert biases, the clamped SwiGLU) against
    the torch path over the same MXFP4 experts, which transformers' GptOssMLP is the reference of
    (tests/test_model_families.py, tests/test_gpt_oss.py): the same experts, the same weights, outputs equal up to
    float rounding; and each row's bits the same alone and in a batch."""
    from brisk.models.moe import route_top_logits

    gguf_path = write_random_gguf(tmp_path_factory.mktemp("oss") / "oss.gguf", OSS, "MXFP4_MOE", None)
    block = load(str(gguf_path), warmup=False).model.model.layers[1].mlp
    assert block.compiled() is not None and block.compiled().oai == 1
    x = torch.randn(37, OSS.hidden, generator=torch.Generator().manual_seed(5)) * 4  # gates past the clamp's limit
    with torch.inference_mode():
        ids = torch.empty(37, OSS.experts_used, dtype=torch.int64)
        weights = torch.empty(37, OSS.experts_used)
        kernels.library().brisk_moe_route(x.data_ptr(), block.gate.weight.data_ptr(), block.gate.bias.data_ptr(), 37,
                                          OSS.experts, OSS.hidden, OSS.experts_used, 2, ids.data_ptr(),
                                          weights.data_ptr())
        ref_ids, ref_weights = route_top_logits(torch.nn.functional.linear(x, block.gate.weight, block.gate.bias),
                                                OSS.experts_used)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-4, atol=1e-5)  # logits summed in another order
        compiled = block(x)
        with monkeypatch.context() as m:
            m.setattr(block, "compiled", lambda: None)
            torch_path = block(x)
        for r in (0, 11, 36):
            assert torch.equal(block(x[r:r + 1].clone())[0], compiled[r])
    torch.testing.assert_close(compiled, torch_path, rtol=1e-4, atol=1e-5)


def test_greedy_tokens_do_not_depend_on_the_batch(brisk_cache, tmp_path_factory):
    """Through the engine: a request's greedy tokens alone, and among 7 others of other lengths."""
    path = write_random_gguf(tmp_path_factory.mktemp("batch") / "moe-q4km.gguf", MOE, "Q4_K_M", None)
    llm = LLM(str(path), max_model_len=128, num_blocks=256, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    probe = list(range(3, 30))
    alone = llm.generate([probe], params)[0].token_ids
    others = [[(7 * i + j) % 120 + 3 for j in range(5 + 9 * i)] for i in range(7)]
    together = llm.generate(others[:3] + [probe] + others[3:], params)[3].token_ids
    assert together == alone


def test_the_memory_plan_counts_expert_bytes_exactly(moe_gguf, brisk_cache):
    """Predicted from the header before anything converts (a bf16 GGUF keeps its 16-bit weights on CPU, as
    `auto` picks), equal to what the load holds."""
    predicted, _ = memory_plan.gguf_weight_bytes(moe_gguf, "bf16" if moe_gguf.stem.endswith("BF16") else "auto")
    assert load(str(moe_gguf), warmup=False).report.weight_bytes == predicted


def test_kv_plan_sizes_the_weights_with_every_expert(brisk_cache, tmp_path):
    """`brisk kv-plan` reports the weights beside the KV budget: all experts in their packed format (the bytes
    the server holds) and the parameters a token reads."""
    from brisk.kvplan.plan import model_shape

    path = write_random_gguf(tmp_path / "moe.gguf", MOE, "Q4_K_M", None)
    shape = model_shape(str(path), "float32")
    loaded = load(str(path), warmup=False)
    assert shape.weight_bytes == loaded.report.weight_bytes
    assert shape.parameters == (loaded.report.parameters_total, loaded.report.parameters_active)


def test_the_load_report_names_total_and_active_parameters(brisk_cache, tmp_path):
    path = write_random_gguf(tmp_path / "moe.gguf", MOE, "Q8_0", None)
    report = load(str(path), warmup=False).report
    cfg = MOE
    expert = 3 * cfg.hidden * cfg.expert_ffn
    assert report.parameters_total - report.parameters_active == cfg.layers * (cfg.experts - cfg.experts_used) * expert
    assert "active" in report.summary()


# -- config.json: what is read, what is refused ------------------------------------------------------------------
def _config(**changes):
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    return {**base, **changes}


def test_sparse_steps_and_dense_layers_follow_transformers():
    moe = ModelConfig.from_hf_dict(_config(decoder_sparse_step=2, mlp_only_layers=[3])).moe
    assert moe.layers == (1,) and not moe.norm_topk_prob  # (i + 1) % 2 == 0, and not layer 3
    assert ModelConfig.from_hf_dict(_config(norm_topk_prob=True)).moe.norm_topk_prob
    mixtral = ModelConfig.from_hf_dict({**_config(architectures=["MixtralForCausalLM"], num_local_experts=4),
                                        "num_experts": None}).moe
    assert mixtral.num_experts == 4 and mixtral.norm_topk_prob and mixtral.expert_intermediate_size == 96


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["DeepseekV3ForCausalLM"]), "DeepseekV3ForCausalLM is a model brisk cannot run.*latent attention"),
    (dict(architectures=["OlmoeForCausalLM"], clip_qkv=8.0), "clip_qkv 8.0"),
    (dict(scoring_func="sigmoid"), "scoring_func 'sigmoid' is a gating function"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 exceeds the 8 experts"),
    (dict(num_experts=0), "num_experts must be a positive integer"),
])
def test_moe_variants_brisk_cannot_run_are_named(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict(_config(**changes), "config.json")


def test_a_serve_of_an_unsupported_moe_is_one_line_before_anything_loads(tmp_path):
    import subprocess
    import sys

    import socket

    (tmp_path / "config.json").write_text(json.dumps(_config(architectures=["DeepseekV3ForCausalLM"])))
    (tmp_path / "tokenizer.json").write_text("{}")
    with socket.socket() as s:  # a port nobody holds
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "brisk", "serve", str(tmp_path), "--port", str(port)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("brisk: error:") and "DeepseekV3ForCausalLM" in lines[0], done.stderr
    assert str(tmp_path) in lines[0]


def test_a_gguf_with_experts_in_separate_tensors_is_refused(brisk_cache, tmp_path):
    """An old converter's Mixtral GGUF kept each expert apart (`ffn_gate.0.weight`): refused by name."""
    writer = gguf.GGUFWriter(str(tmp_path / "old.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_expert_count(2)
    writer.add_expert_used_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(8)])
    writer.add_token_types([1] * 8)
    writer.add_token_merges([])
    for name, shape in {"token_embd.weight": (8, 32), "output.weight": (8, 32), "output_norm.weight": (32,),
                        "blk.0.attn_norm.weight": (32,), "blk.0.ffn_norm.weight": (32,),
                        "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (32, 32),
                        "blk.0.attn_v.weight": (32, 32), "blk.0.attn_output.weight": (32, 32),
                        "blk.0.ffn_gate_inp.weight": (2, 32), "blk.0.ffn_gate.0.weight": (64, 32),
                        "blk.0.ffn_up.0.weight": (64, 32), "blk.0.ffn_down.0.weight": (32, 64)}.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="experts are not stacked"):
        load(str(tmp_path / "old.gguf"), warmup=False)
