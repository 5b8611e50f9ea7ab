"""bfloat16 and float16 checkpoints keep their 16-bit weights on CPU (half_matmul.cpp widens them in
registers; activations stay float32). The kernel against float64 on every ISA path, a row's bits
independent of the batch, and whole models saved by transformers against transformers' own float32
forward on the same weights; the memory they take; the explicit overrides; the refusal for a GGUF."""

import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM

from isa_paths import force_matmul
from brisk import kernels
from brisk.errors import BriskError
from brisk.loading import memory_plan
from brisk.loading.loader import load
from brisk.models.simple_cache import SingleSequenceCache

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="compiled kernels not built")

HALVES = {"bf16": torch.bfloat16, "f16": torch.float16}
PATHS = {"avx512": 3, "avx2": 2, "portable": 0}
SHAPES = [(1, 1, 1), (1, 7, 5), (3, 9, 37), (6, 33, 100), (17, 68, 2048)]  # K tails, N tails, M tails


@pytest.fixture
def forced_isa(request):
    lib = kernels.library()
    isa = PATHS[request.param]
    force_matmul(lib, isa)
    yield isa
    lib.brisk_kernels_force_isa(-1)


def _operands(seed, half):
    gen = torch.Generator().manual_seed(seed)
    for m, n, k in SHAPES:
        yield torch.randn(m, k, generator=gen), (torch.randn(n, k, generator=gen) * 0.2).to(HALVES[half])


@pytest.mark.parametrize("layout", ["rows", "panels"])
@pytest.mark.parametrize("forced_isa", sorted(PATHS), indirect=True)
@pytest.mark.parametrize("half", sorted(HALVES))
def test_kernel_matches_float64_and_a_row_does_not_depend_on_its_batch(forced_isa, half, layout):
    for x, w in _operands(forced_isa * 10 + len(half), half):
        m, n, k = x.shape[0], w.shape[0], x.shape[1]
        stored = kernels.pack_half(w) if layout == "panels" else w
        if layout == "panels":
            assert torch.equal(kernels.unpack_half(stored, n), w)
        out = kernels.half_matmul(x, stored, n)
        exact = x.double() @ w.double().T  # the stored weights are exact in float64
        magnitude = x.double().abs() @ w.double().abs().T
        assert ((out.double() - exact).abs() <= 1e-5 * magnitude + 1e-30).all(), (m, n, k)
        alone = torch.cat([kernels.half_matmul(x[i:i + 1].contiguous(), stored, n) for i in range(m)])
        assert torch.equal(alone, out), (m, n, k)


@pytest.mark.parametrize("half", sorted(HALVES))
def test_panels_give_the_same_bits_on_every_path(half):
    """Each output is one fma per k in k order on every path (the portable loop uses std::fma)."""
    lib = kernels.library()
    for x, w in _operands(5, half):
        panels = kernels.pack_half(w)
        outs = []
        try:
            for isa in sorted({min(v, lib.brisk_kernels_isa()) for v in PATHS.values()}):
                lib.brisk_kernels_force_isa(isa)
                outs.append(kernels.half_matmul(x, panels, w.shape[0]))
        finally:
            lib.brisk_kernels_force_isa(-1)
        assert all(torch.equal(o, outs[0]) for o in outs), x.shape


VOCAB = 128


