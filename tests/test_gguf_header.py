"""brisk.loading.gguf_header reads a GGUF's metadata as the `gguf` package does (the reference),
without the arrays' contents, in a fraction of the time."""

import pytest

from brisk.errors import ModelLoadError
from brisk.loading.gguf_convert import open_gguf, read_metadata
from brisk.loading.gguf_header import read_gguf_metadata
from brisk.models.registry import resolve


def test_same_metadata_as_the_gguf_package():
    path = resolve(None).path
    quick, reference = read_gguf_metadata(path), read_metadata(open_gguf(path))
    assert set(quick) == set(reference)
    for key, value in reference.items():
        if isinstance(value, list):
            assert len(quick[key]) == len(value), key  # arrays: the length only
        else:
            assert quick[key] == pytest.approx(value) if isinstance(value, float) else quick[key] == value, key
    assert len(quick["tokenizer.ggml.tokens"]) == 49152


def test_not_gguf_and_truncated_files_are_one_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf_metadata(bad)
    head = resolve(None).path.read_bytes()[:4096]  # the header and part of the vocabulary
    bad.write_bytes(head)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        read_gguf_metadata(bad)
