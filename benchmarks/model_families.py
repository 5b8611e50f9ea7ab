"""Each model family against transformers, as tests/test_model_families.py checks it, with the
figures printed: the largest logit difference (relative to the logits' range), whether greedy tokens
through the engine equal HF's, for the HF directory and for the GGUF llama.cpp's converter writes;
then llama.cpp's tokenizer test vectors, case by case.

    .venv/bin/python benchmarks/model_families.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_gguf_tokenizers import LLM_VOCABS, test_cases, vocab_path  # noqa: E402
from test_model_families import (FAMILIES, _build, brisk_greedy, brisk_logits, hf_greedy, hf_logits,  # noqa: E402
                                 prompt_ids)

from llamacpp import llamacpp_dir, train_sentencepiece  # noqa: E402


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="brisk-families-"))
    os.environ.setdefault("BRISK_CACHE", str(root / "cache"))
    from brisk.loading.gguf_header import GGUFFile
    from brisk.loading.gguf_tokenizer import build_tokenizer
    from brisk.loading.loader import load

    demo = load("smollm2-135m-instruct", warmup=False)
    corpus = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    spm = train_sentencepiece(root / "spm", corpus)
    print("| family | source | max logit difference / range | greedy tokens = HF's |")
    print("|---|---|---|---|")
    for name, family in FAMILIES.items():
        built = _build(name, family, root / name, demo, spm)
        ids = prompt_ids(built.hf.config.vocab_size)
        expected, expected_tokens = hf_logits(built.hf, ids), hf_greedy(built.hf, ids)
        for source, path in (("HF directory", built.hf_dir), ("GGUF (convert_hf_to_gguf.py)", built.gguf)):
            diff = float(((brisk_logits(path, ids) - expected).abs().max() / expected.abs().max()))
            same = brisk_greedy(path, ids) == expected_tokens
            print(f"| {name} | {source} | {diff:.1e} | {'yes' if same else 'NO'} ({len(expected_tokens)} tokens) |")
    print()
    print("| llama.cpp vocabulary | cases with the expected ids |")
    print("|---|---|")
    for name in LLM_VOCABS:
        path = vocab_path(name)
        tok, _ = build_tokenizer(GGUFFile(path).metadata, str(path))
        cases = test_cases(path)
        ok = sum(tok.encode(text, add_special_tokens=False).ids == want for text, want in cases)
        print(f"| {name} | {ok}/{len(cases)} |")
    print(f"\n(llama.cpp material from {llamacpp_dir()}; torch {torch.__version__})")


if __name__ == "__main__":
    main()