def _checkpoint(path, dtype, tie):
    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tie)
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A bfloat16 checkpoint with its own LM head, a float16 one with tied embeddings."""
    return {"bf16": _checkpoint(tmp_path_factory.mktemp("llama-bf16"), torch.bfloat16, tie=False),
            "f16": _checkpoint(tmp_path_factory.mktemp("llama-f16"), torch.float16, tie=True)}


IDS = [3, 77, 12, 5, 99, 41, 8, 63, 120, 1, 17, 54]


def _brisk_logits(loaded):
    cache = SingleSequenceCache(loaded.config, len(IDS), torch.float32, "cpu")
    cache.begin(len(IDS))
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(torch.tensor(IDS), torch.arange(len(IDS)), cache))


def _hf_float32_logits(path):
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize("half", sorted(HALVES))
def test_auto_keeps_the_checkpoints_16_bit_weights_and_matches_hf_float32(checkpoints, half):
    path = checkpoints[half]
    loaded = load(str(path), warmup=False)
    assert loaded.dtype == torch.float32  # activations, norms, KV: float32 compute
    formats = loaded.report.weight_formats
    assert formats["qkv_proj"] == formats["o_proj"] == formats["gate_up_proj"] == formats["down_proj"] == half
    assert formats["lm_head"] == formats["embed_tokens"] == half
    layer = loaded.model.model.layers[0]
    assert layer.mlp.down_proj.qweight.dim() == 3  # linears in panels; embeddings by row
    assert loaded.model.model.embed_tokens.qweight.dim() == 2
    torch.testing.assert_close(_brisk_logits(loaded), _hf_float32_logits(path), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("half", sorted(HALVES))
def test_weights_take_their_stored_bytes_and_the_memory_check_agrees(checkpoints, half):
    path = checkpoints[half]
    kept = load(str(path), warmup=False)
    widened = load(str(path), dtype="float32", warmup=False)
    assert kept.report.weight_bytes == memory_plan.checkpoint_weight_bytes(path, half, 4)
    norms = sum(p.numel() for n, p in widened.model.named_parameters() if "norm" in n)
    assert kept.report.weight_bytes == (widened.report.weight_bytes - 4 * norms) // 2 + 4 * norms


def test_an_explicit_dtype_overrides_auto(checkpoints):
    path = checkpoints["bf16"]
    float32 = load(str(path), dtype="float32", warmup=False)
    assert float32.report.weight_formats == {} and float32.dtype == torch.float32
    bf16_compute = load(str(path), dtype="bfloat16", warmup=False)
    assert bf16_compute.report.weight_formats == {} and bf16_compute.dtype == torch.bfloat16
    # and --quantization bf16 asks for 16-bit storage whatever --dtype says
    torch.testing.assert_close(_brisk_logits(float32), _hf_float32_logits(path), rtol=1e-4, atol=1e-4)
    kept = load(str(path), quantization="bf16", warmup=False)
    assert kept.report.weight_formats["down_proj"] == "bf16"


def test_a_gguf_refuses_16_bit_storage_in_one_line(demo_gguf_path):
    with pytest.raises(BriskError, match="is a GGUF: use --quantization auto"):
        load(str(demo_gguf_path), quantization="bf16", warmup=False)
    proc = subprocess.run([sys.executable, "-m", "brisk", "generate", "-m", str(demo_gguf_path), "-q", "f16", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("brisk: error:")


@pytest.fixture(scope="module")
def half_ggufs(tmp_path_factory):
    """Llama GGUFs whose matrices are all BF16 / all F16 (llama.cpp's `--outtype bf16|f16`), norms F32."""
    from brisk.loading.gguf_random import Shape, write_random_gguf

    root = tmp_path_factory.mktemp("half-gguf")
    shape = Shape(hidden=64, layers=2, ffn=160, heads=4, kv_heads=2)
    return {half: write_random_gguf(root / f"tiny-{half}.gguf", shape, {"bf16": "BF16", "f16": "F16"}[half], None,
                                    seed=3) for half in sorted(HALVES)}


@pytest.mark.parametrize("half", sorted(HALVES))
def test_a_16_bit_gguf_stays_16_bit_bit_for_bit(half_ggufs, half, brisk_cache):
    """auto converts its matrices as stored (the gguf package's dequantizer gives the same values),
    keeps them 16-bit at load, and computes what the float32 model of the same values computes."""
    import gguf
    from safetensors.torch import load_file

    path = half_ggufs[half]
    kept = load(str(path), warmup=False)
    assert kept.report.conversion_cache == "miss"  # judged by the GGUF's header
    formats = kept.report.weight_formats
    again = load(str(path), warmup=False)  # judged by the converted checkpoint: the same answer
    assert again.report.conversion_cache == "hit" and again.report.weight_formats == formats
    assert formats["qkv_proj"] == formats["down_proj"] == formats["lm_head"] == formats["embed_tokens"] == half
    stored = load_file(str(kept.model_dir / "model.safetensors"))
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    for gguf_name, ours in (("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
                            ("token_embd.weight", "model.embed_tokens.weight")):
        t = by_name[gguf_name]
        assert stored[ours].dtype == HALVES[half]
        reference = gguf.quants.dequantize(t.data, t.tensor_type).reshape(stored[ours].shape)
        assert torch.equal(stored[ours].float(), torch.from_numpy(reference))
    assert kept.report.weight_bytes == memory_plan.gguf_weight_bytes(path, half)[0]  # predicted before converting
    widened = load(str(path), quantization="none", warmup=False)
    assert widened.report.weight_formats == {}
    torch.testing.assert_close(_brisk_logits(kept), _brisk_logits(widened), rtol=1e-4, atol=1e-4)
    assert load(str(path), dtype="float32", warmup=False).report.weight_formats == {}  # --dtype overrides auto
