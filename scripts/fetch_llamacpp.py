#!/usr/bin/env python3
"""Fetch llama.cpp's own test material from the llama-cpp-python sdist on PyPI (a package registry,
like every other dependency; nothing comes from a model hub).

Unpacked from `vendor/llama.cpp/` into DEST (default .venv/llama.cpp):
- `convert_hf_to_gguf.py` with its `conversion/` and `gguf-py/`: the converter users run, which the
  tests use to write GGUFs of tiny transformers models;
- `models/ggml-vocab-*.gguf` with their `.inp`/`.out` tokenizer test vectors, and
  `models/templates/*.jinja`, real chat templates;
- with --all, the whole tree (to build `llama-server` and `llama-quantize` for the benchmarks).
`sentencepiece`, which the converter needs for SentencePiece vocabularies, is installed into
DEST/pydeps (a separate target: it is not a brisk dependency).

The sdist is pinned by version and SHA-256. llama.cpp is MIT-licensed (DEST/LICENSE).

    python scripts/fetch_llamacpp.py [DEST] [--all]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/", "LICENSE")
STAMP = ".brisk-fetched"


def sdist_url() -> str:
    """From the package index's JSON simple API (PEP 691), what pip itself reads."""
    request = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    for f in files:
        if f["filename"] == name:
            return f["url"]
    raise SystemExit(f"{name} is not on the package index")


def download() -> bytes:
    with urllib.request.urlopen(sdist_url(), timeout=600) as r:
        data = r.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"llama-cpp-python {VERSION} sdist: SHA-256 {digest}, expected {SHA256}; refusing it")
    return data


def unpack(data: bytes, dest: Path, everything: bool) -> None:
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            rel = m.name[len(prefix):]
            if rel and (everything or any(rel == p or rel.startswith(p) for p in PARTS)):
                m.name = rel
                members.append(m)
        tar.extractall(dest, members=members, filter="data")


def main() -> None:
    parser = argparse.ArgumentParser(description="fetch llama.cpp's converter, test vocabularies and templates")
    parser.add_argument("dest", nargs="?", default=".venv/llama.cpp", type=Path)
    parser.add_argument("--all", action="store_true", help="the whole llama.cpp tree (to build its programs)")
    args = parser.parse_args()
    stamp = args.dest / STAMP
    wanted = f"{VERSION} {'all' if args.all else 'parts'}"
    if stamp.is_file() and stamp.read_text() in (wanted, f"{VERSION} all"):
        return
    args.dest.mkdir(parents=True, exist_ok=True)
    unpack(download(), args.dest, args.all)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--upgrade", "--target",
                    str(args.dest / "pydeps"), "sentencepiece"], check=True)
    stamp.write_text(wanted)
    print(f"llama.cpp test material (llama-cpp-python {VERSION}) in {args.dest}")


if __name__ == "__main__":
    main()
