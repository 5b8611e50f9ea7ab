"""Every LLM vocabulary of llama.cpp's own tokenizer tests (`models/ggml-vocab-*.gguf`, with the
ids each model's Hugging Face tokenizer gives in `.inp`/`.out`), rebuilt by brisk from the GGUF
metadata alone, tokenizes every case to the expected ids (without special tokens, as the tests
run). Non-LLM vocabularies are refused with one clear error."""

from pathlib import Path

import pytest

from brisk.errors import ModelLoadError
from brisk.loading.gguf_header import GGUFFile
from brisk.loading.gguf_tokenizer import build_tokenizer

from llamacpp import llamacpp_dir

SEPARATOR = "\n__ggml_vocab_test__\n"
LLM_VOCABS = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "llama-spm",
              "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]


def vocab_path(name: str) -> Path:
    return llamacpp_dir() / "models" / f"ggml-vocab-{name}.gguf"


def test_cases(path: Path) -> list[tuple[str, list[int]]]:
    inputs = Path(f"{path}.inp").read_bytes().decode("utf-8").split(SEPARATOR)
    if inputs[-1] == "":
        inputs.pop()
    outputs = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")[:len(inputs)]
    return [(text, [int(t) for t in ids.split()]) for text, ids in zip(inputs, outputs)]


test_cases.__test__ = False  # a helper, not a test


def test_every_llm_vocabulary_has_its_test_vectors():
    shipped = {p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in (llamacpp_dir() / "models").glob("*.inp")}
    assert shipped - {"bert-bge"} == set(LLM_VOCABS)


@pytest.mark.parametrize("name", LLM_VOCABS)
def test_vocabulary_tokenizes_every_case_as_its_model_does(name):
    path = vocab_path(name)
    tok, _ = build_tokenizer(GGUFFile(path).metadata, str(path))
    cases = test_cases(path)
    assert len(cases) >= 46
    wrong = [(text, want, got) for text, want in cases
             if (got := tok.encode(text, add_special_tokens=False).ids) != want]
    assert not wrong, f"{len(wrong)} of {len(cases)} cases differ, e.g. {wrong[0]}"


def test_a_non_llm_vocabulary_is_refused_naming_it():
    path = vocab_path("bert-bge")
    with pytest.raises(ModelLoadError, match=r"ggml-vocab-bert-bge\.gguf: GGUF tokenizer type 'bert'"):
        build_tokenizer(GGUFFile(path).metadata, str(path))


def test_an_unknown_pre_tokenizer_is_refused_naming_it():
    path = vocab_path("gpt-2")
    meta = {**GGUFFile(path).metadata, "tokenizer.ggml.pre": "brand-new-pre"}
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'brand-new-pre' is not one brisk knows"):
        build_tokenizer(meta, str(path))
