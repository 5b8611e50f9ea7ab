"""llama.cpp's own test material (scripts/fetch_llamacpp.py, run by `make test`): its GGUF converter,
tokenizer test vocabularies and real chat templates, from the llama-cpp-python sdist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMACPP = Path(os.environ.get("BRISK_LLAMACPP", REPO / ".venv" / "llama.cpp"))


def llamacpp_dir() -> Path:
    if not (LLAMACPP / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"llama.cpp's test material is not in {LLAMACPP}: run `make test` (or "
                           f"`python scripts/fetch_llamacpp.py {LLAMACPP}`)")
    return LLAMACPP


def convert_hf_to_gguf(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """Write `hf_dir` as a GGUF with llama.cpp's `convert_hf_to_gguf.py`, as a user would."""
    root = llamacpp_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "pydeps"), str(root / "gguf-py")])}
    done = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
                           "--outfile", str(out)], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{done.stderr[-3000:]}")
    return out


SPM_TRAINER = """
import sentencepiece as spm, sys
from transformers import AutoTokenizer
out, corpus = sys.argv[1], sys.argv[2]
spm.SentencePieceTrainer.train(input=corpus, model_prefix=out + "/tokenizer", vocab_size=int(sys.argv[3]),
    model_type="bpe", byte_fallback=True, character_coverage=1.0, add_dummy_prefix=sys.argv[4] == "1",
    pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
    unk_piece="<unk>", minloglevel=2)
import os; os.remove(out + "/tokenizer.vocab")
AutoTokenizer.from_pretrained(out).save_pretrained(out)
"""


def train_sentencepiece(out: Path, corpus: str, vocab_size: int = 1000, dummy_prefix: bool = False,
                        tokenizer_class: str = "GemmaTokenizer") -> Path:
    """A small SentencePiece BPE vocabulary (byte fallback) trained on `corpus`, saved as a model
    directory's `tokenizer.model` with transformers' own `tokenizer.json` made from it (sentencepiece
    runs from llama.cpp's separate target, as the converter does)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus.txt").write_text(corpus, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "%s", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", '
        '"unk_token": "<unk>", "add_bos_token": true}' % tokenizer_class)
    root = llamacpp_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "pydeps")}
    done = subprocess.run([sys.executable, "-c", SPM_TRAINER, str(out), str(out / "corpus.txt"), str(vocab_size),
                           "1" if dummy_prefix else "0"], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"training a SentencePiece vocabulary failed:\n{done.stderr[-3000:]}")
    (out / "corpus.txt").unlink()
    return out
