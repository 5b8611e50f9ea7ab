"""gpt-oss as the Hub ships it: experts in MXFP4 (`*_blocks`/`*_scales`, `quantization_config.quant_method:
mxfp4`), against transformers' own reading of the same checkpoint (it dequantizes MXFP4 on a CPU without
triton: E2M1 values times a power of two, exact in float32). brisk keeps the experts packed at 4.25 bits; its
logits are transformers' up to the int8 rounding of the kernels' activations, and equal to them (1e-4) with
the activations left in float. The architecture against transformers' float model, from HF directories and
GGUFs: tests/test_model_families.py ("gptoss"); MXFP4 kernels on every ISA path: tests/test_quant.py."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from brisk import kernels
from brisk.loading.loader import load
from brisk.models.moe import SparseMoeBlock
from brisk.models.simple_cache import SingleSequenceCache

from test_moe import _float_activation_experts

CONFIG = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16, max_position_embeddings=256,
              vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})


def _hub_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts [E, out, in] float -> the Hub's MXFP4 tensors: blocks [E, out, in/32, 16] (weight 2i in byte i's
    low nibble, 2i + 1 in its high one) and E8M0 scales [E, out, in/32], quantized by gguf's own quantizer."""
    e, n, k = weight.shape
    raw = quantize(weight.reshape(-1, k).numpy(), gguf.GGMLQuantizationType.MXFP4).reshape(e, n, k // 32, 17)
    scales, qs = raw[..., 0], raw[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # GGUF's order: byte j holds weights j and j + 16
    hub = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(hub)), torch.from_numpy(np.ascontiguousarray(scales))


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory, demo):
    """A tiny random gpt-oss saved by transformers, its experts then rewritten as the Hub's MXFP4 checkpoints
    store them."""
    import transformers
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("gptoss-mxfp4")
    cfg = transformers.GptOssConfig(**CONFIG, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("sinks", "bias")):
                param.normal_(0.0, 0.5)
            elif name.endswith("router.weight"):
                param.normal_(0.0, 0.5)
            elif name.endswith("experts.gate_up_proj"):
                param.normal_(0.0, 2.0)  # gates past the clamp's limit (7)
    model.save_pretrained(root)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo.model_dir / f, root / f)
    (shard,) = root.glob("*.safetensors")
    tensors = load_file(shard)
    for i in range(cfg.num_hidden_layers):
        experts = f"model.layers.{i}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):  # stored [E, in, out]: the blocks are [E, out, in/32, 16]
            blocks, scales = _hub_blocks(tensors.pop(experts + name).transpose(1, 2).contiguous())
            tensors[f"{experts}{name}_blocks"], tensors[f"{experts}{name}_scales"] = blocks, scales
    save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (root / "config.json").write_text(json.dumps(config))
    return root


def _logits(loaded, ids):
    cache = SingleSequenceCache(loaded.config, len(ids), torch.float32, "cpu")
    cache.begin(len(ids))
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache))


def test_the_hubs_mxfp4_experts_stay_packed_and_compute_transformers_logits(hub_checkpoint, brisk_cache, monkeypatch):
    import transformers

    reference_model = transformers.GptOssForCausalLM.from_pretrained(hub_checkpoint, dtype=torch.float32).eval()
    gate_up = reference_model.model.layers[0].mlp.experts.gate_up_proj  # transformers' dequantization, [E, H, 2I]
    ids = torch.randint(3, 512, (48,), generator=torch.Generator().manual_seed(0)).tolist()  # past the window
    with torch.inference_mode():
        reference = reference_model(torch.tensor([ids])).logits[0].float()
    loaded = load(str(hub_checkpoint), max_model_len=256, warmup=False)
    experts = loaded.model.model.layers[0].mlp.experts
    assert {loaded.report.weight_formats[k] for k in ("gate_up_proj", "down_proj")} == {"mxfp4"}
    assert experts.gate_up_proj.qweight.dtype == torch.uint8 and experts.gate_up_proj.scales.dtype == torch.uint8
    # brisk's layout holds transformers' weights exactly: [2I, H] with gate's rows then up's (transformers
    # interleaves gate and up column by column)
    expected = torch.cat([gate_up[1, :, 0::2], gate_up[1, :, 1::2]], dim=1).T
    assert torch.equal(experts.gate_up_proj.dequantized(1), expected.float())
    served = _logits(loaded, ids)
    with monkeypatch.context() as m:  # the kernels' int8 activation blocks swapped for float activations
        m.setattr(kernels, "quant_matmul", lambda *a: kernels.reference_matmul(*a, quantized_activations=False))
        m.setattr(kernels, "quant_matmul_experts", _float_activation_experts)
        m.setattr(SparseMoeBlock, "compiled", lambda self: None)
        exact = _logits(loaded, ids)
    scale = reference.abs().max()
    torch.testing.assert_close(exact / scale, reference / scale, rtol=0, atol=1e-4)
    assert float((served.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.9


def test_mxfp4_kept_packed_says_nothing_and_a_widened_one_says_so(tmp_path, brisk_cache):
    """Never widened silently: a GGUF's MXFP4 experts kept at 4.25 bits need no note; converted to another format
    (here --quantization none), the load report says what they became."""
    from brisk.loading.gguf_random import Shape, write_random_gguf

    shape = Shape(hidden=256, layers=1, ffn=256, heads=4, kv_heads=2, context=128, head_dim=64, experts=4,
                  experts_used=2, expert_ffn=256, arch="gpt-oss")
    path = write_random_gguf(tmp_path / "oss.gguf", shape, "MXFP4_MOE", None)
    packed = load(str(path), warmup=False).report
    assert packed.weight_formats["gate_up_proj"] == "mxfp4" and packed.notes == []
    widened = load(str(path), warmup=False, quantization="none").report
    assert widened.notes == ["the file's MXFP4 weights are stored as float (rows not in whole tiles of 8, or "
                             "--quantization)"]
    assert any("note: the file's MXFP4" in line for line in widened.lines())
